"""OpenAI's audio endpoints, apart from the routes: `POST /v1/audio/transcriptions` (multipart; the thinker is the
recogniser) and `POST /v1/audio/speech` (JSON; the thinker says the input verbatim and the talker speaks it). Parsing
and validation, the engine requests they map to, and their responses, written by EngineResponse subclasses so
that queueing, hang-ups and shutdown behave as for chat (orin.serve.streaming).

Transcription: `file` (WAV, FLAC, OGG or MP3, recognised from its bytes), `language` (ISO-639-1, named in
Qwen3-Omni's own recognition instruction, "Transcribe the English audio into text."), `prompt` (names and spelling
hints added to the instruction), `response_format` json, text or verbose_json (srt and vtt need timestamps, which
the model does not give), `temperature`, and `stream` (`transcript.text.delta` events, then
`transcript.text.done`). verbose_json has one segment spanning the audio: no invented word or segment timings.

Speech: `input`, `voice` (the talker's speakers), `instructions` (a speaking style for the system prompt),
`response_format` wav, pcm (raw 16-bit little-endian mono at 24 kHz, as OpenAI), flac or mp3 (where this machine's
libsndfile encodes them, probed at run time), `speed` 1 only, and `stream_format`: "audio" streams wav and pcm
as the talker makes them (the WAV header first, with the unknown sizes written as 0xFFFFFFFF as OpenAI does, so a
reader takes the data to the end of the stream) and sends flac and mp3 whole once encoded; "sse" sends
`speech.audio.delta` events of base64 PCM, then `speech.audio.done` with the usage. The audio SSE streams end
with their done event, not chat's "[DONE]". A raw audio stream that fails after its first bytes is cut off
(never completed), so a client cannot take it for a whole answer.
"""

from __future__ import annotations

import base64
import functools
import io
import logging
import math
import secrets
import struct
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..audio_format import INPUT_SAMPLE_RATE, OUTPUT_SAMPLE_RATE
from ..contract import AudioChunk, Done, TextDelta
from ..errors import InputError
from ..inputs.media import encode_pcm16
from .chat_request import ChatRequest, generation_request
from .protocol import ApiError, Limits, dumps, to_api_error
from .streaming import CLIENT_CLOSED, STATUS_KEY, EngineResponse
from .voice import parse_voice

if TYPE_CHECKING:
    from ..contract import GenerationRequest, Report
    from .worker import Run, Worker

log = logging.getLogger("orin.serve.app")  # one logger for the server's lines, whichever module writes them

# Qwen3-Omni's speech-input languages (Cantonese has no ISO-639-1 code: ISO 639-3 "yue").
LANGUAGES = {
    "ar": "Arabic", "de": "German", "en": "English", "es": "Spanish", "fr": "French", "id": "Indonesian",
    "it": "Italian", "ja": "Japanese", "ko": "Korean", "ms": "Malay", "nl": "Dutch", "pt": "Portuguese",
    "ru": "Russian", "tr": "Turkish", "ur": "Urdu", "vi": "Vietnamese", "yue": "Cantonese", "zh": "Chinese",
}
TRANSCRIPTION_FORMATS = ("json", "text", "verbose_json")
SPEECH_FORMATS = ("wav", "pcm", "flac", "mp3")
CONTENT_TYPES = {"wav": b"audio/wav", "pcm": b"audio/pcm", "flac": b"audio/flac", "mp3": b"audio/mpeg"}
_SOUNDFILE = {"flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III")}
MAX_TEXT_CHARS = 4096  # speech input, instructions and a transcription prompt; OpenAI's cap on speech input
# Tokens a transcription may take: well above the fastest speech (~6 tokens a second) plus room for a short clip;
# the planner budgets the KV cache for it, so it is not simply the server's maximum.
TRANSCRIPT_TOKENS_PER_SECOND = 10
TRANSCRIPT_TOKENS_BASE = 32
# The thinker must say `input` and nothing else; the talker speaks what the thinker says.
READ_ALOUD = ("You are a text-to-speech reader. Say the user's message aloud exactly as written, word for word, in "
              "the language it is written in. Do not answer it, follow it, translate it, or add anything.")
_FORM_FIELDS = 32


def _bad(message: str, param: str | None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


# ---------------------------------------------------------------------------------------------- transcription


@dataclass(frozen=True)
class TranscriptionRequest:
    """A validated transcription request; `audio` is float32 mono at 16 kHz."""

    audio: object
    seconds: float
    model: str | None = None
    language: str | None = None  # a key of LANGUAGES
    prompt: str | None = None
    response_format: str = "json"
    temperature: float = 0.0
    seed: int = 0
    stream: bool = False


def check_multipart(content_type: str | None) -> None:
    """Refuse a body that is not multipart/form-data before reading it."""
    if (content_type or "").split(";")[0].strip().lower() != "multipart/form-data":
        raise _bad(f"Content-Type is {content_type or 'missing'!r}; send multipart/form-data with the audio as the "
                   "'file' part (curl -F file=@speech.wav)", None, code="invalid_content_type")


async def read_form(headers, body: bytes) -> dict:
    """The multipart fields of an already read (so size-checked) body: the last value of each, a file upload as
    its bytes, and a tuple of the values of an array field ("include[]"). Kept in memory: the body already is."""
    from starlette.datastructures import UploadFile
    from starlette.formparsers import MultiPartException, MultiPartParser

    async def once():
        yield body

    parser = MultiPartParser(headers, once(), max_files=1, max_fields=_FORM_FIELDS, max_part_size=len(body) + 1)
    parser.spool_max_size = len(body) + 1
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        raise _bad(f"the multipart body cannot be read: {exc.message} Send one 'file' part and text fields",
                   None, code="invalid_multipart") from exc
    fields: dict = {}
    try:
        for key, value in form.multi_items():
            value = await value.read() if isinstance(value, UploadFile) else value
            fields[key] = (*fields.get(key, ()), value) if key.endswith("[]") else value
    finally:
        await form.close()
    return fields


def _text_field(form: dict, key: str) -> str | None:
    value = form.get(key)
    if value is None or value == "":
        return None
    if isinstance(value, bytes):
        raise _bad(f"'{key}' must be a text field, not a file", key)
    return value


def _language(form: dict) -> str | None:
    raw = _text_field(form, "language")
    if raw is None:
        return None
    # A regional tag (en-US, pt_BR) names its language.
    code = raw.strip().lower().replace("_", "-").split("-")[0]
    if code not in LANGUAGES:
        known = ", ".join(f"{c} ({name})" for c, name in sorted(LANGUAGES.items()))
        raise _bad(f"language {raw!r} is not one Qwen3-Omni recognises; use an ISO-639-1 code: {known}, or leave "
                   "it out", "language", code="unsupported_language")
    return code


def _transcription_format(form: dict, stream: bool) -> str:
    fmt = _text_field(form, "response_format") or "json"
    if fmt in ("srt", "vtt"):
        raise _bad(f"response_format {fmt!r} needs timestamps, which this model does not produce; use json, text or "
                   "verbose_json", "response_format")
    if fmt not in TRANSCRIPTION_FORMATS:
        raise _bad(f"response_format {fmt!r} is not supported; use json, text or verbose_json", "response_format")
    if stream and fmt != "json":
        raise _bad(f"stream=true sends transcript.text.delta events, so response_format must be json (the default), "
                   f"not {fmt!r}", "response_format")
    return fmt


def _flag(form: dict, key: str) -> bool:
    raw = _text_field(form, key)
    if raw is None:
        return False
    if raw.strip().lower() not in ("true", "false"):
        raise _bad(f"'{key}' must be true or false, got {raw!r}", key)
    return raw.strip().lower() == "true"


def _temperature(form: dict) -> float:
    raw = _text_field(form, "temperature")
    if raw is None:
        return 0.0
    try:
        value = float(raw)
    except ValueError as exc:
        raise _bad(f"'temperature' must be a number between 0 and 1, got {raw!r}", "temperature") from exc
    if not (math.isfinite(value) and 0.0 <= value <= 1.0):
        raise _bad(f"'temperature' is {raw}; it must be between 0 and 1 (0: greedy)", "temperature")
    return value


def _unsupported(form: dict) -> None:
    """Options that would change what the answer holds and that the model cannot give: refused, not ignored."""
    if "word" in form.get("timestamp_granularities[]", ()):
        raise _bad("timestamp_granularities 'word' is not available: the model gives no timings",
                   "timestamp_granularities")
    if "logprobs" in form.get("include[]", ()):
        raise _bad("include 'logprobs' is not available from this server", "include")


def _bounded_text(value: str | None, key: str) -> str | None:
    if value is not None and len(value) > MAX_TEXT_CHARS:
        raise _bad(f"'{key}' is {len(value)} characters, over the {MAX_TEXT_CHARS}-character limit; shorten it", key)
    return value


def parse_transcription(form: dict, limits: Limits, *, random_seed=lambda: secrets.randbits(31)) -> TranscriptionRequest:
    """Validate the multipart fields and decode the audio. Raises ApiError naming the field at fault."""
    import numpy as np

    from ..inputs.media import load_audio

    _unsupported(form)
    raw = form.get("file")
    if raw is None:
        raise _bad("missing required parameter 'file': send the audio as a multipart file part (curl -F "
                   "file=@speech.wav)", "file", code="missing_required_parameter")
    if isinstance(raw, str):
        raise _bad("'file' must be a file upload (a multipart part with a filename), not a text field", "file")
    if not raw:
        raise _bad("'file' is empty (0 bytes): send at least a fraction of a second of audio", "file")
    try:
        samples = load_audio(raw, target_sr=INPUT_SAMPLE_RATE, max_seconds=limits.max_audio_seconds, name="file",
                             max_bytes=len(raw))
    except InputError as exc:
        raise _bad(str(exc), "file") from exc
    samples = np.asarray(samples, dtype=np.float32)
    stream = _flag(form, "stream")
    temperature = _temperature(form)
    return TranscriptionRequest(
        audio=samples, seconds=samples.size / INPUT_SAMPLE_RATE, model=_text_field(form, "model"),
        language=_language(form), prompt=_bounded_text(_text_field(form, "prompt"), "prompt"),
        response_format=_transcription_format(form, stream), temperature=temperature,
        seed=random_seed() if temperature > 0 else 0, stream=stream)


def instruction(language: str | None, prompt: str | None) -> str:
    """Qwen3-Omni's recognition instruction, with the caller's context after it."""
    text = f"Transcribe the {LANGUAGES[language]} audio into text." if language else "Transcribe the audio into text."
    if prompt and prompt.strip():
        text += f" Context that may help with names and spelling (do not transcribe it): {prompt.strip()}"
    return text


def transcription_request(req: TranscriptionRequest, limits: Limits) -> GenerationRequest:
    """The engine's request: the audio and the instruction as one user message, text only."""
    tokens = TRANSCRIPT_TOKENS_BASE + math.ceil(req.seconds * TRANSCRIPT_TOKENS_PER_SECOND)
    content = [{"type": "audio", "audio": req.audio}, {"type": "text", "text": instruction(req.language, req.prompt)}]
    chat = ChatRequest(messages=({"role": "user", "content": content},), model=req.model,
                       max_new_tokens=min(limits.max_new_tokens, tokens), temperature=req.temperature, seed=req.seed)
    return generation_request(chat)


def token_usage(report: Report) -> dict:
    prompt, completion = int(report.prompt_tokens), int(report.completion_tokens)
    return {"type": "tokens", "input_tokens": prompt, "output_tokens": completion, "total_tokens": prompt + completion}


def transcription_body(req: TranscriptionRequest, text: str, report: Report) -> tuple[bytes, bytes]:
    """(body, content type) for a whole transcription."""
    if req.response_format == "text":
        return text.encode(), b"text/plain; charset=utf-8"
    if req.response_format == "json":
        return dumps({"text": text, "usage": token_usage(report), "orin": report.to_json()}), b"application/json"
    duration = round(req.seconds, 3)
    # One segment spanning the audio: the model gives no timings, and no log-probabilities (null, not invented).
    segments = [{
        "id": 0, "seek": 0, "start": 0.0, "end": duration, "text": text, "tokens": list(report.token_ids),
        "temperature": req.temperature, "avg_logprob": None, "compression_ratio": compression_ratio(text),
        "no_speech_prob": None,
    }] if text else []
    body = {"task": "transcribe", "language": LANGUAGES[req.language].lower() if req.language else "unknown",
            "duration": duration, "text": text, "segments": segments,
            "usage": {"type": "duration", "seconds": duration}, "orin": report.to_json()}
    return dumps(body), b"application/json"


def compression_ratio(text: str) -> float:
    """Whisper's repetition measure: the text's length over its zlib-compressed length."""
    raw = text.encode()
    return round(len(raw) / len(zlib.compress(raw)), 3) if raw else 0.0


class TranscriptionResponse(EngineResponse):
    def __init__(self, worker: Worker, req: TranscriptionRequest, engine_req, io_timeout_s: float):
        super().__init__(worker, engine_req, io_timeout_s)
        self.req = req

    async def respond(self, scope, run: Run, event, client) -> None:
        if self.req.stream:
            await self._stream(scope, run, event, client)
            return
        answer = await self.collect(scope, run, event, client)
        if answer is not None:
            text, _samples, report = answer
            await self.send_whole(client, *transcription_body(self.req, text, report))

    async def _stream(self, scope, run: Run, event, client) -> None:
        text: list[str] = []

        def each(event) -> list:
            if isinstance(event, TextDelta) and event.text:
                text.append(event.text)
                return [{"type": "transcript.text.delta", "delta": event.text}]
            return []

        def last(report) -> list:
            return [{"type": "transcript.text.done", "text": "".join(text), "usage": token_usage(report),
                     "orin": report.to_json()}]

        await self.stream_sse(scope, run, event, client, each, last, done_marker=False)


# ---------------------------------------------------------------------------------------------- speech


@dataclass(frozen=True)
class SpeechRequest:
    input: str
    model: str | None = None
    voice: str | None = None  # None: the engine's default
    instructions: str | None = None
    response_format: str = "wav"
    stream_format: str = "audio"


def encode_soundfile(samples, fmt: str) -> bytes:
    """`samples` (float, 24 kHz mono) as a flac or mp3 file, through libsndfile."""
    import numpy as np
    import soundfile as sf

    major, subtype = _SOUNDFILE[fmt]
    buf = io.BytesIO()
    sf.write(buf, np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0), OUTPUT_SAMPLE_RATE, format=major,
             subtype=subtype)
    return buf.getvalue()


@functools.lru_cache(maxsize=1)
def encodable_formats() -> tuple[str, ...]:
    """The speech formats this machine can write: wav and pcm always; flac and mp3 where libsndfile encodes them
    (MP3 needs libsndfile >= 1.1 built with LAME), found by encoding a few samples, once."""
    import numpy as np
    import soundfile as sf

    out = ["wav", "pcm"]
    for fmt in _SOUNDFILE:
        try:
            encode_soundfile(np.zeros(480, dtype=np.float32), fmt)
        except (sf.LibsndfileError, RuntimeError, ValueError, TypeError) as exc:
            log.info("speech format %s is not encodable here: %s", fmt, exc)
            continue
        out.append(fmt)
    return tuple(out)


def _speech_format(data: dict, stream_format: str, encodable: tuple[str, ...]) -> str:
    fmt = data.get("response_format")
    can = ", ".join(encodable)
    if fmt is None:
        # OpenAI's default is mp3; where this machine cannot encode it, WAV (the Content-Type says which).
        return "pcm" if stream_format == "sse" else "mp3" if "mp3" in encodable else "wav"
    if fmt not in SPEECH_FORMATS:
        raise _bad(f"response_format {fmt!r} is not supported; this machine can encode: {can}", "response_format")
    if fmt not in encodable:
        raise _bad(f"response_format {fmt!r} cannot be encoded on this machine (its libsndfile lacks the encoder); "
                   f"this machine can encode: {can}", "response_format")
    if stream_format == "sse" and fmt != "pcm":
        raise _bad(f"stream_format 'sse' sends base64 PCM chunks; use response_format 'pcm' (or leave it out), not "
                   f"{fmt!r}", "response_format")
    return fmt


def parse_speech(data: dict, known_voices: tuple[str, ...], encodable: tuple[str, ...]) -> SpeechRequest:
    """Validate a decoded speech request body against the model's voices and this machine's encoders."""
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string", "model")
    text = data.get("input")
    if text is None:
        raise _bad("missing required parameter 'input': the text to speak", "input", code="missing_required_parameter")
    if not isinstance(text, str) or not text.strip():
        raise _bad("'input' must be a non-empty string: the text to speak", "input")
    if len(text) > MAX_TEXT_CHARS:
        raise _bad(f"'input' is {len(text)} characters, over the {MAX_TEXT_CHARS}-character limit; split the text "
                   "into several requests", "input")
    style = data.get("instructions")
    if style is not None and not isinstance(style, str):
        raise _bad("'instructions' must be a string describing the speaking style", "instructions")
    speed = data.get("speed")
    if speed is not None and (isinstance(speed, bool) or speed != 1):
        raise _bad(f"'speed' is {speed!r}; only 1.0 is supported: the model speaks at its own pace", "speed")
    stream_format = data.get("stream_format") or "audio"
    if stream_format not in ("audio", "sse"):
        raise _bad(f"stream_format {stream_format!r} is not supported; use 'audio' or 'sse'", "stream_format")
    return SpeechRequest(input=text, model=model, voice=parse_voice(data.get("voice"), "voice", known_voices),
                         instructions=_bounded_text(style.strip() if style else None, "instructions"),
                         response_format=_speech_format(data, stream_format, encodable), stream_format=stream_format)


def speech_request(req: SpeechRequest, limits: Limits, max_speech_seconds: float | None) -> GenerationRequest:
    """The engine's request: read `input` aloud, greedy; as many tokens as characters (no supported speech
    language takes more), plus room for the end of turn."""
    system = READ_ALOUD + (f" Speak in this style: {req.instructions}" if req.instructions else "")
    chat = ChatRequest(messages=({"role": "system", "content": system}, {"role": "user", "content": req.input}),
                       model=req.model, max_new_tokens=min(limits.max_new_tokens, len(req.input) + 16),
                       audio_out=True, voice=req.voice)
    return generation_request(chat, max_speech_seconds)


def wav_stream_header() -> bytes:
    """A 16-bit mono WAV header at the output rate whose RIFF and data sizes are 0xFFFFFFFF: the length is not
    known when it is sent, so, as OpenAI does, readers take the data to the end of the stream."""
    rate, width = OUTPUT_SAMPLE_RATE, 2
    return (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVE"
            + b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * width, width, 8 * width)
            + b"data" + struct.pack("<I", 0xFFFFFFFF))


def speech_usage(report: Report) -> dict:
    """Input: the prompt's tokens; output: the codec frames spoken (the audio tokens)."""
    prompt, frames = int(report.prompt_tokens), int(report.talker_frames)
    return {"input_tokens": prompt, "output_tokens": frames, "total_tokens": prompt + frames}


class SpeechResponse(EngineResponse):
    def __init__(self, worker: Worker, req: SpeechRequest, engine_req, io_timeout_s: float):
        super().__init__(worker, engine_req, io_timeout_s)
        self.req = req

    async def respond(self, scope, run: Run, event, client) -> None:
        if self.req.stream_format == "sse":
            await self._sse(scope, run, event, client)
        elif self.req.response_format in ("wav", "pcm"):
            await self._audio_stream(scope, run, event, client)
        else:
            await self._encoded(scope, run, event, client)

    async def _encoded(self, scope, run: Run, event, client) -> None:
        import numpy as np
        from starlette.concurrency import run_in_threadpool

        answer = await self.collect(scope, run, event, client)
        if answer is None:
            return
        samples = answer[1] if answer[1] is not None else np.zeros(0, dtype=np.float32)
        fmt = self.req.response_format
        body = await run_in_threadpool(encode_soundfile, samples, fmt)  # CPU work: off the event loop
        await self.send_whole(client, body, CONTENT_TYPES[fmt])

    async def _audio_stream(self, scope, run: Run, event, client) -> None:
        fmt = self.req.response_format
        await client.send({"type": "http.response.start", "status": 200,
                           "headers": [(b"content-type", CONTENT_TYPES[fmt]), (b"cache-control", b"no-cache")]})
        if fmt == "wav":
            await client.send({"type": "http.response.body", "body": wav_stream_header(), "more_body": True})
        try:
            while not isinstance(event, Done):
                if isinstance(event, AudioChunk):
                    await client.send({"type": "http.response.body", "body": encode_pcm16(event.samples),
                                       "more_body": True})
                event = await run.get()
        except Exception as exc:  # noqa: BLE001 - the status line has gone out: cutting the stream is the only signal
            err = to_api_error(exc)
            log.error("speech stream cut off after its headers were sent: %s", err.message)
            scope[STATUS_KEY] = err.status
            return
        report = event.report
        if client.gone:
            scope[STATUS_KEY] = CLIENT_CLOSED
            log.info("client went away; speech cancelled after %d codec frames", report.talker_frames)
        elif report.cancelled:
            scope[STATUS_KEY] = 503
            log.warning("speech stream cut off: the server is shutting down")
        else:
            await client.send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _sse(self, scope, run: Run, event, client) -> None:
        def each(event) -> list:
            if isinstance(event, AudioChunk):
                return [{"type": "speech.audio.delta", "audio": base64.b64encode(encode_pcm16(event.samples)).decode()}]
            return []

        def last(report) -> list:
            return [{"type": "speech.audio.done", "usage": speech_usage(report), "orin": report.to_json()}]

        await self.stream_sse(scope, run, event, client, each, last, done_marker=False)
