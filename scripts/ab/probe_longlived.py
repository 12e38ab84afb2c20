#!/usr/bin/env python3
"""Defect 2 probe: why does the compiled engine decode slower in a long-lived process than in a fresh one?

Reported: 211 thinker tokens/s when the compiled engine ran after HF and the graph engine in one process, 233-237
alone on the same machine; 4.62 against 4.0 ms wall per step, GPU time 3.5 ms in both. So the host side of a
step is what grows. This script, in ONE process (about 3.5-4 minutes on an H200 with the checkpoint present, ~2
more to write it):

  F   the compiled engine, fresh: load, warm-up, the standard request (its thinker tokens/s, as the bench reports),
      then STEPS thinker decode steps timed one by one: host wall per step, the graph's device span per step (CUDA
      events around the replay), and host overhead = wall - span; plus host micro-benchmarks (a Python call, a
      CUDA launch, an idle sync, a 1-kernel graph replay + sync, a meter stage) and a state snapshot (threads with
      their CPU time during the steps, child processes, gc, allocator, dynamo, CPU affinity/frequency, CUPTI).
  F+P the same engine after one bare torch.profiler session (CUDA activity), as bench_kernels.profile_steps runs.
  F+K the same engine after the bench's kernel timings (decode_timings: fresh decoders compiled, profiled; and
      prefill_timings).
  H   (engine closed, bench_config.free) the HF BF16 reference, short (32 tokens, 8 frames), as run_hf runs it.
  G   the graph engine exactly as `bench` runs it (run_all_resident, compile off: load, warm-up, standard request,
      short requests, kernel timings with the profiler), closed.
  L   the compiled engine again, in this long-lived process: as F.
  L+gc   after gc.collect() + gc.freeze().
  L+cupti after a profiler session with TEARDOWN_CUPTI=1 (kineto then calls cuptiFinalize at its stop): whether
      detaching CUPTI gives the fresh speed back. Last, because CUPTI teardown with live CUDA graphs has crashed
      older CUDA; --no-teardown skips it.

Reading it: if F+P or F+K already has L's per-step overhead, the profiler (CUPTI left attached: kineto only calls
cuptiFinalize with TEARDOWN_CUPTI=1) is enough to explain it; if the device span grows, it is device side (CUPTI
instrumenting the graph's kernels); if wall - span grows and a thread or child process shows CPU time during the
steps, it is that thread; if gc pauses show during the request, it is the heap; if the Python-call micro-bench
slows, it is the interpreter (CPU frequency, an eval-frame hook, a trace function).

Runs against the code in the current directory (run it from the tree's root, e.g. `cd .base`), imports below.
  python3 probe_longlived.py [--model-dir /tmp/orin-ab/ckpt] [--json probe.json] [--skip-hf] [--steps 200]
A missing checkpoint is written first (synthetic, as bench --synthetic). --config tiny --device cpu is a smoke test.
"""

from __future__ import annotations

import argparse
import gc

# ---------------------------------------------------------------------------------------------------------------
# The code under test: every import of the project is here. When the module paths change, edit only this block
# (the first name that imports wins: today's orin.devtools.*, then a top-level devtools.* package).
import importlib
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path


def _first(*names):
    errors = []
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise ImportError("; ".join(errors))


_bench_config = _first("orin.devtools.bench_config", "devtools.bench_config")
_bench_engine = _first("orin.devtools.bench_engine", "devtools.bench_engine")
_bench_kernels = _first("orin.devtools.bench_kernels", "devtools.bench_kernels")
_bench_hf = _first("orin.devtools.bench_hf", "devtools.bench_hf")
_synthetic = _first("orin.devtools.synthetic", "devtools.synthetic")
BenchConfig = _bench_config.BenchConfig
make_inputs, bench_request, free = _bench_config.make_inputs, _bench_config.bench_request, _bench_config.free
open_engine, load_all = _bench_engine.open_engine, _bench_engine._load_all
stream_request, warm_chunks = _bench_engine.stream_request, _bench_engine.warm_chunks
summarize_engine, run_all_resident = _bench_engine.summarize_engine, _bench_engine.run_all_resident
decode_timings, prefill_timings = _bench_kernels.decode_timings, _bench_kernels.prefill_timings
run_hf = _bench_hf.run_hf
SyntheticConfig, write_synthetic_checkpoint = _synthetic.SyntheticConfig, _synthetic.write_synthetic_checkpoint
try:  # the layer function torch.compile wraps (for its dynamo cache entries); optional
    decoder_layer = _first("orin.decoder_layer").decoder_layer
except ImportError:
    decoder_layer = None


def make_cfg(args) -> BenchConfig:
    """The bench's settings for the standard request (scripts/bench_gpu.sh's), on an existing checkpoint."""
    return BenchConfig(config=args.config, model_dir=args.model_dir, synthetic=True,  # synthetic: no re-hashing
                       device=args.device, power_backend=args.power_backend, packed_cache=args.packed_cache,
                       audio_seconds=30.0, images=1, text_tokens=256, audio_frames=100, profile=False, skip_hf=True)


def thinker_decoder(engine):
    return engine.decoders.thinker  # orin.decode.StaticDecoder (runner: orin.graph_runner.GraphRunner)


def meter_of(engine):
    return engine.meter  # orin.power.meter.PowerMeter
# ---------------------------------------------------------------------------------------------------------------

LOG: list[str] = []
T_START = time.perf_counter()


def log(msg: str) -> None:
    line = f"[probe +{time.perf_counter() - T_START:6.1f}s] {msg}"
    LOG.append(line)
    print(line, flush=True)


def _torch():
    import torch

    return torch


def cuda(cfg) -> bool:
    torch = _torch()
    return cfg.device in ("auto", "cuda") and torch.cuda.is_available()


# ------------------------------------------------------------------ state: threads, processes, gc, memory, ...

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(path: str):
    """(comm, cpu seconds, ppid) from a /proc .../stat file."""
    try:
        raw = Path(path).read_text()
    except OSError:
        return None
    comm = raw[raw.index("(") + 1:raw.rindex(")")]
    rest = raw[raw.rindex(")") + 2:].split()
    return comm, (int(rest[11]) + int(rest[12])) / _TICK, int(rest[1])


def threads_cpu() -> dict[int, tuple[str, float]]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        st = _stat(f"/proc/self/task/{tid}/stat")
        if st:
            out[int(tid)] = (st[0], st[1])
    return out


def children_cpu() -> dict[int, tuple[str, float]]:
    """Every descendant process of this one: compile workers, a realtime client, ..."""
    procs = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            st = _stat(f"/proc/{pid}/stat")
            if st:
                procs[int(pid)] = st
    me, out = os.getpid(), {}
    for pid, (comm, cpu, ppid) in procs.items():
        p, seen = ppid, 0
        while p and p in procs and seen < 64:
            if p == me:
                out[pid] = (comm, cpu)
                break
            p, seen = procs[p][2], seen + 1
    return out


def cpu_deltas(before: dict, after: dict, floor_s: float = 0.005) -> list[dict]:
    main = threading.get_native_id()
    rows = []
    for tid, (name, cpu) in after.items():
        d = cpu - before.get(tid, (name, 0.0))[1]
        if d >= floor_s:
            rows.append({"id": tid, "name": name, "cpu_s": round(d, 4), "main": tid == main})
    return sorted(rows, key=lambda r: -r["cpu_s"])


def cpu_freq() -> dict:
    mhz = []
    try:
        mhz = [float(line.split(":")[1]) for line in Path("/proc/cpuinfo").read_text().splitlines()
               if line.startswith("cpu MHz")]
    except OSError:
        pass
    cur = []
    for p in sorted(Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cpufreq/scaling_cur_freq")):
        try:
            cur.append(int(p.read_text()) / 1e3)
        except OSError:
            pass
    return {"cpuinfo_mhz": [min(mhz), statistics.mean(mhz), max(mhz)] if mhz else None,
            "scaling_cur_mhz": [min(cur), statistics.mean(cur), max(cur)] if cur else None,
            "affinity": sorted(os.sched_getaffinity(0)), "loadavg": os.getloadavg()}


def gpu_processes() -> list[str]:
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10).stdout
        return [line.strip() for line in out.splitlines() if line.strip()]
    except Exception as exc:  # noqa: BLE001
        return [f"nvidia-smi failed: {exc}"]


def snapshot(cfg, label: str, objects: bool = True) -> dict:
    torch = _torch()
    snap: dict = {"label": label, "t": round(time.perf_counter() - T_START, 1)}
    snap["py_threads"] = sorted(f"{t.name}{' (daemon)' if t.daemon else ''}" for t in threading.enumerate())
    snap["native_threads"] = sorted(name for name, _ in threads_cpu().values())
    snap["native_thread_count"] = len(snap["native_threads"])
    snap["children"] = sorted(f"{pid}:{name}" for pid, (name, _) in children_cpu().items())
    snap["gc"] = {"enabled": gc.isenabled(), "count": gc.get_count(), "threshold": gc.get_threshold(),
                  "frozen": gc.get_freeze_count(), "collections": [s["collections"] for s in gc.get_stats()]}
    if objects:
        snap["gc"]["objects_per_gen"] = [len(gc.get_objects(generation=g)) for g in range(3)]
    snap["cpu"] = cpu_freq()
    snap["torch"] = {"num_threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
                     "switch_interval": sys.getswitchinterval(), "trace": sys.gettrace() is not None,
                     "profile_fn": sys.getprofile() is not None}
    snap["env"] = {k: os.environ.get(k) for k in ("TEARDOWN_CUPTI", "DISABLE_CUPTI_LAZY_REINIT", "OMP_NUM_THREADS",
                                                   "PYTORCH_CUDA_ALLOC_CONF", "CUDA_LAUNCH_BLOCKING") if k in os.environ}
    try:
        maps = Path("/proc/self/maps").read_text()
        snap["libs_loaded"] = {lib: lib in maps for lib in ("libcupti", "libkineto", "libnvperf", "libgomp", "libiomp",
                                                             "libopenblas", "onnxruntime")}
    except OSError:
        pass
    if cuda(cfg):
        s = torch.cuda.memory_stats()
        keep = ("allocated_bytes.all.current", "reserved_bytes.all.current", "active.all.current",
                "segment.all.current", "inactive_split.all.current", "num_alloc_retries", "num_device_alloc",
                "num_device_free")
        snap["cuda_memory"] = {k: s.get(k) for k in keep}
        free_b, total_b = torch.cuda.mem_get_info()
        snap["cuda_memory"]["driver_used_bytes"] = total_b - free_b
        snap["gpu_processes"] = gpu_processes()
    dyn: dict = {"loaded": "torch._dynamo" in sys.modules}
    if dyn["loaded"]:
        import torch._dynamo

        cfgd = torch._dynamo.config
        dyn["recompile_limit"] = getattr(cfgd, "recompile_limit", getattr(cfgd, "cache_size_limit", None))
        try:
            from torch._dynamo.utils import counters

            dyn["counters"] = {k: sum(v.values()) for k, v in counters.items()}
            dyn["unique_graphs"] = counters["stats"].get("unique_graphs")
        except Exception as exc:  # noqa: BLE001
            dyn["counters"] = f"{type(exc).__name__}: {exc}"
        if decoder_layer is not None:
            try:
                from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

                dyn["decoder_layer_cache_entries"] = len(_debug_get_cache_entry_list(decoder_layer.__code__))
            except Exception as exc:  # noqa: BLE001
                dyn["decoder_layer_cache_entries"] = f"{type(exc).__name__}"
    if "torch._inductor.config" in sys.modules:
        dyn["inductor_compile_threads"] = sys.modules["torch._inductor.config"].compile_threads
    dyn["async_compile_loaded"] = "torch._inductor.async_compile" in sys.modules
    snap["dynamo"] = dyn
    return snap


# ------------------------------------------------------------------ measurements

class GcClock:
    """gc pauses (seconds, count) per generation while installed."""

    def __init__(self):
        self.s = [0.0, 0.0, 0.0]
        self.n = [0, 0, 0]
        self._t = 0.0

    def __call__(self, phase, info):
        if phase == "start":
            self._t = time.perf_counter()
        else:
            g = info.get("generation", 2)
            self.s[g] += time.perf_counter() - self._t
            self.n[g] += 1

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)

    def figures(self) -> dict:
        return {"pause_s": [round(x, 4) for x in self.s], "collections": list(self.n)}


class _TimedGraph:
    """Stands in for the runner's CUDAGraph: CUDA events around each replay (the graph's device span)."""

    def __init__(self, graph):
        self.graph = graph
        self.events: list = []

    def replay(self):
        torch = _torch()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        self.graph.replay()
        e.record()
        self.events.append((s, e))


def _stats_ms(xs: list[float]) -> dict:
    if not xs:
        return {}
    xs = sorted(xs)
    return {"median_ms": round(statistics.median(xs), 4), "mean_ms": round(statistics.fmean(xs), 4),
            "p10_ms": round(xs[len(xs) // 10], 4), "p90_ms": round(xs[(len(xs) * 9) // 10], 4),
            "max_ms": round(xs[-1], 4)}


def step_bench(engine, cfg, steps: int) -> dict:
    """`steps` thinker decode steps (StaticDecoder.step: fills, graph replay, stream sync) from a fixed cache
    position, timed one by one: plain (wall only), then with events around each replay (device span)."""
    torch = _torch()
    dec = thinker_decoder(engine)
    if not getattr(dec, "k_cache", None):
        return {"error": "the thinker decoder has no cache yet"}
    base = max(0, min(dec.length, dec.max_len - steps - 2))
    out: dict = {"steps": steps, "from_position": base, "max_len": dec.max_len}
    is_cuda = cuda(cfg)
    before_t, before_c = threads_cpu(), children_cpu()
    with torch.inference_mode(), GcClock() as gcc:
        dec.length = base
        dec.step(1)  # the graph's fingerprint check, outside the timing
        for mode in ("plain", "events"):
            dec.length = base
            runner = dec.runner
            proxy = None
            if mode == "events":
                if not (is_cuda and runner._graph is not None):
                    break
                proxy = runner._graph = _TimedGraph(runner._graph)
            walls = []
            try:
                if is_cuda:
                    torch.cuda.synchronize()
                for _ in range(steps):
                    t = time.perf_counter()
                    dec.step(1)
                    walls.append((time.perf_counter() - t) * 1e3)
                if is_cuda:
                    torch.cuda.synchronize()
            finally:
                if proxy is not None:
                    runner._graph = proxy.graph
            out[f"{mode}_wall"] = _stats_ms(walls)
            if proxy is not None:
                spans = [s.elapsed_time(e) for s, e in proxy.events]
                out["events_span"] = _stats_ms(spans)
                out["events_host_overhead"] = _stats_ms([w - s for w, s in zip(walls, spans, strict=True)])
    out["gc"] = gcc.figures()
    out["threads_cpu"] = cpu_deltas(before_t, threads_cpu())[:8]
    out["children_cpu"] = cpu_deltas(before_c, children_cpu())[:8]
    return out


_TINY: dict = {}


def micro(cfg, engine=None) -> dict:
    """Host costs that a decode step is made of, without the model."""
    torch = _torch()
    out = {}

    def f():
        return None

    t = time.perf_counter()
    for _ in range(200_000):
        f()
    out["python_call_ns"] = round((time.perf_counter() - t) / 200_000 * 1e9, 1)
    if cuda(cfg):
        dev = torch.device("cuda")
        x = torch.zeros(1, device=dev)
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(2000):
            x.add_(1)
        torch.cuda.synchronize()
        out["launch_us"] = round((time.perf_counter() - t) / 2000 * 1e6, 2)
        t = time.perf_counter()
        for _ in range(2000):
            torch.cuda.synchronize()
        out["idle_sync_us"] = round((time.perf_counter() - t) / 2000 * 1e6, 2)
        if "graph" not in _TINY:  # captured once (as orin.graph_runner does: no torch.cuda.graph(), no gc/empty_cache)
            y = torch.zeros(1, device=dev)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                y.add_(1)
                g = torch.cuda.CUDAGraph()
                g.capture_begin()
                y.add_(1)
                g.capture_end()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            _TINY.update(graph=g, y=y)
        g = _TINY["graph"]
        stream = torch.cuda.current_stream()
        t = time.perf_counter()
        for _ in range(2000):
            g.replay()
            stream.synchronize()
        out["tiny_graph_replay_sync_us"] = round((time.perf_counter() - t) / 2000 * 1e6, 2)
    if engine is not None:
        meter = meter_of(engine)
        try:
            with meter.measure("probe"):
                t = time.perf_counter()
                for _ in range(1000):
                    with meter.stage("probe", edge_reads=False):
                        pass
                out["meter_stage_us"] = round((time.perf_counter() - t) / 1000 * 1e6, 2)
        except Exception as exc:  # noqa: BLE001
            out["meter_stage_us"] = f"{type(exc).__name__}: {exc}"
    return out


def request(engine, cfg, inputs) -> dict:
    """The bench's measured standard request (its figures as bench_engine.summarize_engine gives them), with the
    gc pauses and the threads' CPU time during it."""
    before_t, before_c = threads_cpu(), children_cpu()
    with GcClock() as gcc:
        t = time.perf_counter()
        report = stream_request(engine, bench_request(cfg, inputs)).report
        wall = time.perf_counter() - t
    s = summarize_engine(report, "probe")
    keep = ("ttft_s", "first_audio_s", "decode_tokens_per_s", "decode_e2e_tokens_per_s", "talker_frames_per_s",
            "energy_j", "total_s", "stages_s", "peak_bytes")
    out = {k: s.get(k) for k in keep}
    think = (s.get("stages_s") or {}).get("thinker_decode")
    out["thinker_ms_per_step"] = round(think / max(1, report.completion_tokens - 1) * 1e3, 4) if think else None
    out["wall_s"] = round(wall, 3)
    out["gc"] = gcc.figures()
    out["threads_cpu"] = cpu_deltas(before_t, threads_cpu())[:8]
    out["children_cpu"] = cpu_deltas(before_c, children_cpu())[:8]
    return out


def measure(engine, cfg, inputs, steps: int, label: str, results: dict, with_request: bool = True) -> dict:
    entry = {}
    if with_request:
        entry["request"] = request(engine, cfg, inputs)
    entry["steps"] = step_bench(engine, cfg, steps)
    entry["micro"] = micro(cfg, engine)
    entry["state"] = snapshot(cfg, label)
    results["phases"][label] = entry
    r, st = entry.get("request") or {}, entry["steps"]
    log(f"{label}: request {r.get('decode_tokens_per_s') or 0:.1f} tok/s ({r.get('thinker_ms_per_step')} ms/step), "
        f"talker {r.get('talker_frames_per_s') or 0:.1f} fr/s, ttft {r.get('ttft_s') or 0:.3f} s; steps wall "
        f"{st.get('plain_wall', {}).get('median_ms')} ms, span {st.get('events_span', {}).get('median_ms')} ms, host "
        f"{st.get('events_host_overhead', {}).get('median_ms')} ms; micro {entry['micro']}; gc during request "
        f"{r.get('gc')}; busy threads {[(x['name'], x['cpu_s']) for x in st.get('threads_cpu', []) if not x['main']][:4]}")
    return entry


def compiled_engine(cfg, model_dir: str, inputs, results: dict, key: str):
    t = time.perf_counter()
    engine = open_engine(cfg, model_dir, None, True)
    loaded = load_all(engine)
    warm = stream_request(engine, bench_request(cfg, inputs), cancel_after_chunks=warm_chunks())
    results.setdefault("engines", {})[key] = {"open_load_s": round(loaded["load_s"], 2),
                                              "packed_written": loaded.get("packed_written"),
                                              "warm_ttft_s": warm.report.ttft_s,
                                              "ready_s": round(time.perf_counter() - t, 1),
                                              "decoders": engine.decoder_stats()}
    log(f"compiled engine ({key}) ready in {time.perf_counter() - t:.1f} s (load {loaded['load_s']:.1f} s)")
    return engine


def close(engine, cfg) -> None:
    engine.close()
    del engine
    free(cfg.device)


def write(results: dict, path: str | None) -> None:
    results["log"] = LOG
    results["elapsed_s"] = round(time.perf_counter() - T_START, 1)
    if path:
        tmp = Path(path).with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=1, default=str))
        tmp.replace(path)


def summary(results: dict) -> None:
    print("\n=== probe summary: per phase (request = the bench's figures; steps = thinker decode steps timed alone)")
    head = (f"{'phase':<10} {'tok/s':>7} {'ms/step':>8} {'fr/s':>6} {'ttft':>6} | {'wall':>6} {'span':>6} {'host':>6} | "
            f"{'py ns':>6} {'launch':>7} {'sync':>6} {'tiny':>6} {'stage':>6} | {'gc req s':>9} | busy threads / children")
    print(head)
    for label, e in results["phases"].items():
        r, s, m = e.get("request") or {}, e.get("steps") or {}, e.get("micro") or {}
        busy = [f"{x['name']}:{x['cpu_s']}" for x in s.get("threads_cpu", []) if not x["main"]][:3]
        busy += [f"child {x['name']}:{x['cpu_s']}" for x in s.get("children_cpu", [])][:2]

        def g(d, k):
            v = d.get(k)
            return "-" if v is None else (f"{v:.1f}" if isinstance(v, float) and v >= 10 else
                                          f"{v:.3f}" if isinstance(v, float) else str(v))

        print(f"{label:<10} {g(r, 'decode_tokens_per_s'):>7} {g(r, 'thinker_ms_per_step'):>8} "
              f"{g(r, 'talker_frames_per_s'):>6} {g(r, 'ttft_s'):>6} | "
              f"{g(s.get('plain_wall', {}), 'median_ms'):>6} {g(s.get('events_span', {}), 'median_ms'):>6} "
              f"{g(s.get('events_host_overhead', {}), 'median_ms'):>6} | {g(m, 'python_call_ns'):>6} "
              f"{g(m, 'launch_us'):>7} {g(m, 'idle_sync_us'):>6} {g(m, 'tiny_graph_replay_sync_us'):>6} "
              f"{g(m, 'meter_stage_us'):>6} | {sum((r.get('gc') or {}).get('pause_s', [0])):>9.4f} | {', '.join(busy)}")
    print("\nstate per phase: threads / children / gc objects (gen0,1,2; frozen) / allocator segments / dynamo "
          "entries / CPU MHz / CUPTI loaded")
    for label, e in results["phases"].items():
        st = e.get("state") or {}
        gcs, mem, dyn = st.get("gc", {}), st.get("cuda_memory", {}), st.get("dynamo", {})
        print(f"{label:<10} threads {st.get('native_thread_count')} (py {len(st.get('py_threads', []))}), children "
              f"{len(st.get('children', []))}, gc {gcs.get('objects_per_gen')} frozen {gcs.get('frozen')}, segments "
              f"{mem.get('segment.all.current')}, reserved {((mem.get('reserved_bytes.all.current') or 0) / 2**30):.2f} GiB, "
              f"dynamo {dyn.get('decoder_layer_cache_entries')}, cpu {st.get('cpu', {}).get('cpuinfo_mhz')}, cupti "
              f"{(st.get('libs_loaded') or {}).get('libcupti')}")
    ph = results["phases"]
    if "F" in ph and "L" in ph:
        def ms(label):
            return ((ph[label].get("request") or {}).get("thinker_ms_per_step"),
                    (ph[label].get("steps") or {}).get("plain_wall", {}).get("median_ms"))
        print(f"\nfresh F {ms('F')} vs long-lived L {ms('L')} (request ms/step, steps wall ms); after profiler F+P "
              f"{ms('F+P') if 'F+P' in ph else '-'}; after kernels F+K {ms('F+K') if 'F+K' in ph else '-'}; remedies "
              + ", ".join(f"{k} {ms(k)}" for k in ph if k.startswith("L+")))
        newt = sorted(set(ph["L"]["state"].get("native_threads", [])) - set(ph["F"]["state"].get("native_threads", [])))
        print(f"native threads in L not in F: {newt}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default="/tmp/orin-ab/ckpt")
    ap.add_argument("--config", default="tests/data/qwen3-omni-30b-a3b-instruct.config.json",
                    help="written from this if --model-dir has no checkpoint")
    ap.add_argument("--packed-cache", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--power-backend", default="nvml")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-graph", action="store_true")
    ap.add_argument("--no-teardown", action="store_true", help="skip the CUPTI teardown remedy")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch = _torch()
    results: dict = {"args": vars(args), "phases": {}, "errors": {}}
    if not (Path(args.model_dir) / "manifest.json").exists():
        log(f"no checkpoint in {args.model_dir}: writing the synthetic one (about 45 s on a GPU)")
        write_synthetic_checkpoint(SyntheticConfig(config=args.config, out=args.model_dir, device=args.device,
                                                   seed=0, force=True), log=lambda m: log(m))
        os.sync()
    if args.device == "cpu" and args.power_backend == "nvml":
        args.power_backend = "none"
    cfg = make_cfg(args)
    inputs = make_inputs(cfg)
    results["gpu"] = torch.cuda.get_device_name(0) if cuda(cfg) else "cpu"
    results["phases"]["start"] = {"state": snapshot(cfg, "start"), "micro": micro(cfg)}
    write(results, args.json)

    def step(name: str, fn) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the phases before stay written
            import traceback

            results["errors"][name] = traceback.format_exc()[-3000:]
            log(f"{name} FAILED: {type(exc).__name__}: {exc}")
        write(results, args.json)

    # F: fresh compiled engine; then the same engine after a profiler session and after the bench's kernel timings
    holder: dict = {}

    def fresh():
        e = holder["e"] = compiled_engine(cfg, args.model_dir, inputs, results, "fresh")
        measure(e, cfg, inputs, args.steps, "F", results)

    def after_profiler():
        from torch.profiler import ProfilerActivity, profile

        e = holder["e"]
        dec = thinker_decoder(e)
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]):  # as bench_kernels.profile_steps
            dec.length = max(0, min(dec.length, dec.max_len - 8))
            for _ in range(4):
                dec.step(1)
            torch.cuda.synchronize()
        measure(e, cfg, inputs, args.steps, "F+P", results)

    def after_kernels():
        e = holder["e"]
        t = time.perf_counter()
        decode_timings(e)
        prefill_timings(e, prompt=e.prepare(bench_request(cfg, inputs)))
        log(f"bench kernel timings on the fresh engine in {time.perf_counter() - t:.1f} s")
        measure(e, cfg, inputs, args.steps, "F+K", results)

    step("F", fresh)
    if "e" in holder and cuda(cfg):
        step("F+P", after_profiler)
        step("F+K", after_kernels)
    if "e" in holder:
        close(holder.pop("e"), cfg)
    results["phases"]["F closed"] = {"state": snapshot(cfg, "F closed"), "micro": micro(cfg)}

    # H: the HF reference, short; G: the graph engine as bench runs it
    if not args.skip_hf:
        def hf():
            t = time.perf_counter()
            out = run_hf(replace(cfg, text_tokens=32, audio_frames=8, hf_repeats=1), args.model_dir, inputs, log)
            results["hf"] = {k: out.get(k) for k in ("build_s", "warmup_s", "total_s", "decode_tokens_per_s",
                                                      "peak_bytes")}
            results["phases"]["H done"] = {"state": snapshot(cfg, "H done"), "micro": micro(cfg)}
            log(f"HF reference done in {time.perf_counter() - t:.1f} s")
        step("H", hf)
    if not args.skip_graph:
        def graph():
            t = time.perf_counter()
            recorded: dict = {}
            run_all_resident(replace(cfg, compile=(False,)), args.model_dir, inputs, log,
                             lambda k, v: recorded.__setitem__(k, v))
            g = recorded.get("run:orin_graph") or {}
            results["graph"] = {k: g.get(k) for k in ("ttft_s", "first_audio_s", "decode_tokens_per_s",
                                                      "talker_frames_per_s")}
            results["phases"]["G done"] = {"state": snapshot(cfg, "G done"), "micro": micro(cfg)}
            log(f"graph engine (as bench runs it) done in {time.perf_counter() - t:.1f} s: {results['graph']}")
        step("G", graph)

    # L: the compiled engine again, long-lived; then remedies one at a time
    def longlived():
        e = holder["e"] = compiled_engine(cfg, args.model_dir, inputs, results, "longlived")
        measure(e, cfg, inputs, args.steps, "L", results)

    def remedy_gc():
        gc.collect()
        gc.freeze()
        measure(holder["e"], cfg, inputs, args.steps, "L+gc", results)

    def remedy_cupti():
        from torch.profiler import ProfilerActivity, profile

        os.environ["TEARDOWN_CUPTI"] = "1"  # read by kineto when the session stops: cuptiFinalize
        with profile(activities=[ProfilerActivity.CUDA]):
            torch.cuda.synchronize()
        torch.cuda.synchronize()
        measure(holder["e"], cfg, inputs, args.steps, "L+cupti", results)

    step("L", longlived)
    if "e" in holder:
        step("L+gc", remedy_gc)
        if cuda(cfg) and not args.no_teardown:
            step("L+cupti", remedy_cupti)
        close(holder.pop("e"), cfg)
    write(results, args.json)
    summary(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
