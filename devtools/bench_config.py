"""The benchmark's settings and its standard request: one user turn with images, an audio clip and a short
instruction, answered with a fixed number of text tokens and speech frames (EOS ignored on every side, so every
side does the same work). Shared by the engine side (devtools.bench_engine) and the HF reference
(devtools.bench_hf).

The video cases (`video_seconds` > 0): per sampling rate, one user turn with one image, a video of
`video_seconds` with its soundtrack (audio in video) and the instruction, answered as the standard request is.
The clip is built as already decoded (orin.inputs.video.Video: pseudo-random frames at `video_size`², the count that
orin.inputs.video.sampled_frames gives, and a speech-like soundtrack), so no run pays a two-minute decode; what decoding
costs is timed once apart (devtools.bench.video_decode_timing)."""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

from orin.errors import UsageError
from orin.runtime.engine import EngineConfig

GiB = 1 << 30

# The all-resident runs' names, per torch.compile setting: graphs are always used on CUDA where the weights stay
# put, so "graph" is the plain layer function replayed and "compiled" the same through torch.compile. The names
# are the JSON's run keys ("orin_graph", "orin_compiled").
RUN_NAMES = {False: "graph", True: "compiled"}
_SWITCH = {"on": True, "off": False}

log = logging.getLogger("devtools.bench")


@dataclass(frozen=True)
class BenchConfig:
    # How every run's engine opens the checkpoint (device, power backend, device profile: orin.runtime.engine.EngineConfig);
    # its model_dir is an existing quantized checkpoint's, "" with synthetic=True (written under workdir). Each run
    # sets its own budget, compile, prefetch and packed copies (devtools.bench_engine.open_engine).
    engine: EngineConfig = EngineConfig(model_dir="")
    config: str | None = None  # config.json / checkpoint dir / "tiny"; with synthetic=True
    synthetic: bool = False
    workdir: str = "build/bench"
    audio_seconds: float = 30.0
    images: int = 1
    image_size: int = 224
    text_tokens: int = 256
    audio_frames: int = 100
    prompt: str = "Describe it all."
    voice: str = "ethan"
    budget_sliced: tuple[int, ...] = (18 * GiB,)  # one time-sliced run per budget
    skip_hf: bool = False
    skip_sliced: bool = False
    # One all-resident engine per torch.compile setting, in this order; the last one also runs time-sliced.
    compile: tuple[bool, ...] = (False, True)
    profile: bool = True
    json_out: str | None = None
    seed: int = 0
    hf_repeats: int = 2
    packed_cache: str = "auto"  # a --packed-cache value (orin.memory.packed_cache.resolve_dir): "auto", "off" or a path
    sliced_unpacked: tuple[int, ...] = ()  # budgets run time-sliced again without packed copies (converting)
    memory: str = "device"  # the time-sliced runs' weight arenas (devtools.bench_memory.MEMORY_VARIANTS)
    # The video cases: a clip of video_seconds (0: none) sampled at each of video_fps, frames video_size² pixels.
    video_seconds: float = 0.0
    video_fps: tuple[float, ...] = (2.0,)
    video_size: int = 448
    video_only: bool = False  # only the extra cases (video, realtime): no standard request, time-sliced runs,
    # kernels or profile
    # The Realtime API case: a spoken question (an audio file), streamed to the real server's WebSocket
    # as a microphone would, on the first setting's engine (devtools.bench_realtime); None: not run.
    realtime_question: str | None = None


def parse_compile(text: str) -> tuple[bool, ...]:
    """`--compile off,on` -> (False, True): the all-resident runs' torch.compile settings, in order."""
    words = [w.strip().lower() for w in text.split(",") if w.strip()]
    if not words:
        raise UsageError("--compile needs at least one of: off, on")
    bad = [w for w in words if w not in _SWITCH]
    if bad:
        raise UsageError(f"--compile {bad[0]!r}: use off, on or both, comma-separated (e.g. off,on)")
    out = tuple(_SWITCH[w] for w in words)
    if len(set(out)) != len(out):
        raise UsageError(f"--compile {text!r} names a setting twice")
    return out


def run_name(compile: bool) -> str:
    return RUN_NAMES[bool(compile)]


@dataclass(frozen=True)
class BenchInputs:
    messages: tuple
    images: list
    audio: object  # float32 samples at orin.audio_format.INPUT_SAMPLE_RATE, or None
    video: object = None  # an orin.inputs.video.Video (a video case), or None


def make_inputs(cfg: BenchConfig) -> BenchInputs:
    from orin.audio_format import INPUT_SAMPLE_RATE
    from orin.inputs.media import synth_image, synth_speechlike

    images = [synth_image(cfg.image_size, seed=cfg.seed + i) for i in range(cfg.images)]
    audio = synth_speechlike(cfg.audio_seconds, INPUT_SAMPLE_RATE, seed=cfg.seed) if cfg.audio_seconds > 0 else None
    parts = [{"type": "image", "image": im} for im in images]
    if audio is not None:
        parts.append({"type": "audio", "audio": audio})
    parts.append({"type": "text", "text": cfg.prompt})
    return BenchInputs(({"role": "user", "content": parts},), images, audio)


@dataclass(frozen=True)
class VideoCase:
    """One video case: its name in the JSON ("video_2fps"), the sampling rate and the request's inputs."""

    name: str
    fps: float
    inputs: BenchInputs

    def describe(self) -> dict:
        v = self.inputs.video
        t, h, w, _ = v.frames.shape
        return {"fps": self.fps, "seconds": v.duration, "frames": t, "frame_size": [h, w],
                "sampled_fps": v.fps, "soundtrack_s": (len(v.audio) / _rate()) if v.audio is not None else 0.0,
                "images": len(self.inputs.images), "expected_video_tokens": video_tokens(t, h, w)}


def _rate() -> int:
    from orin.audio_format import INPUT_SAMPLE_RATE

    return INPUT_SAMPLE_RATE


def video_tokens(frames: int, height: int, width: int) -> int:
    """The thinker tokens of a clip's frames: one per 2x2 merge of 16-pixel patches, two frames a temporal grid."""
    from orin.inputs.video import FRAME_FACTOR, TEMPORAL_PATCH

    return (frames // TEMPORAL_PATCH) * (height // FRAME_FACTOR) * (width // FRAME_FACTOR)


def check_video(cfg: BenchConfig) -> None:
    from orin.inputs.video import FRAME_FACTOR, VideoOptions

    if cfg.video_seconds < 0:
        raise UsageError(f"--video-seconds {cfg.video_seconds:g} must be 0 (no video case) or more")
    if cfg.video_only and not cfg.video_seconds and not cfg.realtime_question:
        raise UsageError("--video-only/--cases-only needs a case to run: --video-seconds or --realtime-question")
    if not cfg.video_seconds:
        return
    if cfg.video_size < FRAME_FACTOR or cfg.video_size % FRAME_FACTOR:
        raise UsageError(f"--video-size {cfg.video_size}: a frame side must be a multiple of {FRAME_FACTOR}")
    if not cfg.video_fps or len(set(cfg.video_fps)) != len(cfg.video_fps):
        raise UsageError("--video-fps: give each sampling rate once")
    for fps in cfg.video_fps:
        opts = VideoOptions(fps=fps, max_frame_pixels=cfg.video_size ** 2)
        opts.check()  # an InputError naming the rate
        if cfg.video_seconds > opts.max_seconds:
            raise UsageError(f"--video-seconds {cfg.video_seconds:g} is over the {opts.max_seconds:g} s a video may "
                             "last")


def synth_video(seconds: float, fps: float, size: int, seed: int = 0):
    """An already-decoded clip as orin.inputs.video.load_video gives one: sampled_frames(seconds) frames of size² pixels
    (pseudo-random, deterministic for `seed`), its real rate (frames / seconds), and a speech-like soundtrack of
    `seconds` at 16 kHz."""
    import numpy as np

    from orin.inputs.media import synth_speechlike
    from orin.inputs.video import Video, VideoOptions, sampled_frames

    n = sampled_frames(seconds, VideoOptions(fps=fps, max_frame_pixels=size * size))
    frames = np.random.default_rng(seed).integers(0, 256, (n, size, size, 3), dtype=np.uint8)
    rate = n / seconds
    return Video(frames=frames, fps=rate, timestamps=tuple(float(i / rate) for i in range(n)), duration=seconds,
                 audio=synth_speechlike(seconds, _rate(), seed=seed + 1),
                 source={"synthetic": True, "width": size, "height": size, "codec": None})


def case_name(fps: float) -> str:
    return f"video_{fps:g}fps".replace(".", "p")


def make_video_cases(cfg: BenchConfig) -> list[VideoCase]:
    """One case per --video-fps, the lowest rate first: [one image (if --images >= 1)] + the clip with its soundtrack
    + the instruction. The order matters to the engine: its static KV caches keep the largest size a request has
    needed, and decode attends over all of it, so a shorter prompt after a longer one decodes as the longer."""
    from orin.inputs.media import synth_image

    if not cfg.video_seconds:
        return []
    images = [synth_image(cfg.image_size, seed=cfg.seed)] if cfg.images >= 1 else []
    cases = []
    for fps in sorted(cfg.video_fps):
        video = synth_video(cfg.video_seconds, fps, cfg.video_size, seed=cfg.seed)
        parts = [{"type": "image", "image": im} for im in images] + [{"type": "video", "video": video},
                                                                    {"type": "text", "text": cfg.prompt}]
        cases.append(VideoCase(case_name(fps), fps, BenchInputs(({"role": "user", "content": parts},), images,
                                                                None, video)))
    return cases


def bench_request(cfg: BenchConfig, inputs: BenchInputs, **overrides):
    """The standard request (orin.contract.GenerationRequest); `overrides` change its fields (short requests)."""
    from orin.contract import GenerationRequest

    args = dict(messages=inputs.messages, max_new_tokens=cfg.text_tokens, speech=cfg.audio_frames > 0,
                voice=cfg.voice, max_audio_frames=max(cfg.audio_frames, 1), ignore_eos=True)
    args.update(overrides)
    return GenerationRequest(**args)


def sync(device) -> None:
    import torch

    if getattr(device, "type", device) == "cuda":
        torch.cuda.synchronize()


def free(device) -> None:
    """Give what the last part held back to the driver before the next part measures its peak. torch.compile's
    caches keep the compiled decoders (their KV caches and CUDA graphs) of a closed engine alive: they are reset
    too, else the next engine's figures carry them (gigabytes of the last engine's caches in the next one's peak)."""
    import sys

    import torch

    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    gc.collect()
    if getattr(device, "type", device) in ("cuda", "auto") and torch.cuda.is_available():
        torch.cuda.empty_cache()
        if torch.cuda.memory_allocated() > 64 << 20:  # the next part's peak would carry it
            log.warning("a finished part left %d bytes allocated (%d reserved)", torch.cuda.memory_allocated(),
                        torch.cuda.memory_reserved())


__all__ = ["GiB", "RUN_NAMES", "BenchConfig", "BenchInputs", "VideoCase", "bench_request", "case_name", "check_video",
           "free", "make_inputs", "make_video_cases", "parse_compile", "run_name", "synth_video", "sync",
           "video_tokens"]
