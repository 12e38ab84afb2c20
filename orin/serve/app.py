"""`orin-omni serve`: an OpenAI-compatible HTTP server around orin.runtime.engine, run by systemd as Type=notify.

The stack: uvicorn (HTTP/1.1 by h11, WebSockets by websockets) serving a Starlette application
(orin.serve.routes) on a socket bound here (orin.serve.listener), in a thread with its own event loop; the
protocol apart from HTTP in orin.serve.protocol, orin.serve.chat_request and orin.serve.audio_api. The server uses
the engine's public methods only (orin.runtime.engine.Engine). The GPU serves one generation at a time: a worker thread per
request waits its turn in a bounded FIFO (orin.serve.admission; full -> 429), runs the synchronous engine and
hands its events to the event loop (orin.serve.worker). The responses, JSON or server-sent events, and the watch for
a client that hangs up (it cancels the generation, also while queued) are orin.serve.streaming's.

Lifecycle, this module's: bind first (a taken port fails in a second, not after a minutes-long model load), load
the engine, run one warm-up request, then READY=1. WATCHDOG=1 pings while healthy (the HTTP server alive, the GPU
not stuck on one step for `stall_s`, fewer than `max_failures` internal errors in a row). SIGTERM: STOPPING=1,
refuse the queue (503), stop accepting, let the running request finish for `drain_s`, then cancel it.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..checkpoint.manifest import check_served_name
from ..errors import UsageError
from .metrics import Metrics, process_rss_bytes
from .protocol import Limits
from .sdnotify import Notifier

if TYPE_CHECKING:
    from ..runtime.engine import EngineConfig
    from .listener import Listener
    from .worker import Hook

log = logging.getLogger("orin.serve.app")
MiB = 1 << 20


@dataclass(frozen=True)
class ServeConfig:
    engine: EngineConfig  # the model served and how it is loaded (ignored where Server is handed a loaded engine)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key_file: str | None = None
    max_queue: int = 4
    allow_dir: str | None = None
    warmup: bool = True
    max_body_bytes: int = 64 * MiB
    max_audio_seconds: float = 300.0
    max_video_seconds: float = 600.0
    max_image_pixels: int = 32 * MiB
    max_new_tokens: int = 8192
    max_speech_seconds: float | None = None
    io_timeout_s: float = 30.0
    drain_s: float = 60.0
    stall_s: float = 300.0
    max_failures: int = 3
    max_connections: int = 64
    served_model_name: str | None = None  # None: the name recorded in the checkpoint's manifest
    # The Realtime API (orin.serve.realtime): sessions open at once; what a session beyond them, or a response
    # while the GPU is busy, gets ("wait": it waits; "error": an error event); the caps on one session
    realtime_max_sessions: int = 4
    realtime_busy: str = "wait"
    realtime_max_session_s: float = 3600.0
    realtime_max_buffer_s: float = 120.0
    realtime_max_message_bytes: int = 16 * MiB
    realtime_context_tokens: int | None = None  # None: the model's context length


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


class Server:
    """The serving process's state. `start()` binds, loads and warms up; `stop()` drains. Tests pass a loaded
    `engine` to share one between servers, and a `hook` to hold a request at a known point (the
    "admitted" and "event" stages, orin.serve.worker.Hook) so queueing and disconnects are deterministic.
    `app` is the Starlette application: its router takes more routes, WebSocket ones included."""

    def __init__(self, cfg: ServeConfig, *, engine=None, notifier: Notifier | None = None, hook: Hook | None = None):
        self.cfg = cfg
        self._owns_engine = engine is None
        self.notifier = notifier or Notifier()
        if cfg.served_model_name is not None:
            check_served_name(cfg.served_model_name)
        if cfg.realtime_busy not in ("wait", "error"):
            raise UsageError(f"--realtime-busy {cfg.realtime_busy!r}: use wait or error")
        self.api_keys = read_api_keys(cfg.api_key_file) if cfg.api_key_file else ()
        self.limits = Limits(max_audio_seconds=cfg.max_audio_seconds, max_image_pixels=cfg.max_image_pixels,
                             max_new_tokens=cfg.max_new_tokens, allow_dir=cfg.allow_dir,
                             max_video_seconds=cfg.max_video_seconds)
        # Imported here: `orin-omni smoke` imports read_api_keys from this module where no web stack is installed.
        from .routes import build_app
        from .worker import Worker

        self.metrics = Metrics()
        self.worker = Worker(cfg.max_queue, self.metrics, hook)
        self.worker.engine = engine
        self.gate = self.worker.gate
        self.app = build_app(self)
        self.state = "starting"
        self.model_name = ""
        self.created = int(time.time())
        self._listener: Listener | None = None
        self._watchdog_thread: threading.Thread | None = None
        self._stop_requested = threading.Event()
        self._stopped = threading.Event()

    @property
    def engine(self):
        return self.worker.engine

    # ------------------------------------------------------------------ lifecycle

    @property
    def port(self) -> int:
        if self._listener is None:
            raise RuntimeError("the server is not bound yet")
        return self._listener.port

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
        """Listen, and answer at once: /health says "loading" until the model is ready."""
        from .listener import Listener, bind

        sock = bind(self.cfg.host, self.cfg.port)
        cfg = self.cfg
        self._listener = Listener(self.app, sock, metrics=self.metrics, keep_alive_s=cfg.io_timeout_s,
                                  max_connections=cfg.max_connections, grace_s=cfg.drain_s + 35.0)
        # WebSocket frames (the Realtime API): a message over --realtime-max-message gets an error event from the
        # session; the protocol layer drops the connection (1009) only past twice that, before reading it all.
        # No per-message deflate: base64 audio hardly compresses, and the CPU is the model's. Pings every 20 s
        # find a client that vanished without closing.
        ws = self._listener.server.config
        ws.ws_max_size = 2 * cfg.realtime_max_message_bytes
        ws.ws_per_message_deflate = False
        ws.ws_ping_interval, ws.ws_ping_timeout = 20.0, 20.0
        self._listener.start()
        log.info("listening on %s", self.url)

    def start(self) -> Server:
        """Bind, load the model, warm up, then READY=1. Returns early (not ready) if stop is requested."""
        self.bind()
        try:
            if self.engine is None:
                from ..runtime.engine import Engine

                self.state = "loading"
                self.notifier.status(f"loading {self.cfg.engine.model_dir}")
                self.worker.engine = Engine(self.cfg.engine)
            self.model_name = self.cfg.served_model_name or self.engine.model_name
            self.engine.defer_captures(True)
            if self._stop_requested.is_set():
                return self
            if self.cfg.warmup:
                self.state = "warming up"
                self.notifier.status("warming up")
                self.warm_up()
                self.worker.spare()  # the warm-up's captures, before the first client
            if self._stop_requested.is_set():
                return self
            self.state = "ready"
            self.worker.progress = time.monotonic()
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

    def warm_up(self):
        """One short request through every stage that serving uses (two audios of different lengths, an image,
        text and speech), so the first client does not pay for first-call compilation, lazily loaded kernels
        (the padded audio batch's attention, the FFTs of the features) and segment loading. Returns its report."""
        from ..contract import GenerationRequest
        from ..inputs.media import synth_image, synth_speechlike

        start = time.perf_counter()
        parts = [{"type": "audio", "audio": synth_speechlike(1.0)}, {"type": "audio", "audio": synth_speechlike(0.6)},
                 {"type": "image", "image": synth_image(64)}, {"type": "text", "text": "Hello."}]
        # speech long enough for every chunk shape code2wav decodes (the profile's schedule), whatever the text's length
        req = GenerationRequest(messages=({"role": "user", "content": parts},), max_new_tokens=4, speech=True,
                                max_audio_frames=self.engine.profile.speech.every_shape_frames(), ignore_eos=True)
        with self.gate.turn():
            _text, _audio, report = self.engine.generate(req)
        log.info("warm-up done in %.2f s (ttft %.3f s)", time.perf_counter() - start, report.ttft_s or 0.0)
        return report

    def request_stop(self) -> None:
        self._stop_requested.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._stop_requested.wait(timeout)

    def stop(self, drain_s: float | None = None) -> None:
        """Refuse the queue, stop accepting, let the running request finish for `drain_s`, then cancel it."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._stop_requested.set()
        self.state = "stopping"
        drain_s = self.cfg.drain_s if drain_s is None else drain_s
        self.gate.close()
        if self._listener is not None:
            self._listener.stop()
        deadline = time.monotonic() + drain_s
        while self.gate.busy and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.gate.busy:
            log.warning("cancelling the request in flight after %.0f s of draining", drain_s)
            self.worker.cancel_all()
            deadline = time.monotonic() + 30.0
            while self.gate.busy and time.monotonic() < deadline:
                time.sleep(0.05)
        self.gate.wait_spare()  # a capture between requests ends at its step; the engine may close after it
        if not self._owns_engine and self.engine is not None:
            self.engine.defer_captures(False)  # a shared engine goes back to capturing as it did before
        # The responses to what ran are written by now, or soon: uvicorn closes their connections after them.
        if self._listener is not None and not self._listener.join(10.0):
            log.warning("connections still open after the drain; leaving them to the process's exit")
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
        if self._listener is None or not self._listener.alive():
            return False
        if self.worker.stalled_for() > self.cfg.stall_s:
            return False
        return self.worker.failures < self.cfg.max_failures

    def _watchdog_loop(self) -> None:
        interval = self.notifier.watchdog_s
        while not self._stop_requested.wait(interval):
            if self.healthy():
                self.notifier.watchdog()
            else:
                log.error("unhealthy (stalled for %.0f s or %d failures in a row): not pinging the watchdog",
                          self.worker.stalled_for(), self.worker.failures)

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


def serve(cfg: ServeConfig, env: Mapping[str, str]) -> None:
    """Run until SIGTERM or SIGINT. Under systemd ($NOTIFY_SOCKET in `env`, the process's environment, which the
    CLI hands over), speaks the notify protocol."""
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
