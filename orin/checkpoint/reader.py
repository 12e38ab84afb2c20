"""A quantized checkpoint as the loader sees it: which tensors of which file make each component's parameters
and INT4 modules, under the runtime's names (orin.model.omni's tree, transformers 5.23's names).

Three kinds of directory are read:
- orin-omni's own (manifest.json, schema 2): the standard GPTQ layout of orin.checkpoint.files, one shard per
  segment, every file verified against the manifest's sha256 first;
- orin-omni 0.1's (manifest schema 1: per-segment directories, runtime names, zero-padded inputs): still read;
  `orin-omni convert` rewrites it in the standard layout for other tools;
- a GPTQ checkpoint written by another tool (no manifest.json: config.json with a GPTQ quantization_config,
  model.safetensors or an index of shards): the thinker quantized and the rest BF16, or the talker quantized
  too. Per-expert BF16 weights are fused and hub names mapped at load time; nothing is verified (there are no
  recorded checksums), which is logged.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .. import components as C
from ..errors import ModelError
from .hub_names import expert_part, to_runtime

log = logging.getLogger("orin.checkpoint.reader")

_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.(gate|up|down)_proj$")
_GPTQ_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx")


def int4_module_of(key: str) -> str | None:
    """The INT4 module a checkpoint key belongs to (GPTQ tensors), or None for a plain tensor. Works on hub and
    runtime names alike; a per-expert Linear's tensors belong to the fused experts module."""
    for suffix in _GPTQ_SUFFIXES:
        if key.endswith(suffix):
            module = key[: -len(suffix)]
            match = _EXPERT.match(module)
            return match.group(1) if match else module
    return None


@dataclass
class Int4Source:
    """One INT4 module's tensors in one file: the module's name there and its keys."""

    file_prefix: str
    keys: list[str] = field(default_factory=list)


@dataclass
class Source:
    """One safetensors file's tensors of one component. `plain` maps a runtime parameter name to the file keys
    it is made of: one key, or every expert's weight of a fused experts tensor (in stacking order)."""

    path: Path
    plain: dict[str, list[str]] = field(default_factory=dict)
    int4_modules: dict[str, Int4Source] = field(default_factory=dict)

    @contextlib.contextmanager
    def open(self, device) -> Iterator:
        from safetensors import safe_open

        try:
            with safe_open(str(self.path), framework="pt", device=str(device)) as reader:
                yield reader
        except OSError as exc:
            raise ModelError(f"{self.path}: cannot read ({exc})") from exc


@dataclass
class Checkpoint:
    root: Path
    config: object
    manifest: object  # orin.checkpoint.manifest.Manifest, synthesized for a checkpoint of another tool
    by_component: dict[str, list[Source]]
    quantized_modules: set[str]
    foreign: bool = False

    def sources(self, component: str) -> list[Source]:
        return self.by_component.get(component, [])

    @property
    def name(self) -> str:
        """The model id recorded at quantize time, not the directory's name: copies of one checkpoint under
        other paths answer to the same model= as the README's clients use."""
        return self.manifest.model_name

    @property
    def spec(self):
        return self.manifest.quant_spec()

    @property
    def split(self) -> dict[str, tuple[str, ...]]:
        return self.manifest.segment_split()

    @classmethod
    def open(cls, model_dir: str | Path, verify: bool = True) -> Checkpoint:
        from ..model.config import load_omni_config
        from .manifest import read_manifest, verify_files

        root = Path(model_dir)
        if not root.is_dir():
            raise ModelError(f"{root}: no such directory; give the --out directory of orin-omni quantize")
        foreign = not (root / "manifest.json").is_file()
        if foreign:
            manifest, files = _foreign_manifest(root), _foreign_files(root)
        else:
            manifest = read_manifest(root)
            if manifest.schema_version == 1:
                log.warning("%s: an orin-omni 0.1 checkpoint; it loads as it is, but for the standard GPTQ layout "
                            "that vLLM and transformers read run: orin-omni convert %s --out NEW", root, root)
            if verify:
                verify_files(root, manifest)
            files = manifest.safetensors_files()
        config = load_omni_config(root)
        by_component: dict[str, list[Source]] = {}
        quantized: set[str] = set()
        for rel in files:
            for comp, src in _index_file(root / rel).items():
                by_component.setdefault(comp, []).append(src)
                quantized.update(src.int4_modules)
        absent = [c for c in C.NAMES if c not in by_component]
        if absent:
            hint = ("quantize every segment (orin-omni quantize without --segments) before serving" if not foreign
                    else "this checkpoint lacks them; orin-omni needs every Qwen3-Omni component (speech included)")
            raise ModelError(f"{root}: the checkpoint has no tensors for {', '.join(absent)}; {hint}")
        return cls(root, config, manifest, by_component, quantized, foreign)


def _index_file(file: Path) -> dict[str, Source]:
    """Group one safetensors file's keys by component, under runtime names."""
    from .files import read_header

    per_comp: dict[str, Source] = {}
    for key in read_header(file):
        runtime = to_runtime(key)
        comp = C.component_of(runtime)
        if comp is None:
            raise ModelError(f"{file}: tensor {key} belongs to no Qwen3-Omni component")
        src = per_comp.setdefault(comp, Source(file))
        module = int4_module_of(key)
        if module is not None:
            src.int4_modules.setdefault(to_runtime(module), Int4Source(module)).keys.append(key)
            continue
        part = expert_part(runtime)
        src.plain.setdefault(part.fused if part else runtime, []).append(key)
    for src in per_comp.values():
        for keys in src.plain.values():
            if len(keys) > 1:
                keys.sort(key=lambda k: _expert_order(to_runtime(k)))
        # An INT4 Linear's bias is stored beside its GPTQ tensors and loaded with them.
        for name in [n for n in src.plain if n.endswith(".bias") and n[:-5] in src.int4_modules]:
            src.int4_modules[name[:-5]].keys.extend(src.plain.pop(name))
    return per_comp


def _expert_order(runtime_key: str) -> tuple[int, int]:
    part = expert_part(runtime_key)
    return (part.expert, part.half) if part else (0, 0)


def _foreign_files(root: Path) -> list[str]:
    from .files import INDEX_NAME

    index = root / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ModelError(f"{index}: not a readable safetensors index ({exc})") from exc
        files = list(dict.fromkeys(weight_map.values()))
    elif (root / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ModelError(f"{root}: no manifest.json, {INDEX_NAME} or model.safetensors; give the --out directory of "
                         f"orin-omni quantize, or a GPTQ checkpoint directory. To make one: orin-omni quantize {root} "
                         "--out DIR")
    for rel in files:
        if Path(rel).is_absolute() or ".." in Path(rel).parts or not (root / rel).is_file():
            raise ModelError(f"{root}: shard {rel!r} named by the index is missing or outside the directory")
    return files


def _foreign_manifest(root: Path):
    """A manifest for a GPTQ checkpoint of another tool, from its config.json's quantization_config: what the
    planner and the engine need (bits, group size, symmetry, the default split, a model id)."""
    from ..model.config_file import read_config_dict
    from .manifest import Manifest, default_served_name
    from .targets import QuantSpec

    if not (root / "config.json").is_file():
        raise ModelError(f"{root}: no manifest.json and no config.json; this is not a checkpoint. Give the --out "
                         f"directory of orin-omni quantize (or a GPTQ checkpoint directory)")
    data = read_config_dict(root)
    q = data.get("quantization_config")
    if not isinstance(q, dict) or str(q.get("quant_method", "")).lower() != "gptq":
        raise ModelError(f"{root}: no manifest.json and config.json has no GPTQ quantization_config; orin-omni runs "
                         f"GPTQ INT4 checkpoints. Quantize this one: orin-omni quantize {root} --out DIR")
    if q.get("bits") != 4:
        raise ModelError(f"{root}: a {q.get('bits')}-bit GPTQ checkpoint; orin-omni's kernels run 4-bit only")
    if q.get("desc_act"):
        raise ModelError(f"{root}: quantized with desc_act (act-order), which the INT4 runtime cannot run; "
                         "re-quantize with desc_act false (orin-omni quantize does)")
    fmt = str(q.get("checkpoint_format") or q.get("format") or "gptq").lower()
    if fmt != "gptq":
        raise ModelError(f"{root}: GPTQ checkpoint_format {fmt!r}; orin-omni reads the v1 'gptq' format (GPTQModel "
                         "writes it when saving with format='gptq')")
    group = q.get("group_size")
    if not isinstance(group, int) or group <= 0:
        raise ModelError(f"{root}: quantization_config.group_size {group!r}; orin-omni needs a positive group size")
    spec = QuantSpec(bits=4, group_size=group, sym=bool(q.get("sym", True)))
    log.warning("%s: a GPTQ checkpoint without an orin-omni manifest; no checksums to verify", root)
    return Manifest(tool_version="", created_at="", source={"model_dir": str(root)},
                    quantization={**spec.describe(), "spec": asdict(spec), "foreign": True},
                    split=dict(C.DEFAULT_SEGMENTS), shared_files=(), segments={},
                    served_model_name=default_served_name(4))
