"""A long prompt's MoE kernels at launch shapes side by side, on the GPU, at the talker's and the thinker's widths
(the 2 fps video case: 25,159 tokens, random routing over 128 experts, the blocks Int4Experts.add_long makes):
- the combine (orin.kernels.moe_combine): each shape's time per layer, the bytes it moves, and whether its sums
  are the default shape's bits;
- the experts' dequantization (orin.kernels.int4_gemm.dequantize) of a layer's every expert, by launch shape;
- the activation (orin.kernels.silu_mul) against the torch ops it replaces, over a layer's rows.
Run on the lent GPU like scripts/bench_gpu.sh:
    python3 scripts/bench_long_moe_kernels.py      # $OUT/long_moe_kernels.json
"""
import json
import os
import sys

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from orin.checkpoint.gptq_format import random_gptq_v1  # noqa: E402
from orin.int4 import pack as int4pack  # noqa: E402
from orin.kernels import int4_gemm, moe_combine, silu_mul  # noqa: E402

T, E = 25159, 128
# (name, hidden, k, rows a block): the talker's blocks are LONG_MOE_BLOCK_ROWS (twice for its width, halved with
# every expert dequantized at once), the thinker's LONG_MOE_BLOCK_ROWS
MODELS = [("talker", 1024, 6, 32768, 384), ("thinker", 2048, 8, 32768, 768)]
DEQUANT_SHAPES = [(32, 4), (32, 8), (64, 4), (64, 8), (128, 4), (128, 8), (16, 4)]
SHAPES = [(1, 512, 4), (1, 1024, 4), (1, 1024, 8), (2, 512, 4), (4, 512, 4), (4, 256, 4), (4, 512, 8),
          (8, 256, 4), (8, 512, 8), (16, 128, 4)]
REPS = 10


def layer(hidden: int, k: int, rows: int, gen):
    top = torch.rand((T, E), device="cuda", generator=gen).argsort(dim=1)[:, :k]  # k distinct experts a token
    flat = top.reshape(-1)
    order = torch.argsort(flat, stable=True)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device="cuda")
    weights = torch.rand(T * k, device="cuda", generator=gen)
    out = torch.randn((T * k, hidden), device="cuda", generator=gen).to(torch.bfloat16)
    x = torch.randn((T, hidden), device="cuda", generator=gen).to(torch.bfloat16)
    blocks = [(lo, min(T * k, lo + rows)) for lo in range(0, T * k, rows)]
    return x, out, weights, inv, blocks


def timed(fn, reps=REPS) -> float:
    fn()  # compiles
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def experts(n_out: int, n_in: int, copies: int):
    """One expert projection in the CUDA int4pack layout, repeated `copies` times (the timing needs no variety)."""
    kw = int4pack.to_kernel(random_gptq_v1(n_in, n_out, 128, generator=torch.Generator().manual_seed(0)), n_in,
                            torch.device("cuda"), torch.bfloat16, "expert")
    return (kw.weight.unsqueeze(0).expand(copies, *kw.weight.shape).contiguous(),
            kw.scales_and_zeros.unsqueeze(0).expand(copies, *kw.scales_and_zeros.shape).contiguous(), kw.kernel_group)


def run(x, out, weights, inv, blocks, k, shape):
    y = x.clone()
    for lo, hi in blocks:
        moe_combine.combine_block(y, out[lo:hi], weights, inv, lo, k, *shape)
    return y


def bench_combine(name: str, hidden: int, k: int, rows: int, gen) -> tuple[list, int, int]:
    x, out, weights, inv, blocks = layer(hidden, k, rows, gen)
    # what a layer's combine must move at least: each block reads its rows and reads and writes every token's x
    moved = out.numel() * 2 + len(blocks) * x.numel() * 2 * 2
    want = run(x, out, weights, inv, blocks, k, (moe_combine.BLOCK_T, moe_combine.BLOCK_H, moe_combine.NUM_WARPS))
    res = []
    for shape in SHAPES:
        got = run(x, out, weights, inv, blocks, k, shape)
        ms = timed(lambda shape=shape: run(x, out, weights, inv, blocks, k, shape))
        res.append({"block_t": shape[0], "block_h": shape[1], "num_warps": shape[2], "ms_per_layer": ms,
                    "GB_per_s": moved / ms / 1e6, "same_bits_as_default": bool(torch.equal(got, want))})
        print(f"{name:8s} combine T={T} k={k} H={hidden} {len(blocks)} blocks  block_t={shape[0]:2d} "
              f"block_h={shape[1]:4d} warps={shape[2]}: {ms:.3f} ms a layer, {moved / ms / 1e6:.0f} GB/s, same bits: "
              f"{res[-1]['same_bits_as_default']}", flush=True)
    return res, moved, len(blocks)


def bench_dequant(name: str, proj: str, n_out: int, n_in: int) -> list:
    """Every expert's `proj` dequantized at once, as _add_long_on_device does (the talker's)."""
    packed, sz, group = experts(n_out, n_in, E)
    ref = int4_gemm.dequantize(packed, sz, group)
    moved = ref.numel() * 2 + packed.numel() * packed.element_size() + sz.numel() * 2
    res = []
    for bn, warps in DEQUANT_SHAPES:
        same = bool(torch.equal(int4_gemm.dequantize(packed, sz, group, bn, warps), ref))
        ms = timed(lambda bn=bn, warps=warps: int4_gemm.dequantize(packed, sz, group, bn, warps))
        res.append({"proj": proj, "block_n": bn, "num_warps": warps, "ms": ms, "GB_per_s": moved / ms / 1e6,
                    "same_bits": same})
        print(f"{name:8s} dequantize {E} experts' {proj} [{n_out}, {n_in}] block_n={bn:3d} warps={warps}: "
              f"{ms:.3f} ms, {moved / ms / 1e6:.0f} GB/s, same bits: {same}", flush=True)
    return res


def bench_activation(name: str, inter: int, rows: int, n_blocks: int, gen) -> dict:
    """The activation over a layer's rows, a block at a time: the torch ops against the kernel."""
    gate_up = torch.randn((rows, 2 * inter), device="cuda", generator=gen).to(torch.bfloat16)
    ms_torch = timed(lambda: [F.silu(gate_up[:, :inter]) * gate_up[:, inter:] for _ in range(n_blocks)])
    ms_kernel = timed(lambda: [silu_mul.silu_mul(gate_up, inter, inter) for _ in range(n_blocks)])
    print(f"{name:8s} activation, {n_blocks} blocks of {rows} rows: torch ops {ms_torch:.3f} ms a layer, kernel "
          f"{ms_kernel:.3f} ms", flush=True)
    return {"torch_ms_per_layer": ms_torch, "kernel_ms_per_layer": ms_kernel}


result = {"tokens": T, "experts": E, "device": torch.cuda.get_device_name(), "models": {}}
gen = torch.Generator(device="cuda").manual_seed(0)
for name, hidden, k, rows, inter in MODELS:
    combine, moved, n_blocks = bench_combine(name, hidden, k, rows, gen)
    result["models"][name] = {
        "hidden": hidden, "k": k, "block_rows": rows, "blocks": n_blocks, "combine_min_bytes": moved,
        "combine": combine,
        "dequant": bench_dequant(name, "gate_up", 2 * inter, hidden) + bench_dequant(name, "down", hidden, inter),
        "activation": bench_activation(name, inter, rows, n_blocks, gen)}
with open(os.path.join(os.environ.get("OUT", "/tmp"), "long_moe_kernels.json"), "w") as f:
    json.dump(result, f, indent=1)
