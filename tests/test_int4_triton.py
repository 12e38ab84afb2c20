"""orin.kernels' int4_gemm, router, moe_combine, silu_mul and norm_rope kernels under Triton's CPU interpreter, on weights in torch's
CUDA int4pack layout (built with the transcribed converter), against the layout reader of orin.int4.pack. On a GPU,
tests/test_int4.py runs the same kernels compiled, against tinygemm."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")

# TRITON_INTERPRET must be set before triton is imported: a fresh interpreter per run.
SCRIPT = textwrap.dedent('''
    import torch
    from int4pack_reference import cuda_int4pack_reference
    from orin.int4 import pack as int4pack
    from orin.int4.linear import Int4Linear
    from orin.kernels import int4_gemm, moe_combine, norm_rope, router, silu_mul
    from orin.checkpoint.gptq_format import random_gptq_v1

    def rel(a, b):
        a, b = a.double(), b.double()
        return float((a - b).norm() / b.norm())

    def cuda_weights(K, N, g, n, gen):
        packed, scales = [], []
        for _ in range(n):
            cpu = Int4Linear.from_gptq(random_gptq_v1(K, N, g, generator=gen), K, "cpu", torch.float32)
            codes = int4pack.unpack_codes(cpu.weight_packed, cpu.padded_out_features, cpu.padded_in_features).int()
            packed.append(cuda_int4pack_reference(codes, int4pack._inner_k_tiles(cpu.padded_in_features)))
            scales.append(cpu.scales_and_zeros.bfloat16())
        return torch.stack(packed), torch.stack(scales), cpu.kernel_group_size

    gen = torch.Generator().manual_seed(0)
    for K, N, g, counts in [(256, 96, 128, [37, 0, 5, 16, 1]), (384, 48, 32, [3, 20]), (200, 40, 64, [9])]:
        packed, sz, kg = cuda_weights(K, N, g, len(counts), gen)
        ref_w = int4pack._dequantize(packed, sz, kg).float()
        w = int4_gemm.dequantize(packed, sz, kg)
        assert w.shape == ref_w.shape and w.dtype == torch.bfloat16
        assert torch.allclose(w.float(), ref_w, rtol=1e-2, atol=1e-3), (K, N, g)
        K_run, rows = packed.shape[2] * 32 * packed.shape[4], sum(counts)
        # float32 rows: the interpreter computes a bf16 tl.dot wrongly (on the GPU it is bf16)
        x = torch.randn(rows + 3, K_run, generator=gen)
        if int4_gemm.supports(packed):
            y = int4_gemm.grouped_int4_mm(x, packed, sz, kg, torch.tensor(counts).cumsum(0))
            assert torch.equal(y, int4_gemm.grouped_int4_mm(x, packed, sz, kg, torch.tensor(counts).cumsum(0),
                                                            max_rows=max(counts)))
            order = int4_gemm.nibble_order(packed)
            assert sorted(order.tolist()) == list(range(K_run)) and order.tolist() != list(range(K_run))
            assert torch.equal(y, int4_gemm.grouped_int4_mm(x.index_select(1, order), packed, sz, kg,
                                                            torch.tensor(counts).cumsum(0), x_ordered=True))
            ends = torch.tensor([0] + counts).cumsum(0).tolist()
            ref = torch.cat([x[a:b] @ ref_w[e].T for e, (a, b) in enumerate(zip(ends, ends[1:]))])
            assert rel(y[:rows], ref) < 5e-3 and not y[rows:].any(), (K, N, g)  # ref_w is rounded to bf16
        sel = torch.tensor([len(counts) - 1, 0, len(counts) - 1])
        xb = x[:3].bfloat16()
        shared = int4_gemm.moe_gemv(xb[:1], packed, sz, sel, kg).sum(0)
        each = int4_gemm.moe_gemv(xb, packed, sz, sel, kg).sum(0)
        for j, e in enumerate(sel.tolist()):
            assert rel(shared[j], xb[0].float() @ ref_w[e].T) < 5e-3, (K, N, g, j)
            assert rel(each[j], xb[j].float() @ ref_w[e].T) < 5e-3, (K, N, g, j)

    logits = torch.randn(5, 128, generator=gen).bfloat16()
    logits[2, 7] = logits[2, 9] = 30.0  # a tie at the top: the lower id first
    w, i = router.softmax_topk(logits, 8)
    ref_w, ref_i = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), 8, dim=-1)
    assert torch.allclose(w, ref_w, rtol=1e-5, atol=1e-7) and i.dtype == torch.int64
    assert torch.equal(i[[0, 1, 3, 4]], ref_i[[0, 1, 3, 4]]) and i[2, :2].tolist() == [7, 9]
    w, i = router.softmax_topk(torch.randn(3, 60, generator=gen), 4)  # experts not a power of 2
    assert i.max() < 60 and bool((w.sum(-1) <= 1 + 1e-6).all())

    # the long MoE's combine, block by block, against index_add_ of the weighted rows (float64): rows past the
    # last expert (id E) sort last and belong to no block; out has padding columns past H
    T, k, E, H = 37, 3, 6, 600
    top = torch.stack([torch.randperm(E + 1, generator=gen)[:k] for _ in range(T)])
    top[5] = E  # a padding row: no expert
    flat = top.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = int((flat < E).sum())
    token, wts = order // k, torch.rand(T * k, generator=gen)[order]
    out = torch.randn(rows, H + 8, generator=gen)
    x = torch.randn(T, H, generator=gen)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(T * k)
    ref = x.double()
    for lo, hi in [(0, 11), (11, 12), (12, rows)]:
        ref.index_add_(0, token[lo:hi], out[lo:hi, :H].double() * wts[lo:hi, None].double())
    untouched = torch.ones(T, dtype=torch.bool)
    untouched[token[:rows]] = False
    # the launch shapes: the default, several tokens a program (the last program's past T), fewer columns than H
    for shape in ({}, {"block_t": 4, "block_h": 512}, {"block_t": 8, "block_h": 128}):
        got = x.clone()
        for lo, hi in [(0, 11), (11, 12), (12, rows)]:
            moe_combine.combine_block(got, out[lo:hi], wts, inv, lo, k, **shape)
        assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5)
        assert untouched.any() and torch.equal(got[untouched], x[untouched])

    # the long MoE's activation: gate/up halves of strided rows (columns past 2 * inter ignored), padded to k_out
    # and not; float32 (the interpreter's bfloat16 rounding is not the GPU's: tests/test_device_kernels.py)
    import torch.nn.functional as F
    for rows, inter, k_out in [(5, 12, 16), (300, 7, 7)]:
        gate_up = torch.randn(rows, 2 * inter + 3, generator=gen)
        want = F.pad(F.silu(gate_up[:, :inter]) * gate_up[:, inter:2 * inter], (0, k_out - inter))
        got = silu_mul.silu_mul(gate_up, inter, k_out)
        assert got.shape == (rows, k_out) and torch.allclose(got, want, rtol=1e-5, atol=1e-6)
        assert not got[:, inter:].any()

    # the long attention's per-head norm and rotary embedding, written into a strided [heads, T, hd] view (a
    # queries' buffer or KV cache slice), against orin.runtime.attention's torch ops; heads not a power of two. float32
    # only: the interpreter rounds to bfloat16 wrongly (tests/test_device_kernels.py checks bfloat16 on a GPU)
    from orin.runtime.attention import _rms, _rope
    for dtype, tol in [(torch.float32, 1e-5)]:
        T, heads, hd = 7, 3, 16
        y = torch.randn(T, heads * hd + 4, generator=gen).to(dtype)[:, :heads * hd].view(T, heads, hd)
        weight = (1 + torch.randn(hd, generator=gen) / 4).to(dtype)
        ang = torch.randn(T, hd // 2, generator=gen)
        cos, sin = torch.cat([ang.cos()] * 2, -1).to(dtype), torch.cat([ang.sin()] * 2, -1).to(dtype)
        cache = torch.zeros(1, heads, T + 5, hd, dtype=dtype)
        norm_rope.norm_rope_into(cache[0, :, 2:2 + T], y, weight, 1e-6, cos, sin)
        ref = _rope(_rms(y, weight, 1e-6).transpose(0, 1), cos, sin)
        assert torch.allclose(cache[0, :, 2:2 + T].float(), ref.float(), rtol=tol, atol=tol), dtype
        assert not cache[0, :, :2].any() and not cache[0, :, 2 + T:].any()
    print("ok")
''')


def test_kernels_match_the_layout_reader_under_the_interpreter():
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(root / "tests"), str(root)]))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
