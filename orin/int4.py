"""INT4 runtime modules on torch's own tinygemm kernels (no GPTQ library on the device).

Kernels and the constraints found in torch 2.13 (CPU) / the CUDA source of ``int4mm.cu``:

- CUDA: ``aten._weight_int4pack_mm(x, w, group, scales_and_zeros)``: x bfloat16 only, contiguous [M, K];
  ``w`` from ``aten._convert_weight_to_int4pack(uint8 [N, K/2], inner_k_tiles)`` where byte ``[n, j]`` holds
  ``q[n, 2j] << 4 | q[n, 2j+1]``; inner_k_tiles in {2, 4, 8} and K % (16 * inner_k_tiles) == 0; N % 8 == 0;
  needs sm80+ (the Orin is sm87). scales_and_zeros bfloat16.
- CPU: ``aten._weight_int4pack_mm_for_cpu`` with ``aten._convert_weight_to_int4pack_for_cpu(int32 [N, K], 1)``
  -> uint8 [N, K/2] in a layout blocked by N (64-row blocks when N % 64 == 0); x bf16, fp16 or fp32 (contiguous),
  scales_and_zeros in the same dtype as x; N % 16 == 0, K % 2 == 0, K % group == 0.
- Both: group in {32, 64, 128, 256}; ``scales_and_zeros`` [K/group, N, 2]; the kernel dequantizes
  ``w = (q - 8) * scale + zero``, so a GPTQ zero point z becomes ``zero = scale * (8 - z)``.

Prefill (many rows at once) does not go through tinygemm: that kernel is GEMV-shaped, fast for a few rows and
far off a dense GEMM at hundreds, and one launch per expert made the MoE prefill launch-bound (12k launches for
467 tokens). From ``LINEAR_DEQUANT_MIN_ROWS`` rows an ``Int4Linear`` dequantizes its weight to the compute dtype
and runs one dense GEMM; from ``GROUPED_MIN_ROWS_PER_EXPERT`` rows per expert an ``Int4Experts`` runs all its
rows as one grouped GEMM: on CUDA with Triton, ``orin.int4_triton``'s kernel, which dequantizes the packed tiles
in registers (weights read once, at 0.5 byte each); elsewhere, experts dequantized a chunk of at most
``orin.plan.PREFILL_DEQUANT_CHUNK`` bytes at a time and ``torch._grouped_mm``. Dequantizing reads the packed
layout directly: on CUDA by the layout of ``int4mm.cu``'s ``matrix_to_m16n8k16_Bint4_layout`` (``_codes_cuda``,
checked once per process against the real converter; the Triton kernels read the same layout); on CPU, whose
layout depends on the ISA, by an order found by converting probe matrices (``_cpu_order``).

So at load time a GPTQ layer (see orin.gptq_format) is turned into: codes padded to K_run = groups * g (zero
activations feed the padding) and N_pad = N rounded up to 16 (extra outputs sliced off), a kernel group that
divides g (scales repeated when g > 256), and the device's packed layout. The packed layout differs between CPU
and CUDA: a module loaded for one cannot run on the other (``forward`` says so instead of computing garbage).

The loader's protocol (the model skeleton is built on the meta device):

1. ``convert_for_runtime(model, paths)`` swaps each quantized ``nn.Linear`` / fused experts module for an empty
   ``Int4Linear`` / ``Int4Experts`` shell; shells hold no tensors at all.
2. For each shell, ``load_int4_module(module, tensors, device, dtype)`` where ``tensors`` maps the checkpoint keys
   *relative to the module path* (``int4_tensor_keys(module)`` lists them: ``qweight``... for a Linear,
   ``{e}.gate_proj.qweight``... for experts) to tensors. ``tensors`` may be a lazy Mapping over ``safe_open``:
   experts read one expert at a time, so the transient memory is one expert's (one layer's for a Linear), and the
   result is written straight into its final buffer on ``device``. Passing tensors already on ``device`` makes the
   unpacking run there (fastest on the GPU).
3. To swap a segment out, ``unload_int4_module(module)`` drops the buffers (or ``module.to(...)`` moves them;
   they run again once back on the device type they were packed for).

Buffers are non-persistent: ``state_dict()`` never mixes kernel layouts with checkpoint tensors.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
import re
import sys
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from orin.errors import ModelError
from orin.gptq_format import GPTQ_KEYS, check_in_features, decode_qzeros_v1, gptq_v1_geometry
from orin.plan import PREFILL_DEQUANT_CHUNK

log = logging.getLogger("orin.int4")

KERNEL_GROUP_SIZES = (256, 128, 64, 32)
N_ALIGN = 16
# Rows converted at once on CPU, bounding the int32 [rows, K] transient; a multiple of the CPU kernel's 64-row block.
CPU_CONVERT_CHUNK_ROWS = 4096
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
# Rows from which an Int4Linear runs as dequantize + dense GEMM instead of tinygemm (prefill, encoders), and
# rows per expert (on average) from which an Int4Experts runs as dequantized chunks + grouped GEMMs. The module
# runs eagerly, where launching the Triton dequantizer costs ~40 us of host time: below 256 rows tinygemm's
# one launch wins (the real vision encoder, 196 rows: 32.5 ms against 48.5 ms, BENCHMARKS.md). Inside a CUDA
# graph only device time counts: orin.fastdecode's prefill dequantizes from GRAPH_DEQUANT_MIN_ROWS.
LINEAR_DEQUANT_MIN_ROWS = 256
GRAPH_DEQUANT_MIN_ROWS = 64
GROUPED_MIN_ROWS_PER_EXPERT = 1


@functools.cache
def triton_available() -> bool:
    """Whether orin.int4_triton's kernels can run here: Triton installed (CUDA builds of torch bring it) and a
    CUDA device."""
    return importlib.util.find_spec("triton") is not None and torch.cuda.is_available()


def kernel_group_size(g: int) -> int:
    """The largest kernel group size dividing the checkpoint's group size g (scales repeat g/kg times)."""
    for kg in KERNEL_GROUP_SIZES:
        if g % kg == 0:
            return kg
    raise ModelError(f"group size {g} is not a multiple of 32; the INT4 kernels need 32, 64, 128 or 256 — re-quantize")


def _layout_for(device: torch.device) -> str:
    if device.type not in ("cpu", "cuda"):
        raise ModelError(f"INT4 modules run on cpu or cuda, not {device}")
    return device.type


def _compute_dtype(layout: str, dtype: torch.dtype) -> torch.dtype:
    if layout == "cuda":
        return torch.bfloat16  # the CUDA tinygemm kernel takes bf16 activations only
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"INT4 modules compute in bf16, fp16 or fp32, not {dtype}")
    return dtype


def _inner_k_tiles(K: int) -> int:
    for tiles in (8, 4, 2):
        if K % (16 * tiles) == 0:
            return tiles
    raise ModelError(f"padded in_features {K} is not a multiple of 32")


def _cuda_codes_bytes(qweight: torch.Tensor) -> torch.Tensor:
    """qweight int32 [K/8, N] -> uint8 [N, K/2] with byte [n, j] = q[n,2j] << 4 | q[n,2j+1] (CUDA's input).

    A little-endian int32 word's byte b holds codes 2b (low nibble) and 2b+1 (high): a nibble swap suffices,
    with 0.5 byte per weight of transient memory.
    """
    if sys.byteorder != "little":
        raise RuntimeError("the INT4 CUDA repacking assumes a little-endian host")
    b = qweight.t().contiguous().view(torch.uint8)
    high = b >> 4
    return b.bitwise_and_(0x0F).bitwise_left_shift_(4).bitwise_or_(high)


def _convert_cpu_codes(codes: torch.Tensor) -> torch.Tensor:
    """int32 codes [N, K] -> the CPU kernel's uint8 [N, K/2] (its layout is blocked by rows: row blocks convert
    alone, see _convert_cpu)."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)


def _convert_cpu(qweight: torch.Tensor) -> torch.Tensor:
    """qweight int32 [K/8, N] -> the CPU kernel's uint8 [N, K/2], converting row blocks to bound the transient."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device).view(1, 8, 1)
    N = qweight.shape[1]
    step = CPU_CONVERT_CHUNK_ROWS if N % 64 == 0 else N
    parts = []
    for n0 in range(0, N, step):
        words = qweight[:, n0 : n0 + step]
        codes = ((words.unsqueeze(1) >> shifts) & 0xF).reshape(-1, words.shape[1]).t().contiguous()
        parts.append(_convert_cpu_codes(codes))
        del codes
    return parts[0] if len(parts) == 1 else torch.cat(parts)


# ---------------------------------------------------------------- reading the packed layouts back


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """A packed tensor's 4-bit fields in storage order (byte by byte, low nibble first) as uint8, last dim x2
    per byte: int32 [..., J] -> [..., 8J], uint8 [..., B] -> [..., 2B]."""
    if sys.byteorder != "little":
        raise RuntimeError("reading the INT4 packed layouts assumes a little-endian host")
    b = packed.view(torch.uint8)
    return torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)


def _codes_cuda(packed: torch.Tensor) -> torch.Tensor:
    """CUDA int4pack [..., N/8, K/(16*tiles), 32, tiles/2] int32 -> codes [..., N, K] uint8.

    From ``matrix_to_m16n8k16_Bint4_layout``: lane t of an 8-row n-tile holds row ``t // 4``; word j of a
    k-super-tile holds two 16-wide k-tiles; its nibble s = 4h + 2a + b holds column
    ``32j + 16a + 8b + 2(t % 4) + h`` of the super-tile (h: the even or odd column of a byte pair).
    """
    *lead, NT, KO, lanes, J = packed.shape
    q = _nibbles(packed).view(*lead, NT, KO, 8, 4, J, 2, 2, 2)  # ..., n-tile, k-super, tn, tk, j, h, a, b
    d = len(lead)
    order = [*range(d)] + [d + i for i in (0, 2, 1, 4, 6, 7, 3, 5)]  # -> n-tile, tn, k-super, j, a, b, tk, h
    return q.permute(order).reshape(*lead, NT * 8, KO * J * 32)


_CPU_ORDER: dict[tuple[int, int], torch.Tensor] = {}


def _cpu_order(N: int, K: int) -> torch.Tensor:
    """For the CPU layout of an [N, K] matrix: the storage position of each (n, k), flattened (int64 [N*K]).

    The CPU kernel's layout depends on the ISA it was built for, so instead of transcribing it, probe it:
    convert matrices whose codes are the hex digits of each element's index and read the digits back.
    """
    key = (N, K)
    if key not in _CPU_ORDER:
        index = torch.arange(N * K, dtype=torch.int64)
        source = torch.zeros(N * K, dtype=torch.int64)
        for d in range(max(1, math.ceil(math.log2(N * K) / 4))):
            probe = ((index >> (4 * d)) & 0xF).to(torch.int32).view(N, K)
            source |= _nibbles(_convert_cpu_codes(probe)).reshape(-1).long() << (4 * d)
        order = torch.full((N * K,), -1, dtype=torch.int64)
        order[source] = index
        if (order < 0).any():
            raise RuntimeError("the CPU int4pack conversion is not a permutation of the codes; orin.int4 cannot read it")
        _CPU_ORDER[key] = order
    return _CPU_ORDER[key]


def unpack_codes(packed: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """The 4-bit codes [..., N, K] (uint8) of packed kernel weights [..., *packed_shape] of either layout."""
    if packed.dtype == torch.int32:  # the CUDA layout (the CPU kernel's is uint8)
        return _codes_cuda(packed)
    lead = packed.shape[:-2]
    flat = _nibbles(packed).reshape(*lead, N * K)
    return flat.index_select(-1, _cpu_order(N, K).to(packed.device)).view(*lead, N, K)


def _dequantize(packed: torch.Tensor, scales_and_zeros: torch.Tensor, kernel_group: int) -> torch.Tensor:
    """Packed weights [..., *] + scales_and_zeros [..., K/group, N, 2] -> the kernel's weight [..., N, K] in the
    scales' dtype: ``(q - 8) * scale + zero``, computed in float32 and rounded once."""
    G, N = scales_and_zeros.shape[-3], scales_and_zeros.shape[-2]
    K = G * kernel_group
    q = unpack_codes(packed, N, K)
    lead = q.shape[:-2]
    sz = scales_and_zeros.float().transpose(-3, -2).unsqueeze(-2)  # [..., N, G, 1, 2]
    w = (q.view(*lead, N, G, kernel_group).float() - 8.0) * sz[..., 0] + sz[..., 1]
    return w.to(scales_and_zeros.dtype).view(*lead, N, K)


class _Dequantizer:
    """``_dequantize`` as one Triton kernel on CUDA (``orin.int4_triton.dequantize``: bandwidth-speed, where the
    torch ops make ~8 passes over the weights), the torch ops elsewhere. A Triton failure falls back to the torch
    ops for the rest of the process."""

    def __init__(self) -> None:
        self.error: str | None = None
        self._checked: set[tuple] = set()

    def _check_cuda_layout(self, packed: torch.Tensor) -> None:
        """Once per device and tile count: read back a converted random matrix (guards against a torch whose
        int4pack layout differs from the one ``_codes_cuda`` and the Triton kernels read)."""
        tiles = packed.shape[-1] * 2
        key = (packed.device, tiles)
        if key in self._checked:
            return
        K = 16 * tiles * 2
        codes = torch.randint(0, 16, (16, K), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
        pairs = codes.to(torch.uint8).view(16, K // 2, 2)
        bytes_ = (pairs[..., 0] << 4) | pairs[..., 1]
        converted = torch.ops.aten._convert_weight_to_int4pack(bytes_.to(packed.device).contiguous(), tiles)
        if not torch.equal(_codes_cuda(converted).cpu().int(), codes):
            raise ModelError(
                "this torch build's CUDA int4pack layout is not the one orin.int4 reads; prefill cannot "
                "dequantize INT4 weights — report the torch version"
            )
        self._checked.add(key)

    def __call__(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, kernel_group: int) -> torch.Tensor:
        if packed.is_cuda:
            self._check_cuda_layout(packed)
            if self.error is None and triton_available():
                from orin import int4_triton

                try:
                    return int4_triton.dequantize(packed, scales_and_zeros, kernel_group)
                except Exception as exc:  # noqa: BLE001 - a kernel that cannot build must not stop inference
                    self.error = f"{type(exc).__name__}: {exc}"[:500]
                    log.warning("the Triton INT4 dequantization failed (%s); using torch ops", exc)
        return _dequantize(packed, scales_and_zeros, kernel_group)


dequantize_packed = _Dequantizer()


class _FusedGemm:
    """``orin.int4_triton.grouped_int4_mm`` where it can run (CUDA, Triton, bf16, 4 inner k-tiles); a kernel
    failure disables it for the process and the callers fall back to dequantized chunks."""

    def __init__(self) -> None:
        self.error: str | None = None

    def usable(self, x: torch.Tensor, packed: torch.Tensor) -> bool:
        if not (self.error is None and x.is_cuda and triton_available()):
            return False
        from orin import int4_triton

        dequantize_packed._check_cuda_layout(packed)
        return int4_triton.supports(packed)

    def __call__(self, x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, kernel_group: int,
                 ends: torch.Tensor, max_rows: int, x_ordered: bool = False) -> torch.Tensor:
        from orin import int4_triton

        try:
            return int4_triton.grouped_int4_mm(x, packed, scales_and_zeros, kernel_group, ends, max_rows, x_ordered)
        except Exception as exc:  # noqa: BLE001 - re-raised for the caller's fallback, after switching off
            self.error = f"{type(exc).__name__}: {exc}"[:500]
            log.warning("the Triton INT4 GEMM failed (%s); it is off for this process", exc)
            raise


fused_gemm = _FusedGemm()


class _KernelWeight:
    """One layer in kernel form: packed weight, scales_and_zeros, kernel group, K_run and N_pad."""

    def __init__(
        self, weight: torch.Tensor, scales_and_zeros: torch.Tensor, kernel_group: int, group: int, K_run: int, N: int
    ):
        self.weight = weight
        self.scales_and_zeros = scales_and_zeros
        self.kernel_group = kernel_group
        self.group = group
        self.K_run = K_run
        self.N = N
        self.N_pad = scales_and_zeros.shape[1]


def _to_kernel(
    tensors: Mapping[str, torch.Tensor], in_features: int, device: torch.device, dtype: torch.dtype, name: str
) -> _KernelWeight:
    """GPTQ v1 tensors of one layer -> kernel form on ``device`` (transient: the layer's codes, on ``device``)."""
    layout = _layout_for(device)
    gptq = {k: tensors[k].to(device) for k in GPTQ_KEYS if k in tensors}
    K_pack, N, groups, g = gptq_v1_geometry(gptq, name)
    check_in_features(K_pack, g, in_features, name)
    qweight, scales, zeros_int = gptq["qweight"], gptq["scales"], decode_qzeros_v1(gptq["qzeros"])
    K_run = groups * g
    N_pad = -(-N // N_ALIGN) * N_ALIGN
    kg = kernel_group_size(g)
    # Padded input rows hold code 0 (their activations are zero); padded outputs have scale 0 and are sliced off.
    if N_pad > N or K_run > K_pack:
        qweight = F.pad(qweight, (0, N_pad - N, 0, (K_run - K_pack) // 8))
    if layout == "cuda":
        weight = torch.ops.aten._convert_weight_to_int4pack(_cuda_codes_bytes(qweight), _inner_k_tiles(K_run))
    else:
        weight = _convert_cpu(qweight)
    del qweight
    s = F.pad(scales.float(), (0, N_pad - N))
    z = F.pad(zeros_int.float(), (0, N_pad - N), value=8.0)
    sz = torch.stack([s, s * (8.0 - z)], dim=-1)
    if g != kg:
        sz = sz.repeat_interleave(g // kg, dim=0)
    sz = sz.to(_compute_dtype(layout, dtype)).contiguous()
    return _KernelWeight(weight, sz, kg, g, K_run, N)


def _int4_mm(x2: torch.Tensor, weight: torch.Tensor, kernel_group: int, sz: torch.Tensor) -> torch.Tensor:
    if x2.is_cuda:
        return torch.ops.aten._weight_int4pack_mm(x2, weight, kernel_group, sz)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, weight, kernel_group, sz)


def _check_device(tensor: torch.Tensor | None, layout: str | None, what: str) -> None:
    if tensor is None:
        raise RuntimeError(f"{what} is not loaded: call load_int4_module() on it first")
    if tensor.device.type != layout:
        raise RuntimeError(
            f"{what} was packed for {layout} but its buffers are on {tensor.device}; the packed layouts differ, "
            f"reload it with load_int4_module(..., device='{tensor.device.type}')"
        )


def int4_linear_runtime_bytes(K: int, N: int, g: int, *, bias: bool, dtype: torch.dtype = torch.bfloat16) -> int:
    """Device bytes one loaded Int4Linear holds (padded layout: K_run = K rounded up to g), for the planner."""
    K_run = -(-K // g) * g
    N_pad = -(-N // N_ALIGN) * N_ALIGN
    item = torch.empty((), dtype=dtype).element_size()
    total = N_pad * K_run // 2 + (K_run // kernel_group_size(g)) * N_pad * 2 * item
    return total + (N * item if bias else 0)


def int4_experts_runtime_bytes(
    num_experts: int, hidden: int, intermediate: int, g: int, *, dtype: torch.dtype = torch.bfloat16
) -> int:
    """Device bytes one loaded Int4Experts holds (fused gate+up [2I x H] and down [H x I] per expert)."""
    per_expert = int4_linear_runtime_bytes(hidden, 2 * intermediate, g, bias=False, dtype=dtype)
    per_expert += int4_linear_runtime_bytes(intermediate, hidden, g, bias=False, dtype=dtype)
    return num_experts * per_expert


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
    ) -> Int4Linear:
        """Fill this module from the GPTQ v1 tensors of one layer (``name`` is its path, for error messages).

        ``dtype`` is the compute dtype (bf16, fp16 or fp32 on CPU; always bf16 on CUDA, the kernel's only one).
        On failure (ModelError naming the tensor) the module is left empty.
        """
        device = torch.device(device)
        self.unload_()  # never hold the old and the new buffers at once
        if self.has_bias and "bias" not in tensors:
            raise ModelError(f"{name}.bias missing from the checkpoint; re-run orin-omni quantize")
        kw = _to_kernel(tensors, self.in_features, device, dtype, name)
        if kw.N != self.out_features:
            raise ModelError(
                f"{name}: checkpoint has {kw.N} outputs, the model's Linear {self.out_features}; it does not match this model"
            )
        self.weight_packed = kw.weight
        self.scales_and_zeros = kw.scales_and_zeros
        self.group_size, self.kernel_group_size = kw.group, kw.kernel_group
        self.padded_in_features, self.padded_out_features = kw.K_run, kw.N_pad
        self.layout = device.type
        self.bias = tensors["bias"].to(device=device, dtype=self.compute_dtype) if self.has_bias else None
        return self

    def unload_(self) -> None:
        """Drop the packed buffers (the module becomes an empty shell again)."""
        self.weight_packed = self.scales_and_zeros = self.bias = None

    @classmethod
    def from_gptq(
        cls,
        tensors: Mapping[str, torch.Tensor],
        in_features: int,
        device: torch.device | str,
        dtype: torch.dtype = torch.bfloat16,
        name: str = "layer",
    ) -> Int4Linear:
        module = cls(in_features, tensors["qweight"].shape[1], bias="bias" in tensors)
        return module.load_gptq_(tensors, device, dtype, name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_device(self.weight_packed, self.layout, "Int4Linear")
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != self.compute_dtype:
            x2 = x2.to(self.compute_dtype)
        if self.padded_in_features > self.in_features:
            x2 = F.pad(x2, (0, self.padded_in_features - self.in_features))
        bias = self.bias
        if x2.shape[0] >= LINEAR_DEQUANT_MIN_ROWS:
            w = dequantize_packed(self.weight_packed, self.scales_and_zeros, self.kernel_group_size)
            if self.padded_out_features == self.out_features and (bias is None or bias.dtype == w.dtype):
                y, bias = F.linear(x2, w, bias), None  # the bias in the GEMM's epilogue: one launch less
            else:
                y = F.linear(x2, w)
        else:
            y = _int4_mm(x2.contiguous(), self.weight_packed, self.kernel_group_size, self.scales_and_zeros)
        if self.padded_out_features > self.out_features:
            y = y[:, : self.out_features]
        if bias is not None:
            y = y + bias
        return y.reshape(*lead, self.out_features).to(x.dtype)

    @torch.no_grad()
    def dequantized_weight(self, chunk: int = 512) -> torch.Tensor:
        """The float32 weight [out, in] the kernel actually uses, read back by multiplying identity blocks."""
        _check_device(self.weight_packed, self.layout, "Int4Linear")
        K, dev = self.padded_in_features, self.weight_packed.device
        cols = []
        for k0 in range(0, self.in_features, chunk):
            k1 = min(k0 + chunk, self.in_features)
            eye = torch.zeros(k1 - k0, K, dtype=self.compute_dtype, device=dev)
            rows = torch.arange(k1 - k0, device=dev)
            eye[rows, rows + k0] = 1
            cols.append(_int4_mm(eye, self.weight_packed, self.kernel_group_size, self.scales_and_zeros).float())
        return torch.cat(cols)[:, : self.out_features].t().contiguous()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.has_bias}, "
            f"group_size={self.group_size}, loaded={self.is_loaded}, layout={self.layout}"
        )


def _expert_tensors(source, e: int, proj: str, prefix: str) -> Mapping[str, torch.Tensor]:
    if isinstance(source, Sequence):
        return source[e].get(proj, {})
    return _Prefixed(source, f"{prefix}{e}.{proj}.")


class _Prefixed(Mapping):
    """A read-only view of ``source`` keyed without ``prefix``; lookups stay lazy (one tensor at a time)."""

    def __init__(self, source: Mapping[str, torch.Tensor], prefix: str) -> None:
        self._source, self._prefix = source, prefix

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._source[self._prefix + key]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and (self._prefix + key) in self._source

    def __iter__(self):
        n = len(self._prefix)
        return (k[n:] for k in self._source if k.startswith(self._prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _fuse_gate_up(
    gate: Mapping[str, torch.Tensor], up: Mapping[str, torch.Tensor], device: torch.device, name: str
) -> dict:
    """One GPTQ layer [K=H, N=2I] from gate_proj and up_proj (gate outputs first, as HF's gate_up_proj)."""
    fused = {}
    for key in GPTQ_KEYS:
        if key not in gate or key not in up:
            raise ModelError(
                f"{name}: {key} of gate_proj/up_proj missing from the checkpoint; re-run orin-omni quantize"
            )
        a, b = gate[key].to(device), up[key].to(device)
        if key == "g_idx" and not torch.equal(a, b):
            raise ModelError(f"{name}: gate_proj and up_proj were quantized with different group layouts; re-quantize")
        fused[key] = a if key == "g_idx" else torch.cat([a, b], dim=1)
    return fused


class Int4Experts(nn.Module):
    """INT4 replacement of HF's fused experts (Qwen3OmniMoe{Thinker,Talker}TextExperts).

    Same call as the module it replaces: ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])
    -> [T, H]``, same math (``down(act(gate(x)) * up(x)) * weight`` summed over the chosen experts; an index equal to
    ``num_experts`` is skipped like HF). Tokens are grouped per expert with one sort; gate and up are one fused
    matmul. A few rows (decode) run tinygemm for each expert the router picked, after one host sync for the
    per-expert counts. From ``GROUPED_MIN_ROWS_PER_EXPERT`` rows per expert (prefill) all rows run as one
    grouped GEMM per projection: the Triton kernel on CUDA (no host sync), else dequantized chunks of experts
    and ``torch._grouped_mm``.
    """

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, act_fn: nn.Module) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.act_fn = act_fn
        self.layout: str | None = None
        self.group_size: int | None = None
        self._geom: dict[str, tuple[int, int, int]] = {}  # proj -> (kernel group, K_run, N_pad)
        self._views: tuple[tuple[torch.Tensor, ...], ...] | None = None
        for buf in ("gate_up_packed", "gate_up_scales_and_zeros", "down_packed", "down_scales_and_zeros"):
            self.register_buffer(buf, None, persistent=False)

    @property
    def is_loaded(self) -> bool:
        return self.down_packed is not None

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The kernel's activation dtype: that of the scales_and_zeros buffers (``model.to(dtype)`` converts them)."""
        return None if self.down_scales_and_zeros is None else self.down_scales_and_zeros.dtype

    def tensor_keys(self) -> list[str]:
        """Checkpoint keys, relative to this module's path (GPTQModel's defused layout ``{e}.gate_proj.qweight``)."""
        return [f"{e}.{p}.{k}" for e in range(self.num_experts) for p in EXPERT_PROJS for k in GPTQ_KEYS]

    @torch.no_grad()
    def load_gptq_(
        self,
        source: Sequence[Mapping[str, Mapping[str, torch.Tensor]]] | Mapping[str, torch.Tensor],
        device: torch.device | str,
        dtype: torch.dtype = torch.bfloat16,
        name: str = "experts",
        prefix: str = "",
    ) -> Int4Experts:
        """Fill from per-expert GPTQ tensors: ``source[e]['gate_proj'|'up_proj'|'down_proj'] -> {qweight, ...}``,
        or a flat mapping with keys ``f"{prefix}{e}.gate_proj.qweight"`` (lazy mappings are read one expert at a
        time; each expert is converted on ``device`` and copied into its slot of the stacked buffers)."""
        device = torch.device(device)
        self.unload_()  # never hold the old and the new buffers at once
        E = self.num_experts
        if isinstance(source, Sequence) and len(source) != E:
            raise ModelError(f"{name}: {len(source)} experts given, the model has {E}")
        stacks: dict[str, torch.Tensor] = {}
        for e in range(E):
            ename = f"{name}.{e}"
            parts = {p: _expert_tensors(source, e, p, prefix) for p in EXPERT_PROJS}
            for p in EXPERT_PROJS:
                if "qweight" not in parts[p]:
                    raise ModelError(f"{ename}.{p}.qweight missing from the checkpoint; re-run orin-omni quantize")
            gate_up = _to_kernel(
                _fuse_gate_up(parts["gate_proj"], parts["up_proj"], device, ename),
                self.hidden_dim,
                device,
                dtype,
                f"{ename}.gate_up",
            )
            down = _to_kernel(parts["down_proj"], self.intermediate_dim, device, dtype, f"{ename}.down_proj")
            if gate_up.N != 2 * self.intermediate_dim or down.N != self.hidden_dim:
                raise ModelError(
                    f"{ename}: expert output sizes in the checkpoint do not match the model's (H={self.hidden_dim}, I={self.intermediate_dim})"
                )
            for key, kw in (("gate_up", gate_up), ("down", down)):
                geom = (kw.kernel_group, kw.K_run, kw.N_pad)
                if e == 0:
                    self._geom[key] = geom
                    stacks[f"{key}_packed"] = torch.empty((E, *kw.weight.shape), dtype=kw.weight.dtype, device=device)
                    stacks[f"{key}_scales_and_zeros"] = torch.empty(
                        (E, *kw.scales_and_zeros.shape), dtype=kw.scales_and_zeros.dtype, device=device
                    )
                elif self._geom[key] != geom:
                    raise ModelError(f"{ename}: quantized with a different group size than expert 0; re-quantize")
                stacks[f"{key}_packed"][e].copy_(kw.weight)
                stacks[f"{key}_scales_and_zeros"][e].copy_(kw.scales_and_zeros)
            self.group_size = gate_up.group
            del gate_up, down, parts
        for key, value in stacks.items():
            setattr(self, key, value)
        self._views = None
        self.layout = device.type
        return self

    def unload_(self) -> None:
        """Drop the packed buffers (the module becomes an empty shell again)."""
        self.gate_up_packed = self.gate_up_scales_and_zeros = self.down_packed = self.down_scales_and_zeros = None
        self._views = None

    @classmethod
    def from_gptq(
        cls,
        source: Sequence[Mapping[str, Mapping[str, torch.Tensor]]] | Mapping[str, torch.Tensor],
        *,
        num_experts: int,
        hidden_dim: int,
        intermediate_dim: int,
        act_fn: nn.Module,
        device: torch.device | str,
        dtype: torch.dtype = torch.bfloat16,
        prefix: str = "",
        name: str = "experts",
    ) -> Int4Experts:
        module = cls(num_experts, hidden_dim, intermediate_dim, act_fn)
        return module.load_gptq_(source, device, dtype, name=name, prefix=prefix)

    def _apply(self, fn, recurse=True):
        self._views = None  # .to()/.cuda() replace the buffers: drop views of the old ones
        return super()._apply(fn, recurse)

    def _expert_views(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        """Per-expert views of the stacked buffers, made once per load: indexing per call costs host time."""
        if self._views is None:
            self._views = tuple(
                t.unbind(0)
                for t in (
                    self.gate_up_packed,
                    self.gate_up_scales_and_zeros,
                    self.down_packed,
                    self.down_scales_and_zeros,
                )
            )
        return self._views

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        _check_device(self.down_packed, self.layout, "Int4Experts")
        T, k = top_k_index.shape
        E = self.num_experts
        grouped = T * k >= GROUPED_MIN_ROWS_PER_EXPERT * E
        if T and self.fused(hidden_states, k):
            try:
                return self._forward_fused(hidden_states, top_k_index, top_k_weights)
            except Exception:  # noqa: BLE001 - the kernel's own failure (recorded, and it is now off) falls back
                if fused_gemm.error is None:
                    raise
        final = torch.zeros_like(hidden_states)
        if T == 0:
            return final
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # indices >= num_experts sort last and are skipped
        counts_dev = torch.bincount(flat.clamp(max=E), minlength=E + 1)[:E]
        counts = counts_dev.tolist()  # the one host sync
        rows = sum(counts)
        if rows == 0:
            return final
        order = order[:rows]
        token = order // k
        x = self._rows(hidden_states, token)
        # Every expert's rows are a contiguous slice of the sorted batch, so padding, activation and joins run
        # once over all rows; only the matmuls are per expert (decode) or per chunk of experts (prefill).
        if grouped:
            ends = torch.cumsum(counts_dev, 0)
            gate_up = self._grouped(x, self.gate_up_packed, self.gate_up_scales_and_zeros, self._geom["gate_up"][0],
                                    counts, ends)
        else:
            gate_up = self._per_expert(x, 0, self._geom["gate_up"][0], counts)
        h = self._act(gate_up)
        if grouped:
            out = self._grouped(h, self.down_packed, self.down_scales_and_zeros, self._geom["down"][0], counts, ends)
        else:
            out = self._per_expert(h, 2, self._geom["down"][0], counts)
        weights = top_k_weights.reshape(-1)[order]
        return self._combine(final, out, weights, token)

    def fused(self, hidden_states: torch.Tensor, k: int) -> bool:
        """Whether forward takes the fused path for these rows, k experts each: the one without a host sync,
        which a CUDA graph can capture."""
        return (hidden_states.shape[0] * k >= GROUPED_MIN_ROWS_PER_EXPERT * self.num_experts
                and fused_gemm.usable(hidden_states, self.gate_up_packed)
                and fused_gemm.usable(hidden_states, self.down_packed))

    def _forward_fused(self, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        """Prefill on CUDA: one Triton launch per projection over all experts, group boundaries on the device
        (no host sync, so the host queues the next layers while this one runs)."""
        E, (T, k) = self.num_experts, top_k_index.shape
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        # counted by scatter_add: bincount on CUDA syncs with the host to size its output
        counts = torch.zeros(E + 1, dtype=torch.long, device=flat.device)
        counts.scatter_add_(0, flat.clamp(max=E), torch.ones_like(flat))
        ends = torch.cumsum(counts[:E], 0)
        token = order // k
        from orin import int4_triton

        # activations handed over in the kernel's column order (int4_triton.nibble_order)
        x = self._rows(hidden_states, token, int4_triton.nibble_order(self.gate_up_packed))
        gate_up = fused_gemm(x, self.gate_up_packed, self.gate_up_scales_and_zeros, self._geom["gate_up"][0], ends, T,
                             x_ordered=True)
        h = self._act(gate_up).index_select(1, int4_triton.nibble_order(self.down_packed))
        out = fused_gemm(h, self.down_packed, self.down_scales_and_zeros, self._geom["down"][0], ends, T,
                         x_ordered=True)
        # Back to each token's k rows (a permutation: every row has one place), weighted and summed in one
        # reduction; index_add_'s atomics took 50 us a layer. Rows of out-of-range indices sorted last, beyond
        # ends[-1], and came back zero: they weigh 0 as well.
        H = self.hidden_dim
        dtype = hidden_states.dtype
        back = torch.empty((T * k, H), dtype=dtype, device=hidden_states.device)
        back.index_copy_(0, order, out[:, :H].to(dtype))
        weights = torch.where(flat < E, top_k_weights.reshape(-1), 0).to(dtype)
        return (back.view(T, k, H) * weights.view(T, k, 1)).sum(1)

    def _rows(self, hidden_states: torch.Tensor, token: torch.Tensor, columns: torch.Tensor | None = None):
        """The sorted rows in the compute dtype, padded to the kernel's K, their columns in the order `columns`
        gives (cast, padded and reordered on the T tokens, before the gather repeats each k times)."""
        x = hidden_states
        if x.dtype != self.compute_dtype:
            x = x.to(self.compute_dtype)
        K_gu = self._geom["gate_up"][1]
        if K_gu > self.hidden_dim:
            x = F.pad(x, (0, K_gu - self.hidden_dim))
        if columns is not None:
            x = x.index_select(1, columns)
        return x[token]

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        inter = self.intermediate_dim
        h = self.act_fn(gate_up[:, :inter]) * gate_up[:, inter : 2 * inter]
        K_dn = self._geom["down"][1]
        return F.pad(h, (0, K_dn - inter)) if K_dn > inter else h

    def _combine(self, final: torch.Tensor, out: torch.Tensor, weights: torch.Tensor, token: torch.Tensor):
        out = out[:, : self.hidden_dim].to(final.dtype) * weights[:, None].to(final.dtype)
        return final.index_add_(0, token, out)

    def _per_expert(self, x: torch.Tensor, which: int, kernel_group: int, counts: list[int]) -> torch.Tensor:
        """tinygemm, one launch per expert that got rows (decode: a handful of rows in all)."""
        views = self._expert_views()
        packed, sz = views[which], views[which + 1]
        outs, start = [], 0
        for e, c in enumerate(counts):
            if c:
                outs.append(_int4_mm(x[start : start + c], packed[e], kernel_group, sz[e]))
                start += c
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _grouped(self, x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, kernel_group: int,
                 counts: list[int], ends: torch.Tensor) -> torch.Tensor:
        """All experts' rows in a few grouped GEMMs where the Triton kernel cannot run: experts dequantized a
        chunk at a time (bounded transient), each chunk's token groups one ``torch._grouped_mm``."""
        E = self.num_experts
        N_pad = scales_and_zeros.shape[-2]
        per = max(1, PREFILL_DEQUANT_CHUNK // (N_pad * x.shape[1] * x.element_size()))
        out = x.new_empty((x.shape[0], N_pad))
        start = 0
        for e0 in range(0, E, per):
            e1 = min(E, e0 + per)
            rows = sum(counts[e0:e1])
            if not rows:
                continue
            w = dequantize_packed(packed[e0:e1], scales_and_zeros[e0:e1], kernel_group)
            offs = (ends[e0:e1] - start).to(torch.int32)
            out[start : start + rows] = torch._grouped_mm(x[start : start + rows], w.transpose(1, 2), offs=offs)
            start += rows
        return out

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, intermediate_dim={self.intermediate_dim}, "
            f"group_size={self.group_size}, loaded={self.is_loaded}, layout={self.layout}"
        )


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
) -> nn.Module:
    """Fill an INT4 shell from its checkpoint tensors (keys relative to the module path, see ``int4_tensor_keys``)."""
    if isinstance(module, (Int4Linear, Int4Experts)):
        return module.load_gptq_(tensors, device, dtype, name=name)
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


__all__ = [
    "CPU_CONVERT_CHUNK_ROWS",
    "Int4Experts",
    "Int4Linear",
    "convert_for_runtime",
    "int4_experts_runtime_bytes",
    "int4_linear_runtime_bytes",
    "int4_tensor_keys",
    "kernel_group_size",
    "load_int4_module",
    "quantized_module_paths",
    "triton_available",
    "dequantize_packed",
    "fused_gemm",
    "unload_int4_module",
    "unpack_codes",
]
