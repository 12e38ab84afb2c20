"""The HTTP API as a Starlette application: routes, API keys, request bodies, errors as OpenAI JSON, and one
access line and one metrics sample per request.

Every refusal is an OpenAI-style JSON error, including the ones Starlette's router makes (404, 405). A refusal
that leaves the request body unread keeps the connection usable: uvicorn reads the rest of the body and discards
it before the next request, so an error never poisons the request after it. The exceptions close the connection
on purpose: a body too slow to arrive (408), and an oversized body whose client waits for `100 Continue` (413;
it will never send the body).

`server` is orin.serve.app.Server (not imported: app imports this module); what is read from it: cfg, api_keys,
state, model_name, created, limits, worker, metrics, engine, healthy(), memory(), render_metrics().
"""

from __future__ import annotations

import logging
import time
from email.utils import formatdate

import anyio
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from .. import __version__
from ..errors import OrinError
from .audio_api import (
    SpeechResponse,
    TranscriptionResponse,
    check_multipart,
    encodable_formats,
    parse_speech,
    parse_transcription,
    read_form,
    speech_request,
    transcription_request,
)
from .chat_request import generation_request, parse_chat
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .protocol import ApiError, check_model, dumps, key_matches, model_card, parse_json, to_api_error
from .realtime import realtime_route
from .streaming import CLIENT_CLOSED, STATUS_KEY, ChatResponse

log = logging.getLogger("orin.serve.app")  # one logger for the server's lines, whichever module writes them
# Label values for /metrics: anything else is "other", so scanners cannot blow up the label set.
ENDPOINTS = ("/v1/chat/completions", "/v1/audio/transcriptions", "/v1/audio/speech", "/v1/realtime", "/v1/models",
             "/health", "/metrics")
PROBE_ENDPOINTS = ("/health", "/metrics")
METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH")  # others are 501, as the HTTP/1.1 spec has it
SERVER = f"orin-omni/{__version__}".encode()
_NAMES = {b"www-authenticate": b"WWW-Authenticate"}  # where Title-Case is not the usual spelling


def json_response(status: int, obj: object, headers: dict | None = None) -> Response:
    return Response(dumps(obj), status_code=status, headers=headers, media_type="application/json")


def error_response(err: ApiError) -> Response:
    return json_response(err.status, err.body(), err.headers)


async def _no_response(scope, receive, send) -> None:
    """For a client that hung up before its request was read: there is no one to answer."""


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The request body, refused before it is read when its Content-Length is over `limit` (and so before
    uvicorn sends `100 Continue`). Chunked bodies are counted as they arrive."""
    headers = request.headers
    length = headers.get("content-length")
    if length is None and "chunked" not in headers.get("transfer-encoding", "").lower():
        raise ApiError(411, "a Content-Length header is required (or a chunked body)")
    if length is not None and int(length) > limit:  # h11 has checked that it is a number
        # A client waiting for 100 Continue sends no body, so the connection cannot carry another request.
        waiting = headers.get("expect", "").lower() == "100-continue"
        raise _too_large(f"request body is {length} bytes", limit, close=waiting)
    chunks, size = [], 0
    try:
        with anyio.fail_after(timeout_s):
            async for part in request.stream():
                size += len(part)
                if size > limit:
                    raise _too_large(f"request body is over {size} bytes", limit)
                chunks.append(part)
    except TimeoutError as exc:
        raise ApiError(408, f"timed out reading the request body after {timeout_s:g} s",
                       headers={"Connection": "close"}) from exc
    return b"".join(chunks)


def _too_large(what: str, limit: int, close: bool = False) -> ApiError:
    return ApiError(413, f"{what}, over the {limit}-byte limit (--max-body); send smaller media",
                    code="request_too_large", headers={"Connection": "close"} if close else None)


class _Api:
    def __init__(self, server):
        self.server = server

    def require_auth(self, request: Request) -> None:
        keys = self.server.api_keys
        if not keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key_matches(token.strip(), keys):
            raise ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' with the key "
                           "from the server's --api-key-file", code="invalid_api_key",
                           headers={"WWW-Authenticate": 'Bearer realm="orin-omni"'})

    async def health(self, request: Request) -> Response:
        srv = self.server
        state = srv.state if srv.state != "ready" or srv.healthy() else "unhealthy"
        body = {"status": "ok" if state == "ready" else state, "model": srv.model_name,
                "in_flight": int(srv.worker.gate.busy), "queued": srv.worker.gate.queued}
        if srv.engine is not None:
            body["memory"] = await run_in_threadpool(srv.memory)
        return json_response(200 if state == "ready" else 503, body, {"Retry-After": "5"} if state != "ready" else None)

    async def metrics(self, request: Request) -> Response:
        self.require_auth(request)
        text = await run_in_threadpool(self.server.render_metrics)
        return Response(text.encode(), media_type=METRICS_CONTENT_TYPE)

    async def models(self, request: Request) -> Response:
        self.require_auth(request)
        srv = self.server
        cards = [model_card(srv.model_name, srv.created)] if srv.model_name else []
        return json_response(200, {"object": "list", "data": cards})

    async def model(self, request: Request) -> Response:
        self.require_auth(request)
        srv = self.server
        name = request.path_params["name"]
        if not srv.model_name or name != srv.model_name:
            raise ApiError(404, f"The model '{name}' does not exist; this server serves '{srv.model_name}'",
                           param="model", code="model_not_found")
        return json_response(200, model_card(srv.model_name, srv.created))

    async def accepted(self, request: Request, parse, check_headers=None):
        """The request's body through `parse` (bytes -> a dict with the request's fields), once the key, the
        headers (`check_headers`), the body's size and the server's state are checked, and its `model`, where
        given, is the served one; None when the client hung up while sending it."""
        self.require_auth(request)
        if check_headers is not None:
            check_headers(request.headers)
        srv = self.server
        try:
            body = await read_body(request, srv.cfg.max_body_bytes, srv.cfg.io_timeout_s)
        except ClientDisconnect:
            return None
        data = await parse(body)
        self.require_ready()
        model = data.get("model")
        if isinstance(model, str):
            check_model(model, srv.model_name)
        return data

    async def chat(self, request: Request):
        srv = self.server
        data = await self.accepted(request, lambda body: run_in_threadpool(parse_json, body))
        if data is None:
            return _no_response
        # Decoding images and audio is CPU work: off the event loop.
        req = await run_in_threadpool(parse_chat, data, srv.limits, srv.engine.voices,
                                      max_bytes=srv.cfg.max_body_bytes)
        return ChatResponse(srv.worker, req, generation_request(req, srv.cfg.max_speech_seconds), srv.model_name,
                            srv.cfg.io_timeout_s)

    def require_ready(self) -> None:
        if self.server.state != "ready":
            raise ApiError(503, f"the server is {self.server.state}; retry shortly", type="server_error",
                           code="not_ready", headers={"Retry-After": "5"})

    async def transcriptions(self, request: Request):
        srv = self.server
        form = await self.accepted(request, lambda body: read_form(request.headers, body),
                                   lambda headers: check_multipart(headers.get("content-type")))
        if form is None:
            return _no_response
        # Decoding the audio is CPU work: off the event loop.
        req = await run_in_threadpool(parse_transcription, form, srv.limits)
        return TranscriptionResponse(srv.worker, req, transcription_request(req, srv.limits), srv.cfg.io_timeout_s)

    async def speech(self, request: Request):
        srv = self.server
        data = await self.accepted(request, lambda body: run_in_threadpool(parse_json, body))
        if data is None:
            return _no_response
        req = parse_speech(data, srv.engine.voices, await run_in_threadpool(encodable_formats))
        return SpeechResponse(srv.worker, req, speech_request(req, srv.limits, srv.cfg.max_speech_seconds),
                              srv.cfg.io_timeout_s)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    """Starlette's router refusals, in the API's words."""
    method, path = request.method, request.url.path
    if exc.status_code == 404:
        return error_response(ApiError(404, f"no such endpoint: {method} {path}; see /v1/models, "
                                       "/v1/chat/completions, /v1/audio/transcriptions, /v1/audio/speech, "
                                       "/v1/realtime (WebSocket), /health, /metrics", code="not_found"))
    if exc.status_code == 405:
        allowed = ", ".join(sorted(m.strip() for m in (exc.headers or {}).get("Allow", "").split(",")))
        return error_response(ApiError(405, f"{method} is not allowed on {path}; use {allowed}",
                                       headers={"Allow": allowed}))
    return error_response(ApiError(exc.status_code, str(exc.detail)))


async def _api_error(request: Request, exc: Exception) -> Response:
    err = to_api_error(exc)
    if err.status >= 500:  # out of memory is an answer; the engine has logged what failed
        level = logging.WARNING if err.code == "out_of_memory" else logging.ERROR
        log.log(level, "%s %s: %s", request.method, request.url.path, err.message)
    return error_response(err)


def _headers(headers) -> list[tuple[bytes, bytes]]:
    """Server and Date first, then the response's, with names in their usual case: HTTP says case does not
    matter, but a client that keeps headers in a plain dict looks up "Content-Type"."""
    out = [(b"Server", SERVER), (b"Date", formatdate(usegmt=True).encode())]
    out += [(_NAMES.get(name.lower()) or name.title(), value) for name, value in headers]
    return out


class AccessLog:
    """Outermost: one access line and one requests_total sample per request, 501 for unknown methods, and
    unexpected exceptions as a logged 500 (never a traceback from uvicorn, never a bare connection reset)."""

    def __init__(self, app, server):
        self.app = app
        self.server = server

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        method, path = scope["method"], scope["path"]
        if len(path) > 1 and path.endswith("/"):
            scope["path"] = path.rstrip("/") or "/"
        sent = [0]
        endpoint = "/v1/models" if path.startswith("/v1/models") else path.rstrip("/")
        endpoint = endpoint if endpoint in ENDPOINTS else "other"
        counted = [False]

        def count(status: int) -> None:
            if not counted[0]:
                counted[0] = True
                self.server.metrics.request(endpoint, status)

        async def send_and_note(message) -> None:
            if message["type"] == "http.response.start":
                sent[0] = message["status"]
                message = {**message, "headers": _headers(message.get("headers") or ())}
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                # Counted before the last byte goes out: a client holding its whole answer finds it in /metrics
                # (the app may still be winding down its engine run when the client has everything).
                count(scope.get(STATUS_KEY) or sent[0])
            await send(message)

        try:
            if method in METHODS:
                await self.app(scope, receive, send_and_note)
            else:
                err = ApiError(501, f"method {method} is not supported; use {', '.join(METHODS)}",
                               type="server_error")
                await error_response(err)(scope, receive, send_and_note)
        except Exception as exc:
            log.exception("%s %s failed", method, path)
            if not sent[0]:
                await error_response(to_api_error(exc))(scope, receive, send_and_note)
        finally:
            status = scope.get(STATUS_KEY) or sent[0] or CLIENT_CLOSED
            count(status)
            # Probes come every few seconds for the life of the service; the state changes they watch for are
            # logged where they happen (loading, ready, unhealthy), so a line per probe is only noise.
            level = logging.DEBUG if endpoint in PROBE_ENDPOINTS else logging.INFO
            client = (scope.get("client") or ("-",))[0]
            log.log(level, "%s %s %s %d %.3fs", client, method, path, status, time.perf_counter() - start)


def build_app(server) -> Starlette:
    """The ASGI application. WebSocket routes (a realtime API) go in the same router."""
    api = _Api(server)
    routes = [
        Route("/v1/chat/completions", api.chat, methods=["POST"]),
        Route("/v1/audio/transcriptions", api.transcriptions, methods=["POST"]),
        Route("/v1/audio/speech", api.speech, methods=["POST"]),
        Route("/v1/models", api.models, methods=["GET"]),
        Route("/v1/models/{name:path}", api.model, methods=["GET"]),
        Route("/health", api.health, methods=["GET"]),
        Route("/metrics", api.metrics, methods=["GET"]),
        realtime_route(server),
    ]
    handlers = {HTTPException: _http_error, ApiError: _api_error, OrinError: _api_error}
    app = Starlette(routes=routes, exception_handlers=handlers, middleware=[Middleware(AccessLog, server=server)])
    app.router.redirect_slashes = False  # AccessLog strips trailing slashes instead
    return app
