"""The INT4 checkpoint format: GPTQ v1 tensors, in pure torch (no GPTQ library on the device).

One quantized ``nn.Linear`` with ``in_features=K``, ``out_features=N`` and group size ``g`` is stored as

- ``qweight`` int32 ``[ceil(K/8), N]``: 8 4-bit codes per word along the input dim, low nibble first;
- ``qzeros``  int32 ``[ceil(K/g), N/8]``: the zero points packed along the output dim, GPTQ v1 convention, i.e.
  the packed word of the zero points minus ``0x11111111`` *as a whole 32-bit word* (that is what GPTQModel's
  ``convert_gptq_v2_to_v1_format_module`` writes; a zero point of 0 borrows from the next nibble, so decoding
  must add ``0x11111111`` to the word before splitting nibbles, never add 1 per nibble);
- ``scales``  float16 ``[ceil(K/g), N]``;
- ``g_idx``   int32 ``[K]`` = ``arange(K) // g`` (desc_act=False; anything else is refused);
- ``bias``    bf16/fp16 ``[N]`` if the layer has one.

The weight is ``W[n, k] = scales[k//g, n] * (q[n, k] - z[k//g, n])``. A K that is not a multiple of g ends in a
partial group, as GPTQModel writes it; the runtime pads such layers to ``K_pad = pad_in_features(K, g)`` with
zero columns at load time. Checkpoints of orin-omni 0.1, which stored K_pad columns, are read too.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from orin.errors import ModelError

BITS = 4
PACK = 32 // BITS  # codes per int32 word
MAXQ = (1 << BITS) - 1
# Added to / subtracted from the whole packed zero-point word for the v1 convention (zero - 1 per nibble).
V1_ZERO_OFFSET = 0x11111111
GPTQ_KEYS = ("qweight", "qzeros", "scales", "g_idx")


def pad_in_features(K: int, g: int) -> int:
    """The stored input width: K rounded up to a multiple of the group size g."""
    if K <= 0 or g <= 0:
        raise ValueError(f"in_features and group size must be positive, got K={K}, g={g}")
    return -(-K // g) * g


def gptq_v1_bytes(K: int, N: int, g: int, bias: bool, bias_dtype_bytes: int = 2) -> int:
    """Exact bytes of the tensors ``pack_gptq_v1`` writes for one K -> N layer (safetensors payload, no header)."""
    from .targets import gptq_v1_bytes as file_bytes

    return file_bytes(K, N, g, False) + (N * bias_dtype_bytes if bias else 0)


def _to_int32_words(words64: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) (or any int64, taken mod 2**32) -> the int32 with the same bit pattern."""
    words64 = words64 & 0xFFFFFFFF
    return torch.where(words64 >= 2**31, words64 - 2**32, words64).to(torch.int32)


def _pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """[R*8, C] codes 0..15 -> int32 [R, C], code 8r+j in nibble j (low nibble first)."""
    R = codes.shape[0] // PACK
    shifts = torch.arange(0, 32, BITS, device=codes.device, dtype=torch.int64).view(1, PACK, 1)
    words = (codes.to(torch.int64).view(R, PACK, -1) << shifts).sum(dim=1)
    return _to_int32_words(words)


def _unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R*8, C], inverse of ``_pack_rows``."""
    shifts = torch.arange(0, 32, BITS, device=words.device, dtype=torch.int32).view(1, PACK, 1)
    codes = (words.unsqueeze(1) >> shifts) & MAXQ  # arithmetic shift: the mask drops the sign bits
    return codes.reshape(-1, words.shape[1]).to(torch.uint8)


def pack_gptq_v1(
    q_int: torch.Tensor,
    zeros_int: torch.Tensor,
    scales: torch.Tensor,
    g: int,
    bias: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Pack integer codes into the GPTQ v1 tensors of one layer.

    ``q_int`` [N, K] ints 0..15, ``zeros_int`` [ceil(K/g), N] ints 0..15 (the real zero points, 8 for sym),
    ``scales`` [ceil(K/g), N]. The layout GPTQ tools write and read: ``qweight`` holds ceil(K/8) rows (a K that
    is not a multiple of 8 is padded with the last group's zero point, which dequantizes to exactly 0), the last
    group may be partial, and ``g_idx`` has K entries. The runtime pads to a multiple of g at load time where its
    kernels need it. Works on any device.
    """
    if q_int.dim() != 2:
        raise ValueError(f"q_int must be [N, K], got shape {tuple(q_int.shape)}")
    N, K = q_int.shape
    K_pad = pad_in_features(K, g)
    groups = K_pad // g
    if N % PACK:
        raise ValueError(f"out_features N={N} must be a multiple of {PACK} to pack GPTQ qzeros")
    if tuple(zeros_int.shape) != (groups, N) or tuple(scales.shape) != (groups, N):
        raise ValueError(
            f"zeros_int/scales must be [{groups}, {N}] for K={K}, g={g}; "
            f"got {tuple(zeros_int.shape)} and {tuple(scales.shape)}"
        )
    q = q_int.to(torch.int64)
    z = zeros_int.to(torch.int64)
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > MAXQ):
        raise ValueError("q_int values must lie in 0..15")
    if z.numel() and (int(z.min()) < 0 or int(z.max()) > MAXQ):
        raise ValueError("zeros_int values must lie in 0..15")
    K_words = -(-K // PACK) * PACK
    if K_words > K:
        pad_codes = z[-1].view(N, 1).expand(N, K_words - K)
        q = torch.cat([q, pad_codes], dim=1)
    qweight = _pack_rows(q.t().contiguous())
    zero_words = _pack_rows(z.t().contiguous()).t().contiguous()  # [groups, N/8]
    qzeros = _to_int32_words(zero_words.to(torch.int64) - V1_ZERO_OFFSET)
    out = {
        "qweight": qweight,
        "qzeros": qzeros,
        "scales": scales.to(torch.float16).contiguous(),
        "g_idx": (torch.arange(K, device=q_int.device, dtype=torch.int32) // g),
    }
    if bias is not None:
        if tuple(bias.shape) != (N,):
            raise ValueError(f"bias must be [{N}], got {tuple(bias.shape)}")
        out["bias"] = bias.detach().to(bias.dtype if bias.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16)
    return out


def _group_size_from_g_idx(g_idx: torch.Tensor, K_pack: int, groups: int, name: str) -> int:
    """Infer g from a contiguous g_idx (arange(L)//g); refuse act-order (desc_act=True) layouts."""
    L = g_idx.numel()
    if not (K_pack - PACK < L <= K_pack):
        raise ModelError(
            f"{name}.g_idx has {L} entries but qweight holds {K_pack} input rows; the checkpoint is corrupt"
        )
    if groups == 1:
        g = -(-K_pack // 32) * 32  # any g >= L describes one group; pick one the kernels can tile
    else:
        g = int((g_idx == 0).sum())
    expected = torch.arange(L, device=g_idx.device, dtype=torch.int64) // max(g, 1)
    if g <= 0 or not torch.equal(g_idx.to(torch.int64), expected) or -(-L // g) != groups:
        raise ModelError(
            f"{name}.g_idx is not contiguous (arange(K)//group_size): this is an act-order (desc_act=True) "
            "checkpoint, which the INT4 runtime cannot run; re-quantize with desc_act=False"
        )
    return g


def gptq_v1_geometry(tensors: Mapping[str, torch.Tensor], name: str = "layer") -> tuple[int, int, int, int]:
    """Validate one layer's GPTQ v1 tensors; return (K_pack, N, groups, g) with K_pack = qweight rows * 8.

    Raises ModelError on missing keys, wrong dtypes or shapes, or a non-contiguous (act-order) g_idx.
    """
    missing = [k for k in GPTQ_KEYS if k not in tensors]
    if missing:
        raise ModelError(
            f"{name}: GPTQ tensors {', '.join(missing)} missing from the checkpoint; re-run orin-omni quantize"
        )
    qweight, qzeros, scales, g_idx = (tensors[k] for k in GPTQ_KEYS)
    for key, t, dtypes in (
        ("qweight", qweight, (torch.int32,)),
        ("qzeros", qzeros, (torch.int32,)),
        ("g_idx", g_idx, (torch.int32, torch.int64)),
        ("scales", scales, (torch.float16, torch.bfloat16, torch.float32)),
    ):
        if t.dtype not in dtypes:
            raise ModelError(
                f"{name}.{key} has dtype {t.dtype}, expected {dtypes[0]}; this is not a 4-bit GPTQ checkpoint"
            )
    if qweight.dim() != 2 or scales.dim() != 2 or qzeros.dim() != 2:
        raise ModelError(f"{name}: qweight/qzeros/scales must be 2-D")
    K_pack, N = qweight.shape[0] * PACK, qweight.shape[1]
    groups = scales.shape[0]
    if scales.shape[1] != N or tuple(qzeros.shape) != (groups, N // PACK) or N % PACK:
        raise ModelError(
            f"{name}: inconsistent GPTQ shapes qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
            f"scales {tuple(scales.shape)} (expected 4-bit, N multiple of 8)"
        )
    g = _group_size_from_g_idx(g_idx.reshape(-1), K_pack, groups, name)
    return K_pack, N, groups, g


def decode_qzeros_v1(qzeros: torch.Tensor) -> torch.Tensor:
    """v1 packed zero points int32 [G, N/8] -> the real zero points uint8 [G, N] (word-wise +0x11111111)."""
    zero_words = _to_int32_words(qzeros.to(torch.int64) + V1_ZERO_OFFSET)
    return _unpack_rows(zero_words.t().contiguous()).t().contiguous()


def unpack_gptq_v1(
    tensors: Mapping[str, torch.Tensor], name: str = "layer"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """GPTQ v1 tensors -> (q_int uint8 [N, K_pad], zeros_int uint8 [G, N], scales [G, N], g).

    ``K_pad = qweight.shape[0] * 8`` (for our padded checkpoints ``G * g``). ``name`` prefixes error messages
    (pass the module path). Raises ModelError on missing keys, bad dtypes/shapes or a non-contiguous g_idx.
    """
    g = gptq_v1_geometry(tensors, name)[3]
    q_int = _unpack_rows(tensors["qweight"]).t().contiguous()  # [N, K_pack]
    return q_int, decode_qzeros_v1(tensors["qzeros"]), tensors["scales"], g


def dequantize_gptq_v1(
    tensors: Mapping[str, torch.Tensor], in_features: int | None = None, name: str = "layer"
) -> torch.Tensor:
    """The float32 weight [N, K] of a GPTQ v1 layer (K = in_features when given, else K_pad)."""
    q_int, zeros_int, scales, g = unpack_gptq_v1(tensors, name)
    K_pack = q_int.shape[1]
    if in_features is not None:
        check_in_features(K_pack, g, in_features, name)
    group = torch.arange(K_pack, device=q_int.device) // g
    W = (q_int.float() - zeros_int.float()[group].t()) * scales.float()[group].t()
    return W[:, :in_features].contiguous() if in_features is not None else W


def check_in_features(K_pack: int, g: int, in_features: int, name: str = "layer") -> None:
    """Refuse a checkpoint whose stored input width cannot belong to a Linear of ``in_features`` inputs."""
    if not (in_features <= K_pack <= max(pad_in_features(in_features, g), -(-in_features // PACK) * PACK)):
        raise ModelError(
            f"{name}: checkpoint stores {K_pack} input columns (group size {g}) but the model's Linear has "
            f"in_features={in_features}; the checkpoint does not match this model"
        )


def _rtn_params(Wg: torch.Tensor, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's Quantizer.find_params per group: Wg [N, G, g] -> (scale, zero) [N, G]; range always includes 0."""
    xmin = Wg.amin(dim=-1).clamp(max=0)
    xmax = Wg.amax(dim=-1).clamp(min=0)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    dead = (xmin == 0) & (xmax == 0)
    xmin = torch.where(dead, torch.full_like(xmin, -1.0), xmin)
    xmax = torch.where(dead, torch.full_like(xmax, 1.0), xmax)
    scale = (xmax - xmin) / MAXQ
    zero = torch.full_like(scale, (MAXQ + 1) / 2) if sym else torch.round(-xmin / scale)
    return scale, zero


def quantize_rtn(
    W: torch.Tensor,
    bits: int = 4,
    group_size: int = 128,
    sym: bool = False,
    bias: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Round-to-nearest 4-bit quantization of W [N, K] into GPTQ v1 tensors (the RTN baseline)."""
    if bits != BITS:
        raise ValueError(f"only {BITS}-bit quantization is supported, got bits={bits}")
    N, K = W.shape
    K_pad = pad_in_features(K, group_size)
    Wf = W.detach().float()
    if K_pad > K:
        Wf = torch.nn.functional.pad(Wf, (0, K_pad - K))
    Wg = Wf.view(N, K_pad // group_size, group_size)
    scale, zero = _rtn_params(Wg, sym)
    # Quantize against the fp16 scale that is stored, so dequantization reproduces the codes' intent.
    scale = scale.to(torch.float16).float().clamp(min=torch.finfo(torch.float16).tiny)
    q = torch.clamp(torch.round(Wg / scale.unsqueeze(-1)) + zero.unsqueeze(-1), 0, MAXQ)
    return pack_gptq_v1(q.view(N, K_pad)[:, :K], zero.t(), scale.t(), group_size, bias)


def random_gptq_v1(
    K: int,
    N: int,
    g: int,
    *,
    generator: torch.Generator,
    device: torch.device | str = "cpu",
    bias: bool = False,
) -> dict[str, torch.Tensor]:
    """Random valid GPTQ v1 tensors at real dimensions, scales like a trained LLM's (|W| ~ 0.02)."""
    device = torch.device(device)
    groups = pad_in_features(K, g) // g
    q = torch.randint(0, MAXQ + 1, (N, K), generator=generator, device=device, dtype=torch.int32)
    zeros = torch.randint(4, 12, (groups, N), generator=generator, device=device, dtype=torch.int32)
    scales = torch.rand((groups, N), generator=generator, device=device) * 0.008 + 0.002
    b = torch.randn((N,), generator=generator, device=device).mul_(0.02).to(torch.bfloat16) if bias else None
    return pack_gptq_v1(q, zeros, scales, g, b)


__all__ = [
    "GPTQ_KEYS",
    "check_in_features",
    "decode_qzeros_v1",
    "dequantize_gptq_v1",
    "gptq_v1_bytes",
    "gptq_v1_geometry",
    "pack_gptq_v1",
    "pad_in_features",
    "quantize_rtn",
    "random_gptq_v1",
    "unpack_gptq_v1",
]
