"""A chat-completions request, parsed and validated apart from HTTP: its messages and their media parts (decoded
into orin.runtime.engine's format), its sampling and audio-out parameters, and the engine request it maps to. Pure
functions over dicts and bytes; refusals are orin.serve.protocol's ApiError, naming the field at fault.

Follows what the official `openai` client sends: content parts `text`, `image_url`, `input_audio` and `video_url`
(vLLM's part: `{"url", "fps", "audio"}`, with the request's `video_fps` and `use_audio_in_video` as defaults for
every video, which the client sends through `extra_body`; `audio` true, the default, sends the soundtrack too,
interleaved with the frames as Qwen3-Omni's audio in video); `modalities: ["text", "audio"]` with
`audio: {voice, format}` (the voice parsed by orin.serve.voice).
"""

from __future__ import annotations

import base64
import binascii
import math
import os
import secrets
import urllib.parse
from dataclasses import dataclass, replace

from ..audio_format import CODEC_FRAMES_PER_SECOND, INPUT_SAMPLE_RATE
from ..contract import GenerationRequest
from ..errors import InputError
from .protocol import ApiError, Limits, bad_request
from .voice import parse_voice

# Formats the media decoder reads; OpenAI itself takes wav and mp3.
INPUT_AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg")
# `pcm16` is what OpenAI streams (raw 16-bit little-endian mono at 24 kHz); `wav` is a complete file.
OUTPUT_AUDIO_FORMATS = ("wav", "pcm16")
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MEDIA_PARTS = ("image_url", "input_audio", "video_url")
MAX_VIDEO_FPS = 60.0


@dataclass(frozen=True)
class VideoDefaults:
    """The request's `video_fps` and `use_audio_in_video`: what a video_url part that sets neither gets. `fps`
    None leaves the rate to orin.inputs.video (Qwen3-Omni's own 2 fps)."""

    fps: float | None = None
    audio: bool = True


@dataclass(frozen=True)
class ChatRequest:
    """A validated chat-completions request; `messages` are in orin.runtime.engine's format (decoded media)."""

    messages: tuple
    model: str | None = None
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    audio_out: bool = False
    voice: str | None = None
    audio_format: str = "wav"
    stream: bool = False
    include_usage: bool = False


def b64decode(data: object, param: str) -> bytes:
    """Strict base64 (standard alphabet, padding checked); line breaks from MIME-style wrapping are tolerated."""
    if not isinstance(data, str):
        raise bad_request(f"{param} must be a base64 string", param)
    compact = "".join(data.split())
    try:
        return base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise bad_request(f"{param} is not valid base64: {exc}", param) from exc


def decode_data_url(url: str, param: str) -> bytes:
    """The payload of a data: URL (base64 or percent-encoded)."""
    header, sep, payload = url.partition(",")
    if not sep:
        raise bad_request(f"{param} is a data: URL without a ',' before its payload", param)
    if header.lower().endswith(";base64"):
        return b64decode(payload, param)
    return urllib.parse.unquote_to_bytes(payload)


def read_file_url(url: str, allow_dir: str | None, param: str, max_bytes: int, what: str = "image") -> bytes:
    """A file:// URL's bytes, only for a regular file under `allow_dir` (symlinks resolved first, so a link
    inside the directory cannot point out of it). `what` names the medium in the refusal's advice."""
    if allow_dir is None:
        raise bad_request(f"{param}: file:// URLs are refused by this server; send the {what} as a data: URL, or start "
                          "the server with --allow-dir DIR to allow files under DIR", param)
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise bad_request(f"{param}: file URL host {parsed.netloc!r} is not local; use file:///path", param)
    path = os.path.realpath(urllib.parse.unquote(parsed.path))
    root = os.path.realpath(allow_dir)
    if os.path.commonpath([path, root]) != root:
        raise bad_request(f"{param}: {path} is outside the allowed directory {root}", param)
    if not os.path.isfile(path):
        raise bad_request(f"{param}: {path} is not a file", param)
    size = os.path.getsize(path)
    if size > max_bytes:
        raise ApiError(413, f"{param}: {path} is {size} bytes, over the {max_bytes}-byte limit", param=param)
    with open(path, "rb") as fh:
        return fh.read()


def _url_bytes(url: object, limits: Limits, param: str, max_bytes: int, what: str, example: str) -> bytes:
    """The bytes an image_url or video_url part's `url` (at `param`) carries: a data: URL, or a file:// URL under
    --allow-dir; never the network. `example` is the data: URL prefix the advice shows."""
    if not isinstance(url, str) or not url:
        raise bad_request(f"{param}.url must be a non-empty string", param)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        raw = decode_data_url(url, f"{param}.url")
    elif scheme == "file":
        raw = read_file_url(url, limits.allow_dir, f"{param}.url", max_bytes, what)
    elif scheme in ("http", "https"):
        raise bad_request(f"{param}.url: this server never fetches from the network; send the {what} as a data: URL "
                          f"({example})", param)
    else:
        raise bad_request(f"{param}.url must be a data: URL (or file:// under --allow-dir), got scheme "
                          f"{scheme or 'none'!r}", param)
    if not raw:
        raise bad_request(f"{param}.url holds no {what} bytes", param)
    return raw


def _decoder_refusal(exc: InputError, where: str) -> ApiError:
    """A media decoder's refusal as a 400 naming the part at `where`, in its message and in `param` (decoders
    name their input in most refusals, not in all: a video frame without area)."""
    message = str(exc)
    return bad_request(message if where in message else f"{where}: {message}", where)


def _image(part: dict, limits: Limits, param: str, max_bytes: int):
    from ..inputs.media import load_image

    where = f"{param}.image_url"
    spec = part.get("image_url")
    url = spec.get("url") if isinstance(spec, dict) else spec
    raw = _url_bytes(url, limits, where, max_bytes, "image", "data:image/png;base64,...")
    try:
        return load_image(raw, max_pixels=limits.max_image_pixels, name=where)
    except InputError as exc:
        raise _decoder_refusal(exc, where) from exc


def _fps(value: object, param: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"{param} must be a number of frames per second, such as 2; got {value!r}", param)
    if not 0 < value <= MAX_VIDEO_FPS:
        raise bad_request(f"{param} is {value:g}; send a rate above 0 and at most {MAX_VIDEO_FPS:g} frames per second, "
                          "such as 2", param)
    return float(value)


def _flag(value: object, param: str) -> bool:
    if not isinstance(value, bool):
        raise bad_request(f"{param} must be true or false (a JSON boolean); got {value!r}", param)
    return value


def video_defaults(data: dict) -> VideoDefaults:
    """The request-level `video_fps` and `use_audio_in_video`, validated."""
    fps, audio = data.get("video_fps"), data.get("use_audio_in_video")
    return VideoDefaults(fps=None if fps is None else _fps(fps, "video_fps"),
                         audio=True if audio is None else _flag(audio, "use_audio_in_video"))


def _video(part: dict, limits: Limits, param: str, max_bytes: int, defaults: VideoDefaults):
    from ..inputs.video import VideoOptions, load_video

    where = f"{param}.video_url"
    spec = part.get("video_url")
    spec = spec if isinstance(spec, dict) else {"url": spec}
    fps = defaults.fps if spec.get("fps") is None else _fps(spec["fps"], f"{where}.fps")
    audio = defaults.audio if spec.get("audio") is None else _flag(spec["audio"], f"{where}.audio")
    raw = _url_bytes(spec.get("url"), limits, where, max_bytes, "video", "data:video/mp4;base64,...")
    opts = VideoOptions(audio=audio, max_seconds=limits.max_video_seconds, max_bytes=max_bytes)
    opts = opts if fps is None else replace(opts, fps=fps)
    try:
        return load_video(raw, opts, name=where)
    except InputError as exc:
        raise _decoder_refusal(exc, where) from exc


def _audio(part: dict, limits: Limits, param: str):
    import numpy as np

    from ..inputs.media import load_audio

    spec = part.get("input_audio")
    if not isinstance(spec, dict):
        raise bad_request(f"{param}.input_audio must be an object with 'data' and 'format'", f"{param}.input_audio")
    fmt = spec.get("format")
    if fmt is not None and (not isinstance(fmt, str) or fmt.lower() not in INPUT_AUDIO_FORMATS):
        raise bad_request(f"{param}.input_audio.format {fmt!r} is not supported; use one of "
                          f"{', '.join(INPUT_AUDIO_FORMATS)}", f"{param}.input_audio.format")
    raw = b64decode(spec.get("data"), f"{param}.input_audio.data")
    if not raw:
        raise bad_request(f"{param}.input_audio.data is empty: send at least a fraction of a second of audio",
                          f"{param}.input_audio.data")
    where = f"{param}.input_audio.data"
    try:
        samples = load_audio(raw, target_sr=INPUT_SAMPLE_RATE, max_seconds=limits.max_audio_seconds, name=where)
    except InputError as exc:
        raise _decoder_refusal(exc, where) from exc
    samples = np.asarray(samples, dtype=np.float32)
    if samples.size == 0:
        raise bad_request(f"{param}.input_audio holds zero samples: send at least a fraction of a second of audio",
                          f"{param}.input_audio.data")
    seconds = samples.shape[-1] / INPUT_SAMPLE_RATE
    if seconds > limits.max_audio_seconds:
        raise bad_request(f"{param}.input_audio is {seconds:.1f} s long, over the {limits.max_audio_seconds:g} s "
                          "limit; send a shorter clip", f"{param}.input_audio.data")
    return samples


def _media(kind: str, part: dict, limits: Limits, where: str, max_bytes: int, video: VideoDefaults) -> dict:
    """A user message's media part, decoded into orin.runtime.engine's part."""
    if kind == "image_url":
        return {"type": "image", "image": _image(part, limits, where, max_bytes)}
    if kind == "input_audio":
        return {"type": "audio", "audio": _audio(part, limits, where)}
    return {"type": "video", "video": _video(part, limits, where, max_bytes, video)}


def _content(role: str, content: object, limits: Limits, param: str, max_bytes: int, video: VideoDefaults):
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise bad_request(f"{param}.content must be a string or a non-empty list of content parts", f"{param}.content")
    parts = []
    for j, part in enumerate(content):
        where = f"{param}.content[{j}]"
        if not isinstance(part, dict):
            raise bad_request(f"{where} must be an object with a 'type'", where)
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise bad_request(f"{where}.text must be a string", f"{where}.text")
            parts.append({"type": "text", "text": text})
        elif kind in MEDIA_PARTS:
            if role != "user":
                raise bad_request(f"{where}: {kind} parts are only accepted in user messages", where)
            parts.append(_media(kind, part, limits, where, max_bytes, video))
        else:
            raise bad_request(f"{where}: content type {kind!r} is not supported; use text, image_url, input_audio or "
                              "video_url", f"{where}.type", code="unsupported_content_type")
    return parts


def parse_messages(messages: object, limits: Limits, max_bytes: int = 64 << 20,
                   video: VideoDefaults = VideoDefaults()) -> tuple:
    if messages is None:
        raise bad_request("missing required parameter 'messages'", "messages", code="missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    out = []
    for i, msg in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise bad_request(f"{param} must be an object with 'role' and 'content'", param)
        role = msg.get("role")
        if role not in ROLES:
            raise bad_request(f"{param}.role {role!r} is not supported; use system, developer, user or assistant",
                              f"{param}.role")
        content = msg.get("content")
        if content is None:
            if role == "assistant" and msg.get("audio"):
                raise bad_request(f"{param}: earlier audio replies are not stored by this server; send the assistant "
                                  "turn's transcript as its content", f"{param}.audio")
            raise bad_request(f"{param}.content is missing", f"{param}.content")
        out.append({"role": ROLES[role], "content": _content(role, content, limits, param, max_bytes, video)})
    return tuple(out)


def _number(data: dict, key: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    value = data.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"'{key}' must be a number", key)
    if value > hi or value < lo or (lo_open and value == lo):
        raise bad_request(f"'{key}' is {value}; it must be {'>' if lo_open else '>='} {lo:g} and <= {hi:g}", key)
    return float(value)


def _int(value: object, key: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{key}' must be an integer", key)
    if not lo <= value <= hi:
        raise bad_request(f"'{key}' is {value}; it must be between {lo} and {hi}", key)
    return value


def _unsupported(data: dict) -> None:
    """Parameters that would change the answer's meaning and that this server cannot honour: refused, not
    silently ignored. Other unknown keys are ignored, as clients send extras."""
    n = data.get("n")
    if n not in (None, 1):
        raise bad_request("'n' must be 1: one choice per request", "n")
    if data.get("tools") or data.get("functions"):
        raise bad_request("tools and function calling are not supported by this server", "tools")
    if data.get("stop") not in (None, [], ""):
        raise bad_request("'stop' sequences are not supported by this server", "stop")
    if data.get("logprobs"):
        raise bad_request("'logprobs' are not supported by this server", "logprobs")
    fmt = data.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise bad_request("only response_format {'type': 'text'} is supported", "response_format")


def _modalities(data: dict) -> bool:
    """True when audio output is asked for."""
    mods = data.get("modalities")
    if mods is None:
        return False
    if not isinstance(mods, list) or not mods or not all(isinstance(m, str) for m in mods):
        raise bad_request("'modalities' must be a list such as [\"text\"] or [\"text\", \"audio\"]", "modalities")
    unknown = sorted(set(mods) - {"text", "audio"})
    if unknown:
        raise bad_request(f"unknown modalities {unknown}; use [\"text\"] or [\"text\", \"audio\"]", "modalities")
    return "audio" in mods


def _audio_param(data: dict, stream: bool, voices: tuple[str, ...]) -> tuple[str | None, str]:
    spec = data.get("audio")
    if spec is None:
        return None, "pcm16" if stream else "wav"
    if not isinstance(spec, dict):
        raise bad_request("'audio' must be an object such as {\"voice\": \"ethan\", \"format\": \"wav\"}", "audio")
    voice = parse_voice(spec.get("voice"), "audio.voice", voices)
    fmt = spec.get("format", "pcm16" if stream else "wav")
    if fmt not in OUTPUT_AUDIO_FORMATS:
        raise bad_request(f"audio.format {fmt!r} is not supported; use one of {', '.join(OUTPUT_AUDIO_FORMATS)}",
                          "audio.format")
    return voice, fmt


def parse_chat(data: dict, limits: Limits, voices: tuple[str, ...], *, max_bytes: int = 64 << 20,
               random_seed=lambda: secrets.randbits(31)) -> ChatRequest:
    """Validate a decoded request body and decode its media; `voices` are the talker's (orin.runtime.engine.Engine.voices).
    Raises ApiError (protocol, and media the decoders refuse, naming the part) or orin InputError (a voice the
    model lacks); both are the client's fault."""
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", "model")
    _unsupported(data)
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be true or false", "stream")
    opts = data.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    audio_out = _modalities(data)
    voice, fmt = _audio_param(data, stream, voices) if audio_out else (None, "wav")
    limit_key = "max_completion_tokens" if data.get("max_completion_tokens") is not None else "max_tokens"
    raw_limit = data.get(limit_key)
    max_new = (limits.default_max_new_tokens if raw_limit is None
               else _int(raw_limit, limit_key, 1, limits.max_new_tokens))
    temperature = _number(data, "temperature", 0.0, 0.0, 2.0)
    top_p = _number(data, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    seed_value = data.get("seed")
    # Greedy decoding ignores the seed; with sampling and no seed, answers vary from call to call as on OpenAI.
    seed = random_seed() if seed_value is None else _int(seed_value, "seed", -(2**63), 2**63 - 1)
    messages = parse_messages(data.get("messages"), limits, max_bytes, video_defaults(data))
    return ChatRequest(
        messages=messages, model=model, max_new_tokens=max_new, temperature=temperature, top_p=top_p,
        seed=seed, audio_out=audio_out, voice=voice, audio_format=fmt, stream=stream,
        include_usage=bool(opts.get("include_usage")),
    )


def speech_frames(max_speech_seconds: float | None) -> int | None:
    """The codec frames the server's --max-speech-seconds allows one answer (None: no cap, the text decides)."""
    if max_speech_seconds is None:
        return None
    return max(1, math.ceil(max_speech_seconds * CODEC_FRAMES_PER_SECOND))


def generation_request(req: ChatRequest, max_speech_seconds: float | None = None) -> GenerationRequest:
    """The engine's request for a validated chat request; `max_speech_seconds` is the server's cap on speech."""
    extra: dict = {"voice": req.voice} if req.voice else {}
    if max_speech_seconds is not None:
        extra["max_audio_frames"] = speech_frames(max_speech_seconds)
    # A chat that carries the model's earlier answers continues a conversation: its prompt most likely starts with
    # the last request's, whose rows the engine then reads from its cache (GenerationRequest.continues).
    continues = any(m.get("role") == "assistant" for m in req.messages)
    return GenerationRequest(messages=req.messages, max_new_tokens=req.max_new_tokens, speech=req.audio_out,
                             temperature=req.temperature, top_p=req.top_p, seed=req.seed, continues=continues,
                             **extra)


