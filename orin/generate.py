"""`orin-omni generate`: one request through the engine. For people: the answer on stdout as it is written, then
a short summary on stderr (TTFT, tokens/s, peak memory, energy, where the speech went). For machines: `--json`,
the report as one JSON line on stdout; a terminal gets the answer with its control characters escaped."""

from __future__ import annotations

import json
import sys
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import InputError

if TYPE_CHECKING:
    from .runtime.engine import EngineConfig


@dataclass(frozen=True)
class GenerateConfig:
    engine: EngineConfig  # the checkpoint and how it is loaded
    text: str | None = None
    images: tuple[str, ...] = ()
    audios: tuple[str, ...] = ()
    videos: tuple[str, ...] = ()
    video_fps: float = 2.0  # frames sampled per second of each video
    video_audio: bool = True  # each video's soundtrack interleaved with its frames (Qwen3-Omni's audio in video)
    max_video_seconds: float = 600.0
    out_wav: str | None = None
    speech: bool | None = None  # None: speak when --out-wav says where the speech goes
    max_new_tokens: int = 256
    voice: str = "ethan"
    as_json: bool = False
    temperature: float = 0.0
    max_audio_frames: int | None = None

    @property
    def wants_speech(self) -> bool:
        return bool(self.out_wav) if self.speech is None else self.speech


def build_request(cfg: GenerateConfig):
    """Read the media files (any sample rate, resampled to 16 kHz; PNG/JPEG; videos sampled at `video_fps`) into
    one user message."""
    from .contract import GenerationRequest
    from .inputs.media import load_audio, load_image

    if not (cfg.text or cfg.images or cfg.audios or cfg.videos):
        raise InputError("nothing to answer: give --text, --image, --audio or --video")
    parts = []
    for path in cfg.images:
        parts.append({"type": "image", "image": load_image(path)})
    for path in cfg.audios:
        parts.append({"type": "audio", "audio": load_audio(path)})
    if cfg.videos:
        from .inputs.video import VideoOptions, load_video

        opts = VideoOptions(fps=cfg.video_fps, audio=cfg.video_audio, max_seconds=cfg.max_video_seconds)
        for path in cfg.videos:
            parts.append({"type": "video", "video": load_video(path, opts)})
    if cfg.text:
        parts.append({"type": "text", "text": cfg.text})
    return GenerationRequest(
        messages=({"role": "user", "content": parts},), max_new_tokens=cfg.max_new_tokens, speech=cfg.wants_speech,
        voice=cfg.voice, temperature=cfg.temperature, max_audio_frames=cfg.max_audio_frames,
    )


def run_generate(cfg: GenerateConfig, out=None, err=None) -> dict:
    """Returns the report as JSON (with "wav": where the speech went, or None)."""
    out = sys.stdout if out is None else out  # looked up per call: a test runner swaps them after import
    err = sys.stderr if err is None else err
    from .contract import AudioChunk, Done, TextDelta
    from .inputs.media import write_wav
    from .runtime.engine import Engine

    if cfg.out_wav and cfg.speech is False:
        raise InputError("--out-wav needs speech; drop --no-speech")
    request = build_request(cfg)  # bad media fails before the model is loaded
    engine = Engine(cfg.engine)
    try:
        chunks, report = [], None
        isatty = getattr(out, "isatty", None)
        show = for_terminal if isatty is not None and isatty() else str  # a file or pipe gets the text as it is
        for event in engine.stream(request):
            if isinstance(event, TextDelta) and not cfg.as_json:
                out.write(show(event.text))
                out.flush()
            elif isinstance(event, AudioChunk):
                chunks.append(event.samples)
            elif isinstance(event, Done):
                report = event.report
    finally:
        engine.close()
    wav = None
    if cfg.out_wav:
        import numpy as np

        from .audio_format import OUTPUT_SAMPLE_RATE

        samples = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        write_wav(cfg.out_wav, samples, OUTPUT_SAMPLE_RATE)
        wav = str(Path(cfg.out_wav))
    result = {**report.to_json(), "wav": wav}
    if cfg.as_json:
        out.write(json.dumps(result, separators=(",", ":"), default=str) + "\n")  # one line: one report
    else:
        out.write("\n")
        out.flush()
        err.write(render_summary(report, wav) + "\n")
    return result


def render_summary(report, wav: str | None = None) -> str:
    """Two or three lines under the answer (`report`: an orin.contract.Report): speed, memory, energy, and where
    the speech went (or why there is none on disk)."""
    from .units import format_bytes

    def secs(v) -> str:
        return "-" if v is None else f"{v:.3f} s"

    tps = report.tokens_per_s
    budget = report.budget_bytes
    lines = [
        f"{report.completion_tokens} tokens in {secs(report.total_s)} | TTFT "
        f"{secs(report.ttft_s)} | {'-' if tps is None else f'{tps:.1f}'} tokens/s | peak "
        f"{format_bytes(report.peak_bytes or 0)}"
        + (f" of a {format_bytes(budget)} budget" if budget else "")
        + f" | {report.prompt_tokens} prompt tokens on {report.device}",
        "energy: " + _energy_line(report.energy),
    ]
    frames, seconds = report.talker_frames, report.audio_seconds
    if wav:
        lines.append(f"speech: {seconds:.2f} s ({frames} codec frames, first audio after "
                     f"{secs(report.first_audio_s)}) written to {wav}")
    elif frames:
        lines.append(f"speech: {seconds:.2f} s generated but not saved; pass --out-wav FILE to keep it")
    else:
        lines.append("speech: none (pass --out-wav FILE to have the answer spoken)")
    return "\n".join(lines)


def _energy_line(energy) -> str:
    if not energy.available or energy.joules is None:
        return "not measured (no power backend was reading; `orin-omni power` shows which one works here)"
    mean = energy.mean_w
    line = (f"{energy.joules:.1f} J, mean {'-' if mean is None else f'{mean:.1f}'} W "
            f"({' -> '.join(energy.backends or [energy.backend])})")
    return line + (f"; {energy.note}" if energy.note else "")


def for_terminal(text: str) -> str:
    """`text` safe to print on a terminal: control characters other than newline and tab (a random model's bell,
    escape or carriage return would ring, recolour or overwrite the screen) shown escaped, as \\x07; a lone
    surrogate, which no terminal encoding can write, as U+FFFD."""
    out = []
    for ch in text:
        kind = unicodedata.category(ch)
        if kind == "Cc" and ch not in "\n\t":
            out.append(f"\\x{ord(ch):02x}")  # every Cc is below U+0100: C0, DEL and C1
        else:
            out.append("\ufffd" if kind == "Cs" else ch)
    return "".join(out)
