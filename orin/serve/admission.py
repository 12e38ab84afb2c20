"""One generation at a time on the GPU, a bounded first-come-first-served queue in front of it.

A request that finds `max_queue` others already waiting is refused at once (HTTP 429) rather than piling up
behind a GPU that serves one at a time. A waiting request leaves the queue when its client disconnects
(its cancel event is set) or when the server stops.

After an out-of-memory answer, MemoryPolicy keeps a request as large from running again until it can fit.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..errors import OutOfMemoryError
from ..memory.oom import MemoryReading, refused

# Where the failed allocation's size is unknown, how much more must be free than when it failed.
MIN_GROWTH = 64 << 20


class QueueFull(Exception):
    """max_queue requests are already waiting."""


class Closed(Exception):
    """The server is stopping; no new work starts."""


class Abandoned(Exception):
    """The client went away while waiting."""


class Gate:
    def __init__(self, max_queue: int, poll_s: float = 0.05):
        if max_queue < 0:
            raise ValueError("max_queue must be >= 0")
        self.max_queue = max_queue
        self._poll_s = poll_s
        self._cond = threading.Condition()
        self._waiting: deque[int] = deque()
        self._tickets = itertools.count()
        self._busy = False
        self._spare = False  # the GPU is held for spare work, which stops for the first request that queues
        self._closed = False

    @property
    def queued(self) -> int:
        with self._cond:
            return len(self._waiting)

    @property
    def busy(self) -> bool:
        """A request holds the GPU (spare work does not count: it gives way within one step)."""
        with self._cond:
            return self._busy and not self._spare

    def close(self) -> None:
        """Refuse new entries and wake the waiting ones, which raise Closed. The running one finishes."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _leave_queue(self, ticket: int) -> None:
        self._waiting.remove(ticket)
        self._cond.notify_all()

    def spare(self, work: Callable[[Callable[[], bool]], object]) -> None:
        """Run `work(stop)` on the GPU when it is free and nobody waits (else not at all); `stop()` turns true
        once a request queues or the server stops, and `work` must then return at its next step. The request
        waits for that step, not for the whole work."""
        with self._cond:
            if self._busy or self._waiting or self._closed:
                return
            self._busy = self._spare = True
        try:
            work(lambda: bool(self._waiting) or self._closed)
        finally:
            with self._cond:
                self._busy = self._spare = False
                self._cond.notify_all()

    def wait_spare(self) -> None:
        """Until spare work (stopped by close()) has returned."""
        with self._cond:
            while self._spare:
                self._cond.wait(self._poll_s)

    @contextmanager
    def turn(self, cancel: threading.Event | None = None) -> Iterator[None]:
        """Hold the GPU for the body of the with-block."""
        with self._cond:
            if self._closed:
                raise Closed()
            if (self._busy and not self._spare) or self._waiting:  # spare work gives way: no queue slot
                if len(self._waiting) >= self.max_queue:
                    raise QueueFull()
            ticket = next(self._tickets)
            self._waiting.append(ticket)
            while True:
                if self._closed:
                    self._leave_queue(ticket)
                    raise Closed()
                if cancel is not None and cancel.is_set():
                    self._leave_queue(ticket)
                    raise Abandoned()
                if not self._busy and self._waiting[0] == ticket:
                    break
                # Polled, because a client's disconnect sets a plain Event that cannot wake this condition.
                self._cond.wait(self._poll_s)
            self._waiting.popleft()
            self._busy = True
        try:
            yield
        finally:
            with self._cond:
                self._busy = False
                self._cond.notify_all()


class MemoryPolicy:
    """Out of memory is answered, then remembered. After a request planned at A bytes (OutOfMemoryError.asked)
    ran out of memory with F bytes free (read once its memory was given back), a request
    planned at A or more is refused at once, without running (503 out_of_memory), until the board reports at least
    A free and more than F: F plus the allocation that failed (MIN_GROWTH where its size is unknown). Sooner it
    would only fail again, after its prefill. Smaller requests run. The retry that is let through clears the
    record; if it fails too, its failure is the new one. Where nothing free can be read, requests run.

    `read`: what the board has free now (the engine's free_memory; tests give fake readings); `clock`: seconds."""

    def __init__(self, read: Callable[[], MemoryReading], clock: Callable[[], float] = time.monotonic):
        self._read = read
        self._clock = clock
        self._lock = threading.Lock()
        self._failed: tuple[int, int | None, int, float] | None = None  # asked, free then, free needed, when

    @property
    def remembered(self) -> int | None:
        """The planned bytes of the failure remembered, or None."""
        failed = self._failed
        return failed[0] if failed is not None else None

    def failed(self, err: OutOfMemoryError) -> None:
        """A request ran out of memory (a refusal by `admit` changes nothing: nothing ran)."""
        if not err.tried or err.asked is None:
            return
        free = err.memory.free if err.memory is not None else None
        needed = err.asked if free is None else max(err.asked, free + (err.allocation or MIN_GROWTH))
        with self._lock:
            self._failed = (err.asked, free, needed, self._clock())

    def admit(self, asked: int) -> None:
        """Let a request planned at `asked` bytes run, or raise the OutOfMemoryError that refuses it."""
        with self._lock:
            failed = self._failed
        if failed is None or asked < failed[0]:
            return
        memory = self._read()
        if memory.free is None or memory.free >= failed[2]:
            with self._lock:
                if self._failed is failed:
                    self._failed = None
            return
        raise refused(asked, failed[0], failed[1], self._clock() - failed[3], memory)
