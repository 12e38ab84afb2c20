"""`orin-omni smoke`'s checks, one answer or one report at a time: the text, TTFT and peak memory against their
limits, a speech answer's WAV against the codec frames it was made of (12.5 frames/s at 24 kHz is 1920 samples a
frame), a video's prompt tokens against what its frames and soundtrack make, the power readings ("skip", never
"pass", without a power backend), and a server's /health and /metrics. orin.checks.smoke runs them."""

from __future__ import annotations

import io
import math
import wave
from collections.abc import Mapping
from dataclasses import dataclass

from ..audio_format import OUTPUT_SAMPLE_RATE, SAMPLES_PER_FRAME
from ..device.profile import SpeechTuning
from ..errors import OrinError
from ..units import format_bytes
from .check import FAIL, PASS, SKIP, Check

MIN_SPEECH_SECONDS = 0.1  # when the report does not say how many frames were generated


@dataclass(frozen=True)
class Answer:
    """What a smoke target answered one case: its text, its WAV (speech cases), and its report as JSON."""

    text: str
    wav: bytes | None
    report: Mapping


class SmokeRequestError(OrinError):
    """One smoke request failed (HTTP error, engine error); recorded as a failed check, not raised out."""


def as_number(value: object) -> float | None:
    """A report's figure as a finite number; None for anything else (missing, a string, NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def check_text(name: str, answer: Answer) -> Check:
    text = answer.text.strip()
    if not text:
        return Check(f"{name}: answer", FAIL, "empty text")
    shown = text if len(text) <= 40 else text[:37] + "..."
    return Check(f"{name}: answer", PASS, f"{len(text)} chars: {shown!r}")


def check_ttft(name: str, report: Mapping, limit: float | None) -> Check:
    ttft = as_number(report.get("ttft_s"))
    if ttft is None or ttft <= 0:
        return Check(f"{name}: ttft", FAIL, f"the report has no time to first token ({report.get('ttft_s')!r})")
    if limit is None:
        return Check(f"{name}: ttft", PASS, f"{ttft:.3f} s (no --max-ttft)")
    status = PASS if ttft <= limit else FAIL
    return Check(f"{name}: ttft", status, f"{ttft:.3f} s, limit {limit:g} s")


def check_peak(name: str, report: Mapping, limit: int | None) -> Check:
    peak = as_number(report.get("peak_bytes"))
    if peak is None or peak <= 0:
        return Check(f"{name}: peak memory", FAIL, f"the report has no peak memory ({report.get('peak_bytes')!r})")
    if limit is None:
        return Check(f"{name}: peak memory", PASS, f"{format_bytes(peak)} (no --max-peak or budget)")
    status = PASS if peak <= limit else FAIL
    return Check(f"{name}: peak memory", status, f"{format_bytes(peak)}, limit {format_bytes(limit)}")


def parse_wav(data: bytes) -> tuple[int, int, int, int]:
    """(sample rate, channels, sample width, frames) of a WAV file; raises ValueError for anything else."""
    try:
        with wave.open(io.BytesIO(data), "rb") as w:
            params = (w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes())
            actual = len(w.readframes(w.getnframes())) // max(1, w.getnchannels() * w.getsampwidth())
    except (wave.Error, EOFError) as exc:
        raise ValueError(f"not a valid WAV file: {exc}") from exc
    if actual != params[3]:
        raise ValueError(f"WAV header says {params[3]} frames but the data holds {actual}")
    return params


def expected_samples(frames: int, speech: SpeechTuning) -> tuple[int, int]:
    """The range of sample counts `frames` codec frames decode to: 1920 a frame, less at most one frame at the
    edge of each chunk of code2wav's schedule (`speech`: the causal decoder's trim)."""
    return (frames - speech.chunk_count(frames)) * SAMPLES_PER_FRAME, frames * SAMPLES_PER_FRAME


def check_wav(name: str, answer: Answer, speech: SpeechTuning) -> Check:
    """A valid 24 kHz mono 16-bit WAV whose length fits the codec frames generated (in chunks of `speech`'s
    schedule) or, when the report does not count frames, longer than 0.1 s; and as long as the report's
    audio_seconds."""
    label = f"{name}: wav"
    if not answer.wav:
        return Check(label, FAIL, "no audio returned")
    try:
        sr, channels, width, samples = parse_wav(answer.wav)
    except ValueError as exc:
        return Check(label, FAIL, str(exc))
    if (sr, channels, width) != (OUTPUT_SAMPLE_RATE, 1, 2):
        return Check(label, FAIL, f"{sr} Hz, {channels} channel(s), {8 * width}-bit; expected 24000 Hz mono 16-bit")
    seconds = samples / sr
    frames = as_number(answer.report.get("talker_frames", answer.report.get("codec_frames")))
    if frames is not None:
        lo, hi = expected_samples(int(frames), speech)
        lo = max(lo, 1)  # an empty WAV is never a plausible answer
        if not lo <= samples <= hi:
            return Check(label, FAIL, f"{samples} samples ({seconds:.2f} s) for {int(frames)} codec frames; "
                         f"expected {lo}..{hi}")
        plausible = f"{int(frames)} frames"
    else:
        if seconds <= MIN_SPEECH_SECONDS:
            return Check(label, FAIL, f"{seconds:.3f} s of audio; expected more than {MIN_SPEECH_SECONDS} s")
        plausible = f"> {MIN_SPEECH_SECONDS} s"
    reported = as_number(answer.report.get("audio_seconds"))
    if reported is not None and abs(reported - seconds) > 1.0 / sr + 1e-6:
        return Check(label, FAIL, f"{seconds:.3f} s of audio but the report says {reported:.3f} s")
    return Check(label, PASS, f"{seconds:.2f} s at 24 kHz ({plausible})")


def check_prompt_tokens(name: str, report: Mapping, minimum: int) -> Check:
    """The prompt holds at least the tokens its media make (a video's frames and soundtrack): fewer means the
    server or engine dropped frames or the audio."""
    tokens = as_number(report.get("prompt_tokens"))
    if tokens is None or tokens <= 0:
        return Check(f"{name}: prompt tokens", FAIL, f"the report has no prompt token count "
                     f"({report.get('prompt_tokens')!r})")
    status = PASS if tokens >= minimum else FAIL
    return Check(f"{name}: prompt tokens", status, f"{int(tokens)}, at least {minimum} expected (frames + soundtrack)")


def check_first_audio(name: str, report: Mapping) -> Check:
    first = as_number(report.get("first_audio_s"))
    if first is None or first <= 0:
        return Check(f"{name}: first audio", FAIL, f"the report has no time to first audio "
                     f"({report.get('first_audio_s')!r})")
    return Check(f"{name}: first audio", PASS, f"{first:.3f} s")


def check_power(reports: Mapping[str, Mapping]) -> Check:
    """Energy must be measured for every request when a backend reads power; with backend "none" the check
    is skipped (there is nothing to verify), which is not a pass."""
    if not reports:
        return Check("power", FAIL, "no request completed")
    backends = {str((r.get("energy") or {}).get("backend", "none")) for r in reports.values()}
    if backends == {"none"}:
        return Check("power", SKIP, "no power backend on this machine (backend none)")
    missing, parts = [], []
    for name, report in reports.items():
        energy = report.get("energy") or {}
        joules, mean_w = as_number(energy.get("joules")), as_number(energy.get("mean_w"))
        if joules is None or joules <= 0 or mean_w is None or mean_w <= 0:
            missing.append(f"{name} ({energy.get('backend', 'none')}: {energy.get('note') or 'no joules'})")
        else:
            parts.append(f"{name} {joules:.1f} J @ {mean_w:.1f} W")
    if missing:
        return Check("power", FAIL, "no energy for " + ", ".join(missing))
    return Check("power", PASS, f"{', '.join(sorted(backends))}: " + "; ".join(parts))


def check_health(target) -> Check:
    """`target`: orin.checks.smoke.HttpTarget."""
    try:
        status, body = target.get_json("/health")
    except SmokeRequestError as exc:
        return Check("health", FAIL, str(exc))
    if status != 200 or body.get("status") != "ok":
        return Check("health", FAIL, f"HTTP {status}: {body.get('status', body)!r}")
    return Check("health", PASS, f"ok, model {body.get('model')!r}")


def check_metrics(target) -> Check:
    from ..serve.metrics import parse_metrics

    try:
        status, text = target.get_text("/metrics")
    except SmokeRequestError as exc:
        return Check("metrics", FAIL, str(exc))
    if status != 200:
        return Check("metrics", FAIL, f"HTTP {status}")
    try:
        samples = parse_metrics(text)
    except ValueError as exc:
        return Check("metrics", FAIL, f"not Prometheus text: {exc}")
    wanted = ("orin_ttft_seconds_count", "orin_requests_total", "orin_memory_resident_bytes",
              "orin_process_resident_memory_bytes")
    absent = [w for w in wanted if not any(k == w or k.startswith(w + "{") for k in samples)]
    if absent:
        return Check("metrics", FAIL, f"missing {', '.join(absent)}")
    return Check("metrics", PASS, f"{len(samples)} samples, {int(samples['orin_ttft_seconds_count'])} TTFTs")
