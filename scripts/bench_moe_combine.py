"""The long MoE's combine kernel (orin.kernels.moe_combine) at launch shapes side by side, on the GPU: one layer's
blocks of expert-sorted rows at the talker's and the thinker's widths (the 2 fps video case: 25,159 tokens, random
routing over 128 experts, the blocks Int4Experts.add_long makes), each shape's time per layer and the bytes it
moves, and whether its sums are the default shape's bits.
Run on the lent GPU like scripts/bench_gpu.sh:
    python3 scripts/bench_moe_combine.py      # $OUT/moe_combine.json
"""
import json
import os
import sys

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402

from orin.kernels import moe_combine  # noqa: E402

T, E = 25159, 128
# (name, hidden, k, rows a block): the talker's blocks are LONG_MOE_BLOCK_ROWS (twice for its width, halved with
# every expert dequantized at once), the thinker's LONG_MOE_BLOCK_ROWS
MODELS = [("talker", 1024, 6, 32768), ("thinker", 2048, 8, 32768)]
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


def run(x, out, weights, inv, blocks, k, shape):
    y = x.clone()
    for lo, hi in blocks:
        moe_combine.combine_block(y, out[lo:hi], weights, inv, lo, k, *shape)
    return y


result = {"tokens": T, "experts": E, "device": torch.cuda.get_device_name(), "models": {}}
gen = torch.Generator(device="cuda").manual_seed(0)
for name, hidden, k, rows in MODELS:
    x, out, weights, inv, blocks = layer(hidden, k, rows, gen)
    # what a layer's combine must move at least: each block reads its rows and reads and writes every token's x
    moved = out.numel() * 2 + len(blocks) * x.numel() * 2 * 2
    want = run(x, out, weights, inv, blocks, k, (moe_combine.BLOCK_T, moe_combine.BLOCK_H, moe_combine.NUM_WARPS))
    res = []
    for shape in SHAPES:
        got = run(x, out, weights, inv, blocks, k, shape)  # compiles
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(REPS):
            run(x, out, weights, inv, blocks, k, shape)
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / REPS
        res.append({"block_t": shape[0], "block_h": shape[1], "num_warps": shape[2], "ms_per_layer": ms,
                    "GB_per_s": moved / ms / 1e6, "same_bits_as_default": bool(torch.equal(got, want))})
        print(f"{name:8s} T={T} k={k} H={hidden} {len(blocks)} blocks  block_t={shape[0]:2d} block_h={shape[1]:4d} "
              f"warps={shape[2]}: {ms:.3f} ms a layer, {moved / ms / 1e6:.0f} GB/s, same bits: "
              f"{res[-1]['same_bits_as_default']}", flush=True)
    result["models"][name] = {"hidden": hidden, "k": k, "block_rows": rows, "blocks": len(blocks),
                              "min_bytes": moved, "shapes": res}
with open(os.path.join(os.environ.get("OUT", "/tmp"), "moe_combine.json"), "w") as f:
    json.dump(result, f, indent=1)
