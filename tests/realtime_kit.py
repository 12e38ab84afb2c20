"""Helpers for the Realtime API tests: a session through the official `openai` client (with a guard that closes a
session stuck past GUARD_S, so a broken server fails a test instead of hanging it), streaming speech as the
Realtime API's base64 audio/pcm appends, reading events until the one awaited, and a worker hook that holds a
generation until the server cancels it."""

from __future__ import annotations

import base64
import inspect
import json
import threading
from contextlib import contextmanager

import numpy as np
import openai
import server_kit as kit
import websockets.sync.client
from speech_kit import pcm16

from orin.contract import Done, TextDelta
from orin.serve.metrics import parse_metrics

GUARD_S = 120
CHUNK_MS = (20, 40, 100, 60, 80)  # the sizes appends cycle through, as a microphone client's buffers vary


# The openai client opens its socket with websockets' connect() outside a `with` and closes it itself; websockets
# >= 17.1 warns about that (a DeprecationWarning per connection) unless told legacy=True, which 16 does not take.
WS_OPTIONS = {"legacy": True} if "legacy" in inspect.signature(websockets.sync.client.connect).parameters else {}


def client(srv, key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", websocket_base_url=srv.url.replace("http", "ws", 1) + "/v1",
                         api_key=key, max_retries=0)


def connect(srv, key: str = "x", model: str | None = None):
    """The official client's `realtime.connect` to `srv` (a context manager; nothing read yet)."""
    return client(srv, key).realtime.connect(model=model or srv.model_name, websocket_connection_options=WS_OPTIONS)


@contextmanager
def session(srv, key: str = "x", model: str | None = None):
    """An open Realtime connection, its session.created read (returned as `conn.created`)."""
    with connect(srv, key, model) as conn:
        timer = threading.Timer(GUARD_S, conn.close)
        timer.daemon = True
        timer.start()
        try:
            conn.created = conn.recv()
            yield conn
        finally:
            timer.cancel()


def until(conn, kind: str, seen: list | None = None, errors_ok: bool = False):
    """Read events until one of type `kind` (returned); the ones before it are appended to `seen`. An `error`
    event fails the test unless it is awaited or `errors_ok`."""
    while True:
        event = conn.recv()
        if event.type == kind:
            if seen is not None:
                seen.append(event)
            return event
        assert errors_ok or event.type != "error", f"unexpected error event: {event.error}"
        if seen is not None:
            seen.append(event)


def configure(conn, **session) -> object:
    """session.update with these fields (type "realtime" added); returns the session.updated's session."""
    conn.session.update(session={"type": "realtime", **session})
    return until(conn, "session.updated").session


def send_raw(conn, obj) -> None:
    conn.send_raw(obj if isinstance(obj, (str, bytes)) else json.dumps(obj))


def stream(conn, samples: np.ndarray, sr: int = 24_000) -> None:
    """`samples` as input_audio_buffer.append events of CHUNK_MS sizes in turn."""
    data, at, i = pcm16(samples), 0, 0
    while at < len(data):
        size = CHUNK_MS[i % len(CHUNK_MS)] * sr // 1000 * 2
        conn.input_audio_buffer.append(audio=base64.b64encode(data[at:at + size]).decode())
        at, i = at + size, i + 1


def text_item(conn, text: str, role: str = "user") -> object:
    """conversation.item.create of a text message; returns the item as conversation.item.done echoes it."""
    kind = "output_text" if role == "assistant" else "input_text"
    conn.conversation.item.create(item={"type": "message", "role": role, "content": [{"type": kind, "text": text}]})
    return until(conn, "conversation.item.done").item


def respond(conn, seen: list | None = None, **response) -> object:
    """response.create (with `response` overrides) and read until its response.done, which is returned."""
    conn.response.create(**({"response": response} if response else {}))
    return until(conn, "response.done", seen)


def metrics(srv, key: str | None = None) -> dict[str, float]:
    headers = {"Authorization": f"Bearer {key}"} if key else None
    status, _, text = kit.http_request(srv, "GET", "/metrics", headers=headers)
    assert status == 200
    return parse_metrics(text)


def types(events) -> list[str]:
    return [e.type for e in events]


class HoldProbe:
    """A worker hook: a generation admitted while `armed` is set is held at its first text event until the
    server cancels it; then what the engine still produces is counted, and its report kept."""

    def __init__(self):
        self.armed = threading.Event()
        self.reached = threading.Event()
        self.saw_cancel = threading.Event()
        self.done = threading.Event()
        self.after_cancel = 0
        self.report = None
        self._holding = False
        self._texts = 0

    def __call__(self, stage, event, cancel):
        if stage == "admitted":
            self._holding, self._texts = self.armed.is_set(), 0
            self.armed.clear()
            return
        if not self._holding:
            return
        if isinstance(event, Done):
            self.report = event.report
            self.done.set()
        elif isinstance(event, TextDelta):
            self._texts += 1
            if self.saw_cancel.is_set():
                self.after_cancel += 1
            if self._texts == 1:
                self.reached.set()
                if cancel.wait(60):
                    self.saw_cancel.set()
