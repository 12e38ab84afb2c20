"""`orin-omni smoke`: end-to-end checks of a running server (--url) or of the engine in-process (--model-dir).

It makes its own inputs (a 30 s speech-like clip and a test image, orin.inputs.media; a 4 s MP4 with a soundtrack,
orin.inputs.video.synth_clip), runs four requests (text only; image + audio + text; speech out; video with its audio +
text, left out with --no-video) and checks each answer: non-empty text, TTFT and peak memory within limits, for
speech a valid 24 kHz WAV whose length matches the codec frames generated (12.5 frames/s at 24 kHz is 1920
samples a frame), for video a prompt at least as long as the clip's frames and soundtrack make it (so the video
was decoded and its audio kept, not dropped), and power readings where a power backend exists ("skip", never
"pass", when there is none). In-process the clip goes through orin.inputs.video.load_video, the decoder a server uses;
over HTTP it is a `video_url` data: URL, and a server that refuses that part type (HTTP 400
unsupported_content_type) fails the video check as one that predates video support. Over HTTP it also checks
/health and /metrics. Only the standard library talks HTTP here, so the smoke test runs on a device without the
`openai` package.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..audio_format import INPUT_SAMPLE_RATE, OUTPUT_SAMPLE_RATE, audio_token_count
from ..device.profile import SpeechTuning
from ..errors import OrinError, UsageError
from .check import FAIL, SKIP, Check
from .http import Unreachable, exchange
from .smoke_checks import (
    Answer,
    SmokeRequestError,
    as_number,
    check_first_audio,
    check_health,
    check_metrics,
    check_peak,
    check_power,
    check_prompt_tokens,
    check_text,
    check_ttft,
    check_wav,
)
from .smoke_voice import voice_checks

if TYPE_CHECKING:
    from ..runtime.engine import EngineConfig

# The video request's clip: 4 s at 10 fps, 128x160 (sides already multiples of 32, under the frame-pixel cap, so
# the decoder keeps them), with a soundtrack.
VIDEO_SECONDS = 4.0
VIDEO_FPS = 10
VIDEO_SIZE = (128, 160)  # (height, width)
AUDIO_FEATURES_PER_SECOND = 100  # Whisper features: a 10 ms hop at 16 kHz


@dataclass(frozen=True)
class SmokeConfig:
    url: str | None = None  # a running server; or, in-process:
    engine: EngineConfig | None = None  # the engine to open (its budget is also the peak-memory limit)
    max_ttft: float | None = None
    max_peak: int | None = None  # None: the engine's budget, or the one the server reports
    api_key_file: str | None = None
    audio_seconds: float = 30.0
    max_new_tokens: int = 32
    max_speech_seconds: float | None = None  # in-process only; a server applies its own --max-speech-seconds
    voice: str | None = None
    timeout_s: float = 600.0
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
    """The fewest prompt tokens the smoke clip can make: its frames sampled at 2 fps (orin.inputs.video's default, an
    even count within the frame bounds) in temporal grids of two, each (h/32)·(w/32) tokens (16-pixel patches
    merged 2x2), plus its soundtrack's audio tokens (Qwen3-Omni's n_window 50; the decoded track is never shorter
    than the clip, AAC's priming makes it a little longer)."""
    from ..inputs.video import FRAME_FACTOR, TEMPORAL_PATCH, VideoOptions, sampled_frames

    h, w = size
    frames = sampled_frames(seconds, VideoOptions())
    tokens = frames // TEMPORAL_PATCH * (h // FRAME_FACTOR) * (w // FRAME_FACTOR)
    if audio:
        tokens += audio_token_count(int(seconds * AUDIO_FEATURES_PER_SECOND), n_window)
    return tokens


# ------------------------------------------------------------------ inputs


@dataclass(frozen=True)
class Inputs:
    audio: object  # float32 mono 16 kHz
    image: object  # PIL RGB
    video: bytes | None = None  # an MP4 with a soundtrack (orin.inputs.video.synth_clip); None without the video request

    @classmethod
    def make(cls, audio_seconds: float, video: bool = False) -> Inputs:
        from ..inputs.media import synth_image, synth_speechlike

        clip = None
        if video:
            from ..inputs.video import synth_clip

            clip = synth_clip(VIDEO_SECONDS, VIDEO_FPS, VIDEO_SIZE, audio=True, seed=0)
        return cls(audio=synth_speechlike(audio_seconds, sr=INPUT_SAMPLE_RATE, seed=0), image=synth_image(224, seed=0),
                   video=clip)

    def mp4_data_url(self) -> str:
        return "data:video/mp4;base64," + base64.b64encode(self.video).decode()

    def wav_b64(self) -> str:
        from ..inputs.media import encode_wav

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
    """orin.runtime.engine in this process."""

    def __init__(self, engine, voice: str | None = None, max_speech_seconds: float | None = None):
        self.engine = engine
        self.voice = voice
        self.max_speech_seconds = max_speech_seconds

    def ask(self, case: Case, inputs: Inputs, max_new_tokens: int) -> Answer:
        from ..contract import GenerationRequest
        from ..inputs.media import encode_wav
        from ..serve.chat_request import speech_frames

        parts: list[dict] = []
        if case.image:
            parts.append({"type": "image", "image": inputs.image})
        if case.audio:
            parts.append({"type": "audio", "audio": inputs.audio})
        extra = {"voice": self.voice} if self.voice else {}
        if self.max_speech_seconds is not None:  # as a server caps it (--max-speech-seconds)
            extra["max_audio_frames"] = speech_frames(self.max_speech_seconds)
        try:
            if case.video:  # through the real decoder, as a server decodes a video_url part
                from ..inputs.video import load_video

                parts.append({"type": "video", "video": load_video(inputs.video, name="the smoke clip")})
            parts.append({"type": "text", "text": case.prompt})
            req = GenerationRequest(messages=({"role": "user", "content": parts},), max_new_tokens=max_new_tokens,
                                    speech=case.speech, **extra)
            text, audio, report = self.engine.generate(req)
        except OrinError as exc:
            raise SmokeRequestError(str(exc)) from exc
        wav = encode_wav(audio, sr=OUTPUT_SAMPLE_RATE) if case.speech and audio is not None else None
        return Answer(text=text, wav=wav, report=report.to_json())  # the JSON a server returns under "orin"


# ------------------------------------------------------------------ run


def _run_cases(ask: Callable[[Case], Answer], ttft_limit: float | None, peak_limit: int | None,
               speech: SpeechTuning, video: bool = True) -> tuple[list[Check], dict[str, Mapping]]:
    """Every case through `ask`, and its checks; `speech` is code2wav's chunk schedule the WAVs were made in."""
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
            checks.append(check_wav(case.name, answer, speech))
            checks.append(check_first_audio(case.name, answer.report))
        if case.video:
            checks.append(check_prompt_tokens(case.name, answer.report, video_prompt_tokens()))
    checks.append(check_power(reports))
    return checks, reports


def _peak_limit(cfg: SmokeConfig, budget_seen: object) -> int | None:
    """--max-peak, else the in-process engine's budget, else the budget the server or engine reports."""
    if cfg.max_peak is not None:
        return cfg.max_peak
    if cfg.engine is not None and cfg.engine.budget is not None:
        return cfg.engine.budget
    value = as_number(budget_seen)
    return int(value) if value else None


def _read_key(path: str | None) -> str | None:
    if path is None:
        return None
    from ..serve.app import read_api_keys

    return read_api_keys(path)[0]


def run_smoke(cfg: SmokeConfig, *, engine=None) -> SmokeResult:
    """Run the checks. `engine` (tests) skips opening one for --model-dir."""
    if (cfg.url is None) == (cfg.engine is None and engine is None):
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
        # a server does not report its chunk schedule: the default one, which every device profile has
        case_checks, _ = _run_cases(lambda c: target.ask(c, inputs, cfg.max_new_tokens), cfg.max_ttft,
                                    _peak_limit(cfg, budget_seen), SpeechTuning(), cfg.video)
        checks += case_checks
        if cfg.voice_endpoints:
            checks += voice_checks(target)
        checks.append(check_metrics(target))
        return SmokeResult(target=cfg.url, checks=tuple(checks))
    owned = engine is None
    if owned:
        from ..runtime.engine import Engine

        engine = Engine(cfg.engine)
    try:
        budget_seen = (engine.memory() or {}).get("budget")
        target = EngineTarget(engine, cfg.voice, cfg.max_speech_seconds)
        checks, _ = _run_cases(lambda c: target.ask(c, inputs, cfg.max_new_tokens), cfg.max_ttft,
                               _peak_limit(cfg, budget_seen), engine.profile.speech, cfg.video)
    finally:
        if owned:
            engine.close()
    name = cfg.engine.model_dir if cfg.engine is not None else getattr(engine, "model_name", "engine")
    return SmokeResult(target=name, checks=tuple(checks))


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
