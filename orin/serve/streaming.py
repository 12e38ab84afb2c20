"""The response to an admitted engine request, as an ASGI callable: EngineResponse queues it, watches the client
and hands the engine's events to its subclass, which writes them; ChatResponse writes chat completions (one JSON
body, or server-sent events as the engine produces them), orin.serve.audio_api the audio endpoints.

While the engine runs, a task waits on the ASGI `receive` channel: the request body has been read, so the next
message is `http.disconnect`, when the client hangs up (also while the request waits in the queue). It sets the
request's cancel event; the engine stops at its next step and the queue gives up the request's place. A client
that stops reading for `io_timeout_s` is treated the same way.

Headers of a stream go out with the engine's first event, so a request the engine refuses at its first step (or
one the queue refuses) still gets a JSON 4xx/5xx. After that, an error is one last error chunk, then [DONE].
"""

from __future__ import annotations

import asyncio
import logging
import threading

import anyio
from starlette.concurrency import run_in_threadpool

from ..contract import AudioChunk, Done, TextDelta
from .admission import Abandoned, Closed, QueueFull
from .chat_request import ChatRequest
from .protocol import (
    ApiError,
    audio_delta,
    chunk,
    completion_body,
    dumps,
    finish_reason,
    new_ids,
    sse,
    text_delta,
    to_api_error,
    usage,
)
from .worker import Run, Worker

log = logging.getLogger("orin.serve.app")  # one logger for the server's lines, whichever module writes them
CLIENT_CLOSED = 499  # nginx's status for "client closed the request", in metrics and logs only
STATUS_KEY = "orin.status"  # set in the ASGI scope when the status to log is not the one sent
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


def shutdown_error() -> ApiError:
    return ApiError(503, "the server is shutting down; the request was cancelled", type="server_error",
                    code="shutting_down")


class _Client:
    """The client's side of one response: gone (hung up or stopped reading) or not, and sends that give up on
    a client that is gone instead of blocking on it."""

    def __init__(self, send, cancel: threading.Event, timeout_s: float):
        self.gone = False
        self._send = send
        self._cancel = cancel
        self._timeout_s = timeout_s

    def hung_up(self) -> None:
        self.gone = True
        self._cancel.set()

    async def watch(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.hung_up()

    async def send(self, message: dict) -> None:
        if self.gone:
            return
        try:
            with anyio.fail_after(self._timeout_s):
                await self._send(message)
        except TimeoutError:
            log.warning("client stopped reading for %g s; dropping its response", self._timeout_s)
            self.hung_up()

    async def event(self, obj: object) -> None:
        await self.send({"type": "http.response.body", "body": sse(obj), "more_body": True})


class EngineResponse:
    """Queues `engine_req`, maps the queue's refusals to errors, cancels the generation when the client hangs up,
    and gives the engine's first event to `respond`, which writes the answer."""

    def __init__(self, worker: Worker, engine_req, io_timeout_s: float):
        self.worker = worker
        self.engine_req = engine_req
        self.io_timeout_s = io_timeout_s

    async def __call__(self, scope, receive, send) -> None:
        cancel = threading.Event()
        client = _Client(send, cancel, self.io_timeout_s)
        watcher = asyncio.ensure_future(client.watch(receive))
        try:
            run = self.worker.submit(self.engine_req, cancel)
            first = await self._admitted(run)
            if first is None or client.gone:
                # Gone while queued, or at the first event: the engine stops at its next step; wait for its end.
                await self._drain(run, first)
                scope[STATUS_KEY] = CLIENT_CLOSED
                return
            await self.respond(scope, run, first, client)
        finally:
            # At once: once the response is complete, receive() reports a disconnect that is not one.
            watcher.cancel()

    async def respond(self, scope, run: Run, event, client: _Client) -> None:
        """Write the response, starting from the engine's first event `event`."""
        raise NotImplementedError

    async def _admitted(self, run: Run):
        """The engine's first event, or None when the client left the queue; the queue's refusals as errors."""
        try:
            return await run.get()
        except QueueFull as exc:
            raise ApiError(429, f"the server is busy: {self.worker.gate.max_queue} requests are already waiting "
                           "(--max-queue); retry later", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}) from exc
        except Closed as exc:
            raise ApiError(503, "the server is shutting down", type="server_error", code="shutting_down",
                           headers={"Retry-After": "5"}) from exc
        except Abandoned:
            log.info("client went away while queued")
            return None

    @staticmethod
    async def _drain(run: Run, event) -> None:
        while event is not None and not isinstance(event, Done):
            event = await run.get()
        if event is not None:
            log.info("client went away; generation cancelled after %d tokens", event.report.completion_tokens)

    async def collect(self, scope, run: Run, event, client: _Client):
        """The whole answer as (text, samples or None, report); None when the client has gone (the status to log
        is set). A generation that shutdown cancelled raises the 503."""
        import numpy as np

        text, audio = [], []
        while not isinstance(event, Done):
            if isinstance(event, TextDelta):
                text.append(event.text)
            elif isinstance(event, AudioChunk):
                audio.append(np.asarray(event.samples, dtype=np.float32))
            event = await run.get()
        report = event.report
        if client.gone:
            scope[STATUS_KEY] = CLIENT_CLOSED
            log.info("client went away; generation cancelled after %d tokens", report.completion_tokens)
            return None
        if report.cancelled:
            raise shutdown_error()
        return "".join(text), np.concatenate(audio) if audio else None, report

    @staticmethod
    async def send_whole(client: _Client, body: bytes, content_type: bytes) -> None:
        await client.send({"type": "http.response.start", "status": 200,
                           "headers": [(b"content-type", content_type),
                                       (b"content-length", str(len(body)).encode())]})
        await client.send({"type": "http.response.body", "body": body})

    async def stream_sse(self, scope, run: Run, event, client: _Client, each, last, *, opening=(),
                         done_marker: bool = True) -> None:
        """Server-sent events: `opening`, then `each(event)`'s objects for every engine event, then `last(report)`'s
        when the engine completed. An error after the status line becomes the last event. `done_marker` ends the
        stream with "[DONE]" (chat completions; the audio endpoints end with a typed done event instead)."""
        await client.send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        for obj in opening:
            await client.event(obj)
        try:
            while not isinstance(event, Done):
                for obj in each(event):
                    await client.event(obj)
                event = await run.get()
        except Exception as exc:  # noqa: BLE001 - the status line has gone out: the error becomes the last event
            err = to_api_error(exc)
            level = logging.WARNING if err.code == "out_of_memory" else logging.ERROR  # an answer, not a fault
            log.log(level, "stream failed after its headers were sent: %s", err.message)
            await client.event(err.body())
            await self._end(scope, client, done_marker)
            return
        report = event.report
        if client.gone:
            log.info("client went away; generation cancelled after %d tokens", report.completion_tokens)
        elif report.cancelled:
            await client.event(shutdown_error().body())
        else:
            for obj in last(report):
                await client.event(obj)
        await self._end(scope, client, done_marker)

    @staticmethod
    async def _end(scope, client: _Client, done_marker: bool = True) -> None:
        if done_marker:
            await client.event("[DONE]")
        if client.gone:
            scope[STATUS_KEY] = CLIENT_CLOSED
            return
        await client.send({"type": "http.response.body", "body": b"", "more_body": False})


class ChatResponse(EngineResponse):
    def __init__(self, worker: Worker, req: ChatRequest, engine_req, model: str, io_timeout_s: float):
        super().__init__(worker, engine_req, io_timeout_s)
        self.req = req
        self.model = model

    async def respond(self, scope, run: Run, event, client: _Client) -> None:
        if self.req.stream:
            await self._stream(scope, run, event, client)
        else:
            await self._complete(scope, run, event, client)

    async def _complete(self, scope, run: Run, event, client: _Client) -> None:
        answer = await self.collect(scope, run, event, client)
        if answer is None:
            return
        text, samples, report = answer
        # Encoding a long answer's speech is CPU work: off the event loop.
        body = await run_in_threadpool(
            lambda: dumps(completion_body(self.req, self.model, new_ids(), text, samples, report)))
        await self.send_whole(client, body, b"application/json")

    async def _stream(self, scope, run: Run, event, client: _Client) -> None:
        req, model, ids = self.req, self.model, new_ids()
        role = {"role": "assistant"} if req.audio_out else {"role": "assistant", "content": ""}

        def each(event) -> list:
            if isinstance(event, TextDelta) and event.text:
                return [chunk(ids, model, text_delta(req, ids, event.text))]
            if isinstance(event, AudioChunk):
                return [chunk(ids, model, audio_delta(req, ids, event.samples))]
            return []

        def last(report) -> list:
            out = [chunk(ids, model, {"audio": {"id": ids[1], "expires_at": ids[2]}})] if req.audio_out else []
            out.append(chunk(ids, model, {}, finish=finish_reason(report), extra={"orin": report.to_json()}))
            if req.include_usage:
                out.append(chunk(ids, model, None, extra={"usage": usage(report)}))
            return out

        await self.stream_sse(scope, run, event, client, each, last, opening=[chunk(ids, model, role)])
