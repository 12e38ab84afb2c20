"""The orin-omni side of `orin-omni bench`: the standard request through the engine, all-resident (one engine
per torch.compile setting) and time-sliced (one engine per budget), through its public API only (orin.runtime.engine,
orin.contract's events and Report, the loader's residency, an observer for the stages).

Each all-resident engine loads every component (load time apart), then gets an unmeasured warm-up (kernels, graphs,
compilation) cancelled once its audio has met every code2wav chunk shape (warm_chunks), the measured request and
three short ones for TTFT; on CUDA the kernel timings (devtools.bench_kernels) and, for the last setting, a profiler
pass follow. The video cases run on the first setting's engine, each with its own warm-up and one request."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from orin import components as C
from orin.units import format_bytes

from .bench_config import BenchConfig, BenchInputs, GiB, VideoCase, bench_request, free, run_name, sync
from .bench_kernels import decode_timings, prefill_timings, profile_events, profile_once
from .bench_report import ttft_stats

log = logging.getLogger("devtools.bench")

Record = Callable[[str, object], None]


@dataclass(frozen=True)
class Streamed:
    """One request's Report (orin.contract.Report) and what the bench times around it."""

    report: object
    wall_s: float
    audio_chunks: int


def open_engine(cfg: BenchConfig, model_dir: str, budget: int | None, compile: bool, prefetch: bool = True,
                observer=None):
    from orin.memory.packed_cache import resolve_dir
    from orin.runtime.engine import Engine

    from .bench_memory import engine_overrides

    memory = engine_overrides(cfg.memory, cfg.engine.device) if budget is not None else {}  # no arenas all-resident
    # The synthetic checkpoint was hashed as it was written; verifying would re-read every byte.
    return Engine(replace(cfg.engine, model_dir=model_dir, budget=budget, compile=compile, prefetch=prefetch,
                          verify_checksums=cfg.engine.verify_checksums and not cfg.synthetic,
                          packed_cache=resolve_dir(cfg.packed_cache, model_dir), **memory), observer=observer)


def warm_chunks(engine) -> int:
    """Audio chunks after which a warm-up is cancelled: those of the engine's every_shape_frames, so the measured
    request meets no code2wav shape for the first time (a warm-up cut at its first packet left five of six)."""
    speech = engine.profile.speech  # code2wav's chunk schedule (orin.device.profile.SpeechTuning)
    return speech.chunk_count(speech.every_shape_frames())


def stream_request(engine, request, cancel_after_chunks: int = 0) -> Streamed:
    """Run one request to its Done, or cancel it once `cancel_after_chunks` audio chunks are out (0: never)."""
    from orin.contract import AudioChunk, Done

    cancel = threading.Event()
    t0 = time.perf_counter()
    report, chunks = None, 0
    for event in engine.stream(request, cancel):
        if isinstance(event, AudioChunk):
            chunks += 1
            if cancel_after_chunks and chunks >= cancel_after_chunks:
                cancel.set()
        elif isinstance(event, Done):
            report = event.report
    return Streamed(report, time.perf_counter() - t0, chunks)


def summarize_engine(report, label: str) -> dict:
    """The table's figures from an engine's Report (orin.contract.Report; see devtools.bench's doc for
    what each one means)."""
    stages = report.energy.by_stage
    decode_tokens = max(0, report.completion_tokens - 1)
    think = stages.get("thinker_decode")
    think_s = think.seconds if think is not None else None
    swaps = report.swaps
    return {
        "label": label,
        "prompt_tokens": report.prompt_tokens,
        "completion_tokens": report.completion_tokens,
        "talker_frames": report.talker_frames,
        "peak_bytes": report.peak_bytes,
        "ttft_s": report.ttft_s,
        "first_audio_s": report.first_audio_s,
        "decode_tokens_per_s": (decode_tokens / think_s) if think_s else None,
        "decode_e2e_tokens_per_s": report.tokens_per_s,
        "talker_frames_per_s": (report.talker_frames / report.talker_s) if report.talker_s else None,
        "energy_j": report.energy.joules,
        "energy_mean_w": report.energy.mean_w,
        "energy_backend": report.energy.backend,
        "swap_s": sum(s.seconds for s in swaps if not s.background),
        "swap_background_s": sum(s.seconds for s in swaps if s.background),
        "swaps": len(swaps),
        "total_s": report.total_s,
        "streaming_speech": report.streaming_speech,
        "stages_s": {k: v.seconds for k, v in stages.items()},
        "timeline_s": dict(report.timeline_s),
        "schedule": [s.name for s in report.schedule],
    }


def _load_all(engine) -> dict:
    """Every component resident, timed; what the loader then holds."""
    import torch

    t0 = time.perf_counter()
    with torch.inference_mode():  # as the engine loads them during a request: the same kind of tensors
        for comp in C.PIPELINE:
            engine.loader.ensure(comp)
    sync(engine.device)
    sizes = engine.loader.sizes()
    swaps = engine.loader.swaps()
    out = {"load_s": time.perf_counter() - t0, "resident_bytes": engine.loader.resident_bytes(),
           "resident_by_component": {c: sizes[c] for c in engine.loader.resident()},
           # units read from their packed copies, and packed copies written (the first load with a cache)
           "packed_units": sum(s.packed for s in swaps), "packed_written": sum(s.written for s in swaps)}
    if engine.device.type == "cuda":
        out["allocated_after_load"] = torch.cuda.memory_allocated()
    return out


def _measure_resident(engine, cfg: BenchConfig, inputs: BenchInputs, name: str, loaded: dict, log_fn) -> dict:
    t0 = time.perf_counter()
    warm = stream_request(engine, bench_request(cfg, inputs), cancel_after_chunks=warm_chunks(engine))
    warm_s = time.perf_counter() - t0
    log_fn(f"[{name}] warm-up {warm_s:.1f} s (ttft {warm.report.ttft_s or 0:.3f} s)")
    report = stream_request(engine, bench_request(cfg, inputs)).report
    summary = summarize_engine(report, f"orin-omni INT4 all-resident ({name})")
    summary["weight_bytes"] = loaded["resident_bytes"]
    summary["load_s"] = loaded["load_s"]
    summary["warmup_s"] = warm_s
    summary["decoders"] = engine.decoder_stats()
    # TTFT again on short requests (no speech): the measured request's value is one sample.
    repeats = [stream_request(engine, bench_request(cfg, inputs, max_new_tokens=2, speech=False)).report
               for _ in range(3)]
    summary.update(ttft_stats(summary["ttft_s"], [r.ttft_s for r in repeats]))
    # where each repeat's time went: they have come out slower than the measured request on some hosts
    summary["ttft_repeats_timeline_s"] = [dict(r.timeline_s) for r in repeats]
    log_fn(f"[{name}] ttft {summary['ttft_s']:.3f} s, first audio {summary['first_audio_s'] or 0:.3f} s, "
           f"thinker {summary['decode_tokens_per_s'] or 0:.1f} tok/s, talker "
           f"{summary['talker_frames_per_s'] or 0:.1f} frames/s, peak {format_bytes(summary['peak_bytes'] or 0)}, "
           f"{summary['energy_j'] or 0:.0f} J")
    return summary


def _since(timeline: dict, mark: str, before: tuple[str, ...]) -> float | None:
    """Seconds from the latest of `before`'s marks reached before `mark` to `mark` (None where it is missing)."""
    end = timeline.get(mark)
    if end is None:
        return None
    starts = [timeline[k] for k in before if k in timeline and timeline[k] <= end]
    return end - max(starts) if starts else None


def video_phases(timeline: dict) -> dict:
    """The video request's phases from the engine's timeline marks (orin.runtime.engine): preprocessing (the processor:
    patches, Whisper features), the encoders (vision and audio), the video's share of them, the thinker prefill
    (merge included) and the talker's prefill over the same prompt."""
    return {"prepare_s": timeline.get("prepared"),
            "encode_s": _since(timeline, "encoded", ("planned",)),
            "video_encode_s": _since(timeline, "video_encoded", ("planned", "audio_encoded", "image_encoded")),
            "prefill_s": _since(timeline, "prefilled", ("encoded",)),
            "talker_prefill_s": _since(timeline, "talker_prefilled", ("first_token",))}


def prompt_counts(prompt) -> dict:
    """A prompt's tokens by kind (orin.inputs.prompt.Prompt): a video's soundtrack counts as audio."""
    return {"prompt_tokens": prompt.length, "video_tokens": prompt.n_video_tokens,
            "audio_tokens": prompt.n_audio_tokens, "image_tokens": prompt.n_image_tokens,
            "video_grids": [list(g) for g in prompt.video_grids]}


@contextlib.contextmanager
def phase_peaks(device):
    """{timeline mark: the allocator's peak since the mark before it} over the block (CUDA; empty elsewhere):
    which phase of a request sets its peak. The engine's RequestState.mark is wrapped for the block's length."""
    import torch

    from orin.runtime.request_state import RequestState

    peaks: dict[str, int] = {}
    if device.type != "cuda":
        yield peaks
        return
    mark = RequestState.mark

    def marked(state, name: str) -> None:
        peaks.setdefault(name, torch.cuda.max_memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)
        mark(state, name)

    RequestState.mark = marked
    try:
        yield peaks
    finally:
        RequestState.mark = mark
        peaks["end"] = torch.cuda.max_memory_allocated(device)  # after the last mark


def measure_video(engine, cfg: BenchConfig, case: VideoCase, name: str, log_fn) -> dict:
    """One video case on an all-resident engine: a warm-up (the prompt's shapes, new to the engine) cancelled
    once its audio has met every code2wav shape, then the measured request twice, the faster one reported. Peak:
    the allocator's, reset before each."""
    import torch

    cuda = engine.device.type == "cuda"
    counts = prompt_counts(engine.prepare(bench_request(cfg, case.inputs)))
    t0 = time.perf_counter()
    stream_request(engine, bench_request(cfg, case.inputs), cancel_after_chunks=warm_chunks(engine))
    warm_s = time.perf_counter() - t0
    # Measured twice, as HF is (devtools.bench_hf), and the faster reported: one request's TTFT moves by tenths
    # of a second between runs on a shared host, its unchanged vision encoder alike. The peak is the larger of
    # the two.
    runs = []
    for _ in range(2):
        free(engine.device)  # the warm-up's cached blocks do not count in the measured peak
        if cuda:
            torch.cuda.reset_peak_memory_stats(engine.device)
        with phase_peaks(engine.device) as peaks:
            runs.append((stream_request(engine, bench_request(cfg, case.inputs)).report, peaks))
    report, peaks = min(runs, key=lambda r: r[0].ttft_s or float("inf"))
    summary = summarize_engine(report, f"orin-omni INT4 all-resident ({name})")
    summary["phase_peak_bytes"] = peaks
    summary["ttft_s_both"] = [r.ttft_s for r, _ in runs]
    if cuda:  # the allocator's own peak over both requests (the loader samples it at its checkpoints)
        summary["peak_bytes"] = max(summary["peak_bytes"] or 0, *(v for _, p in runs for v in p.values()))
    summary.update(counts)
    summary.update(video_phases(summary["timeline_s"]))
    summary["warmup_s"] = warm_s
    summary["decoders"] = engine.decoder_stats()
    if cuda and cfg.profile:  # where the device time to the first audio packet goes (encoders, both prefills)
        summary["profile_to_first_audio"] = _attempt("profile", lambda: profile_once(
            lambda: stream_request(engine, bench_request(cfg, case.inputs), cancel_after_chunks=1)))
    log_fn(f"[{case.name} {name}] {counts['prompt_tokens']} prompt tokens ({counts['video_tokens']} video, "
           f"{counts['audio_tokens']} audio): encode {summary['encode_s'] or 0:.2f} s, prefill "
           f"{summary['prefill_s'] or 0:.2f} s, ttft {summary['ttft_s'] or 0:.2f} s, first audio "
           f"{summary['first_audio_s'] or 0:.2f} s, total {summary['total_s']:.1f} s, peak "
           f"{format_bytes(summary['peak_bytes'] or 0)}, {summary['energy_j'] or 0:.0f} J")
    return summary


def _attempt(key: str, fn) -> dict:
    """fn()'s figures, or its error: a failed timing is a finding, not a reason to stop."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the other parts' figures still count
        log.exception("bench part %s failed", key)
        return {"error": f"{type(exc).__name__}: {exc}"[:1000]}


def run_all_resident(cfg: BenchConfig, model_dir: str, inputs: BenchInputs, log_fn, record: Record,
                     videos: tuple[VideoCase, ...] = ()) -> dict:
    """Per torch.compile setting, an engine with every component loaded, its warm-up and measured requests;
    `record(key, value)` is called as each figure is ready ("all_resident": the first load; "run:orin_NAME": a
    run; "error:orin_NAME": a setting that failed, the next one still runs; "kernel_timings", "profile";
    "video:CASE": a video case on the first setting's engine; "realtime": the Realtime API case on it). With
    cfg.video_only, only the first setting's engine runs, and only those extra cases."""
    loaded: dict = {}
    kernels: dict = {}
    for i, compile in enumerate(cfg.compile[:1] if cfg.video_only else cfg.compile):
        name = run_name(compile)
        engine = None
        try:
            engine = open_engine(cfg, model_dir, None, compile)
            this_load = _load_all(engine)
            if not loaded:
                loaded = this_load
                record("all_resident", loaded)
            if not cfg.video_only:
                try:
                    _standard(engine, cfg, inputs, name, i, this_load, kernels, log_fn, record)
                except Exception as exc:  # noqa: BLE001 - the video cases on this engine still run
                    if not videos or i > 0:
                        raise
                    log.exception("all-resident run %s failed", name)
                    record(f"error:orin_{name}", f"{type(exc).__name__}: {exc}"[:1000])
            if i == 0:  # after the standard request's figures, which stay comparable with earlier runs'
                for case in videos:
                    free(cfg.engine.device)
                    record(f"video:{case.name}", _attempt(case.name, lambda e=engine, c=case, n=name: measure_video(
                        e, cfg, c, n, log_fn)))
                if cfg.realtime_question:
                    from .bench_realtime import measure_realtime

                    free(cfg.engine.device)
                    record("realtime", _attempt("realtime", lambda e=engine: measure_realtime(
                        e, model_dir, cfg.realtime_question, log_fn)))
        except Exception as exc:  # noqa: BLE001 - the other settings' figures still count
            log.exception("all-resident run %s failed", name)
            record(f"error:orin_{name}", f"{type(exc).__name__}: {exc}"[:1000])
        finally:
            if engine is not None:
                engine.close()
            del engine
            free(cfg.engine.device)
    return loaded


def _standard(engine, cfg: BenchConfig, inputs: BenchInputs, name: str, i: int, loaded: dict, kernels: dict, log_fn,
              record: Record) -> None:
    """The standard request's run on one all-resident engine, then (CUDA) its kernel timings and profile."""
    record(f"run:orin_{name}", _measure_resident(engine, cfg, inputs, name, loaded, log_fn))
    if engine.device.type == "cuda":
        last = i == len(cfg.compile) - 1  # the profiler slows the rest of the process: the last engine only
        kernels[f"decode_{name}"] = _attempt(f"decode_{name}", lambda e=engine: decode_timings(e, kernels=last))
        if i == 0:  # the routes and the encoders do not depend on the compile setting
            kernels["prefill"] = _attempt("prefill", lambda e=engine: prefill_timings(
                e, prompt=e.prepare(bench_request(cfg, inputs))))
        record("kernel_timings", kernels)
        if cfg.profile and i == len(cfg.compile) - 1:
            record("profile", {name: _attempt("profile", lambda e=engine: profile_request(e, cfg, inputs))})


def run_time_sliced(cfg: BenchConfig, model_dir: str, inputs: BenchInputs, log_fn, budget: int,
                    prefetch: bool = True) -> dict:
    """The standard request under `budget`, with the last compile setting; `stage_memory` is what was resident
    and the allocator's bytes at each stage of the pipeline (orin.contract.Staged): where the peak was reached."""
    from orin.contract import Staged
    from orin.memory.residency import simulate

    compile = cfg.compile[-1]
    stages: list = []

    def observe(event) -> None:
        if isinstance(event, Staged):
            stages.append(event.to_json())

    from orin.device.select import pick_device

    held = DeviceMemory(pick_device(cfg.engine.device))
    engine = open_engine(cfg, model_dir, budget, compile, prefetch=prefetch, observer=observe)
    held.mapped = lambda loader=engine.loader: loader.mapped_bytes() or 0
    try:
        # Three requests in a row: the first starts from nothing resident, the third is the steady state of a
        # stream of requests (what the budget costs each request), and is the one summarised. The second is the
        # first to bring swapped units back, which then land where they will stay (orin.memory.loader.weights_memory):
        # the decoders' captures after it say whether the steady state re-captured any graph.
        first = stream_request(engine, bench_request(cfg, inputs)).report
        laps = [held.lap()]
        # what `plan`'s policy says the steady state loads, on the sizes the loader measured
        calls = engine.plan(bench_request(cfg, inputs)).stages.calls()
        planned = simulate(calls, engine.loader.unit_sizes(), budget)[-1]
        second = stream_request(engine, bench_request(cfg, inputs)).report
        laps.append(held.lap())
        captured = {k: v["captures"] + v["prefill_captures"] for k, v in engine.decoder_stats().items()}
        stages.clear()
        report = stream_request(engine, bench_request(cfg, inputs)).report
        # what the process held from the driver (allocator cache and mapped weights): the loader keeps it under
        # the budget
        reserved = _peak_reserved(engine)
        laps.append(held.lap())
        device_used = held.stop()
        note = "" if prefetch else ", no prefetch"
        if engine.loader.packed is None:
            note += ", no packed copies"
        label = f"orin-omni INT4 time-sliced, budget {format_bytes(budget)} ({run_name(compile)}{note})"
        summary = summarize_engine(report, label)
        summary["first_request"] = {"ttft_s": first.ttft_s, "first_audio_s": first.first_audio_s,
                                    "total_s": first.total_s, "peak_bytes": first.peak_bytes, **_moved(first)}
        summary.update(_moved(report))
        summary["stage_memory"] = stages
        summary["weight_bytes"] = sum(s.runtime_int4_bytes for s in engine.sizes.components.values())
        summary["budget_bytes"] = budget
        summary["swap_detail"] = [s.to_json() for s in report.swaps]
        summary["planned_steady_bytes_loaded"] = sum(m.loaded() for m in planned)
        summary["peak_reserved_bytes"] = reserved
        summary["peak_device_used_bytes"] = device_used
        # per request (first, second, steady state): the peak, and the allocator's and the arenas' share of it
        summary["device_used_per_request"] = laps
        summary["decoders"] = engine.decoder_stats()  # captures: how often a swap moved a decoder's weights
        summary["steady_captures"] = {k: v["captures"] + v["prefill_captures"] - captured.get(k, 0)
                                      for k, v in summary["decoders"].items()}
        summary["second_request"] = {"ttft_s": second.ttft_s, "first_audio_s": second.first_audio_s,
                                     "total_s": second.total_s, **_moved(second)}
        log_fn(f"[time-sliced {format_bytes(budget)}{note}] steady state: ttft {summary['ttft_s']:.3f} s, first audio "
               f"{summary['first_audio_s'] or 0:.3f} s, total {report.total_s:.2f} s, peak "
               f"{format_bytes(summary['peak_bytes'] or 0)}, swapped in {summary['swap_in_bytes'] / 1e9:.2f} GB in "
               f"{summary['swap_in_s']:.2f} s ({summary['swap_in_gb_s'] or 0:.2f} GB/s; planned "
               f"{summary['planned_steady_bytes_loaded'] / 1e9:.2f} GB); first request: ttft "
               f"{first.ttft_s:.2f} s, {summary['first_request']['swap_in_bytes'] / 1e9:.2f} GB in; second: first "
               f"audio {second.first_audio_s or 0:.3f} s; steady-state captures {summary['steady_captures']}; held from "
               f"the driver at most {format_bytes(device_used or 0)} (reserved + mapped peaks "
               f"{format_bytes(reserved or 0)}; per request {_laps(laps)})")
        return summary
    finally:
        held.stop()
        held.mapped = lambda: 0  # the loader goes with the engine
        engine.close()
        del engine
        free(cfg.engine.device)


def _laps(laps: list) -> str:
    """'peak (reserved + mapped + other)' per request, in GiB."""
    return ", ".join("-" if not lap or not lap["peak"] else
                     f"{lap['peak'] / GiB:.2f} ({lap.get('reserved', 0) / GiB:.2f} + {lap.get('mapped', 0) / GiB:.2f} + "
                     f"{lap.get('other', 0) / GiB:.2f})" for lap in laps)


def _peak_reserved(engine) -> int | None:
    """The allocator's peak of reserved memory plus the weights' mapped outside it (orin.memory.arena): the two
    peaks added, which can only overstate."""
    import torch

    if engine.device.type != "cuda":
        return None
    return torch.cuda.max_memory_reserved(engine.device) + (engine.loader.mapped_bytes(peak_ever=True) or 0)


class DeviceMemory:
    """The device's used memory sampled every `every` seconds on a thread of its own, from now until stop(): the
    peak above what was used at the start outside torch's allocator (the CUDA context, other processes): all the
    process took from the driver, allocator and mapped weights alike, as the other processes of an Orin would
    see it; at that peak, what torch's allocator reserved and what `mapped()` said was mapped outside it, so
    what neither accounts for shows. lap() ends one part (a request) and starts the next. None off CUDA."""

    def __init__(self, device, every: float = 0.002, mapped: Callable[[], int] = lambda: 0):
        import torch

        self._device = device
        self.mapped = mapped
        self._stop = threading.Event()
        self.peak: int | None = None
        self._lap: dict = {}
        if device.type != "cuda":
            return
        free_, total = torch.cuda.mem_get_info(device)
        self._base = total - free_ - torch.cuda.memory_reserved(device)
        self.peak = 0
        self._lap = {"peak": 0}
        self._thread = threading.Thread(target=self._sample, args=(every,), daemon=True, name="bench-memory")
        self._thread.start()

    def _sample(self, every: float) -> None:
        import torch

        while not self._stop.wait(every):
            free_, total = torch.cuda.mem_get_info(self._device)
            used = total - free_ - self._base
            self.peak = max(self.peak, used)
            if used > self._lap["peak"]:
                reserved, mapped = torch.cuda.memory_reserved(self._device), self.mapped()
                self._lap = {"peak": used, "reserved": reserved, "mapped": mapped,
                             "other": used - reserved - mapped}

    def lap(self) -> dict | None:
        """The part just ended: its peak, and the allocator's reserved and the mapped bytes at that peak."""
        if self.peak is None:
            return None
        lap, self._lap = self._lap, {"peak": 0}
        return lap

    def stop(self) -> int | None:
        if self.peak is not None and not self._stop.is_set():
            self._stop.set()
            self._thread.join()
        return self.peak


def _moved(report) -> dict:
    """Bytes and seconds a request swapped in (foreground and prefetched) and out, and the swap-in throughput (of
    all loads, and of the foreground ones alone)."""
    ins = [s for s in report.swaps if s.direction == "in"]
    in_bytes, in_s = sum(s.bytes for s in ins), sum(s.seconds for s in ins)
    fg = [s for s in ins if not s.background]  # loads alone, the request waiting: what the storage comparison takes
    fg_bytes, fg_s = sum(s.bytes for s in fg), sum(s.seconds for s in fg)
    return {"swap_in_bytes": in_bytes, "swap_in_s": in_s, "swap_in_gb_s": in_bytes / in_s / 1e9 if in_s else None,
            "swap_in_foreground_gb_s": fg_bytes / fg_s / 1e9 if fg_s else None,
            "swap_out_bytes": sum(s.bytes for s in report.swaps if s.direction == "out"),
            "total_s": report.total_s}


def profile_request(engine, cfg: BenchConfig, inputs: BenchInputs, tokens: int = 24, frames: int = 12) -> dict:
    """Kernel-level profile of a short request: its top CUDA kernels by device time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    req = bench_request(cfg, inputs, max_new_tokens=tokens, max_audio_frames=frames)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # kernels only: CPU events cost minutes here
        streamed = stream_request(engine, req)
    torch.cuda.synchronize()
    events = profile_events(prof, 1, 25)
    return {"tokens": tokens, "frames": frames, "wall_s": streamed.wall_s,
            "device_ms_total": events["device_ms_per_call"], "kernels": events["kernels_per_call"],
            "top": [{"name": e["name"], "device_ms": e["us_per_call"] / 1e3, "share": e["share"],
                     "calls": e["calls_per_call"]} for e in events["top"]],
            "stages_s": {k: v.seconds for k, v in streamed.report.energy.by_stage.items()}}


__all__ = ["Streamed", "measure_video", "open_engine", "profile_request", "prompt_counts", "run_all_resident",
           "run_time_sliced", "stream_request", "summarize_engine", "video_phases"]
