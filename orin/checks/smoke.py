"""`orin-omni smoke`: end-to-end checks of a running server (--url) or of the engine in-process (--model-dir).

It makes its own inputs (a 30 s speech-like clip and a test image, orin.media; a 4 s MP4 with a soundtrack,
orin.video.synth_clip), runs four requests (text only; image + audio + text; speech out; video with its audio +
text, left out with --no-video) and checks each answer: non-empty text, TTFT and peak memory within limits, for
speech a valid 24 kHz WAV whose length matches the codec frames generated (12.5 frames/s at 24 kHz is 1920
samples a frame), for video a prompt at least as long as the clip's frames and soundtrack make it (so the video
was decoded and its audio kept, not dropped), and power readings where a power backend exists ("skip", never
"pass", when there is none). In-process the clip goes through orin.video.load_video, the decoder a server uses;
over HTTP it is a `video_url` data: URL, and a server that refuses that part type (HTTP 400
unsupported_content_type) fails the video check as one that predates video support. Over HTTP it also checks
/health and /metrics. Only the standard library talks HTTP here, so the smoke test runs on a device without the
`openai` package.
"""

from __future__ import annotations

import base64
import io
import json
import math
import wave
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..audio_format import (
    CODEC_FRAMES_PER_SECOND,
    INPUT_SAMPLE_RATE,
    OUTPUT_SAMPLE_RATE,
    SAMPLES_PER_FRAME,
    audio_token_count,
)
from ..errors import OrinError, UsageError
from ..units import format_bytes
from .check import FAIL, PASS, SKIP, Check
from .http import Unreachable, exchange
from .smoke_voice import voice_checks

MIN_SPEECH_SECONDS = 0.1  # when the report does not say how many frames were generated
# The video request's clip: 4 s at 10 fps, 128x160 (sides already multiples of 32, under the frame-pixel cap, so
# the decoder keeps them), with a soundtrack.
VIDEO_SECONDS = 4.0
VIDEO_FPS = 10
VIDEO_SIZE = (128, 160)  # (height, width)
AUDIO_FEATURES_PER_SECOND = 100  # Whisper features: a 10 ms hop at 16 kHz


@dataclass(frozen=True)
class SmokeConfig:
    url: str | None = None
    model_dir: str | None = None
    budget: int | None = None
    max_ttft: float | None = None
    max_peak: int | None = None
    api_key_file: str | None = None
    device: str = "auto"
    power_backend: str = "auto"
    sysfs_root: str = "/sys"
    audio_seconds: float = 30.0
    max_new_tokens: int = 32
    max_speech_seconds: float | None = None  # in-process only; a server applies its own --max-speech-seconds
    voice: str | None = None
    timeout_s: float = 600.0
    packed_cache: str | None = None  # in-process: orin.packed_cache's directory
    video: bool = True  # the video request (--video/--no-video)
    voice_endpoints: bool = True  # with --url: /v1/audio/speech, /v1/audio/transcriptions, /v1/realtime


@dataclass(frozen=True)
class SmokeResult:
    target: str
    checks: tuple[Check, ...]

    @property
    def ok(self) -> bool:
        return all(c.status != FAIL for c in self.checks)

    def to_json(self) -> dict:
        return {"target": self.target, "ok": self.ok, "checks": [c.to_json() for c in self.checks]}


@dataclass(frozen=True)
class Case:
    name: str
    prompt: str
    image: bool = False
    audio: bool = False
    speech: bool = False
    video: bool = False  # the clip, with its soundtrack


CASES = (
    Case("text", "In one short sentence: what is the capital of France?"),
    Case("image+audio+text", "Describe the picture and the sound in one sentence.", image=True, audio=True),
    Case("speech", "Say hello and introduce yourself in one sentence.", speech=True),
)
VIDEO_CASE = Case("video", "What moves in this clip, and what do you hear? Answer in one sentence.", video=True)


def cases(video: bool = True) -> tuple[Case, ...]:
    return CASES + (VIDEO_CASE,) if video else CASES


def video_prompt_tokens(seconds: float = VIDEO_SECONDS, size: tuple[int, int] = VIDEO_SIZE, *, audio: bool = True,
                        n_window: int = 50) -> int:
    """The fewest prompt tokens the smoke clip can make: its frames sampled at 2 fps (orin.video's default, an
    even count within the frame bounds) in temporal grids of two, each (h/32)·(w/32) tokens (16-pixel patches
    merged 2x2), plus its soundtrack's audio tokens (Qwen3-Omni's n_window 50; the decoded track is never shorter
    than the clip, AAC's priming makes it a little longer)."""
    from ..video import FRAME_FACTOR, TEMPORAL_PATCH, VideoOptions, sampled_frames

    h, w = size
    frames = sampled_frames(seconds, VideoOptions())
    tokens = frames // TEMPORAL_PATCH * (h // FRAME_FACTOR) * (w // FRAME_FACTOR)
    if audio:
        tokens += audio_token_count(int(seconds * AUDIO_FEATURES_PER_SECOND), n_window)
    return tokens


@dataclass(frozen=True)
class Answer:
    text: str
    wav: bytes | None
    report: Mapping


class SmokeRequestError(OrinError):
    """One smoke request failed (HTTP error, engine error); recorded as a failed check, not raised out."""


# ------------------------------------------------------------------ inputs


@dataclass(frozen=True)
class Inputs:
    audio: object  # float32 mono 16 kHz
    image: object  # PIL RGB
    video: bytes | None = None  # an MP4 with a soundtrack (orin.video.synth_clip); None without the video request

    @classmethod
    def make(cls, audio_seconds: float, video: bool = False) -> Inputs:
        from ..media import synth_image, synth_speechlike

        clip = None
        if video:
            from ..video import synth_clip

            clip = synth_clip(VIDEO_SECONDS, VIDEO_FPS, VIDEO_SIZE, audio=True, seed=0)
        return cls(audio=synth_speechlike(audio_seconds, sr=INPUT_SAMPLE_RATE, seed=0), image=synth_image(224, seed=0),
                   video=clip)

    def mp4_data_url(self) -> str:
        return "data:video/mp4;base64," + base64.b64encode(self.video).decode()

    def wav_b64(self) -> str:
        from ..media import encode_wav

        return base64.b64encode(encode_wav(self.audio, sr=INPUT_SAMPLE_RATE)).decode()

    def png_data_url(self) -> str:
        buf = io.BytesIO()
        self.image.save(buf, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# ------------------------------------------------------------------ targets


class HttpTarget:
    """An `orin-omni serve` (or other OpenAI-compatible server returning the `orin` report) over HTTP."""

    def __init__(self, url: str, api_key: str | None, timeout_s: float, voice: str | None = None):
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.voice = voice
        self.model: str | None = None

    def _request(self, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        data = json.dumps(body).encode() if body is not None else None
        try:
            return exchange(self.url + path, method, data, headers, self.api_key, self.timeout_s)
        except Unreachable as exc:
            raise SmokeRequestError(str(exc)) from exc

    def get_json(self, path: str) -> tuple[int, dict]:
        status, raw = self._request("GET", path)
        return status, _json_or_error(raw)

    def get_text(self, path: str) -> tuple[int, str]:
        status, raw = self._request("GET", path)
        return status, raw.decode("utf-8", "replace")

    def ask(self, case: Case, inputs: Inputs, max_new_tokens: int) -> Answer:
        content: list[dict] = []
        if case.image:
            content.append({"type": "image_url", "image_url": {"url": inputs.png_data_url()}})
        if case.audio:
            content.append({"type": "input_audio", "input_audio": {"data": inputs.wav_b64(), "format": "wav"}})
        if case.video:
            content.append({"type": "video_url", "video_url": {"url": inputs.mp4_data_url()}})
        content.append({"type": "text", "text": case.prompt})
        body: dict = {"messages": [{"role": "user", "content": content}], "max_tokens": max_new_tokens,
                      "temperature": 0}
        if self.model:
            body["model"] = self.model
        if case.speech:
            body["modalities"] = ["text", "audio"]
            body["audio"] = {"format": "wav", **({"voice": self.voice} if self.voice else {})}
        status, raw = self._request("POST", "/v1/chat/completions", body)
        data = _json_or_error(raw)
        if status != 200:
            error = data.get("error") if isinstance(data.get("error"), dict) else {}
            message = error.get("message")
            if case.video and status == 400 and error.get("code") == "unsupported_content_type":
                raise SmokeRequestError("the server predates video support: it refused the video_url part (HTTP 400 "
                                        f"unsupported_content_type: {message}); upgrade it, or leave the check out "
                                        "with --no-video")
            raise SmokeRequestError(f"HTTP {status}: {message or raw[:200]!r}")
        try:
            message = data["choices"][0]["message"]
        except (KeyError, IndexError, TypeError) as exc:
            raise SmokeRequestError(f"response has no choices[0].message: {raw[:200]!r}") from exc
        audio = message.get("audio") or None
        text = (audio or {}).get("transcript") if case.speech else message.get("content")
        wav = None
        if case.speech:
            if not audio or not isinstance(audio.get("data"), str):
                raise SmokeRequestError("speech was asked for but the response has no message.audio.data")
            try:
                wav = base64.b64decode(audio["data"], validate=True)
            except ValueError as exc:
                raise SmokeRequestError(f"message.audio.data is not valid base64: {exc}") from exc
        return Answer(text=text or "", wav=wav, report=data.get("orin") or {})


def _json_or_error(raw: bytes) -> dict:
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


class EngineTarget:
    """orin.engine in this process."""

    def __init__(self, engine, voice: str | None = None, max_speech_seconds: float | None = None):
        self.engine = engine
        self.voice = voice
        self.max_speech_seconds = max_speech_seconds

    def ask(self, case: Case, inputs: Inputs, max_new_tokens: int) -> Answer:
        from ..contract import GenerationRequest
        from ..media import encode_wav

        parts: list[dict] = []
        if case.image:
            parts.append({"type": "image", "image": inputs.image})
        if case.audio:
            parts.append({"type": "audio", "audio": inputs.audio})
        extra = {"voice": self.voice} if self.voice else {}
        if self.max_speech_seconds is not None:
            extra["max_audio_frames"] = max(1, math.ceil(self.max_speech_seconds * CODEC_FRAMES_PER_SECOND))
        try:
            if case.video:  # through the real decoder, as a server decodes a video_url part
                from ..video import load_video

                parts.append({"type": "video", "video": load_video(inputs.video, name="the smoke clip")})
            parts.append({"type": "text", "text": case.prompt})
            req = GenerationRequest(messages=({"role": "user", "content": parts},), max_new_tokens=max_new_tokens,
                                    speech=case.speech, **extra)
            text, audio, report = self.engine.generate(req)
        except OrinError as exc:
            raise SmokeRequestError(str(exc)) from exc
        wav = encode_wav(audio, sr=OUTPUT_SAMPLE_RATE) if case.speech and audio is not None else None
        return Answer(text=text, wav=wav, report=report.to_json())  # the JSON a server returns under "orin"


# ------------------------------------------------------------------ checks


def _num(value: object) -> float | None:
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
    ttft = _num(report.get("ttft_s"))
    if ttft is None or ttft <= 0:
        return Check(f"{name}: ttft", FAIL, f"the report has no time to first token ({report.get('ttft_s')!r})")
    if limit is None:
        return Check(f"{name}: ttft", PASS, f"{ttft:.3f} s (no --max-ttft)")
    status = PASS if ttft <= limit else FAIL
    return Check(f"{name}: ttft", status, f"{ttft:.3f} s, limit {limit:g} s")


def check_peak(name: str, report: Mapping, limit: int | None) -> Check:
    peak = _num(report.get("peak_bytes"))
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


def vocoder_chunks(frames: int) -> int:
    """How many pieces code2wav decodes `frames` codec frames in (orin.vocoder's fixed chunk schedule)."""
    from ..vocoder import chunk_count

    return chunk_count(frames)


def expected_samples(frames: int) -> tuple[int, int]:
    """The range of sample counts `frames` codec frames decode to: 1920 a frame, less at most one frame at the
    edge of each vocoder chunk (the causal decoder's trim)."""
    return (frames - vocoder_chunks(frames)) * SAMPLES_PER_FRAME, frames * SAMPLES_PER_FRAME


def check_wav(name: str, answer: Answer) -> Check:
    """A valid 24 kHz mono 16-bit WAV whose length fits the codec frames generated or, when the report does not
    count frames, longer than 0.1 s; and as long as the report's audio_seconds."""
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
    frames = _num(answer.report.get("talker_frames", answer.report.get("codec_frames")))
    if frames is not None:
        lo, hi = expected_samples(int(frames))
        lo = max(lo, 1)  # an empty WAV is never a plausible answer
        if not lo <= samples <= hi:
            return Check(label, FAIL, f"{samples} samples ({seconds:.2f} s) for {int(frames)} codec frames; "
                         f"expected {lo}..{hi}")
        plausible = f"{int(frames)} frames"
    else:
        if seconds <= MIN_SPEECH_SECONDS:
            return Check(label, FAIL, f"{seconds:.3f} s of audio; expected more than {MIN_SPEECH_SECONDS} s")
        plausible = f"> {MIN_SPEECH_SECONDS} s"
    reported = _num(answer.report.get("audio_seconds"))
    if reported is not None and abs(reported - seconds) > 1.0 / sr + 1e-6:
        return Check(label, FAIL, f"{seconds:.3f} s of audio but the report says {reported:.3f} s")
    return Check(label, PASS, f"{seconds:.2f} s at 24 kHz ({plausible})")


def check_prompt_tokens(name: str, report: Mapping, minimum: int) -> Check:
    """The prompt holds at least the tokens its media make (a video's frames and soundtrack): fewer means the
    server or engine dropped frames or the audio."""
    tokens = _num(report.get("prompt_tokens"))
    if tokens is None or tokens <= 0:
        return Check(f"{name}: prompt tokens", FAIL, f"the report has no prompt token count "
                     f"({report.get('prompt_tokens')!r})")
    status = PASS if tokens >= minimum else FAIL
    return Check(f"{name}: prompt tokens", status, f"{int(tokens)}, at least {minimum} expected (frames + soundtrack)")


def check_first_audio(name: str, report: Mapping) -> Check:
    first = _num(report.get("first_audio_s"))
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
        joules, mean_w = _num(energy.get("joules")), _num(energy.get("mean_w"))
        if joules is None or joules <= 0 or mean_w is None or mean_w <= 0:
            missing.append(f"{name} ({energy.get('backend', 'none')}: {energy.get('note') or 'no joules'})")
        else:
            parts.append(f"{name} {joules:.1f} J @ {mean_w:.1f} W")
    if missing:
        return Check("power", FAIL, "no energy for " + ", ".join(missing))
    return Check("power", PASS, f"{', '.join(sorted(backends))}: " + "; ".join(parts))


def check_health(target: HttpTarget) -> Check:
    try:
        status, body = target.get_json("/health")
    except SmokeRequestError as exc:
        return Check("health", FAIL, str(exc))
    if status != 200 or body.get("status") != "ok":
        return Check("health", FAIL, f"HTTP {status}: {body.get('status', body)!r}")
    return Check("health", PASS, f"ok, model {body.get('model')!r}")


def check_metrics(target: HttpTarget) -> Check:
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


# ------------------------------------------------------------------ run


def _run_cases(ask: Callable[[Case], Answer], ttft_limit: float | None, peak_limit: int | None,
               video: bool = True) -> tuple[list[Check], dict[str, Mapping]]:
    checks: list[Check] = []
    reports: dict[str, Mapping] = {}
    for case in cases(video):
        try:
            answer = ask(case)
        except SmokeRequestError as exc:
            checks.append(Check(f"{case.name}: request", FAIL, str(exc)))
            continue
        reports[case.name] = answer.report
        checks.append(check_text(case.name, answer))
        checks.append(check_ttft(case.name, answer.report, ttft_limit))
        checks.append(check_peak(case.name, answer.report, peak_limit))
        if case.speech:
            checks.append(check_wav(case.name, answer))
            checks.append(check_first_audio(case.name, answer.report))
        if case.video:
            checks.append(check_prompt_tokens(case.name, answer.report, video_prompt_tokens()))
    checks.append(check_power(reports))
    return checks, reports


def _peak_limit(cfg: SmokeConfig, budget_seen: object) -> int | None:
    """--max-peak, else --budget, else the budget the server or engine reports."""
    if cfg.max_peak is not None:
        return cfg.max_peak
    if cfg.budget is not None:
        return cfg.budget
    value = _num(budget_seen)
    return int(value) if value else None


def _read_key(path: str | None) -> str | None:
    if path is None:
        return None
    from ..serve.app import read_api_keys

    return read_api_keys(path)[0]


def run_smoke(cfg: SmokeConfig, *, engine=None) -> SmokeResult:
    """Run the checks. `engine` (tests) skips opening one for --model-dir."""
    if (cfg.url is None) == (cfg.model_dir is None and engine is None):
        raise UsageError("give exactly one of --url URL (a running server) or --model-dir DIR (in-process)")
    inputs = Inputs.make(cfg.audio_seconds, video=cfg.video)
    if cfg.url is not None:
        target = HttpTarget(cfg.url, _read_key(cfg.api_key_file), cfg.timeout_s, cfg.voice)
        checks = [check_health(target)]
        try:
            status, models = target.get_json("/v1/models")
            if status == 200 and models.get("data"):
                target.model = models["data"][0].get("id")
            _, health = target.get_json("/health")
        except SmokeRequestError:
            health = {}
        budget_seen = (health.get("memory") or {}).get("budget")
        case_checks, _ = _run_cases(lambda c: target.ask(c, inputs, cfg.max_new_tokens), cfg.max_ttft,
                                    _peak_limit(cfg, budget_seen), cfg.video)
        checks += case_checks
        if cfg.voice_endpoints:
            checks += voice_checks(target)
        checks.append(check_metrics(target))
        return SmokeResult(target=cfg.url, checks=tuple(checks))
    owned = engine is None
    if owned:
        from ..engine import Engine, EngineConfig

        engine = Engine(EngineConfig(model_dir=cfg.model_dir, device=cfg.device, budget=cfg.budget,
                                     power_backend=cfg.power_backend, sysfs_root=cfg.sysfs_root,
                                     packed_cache=cfg.packed_cache))
    try:
        budget_seen = (engine.memory() or {}).get("budget")
        target = EngineTarget(engine, cfg.voice, cfg.max_speech_seconds)
        checks, _ = _run_cases(lambda c: target.ask(c, inputs, cfg.max_new_tokens), cfg.max_ttft,
                               _peak_limit(cfg, budget_seen), cfg.video)
    finally:
        if owned:
            engine.close()
    return SmokeResult(target=cfg.model_dir or getattr(engine, "model_name", "engine"), checks=tuple(checks))


def render_table(result: SmokeResult) -> str:
    rows = [("check", "result", "detail")] + [(c.name, c.status.upper(), c.detail) for c in result.checks]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [f"smoke test of {result.target}"]
    lines += [f"{a:<{w0}}  {b:<{w1}}  {c}" for a, b, c in rows]
    failed = sum(c.status == FAIL for c in result.checks)
    skipped = sum(c.status == SKIP for c in result.checks)
    passed = len(result.checks) - failed - skipped
    lines.append(f"{'PASSED' if result.ok else 'FAILED'}: {passed} passed, {failed} failed, {skipped} skipped")
    if not result.ok:
        # A URL says nothing of the checkpoint: doctor then reads it from the installed unit.
        where = "" if "://" in result.target else f" --model-dir {result.target}"
        lines.append(f"run `orin-omni doctor{where}` to check the board")
    return "\n".join(lines)
