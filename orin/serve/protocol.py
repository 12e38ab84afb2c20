"""The OpenAI protocol's common ground, apart from HTTP: errors as OpenAI's JSON, what one request may carry
(Limits), API keys and the model check, and the JSON shapes of chat responses, stream chunks and server-sent
events. The requests themselves are parsed by orin.serve.chat_request and orin.serve.audio_api; orin.serve.routes
and orin.serve.streaming do the I/O.

Chat responses as the official `openai` client parses them: `message.audio` (`id`, `data`, `expires_at`,
`transcript`; the text is the transcript and `content` is null, as OpenAI does) when audio was asked for; in a
stream, text as `delta.content` (text only) or `delta.audio.transcript` (audio out) and audio as
`delta.audio.data`.
"""

from __future__ import annotations

import base64
import hmac
import json
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..contract import Report
    from .chat_request import ChatRequest

from ..audio_format import OUTPUT_SAMPLE_RATE
from ..errors import BudgetError, InputError, OrinError, OutOfMemoryError
from .voice import VoiceError

# Seconds an out-of-memory answer asks the client to wait: the board's other users may free memory by then.
OUT_OF_MEMORY_RETRY_S = 5


class ApiError(Exception):
    """A request the API refuses, with its HTTP status and OpenAI error fields; `extra`: more fields of the error
    object (OpenAI's clients keep them in the exception's `body`)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, headers: Mapping[str, str] | None = None,
                 extra: Mapping | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = dict(headers or {})
        self.extra = dict(extra or {})

    def body(self) -> dict:
        body = error_body(self.message, type=self.type, code=self.code, param=self.param)
        body["error"].update(self.extra)
        return body


def to_api_error(exc: BaseException) -> ApiError:
    """Client mistakes are 4xx with the engine's message; out of memory is a 503 (an answer: the server goes on);
    anything else is a 500 that says what broke."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, OutOfMemoryError):
        return out_of_memory_error(exc)
    if isinstance(exc, BudgetError):
        return ApiError(400, str(exc), code="budget_exceeded")
    if isinstance(exc, VoiceError):
        return ApiError(400, str(exc), param=exc.param, code="unsupported_voice")
    if isinstance(exc, InputError):
        return ApiError(400, str(exc))
    if isinstance(exc, OrinError):
        return ApiError(500, str(exc), type="server_error")
    return ApiError(500, f"internal error ({type(exc).__name__}: {exc}); see the server log", type="server_error")


def out_of_memory_error(exc: OutOfMemoryError) -> ApiError:
    """503: the request ran out of memory (or is as large as one that just did); the server goes on. The error
    object's `memory` holds the figures the message gives: the bytes asked and failed, and what was free."""
    memory = {"asked_bytes": exc.asked, "allocation_bytes": exc.allocation, "tried": exc.tried,
              **(exc.memory.to_json() if exc.memory is not None else {"free_bytes": None})}
    return ApiError(503, str(exc), type="server_error", code="out_of_memory",
                    headers={"Retry-After": str(OUT_OF_MEMORY_RETRY_S)}, extra={"memory": memory})


def error_body(message: str, *, type: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass(frozen=True)
class Limits:
    """What one request may carry. `allow_dir` None refuses file:// URLs altogether."""

    max_audio_seconds: float = 300.0
    max_image_pixels: int = 32 * 1024 * 1024
    max_new_tokens: int = 8192
    default_max_new_tokens: int = 256
    allow_dir: str | None = None
    max_video_seconds: float = 600.0


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 naming the field at fault."""
    return ApiError(400, message, param=param, code=code)


def parse_json(body: bytes) -> dict:
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    return data


def key_matches(token: str, keys: tuple[str, ...]) -> bool:
    """Whether `token` is one of the server's API keys. Every key is compared (constant time each), so timing does
    not tell which one nearly matched."""
    matches = [hmac.compare_digest(token.encode(), key.encode()) for key in keys]
    return any(matches)


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise ApiError(404, f"The model '{requested}' does not exist; this server serves '{served}' "
                       "(GET /v1/models lists it)", param="model", code="model_not_found")


# Responses ------------------------------------------------------------------------------------------------


def new_ids() -> tuple[str, str, int]:
    """(completion id, audio id, created timestamp)."""
    token = secrets.token_hex(12)
    return f"chatcmpl-{token}", f"audio_{token}", int(time.time())


def encode_audio(samples, fmt: str) -> bytes:
    """One audio payload in `fmt`; a streamed `wav` chunk is a complete small file of its own."""
    import numpy as np

    from ..inputs.media import encode_pcm16, encode_wav

    samples = np.zeros(0, dtype=np.float32) if samples is None else samples
    if fmt == "pcm16":
        return encode_pcm16(samples)
    return encode_wav(samples, sr=OUTPUT_SAMPLE_RATE)


def finish_reason(report: Report) -> str:
    """OpenAI's finish_reason: "length" when max_tokens cut the answer, else "stop". A cancelled request never
    gets here with a success: the server answers it with an error (or not at all, when the client left)."""
    return "length" if report.finish_reason == "length" else "stop"


def usage(report: Report) -> dict:
    """OpenAI's usage; its cached tokens: those of the prompt read from the engine's cache (a conversation's next
    turn)."""
    prompt, completion = int(report.prompt_tokens), int(report.completion_tokens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": int(report.cached_tokens)}}


def completion_body(req: ChatRequest, model: str, ids: tuple[str, str, int], text: str, audio,
                    report: Report) -> dict:
    cid, aid, created = ids
    message: dict = {"role": "assistant", "content": text, "refusal": None}
    if req.audio_out:
        # Audio replies are not stored, so an id cannot be referenced in a later turn: it expires at once.
        data = base64.b64encode(encode_audio(audio, req.audio_format)).decode()
        message["content"] = None
        message["audio"] = {"id": aid, "data": data, "expires_at": created, "transcript": text}
    return {
        "id": cid, "object": "chat.completion", "created": created, "model": model, "system_fingerprint": None,
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": finish_reason(report)}],
        "usage": usage(report),
        "orin": report.to_json(),
    }


def chunk(ids: tuple[str, str, int], model: str, delta: dict | None, *, finish: str | None = None,
          extra: Mapping | None = None) -> dict:
    """One stream chunk; `delta` None gives the choices-less usage chunk."""
    cid, _aid, created = ids
    body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": None,
            "choices": [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                                  "finish_reason": finish}]}
    if extra:
        body.update(extra)
    return body


def text_delta(req: ChatRequest, ids: tuple[str, str, int], text: str) -> dict:
    if req.audio_out:
        return {"audio": {"id": ids[1], "transcript": text}}
    return {"content": text}


def audio_delta(req: ChatRequest, ids: tuple[str, str, int], samples) -> dict:
    return {"audio": {"id": ids[1], "data": base64.b64encode(encode_audio(samples, req.audio_format)).decode()}}


def sse(obj: object) -> bytes:
    """One server-sent event; compact JSON never holds a newline, so one data: line suffices."""
    payload = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), default=_jsonable)
    return f"data: {payload}\n\n".encode()


def _jsonable(value):
    """Numpy scalars and arrays in reports."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (set, tuple)):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")


def dumps(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":"), default=_jsonable).encode()


def model_card(model: str, created: int) -> dict:
    return {"id": model, "object": "model", "created": created, "owned_by": "orin-omni"}
