"""`GET /v1/realtime` (WebSocket): the OpenAI Realtime API's GA event set, so that the official client's
`client.realtime.connect(model=...)` talks to the served model. The protocol's pieces are orin.realtime's
(events, session settings, input buffer, conversation, responses, the server VAD); the client events' handlers
(feeding the VAD, driving generations through the server's worker, barge-in) are orin.serve.realtime_handlers';
this module does the I/O: auth, the model check, session slots, reading and writing frames, timers and clean-up.

A connection is refused with an `error` event and a close code that says why, the socket having been accepted so
that every client, a browser's included, can read the reason: 1008 for a missing or wrong API key, an unknown
model or an expired session (`--realtime-max-session-seconds`); 1013 when `--realtime-max-sessions` are open and
the busy policy is "error" (with "wait" the session waits for a slot); 1009 for a message over
`--realtime-max-message` (over twice that, the WebSocket layer closes with 1009 before the message is read). Any
other bad event gets an `error` carrying the client's `event_id`, and the session goes on.

Barge-in: the VAD's speech start while a response runs (turn_detection.interrupt_response) sets the response's
cancel event at once; nothing more of it is sent; the engine stops at its next step and its Done closes the
response with `response.done` status "cancelled" (reason "turn_detected"; response.cancel: "client_cancelled").
The time from the cancel to the engine's stop is `response.orin.interrupt_to_stop_s` and the metric
orin_realtime_interrupt_seconds. A client that vanishes has its response cancelled the same way; the session
ends once the engine has stopped (awaited, not blocking the loop), which frees its slot and the GPU.
"""

from __future__ import annotations

import asyncio
import logging
import time

import anyio
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from ..contract import GenerationRequest
from ..realtime import events as ev
from ..realtime.events import EventError, error_event, server_event
from ..realtime.session import Capabilities, SessionConfig
from ..realtime.tokens import TokenCounter
from .protocol import dumps, key_matches
from .realtime_handlers import SessionHandlers
from .streaming import CLIENT_CLOSED

log = logging.getLogger("orin.serve.app")  # one logger for the server's lines, whichever module writes them

PATH = "/v1/realtime"
CLOSE_POLICY, CLOSE_TOO_BIG, CLOSE_TRY_LATER = 1008, 1009, 1013
KEY_PROTOCOL = "openai-insecure-api-key."  # how a browser, which cannot set headers, sends its key
POLL_S = 1.0  # the reader wakes at least this often to notice a client that stopped reading


class Refused(Exception):
    """The connection cannot have a session: an error event, then the close code."""

    def __init__(self, code: str, message: str, close: int, status: int, type: str = "invalid_request_error"):
        super().__init__(message)
        self.error = EventError(message, code=code, type=type)
        self.close = close
        self.status = status  # the HTTP status the refusal stands for, in orin_requests_total


class _Gone(Exception):
    """The client left while waiting for a slot."""


class RealtimeHub:
    """The endpoint's shared state: the server, the count of open sessions, the model's capabilities."""

    def __init__(self, server):
        self.server = server
        self.open = 0
        self._counter: TokenCounter | None = None

    def capabilities(self) -> Capabilities:
        srv = self.server
        voices = srv.engine.voices
        default = GenerationRequest.__dataclass_fields__["voice"].default
        return Capabilities(model=srv.model_name, voices=voices,
                            default_voice=default if default in voices or not voices else voices[0],
                            max_output_tokens=srv.cfg.max_new_tokens)

    def counter(self) -> TokenCounter:
        if self._counter is None:
            self._counter = TokenCounter(self.server.engine)
        return self._counter

    def context_tokens(self) -> int:
        """The context a session's prompt and answer share: --realtime-context-tokens, else the thinker's
        max_position_embeddings."""
        srv = self.server
        return srv.cfg.realtime_context_tokens or srv.engine.context_tokens

    async def endpoint(self, websocket: WebSocket) -> None:
        await _Session(self, websocket).run()


def realtime_route(server) -> WebSocketRoute:
    return WebSocketRoute(PATH, RealtimeHub(server).endpoint)


class _Session(SessionHandlers):
    """A session on its WebSocket: admission, the slot, reading and writing frames, the timers."""

    def __init__(self, hub: RealtimeHub, ws: WebSocket):
        super().__init__(hub)
        self.ws = ws
        self.held = False  # holds a session slot
        self.pending: list[dict] = []  # messages read while waiting for a slot
        self._send_lock = asyncio.Lock()

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        srv, status = self.server, 101
        offered = self.ws.scope.get("subprotocols") or []
        await self.ws.accept(subprotocol="realtime" if "realtime" in offered else None)
        try:
            self._admit(offered)
            await self._take_slot()
            self.caps = self.hub.capabilities()
            self.cfg = SessionConfig.default(self.caps)
            await self._configure_vad()
            await self.emit(server_event("session.created", session=self.cfg.to_json(self.id, self.expires_at)))
            self.expect_first_turn()
            log.info("%s realtime session %s started", self._client(), self.id)
            await self._read()
        except _Gone:
            status = CLIENT_CLOSED
        except Refused as exc:
            status = exc.status
            log.info("%s realtime session refused: %s", self._client(), exc)
            await self.emit(error_event(exc.error))
            await self._close(exc.close, str(exc))
        finally:
            self.gone = True
            await self._stop_response()
            if self.held:
                self.hub.open -= 1
                srv.metrics.realtime_session(-1)
            srv.metrics.request(PATH, status)
            log.info("%s WS %s %d %.3fs", self._client(), PATH, status, time.monotonic() - self.started)

    def _client(self) -> str:
        return (self.ws.scope.get("client") or ("-",))[0]

    def _admit(self, offered: list[str]) -> None:
        srv = self.server
        if srv.api_keys:
            scheme, _, token = self.ws.headers.get("authorization", "").partition(" ")
            token = token.strip() if scheme.lower() == "bearer" else ""
            for proto in offered:
                if proto.startswith(KEY_PROTOCOL):
                    token = token or proto[len(KEY_PROTOCOL):]
            if not key_matches(token, srv.api_keys):
                raise Refused("invalid_api_key", "Incorrect or missing API key: send 'Authorization: Bearer <key>' "
                              "with the key from the server's --api-key-file", CLOSE_POLICY, 401)
        query = self.ws.query_params
        if query.get("call_id") or query.get("intent") == "transcription":
            raise Refused("unsupported", "this server serves Realtime sessions over the WebSocket only: no WebRTC "
                          "or SIP calls (call_id) and no transcription sessions (use POST /v1/audio/transcriptions)",
                          CLOSE_POLICY, 400)
        model = query.get("model")
        if model is not None and model != srv.model_name:
            raise Refused("model_not_found", f"The model '{model}' does not exist; this server serves "
                          f"'{srv.model_name}' (connect with ?model={srv.model_name})", CLOSE_POLICY, 404)
        if srv.state != "ready":
            raise Refused("not_ready", f"the server is {srv.state}; retry shortly", CLOSE_TRY_LATER, 503,
                          "server_error")

    async def _take_slot(self) -> None:
        cfg = self.cfg_srv
        if self.hub.open >= cfg.realtime_max_sessions:
            if cfg.realtime_busy == "error":
                raise Refused("session_limit_reached", f"{cfg.realtime_max_sessions} realtime sessions are open, "
                              "the server's limit (--realtime-max-sessions); retry when one ends", CLOSE_TRY_LATER,
                              429, "rate_limit_error")
            log.info("%s realtime session waits for a slot", self._client())
            receive = asyncio.ensure_future(self.ws.receive())
            try:
                while self.hub.open >= cfg.realtime_max_sessions:
                    if receive is not None and receive.done():
                        message = receive.result()
                        if message["type"] == "websocket.disconnect":
                            self.gone = True
                            raise _Gone()
                        self.pending.append(message)  # later ones wait in the server's receive queue
                        receive = None
                    await asyncio.sleep(0.05)
            finally:
                if receive is not None and not receive.done():
                    receive.cancel()
        self.hub.open += 1
        self.held = True
        self.server.metrics.realtime_session(+1)

    async def _close(self, code: int, reason: str) -> None:
        if self.gone:
            return
        self.gone = True
        with anyio.move_on_after(1.0):  # a client that stopped reading is dropped when the endpoint returns
            try:
                await self.ws.send({"type": "websocket.close", "code": code, "reason": reason[:120]})
            except (OSError, RuntimeError, WebSocketDisconnect):
                pass

    async def emit(self, *events: dict) -> None:
        """Send events in order; a client that has gone, or stopped reading for --io-timeout, is dropped."""
        async with self._send_lock:
            for event in events:
                if self.gone:
                    return
                try:
                    with anyio.fail_after(self.cfg_srv.io_timeout_s):
                        await self.ws.send({"type": "websocket.send", "text": dumps(event).decode()})
                except TimeoutError:
                    log.warning("realtime client stopped reading for %g s; dropping it", self.cfg_srv.io_timeout_s)
                    self._vanish()
                except (OSError, RuntimeError, WebSocketDisconnect):
                    self._vanish()

    def _vanish(self) -> None:
        self.gone = True
        if self.cancel is not None:
            self.cancel.set()

    # ------------------------------------------------------------------ reading

    def _timeout(self) -> float:
        now = time.monotonic()
        wait = min(POLL_S, self.deadline - now)
        idle = self._idle_deadline()
        if idle is not None:
            wait = min(wait, idle - now)
        return max(0.0, wait)

    def _idle_deadline(self) -> float | None:
        vad = self.cfg.turn_detection if self.cfg else None
        if vad is None or vad.idle_timeout_ms is None or self.response is not None or self.detector is None \
                or self.detector.speaking:
            return None
        return self.idle_from + vad.idle_timeout_ms / 1000

    async def _receive(self) -> dict | None:
        if self.pending:
            return self.pending.pop(0)
        try:
            return await asyncio.wait_for(self.ws.receive(), timeout=self._timeout())
        except asyncio.TimeoutError:
            return None

    async def _read(self) -> None:
        while not self.gone:
            message = await self._receive()
            now = time.monotonic()
            if now >= self.deadline:
                limit = self.cfg_srv.realtime_max_session_s
                await self.emit(error_event(EventError(
                    f"the session reached the server's {limit:g} s limit (--realtime-max-session-seconds); open a "
                    "new one", code="session_expired")))
                await self._close(CLOSE_POLICY, "session length limit")
                return
            idle = self._idle_deadline()
            if idle is not None and now >= idle:
                await self._guard(None, self._idle_timeout())
            if message is None:
                continue
            if message["type"] == "websocket.disconnect":
                self.gone = True
                return
            await self._message(message)

    async def _message(self, message: dict) -> None:
        text = message.get("text")
        if text is None:
            await self.emit(error_event(EventError("send each event as a JSON text frame, not a binary one",
                                                   code="invalid_json")))
            return
        limit = self.cfg_srv.realtime_max_message_bytes
        if len(text) > limit or (len(text) * 4 > limit and len(text.encode()) > limit):
            await self.emit(error_event(EventError(
                f"a message of {len(text.encode())} bytes is over the server's {limit}-byte limit "
                "(--realtime-max-message); send audio in smaller appends and smaller images",
                code="message_too_large")))
            await self._close(CLOSE_TOO_BIG, "message too big")
            return
        try:
            event = ev.parse_client_event(text)
        except EventError as exc:
            await self.emit(error_event(exc))
            return
        await self._guard(event.event_id, self._dispatch(event))

