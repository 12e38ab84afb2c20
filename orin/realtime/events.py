"""The Realtime API's events, GA names and shapes (as the official `openai` package's types/realtime define them):
client events validated into typed values, server events built as plain dicts, and the `error` event that
answers a bad client event. No I/O: orin.serve.realtime reads and writes the frames.

A client event is checked for its own shape here (JSON object, known type, required fields and their types, no
unknown keys, strict base64); what needs the session's state (a session.update's values, an item's media in the
session's audio format) is checked by orin.realtime.session and orin.realtime.conversation, which raise the same
EventError.
"""

from __future__ import annotations

import base64
import binascii
import json
import secrets
from dataclasses import dataclass

from ..errors import OrinError


class EventError(OrinError):
    """A client event the server refuses: answered by an `error` event (carrying the client's `event_id`), and the
    session goes on. `param` is the offending field's dotted path."""

    def __init__(self, message: str, *, code: str = "invalid_value", param: str | None = None,
                 event_id: str | None = None, type: str = "invalid_request_error"):
        super().__init__(message)
        self.code = code
        self.param = param
        self.event_id = event_id
        self.type = type

    def for_event(self, event_id: str | None) -> EventError:
        """This error, answering the client event `event_id` (kept if it already names one)."""
        if self.event_id is None:
            self.event_id = event_id
        return self


def new_id(prefix: str) -> str:
    """An id in OpenAI's style: `event_...`, `item_...`, `resp_...`, `sess_...`."""
    return f"{prefix}_{secrets.token_hex(10)}"


# --------------------------------------------------------------------------- client events


@dataclass(frozen=True)
class SessionUpdate:
    event_id: str | None
    session: dict


@dataclass(frozen=True)
class AudioAppend:
    event_id: str | None
    audio: bytes  # in the session's input format, not yet decoded


@dataclass(frozen=True)
class AudioCommit:
    event_id: str | None


@dataclass(frozen=True)
class AudioClear:
    event_id: str | None


@dataclass(frozen=True)
class OutputAudioClear:
    event_id: str | None


@dataclass(frozen=True)
class ItemCreate:
    event_id: str | None
    item: dict
    previous_item_id: str | None


@dataclass(frozen=True)
class ItemTruncate:
    event_id: str | None
    item_id: str
    content_index: int
    audio_end_ms: int


@dataclass(frozen=True)
class ItemDelete:
    event_id: str | None
    item_id: str


@dataclass(frozen=True)
class ItemRetrieve:
    event_id: str | None
    item_id: str


@dataclass(frozen=True)
class ResponseCreate:
    event_id: str | None
    response: dict  # the per-response overrides ({} when none)


@dataclass(frozen=True)
class ResponseCancel:
    event_id: str | None
    response_id: str | None


ClientEvent = (SessionUpdate | AudioAppend | AudioCommit | AudioClear | OutputAudioClear | ItemCreate | ItemTruncate
               | ItemDelete | ItemRetrieve | ResponseCreate | ResponseCancel)


def _check_keys(data: dict, allowed: tuple[str, ...], event_id: str | None) -> None:
    unknown = sorted(set(data) - {"type", "event_id", *allowed})
    if unknown:
        raise EventError(f"unknown parameter '{unknown[0]}' in a {data['type']} event; it takes "
                         f"{', '.join(('type', 'event_id') + allowed)}", code="unknown_parameter",
                         param=unknown[0], event_id=event_id)


def _string(data: dict, key: str, event_id: str | None, *, required: bool = True) -> str | None:
    value = data.get(key)
    if value is None:
        if required:
            raise EventError(f"missing required parameter '{key}' in a {data['type']} event",
                             code="missing_required_parameter", param=key, event_id=event_id)
        return None
    if not isinstance(value, str) or not value:
        raise EventError(f"'{key}' must be a non-empty string, got {value!r}", code="invalid_type", param=key,
                         event_id=event_id)
    return value


def _count(data: dict, key: str, event_id: str | None) -> int:
    value = data.get(key)
    if value is None:
        raise EventError(f"missing required parameter '{key}' in a {data['type']} event",
                         code="missing_required_parameter", param=key, event_id=event_id)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise EventError(f"'{key}' must be a whole number >= 0, got {value!r}", code="invalid_type", param=key,
                         event_id=event_id)
    return value


def b64decode(value: object, param: str, event_id: str | None = None) -> bytes:
    """Strict base64 (standard alphabet, padding checked)."""
    if not isinstance(value, str):
        raise EventError(f"'{param}' must be a base64 string", code="invalid_type", param=param, event_id=event_id)
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise EventError(f"'{param}' is not valid base64 ({exc}); send the bytes base64-encoded (standard "
                         "alphabet, with padding)", code="invalid_base64", param=param, event_id=event_id) from exc


def _session_update(data: dict, event_id):
    _check_keys(data, ("session",), event_id)
    session = data.get("session")
    if not isinstance(session, dict):
        raise EventError("'session' must be an object such as {\"type\": \"realtime\", \"instructions\": \"...\"}",
                         code="invalid_type" if "session" in data else "missing_required_parameter",
                         param="session", event_id=event_id)
    return SessionUpdate(event_id, session)


def _append(data: dict, event_id):
    _check_keys(data, ("audio",), event_id)
    if "audio" not in data:
        raise EventError("missing required parameter 'audio' (base64 audio in the session's input format)",
                         code="missing_required_parameter", param="audio", event_id=event_id)
    return AudioAppend(event_id, b64decode(data["audio"], "audio", event_id))


def _no_fields(cls):
    def parse(data: dict, event_id):
        _check_keys(data, (), event_id)
        return cls(event_id)

    return parse


def _item_create(data: dict, event_id):
    _check_keys(data, ("item", "previous_item_id"), event_id)
    item = data.get("item")
    if not isinstance(item, dict):
        raise EventError("'item' must be an object such as {\"type\": \"message\", \"role\": \"user\", \"content\": "
                         "[{\"type\": \"input_text\", \"text\": \"Hello\"}]}",
                         code="invalid_type" if "item" in data else "missing_required_parameter", param="item",
                         event_id=event_id)
    return ItemCreate(event_id, item, _string(data, "previous_item_id", event_id, required=False))


def _truncate(data: dict, event_id):
    _check_keys(data, ("item_id", "content_index", "audio_end_ms"), event_id)
    return ItemTruncate(event_id, _string(data, "item_id", event_id), _count(data, "content_index", event_id),
                        _count(data, "audio_end_ms", event_id))


def _item_ref(cls):
    def parse(data: dict, event_id):
        _check_keys(data, ("item_id",), event_id)
        return cls(event_id, _string(data, "item_id", event_id))

    return parse


def _response_create(data: dict, event_id):
    _check_keys(data, ("response",), event_id)
    response = data.get("response")
    if response is not None and not isinstance(response, dict):
        raise EventError("'response' must be an object of per-response settings (or left out)", code="invalid_type",
                         param="response", event_id=event_id)
    return ResponseCreate(event_id, response or {})


def _response_cancel(data: dict, event_id):
    _check_keys(data, ("response_id",), event_id)
    return ResponseCancel(event_id, _string(data, "response_id", event_id, required=False))


_PARSERS = {
    "session.update": _session_update,
    "input_audio_buffer.append": _append,
    "input_audio_buffer.commit": _no_fields(AudioCommit),
    "input_audio_buffer.clear": _no_fields(AudioClear),
    "output_audio_buffer.clear": _no_fields(OutputAudioClear),
    "conversation.item.create": _item_create,
    "conversation.item.truncate": _truncate,
    "conversation.item.delete": _item_ref(ItemDelete),
    "conversation.item.retrieve": _item_ref(ItemRetrieve),
    "response.create": _response_create,
    "response.cancel": _response_cancel,
}
CLIENT_EVENT_TYPES = tuple(_PARSERS)


def parse_client_event(text: str | bytes) -> ClientEvent:
    """One client event from a text frame. Raises EventError, with the event's `event_id` once it is known."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise EventError(f"the message is not valid JSON ({exc}); send one JSON object per text frame",
                         code="invalid_json") from exc
    if not isinstance(data, dict):
        raise EventError("an event must be a JSON object with a 'type', such as {\"type\": \"response.create\"}",
                         code="invalid_json")
    event_id = data.get("event_id")
    if event_id is not None and not isinstance(event_id, str):
        raise EventError(f"'event_id' must be a string, got {event_id!r}", code="invalid_type", param="event_id")
    kind = data.get("type")
    if kind is None:
        raise EventError("missing required parameter 'type'", code="missing_required_parameter", param="type",
                         event_id=event_id)
    parse = _PARSERS.get(kind) if isinstance(kind, str) else None
    if parse is None:
        raise EventError(f"unknown event type {kind!r}; the Realtime API's client events are "
                         f"{', '.join(CLIENT_EVENT_TYPES)}", code="invalid_value", param="type", event_id=event_id)
    return parse(data, event_id)


# --------------------------------------------------------------------------- server events


def server_event(kind: str, **fields) -> dict:
    """A server event of type `kind` with a fresh `event_id`."""
    return {"event_id": new_id("event"), "type": kind, **fields}


def error_event(err: EventError) -> dict:
    """The `error` event answering a refused client event: its `event_id` is the server's; the client's is in
    `error.event_id`."""
    return server_event("error", error={"type": err.type, "code": err.code, "message": str(err), "param": err.param,
                                        "event_id": err.event_id})
