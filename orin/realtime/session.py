"""A Realtime session's state apart from I/O: its configuration (what `session.update` sets and `session.created` /
`session.updated` echo, in the GA shape), the per-response settings `response.create` may override, and the input
audio buffer on the session's audio timeline.

What this server cannot honour is refused with an EventError naming the field, not ignored: tools and function
calling, input audio transcription (a separate recogniser; /v1/audio/transcriptions does speech to text),
noise reduction, semantic_vad, tracing, prompt templates, reasoning settings, output speeds other than 1, output
formats other than audio/pcm at 24 kHz.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..serve.voice import VoiceError, parse_voice
from .audio import INPUT_FORMATS, OUTPUT_FORMATS, PCM_RATE
from .events import EventError
from .vad import ServerVad, VadConfigError

MODALITIES = ("audio", "text")
TRANSCRIBE_HINT = ("input audio transcription needs a separate recogniser, which this server does not run: leave "
                   "it null (the model hears the audio itself), or send the audio to POST /v1/audio/transcriptions")
TOOLS_HINT = "tools and function calling are not supported by this server; leave 'tools' empty"


@dataclass(frozen=True)
class Capabilities:
    """What the served model offers a session: its name, the talker's voices, the cap on one answer's tokens."""

    model: str
    voices: tuple[str, ...]
    default_voice: str
    max_output_tokens: int


@dataclass(frozen=True)
class SessionConfig:
    model: str
    voice: str
    instructions: str = ""
    output_modalities: tuple[str, ...] = ("audio",)
    input_format: str = "audio/pcm"
    turn_detection: ServerVad | None = field(default_factory=ServerVad)
    max_output_tokens: int | None = None  # None: "inf", the most the server and the context allow
    truncation: str = "auto"  # "auto": drop the oldest items to fit the context; "disabled": fail instead

    @classmethod
    def default(cls, caps: Capabilities) -> SessionConfig:
        return cls(model=caps.model, voice=caps.default_voice)

    def to_json(self, session_id: str, expires_at: int) -> dict:
        """The session object of session.created / session.updated."""
        return {
            "type": "realtime", "object": "realtime.session", "id": session_id, "model": self.model,
            "expires_at": expires_at, "output_modalities": list(self.output_modalities),
            "instructions": self.instructions,
            "audio": {
                "input": {"format": format_json(self.input_format), "transcription": None, "noise_reduction": None,
                          "turn_detection": self.turn_detection.to_json() if self.turn_detection else None},
                "output": {"format": format_json("audio/pcm"), "voice": self.voice, "speed": 1.0},
            },
            "tools": [], "tool_choice": "auto",
            "max_output_tokens": "inf" if self.max_output_tokens is None else self.max_output_tokens,
            "tracing": None, "truncation": self.truncation, "prompt": None, "include": None,
        }


def format_json(fmt: str) -> dict:
    return {"type": fmt, "rate": PCM_RATE} if fmt == "audio/pcm" else {"type": fmt}


def _bad(message: str, param: str, code: str = "invalid_value") -> EventError:
    return EventError(message, code=code, param=param)


def _object(value: object, param: str, allowed: tuple[str, ...]) -> dict:
    if not isinstance(value, dict):
        raise _bad(f"'{param}' must be an object", param, "invalid_type")
    unknown = sorted(set(value) - set(allowed))
    if unknown:
        raise _bad(f"unknown parameter '{param}.{unknown[0]}'; '{param}' takes {', '.join(allowed)}",
                   f"{param}.{unknown[0]}", "unknown_parameter")
    return value


def parse_format(value: object, param: str, formats: dict[str, int]) -> str:
    names = ", ".join(f"{{\"type\": \"{f}\"" + (f", \"rate\": {PCM_RATE}}}" if f == "audio/pcm" else "}")
                      for f in formats)
    if not isinstance(value, dict):
        raise _bad(f"'{param}' must be an object: {names}", param, "invalid_type")
    fmt = value.get("type")
    if fmt not in formats:
        raise _bad(f"{param}.type {fmt!r} is not supported here; use {names}", f"{param}.type")
    unknown = sorted(set(value) - {"type", "rate"})
    if unknown:
        raise _bad(f"unknown parameter '{param}.{unknown[0]}'", f"{param}.{unknown[0]}", "unknown_parameter")
    rate = value.get("rate")
    if fmt == "audio/pcm" and rate is not None and rate != PCM_RATE:
        raise _bad(f"{param}.rate {rate!r} is not supported: audio/pcm is {PCM_RATE} Hz (resample before sending)",
                   f"{param}.rate")
    if fmt != "audio/pcm" and rate is not None:
        raise _bad(f"{param}.rate: {fmt} is always 8000 Hz; leave 'rate' out", f"{param}.rate")
    return fmt


def parse_modalities(value: object, param: str) -> tuple[str, ...]:
    if (not isinstance(value, list) or len(value) != 1 or value[0] not in MODALITIES):
        raise _bad(f"'{param}' must be [\"audio\"] (speech with its transcript) or [\"text\"] (text only), got "
                   f"{value!r}; both at once is not possible", param)
    return (value[0],)


def _voice(value: object, param: str, caps: Capabilities) -> str:
    """orin.serve.voice's parse, its refusal as this protocol's error (invalid_value, naming the field)."""
    try:
        name = parse_voice(value, param, caps.voices)
    except VoiceError as exc:
        raise _bad(str(exc), exc.param) from exc
    if name is None:  # {"id": null}: a setting names a voice, it cannot leave it to the default
        raise _bad(f"'{param}' must name one of this model's voices: {', '.join(caps.voices)}", param)
    return name


def parse_max_tokens(value: object, param: str, caps: Capabilities) -> int | None:
    if value == "inf":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= caps.max_output_tokens:
        raise _bad(f"'{param}' must be a whole number from 1 to {caps.max_output_tokens} (the server's "
                   f"--max-new-tokens) or \"inf\", got {value!r}", param)
    return value


def _refuse_tools(obj: dict, prefix: str) -> None:
    if obj.get("tools"):
        raise _bad(TOOLS_HINT, f"{prefix}.tools")
    choice = obj.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise _bad(f"{TOOLS_HINT}; 'tool_choice' may only be \"auto\" or \"none\"", f"{prefix}.tool_choice")
    for key, what in (("prompt", "prompt templates"), ("reasoning", "reasoning settings")):
        if obj.get(key) is not None:
            raise _bad(f"{what} are not supported by this server; leave '{key}' null", f"{prefix}.{key}")
    if obj.get("parallel_tool_calls") not in (None, False, True):
        raise _bad("'parallel_tool_calls' must be true or false", f"{prefix}.parallel_tool_calls", "invalid_type")


_SESSION_KEYS = ("type", "model", "instructions", "output_modalities", "audio", "max_output_tokens", "tools",
                 "tool_choice", "tracing", "truncation", "prompt", "include", "parallel_tool_calls", "reasoning",
                 # read-only fields of the session object, which a client may send back as it got them
                 "id", "object", "expires_at")


def apply_update(cfg: SessionConfig, obj: dict, caps: Capabilities, *, spoke: bool,
                 buffered: bool) -> SessionConfig:
    """`cfg` with a session.update's `session` applied (fields left out keep their values). `spoke`: the model has
    answered with audio (the voice is fixed from then on, as on OpenAI); `buffered`: the input audio buffer holds
    audio (its format cannot change under it)."""
    obj = _object(obj, "session", _SESSION_KEYS)
    kind = obj.get("type")
    if kind == "transcription":
        raise _bad("transcription sessions are not supported by this server; use POST /v1/audio/transcriptions "
                   "for speech to text", "session.type")
    if kind != "realtime":
        raise _bad(f"session.type must be \"realtime\" (got {kind!r})", "session.type",
                   "missing_required_parameter" if kind is None else "invalid_value")
    if obj.get("model") is not None and obj["model"] != caps.model:
        raise _bad(f"session.model {obj['model']!r} is not served here; this server serves {caps.model!r}",
                   "session.model", "model_not_found")
    _refuse_tools(obj, "session")
    if obj.get("tracing") is not None:
        raise _bad("tracing is not supported by this server; leave 'tracing' null", "session.tracing")
    if obj.get("include"):
        raise _bad(f"'include' is not supported: {TRANSCRIBE_HINT}", "session.include")
    changes: dict = {}
    if "instructions" in obj:
        if not isinstance(obj["instructions"], str):
            raise _bad("'session.instructions' must be a string (\"\" clears it)", "session.instructions",
                       "invalid_type")
        changes["instructions"] = obj["instructions"]
    if "output_modalities" in obj:
        changes["output_modalities"] = parse_modalities(obj["output_modalities"], "session.output_modalities")
    if "max_output_tokens" in obj:
        changes["max_output_tokens"] = parse_max_tokens(obj["max_output_tokens"], "session.max_output_tokens", caps)
    if "truncation" in obj:
        if obj["truncation"] not in ("auto", "disabled"):
            raise _bad("'session.truncation' must be \"auto\" (drop the oldest items to fit the context) or "
                       "\"disabled\" (fail a response that does not fit); retention ratios are not supported",
                       "session.truncation")
        changes["truncation"] = obj["truncation"]
    if obj.get("audio") is not None:
        changes.update(_audio_update(cfg, obj["audio"], caps, spoke=spoke, buffered=buffered))
    return replace(cfg, **changes)


def _audio_update(cfg: SessionConfig, audio: object, caps: Capabilities, *, spoke: bool, buffered: bool) -> dict:
    audio = _object(audio, "session.audio", ("input", "output"))
    changes: dict = {}
    if audio.get("input") is not None:
        inp = _object(audio["input"], "session.audio.input",
                      ("format", "turn_detection", "transcription", "noise_reduction"))
        if inp.get("format") is not None:
            fmt = parse_format(inp["format"], "session.audio.input.format", INPUT_FORMATS)
            if fmt != cfg.input_format and buffered:
                raise _bad("the input audio buffer holds audio in the current format: commit or clear it before "
                           "changing the format", "session.audio.input.format")
            changes["input_format"] = fmt
        if "turn_detection" in inp:
            try:
                td = inp["turn_detection"]
                changes["turn_detection"] = None if td is None else ServerVad.from_json(
                    td, param="session.audio.input.turn_detection")
            except VadConfigError as exc:
                raise _bad(str(exc), exc.param) from exc
        if inp.get("transcription") is not None:
            raise _bad(TRANSCRIBE_HINT, "session.audio.input.transcription")
        if inp.get("noise_reduction") is not None:
            raise _bad("input noise reduction is not supported by this server; leave 'noise_reduction' null",
                       "session.audio.input.noise_reduction")
    if audio.get("output") is not None:
        out = _object(audio["output"], "session.audio.output", ("format", "voice", "speed"))
        if out.get("format") is not None:
            parse_format(out["format"], "session.audio.output.format", OUTPUT_FORMATS)
        if out.get("speed") not in (None, 1, 1.0):
            raise _bad("only speed 1.0 is supported: the model speaks at its own pace", "session.audio.output.speed")
        if out.get("voice") is not None:
            voice = _voice(out["voice"], "session.audio.output.voice", caps)
            if spoke and voice != cfg.voice:
                raise _bad("the voice cannot change once the model has answered with audio in this session",
                           "session.audio.output.voice")
            changes["voice"] = voice
    return changes


# --------------------------------------------------------------------------- per-response settings


@dataclass(frozen=True)
class ResponseParams:
    """One response's settings: the session's, with response.create's overrides."""

    output_modalities: tuple[str, ...]
    voice: str
    max_output_tokens: int | None
    instructions: str
    conversation: str = "auto"  # "auto": the answer joins the conversation; "none": out of band
    input: tuple | None = None  # the item objects (or item references) to answer instead of the conversation
    metadata: dict | None = None

    @property
    def speech(self) -> bool:
        return "audio" in self.output_modalities


_RESPONSE_KEYS = ("audio", "conversation", "input", "instructions", "max_output_tokens", "metadata",
                  "output_modalities", "tool_choice", "tools", "prompt", "reasoning", "parallel_tool_calls")


def response_params(cfg: SessionConfig, obj: dict, caps: Capabilities) -> ResponseParams:
    """The settings of a response.create whose `response` is `obj` ({} for the session's own)."""
    obj = _object(obj, "response", _RESPONSE_KEYS)
    _refuse_tools(obj, "response")
    params = ResponseParams(cfg.output_modalities, cfg.voice, cfg.max_output_tokens, cfg.instructions)
    changes: dict = {}
    if obj.get("output_modalities") is not None:
        changes["output_modalities"] = parse_modalities(obj["output_modalities"], "response.output_modalities")
    if obj.get("instructions") is not None:
        if not isinstance(obj["instructions"], str):
            raise _bad("'response.instructions' must be a string", "response.instructions", "invalid_type")
        changes["instructions"] = obj["instructions"]
    if obj.get("max_output_tokens") is not None:
        changes["max_output_tokens"] = parse_max_tokens(obj["max_output_tokens"], "response.max_output_tokens", caps)
    if obj.get("audio") is not None:
        audio = _object(obj["audio"], "response.audio", ("output",))
        out = _object(audio.get("output") or {}, "response.audio.output", ("format", "voice"))
        if out.get("format") is not None:
            parse_format(out["format"], "response.audio.output.format", OUTPUT_FORMATS)
        if out.get("voice") is not None:
            changes["voice"] = _voice(out["voice"], "response.audio.output.voice", caps)
    conversation = obj.get("conversation")
    if conversation is not None:
        if conversation not in ("auto", "none"):
            raise _bad("'response.conversation' must be \"auto\" (the default conversation) or \"none\" (an "
                       "out-of-band response)", "response.conversation")
        changes["conversation"] = conversation
    if obj.get("input") is not None:
        if not isinstance(obj["input"], list):
            raise _bad("'response.input' must be a list of items or item references", "response.input",
                       "invalid_type")
        changes["input"] = tuple(obj["input"])
    metadata = obj.get("metadata")
    if metadata is not None:
        if (not isinstance(metadata, dict) or len(metadata) > 16
                or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
            raise _bad("'response.metadata' must be an object of at most 16 string values", "response.metadata")
        changes["metadata"] = dict(metadata)
    return replace(params, **changes)


# --------------------------------------------------------------------------- the input audio buffer


class InputAudioBuffer:
    """The audio appended since the last commit or clear, at its format's rate, placed on the session's audio
    timeline (milliseconds from the start of all audio appended in the session, as the VAD counts them).
    `max_seconds` caps what it holds: an append past it is refused."""

    def __init__(self, max_seconds: float, rate: int = PCM_RATE):
        import numpy as np

        self.max_seconds = max_seconds
        self.rate = rate
        self._samples = np.zeros(0, dtype=np.float32)
        self._start = 0  # timeline position of the first held sample, in 1/PCM_RATE s
        self._end = 0  # timeline position after the last appended sample

    @property
    def _step(self) -> int:
        return PCM_RATE // self.rate  # timeline units a sample spans

    @property
    def duration_ms(self) -> int:
        return self._samples.size * 1000 // self.rate

    @property
    def start_ms(self) -> int:
        return self._start * 1000 // PCM_RATE

    @property
    def end_ms(self) -> int:
        return self._end * 1000 // PCM_RATE

    def __len__(self) -> int:
        return int(self._samples.size)

    def set_rate(self, rate: int) -> None:
        if self._samples.size and rate != self.rate:
            raise _bad("the input audio buffer holds audio in the current format; commit or clear it first",
                       "session.audio.input.format")
        self.rate = rate

    def append(self, samples) -> None:
        import numpy as np

        samples = np.asarray(samples, dtype=np.float32)
        if (self._samples.size + samples.size) / self.rate > self.max_seconds:
            raise _bad(f"the input audio buffer would hold over {self.max_seconds:g} s of audio (the server's limit); "
                       "commit it (input_audio_buffer.commit) or clear it before appending more", "audio",
                       "input_audio_buffer_full")
        self._samples = np.concatenate([self._samples, samples])
        self._end += samples.size * self._step

    def _index(self, ms: int) -> int:
        """The held sample at timeline position `ms` (clamped to what is held)."""
        pos = ms * PCM_RATE // 1000
        return min(max(0, (pos - self._start) // self._step), int(self._samples.size))

    def trim_before(self, ms: int) -> None:
        """Drop the audio before timeline position `ms`."""
        cut = self._index(ms)
        self._samples = self._samples[cut:]
        self._start += cut * self._step

    def take(self, until_ms: int | None = None) -> tuple:
        """(samples, start_ms, end_ms) of the audio up to `until_ms` (all of it: None), which leaves the buffer;
        what follows stays."""
        cut = self._samples.size if until_ms is None else self._index(until_ms)
        taken, start = self._samples[:cut], self.start_ms
        self._samples = self._samples[cut:]
        self._start += cut * self._step
        return taken, start, self.start_ms

    def clear(self) -> None:
        self._samples = self._samples[:0]
        self._start = self._end
