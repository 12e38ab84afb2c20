"""A long prompt's per-head query/key RMSNorm and rotary embedding as one Triton kernel, written where the
attention reads it (the queries' buffer, the KV cache).

``orin.runtime.attention`` norms each head's projected queries and keys (HF's ``q_norm``/``k_norm``) and rotates
them: ``_rope(_rms(y, weight, eps).transpose(0, 1), cos, sin)``, then copies them into place. As torch ops that
is eight launches per chunk and projection, each a pass over the chunk's [rows, heads, head_dim]: at a
25k-token video's prefill, 4,700 of the thinker's 16,400 launches, at a point where
the host, not the GPU, sets the pace. Here one program per row does all of it, rounding to the tensors' dtype
after each step as the torch ops do; only the norm's sum runs in another order (as torch's fused ``rms_norm``
on CUDA already does against HF's module).

Import only where the device profile has Triton (orin.int4.moe.triton_runs); the kernel also runs under
``TRITON_INTERPRET=1`` (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_rope(y_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, heads, eps, stride_yt, stride_yh, stride_ct, stride_st,
               stride_oh, stride_ot, HD: tl.constexpr, HALF: tl.constexpr, BLOCK_HEADS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hs = tl.arange(0, BLOCK_HEADS)
    ds = tl.arange(0, HALF)
    ok = (hs < heads)[:, None]
    dt = out_ptr.dtype.element_ty
    src = y_ptr + t * stride_yt + hs[:, None] * stride_yh + ds[None, :]
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    r = tl.math.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HD + eps)[:, None]
    # HF's RMSNorm: normalised in float32, rounded, then scaled (rounded again)
    w1 = tl.load(w_ptr + ds).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + ds).to(tl.float32)[None, :]
    n1 = (w1 * (x1 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    n2 = (w2 * (x2 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    # x * cos + cat(-x2, x1) * sin, each product and the sum rounded
    c1 = tl.load(cos_ptr + t * stride_ct + ds).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + ds).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + t * stride_st + ds).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + t * stride_st + HALF + ds).to(tl.float32)[None, :]
    o1 = (n1 * c1).to(dt).to(tl.float32) + (-n2 * s1).to(dt).to(tl.float32)
    o2 = (n2 * c2).to(dt).to(tl.float32) + (n1 * s2).to(dt).to(tl.float32)
    dst = out_ptr + hs[:, None] * stride_oh + t * stride_ot + ds[None, :]
    tl.store(dst, o1.to(dt), mask=ok)
    tl.store(dst + HALF, o2.to(dt), mask=ok)


def supports(out: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether norm_rope_into takes these tensors: a power-of-two head_dim, contiguous last dimensions."""
    hd = y.shape[-1]
    return hd >= 2 and not hd & (hd - 1) and all(t.stride(-1) == 1 for t in (out, y, cos, sin, weight))


def norm_rope_into(out: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
    """``out[:] = _rope(_rms(y, weight, eps).transpose(0, 1), cos, sin)``: y [T, heads, head_dim] (a projection's
    rows), weight [head_dim], cos and sin [T, head_dim], out [heads, T, head_dim] (a view into the queries'
    buffer or the KV cache), all with contiguous last dimensions; head_dim a power of two."""
    T, heads, hd = y.shape
    if not supports(out, y, weight, cos, sin):
        raise ValueError("norm_rope_into needs a power-of-two head_dim and contiguous last dimensions")
    if tuple(out.shape) != (heads, T, hd) or tuple(cos.shape) != (T, hd) or tuple(sin.shape) != (T, hd):
        raise ValueError("norm_rope_into: out must be [heads, T, head_dim] and cos, sin [T, head_dim]")
    if T:
        # no fused multiply-adds: contracted across the roundings, a fifth of the elements came out a step away
        # from the torch ops'; without, only the norm's sum order separates them
        _norm_rope[(T,)](y, weight, cos, sin, out, heads, eps, y.stride(0), y.stride(1), cos.stride(0),
                         sin.stride(0), out.stride(0), out.stride(1), HD=hd, HALF=hd // 2,
                         BLOCK_HEADS=triton.next_power_of_2(heads), num_warps=4, enable_fp_fusion=False)
    return out
