"""A long prompt's MoE activation as one Triton kernel: ``silu(gate) * up`` from the experts' fused gate/up output,
zero-padded to the down projection's K.

``Int4Experts._act`` takes the gate and up halves of each row (strided slices of one [rows, 2 * I] tensor), so
torch runs ``silu`` and the product as its generic strided kernels, each a pass of its own, then pads: at a
25k-token video's talker prefill ``silu`` alone took 3.4 ms in 100 launches of its 155 ms of kernels
on an H200. Here one pass reads each row's gate and up once and writes the padded product, rounding
silu's output to the tensor's dtype before the product as the torch ops do.

Import only where the device profile has Triton (orin.int4.moe.triton_runs); the kernel also runs under
``TRITON_INTERPRET=1`` (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements of the output a program writes: rows times columns flattened, so short rows (384 columns) still fill it.
BLOCK = 1024


@triton.jit
def _silu_mul(g_ptr, out_ptr, n, inter, k_out, stride_g, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    r = i // k_out
    c = i % k_out
    live = (i < n) & (c < inter)  # padding columns (c >= inter) are written 0
    g = tl.load(g_ptr + r * stride_g + c, mask=live, other=0.0).to(tl.float32)
    u = tl.load(g_ptr + r * stride_g + inter + c, mask=live, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + i, (s * u).to(dt), mask=i < n)


def silu_mul(gate_up: torch.Tensor, inter: int, k_out: int) -> torch.Tensor:
    """``F.pad(silu(gate_up[:, :inter]) * gate_up[:, inter:2 * inter], (0, k_out - inter))``: gate_up [rows, >= 2 *
    inter] with contiguous columns -> a new [rows, k_out] of its dtype."""
    rows = gate_up.shape[0]
    if gate_up.stride(1) != 1 or k_out < inter or gate_up.shape[1] < 2 * inter:
        raise ValueError("silu_mul needs [rows, >= 2 * inter] with contiguous columns and k_out >= inter")
    out = torch.empty((rows, k_out), dtype=gate_up.dtype, device=gate_up.device)
    n = rows * k_out
    if n:
        _silu_mul[(triton.cdiv(n, BLOCK),)](gate_up, out, n, inter, k_out, gate_up.stride(0), BLOCK=BLOCK,
                                           num_warps=4, enable_fp_fusion=False)
    return out
