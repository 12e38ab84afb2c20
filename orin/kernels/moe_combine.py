"""A long prompt's MoE combine as one Triton kernel: each token's expert outputs that lie in one block of the
expert-sorted rows, weighted, summed and added to the token's hidden state.

``Int4Experts.add_long`` computes the experts' rows sorted by expert, a block of them at a time, and each token
has up to k rows in a block (one per expert there). ``index_add_`` sums them with one bfloat16 atomic per
element: at the thinker's widths 0.15 ms a block, seven times the block's memory traffic at the H200's
bandwidth, and 166 ms of a 25k-token video prefill's 1.1 s of kernels on an H200. Here one
program per BLOCK_T tokens and column block finds each token's rows through the inverse of the sort
(``inv[t * k + j]``: where the token's j-th choice landed), reads the ones inside the block, and adds their
weighted sum once, in float32: no atomics, the same bits on every run (for a given launch shape: the reduction's
order follows the shape's layout), one rounding per element instead of one per row.

Import only where the device profile has Triton (orin.int4.moe.triton_runs); the kernel also runs under
``TRITON_INTERPRET=1`` (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Tokens and columns per program (a program's tokens' k rows of BLOCK_H float32 values stay in registers) and warps.
# scripts/bench_long_moe_kernels.py on the H200, one layer of the 2 fps video case: one token
# and 512 columns a program took 1.10 ms a talker layer and 2.80 ms a thinker layer (750-810 GB/s); 1,024 columns
# 0.34 and 0.88 ms (2,400-2,600 GB/s), the best of the shapes tried (more tokens a program, fewer columns, 8 warps).
BLOCK_T = 1
BLOCK_H = 1024
NUM_WARPS = 4


@triton.jit
def _combine_block(x_ptr, out_ptr, w_ptr, inv_ptr, lo, hi, T, H, stride_x, stride_out, K: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    ts = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    ks = tl.arange(0, BLOCK_K)
    tm = ts < T
    p = tl.load(inv_ptr + ts[:, None] * K + ks[None, :], mask=tm[:, None] & (ks[None, :] < K), other=-1)
    hit = (p >= lo) & (p < hi)  # [BLOCK_T, BLOCK_K]
    touched = tl.max(hit.to(tl.int32), axis=1) > 0  # the tokens with a row in this block
    if tl.max(touched.to(tl.int32), axis=0) == 0:
        return
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = hs < H
    row = tl.where(hit, p - lo, 0)
    w = tl.load(w_ptr + tl.where(hit, p, 0), mask=hit, other=0.0).to(tl.float32)
    rows = tl.load(out_ptr + row[:, :, None] * stride_out + hs[None, None, :],
                   mask=hit[:, :, None] & hm[None, None, :], other=0.0)
    acc = tl.sum(rows.to(tl.float32) * w[:, :, None], axis=1)  # [BLOCK_T, BLOCK_H], each token's k in order
    xs = x_ptr + ts[:, None] * stride_x + hs[None, :]
    m = touched[:, None] & hm[None, :]
    tl.store(xs, (tl.load(xs, mask=m).to(tl.float32) + acc).to(x_ptr.dtype.element_ty), mask=m)


def combine_block(into: torch.Tensor, out: torch.Tensor, weights: torch.Tensor, inv: torch.Tensor, lo: int,
                  k: int, block_t: int = BLOCK_T, block_h: int = BLOCK_H, num_warps: int = NUM_WARPS) -> torch.Tensor:
    """``into[t] += sum_j weights[p] * out[p - lo]`` over token t's sorted rows p = inv[t * k + j] that fall in
    [lo, lo + len(out)): into [T, H] (written in place), out [rows, >= H] (its first H columns), weights [T * k]
    and inv [T * k] (int64) in sort order and by token respectively. `block_t`, `block_h`, `num_warps`: the
    launch's shape (scripts/bench_long_moe_kernels.py compares them)."""
    T, H = into.shape
    if T == 0 or out.shape[0] == 0:
        return into
    if out.stride(1) != 1 or into.stride(1) != 1:
        raise ValueError("combine_block needs rows with contiguous columns")
    grid = (triton.cdiv(T, block_t), triton.cdiv(H, block_h))
    _combine_block[grid](into, out, weights, inv, lo, lo + out.shape[0], T, H, into.stride(0), out.stride(0), K=k,
                         BLOCK_K=triton.next_power_of_2(k), BLOCK_T=block_t, BLOCK_H=block_h, num_warps=num_warps)
    return into
