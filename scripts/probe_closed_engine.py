"""What a closed all-resident engine leaves on the device (issue 15: the first time-sliced engine after it held
3.4 GiB more than its budget). Runs the bench's all-resident part at the real dimensions (the standard request's
warm-up and measured run, the kernel timings and the profile), closes the engine as the bench does, then prints
what the allocator still holds: per memory pool, per segment, and for the blocks still allocated in segments
mostly free (what keeps empty_cache from handing those segments back) the Python stack that allocated them; and
whether any engine object outlived the close. Run on the lent GPU like scripts/bench_gpu.sh:
    python3 scripts/probe_closed_engine.py      # $OUT/closed_engine.json and .txt
PROBE_COMPILE=0 probes the uncompiled engine; PROBE_PARTS=requests skips the timings and the profile;
PROBE_SLICED=18GiB,17GiB then runs the bench's time-sliced part at those budgets (PROBE_RESIDENT=0: alone, in a
fresh process), printing what the process held from the driver per request.
"""
import collections
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.getcwd())
import torch  # noqa: E402

from devtools.bench_config import BenchConfig, bench_request, free, make_inputs  # noqa: E402
from devtools.bench_engine import _load_all, open_engine, profile_request, run_time_sliced, stream_request  # noqa: E402
from devtools.bench_kernels import decode_timings, prefill_timings  # noqa: E402
from devtools.synthetic import SyntheticConfig, write_synthetic_checkpoint  # noqa: E402
from orin.runtime.engine import EngineConfig  # noqa: E402
from orin.units import parse_bytes  # noqa: E402

out = os.environ.get("OUT", "/tmp")
ck = os.environ.get("PROFILE_CKPT", "/tmp/probe/ckpt")
CONFIG = os.environ.get("PROFILE_CONFIG", "tests/data/qwen3-omni-30b-a3b-instruct.config.json")
COMPILE = os.environ.get("PROBE_COMPILE", "1") == "1"
PARTS = os.environ.get("PROBE_PARTS", "all")
lines: list[str] = []
result: dict = {"alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "compile": COMPILE, "parts": PARTS}


def say(*a):
    print(*a, flush=True)
    lines.append(" ".join(str(x) for x in a))


def held(tag: str) -> dict:
    free_, total = torch.cuda.mem_get_info()
    fig = {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
           "device_used": total - free_}
    say(tag, {k: round(v / 2**30, 3) for k, v in fig.items()}, "GiB")
    result[tag] = fig
    return fig


def ours(frames) -> list[str]:
    keep = [f"{f['filename'].split('/site-packages/')[-1].split(os.getcwd() + '/')[-1]}:{f['line']} {f['name']}"
            for f in frames if "python" not in f["filename"] or "orin" in f["filename"] or "torch" in f["filename"]]
    return keep[:14]


if not os.path.exists(ck):
    t = time.perf_counter()
    write_synthetic_checkpoint(SyntheticConfig(config=CONFIG, out=ck, device="cuda", seed=0))
    say("write", round(time.perf_counter() - t, 1))
free("cuda")
held("start")
cfg = BenchConfig(engine=EngineConfig(model_dir="", device="cuda", power_backend="none"), config=CONFIG, synthetic=True)
inputs = make_inputs(cfg)


def resident_part() -> None:
    engine = open_engine(cfg, ck, None, COMPILE)
    _load_all(engine)
    held("loaded")
    stream_request(engine, bench_request(cfg, inputs), cancel_after_chunks=6)
    stream_request(engine, bench_request(cfg, inputs))
    for _ in range(3):
        stream_request(engine, bench_request(cfg, inputs, max_new_tokens=2, speech=False))
    held("after requests")
    if PARTS == "all":
        decode_timings(engine)
        prefill_timings(engine, prompt=engine.prepare(bench_request(cfg, inputs)))
        profile_request(engine, cfg, inputs)
        held("after timings and profile")
    engine.close()
    held("closed")


def leftovers() -> None:
    """What the allocator holds once the engine is gone, and who holds the large tensors still alive."""
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    pools: dict = collections.defaultdict(lambda: {"segments": 0, "total": 0, "allocated": 0})
    pinned = []
    for seg in snap["segments"]:
        p = pools[str(seg.get("segment_pool_id"))]
        p["segments"] += 1
        p["total"] += seg["total_size"]
        p["allocated"] += seg["allocated_size"]
        if seg["total_size"] - seg["allocated_size"] >= 2 << 20:
            live = [b for b in seg["blocks"] if b["state"] == "active_allocated"]
            pinned.append({"segment_bytes": seg["total_size"], "allocated": seg["allocated_size"],
                           "pool": str(seg.get("segment_pool_id")), "stream": seg.get("stream"),
                           "live": [{"size": b["size"], "stack": ours(b.get("frames", []))} for b in live[:6]]})
    result["pools"] = dict(pools)
    pinned.sort(key=lambda s: -s["segment_bytes"])
    result["pinned_segments"] = pinned[:40]
    say("pools", json.dumps(result["pools"]))
    for s in pinned[:40]:
        say("segment", s["segment_bytes"] >> 20, "MiB, allocated", s["allocated"] >> 10, "KiB, pool", s["pool"],
            "stream", s["stream"])
        for b in s["live"]:
            say("   live", b["size"], "bytes:", " <- ".join(b["stack"][:8]))
    gc.collect()
    names = ("Engine", "Loader", "StaticDecoder", "CodePredictor", "GraphRunner", "CUDAGraph", "EncoderGraphs",
             "MemPool", "UnitArena", "Thinker")
    alive = collections.Counter(type(o).__name__ for o in gc.get_objects() if type(o).__name__ in names)
    result["alive"] = dict(alive)
    say("alive", dict(alive))
    for t in gc.get_objects():
        if isinstance(t, torch.Tensor) and t.is_cuda and t.nbytes >= 16 << 20:
            say("live tensor", tuple(t.shape), t.dtype)
            for r in gc.get_referrers(t)[:3]:
                say("     referred by", type(r).__name__, "itself referred by",
                    [type(rr).__name__ for rr in gc.get_referrers(r)][:6], str(r)[:200] if isinstance(r, dict) else "")


if os.environ.get("PROBE_RESIDENT", "1") == "1":
    torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
    resident_part()
    free("cuda")
    held("freed")
    leftovers()

for budget in filter(None, os.environ.get("PROBE_SLICED", "").split(",")):
    summary = run_time_sliced(cfg, ck, inputs, say, parse_bytes(budget))
    result[f"sliced {budget}"] = {k: summary.get(k) for k in ("device_used_per_request", "peak_device_used_bytes",
                                                             "peak_reserved_bytes", "stage_memory")}
with open(os.path.join(out, "closed_engine.json"), "w") as f:
    json.dump(result, f, indent=1)
with open(os.path.join(out, "closed_engine.txt"), "w") as f:
    f.write("\n".join(lines) + "\n")
