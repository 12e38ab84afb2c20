"""`orin-omni generate`: one request through the engine, text streamed to stdout, speech to a WAV file."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import InputError


@dataclass(frozen=True)
class GenerateConfig:
    model_dir: str
    text: str | None = None
    images: tuple[str, ...] = ()
    audios: tuple[str, ...] = ()
    out_wav: str | None = None
    speech: bool = True
    budget: int | None = None
    max_new_tokens: int = 256
    speaker: str = "ethan"
    device: str = "auto"
    as_json: bool = False
    power_backend: str = "auto"
    temperature: float = 0.0
    max_audio_frames: int | None = None


def build_request(cfg: GenerateConfig):
    """Read the media files (any sample rate, resampled to 16 kHz; PNG/JPEG) into one user message."""
    from .engine import GenerationRequest
    from .media import load_audio, load_image

    if not (cfg.text or cfg.images or cfg.audios):
        raise InputError("nothing to answer: give --text, --image or --audio")
    parts = []
    for path in cfg.images:
        parts.append({"type": "image", "image": load_image(path)})
    for path in cfg.audios:
        parts.append({"type": "audio", "audio": load_audio(path)})
    if cfg.text:
        parts.append({"type": "text", "text": cfg.text})
    return GenerationRequest(
        messages=({"role": "user", "content": parts},), max_new_tokens=cfg.max_new_tokens, speech=cfg.speech,
        speaker=cfg.speaker, temperature=cfg.temperature, max_audio_frames=cfg.max_audio_frames,
    )


def run_generate(cfg: GenerateConfig, out=sys.stdout) -> dict:
    from .engine import AudioChunk, Done, Engine, EngineConfig, TextDelta
    from .media import write_wav

    if cfg.out_wav and not cfg.speech:
        raise InputError("--out-wav needs speech; drop --no-speech")
    request = build_request(cfg)  # bad media fails before the model is loaded
    engine = Engine(EngineConfig(model_dir=cfg.model_dir, device=cfg.device, budget=cfg.budget,
                                 power_backend=cfg.power_backend))
    try:
        chunks, report = [], {}
        for event in engine.stream(request):
            if isinstance(event, TextDelta) and not cfg.as_json:
                out.write(event.text)
                out.flush()
            elif isinstance(event, AudioChunk):
                chunks.append(event.samples)
            elif isinstance(event, Done):
                report = event.report
    finally:
        engine.close()
    if cfg.speech and cfg.out_wav:
        import numpy as np

        samples = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        write_wav(cfg.out_wav, samples, 24000)
        report["wav"] = str(Path(cfg.out_wav))
    if cfg.as_json:
        out.write(json.dumps(report, indent=2, default=str) + "\n")
    else:
        out.write("\n")
    return report
