"""torch's int4pack layout: GPTQ layers packed for the tinygemm kernels, read back, dequantized, and the
dispatch to the kernels that run on it (tinygemm, and orin.kernels.int4_gemm's Triton kernels where they can).

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

So a GPTQ layer (see orin.checkpoint.gptq_format) is packed (``to_kernel``) as: codes padded to K_run = groups * g (zero
activations feed the padding) and N_pad = N rounded up to 16 (extra outputs sliced off), a kernel group that
divides g (scales repeated when g > 256), and the device's packed layout. The packed layout differs between CPU
and CUDA: weights packed for one cannot run on the other (``check_device`` says so instead of computing garbage).
``orin.checkpoint.targets.runtime_int4_bytes`` is the size of the result.

Dequantizing (the prefill's dense GEMMs) reads the packed layout directly: on CUDA by the layout of
``int4mm.cu``'s ``matrix_to_m16n8k16_Bint4_layout`` (``_codes_cuda``, checked once per process against the real
converter; the Triton kernels read the same layout); on CPU, whose layout depends on the ISA, by an order found
by converting probe matrices (``_cpu_order``). Whether the Triton dequantizer runs is the caller's to say (its
MoE backend's, orin.int4.moe, decided once when the weights were loaded): the torch ops compute the same.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from ..checkpoint.gptq_format import GPTQ_KEYS, check_in_features, decode_qzeros_v1, gptq_v1_geometry
from ..checkpoint.targets import INT4_N_ALIGN, kernel_group_size
from ..device.profile import CPU
from ..errors import ModelError


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


# ---------------------------------------------------------------- packing


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


def _convert_cpu(qweight: torch.Tensor, chunk_rows: int) -> torch.Tensor:
    """qweight int32 [K/8, N] -> the CPU kernel's uint8 [N, K/2], converting `chunk_rows` rows at a time (a multiple
    of the kernel's 64-row block) to bound the int32 [rows, K] transient."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device).view(1, 8, 1)
    N = qweight.shape[1]
    step = chunk_rows if N % 64 == 0 else N
    parts = []
    for n0 in range(0, N, step):
        words = qweight[:, n0 : n0 + step]
        codes = ((words.unsqueeze(1) >> shifts) & 0xF).reshape(-1, words.shape[1]).t().contiguous()
        parts.append(_convert_cpu_codes(codes))
        del codes
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class KernelWeight:
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
        self.N_pad = scales_and_zeros.shape[-2]  # [..., K/group, N_pad, 2]: one layer's, or a stack of experts'


def to_kernel(
    tensors: Mapping[str, torch.Tensor], in_features: int, device: torch.device, dtype: torch.dtype, name: str,
    cpu_chunk_rows: int = CPU.memory.cpu_convert_chunk_rows,
) -> KernelWeight:
    """GPTQ v1 tensors of one layer -> kernel form on ``device`` (transient: the layer's codes, on ``device``).
    `cpu_chunk_rows`: the profile's memory.cpu_convert_chunk_rows (the CPU layout's conversion in row blocks)."""
    layout = _layout_for(device)
    gptq = {k: tensors[k].to(device) for k in GPTQ_KEYS if k in tensors}
    K_pack, N, groups, g = gptq_v1_geometry(gptq, name)
    check_in_features(K_pack, g, in_features, name)
    qweight, scales, zeros_int = gptq["qweight"], gptq["scales"], decode_qzeros_v1(gptq["qzeros"])
    K_run = groups * g
    N_pad = -(-N // INT4_N_ALIGN) * INT4_N_ALIGN
    kg = kernel_group_size(g)
    # Padded input rows hold code 0 (their activations are zero); padded outputs have scale 0 and are sliced off.
    if N_pad > N or K_run > K_pack:
        qweight = F.pad(qweight, (0, N_pad - N, 0, (K_run - K_pack) // 8))
    if layout == "cuda":
        weight = torch.ops.aten._convert_weight_to_int4pack(_cuda_codes_bytes(qweight), _inner_k_tiles(K_run))
    else:
        weight = _convert_cpu(qweight, cpu_chunk_rows)
    del qweight
    s = F.pad(scales.float(), (0, N_pad - N))
    z = F.pad(zeros_int.float(), (0, N_pad - N), value=8.0)
    sz = torch.stack([s, s * (8.0 - z)], dim=-1)
    if g != kg:
        sz = sz.repeat_interleave(g // kg, dim=0)
    sz = sz.to(_compute_dtype(layout, dtype)).contiguous()
    return KernelWeight(weight, sz, kg, g, K_run, N)


def check_device(tensor: torch.Tensor | None, layout: str | None, what: str) -> None:
    """Refuse to run weights that are not loaded, or that sit on a device type they were not packed for."""
    if tensor is None:
        raise RuntimeError(f"{what} is not loaded: call load_int4_module() on it first")
    if tensor.device.type != layout:
        raise RuntimeError(
            f"{what} was packed for {layout} but its buffers are on {tensor.device}; the packed layouts differ, "
            f"reload it with load_int4_module(..., device='{tensor.device.type}')"
        )


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
            raise RuntimeError("the CPU int4pack conversion is not a permutation of the codes; orin.int4.pack cannot "
                               "read it")
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


# ---------------------------------------------------------------- the kernels


def int4_mm(x2: torch.Tensor, weight: torch.Tensor, kernel_group: int, sz: torch.Tensor) -> torch.Tensor:
    """tinygemm: x2 [M, K_run] (contiguous, compute dtype) @ the packed weight's [N_pad, K_run].T."""
    if x2.is_cuda:
        return torch.ops.aten._weight_int4pack_mm(x2, weight, kernel_group, sz)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x2, weight, kernel_group, sz)


_LAYOUT_CHECKED: set[tuple] = set()


def check_cuda_layout(packed: torch.Tensor) -> None:
    """Once per device and tile count: read back a converted random matrix (guards against a torch whose int4pack
    layout differs from the one ``_codes_cuda`` and the Triton kernels read)."""
    tiles = packed.shape[-1] * 2
    key = (packed.device, tiles)
    if key in _LAYOUT_CHECKED:
        return
    K = 16 * tiles * 2
    codes = torch.randint(0, 16, (16, K), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    pairs = codes.to(torch.uint8).view(16, K // 2, 2)
    bytes_ = (pairs[..., 0] << 4) | pairs[..., 1]
    converted = torch.ops.aten._convert_weight_to_int4pack(bytes_.to(packed.device).contiguous(), tiles)
    if not torch.equal(_codes_cuda(converted).cpu().int(), codes):
        raise ModelError(
            "this torch build's CUDA int4pack layout is not the one orin.int4.pack reads; prefill cannot "
            "dequantize INT4 weights — report the torch version"
        )
    _LAYOUT_CHECKED.add(key)


def dequantize_packed(packed: torch.Tensor, scales_and_zeros: torch.Tensor, kernel_group: int,
                      triton: bool = False) -> torch.Tensor:
    """``_dequantize``: the kernel's weight [..., N_pad, K_run] in the scales' dtype; with `triton` (a CUDA
    device whose kernels passed their start-up check: the caller's backend says so) as one Triton kernel
    (``orin.kernels.int4_gemm.dequantize``: bandwidth-speed, where the torch ops make ~8 passes over the
    weights)."""
    if packed.is_cuda:
        check_cuda_layout(packed)
        if triton:
            from ..kernels import int4_gemm

            return int4_gemm.dequantize(packed, scales_and_zeros, kernel_group)
    return _dequantize(packed, scales_and_zeros, kernel_group)


__all__ = [
    "KernelWeight",
    "check_cuda_layout",
    "check_device",
    "dequantize_packed",
    "int4_mm",
    "to_kernel",
    "unpack_codes",
]
