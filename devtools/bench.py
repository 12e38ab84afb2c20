"""`orin-omni bench`: the standard request through the orin-omni engine (all-resident and time-sliced) and
through HF transformers' BF16 `generate(return_audio=True)` in one process, side by side.

The standard request is one user turn with an image, an audio clip and a short instruction, answered with a
fixed number of text tokens and speech frames (EOS ignored on both sides, so both do the same work;
devtools.bench_config). Each all-resident engine (one per torch.compile setting) gets an unmeasured
warm-up request first (kernels, the CUDA graphs) that is cancelled once its audio has met every code2wav chunk
shape; its load time is reported separately (devtools.bench_engine). The HF reference gets a short warm-up generate
(devtools.bench_hf).

Figures per run: weight bytes, peak GPU memory (the allocator's peak during the request; weights included),
time to first text token and first audio packet (from the request's start, preprocessing included), thinker
decode tokens/s (the thinker's own step time) and the end-to-end decode rate, talker frames/s, energy per
request (NVML's energy counter on a GPU), and swap seconds. `--synthetic` writes a random checkpoint at the
config's dimensions first (devtools.synthetic); the HF reference is built from the same config with random
BF16 weights. On CUDA the kernel timings (devtools.bench_kernels) and a torch.profiler pass over a short
request record where the time goes; the targets and the table are devtools.bench_report's, the AGX Orin
projection devtools.bench_projection's.

The video cases (`--video-seconds S`, one per `--video-fps`): one image, an S-second clip with its
soundtrack (audio in video) and the instruction, answered as the standard request is, on the first all-resident
engine and on the HF reference (after their standard request; `--video-only`: instead of it, and no time-sliced
runs). Their figures go under the JSON's "video" key: the cases and what each side measured, what decoding an
encoded clip of that shape costs (timed once here: the cases take the clip as already decoded) and the Orin
projection of each case.

This module runs the parts in order and keeps what each one measured: a part that fails is recorded under
"errors" and the rest still run; the JSON is rewritten after every part.
"""

from __future__ import annotations

import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

from orin.errors import UsageError

from .bench_config import BenchConfig, check_video, make_inputs, make_video_cases, parse_compile
from .bench_engine import run_all_resident, run_time_sliced
from .bench_hf import run_hf
from .bench_projection import orin_projection, video_projection
from .bench_report import BenchResult, best_run, render_table

log = logging.getLogger("devtools.bench")


def _meta(cfg: BenchConfig) -> dict:
    import torch
    import transformers

    meta = {"config": asdict(cfg), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "host": platform.node()}
    if torch.cuda.is_available() and cfg.engine.device in ("auto", "cuda"):
        props = torch.cuda.get_device_properties(0)
        meta["gpu"] = {"name": props.name, "memory_bytes": props.total_memory,
                       "multiprocessors": props.multi_processor_count}
    return meta


def _check(cfg: BenchConfig) -> None:
    if cfg.synthetic == bool(cfg.engine.model_dir):
        raise UsageError("give either --synthetic (with --config) or --model-dir")
    if cfg.synthetic and not cfg.config:
        raise UsageError("--synthetic needs --config (a Qwen3-Omni config.json, or 'tiny')")
    if not cfg.compile:
        raise UsageError("--compile needs at least one of: off, on")
    check_video(cfg)


def _write_synthetic(cfg: BenchConfig, result: BenchResult, log_fn) -> str:
    from .synthetic import SyntheticConfig, write_synthetic_checkpoint

    t0 = time.perf_counter()
    out = Path(cfg.workdir) / "checkpoint"
    write_synthetic_checkpoint(SyntheticConfig(config=cfg.config, out=str(out), device=cfg.engine.device,
                                               seed=cfg.seed, force=True), log=log_fn)
    result.extra["synthetic_write_s"] = time.perf_counter() - t0
    os.sync()  # write-back of 20 GB of dirty pages would otherwise steal CPU from the first measurements
    log_fn(f"synthetic checkpoint in {result.extra['synthetic_write_s']:.1f} s: {out}")
    return str(out)


def _storage(model_dir: str, device: str, log_fn) -> dict:
    """The plain storage -> device bandwidth of the checkpoint's largest file (devtools.bench_storage)."""
    from orin.device.select import pick_device

    from .bench_storage import storage_bandwidth

    largest = max(Path(model_dir).glob("*.safetensors"), key=lambda p: p.stat().st_size)
    out = storage_bandwidth(str(largest), pick_device(device))
    cold = (f"{out['cold_gb_s']:.2f} GB/s cold (one read at a time {out['cold_single_gb_s']:.2f})"
            if out["cold_gb_s"] else "cold not measurable")
    log_fn(f"[storage] {out['file']} ({out['bytes'] / 1e9:.2f} GB) -> device: {cold}, {out['warm_gb_s']:.2f} GB/s "
           f"warm (one read at a time {out['warm_single_gb_s']:.2f})")
    return out


def _storage_fraction(run: dict, storage: dict) -> dict:
    """A time-sliced run's swap-in throughput as a fraction of the storage's warm bandwidth (the faster way of
    reading it), the whole request's loads and its foreground ones alone."""
    best = max(storage["warm_gb_s"], storage.get("warm_single_gb_s") or 0)
    return {"warm_gb_s": best, **{key: run[key] / best if run.get(key) else None
                                   for key in ("swap_in_gb_s", "swap_in_foreground_gb_s")}}


def video_decode_timing(cfg: BenchConfig, log_fn, clip_seconds: float = 10.0, source_fps: int = 30) -> dict:
    """What decoding costs (orin.inputs.video.load_video: PyAV, software decode, sampling and resizing), timed once on an
    encoded clip of the video cases' frame size with its soundtrack (orin.inputs.video.synth_clip, MPEG-4 part 2 and
    AAC at `source_fps`), at most `clip_seconds` long, sampled at the first --video-fps."""
    import av  # noqa: F401 - imported before the clock starts

    from orin.inputs.video import VideoOptions, load_video, synth_clip

    seconds = min(clip_seconds, cfg.video_seconds)
    n = cfg.video_size
    t0 = time.perf_counter()
    data = synth_clip(seconds, source_fps, (n, n), audio=True, seed=cfg.seed)
    encode_s = time.perf_counter() - t0
    opts = VideoOptions(fps=cfg.video_fps[0], max_frame_pixels=n * n)
    t0 = time.perf_counter()
    video = load_video(data, opts, name="the decode-timing clip")
    decode_s = time.perf_counter() - t0
    out = {"clip_seconds": seconds, "source_fps": source_fps, "source_size": [n, n], "codec": video.source["codec"],
           "encoded_bytes": len(data), "sample_fps": opts.fps, "frames": int(video.frames.shape[0]),
           "frame_size": list(video.frames.shape[1:3]), "audio_samples": 0 if video.audio is None else
           int(video.audio.size), "synth_encode_s": encode_s, "decode_s": decode_s,
           "decode_s_per_video_s": decode_s / video.duration,
           "decode_s_for_case": decode_s / video.duration * cfg.video_seconds}
    log_fn(f"[video decode] {seconds:g} s of {n}x{n} at {source_fps} fps ({len(data) / 1e6:.1f} MB) decoded and "
           f"sampled at {opts.fps:g} fps in {decode_s:.2f} s: {out['decode_s_per_video_s'] * 1e3:.0f} ms per "
           f"video-second, {out['decode_s_for_case']:.1f} s for {cfg.video_seconds:g} s")
    return out


def run_bench(cfg: BenchConfig, log_fn: Callable[[str], None] = lambda m: None) -> BenchResult:
    """The whole benchmark; each part's failure is recorded (errors) and the rest still runs. The JSON is
    rewritten after every part, so a run cut short keeps what it measured."""
    from orin.checkpoint.manifest import read_manifest

    _check(cfg)
    result = BenchResult(meta=_meta(cfg))
    t_start = time.perf_counter()
    model_dir = _write_synthetic(cfg, result, log_fn) if cfg.synthetic else cfg.engine.model_dir
    manifest = read_manifest(model_dir)
    result.extra["checkpoint"] = {"dir": model_dir, "int4_payload_bytes": sum(
        s.int4_bytes for s in manifest.segments.values()), "file_bytes": sum(
        s.total_bytes for s in manifest.segments.values())}
    inputs = make_inputs(cfg)
    videos = tuple(make_video_cases(cfg))
    video: dict = {}
    if videos:
        video = result.extra["video"] = {"cases": {c.name: c.describe() for c in videos}}

    def part(name: str, fn):
        t0 = time.perf_counter()
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001 - one part failing must not lose the others' figures
            log.exception("bench part %s failed", name)
            result.errors[name] = f"{type(exc).__name__}: {exc}"
            log_fn(f"{name} FAILED: {type(exc).__name__}: {exc}")
            value = None
        result.extra.setdefault("part_s", {})[name] = time.perf_counter() - t0
        result.write(cfg.json_out)
        return value

    def record(key: str, value) -> None:
        if key.startswith("run:"):
            result.runs[key[4:]] = value
        elif key.startswith("error:"):
            result.errors[key[6:]] = value
        else:
            result.extra[key] = value
        result.write(cfg.json_out)

    def recorder(system: str):
        """record(), with "video:CASE" going to the case's `system` figures."""
        def put(key: str, value) -> None:
            if key.startswith("video:"):
                video["cases"][key[6:]][system] = value
                if isinstance(value, dict) and "error" in value:
                    result.errors[f"{key[6:]}:{system}"] = value["error"]
                result.write(cfg.json_out)
            else:
                record(key, value)
        return put

    if videos:
        decode = part("video_decode", lambda: video_decode_timing(cfg, log_fn))
        if decode:
            video["decode"] = decode
    # The reference first: its figures are what the targets compare with, and its run time is known.
    if not cfg.skip_hf:
        hf = part("hf", lambda: run_hf(cfg, model_dir, inputs, log_fn, videos, recorder("hf_bf16")))
        if hf and cfg.video_only:
            video["hf_bf16_model"] = hf  # its build and warm-up: no standard request ran
        elif hf:
            result.runs["hf_bf16"] = hf
    part("all_resident", lambda: run_all_resident(cfg, model_dir, inputs, log_fn, recorder("orin"), videos))
    if not cfg.video_only and not cfg.skip_sliced and cfg.budget_sliced:
        storage = part("storage", lambda: _storage(model_dir, cfg.engine.device, log_fn))
        if storage:
            result.extra["storage_bandwidth"] = storage
        for i, budget in enumerate(cfg.budget_sliced):
            key = "orin_time_sliced" if i == 0 else f"orin_time_sliced_{i + 1}"
            sliced = part(key, lambda b=budget: run_time_sliced(cfg, model_dir, inputs, log_fn, b))
            if sliced:
                result.runs[key] = sliced
                if storage:
                    sliced["storage_fraction"] = _storage_fraction(sliced, storage)
        # the same budgets converting every INT4 layer on each load: what the packed copies are worth
        unpacked = replace(cfg, packed_cache="off")
        for budget in cfg.sliced_unpacked:
            key = f"orin_time_sliced_unpacked_{budget >> 30}GiB"
            sliced = part(key, lambda b=budget: run_time_sliced(unpacked, model_dir, inputs, log_fn, b))
            if sliced:
                result.runs[key] = sliced
    if result.runs:
        any_run = next(iter(result.runs.values()), {})
        proj = part("orin_projection", lambda: orin_projection(
            model_dir, any_run.get("prompt_tokens") or 0, cfg.text_tokens, cfg.audio_frames, best_run(result.runs)))
        if proj:
            result.extra["orin_projection"] = proj
    for case in videos:
        ours = video["cases"][case.name].get("orin") or {}
        if ours.get("prompt_tokens"):
            decode = video.get("decode") or {}
            gpu = (result.meta.get("gpu") or {}).get("name")
            proj = part(f"video_projection_{case.name}", lambda o=ours, d=decode, g=gpu: video_projection(
                model_dir, o, cfg.text_tokens, cfg.audio_frames, o, g, d.get("decode_s_per_video_s"),
                cfg.video_seconds))
            if proj:
                video.setdefault("orin_projection", {})[case.name] = proj
    result.extra["bench_s"] = time.perf_counter() - t_start
    result.write(cfg.json_out)
    return result


# The command's face (orin.cli builds a BenchConfig, calls run_bench, prints render_table).
__all__ = ["BenchConfig", "BenchResult", "orin_projection", "parse_compile", "render_table", "run_bench",
           "video_decode_timing"]
