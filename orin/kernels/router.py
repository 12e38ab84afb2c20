"""The MoE router's softmax and top-k as one Triton kernel, for decode.

HF's router is a softmax over the experts (float32), ``torch.topk`` and a renormalisation. At batch 1 inside a
CUDA graph, ``torch.topk`` over 128 experts is two kernels (a bitonic sort and a gather, ~9 us together): 11 %
of a decode step's device time, 48 times per token. Here one program per token takes its row of logits,
softmax and k rounds of arg-max; the renormalisation stays in the caller, where torch.compile fuses it.

Same picks as ``torch.topk`` except on exact ties (then the lowest expert id wins here). Import only where the
device profile has Triton (orin.int4.moe.triton_runs); the kernel also runs under ``TRITON_INTERPRET=1`` (the
tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softmax_topk(logits_ptr, w_ptr, i_ptr, E, K: tl.constexpr, BLOCK_E: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    x = tl.load(logits_ptr + row * E + offs, mask=ok, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = tl.where(ok, p, 0.0)
    p = p / tl.sum(p, axis=0)
    p = tl.where(ok, p, -1.0)  # padding never wins
    for j in tl.static_range(K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, offs, BLOCK_E), axis=0)  # the lowest id among equals
        tl.store(w_ptr + row * K + j, best)
        tl.store(i_ptr + row * K + j, idx.to(tl.int64))
        p = tl.where(offs == idx, -1.0, p)


@torch.library.custom_op("orin::softmax_topk", mutates_args=())
def softmax_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (softmax probabilities of the top k [T, k] float32, expert ids [T, k] int64), largest
    first, as ``torch.topk(torch.softmax(logits.float(), -1), k)``."""
    T, E = logits.shape
    weights = torch.empty((T, k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((T, k), dtype=torch.int64, device=logits.device)
    if T:
        _softmax_topk[(T,)](logits.contiguous(), weights, ids, E, K=k, BLOCK_E=triton.next_power_of_2(E),
                            num_warps=1)
    return weights, ids


@softmax_topk.register_fake
def _(logits, k):
    T = logits.shape[0]
    return (logits.new_empty((T, k), dtype=torch.float32), logits.new_empty((T, k), dtype=torch.int64))
