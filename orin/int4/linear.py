"""INT4 runtime modules on torch's own tinygemm kernels (no GPTQ library on the device), and the loader's protocol.

- ``Int4Linear`` replaces a quantized ``nn.Linear``; ``Int4Experts`` (orin.int4.experts) a fused MoE experts
  module. Both hold their GPTQ weights in torch's int4pack layout (orin.int4.pack: packing, reading back,
  dequantizing, the kernels); ``orin.checkpoint.targets.runtime_int4_bytes`` is what they hold.
- Routes: tinygemm is GEMV-shaped, fast for a few rows and far off a dense GEMM at hundreds. From the device
  profile's ``prefill.linear_dequant_min_rows`` rows an ``Int4Linear`` dequantizes its weight to the compute
  dtype and runs one dense GEMM (``"dense"``), below that tinygemm (``"tinygemm"``): ``route_for`` says which.
  ``Int4Experts`` runs on the MoE backend chosen when it is loaded (orin.int4.moe).

The loader's protocol (the model skeleton is built on the meta device):

1. ``convert_for_runtime(model, paths)`` swaps each quantized ``nn.Linear`` / fused experts module for an empty
   ``Int4Linear`` / ``Int4Experts`` shell; shells hold no tensors at all.
2. For each shell, ``load_int4_module(module, tensors, device, dtype, profile=...)`` where ``tensors`` maps the
   checkpoint keys *relative to the module path* (``int4_tensor_keys(module)`` lists them: ``qweight``... for a
   Linear, ``{e}.gate_proj.qweight``... for experts) to tensors. ``tensors`` may be a lazy Mapping over ``safe_open``:
   experts are read and converted a batch at a time (the profile's ``moe.load_batch_bytes``), so the transient
   memory is one batch's (one layer's for a Linear), and the result is written into its final buffer on
   ``device``. Passing tensors already on ``device`` makes the unpacking run there (fastest on the GPU). The
   profile (orin.device.profile; the CPU's by default) gives the modules their numbers and their kernels.
3. To swap a segment out, ``unload_int4_module(module)`` drops the buffers (or ``module.to(...)`` moves them;
   they run again once back on the device type they were packed for).

Buffers are non-persistent: ``state_dict()`` never mixes kernel layouts with checkpoint tensors.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint.gptq_format import GPTQ_KEYS
from ..device.profile import CPU, DeviceProfile
from ..errors import ModelError
from .experts import Int4Experts
from .moe import triton_runs
from .pack import check_device, dequantize_packed, int4_mm, to_kernel


class Int4Linear(nn.Module):
    """A GPTQ INT4 ``nn.Linear`` replacement: ``y = x @ W.T + b`` with W dequantized inside the kernel.

    Built empty (no tensors) by ``convert_for_runtime`` or ``Int4Linear(in, out, bias=...)``; filled by
    ``load_gptq_``. ``forward`` takes any leading dims, casts x to the compute dtype (bf16 on CUDA) and the
    result back to x's dtype.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.has_bias = bias
        # the loaders set these from the device profile: the dense route's first row count, and whether the
        # dequantizer is the Triton kernel
        self.dense_min_rows = CPU.prefill.linear_dequant_min_rows
        self.triton = False
        self.group_size: int | None = None
        self.kernel_group_size: int | None = None
        self.padded_in_features: int | None = None
        self.padded_out_features: int | None = None
        self.layout: str | None = None
        self.register_buffer("weight_packed", None, persistent=False)
        self.register_buffer("scales_and_zeros", None, persistent=False)
        self.register_buffer("bias", None, persistent=False)

    @property
    def is_loaded(self) -> bool:
        return self.weight_packed is not None

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The kernel's activation dtype: that of scales_and_zeros (``model.to(dtype)`` converts it)."""
        return None if self.scales_and_zeros is None else self.scales_and_zeros.dtype

    def tensor_keys(self) -> list[str]:
        """Checkpoint keys, relative to this module's path, that ``load_gptq_`` reads."""
        return list(GPTQ_KEYS) + (["bias"] if self.has_bias else [])

    @torch.no_grad()
    def load_gptq_(
        self,
        tensors: Mapping[str, torch.Tensor],
        device: torch.device | str,
        dtype: torch.dtype = torch.bfloat16,
        name: str = "layer",
        *,
        profile: DeviceProfile = CPU,
    ) -> Int4Linear:
        """Fill this module from the GPTQ v1 tensors of one layer (``name`` is its path, for error messages).

        ``dtype`` is the compute dtype (bf16, fp16 or fp32 on CPU; always bf16 on CUDA, the kernel's only one).
        On failure (ModelError naming the tensor) the module is left empty.
        """
        device = torch.device(device)
        self.unload_()  # never hold the old and the new buffers at once
        if self.has_bias and "bias" not in tensors:
            raise ModelError(f"{name}.bias missing from the checkpoint; re-run orin-omni quantize")
        kw = to_kernel(tensors, self.in_features, device, dtype, name, profile.memory.cpu_convert_chunk_rows)
        if kw.N != self.out_features:
            raise ModelError(
                f"{name}: checkpoint has {kw.N} outputs, the model's Linear {self.out_features}; it does not match this model"
            )
        self.weight_packed = kw.weight
        self.scales_and_zeros = kw.scales_and_zeros
        self.group_size, self.kernel_group_size = kw.group, kw.kernel_group
        self.padded_in_features, self.padded_out_features = kw.K_run, kw.N_pad
        self._loaded(device, profile)
        # a private copy: the tensor given may be a view of a larger block read (orin.memory.block_reader)
        self.bias = tensors["bias"].to(device=device, dtype=self.compute_dtype, copy=True) if self.has_bias else None
        return self

    def _loaded(self, device: torch.device, profile: DeviceProfile) -> None:
        self.layout = device.type
        self.dense_min_rows = profile.prefill.linear_dequant_min_rows
        self.triton = triton_runs(profile, device)

    def unload_(self) -> None:
        """Drop the packed buffers (the module becomes an empty shell again)."""
        self.weight_packed = self.scales_and_zeros = self.bias = None

    def packed_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(the kernel-layout buffers, what else they need to run): what `load_packed_` takes back
        (orin.memory.packed_cache keeps them so a later load skips the conversion)."""
        check_device(self.weight_packed, self.layout, "Int4Linear")
        tensors = {"weight_packed": self.weight_packed, "scales_and_zeros": self.scales_and_zeros}
        if self.bias is not None:
            tensors["bias"] = self.bias
        return tensors, {"group_size": self.group_size, "kernel_group_size": self.kernel_group_size,
                         "padded_in_features": self.padded_in_features,
                         "padded_out_features": self.padded_out_features}

    @torch.no_grad()
    def load_packed_(self, tensors: Mapping[str, torch.Tensor], meta: Mapping, device: torch.device | str,
                     name: str = "layer", *, profile: DeviceProfile = CPU) -> Int4Linear:
        """Take `packed_state`'s buffers as they are (already in `device`'s kernel layout: no conversion)."""
        device = torch.device(device)
        self.unload_()
        try:
            weight, sz = tensors["weight_packed"], tensors["scales_and_zeros"]
            padded_in, padded_out = int(meta["padded_in_features"]), int(meta["padded_out_features"])
            group, kernel_group = int(meta["group_size"]), int(meta["kernel_group_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelError(f"{name}: the packed copy lacks {exc}") from exc
        if (padded_out < self.out_features or padded_in < self.in_features or sz.shape[-2] != padded_out
                or sz.shape[0] * kernel_group != padded_in or (self.has_bias != ("bias" in tensors))
                or weight.device.type != device.type):
            raise ModelError(f"{name}: the packed copy does not fit this model's Linear ({self.in_features} -> "
                             f"{self.out_features})")
        self.weight_packed, self.scales_and_zeros = weight, sz
        self.bias = tensors.get("bias")
        self.group_size, self.kernel_group_size = group, kernel_group
        self.padded_in_features, self.padded_out_features = padded_in, padded_out
        self._loaded(device, profile)
        return self

    @classmethod
    def from_gptq(
        cls,
        tensors: Mapping[str, torch.Tensor],
        in_features: int,
        device: torch.device | str,
        dtype: torch.dtype = torch.bfloat16,
        name: str = "layer",
        *,
        profile: DeviceProfile = CPU,
    ) -> Int4Linear:
        module = cls(in_features, tensors["qweight"].shape[1], bias="bias" in tensors)
        return module.load_gptq_(tensors, device, dtype, name, profile=profile)

    def route_for(self, rows: int) -> str:
        """The route forward takes for this many rows: "dense" (dequantize + one dense GEMM) or "tinygemm"."""
        return "dense" if rows >= self.dense_min_rows else "tinygemm"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_device(self.weight_packed, self.layout, "Int4Linear")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        chosen = self.route_for(x2.shape[0])
        if x2.dtype != self.compute_dtype:
            x2 = x2.to(self.compute_dtype)
        if self.padded_in_features > self.in_features:
            x2 = F.pad(x2, (0, self.padded_in_features - self.in_features))
        bias = self.bias
        if chosen == "dense":
            w = dequantize_packed(self.weight_packed, self.scales_and_zeros, self.kernel_group_size, self.triton)
            if self.padded_out_features == self.out_features and (bias is None or bias.dtype == w.dtype):
                y, bias = F.linear(x2, w, bias), None  # the bias in the GEMM's epilogue: one launch less
            else:
                y = F.linear(x2, w)
        else:
            y = int4_mm(x2.contiguous(), self.weight_packed, self.kernel_group_size, self.scales_and_zeros)
        if self.padded_out_features > self.out_features:
            y = y[:, : self.out_features]
        if bias is not None:
            y = y + bias
        return y.reshape(*lead, self.out_features).to(x.dtype)

    @torch.no_grad()
    def dequantized_weight(self, chunk: int = 512) -> torch.Tensor:
        """The float32 weight [out, in] the kernel actually uses, read back by multiplying identity blocks."""
        check_device(self.weight_packed, self.layout, "Int4Linear")
        K, dev = self.padded_in_features, self.weight_packed.device
        cols = []
        for k0 in range(0, self.in_features, chunk):
            k1 = min(k0 + chunk, self.in_features)
            eye = torch.zeros(k1 - k0, K, dtype=self.compute_dtype, device=dev)
            rows = torch.arange(k1 - k0, device=dev)
            eye[rows, rows + k0] = 1
            cols.append(int4_mm(eye, self.weight_packed, self.kernel_group_size, self.scales_and_zeros).float())
        return torch.cat(cols)[:, : self.out_features].t().contiguous()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.has_bias}, "
            f"group_size={self.group_size}, loaded={self.is_loaded}, layout={self.layout}"
        )


# ---------------------------------------------------------------- the loader's protocol


def _is_fused_experts(module: nn.Module) -> bool:
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, torch.Tensor)
        and isinstance(down, torch.Tensor)
        and gate_up.dim() == 3
        and down.dim() == 3
        and hasattr(module, "act_fn")
    )


def convert_for_runtime(model: nn.Module, quantized: Iterable[str]) -> dict[str, nn.Module]:
    """Replace, in place, each module named in ``quantized`` with an empty INT4 shell (no allocation).

    ``nn.Linear`` -> ``Int4Linear``; a fused experts module (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I],
    ``act_fn``) -> ``Int4Experts`` sharing its ``act_fn``. Returns {path: shell} for the loader.
    """
    shells: dict[str, nn.Module] = {}
    for path in sorted(set(quantized)):
        try:
            old = model.get_submodule(path)
        except AttributeError as exc:
            raise ModelError(
                f"quantized module {path!r} does not exist in the model; the checkpoint does not match it"
            ) from exc
        if isinstance(old, nn.Linear):
            new: nn.Module = Int4Linear(old.in_features, old.out_features, bias=old.bias is not None)
        elif _is_fused_experts(old):
            E, two_i, H = old.gate_up_proj.shape
            new = Int4Experts(E, H, two_i // 2, old.act_fn)
        else:
            raise ModelError(
                f"quantized module {path!r} is a {type(old).__name__}, not a Linear or fused experts module"
            )
        parent_path, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, child, new)
        shells[path] = new
    return shells


def load_int4_module(
    module: nn.Module,
    tensors: Mapping[str, torch.Tensor],
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    name: str = "layer",
    *,
    profile: DeviceProfile = CPU,
) -> nn.Module:
    """Fill an INT4 shell from its checkpoint tensors (keys relative to the module path, see ``int4_tensor_keys``),
    to run as `profile` (orin.device.profile) says."""
    if isinstance(module, (Int4Linear, Int4Experts)):
        return module.load_gptq_(tensors, device, dtype, name=name, profile=profile)
    raise TypeError(f"{name} is a {type(module).__name__}, not an INT4 module")


def unload_int4_module(module: nn.Module) -> None:
    """Free an INT4 module's buffers; it can be loaded again later."""
    module.unload_()


def int4_tensor_keys(module: nn.Module) -> list[str]:
    """The checkpoint keys (relative to the module's path) that ``load_int4_module`` reads for this shell."""
    return module.tensor_keys()


_EXPERT_CHILD = re.compile(r"^(?P<experts>(?:.+\.)?experts)\.\d+\.(?:gate_proj|up_proj|down_proj)$")


def quantized_module_paths(keys: Iterable[str]) -> set[str]:
    """Module paths to hand to ``convert_for_runtime`` from checkpoint keys: every ``P.qweight`` gives P, and
    GPTQModel's defused ``X.experts.{e}.{gate,up,down}_proj`` collapse to the fused module ``X.experts``."""
    paths = set()
    for key in keys:
        if key.endswith(".qweight"):
            path = key[: -len(".qweight")]
            m = _EXPERT_CHILD.match(path)
            paths.add(m.group("experts") if m else path)
    return paths


# The runtime's public face: the loader, orin.runtime.layer and the devtools import these from here (the layout
# and the dequantizer live in orin.int4.pack, the MoE's kernels in orin.int4.moe).
__all__ = [
    "Int4Experts",
    "Int4Linear",
    "convert_for_runtime",
    "dequantize_packed",
    "int4_tensor_keys",
    "load_int4_module",
    "quantized_module_paths",
    "unload_int4_module",
]
