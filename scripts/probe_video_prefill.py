"""Where the video case's peak and time go (issue 16), at the real dimensions: the bench's 120 s clip at 2 fps with
its soundtrack and one image, on an all-resident engine (no torch.compile, as the video bench runs), after a
warm-up. Then, on the measured request (cut at its first audio packet):
- memory: the allocator's history replayed to its peak, and the blocks alive at that moment grouped by the orin
  lines that allocated them (what to shrink to stay under 24 GiB);
- time: each prefill (thinker, talker) and encoder marked as a range, and the device's kernels summed within
  each range, by kernel name (what to make faster, and in which pass).
Run on the lent GPU like scripts/bench_gpu.sh:
    python3 scripts/probe_video_prefill.py      # $OUT/video_probe.json and .txt
PROBE_FPS (default 2) and PROBE_SECONDS (default 120) choose the clip.
"""
import collections
import json
import os
import sys
import time

ROOT = os.getcwd()
sys.path.insert(0, ROOT)
import torch  # noqa: E402

from devtools.bench_config import BenchConfig, bench_request, free, make_video_cases  # noqa: E402
from devtools.bench_engine import _load_all, open_engine, stream_request, warm_chunks  # noqa: E402
from devtools.synthetic import SyntheticConfig, write_synthetic_checkpoint  # noqa: E402
from orin.runtime.engine import EngineConfig  # noqa: E402

out = os.environ.get("OUT", "/tmp")
ck = os.environ.get("PROFILE_CKPT", "/tmp/probe/ckpt")
CONFIG = os.environ.get("PROFILE_CONFIG", "tests/data/qwen3-omni-30b-a3b-instruct.config.json")
lines: list[str] = []
result: dict = {}


def say(*a):
    print(*a, flush=True)
    lines.append(" ".join(str(x) for x in a))


def where(frames, n: int = 4) -> str:
    mine = [f"{f['filename'].split('/orin/')[-1]}:{f['line']} {f['name']}" for f in frames
            if "/orin/" in f["filename"] and "devtools" not in f["filename"]]
    return " <- ".join(mine[:n]) or "(outside orin)"


if not os.path.exists(ck):
    t = time.perf_counter()
    write_synthetic_checkpoint(SyntheticConfig(config=CONFIG, out=ck, device="cuda", seed=0))
    say("write", round(time.perf_counter() - t, 1))
cfg = BenchConfig(engine=EngineConfig(model_dir="", device="cuda", power_backend="none"), config=CONFIG, synthetic=True,
                  video_seconds=float(os.environ.get("PROBE_SECONDS", "120")),
                  video_fps=(float(os.environ.get("PROBE_FPS", "2")),))
case = make_video_cases(cfg)[0]
engine = open_engine(cfg, ck, None, False)
_load_all(engine)
t = time.perf_counter()
stream_request(engine, bench_request(cfg, case.inputs), cancel_after_chunks=warm_chunks(engine))
say("warm-up", round(time.perf_counter() - t, 1))
free("cuda")

# ---- memory: the measured request to its first audio packet, every allocation recorded
torch.cuda.reset_peak_memory_stats()
base = torch.cuda.memory_allocated()
torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
t = time.perf_counter()
report = stream_request(engine, bench_request(cfg, case.inputs), cancel_after_chunks=1).report
wall = time.perf_counter() - t
snap = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(enabled=None)
peak = torch.cuda.max_memory_allocated()
say("request", round(wall, 3), "s; allocated before", round(base / 2**30, 3), "GiB, peak", round(peak / 2**30, 3),
    "GiB; timeline", {k: round(v, 3) for k, v in report.timeline_s.items()})
result["timeline_s"] = report.timeline_s
result["peak_bytes"], result["base_bytes"] = peak, base
events = [e for trace in snap["device_traces"] for e in trace]
live: dict = {}
now = base
best, best_live = now, {}
for e in events:
    if e["action"] == "alloc":
        live[e["addr"]] = e
        now += e["size"]
        if now > best:
            best, best_live = now, dict(live)
    elif e["action"] in ("free_requested",) and e["addr"] in live:
        now -= live.pop(e["addr"])["size"]
groups = collections.Counter()
for e in best_live.values():
    groups[where(e.get("frames", []))] += e["size"]
say("replayed peak", round(best / 2**30, 3), "GiB = before", round(base / 2**30, 3), "+ request's",
    round((best - base) / 2**30, 3), "GiB, of which:")
result["at_peak"] = []
for name, size in groups.most_common(25):
    say(f"  {size / 2**20:9.1f} MiB  {name}")
    result["at_peak"].append({"bytes": size, "where": name})
# what was allocated before the request (weights, caches, graph pools), by where: from the snapshot's segments
before = collections.Counter()
for seg in snap["segments"]:
    for b in seg["blocks"]:
        if b["state"] == "active_allocated":
            before[where(b.get("frames", []), 2)] += b["size"]
result["held_after"] = [{"bytes": s, "where": n} for n, s in before.most_common(15)]
say("held when the request was cut:", [(round(s / 2**20), n) for n, s in before.most_common(8)])

# ---- the talker's start, step by step, unprofiled: the device synchronized at each step's edges (it is idle there
# but for the prefill), so each step's time is its own; the decoder's prefill also timed to its return (the host's
# launches) apart from its end on the device
from orin.model import positions as positions_mod  # noqa: E402
from orin.runtime import decode  # noqa: E402
from orin.runtime import talker as talker_mod  # noqa: E402

steps = collections.defaultdict(list)


def timed(owner, name, label, returned=False):
    fn = getattr(owner, name)

    def wrapper(*a, **k):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        y = fn(*a, **k)
        if returned:
            steps[label + " (host, to its return)"].append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        steps[label].append(time.perf_counter() - t0)
        return y
    setattr(owner, name, wrapper)
    return owner, name, fn


undo = [timed(talker_mod.Talker, "_user_part", "user part"),
        timed(talker_mod.Talker, "_assistant_part", "assistant part"),
        timed(positions_mod, "mrope_positions", "positions"),
        timed(decode.StaticDecoder, "prefill", "decoder prefill", returned=True),
        timed(talker_mod.Talker, "_after_forward", "first code"),
        timed(talker_mod.Talker, "prefill", "talker prefill, all")]
report = stream_request(engine, bench_request(cfg, case.inputs), cancel_after_chunks=1).report
for owner, name, fn in undo:
    setattr(owner, name, fn)
result["talker_steps_s"] = {k: v for k, v in steps.items()}
say("talker start, unprofiled, synchronized at each step's edges (s; the thinker's calls first):",
    {k: [round(x, 4) for x in v] for k, v in steps.items()})
free("cuda")

# ---- time: ranges around each prefill and encoder, kernels summed within each
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

marked = []
current = ["-"]
layer_peaks = collections.defaultdict(list)  # range -> the allocator's peak over each long-prefill block


def mark(owner, name, label):
    fn = getattr(owner, name)

    def wrapper(self, *a, **k):
        which = label(self) if callable(label) else label
        was, current[0] = current[0], which
        try:
            with record_function(f"range:{which}"):
                return fn(self, *a, **k)
        finally:
            current[0] = was
    setattr(owner, name, wrapper)
    marked.append((owner, name, fn))


def peaks(module, name):
    fn = getattr(module, name)

    def wrapper(*a, **k):
        torch.cuda.reset_peak_memory_stats()
        y = fn(*a, **k)
        layer_peaks[current[0]].append((name, torch.cuda.max_memory_allocated()))
        return y
    setattr(module, name, wrapper)
    marked.append((module, name, fn))


mark(decode.StaticDecoder, "prefill",
     lambda dec: "thinker_prefill" if dec is engine.decoders._made.get("thinker") else "talker_prefill")
mark(talker_mod.Talker, "prefill", "talker_whole")
mark(talker_mod.Talker, "_user_part", "talker_user_part")
mark(talker_mod.Talker, "_assistant_part", "talker_assistant_part")
mark(talker_mod.Talker, "_after_forward", "talker_after_forward")
mark(decode.StaticDecoder, "_alloc",
     lambda dec: "thinker_alloc" if dec is engine.decoders._made.get("thinker") else "talker_alloc")
mark(positions_mod, "mrope_positions", "mrope_positions")
for mod in ("vision_encoder", "audio_encoder"):
    m = __import__(f"orin.model.{mod}", fromlist=["x"])
    for cls in vars(m).values():
        if isinstance(cls, type) and issubclass(cls, torch.nn.Module) and cls.__module__ == m.__name__ and \
                cls.__name__.endswith("Encoder"):
            mark(cls, "forward", mod)
peaks(decode, "attention_block_long")
peaks(decode, "mlp_block_long")
free("cuda")
torch.cuda.synchronize()
# every host wait for the GPU, by range and the line that made it (torch's sync check warns once per call)
syncs = collections.Counter()


def on_warning(message, category, filename, lineno, file=None, line=None):
    if "synchroniz" in str(message):
        syncs[(current[0], f"{os.path.relpath(filename, ROOT) if filename.startswith(ROOT) else filename}:{lineno}")] += 1


import warnings  # noqa: E402

with warnings.catch_warnings():
    warnings.simplefilter("always")
    warnings.showwarning = on_warning
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            stream_request(engine, bench_request(cfg, case.inputs), cancel_after_chunks=1)
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
for owner, name, fn in marked:
    setattr(owner, name, fn)
evs = prof.events()


def descendants(e):
    for c in e.cpu_children:
        yield c
        yield from descendants(c)


result["ranges"] = {}
gpu_events = sorted((e for e in evs if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
for label in sorted({e.name[6:] for e in evs if e.name.startswith("range:")}):
    tops = [e for e in evs if e.name == f"range:{label}" and e.device_type.name == "CPU"]
    launched = [(op.name, k) for r in tops for op in [r, *descendants(r)] for k in op.kernels]
    inside = [k for _, k in launched]
    total = sum(k.duration for k in inside)
    by = collections.defaultdict(lambda: [0, 0.0])
    by_op = collections.defaultdict(lambda: [0, 0.0])
    for op, k in launched:
        by[k.name[:90]][0] += 1
        by[k.name[:90]][1] += k.duration
        by_op[(op, k.name[:60])][0] += 1
        by_op[(op, k.name[:60])][1] += k.duration
    span_us = sum(r.time_range.elapsed_us() for r in tops)
    # the GPU's idle time inside the range: its span on the device timeline (the range's GPU annotation) minus
    # the union of the kernels and copies within it; None where the profiler made no annotation
    idle = None
    on_device = collections.defaultdict(lambda: [0, 0.0])  # every kernel in the window, Triton's too, by name
    for a in (e for e in gpu_events if e.name == f"range:{label}"):
        idle, end = idle or 0, a.time_range.start
        for e in gpu_events:
            if e.name.startswith("range:") or e.time_range.start < a.time_range.start \
                    or e.time_range.start >= a.time_range.end:
                continue
            idle += max(0, e.time_range.start - end)
            end = max(end, e.time_range.end)
            on_device[e.name[:90]][0] += 1
            on_device[e.name[:90]][1] += e.time_range.elapsed_us()
        idle += max(0, a.time_range.end - end)
    # where the host's range and the device's differ: host time before the range's first kernel ran, and after
    # its last one
    lead = tail = None
    for r, a in zip(tops, (e for e in gpu_events if e.name == f"range:{label}"), strict=False):
        lead = (lead or 0) + a.time_range.start - r.time_range.start
        tail = (tail or 0) + r.time_range.end - a.time_range.end
    top = sorted(by.items(), key=lambda kv: -kv[1][1])[:25]
    result["ranges"][label] = {"calls": len(tops), "cpu_span_ms": span_us / 1e3, "kernel_ms": total / 1e3,
                               "kernels": len(inside), "gpu_idle_ms": None if idle is None else idle / 1e3,
                               "gpu_lead_ms": None if lead is None else lead / 1e3,
                               "host_tail_ms": None if tail is None else tail / 1e3,
                               "syncs": {w: c for (r, w), c in syncs.items() if r == label},
                               "top": [{"name": n, "calls": c, "ms": us / 1e3} for n, (c, us) in top]}
    say(f"{label}: {len(tops)} call(s), host span {span_us / 1e3:.1f} ms, kernels {total / 1e3:.1f} ms in "
        f"{len(inside)} launches; GPU idle between them {'n/a' if idle is None else f'{idle / 1e3:.1f} ms'}; host syncs "
        f"{sum(c for (r, _), c in syncs.items() if r == label)}; its first kernel "
        f"{'n/a' if lead is None else f'{lead / 1e3:.1f} ms'} after the host's start, its last "
        f"{'n/a' if tail is None else f'{tail / 1e3:.1f} ms'} before the host's end")
    for (r, w), c in sorted(syncs.items(), key=lambda kv: -kv[1]):
        if r == label:
            say(f"   sync {c:5d}x  {w}")
    if on_device:
        say(f"  on the device in the range's window: {sum(us for _, us in on_device.values()) / 1e3:.1f} ms of kernels:")
        result["ranges"][label]["on_device"] = {n: {"calls": c, "ms": us / 1e3} for n, (c, us) in on_device.items()}
        for n, (c, us) in sorted(on_device.items(), key=lambda kv: -kv[1][1])[:15]:
            say(f"   {us / 1e3:8.2f} ms {c:6d}x  {n}")
    for n, (c, us) in top:
        say(f"   {us / 1e3:8.2f} ms {c:6d}x  {n}")
    # the host's time: the ops Python called directly, by name, and what is left (Python itself, Triton launches)
    host_ops = collections.defaultdict(lambda: [0, 0.0])
    for r in tops:
        for c in r.cpu_children:
            host_ops[c.name][0] += 1
            host_ops[c.name][1] += c.time_range.elapsed_us()
    in_ops = sum(us for _, us in host_ops.values())
    result["ranges"][label]["host_ops"] = {n: {"calls": c, "ms": us / 1e3} for n, (c, us) in host_ops.items()}
    say(f"  host: {in_ops / 1e3:.1f} ms in ops Python called, {(span_us - in_ops) / 1e3:.1f} ms outside them "
        "(Python, Triton launches); the ops by host time:")
    for n, (c, us) in sorted(host_ops.items(), key=lambda kv: -kv[1][1])[:25]:
        say(f"   {us / 1e3:8.2f} ms {c:6d}x  {n}")
    say("  by the op that launched them:")
    top_op = sorted(by_op.items(), key=lambda kv: -kv[1][1])[:30]
    result["ranges"][label]["by_op"] = [{"op": o, "kernel": n, "calls": c, "ms": us / 1e3}
                                        for (o, n), (c, us) in top_op]
    for (o, n), (c, us) in top_op:
        say(f"   {us / 1e3:8.2f} ms {c:6d}x  {o:28s} {n}")
for label, seq in layer_peaks.items():
    gib = [round(b / 2**30, 3) for _, b in seq]
    say(f"{label}: allocator peak per long-prefill block (GiB, attention and MLP alternating):", gib)
result["layer_peaks"] = {k: v for k, v in layer_peaks.items()}
with open(os.path.join(out, "video_probe.json"), "w") as f:
    json.dump(result, f, indent=1, default=str)
with open(os.path.join(out, "video_probe.txt"), "w") as f:
    f.write("\n".join(lines) + "\n")
engine.close()
