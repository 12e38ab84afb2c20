"""The GPU's single lane: the engine runs one request at a time, in a thread of its own, and its events cross to
the event loop through a queue.

The engine is synchronous and holds the GPU for the whole request, so each admitted request gets a worker thread
that waits its turn in orin.serve.admission's bounded FIFO (full -> QueueFull at once), then iterates the
engine's stream. The event loop never blocks on the GPU: it awaits the thread's events (`Run.get`). A client that
goes away sets the request's cancel event from the loop; the engine checks it at every step, and the queue
checks it while waiting.

Kept here, on the thread side, so they hold whatever the HTTP side does: the watchdog's progress mark, the count
of internal errors in a row, the cancel events of running requests (shutdown cancels them after the drain), the
generation metrics, recorded before the GPU is released, and what the last out-of-memory answer leaves for the next
request (orin.serve.admission.MemoryPolicy: the engine asks it before running a request).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from ..contract import Done, GenerationRequest
from ..errors import OrinError, OutOfMemoryError
from .admission import Gate, MemoryPolicy, QueueFull
from .metrics import Metrics
from .protocol import to_api_error

# A test hook, called on the worker thread with ("admitted", None, cancel) once the request holds the GPU and
# ("event", event, cancel) for each engine event, so a test can hold a request at a known point.
Hook = Callable[[str, object, threading.Event], None]

log = logging.getLogger("orin.serve.app")  # one logger for the server's lines, whichever module writes them

_END = object()  # the thread is done; after a Done event it is never read


class Run:
    """One request's events, from the worker thread to the event loop that awaits them. Exceptions raised on the
    thread (QueueFull, Closed, Abandoned, engine errors) arrive in order and are raised by `get`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, cancel: threading.Event):
        self.cancel = cancel
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: object) -> None:
        """Called on the worker thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:
            # The event loop has closed (the server stopped): nobody reads this request any more.
            self.cancel.set()

    async def get(self) -> object:
        item = await self._queue.get()
        if item is _END:
            raise OrinError("the engine ended without a report")
        if isinstance(item, BaseException):
            raise item
        return item


class Worker:
    def __init__(self, max_queue: int, metrics: Metrics, hook: Hook | None = None):
        self.gate = Gate(max_queue)
        self.metrics = metrics
        self.hook = hook
        self.engine = None
        self.memory = MemoryPolicy(lambda: self.engine.free_memory())
        self.progress = time.monotonic()  # the last time the running request moved (watchdog)
        self.failures = 0  # internal errors in a row
        self._active: set[threading.Event] = set()
        self._lock = threading.Lock()

    def submit(self, req: GenerationRequest, cancel: threading.Event) -> Run:
        """Queue `req` for the GPU; call on the event loop. The thread runs until the engine stops, whatever
        the caller does meanwhile: set `cancel` to stop it early."""
        run = Run(asyncio.get_running_loop(), cancel)
        threading.Thread(target=self._run, args=(req, run), name="orin-generate", daemon=True).start()
        return run

    def expect_conversation(self, rows: tuple[int, int], answer: int) -> None:
        """A conversation of a first prompt of `rows` (least, most) and answers up to `answer` tokens is starting
        (Engine.expect_conversation); its captures run now if the GPU is idle, else after the request running."""
        if self.engine is not None:
            self.engine.expect_conversation(rows, answer)
            threading.Thread(target=self.spare, name="orin-spare", daemon=True).start()

    def cancel_all(self) -> None:
        with self._lock:
            for event in self._active:
                event.set()

    def stalled_for(self) -> float:
        """Seconds the running request has gone without an engine event; 0 when the GPU is idle."""
        return time.monotonic() - self.progress if self.gate.busy else 0.0

    def _run(self, req: GenerationRequest, run: Run) -> None:
        try:
            with self.gate.turn(run.cancel):
                self._generate(req, run)
        except QueueFull as exc:
            self.metrics.queue_full()
            run.put(exc)
        except Exception as exc:  # noqa: BLE001 - handed to the event loop, which answers the client with it
            run.put(exc)
        finally:
            run.put(_END)
        self.spare()

    def spare(self) -> None:
        """While the GPU is idle and nobody waits: the engine's deferred CUDA-graph captures (a prompt bucket or
        an encoder shape a request ran eagerly), so that later requests replay them and none waits for one."""
        def capture(stop) -> None:
            try:
                made = self.engine.capture_deferred(stop)
            except Exception:  # noqa: BLE001 - a failed capture leaves that shape eager; serving goes on
                log.warning("a deferred CUDA-graph capture failed; that shape stays eager", exc_info=True)
                return
            if made:
                log.debug("captured %d deferred CUDA graph(s) while idle", made)
        if self.engine is not None:
            self.gate.spare(capture)

    def _generate(self, req: GenerationRequest, run: Run) -> None:
        cancel = run.cancel
        self.progress = time.monotonic()
        with self._lock:
            self._active.add(cancel)
        start = time.perf_counter()
        try:
            if self.hook is not None:
                self.hook("admitted", None, cancel)
            events = self.engine.stream(req, cancel, admit=self.memory.admit)
            try:
                for event in events:
                    self.progress = time.monotonic()
                    if self.hook is not None:
                        self.hook("event", event, cancel)
                    if isinstance(event, Done):
                        # Recorded before the client hears of it, and before the GPU is released.
                        self.metrics.generation(event.report, time.perf_counter() - start)
                    run.put(event)
            finally:
                events.close()
            self.failures = 0
        except OutOfMemoryError as exc:  # an answer, not a failure of the server: the watchdog does not count it
            self.memory.failed(exc)
            self.metrics.out_of_memory(exc.tried)
            raise
        except Exception as exc:
            if to_api_error(exc).status >= 500:
                self.failures += 1
            raise
        finally:
            with self._lock:
                self._active.discard(cancel)
