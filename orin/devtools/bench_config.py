"""The benchmark's settings and its standard request: one user turn with images, an audio clip and a short
instruction, answered with a fixed number of text tokens and speech frames (EOS ignored on every side, so every
side does the same work). Shared by the engine side (orin.devtools.bench_engine) and the HF reference
(orin.devtools.bench_hf)."""

from __future__ import annotations

import gc
from dataclasses import dataclass

from ..errors import UsageError

GiB = 1 << 30

# The all-resident runs' names, per torch.compile setting: graphs are always used on CUDA where the weights stay
# put, so "graph" is the plain layer function replayed and "compiled" the same through torch.compile. The names
# are the JSON's and BENCHMARKS.md's (runs "orin_graph", "orin_compiled").
RUN_NAMES = {False: "graph", True: "compiled"}
_SWITCH = {"on": True, "off": False}


@dataclass(frozen=True)
class BenchConfig:
    config: str | None = None  # config.json / checkpoint dir / "tiny"; with synthetic=True
    model_dir: str | None = None  # an existing quantized checkpoint instead
    synthetic: bool = False
    workdir: str = "build/bench"
    device: str = "auto"
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
    power_backend: str = "auto"
    json_out: str | None = None
    seed: int = 0
    hf_repeats: int = 2
    packed_cache: str = "auto"  # a --packed-cache value (orin.packed_cache.resolve_dir): "auto", "off" or a path
    sliced_unpacked: tuple[int, ...] = ()  # budgets run time-sliced again without packed copies (converting)


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


def make_inputs(cfg: BenchConfig) -> BenchInputs:
    from ..audio_format import INPUT_SAMPLE_RATE
    from ..media import synth_image, synth_speechlike

    images = [synth_image(cfg.image_size, seed=cfg.seed + i) for i in range(cfg.images)]
    audio = synth_speechlike(cfg.audio_seconds, INPUT_SAMPLE_RATE, seed=cfg.seed) if cfg.audio_seconds > 0 else None
    parts = [{"type": "image", "image": im} for im in images]
    if audio is not None:
        parts.append({"type": "audio", "audio": audio})
    parts.append({"type": "text", "text": cfg.prompt})
    return BenchInputs(({"role": "user", "content": parts},), images, audio)


def bench_request(cfg: BenchConfig, inputs: BenchInputs, **overrides):
    """The standard request (orin.contract.GenerationRequest); `overrides` change its fields (short requests)."""
    from ..contract import GenerationRequest

    args = dict(messages=inputs.messages, max_new_tokens=cfg.text_tokens, speech=cfg.audio_frames > 0,
                voice=cfg.voice, max_audio_frames=max(cfg.audio_frames, 1), ignore_eos=True)
    args.update(overrides)
    return GenerationRequest(**args)


def sync(device) -> None:
    import torch

    if getattr(device, "type", device) == "cuda":
        torch.cuda.synchronize()


def free(device) -> None:
    """Give what the last part held back to the allocator before the next part measures its peak."""
    import torch

    gc.collect()
    if getattr(device, "type", device) in ("cuda", "auto") and torch.cuda.is_available():
        torch.cuda.empty_cache()


__all__ = ["GiB", "RUN_NAMES", "BenchConfig", "BenchInputs", "bench_request", "free", "make_inputs", "parse_compile",
           "run_name", "sync"]
