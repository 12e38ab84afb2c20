"""Progress of the long passes (the BF16 passes over the calibration set, GPTQ layer by layer): a tqdm bar with
the time left when stderr is a terminal; otherwise (a log file, a pipe, systemd's journal) a plain line every
`every` percent, with the first and the last item, so a run of hours never goes silent."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def grow(self, n: int = 1) -> None:
        pass


class _TqdmBar:
    def __init__(self, bar):
        self._bar = bar

    def update(self, n: int = 1) -> None:
        self._bar.update(n)

    def grow(self, n: int = 1) -> None:
        self._bar.total += n
        self._bar.refresh()


def _clock_text(seconds: float) -> str:
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class _Lines:
    """A line after the first item, after each `every` percent step and after the last item."""

    def __init__(self, total: int, desc: str, stream, every: int, clock: Callable[[], float], initial: int = 0):
        self.total, self.desc, self.stream, self.every, self.clock = total, desc, stream, every, clock
        self.done = self.initial = initial  # items done before this run (a resumed stack): not in the rate
        self.printed_step = -1
        self.start = clock()

    def _step(self, done: int) -> int:
        return (100 * done) // (self.every * self.total)

    def update(self, n: int = 1) -> None:
        self.done += n
        step = self._step(self.done)
        if step > self.printed_step or self.done >= self.total:
            self.printed_step = step
            self._print()

    def grow(self, n: int = 1) -> None:
        self.total += n
        self.printed_step = self._step(self.done)

    def _print(self) -> None:
        elapsed = self.clock() - self.start
        head = f"{self.desc}: {100 * self.done // self.total:3d}% ({self.done}/{self.total})"
        if self.done >= self.total:
            line = f"{head} in {_clock_text(elapsed)}"
        else:
            left = elapsed / (self.done - self.initial) * (self.total - self.done)
            line = f"{head}, {_clock_text(elapsed)} elapsed, about {_clock_text(left)} left"
        print(line, file=self.stream, flush=True)


class Progress:
    """Bars on a terminal (enabled), plain progress lines otherwise. `enabled=None` asks the stream."""

    def __init__(self, enabled: bool | None = None, stream=None, every: int = 10,
                 clock: Callable[[], float] = time.monotonic):
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = bool(isatty and isatty()) if enabled is None else enabled
        self.every = every
        self.clock = clock

    @contextlib.contextmanager
    def bar(self, total: int, desc: str, leave: bool = True, unit: str = "it", initial: int = 0) -> Iterator:
        """An object with update(n) (n more items done) and grow(n) (n more items to do). Without a terminal,
        a bar that does not stay (leave=False: the inner per-layer bars) prints nothing. `initial`: items done
        already (a resumed run); the time left is estimated from this run's pace only."""
        if total <= 0 or initial >= total or (not self.enabled and not leave):
            yield _NoBar()
            return
        if not self.enabled:
            yield _Lines(total, desc, self.stream, self.every, self.clock, initial)
            return
        from tqdm import tqdm

        with tqdm(total=total, desc=desc, leave=leave, file=self.stream, dynamic_ncols=True, unit=unit,
                  initial=initial) as bar:
            yield _TqdmBar(bar)

    def track(self, items, total: int | None = None, desc: str = "", unit: str = "it") -> Iterator:
        """Yield each of `items`, counting it done when the next one is asked for."""
        with self.bar(len(items) if total is None else total, desc, unit=unit) as bar:
            for item in items:
                yield item
                bar.update(1)

    def log(self, message: str) -> None:
        if self.enabled:
            from tqdm import tqdm

            tqdm.write(message, file=self.stream)
        else:
            print(message, file=self.stream, flush=True)
