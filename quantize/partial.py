"""A quantize run's partial state, so a killed run resumes at the layer it was in, not at the start of its segment.

    OUT/.partial/run.json                       the key of everything the state depends on (see `run_key`)
    OUT/.partial/passes/                        the BF16 passes' results: every stack's first-layer calls,
                                                the report's BF16 references, the calibration record
    OUT/.partial/<segment>/<stack>/layer-NNNNN/ one finished layer: its GPTQ tensors (gptq.safetensors), the
                                                stack's report figures so far (state.json) and, for the latest
                                                layer only, the next layer's input hidden states

Every directory is written under a temporary name (`.name.tmp`), its files synced, then renamed into place: a
directory under its own name is whole, and a temporary one (a killed run's) is deleted when the next run
starts. A state written under another key (other weights, settings, calibration data, code versions or device)
is deleted, not used. The segment's directory goes once its shard is written; the whole of `.partial` once
every requested segment is.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from orin.fsutil import publish_dir

from .activations import CallStore, Placement, Spilled, StackData

PARTIAL = ".partial"
_LAYER = "layer-{:05d}"


def run_key(parts: dict) -> str:
    """sha256 of `parts` (JSON): what makes a partial state valid for this run."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def inputs_digest(samples) -> str:
    """sha256 over the calibration samples' names and every tensor of their model inputs: the calibration data
    as the model sees it."""
    digest = hashlib.sha256()
    for s in samples:
        digest.update(f"{s.name}|{s.index}|{s.heldout}".encode())
        for inputs in (s.inputs, s.prompt_inputs):
            for key in sorted(inputs):
                value = inputs[key]
                digest.update(key.encode())
                if isinstance(value, torch.Tensor):
                    t = value.detach().cpu().contiguous()
                    digest.update(f"{t.dtype}{tuple(t.shape)}".encode())
                    digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
                else:
                    digest.update(repr(value).encode())
    return digest.hexdigest()


def _digest(name: str) -> str:
    """A file name for a conversation's name (file:line, builtin:N)."""
    return hashlib.sha256(name.encode()).hexdigest()[:16]


@dataclass
class PassState:
    data: dict  # stack -> StackData
    thinker_refs: dict
    talker_refs: dict
    calibration: dict
    samples: list[str]  # the conversations left after the thinker pass (the report's measures run on these)


class PartialState:
    """OUT/.partial for one run key (see the module docstring)."""

    def __init__(self, out: Path, key: str, placement: Placement, log=None):
        self.root = Path(out) / PARTIAL
        self.key = key
        self.placement = placement
        self.log = log or (lambda _m: None)
        found = _read_json(self.root / "run.json")
        if found is not None and found.get("key") != key:
            self.log("note: discarding the partial state of an earlier run with other weights, settings, "
                     "calibration data or versions")
            shutil.rmtree(self.root)
        self.root.mkdir(parents=True, exist_ok=True)
        for tmp in self.root.rglob(".*.tmp"):  # a killed run's half-written directories
            if tmp.is_dir():
                shutil.rmtree(tmp, ignore_errors=True)
        if found is None or found.get("key") != key:
            _write_json(self.root / "run.json", {"key": key})

    # ------------------------------------------------------------------ the passes

    @property
    def passes_tmp(self) -> Path:
        return self.root / ".passes.tmp"

    def new_data(self, stack: str) -> StackData:
        """An empty StackData for the passes to fill (its files, when on disk, in the pass state to be)."""
        return StackData(self.placement, self.passes_tmp / stack)

    def keep_logits(self, name: str, logits: torch.Tensor):
        """A held-out conversation's BF16 logits as the passes keep them: spilled into the pass state to be when
        activations live on disk (they are [tokens, vocab]: 0.3 MB a token at the real vocabulary)."""
        if self.placement.where != "disk":
            return logits
        path = self.passes_tmp / "refs" / f"logits-{_digest(name)}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(logits, path)
        return Spilled(path)

    def save_passes(self, state: PassState, thinker_refs: bool, talker_refs: bool) -> None:
        """Write the passes' results; `thinker_refs`/`talker_refs`: whether they include those references."""
        tmp = self.passes_tmp
        tmp.mkdir(parents=True, exist_ok=True)
        rows = {}
        for stack, data in state.data.items():
            for stream in ("calib", "heldout"):
                store: CallStore = getattr(data, stream)
                store.save_fixed(tmp / stack / stream)
                store.save_hidden(tmp / stack / stream)
                rows[f"{stack}/{stream}"] = store.row_counts()
        thinker = {}
        for name, out in state.thinker_refs.items():
            logits = f"refs/logits-{_digest(name)}.pt"
            if not isinstance(out.logits, Spilled):
                (tmp / "refs").mkdir(exist_ok=True)
                torch.save(out.logits, tmp / logits)
            thinker[name] = {"logits": logits, "vision": out.vision, "audio": out.audio}
        torch.save({"thinker": thinker,
                    "talker": {n: (vars(seq), codes) for n, (seq, codes) in state.talker_refs.items()}},
                   tmp / "refs.pt")
        _write_json(tmp / "info.json", {"key": self.key, "rows": rows, "calibration": state.calibration,
                                        "samples": state.samples, "stacks": sorted(state.data),
                                        "refs": {"thinker": thinker_refs, "talker": talker_refs}})
        publish_dir(tmp, self.root / "passes")
        for name, out in state.thinker_refs.items():
            if isinstance(out.logits, Spilled):
                out.logits = Spilled(self.root / "passes" / thinker[name]["logits"])
        for stack, data in state.data.items():
            for stream in ("calib", "heldout"):
                where = self.root / "passes" / stack / stream
                getattr(data, stream).relocate(where, where)

    def load_passes(self, stacks: set[str], thinker_refs: bool, talker_refs: bool) -> PassState | None:
        """The saved pass state, if it holds every stack in `stacks` and the references asked for. (Which other
        stacks were captured beside them changes nothing in theirs: a run resumed for its last segment reads the
        passes of the run that did them all.)"""
        from .capture import ThinkerOutputs
        from .speech_capture import TalkerSequence

        root = self.root / "passes"
        info = _read_json(root / "info.json")
        if info is None or info.get("key") != self.key or not stacks <= set(info["stacks"]):
            return None
        if (thinker_refs and not info["refs"]["thinker"]) or (talker_refs and not info["refs"]["talker"]):
            return None
        data = {}
        for stack in info["stacks"]:
            d = StackData(self.placement)
            for stream in ("calib", "heldout"):
                where = root / stack / stream
                setattr(d, stream, CallStore.load(self.placement, where, where, info["rows"][f"{stack}/{stream}"]))
            data[stack] = d
        refs = torch.load(root / "refs.pt", weights_only=True, map_location="cpu")
        device = self.placement.device
        thinker = {}
        for name, out in refs["thinker"].items():
            path = root / out["logits"]
            logits = Spilled(path) if self.placement.where == "disk" else Spilled(path).load()
            thinker[name] = ThinkerOutputs(logits, out["vision"], out["audio"])
        talker = {n: (TalkerSequence(seq["inputs_embeds"].to(device), seq["position_ids"].to(device),
                                     seq["prompt_len"]), codes)
                  for n, (seq, codes) in refs["talker"].items()}
        return PassState(data, thinker, talker, info["calibration"], info["samples"])

    # ------------------------------------------------------------------ layers

    def checkpoints(self, segment: str) -> StackCheckpoints:
        return StackCheckpoints(self.root / segment, self.root / "passes", self.key, self.placement)

    def drop_segment(self, segment: str) -> None:
        shutil.rmtree(self.root / segment, ignore_errors=True)

    def clear(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class StackCheckpoints:
    """The finished layers of one segment's stacks (see the module docstring)."""

    def __init__(self, root: Path, passes: Path, key: str, placement: Placement):
        self.root = root
        self.passes = passes
        self.key = key
        self.placement = placement

    def _layers(self, stack: str) -> list[Path]:
        where = self.root / stack
        if not where.is_dir():
            return []
        return sorted(p for p in where.iterdir() if p.is_dir() and p.name.startswith("layer-"))

    def resume(self, stack: str):
        """(next layer, the stack's figures so far, calibration calls, held-out calls) from the latest finished
        layer, or None to start at layer 0."""
        layers = self._layers(stack)
        if not layers:
            return None
        latest = layers[-1]
        state = _read_json(latest / "state.json")
        if state is None or state.get("key") != self.key:
            return None
        stores = []
        for stream in ("calib", "heldout"):
            rows = state["rows"].get(stream)
            stores.append(None if rows is None else CallStore.load(
                self.placement, self.passes / stack / stream, latest / stream, rows))
        return state["next"], state["result"], stores[0], stores[1]

    def layer_dir(self, stack: str, index: int) -> Path:
        """The temporary directory of layer `index` (its next-layer inputs go there while it runs)."""
        tmp = self.root / stack / f".{_LAYER.format(index)}.tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        return tmp

    def commit(self, stack: str, index: int, result, calib: CallStore | None, heldout: CallStore | None):
        """Record layer `index` finished: its GPTQ tensors (taken out of `result`), the figures so far and the next
        layer's inputs; returns the stores pointed at their files."""
        from safetensors.torch import save_file

        tmp = self.layer_dir(stack, index)
        save_file({k: t.contiguous() for k, t in result.tensors.items()}, str(tmp / "gptq.safetensors"),
                  metadata={"format": "pt"})
        result.tensors.clear()
        rows = {}
        for stream, store in (("calib", calib), ("heldout", heldout)):
            if store is not None:
                store.save_hidden(tmp / stream)
                rows[stream] = store.row_counts()
        _write_json(tmp / "state.json", {"key": self.key, "next": index + 1, "result": result.state(),
                                         "rows": rows})
        final = self.root / stack / _LAYER.format(index)
        publish_dir(tmp, final)
        for older in self._layers(stack):
            if older != final:
                for stream in ("calib", "heldout"):
                    shutil.rmtree(older / stream, ignore_errors=True)
        for stream, store in (("calib", calib), ("heldout", heldout)):
            if store is not None:
                store.relocate(hidden_dir=final / stream)
        return calib, heldout

    def gptq_files(self, stack: str) -> list[Path]:
        return [p / "gptq.safetensors" for p in self._layers(stack)]


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _write_json(path: Path, data: dict) -> None:
    from orin.fsutil import atomic_write_json

    atomic_write_json(path, data)
