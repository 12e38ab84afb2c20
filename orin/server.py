"""`orin-omni serve`: an OpenAI-compatible HTTP server around orin.engine, run by systemd as Type=notify.

Built on the standard library's ThreadingHTTPServer: the GPU serves one generation at a time, so an async
stack would buy no concurrency, and it keeps the device-side install free of a web framework. What the stdlib
leaves out is done here: HTTP/1.1 keep-alive, chunked server-sent events, a request size limit checked before
reading (and before `100 Continue`), socket timeouts, a connection cap, OpenAI-style JSON for every error.

Request life: parse and decode media in the connection's thread (CPU), wait for the GPU in a bounded FIFO
(orin.admission; full -> 429), stream the engine's events to the client. A watcher thread per request notices a
client that hangs up and sets the engine's cancel event, also while the request is still queued.

Lifecycle: bind first (a taken port fails in a second, not after a minutes-long model load), load the engine,
run one warm-up request, then READY=1. WATCHDOG=1 pings while healthy (accept loop alive, the GPU not stuck on
one step for `stall_s`, fewer than `max_failures` internal errors in a row). SIGTERM: STOPPING=1, stop
accepting, refuse the queue (503), let the running request finish for `drain_s`, then cancel it.
"""

from __future__ import annotations

import hmac
import logging
import math
import os
import select
import signal
import socket
import socketserver
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from . import __version__
from .admission import Abandoned, Closed, Gate, QueueFull
from .chat_api import (
    ApiError,
    ChatRequest,
    Limits,
    audio_delta,
    check_model,
    chunk,
    completion_body,
    dumps,
    error_body,
    finish_reason,
    model_card,
    new_ids,
    parse_chat,
    parse_json,
    sse,
    text_delta,
    usage,
)
from .errors import BudgetError, InputError, OrinError, UsageError
from .manifest import check_served_name
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import Metrics, process_rss_bytes
from .sdnotify import Notifier

log = logging.getLogger("orin.server")
MiB = 1 << 20
# Label values for /metrics: anything else is "other", so scanners cannot blow up the label set.
ENDPOINTS = ("/v1/chat/completions", "/v1/models", "/health", "/metrics")
PROBE_ENDPOINTS = ("/health", "/metrics")
CODEC_FRAMES_PER_SECOND = 12.5  # Qwen3-Omni's talker: one codec frame per 80 ms of speech
CLIENT_CLOSED = 499  # nginx's status for "client closed the request", in metrics and logs only

Hook = Callable[[str, object, threading.Event], None]


@dataclass(frozen=True)
class ServeConfig:
    model_dir: str
    host: str = "127.0.0.1"
    port: int = 8000
    budget: int | None = None
    api_key_file: str | None = None
    max_queue: int = 4
    allow_dir: str | None = None
    device: str = "auto"
    power_backend: str = "auto"
    power_hz: float = 10.0
    sysfs_root: str = "/sys"
    verify_checksums: bool = True
    warmup: bool = True
    max_body_bytes: int = 64 * MiB
    max_audio_seconds: float = 300.0
    max_image_pixels: int = 32 * MiB
    max_new_tokens: int = 8192
    max_speech_seconds: float | None = None
    io_timeout_s: float = 30.0
    drain_s: float = 60.0
    stall_s: float = 300.0
    max_failures: int = 3
    max_connections: int = 64
    served_model_name: str | None = None  # None: the name recorded in the checkpoint's manifest


def read_api_keys(path: str) -> tuple[str, ...]:
    """The keys in `path`, one a line ('#' comments and blank lines skipped), so a key can be rotated by adding
    the new one before removing the old. Read once at startup: a change needs a restart."""
    try:
        with open(path, encoding="utf-8") as fh:
            lines = fh.read().splitlines()
        mode = os.stat(path).st_mode
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--api-key-file {path}: cannot read it ({exc}); write the key on one line") from exc
    keys = tuple(line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#"))
    if not keys:
        raise UsageError(f"--api-key-file {path} holds no key; write the key on one line")
    for n, key in enumerate(keys, 1):
        if any(c.isspace() for c in key):
            raise UsageError(f"--api-key-file {path}: key {n} contains whitespace; write one key a line")
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("API key file %s is readable by other users; chmod 600 it", path)
    return keys


def to_api_error(exc: BaseException) -> ApiError:
    """Client mistakes are 4xx with the engine's message; anything else is a 500 that says what broke."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, BudgetError):
        return ApiError(400, str(exc), code="budget_exceeded")
    if isinstance(exc, InputError):
        return ApiError(400, str(exc))
    if isinstance(exc, OrinError):
        return ApiError(500, str(exc), type="server_error")
    return ApiError(500, f"internal error ({type(exc).__name__}: {exc}); see the server log", type="server_error")


class _DisconnectWatcher:
    """Sets `cancel` when the peer closes the connection. A readable socket whose peek returns no bytes is a
    hang-up; bytes mean a pipelined next request, after which a close cannot be told apart, so it stops."""

    def __init__(self, sock: socket.socket, cancel: threading.Event, poll_s: float = 0.5):
        self.sock = sock
        self.cancel = cancel
        self.gone = False
        self._poll_s = poll_s
        # A pipe that __exit__ writes to, so the watcher wakes at once instead of at its next poll.
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._run, name="orin-disconnect-watch", daemon=True)

    def __enter__(self) -> _DisconnectWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        os.write(self._wake_w, b"x")
        self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _hung_up(self) -> None:
        self.gone = True
        self.cancel.set()

    def _run(self) -> None:
        while True:
            try:
                readable, _, _ = select.select([self.sock, self._wake_r], [], [], self._poll_s)
            except (OSError, ValueError):
                self._hung_up()
                return
            if self._wake_r in readable:
                return
            if not readable:
                continue
            try:
                data = self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                self._hung_up()
                return
            if not data:
                self._hung_up()
            return


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, address, handler, app: Server, family: int):
        self.address_family = family
        self.app = app
        self._slots = threading.BoundedSemaphore(app.cfg.max_connections)
        super().__init__(address, handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind would look up the host's FQDN, which can hang on a board without DNS.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]

    def process_request(self, request, client_address):
        # A cap on open connections: each holds a thread, and a flood of idle ones would exhaust them.
        if not self._slots.acquire(blocking=False):
            log.warning("refusing a connection from %s: %d connections open", client_address[0],
                        self.app.cfg.max_connections)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request, client_address) -> None:
        # socketserver's default prints a traceback to stderr, outside the log's format and level.
        log.exception("connection from %s failed", client_address[0])


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = f"orin-omni/{__version__}"
    sys_version = ""
    server: _HTTPServer

    # ------------------------------------------------------------------ plumbing

    def setup(self) -> None:
        self.timeout = self.server.app.cfg.io_timeout_s
        super().setup()

    def handle_one_request(self) -> None:
        # A client that resets its connection between requests (a keep-alive pool closing, a probe timing out)
        # is routine, not a server error: the connection just ends.
        try:
            super().handle_one_request()
        except ConnectionError as exc:
            log.debug("%s closed the connection: %s", self.client_address[0], exc)
            self.close_connection = True

    @property
    def app(self) -> Server:
        return self.server.app

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the stdlib's signature
        log.info("%s %s", self.address_string(), format % args)

    def log_request(self, code="-", size="-") -> None:
        # One line per request, written when the response is done (see _dispatch), with its duration.
        pass

    def send_response(self, code: int, message: str | None = None) -> None:
        self._status = code
        super().send_response(code, message)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The stdlib's own errors (bad request line, oversized headers, unknown method) as OpenAI JSON."""
        self.close_connection = True
        text = message or self.responses.get(code, ("error",))[0]
        self._send_json(code, error_body(text, type="invalid_request_error" if code < 500 else "server_error"))

    def _send_json(self, status: int, obj: object, headers: Mapping[str, str] | None = None) -> None:
        self._send_bytes(status, dumps(obj), "application/json", headers)

    def _send_bytes(self, status: int, body: bytes, content_type: str,
                    headers: Mapping[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _send_api_error(self, err: ApiError) -> None:
        self._send_json(err.status, err.body(), err.headers)

    def handle_expect_100(self) -> bool:
        # Refuse an oversized body before the client sends it.
        length = self.headers.get("Content-Length", "")
        if length.isdigit() and int(length) > self.app.cfg.max_body_bytes:
            self.close_connection = True
            self._send_api_error(self._too_large(int(length)))
            return False
        return super().handle_expect_100()

    def _too_large(self, length: int) -> ApiError:
        return ApiError(413, f"request body is {length} bytes, over the {self.app.cfg.max_body_bytes}-byte limit "
                        "(--max-body); send smaller media", code="request_too_large")

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() not in ("", "identity"):
            self.close_connection = True
            raise ApiError(411, "chunked request bodies are not supported; send a Content-Length")
        length = self.headers.get("Content-Length")
        if length is None:
            self.close_connection = True
            raise ApiError(411, "a Content-Length header is required")
        if not length.strip().isdigit():
            self.close_connection = True
            raise ApiError(400, f"bad Content-Length {length!r}")
        n = int(length)
        if n > self.app.cfg.max_body_bytes:
            self.close_connection = True  # the body stays unread, so the connection cannot be reused
            raise self._too_large(n)
        try:
            body = self.rfile.read(n)
        except TimeoutError as exc:
            self.close_connection = True
            raise ApiError(408, f"timed out reading the request body after {self.app.cfg.io_timeout_s:g} s") from exc
        if len(body) < n:
            self.close_connection = True
            raise ApiError(400, f"request body ended after {len(body)} of {n} bytes")
        return body

    def _authorized(self) -> bool:
        keys = self.app.api_keys
        if not keys:
            return True
        scheme, _, token = self.headers.get("Authorization", "").partition(" ")
        given = token.strip().encode()
        # Every key is compared (constant time each), so timing does not tell which one nearly matched.
        matches = [hmac.compare_digest(given, key.encode()) for key in keys]
        return scheme.lower() == "bearer" and any(matches)

    def _require_auth(self) -> None:
        if not self._authorized():
            raise ApiError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' with the key "
                           "from the server's --api-key-file", code="invalid_api_key",
                           headers={"WWW-Authenticate": 'Bearer realm="orin-omni"'})

    # ------------------------------------------------------------------ dispatch

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def _route(self, method: str, path: str):
        routes = {
            "/v1/chat/completions": {"POST": self._chat},
            "/v1/models": {"GET": self._models, "HEAD": self._models},
            "/health": {"GET": self._health, "HEAD": self._health},
            "/metrics": {"GET": self._metrics, "HEAD": self._metrics},
        }
        if path.startswith("/v1/models/"):
            return {"GET": self._model, "HEAD": self._model}.get(method), ["GET", "HEAD"]
        methods = routes.get(path.rstrip("/") or "/")
        if methods is None:
            return None, None
        return methods.get(method), sorted(methods)

    def _dispatch(self, method: str) -> None:
        start = time.perf_counter()
        self._status = 0
        path = self.path.split("?", 1)[0]
        endpoint = "/v1/models" if path.startswith("/v1/models") else path.rstrip("/")
        endpoint = endpoint if endpoint in ENDPOINTS else "other"
        try:
            handler, allowed = self._route(method, path)
            if handler is None and allowed is None:
                raise ApiError(404, f"no such endpoint: {method} {path}; see /v1/models, /v1/chat/completions, "
                               "/health, /metrics", code="not_found")
            if handler is None:
                raise ApiError(405, f"{method} is not allowed on {path}; use {', '.join(allowed)}",
                               headers={"Allow": ", ".join(allowed)})
            handler()
        except (ApiError, OrinError) as exc:
            err = to_api_error(exc)
            if err.status >= 500:
                log.error("%s %s: %s", method, path, err.message)
            self._send_api_error(err)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
            self._status = self._status or CLIENT_CLOSED
        except Exception as exc:
            log.exception("%s %s failed", method, path)
            self.close_connection = True
            if not self._status:
                self._send_api_error(to_api_error(exc))
        finally:
            status = self._status or CLIENT_CLOSED
            self.app.metrics.request(endpoint, status)
            # Probes come every few seconds for the life of the service; the state changes they watch for are
            # logged where they happen (loading, ready, unhealthy), so a line per probe is only noise.
            level = logging.DEBUG if endpoint in PROBE_ENDPOINTS else logging.INFO
            log.log(level, "%s %s %s %d %.3fs", self.address_string(), method, path, status,
                    time.perf_counter() - start)

    # ------------------------------------------------------------------ endpoints

    def _health(self) -> None:
        app = self.app
        state = app.state if app.state != "ready" or app.healthy() else "unhealthy"
        body = {"status": "ok" if state == "ready" else state, "model": app.model_name,
                "in_flight": int(app.gate.busy), "queued": app.gate.queued}
        if app.engine is not None:
            body["memory"] = app.memory()
        self._send_json(200 if state == "ready" else 503, body, {"Retry-After": "5"} if state != "ready" else None)

    def _metrics(self) -> None:
        self._require_auth()
        text = self.app.render_metrics()
        self._send_bytes(200, text.encode(), METRICS_CONTENT_TYPE)

    def _models(self) -> None:
        self._require_auth()
        app = self.app
        cards = [model_card(app.model_name, app.created)] if app.model_name else []
        self._send_json(200, {"object": "list", "data": cards})

    def _model(self) -> None:
        self._require_auth()
        app = self.app
        name = self.path.split("?", 1)[0][len("/v1/models/"):]
        if not app.model_name or name != app.model_name:
            raise ApiError(404, f"The model '{name}' does not exist; this server serves '{app.model_name}'",
                           param="model", code="model_not_found")
        self._send_json(200, model_card(app.model_name, app.created))

    def _chat(self) -> None:
        self._require_auth()
        app = self.app
        data = parse_json(self._read_body())
        if app.state != "ready":
            raise ApiError(503, f"the server is {app.state}; retry shortly", type="server_error",
                           code="not_ready", headers={"Retry-After": "5"})
        model = data.get("model")
        if isinstance(model, str):
            check_model(model, app.model_name)
        try:
            req = parse_chat(data, app.limits, max_bytes=app.cfg.max_body_bytes)
        except InputError as exc:
            raise ApiError(400, str(exc)) from exc
        cancel = threading.Event()
        with _DisconnectWatcher(self.connection, cancel) as watcher:
            try:
                with app.gate.turn(cancel):
                    app.run_chat(self, req, cancel, watcher)
            except QueueFull as exc:
                app.metrics.queue_full()
                raise ApiError(429, f"the server is busy: {app.gate.max_queue} requests are already waiting "
                               "(--max-queue); retry later", type="rate_limit_error", code="queue_full",
                               headers={"Retry-After": "1"}) from exc
            except Closed as exc:
                raise ApiError(503, "the server is shutting down", type="server_error", code="shutting_down",
                               headers={"Retry-After": "5"}) from exc
            except Abandoned:
                self.close_connection = True
                self._status = CLIENT_CLOSED
                log.info("client went away while queued")

    # ------------------------------------------------------------------ generation output

    def write_chunk(self, data: bytes) -> None:
        """One chunk of a chunked body (HTTP/1.1), sent with a single write."""
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("X-Accel-Buffering", "no")
        self.end_headers()

    def end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")


class Server:
    """The serving process's state. `start()` binds, loads and warms up; `stop()` drains. Tests pass a loaded
    `engine` to share one between servers, and a `hook` to hold a request at a known point (the
    "admitted" and "event" stages) so queueing and disconnects are deterministic."""

    def __init__(self, cfg: ServeConfig, *, engine=None, notifier: Notifier | None = None, hook: Hook | None = None):
        self.cfg = cfg
        self.engine = engine
        self._owns_engine = engine is None
        self.notifier = notifier or Notifier()
        self.hook = hook
        if cfg.served_model_name is not None:
            check_served_name(cfg.served_model_name)
        self.api_keys = read_api_keys(cfg.api_key_file) if cfg.api_key_file else ()
        self.limits = Limits(max_audio_seconds=cfg.max_audio_seconds, max_image_pixels=cfg.max_image_pixels,
                             max_new_tokens=cfg.max_new_tokens, allow_dir=cfg.allow_dir)
        self.gate = Gate(cfg.max_queue)
        self.metrics = Metrics()
        self.state = "starting"
        self.model_name = ""
        self.created = int(time.time())
        self._httpd: _HTTPServer | None = None
        self._http_thread: threading.Thread | None = None
        self._watchdog_thread: threading.Thread | None = None
        self._stop_requested = threading.Event()
        self._stopped = threading.Event()
        self._active: set[threading.Event] = set()
        self._active_lock = threading.Lock()
        self._progress = time.monotonic()
        self._failures = 0

    # ------------------------------------------------------------------ lifecycle

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("the server is not bound yet")
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        host = self.cfg.host
        if host in ("0.0.0.0", ""):
            host = "127.0.0.1"
        elif host == "::":
            host = "::1"
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    def bind(self) -> None:
        try:
            infos = socket.getaddrinfo(self.cfg.host, self.cfg.port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
        except socket.gaierror as exc:
            raise UsageError(f"--host {self.cfg.host}: cannot resolve it ({exc})") from exc
        family, _, _, _, address = infos[0]
        try:
            self._httpd = _HTTPServer(address[:2], _Handler, self, family)
        except OSError as exc:
            raise UsageError(f"cannot listen on {self.cfg.host}:{self.cfg.port}: {exc.strerror or exc}; "
                             "pick another --port or stop the process using it") from exc
        self._http_thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                             name="orin-http", daemon=True)
        self._http_thread.start()
        log.info("listening on %s", self.url)

    def start(self) -> Server:
        """Bind, load the model, warm up, then READY=1. Returns early (not ready) if stop is requested."""
        self.bind()
        try:
            if self.engine is None:
                self.state = "loading"
                self.notifier.status(f"loading {self.cfg.model_dir}")
                self.engine = open_engine(self.cfg)
            self.model_name = self.cfg.served_model_name or self.engine.model_name
            if self._stop_requested.is_set():
                return self
            if self.cfg.warmup:
                self.state = "warming up"
                self.notifier.status("warming up")
                self.warm_up()
            if self._stop_requested.is_set():
                return self
            self.state = "ready"
            self._progress = time.monotonic()
            self.notifier.ready(f"serving {self.model_name} on {self.url}")
            log.info("ready: %s on %s", self.model_name, self.url)
            if self.notifier.watchdog_s:
                self._watchdog_thread = threading.Thread(target=self._watchdog_loop, name="orin-watchdog",
                                                         daemon=True)
                self._watchdog_thread.start()
        except BaseException:
            self.stop(drain_s=0)
            raise
        return self

    def warm_up(self) -> dict:
        """One short request through every stage that serving uses (text and speech), so the first client does
        not pay for first-call compilation and segment loading."""
        from .engine import GenerationRequest

        start = time.perf_counter()
        req = GenerationRequest(messages=({"role": "user", "content": "Hello."},), max_new_tokens=4, speech=True,
                                max_audio_frames=8)
        with self.gate.turn():
            _text, _audio, report = self.engine.generate(req)
        log.info("warm-up done in %.2f s (ttft %.3f s)", time.perf_counter() - start, report.get("ttft_s") or 0.0)
        return report

    def request_stop(self) -> None:
        self._stop_requested.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._stop_requested.wait(timeout)

    def stop(self, drain_s: float | None = None) -> None:
        """Stop accepting, refuse the queue, let the running request finish for `drain_s`, then cancel it."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._stop_requested.set()
        self.state = "stopping"
        drain_s = self.cfg.drain_s if drain_s is None else drain_s
        self.gate.close()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        deadline = time.monotonic() + drain_s
        while self.gate.busy and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.gate.busy:
            log.warning("cancelling the request in flight after %.0f s of draining", drain_s)
            with self._active_lock:
                for event in self._active:
                    event.set()
            deadline = time.monotonic() + 30.0
            while self.gate.busy and time.monotonic() < deadline:
                time.sleep(0.05)
        if self._watchdog_thread is not None:
            self._watchdog_thread.join(timeout=5)
        if self._owns_engine and self.engine is not None:
            self.engine.close()
        log.info("stopped")

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ------------------------------------------------------------------ health

    def healthy(self) -> bool:
        if self.state != "ready":
            return False
        if self._http_thread is None or not self._http_thread.is_alive():
            return False
        if self.gate.busy and time.monotonic() - self._progress > self.cfg.stall_s:
            return False
        return self._failures < self.cfg.max_failures

    def _watchdog_loop(self) -> None:
        interval = self.notifier.watchdog_s
        while not self._stop_requested.wait(interval):
            if self.healthy():
                self.notifier.watchdog()
            else:
                log.error("unhealthy (stalled for %.0f s or %d failures in a row): not pinging the watchdog",
                          time.monotonic() - self._progress, self._failures)

    def memory(self) -> dict:
        try:
            return dict(self.engine.memory())
        except Exception as exc:  # noqa: BLE001 - a metrics scrape must not fail on a memory probe
            log.warning("engine.memory() failed: %s", exc)
            return {}

    def render_metrics(self) -> str:
        return self.metrics.render(model=self.model_name, ready=self.state == "ready", in_flight=int(self.gate.busy),
                                   queued=self.gate.queued, memory=self.memory() if self.engine else None,
                                   rss_bytes=process_rss_bytes())

    # ------------------------------------------------------------------ generation

    def _generation_request(self, req: ChatRequest):
        from .engine import GenerationRequest

        extra = {"speaker": req.voice} if req.voice else {}
        if self.cfg.max_speech_seconds is not None:
            extra["max_audio_frames"] = max(1, math.ceil(self.cfg.max_speech_seconds * CODEC_FRAMES_PER_SECOND))
        return GenerationRequest(messages=req.messages, max_new_tokens=req.max_new_tokens, speech=req.audio_out,
                                 temperature=req.temperature, top_p=req.top_p, seed=req.seed, **extra)

    def _events(self, req: ChatRequest, cancel: threading.Event) -> Iterator:
        """The engine's events for `req`, marking progress for the watchdog and calling the test hook."""
        events = self.engine.stream(self._generation_request(req), cancel)
        try:
            for event in events:
                self._progress = time.monotonic()
                if self.hook is not None:
                    self.hook("event", event, cancel)
                yield event
        finally:
            events.close()

    def run_chat(self, handler: _Handler, req: ChatRequest, cancel: threading.Event,
                 watcher: _DisconnectWatcher) -> None:
        """Runs with the GPU held. Writes the whole response (JSON or a stream) to `handler`."""
        self._progress = time.monotonic()
        with self._active_lock:
            self._active.add(cancel)
        start = time.perf_counter()
        report: dict | None = None
        try:
            if self.hook is not None:
                self.hook("admitted", None, cancel)
            events = self._events(req, cancel)
            if req.stream:
                report = self._stream(handler, req, events, cancel, watcher)
            else:
                report = self._complete(handler, req, events, watcher)
            self._failures = 0
        except Exception as exc:
            if to_api_error(exc).status >= 500:
                self._failures += 1
            raise
        finally:
            with self._active_lock:
                self._active.discard(cancel)
            if report is not None:
                self.metrics.generation(report, time.perf_counter() - start)

    def _shutdown_error(self) -> ApiError:
        return ApiError(503, "the server is shutting down; the request was cancelled", type="server_error",
                        code="shutting_down")

    def _complete(self, handler: _Handler, req: ChatRequest, events: Iterator, watcher) -> dict | None:
        import numpy as np

        from .engine import AudioChunk, Done, TextDelta

        text, audio, report = [], [], None
        for event in events:
            if isinstance(event, TextDelta):
                text.append(event.text)
            elif isinstance(event, AudioChunk):
                audio.append(np.asarray(event.samples, dtype=np.float32))
            elif isinstance(event, Done):
                report = dict(event.report)
        if report is None:
            raise OrinError("the engine ended without a report")
        if watcher.gone:
            handler.close_connection = True
            handler._status = CLIENT_CLOSED
            log.info("client went away; generation cancelled after %s tokens", report.get("completion_tokens"))
            return report
        if report.get("cancelled"):
            raise self._shutdown_error()
        samples = np.concatenate(audio) if audio else None
        body = completion_body(req, self.model_name, new_ids(), "".join(text), samples, report)
        handler._send_json(200, body)
        return report

    def _stream(self, handler: _Handler, req: ChatRequest, events: Iterator, cancel: threading.Event,
                watcher) -> dict | None:
        from .engine import AudioChunk, Done, TextDelta

        ids = new_ids()
        try:
            first = next(events)
        except StopIteration as exc:
            raise OrinError("the engine ended without a report") from exc
        # Headers go out only now: a request the engine refuses at its first step still gets a JSON 4xx.
        handler.start_stream()
        open_ = [True]

        def send(obj) -> None:
            if not open_[0]:
                return
            try:
                handler.write_chunk(sse(obj))
            except OSError:
                # The client hung up mid-stream: stop the engine, keep draining it so it cleans up.
                open_[0] = False
                watcher.gone = True
                cancel.set()

        role = {"role": "assistant"} if req.audio_out else {"role": "assistant", "content": ""}
        send(chunk(ids, self.model_name, role))
        report = None
        try:
            for event in _chain(first, events):
                if isinstance(event, TextDelta) and event.text:
                    send(chunk(ids, self.model_name, text_delta(req, ids, event.text)))
                elif isinstance(event, AudioChunk):
                    send(chunk(ids, self.model_name, audio_delta(req, ids, event.samples)))
                elif isinstance(event, Done):
                    report = dict(event.report)
        except Exception as exc:
            err = to_api_error(exc)
            log.error("stream failed after its headers were sent: %s", err.message)
            if err.status >= 500:
                self._failures += 1
            send(err.body())
            send("[DONE]")
            self._finish_stream(handler, open_)
            return report
        if report is None:
            send(error_body("the engine ended without a report", type="server_error"))
        elif watcher.gone:
            handler._status = CLIENT_CLOSED
            log.info("client went away; generation cancelled after %s tokens", report.get("completion_tokens"))
        elif report.get("cancelled"):
            send(self._shutdown_error().body())
        else:
            if req.audio_out:
                send(chunk(ids, self.model_name, {"audio": {"id": ids[1], "expires_at": ids[2]}}))
            send(chunk(ids, self.model_name, {}, finish=finish_reason(report, req.max_new_tokens),
                       extra={"orin": report}))
            if req.include_usage:
                send(chunk(ids, self.model_name, None, extra={"usage": usage(report)}))
        send("[DONE]")
        self._finish_stream(handler, open_)
        return report

    @staticmethod
    def _finish_stream(handler: _Handler, open_: list) -> None:
        if not open_[0]:
            handler.close_connection = True
            return
        try:
            handler.end_stream()
        except OSError:
            handler.close_connection = True


def _chain(first, rest: Iterator) -> Iterator:
    yield first
    yield from rest


def open_engine(cfg: ServeConfig):
    from .engine import Engine, EngineConfig

    return Engine(EngineConfig(model_dir=cfg.model_dir, device=cfg.device, budget=cfg.budget,
                               power_backend=cfg.power_backend, power_hz=cfg.power_hz, sysfs_root=cfg.sysfs_root,
                               verify_checksums=cfg.verify_checksums))


# ---------------------------------------------------------------------- process entry


class _JournalFormatter(logging.Formatter):
    """sd-daemon(3) priority prefixes, so journald files each line at its level; journald adds timestamps."""

    def format(self, record: logging.LogRecord) -> str:
        level = record.levelno
        prio = 3 if level >= logging.ERROR else 4 if level >= logging.WARNING else 6 if level >= logging.INFO else 7
        return f"<{prio}>{super().format(record)}"


def configure_logging(env: Mapping[str, str]) -> None:
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler()
    if env.get("JOURNAL_STREAM"):
        handler.setFormatter(_JournalFormatter("%(name)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def serve(cfg: ServeConfig, env: Mapping[str, str] | None = None) -> None:
    """Run until SIGTERM or SIGINT. Under systemd ($NOTIFY_SOCKET), speaks the notify protocol."""
    env = os.environ if env is None else env
    configure_logging(env)
    notifier = Notifier.from_env(env)
    server = Server(cfg, notifier=notifier)

    def on_signal(signum, _frame) -> None:
        log.info("%s received: stopping", signal.Signals(signum).name)
        notifier.stopping("stopping: finishing the request in flight")
        server.request_stop()

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, on_signal)
    try:
        server.start()
        while not server.wait(1.0):
            pass
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
