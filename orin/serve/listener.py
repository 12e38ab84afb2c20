"""uvicorn on a socket bound beforehand, in a thread with its own event loop.

Bound by us, first: a taken port fails in a second, before a minutes-long model load, and port 0 gives a port
the caller can read at once. The thread leaves the process's signals to orin.serve.app (uvicorn installs its
handlers only in the main thread), which sends systemd's STOPPING=1 and drains the GPU before uvicorn stops.

HTTP/1.1 is h11's, through uvicorn: keep-alive, chunked bodies both ways, `100 Continue` when the application
first reads the body, and the unread rest of a body discarded before the connection's next request. What differs
from stock uvicorn is in `_Protocol`: connections are counted for /metrics, a request h11 cannot parse gets
OpenAI-style JSON, and a client that resets its connection is a debug line, not silence.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .. import __version__
from ..errors import UsageError
from .protocol import dumps, error_body

log = logging.getLogger("orin.serve.app")  # one logger for the server's lines, whichever module writes them


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise UsageError(f"--host {host}: cannot resolve it ({exc})") from exc
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(64)
    except OSError as exc:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; "
                         "pick another --port or stop the process using it") from exc
    return sock


class _Protocol(H11Protocol):
    """uvicorn's h11 protocol, counting connections for /metrics and speaking JSON when h11 refuses a request."""

    metrics = None  # set by Listener on a subclass of its own

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if self.metrics is not None:
            self.metrics.connection()

    def connection_lost(self, exc: Exception | None) -> None:
        # A client that resets its connection (a keep-alive pool closing, a probe timing out) is routine.
        if exc is not None:
            log.debug("%s closed the connection: %s", self.client[0] if self.client else "-", exc)
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        body = dumps(error_body(f"bad HTTP request: {msg}"))
        headers = [(b"Server", f"orin-omni/{__version__}".encode()), (b"Content-Type", b"application/json"),
                   (b"Content-Length", str(len(body)).encode()), (b"Connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


class Listener:
    """uvicorn serving `app` on `sock` in a daemon thread. `stop()` stops accepting and lets the connections
    finish their responses (idle keep-alive ones close at once); `join()` waits for that."""

    def __init__(self, app, sock: socket.socket, *, metrics, keep_alive_s: float, max_connections: int,
                 grace_s: float):
        protocol = type("Protocol", (_Protocol,), {"metrics": metrics})
        config = uvicorn.Config(
            app, http=protocol, ws="auto", lifespan="off", loop="asyncio", interface="asgi3",
            # The server logs its own lines (orin.serve.routes); uvicorn's startup chatter would repeat them.
            log_config=None, log_level="warning", access_log=False,
            # The peer's address is the client's: no proxy in front is trusted to rewrite it.
            proxy_headers=False,
            server_header=False, date_header=False,  # orin.serve.routes writes them
            timeout_keep_alive=max(1, round(keep_alive_s)),
            # With more connections open (counting the one asking), a request gets 503 at once.
            limit_concurrency=max_connections + 1,
            # After stop(), responses still running past this are cancelled (their connections closed).
            timeout_graceful_shutdown=max(1, round(grace_s)),
        )
        self.sock = sock
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="orin-http", daemon=True)

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    def start(self, timeout_s: float = 30.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self.server.started:
            raise RuntimeError("the HTTP server did not start; see the log above")

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        except BaseException:  # noqa: BLE001 - the thread's end is its report; health turns false
            log.exception("the HTTP server stopped")

    def alive(self) -> bool:
        return self._thread.is_alive() and not self.server.should_exit

    def stop(self) -> None:
        self.server.should_exit = True

    def join(self, timeout_s: float) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()
