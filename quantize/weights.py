"""The BF16 model in bounded memory: a skeleton of transformers' model whose parameters live on the meta device,
filled one module at a time from the checkpoint's safetensors files and emptied again.

The skeleton is `Qwen3OmniMoeForConditionalGeneration` built under orin.memory.skeleton.params_on_meta: its buffers
(rotary frequencies, code2wav's code offsets) are real and equal to what from_pretrained gives, its parameters
are shapes only. `Residency.load(prefix)` reads the module's tensors from the source checkpoint (hub names mapped
to transformers 5.23's, per-expert weights stacked into the fused expert tensors, floats cast to BF16 as
from_pretrained(dtype=bfloat16) casts them) straight onto the device, through orin.memory.block_reader's staging buffers:
no copy of the file is ever held in host memory. `release(prefix)` puts the parameters back on meta.

With `quantized=True` a module's INT4 targets that this run has already quantized come from their GPTQ tensors
(`QuantizedStore`), dequantized exactly as the GPTQ pass wrote them back into the live model; the rest of the module
(norms, routers, biases) still comes from the source.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from orin.checkpoint.hub_names import expert_part, to_hub, to_runtime
from orin.errors import ModelError


def build_skeleton(config) -> nn.Module:
    """transformers' model for `config` with every parameter on meta (BF16) and every buffer real."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from orin.memory.skeleton import params_on_meta

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # what from_pretrained(dtype=bfloat16) builds the modules under
    try:
        with params_on_meta():
            model = Qwen3OmniMoeForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(before)
    return model.eval()


def source_files(model_dir: Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index names, else every *.safetensors."""
    import json

    from orin.checkpoint.files import INDEX_NAME

    index = model_dir / INDEX_NAME
    if index.is_file():
        try:
            names = dict.fromkeys(json.loads(index.read_text())["weight_map"].values())
        except (OSError, KeyError, TypeError, AttributeError, json.JSONDecodeError) as exc:
            raise ModelError(f"{index}: not a readable safetensors index ({exc}); restore it from the checkpoint") \
                from exc
        files = [model_dir / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ModelError(f"{model_dir}: {missing[0]}, named by {INDEX_NAME}, is missing; download the whole "
                             "checkpoint")
        return files
    return sorted(model_dir.glob("*.safetensors"))


@dataclass(frozen=True)
class _Part:
    file: str
    key: str
    order: tuple[int, int] = (0, 0)  # (expert, half) within a fused experts tensor


class SourceWeights:
    """Where each runtime parameter of the source checkpoint lies: one tensor, or (fused experts) one per expert
    and projection in stacking order."""

    def __init__(self, model_dir: Path):
        from orin.checkpoint.files import read_header

        self.model_dir = model_dir
        self.parts: dict[str, list[_Part]] = {}
        self.stored: dict[str, tuple[str, tuple[int, ...]]] = {}  # file key -> (dtype, shape)
        for path in source_files(model_dir):
            for key, info in read_header(path).items():
                runtime = to_runtime(key)
                part = expert_part(runtime)
                name = part.fused if part else runtime
                self.parts.setdefault(name, []).append(
                    _Part(str(path), key, (part.expert, part.half) if part else (0, 0)))
                self.stored[key] = (info["dtype"], tuple(info["shape"]))
        for parts in self.parts.values():
            parts.sort(key=lambda p: p.order)

    def check_covers(self, skeleton: nn.Module) -> None:
        """Refuse a checkpoint that lacks one of the model's parameters (from_pretrained would initialise it
        randomly and quantize noise)."""
        missing = [n for n, _ in skeleton.named_parameters() if n not in self.parts]
        if missing:
            raise ModelError(f"{self.model_dir}: the checkpoint has no weights for {len(missing)} parameter(s) of the "
                             f"model (e.g. {to_hub(missing[0])}); download the whole checkpoint")

    def read_part(self, part: _Part, dtype: torch.dtype) -> torch.Tensor:
        """One stored tensor in host memory, floats cast to `dtype` (copying a BF16 weight into a shard)."""
        from orin.memory.block_reader import BlockReader

        tensor = BlockReader(Path(part.file), torch.device("cpu")).read([part.key], max_gap=0)[part.key]
        return tensor.to(dtype) if tensor.is_floating_point() and tensor.dtype != dtype else tensor

    def read(self, names: list[str], device: torch.device, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The named runtime parameters on `device`, in the dtype of `like[name]` (the skeleton's meta tensors),
        with their shapes checked. Fused experts are read one tensor at a time (one staging of the per-expert
        weights, then the fused copy), so a thinker layer never needs twice its size."""
        from orin.memory.block_reader import BlockReader

        out: dict[str, torch.Tensor] = {}
        plain = [n for n in names if len(self.parts[n]) == 1 and expert_part(to_runtime(self.parts[n][0].key)) is None]
        for group in [plain] + [[n] for n in names if n not in plain]:
            by_file: dict[str, list[str]] = {}
            for name in group:
                for part in self.parts[name]:
                    by_file.setdefault(part.file, []).append(part.key)
            read: dict[str, torch.Tensor] = {}
            for path, keys in by_file.items():
                # no gaps read along: a parameter is a view of its block, and would keep the bytes of tensors
                # between (another group's experts) alive as long as it is loaded
                read.update(BlockReader(Path(path), device).read(keys, max_gap=0))
            for name in group:
                tensors = [read.pop(p.key) for p in self.parts[name]]
                out[name] = _assemble(name, tensors, like[name])
        return out


def _assemble(name: str, parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    if len(parts) == 1 and not name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
        tensor = parts[0]
    elif name.endswith(".gate_up_proj"):
        # [gate_0, up_0, gate_1, ...] stacked is [gate_0; up_0], [gate_1; up_1], ... viewed per expert: one copy
        # beside the parts (concatenating each pair first made a third)
        tensor = torch.stack(parts).view(len(parts) // 2, -1, *parts[0].shape[1:])
    else:
        tensor = torch.stack(parts)
    if tuple(tensor.shape) != tuple(like.shape):
        raise ModelError(f"{to_hub(name)}: the checkpoint's tensor has shape {tuple(tensor.shape)}, the model's "
                         f"config wants {tuple(like.shape)}; the weights do not belong to this config.json")
    if tensor.is_floating_point() and tensor.dtype != like.dtype:
        tensor = tensor.to(like.dtype)
    return tensor


# ---------------------------------------------------------------------- this run's GPTQ results


@dataclass
class QuantizedStore:
    """Where this run's GPTQ tensors of each quantized module lie: target path -> (file, key prefix of its
    tensors there, hub names or not). A module quantized in this run is loaded dequantized from them wherever
    the model runs after its stack was quantized (the report's end-to-end measures), as the in-memory model
    carried its quantized weights."""

    targets: dict[str, tuple[str, bool]] = field(default_factory=dict)  # path -> (file, hub)

    def add(self, path: str, file: Path, hub: bool = False) -> None:
        self.targets[path] = (str(file), hub)

    def __contains__(self, path: str) -> bool:
        return path in self.targets

    def dequantized(self, target, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """{param name relative to the target: dequantized weight} exactly as the GPTQ pass wrote them: the weight
        of a Linear, or the fused gate_up_proj and down_proj of an experts module."""
        from safetensors import safe_open

        from orin.checkpoint.gptq_format import GPTQ_KEYS

        from .gptq import QuantResult

        file, hub = self.targets[target.path]
        with safe_open(file, framework="pt", device=str(device)) as f:
            def weight(prefix: str, K: int) -> torch.Tensor:
                key = to_hub(prefix) if hub else prefix
                packed = {k: f.get_tensor(f"{key}.{k}") for k in GPTQ_KEYS}
                return QuantResult.unpack(packed, K).dequantize().to(dtype)

            if target.kind == "linear":
                return {"weight": weight(target.path, target.in_features)}
            E, H, inter = target.num_experts, target.in_features, target.intermediate
            gate_up = torch.empty((E, 2 * inter, H), dtype=dtype, device=device)
            down = torch.empty((E, target.out_features, inter), dtype=dtype, device=device)
            for e in range(E):
                gate_up[e, :inter] = weight(f"{target.path}.{e}.gate_proj", H)
                gate_up[e, inter:] = weight(f"{target.path}.{e}.up_proj", H)
                down[e] = weight(f"{target.path}.{e}.down_proj", inter)
        return {"gate_up_proj": gate_up, "down_proj": down}


# ---------------------------------------------------------------------- residency


class Residency:
    """Which modules of the skeleton hold real weights, and their bytes on the device."""

    def __init__(self, skeleton: nn.Module, source: SourceWeights, device: torch.device, targets: list,
                 meter=None):
        self.model = skeleton
        self.source = source
        self.device = device
        self.quantized = QuantizedStore()
        self.meter = meter
        self._targets = {t.path: t for t in targets}
        self._meta = {n: p for n, p in skeleton.named_parameters()}  # the shapes and dtypes, kept for release
        self._loaded: dict[str, bool] = {}  # param name -> loaded quantized (True) or BF16 (False)
        for module in skeleton.modules():  # the buffers are real and small: they live on the device throughout
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.device != device:
                    module._buffers[name] = buffer.to(device)

    def _names(self, prefix: str) -> list[str]:
        dotted = prefix + "."
        names = [n for n in self._meta if n.startswith(dotted)]
        if not names:
            raise ModelError(f"the model has no parameters under {prefix}; quantize's adapters do not match this "
                             "checkpoint's layout")
        return names

    def _replaced(self, names: list[str]) -> dict[str, tuple[object, str]]:
        """Param name -> (target, attribute) for the params of `names` a quantized target of this run replaces."""
        out = {}
        for path, target in self._targets.items():
            if path not in self.quantized:
                continue
            attrs = ("weight",) if target.kind == "linear" else ("gate_up_proj", "down_proj")
            for attr in attrs:
                if f"{path}.{attr}" in names:
                    out[f"{path}.{attr}"] = (target, attr)
        return out

    def load(self, *prefixes: str, quantized: bool = False) -> None:
        """Give the modules under `prefixes` their weights: BF16 from the source or, with quantized, this run's
        dequantized GPTQ weights where their stack is done. A parameter already loaded the same way stays."""
        names = [n for p in prefixes for n in self._names(p)]
        replaced = self._replaced(names) if quantized else {}
        want = [n for n in names if self._loaded.get(n) != (n in replaced)]
        if not want:
            return
        timer = self.meter.stage("load") if self.meter is not None else contextlib.nullcontext()
        with timer, torch.no_grad():
            tensors = self.source.read([n for n in want if n not in replaced], self.device, self._meta)
            done_targets: dict[str, dict] = {}
            for name in (n for n in want if n in replaced):
                target, attr = replaced[name]
                if target.path not in done_targets:
                    done_targets[target.path] = self.quantized.dequantized(target, self.device,
                                                                           self._meta[name].dtype)
                tensors[name] = done_targets[target.path][attr]
            for name in want:
                self._assign(name, tensors.pop(name))
                self._loaded[name] = name in replaced

    def release(self, *prefixes: str) -> None:
        for prefix in prefixes:
            for name in self._names(prefix):
                if name in self._loaded:
                    self._assign(name, self._meta[name])
                    del self._loaded[name]

    def release_all(self) -> None:
        for name in list(self._loaded):
            self._assign(name, self._meta[name])
        self._loaded.clear()

    @contextlib.contextmanager
    def loaded(self, *prefixes: str, quantized: bool = False) -> Iterator[None]:
        self.load(*prefixes, quantized=quantized)
        try:
            yield
        finally:
            self.release(*prefixes)

    def _assign(self, name: str, tensor: torch.Tensor) -> None:
        owner, _, attr = name.rpartition(".")
        module = self.model.get_submodule(owner)
        module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)

    @property
    def loaded_bytes(self) -> int:
        return sum(self._meta[n].numel() * self._meta[n].element_size() for n in self._loaded)


def module_bytes(skeleton: nn.Module, prefix: str) -> int:
    """BF16 bytes of the parameters under `prefix` (the skeleton's shapes: nothing is read)."""
    dotted = prefix + "."
    return sum(p.numel() * p.element_size() for n, p in skeleton.named_parameters() if n.startswith(dotted))
