"""A long prompt's MoE combine as one Triton kernel: each token's expert outputs that lie in one block of the
expert-sorted rows, weighted, summed and added to the token's hidden state.

``Int4Experts.add_long`` computes the experts' rows sorted by expert, a block of them at a time, and each token
has up to k rows in a block (one per expert there). ``index_add_`` sums them with one bfloat16 atomic per
element: at the thinker's widths 0.15 ms a block, seven times the block's memory traffic at the H200's
bandwidth, and 166 ms of a 25k-token video prefill's 1.1 s of kernels (BENCHMARKS.md, run 57v). Here one
program per token and column block finds the token's rows through the inverse of the sort (``inv[t * k + j]``:
where the token's j-th choice landed), reads the ones inside the block, and adds their weighted sum once, in
float32: no atomics, the same bits on every run, one rounding per element instead of one per row.

Import only where ``orin.int4pack.triton_available()`` says so; the kernel also runs under ``TRITON_INTERPRET=1``
(the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns per program: a token's k rows of this many float32 values stay in registers.
BLOCK_H = 512


@triton.jit
def _combine_block(x_ptr, out_ptr, w_ptr, inv_ptr, lo, hi, H, stride_x, stride_out, K: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    p = tl.load(inv_ptr + t * K + ks, mask=ks < K, other=-1)
    hit = (p >= lo) & (p < hi)
    if tl.max(hit.to(tl.int32), axis=0) == 0:  # most tokens have no row in a given block
        return
    hs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = hs < H
    row = tl.where(hit, p - lo, 0)
    w = tl.load(w_ptr + tl.where(hit, p, 0), mask=hit, other=0.0).to(tl.float32)
    rows = tl.load(out_ptr + row[:, None] * stride_out + hs[None, :], mask=hit[:, None] & hm[None, :], other=0.0)
    acc = tl.sum(rows.to(tl.float32) * w[:, None], axis=0)
    xs = x_ptr + t * stride_x + hs
    tl.store(xs, (tl.load(xs, mask=hm).to(tl.float32) + acc).to(x_ptr.dtype.element_ty), mask=hm)


def combine_block(into: torch.Tensor, out: torch.Tensor, weights: torch.Tensor, inv: torch.Tensor, lo: int,
                  k: int) -> torch.Tensor:
    """``into[t] += sum_j weights[p] * out[p - lo]`` over token t's sorted rows p = inv[t * k + j] that fall in
    [lo, lo + len(out)): into [T, H] (written in place), out [rows, >= H] (its first H columns), weights [T * k]
    and inv [T * k] (int64) in sort order and by token respectively."""
    T, H = into.shape
    if T == 0 or out.shape[0] == 0:
        return into
    if out.stride(1) != 1 or into.stride(1) != 1:
        raise ValueError("combine_block needs rows with contiguous columns")
    grid = (T, triton.cdiv(H, BLOCK_H))
    _combine_block[grid](into, out, weights, inv, lo, lo + out.shape[0], H, into.stride(0), out.stride(0), K=k,
                         BLOCK_K=triton.next_power_of_2(k), BLOCK_H=BLOCK_H, num_warps=4)
    return into
