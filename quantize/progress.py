"""Progress of the long passes (the BF16 passes over the calibration set, GPTQ layer by layer): a tqdm bar with
the time left when stderr is a terminal; otherwise (a log file, a pipe, systemd's journal) a plain line every
`every` percent, with the first and the last item, so a run of hours never goes silent. Both show the time left
as TimeLeft estimates it."""

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


class TimeLeft:
    """The time left of a bar, steady from the first estimate on. The first item of a run pays for warm-up
    (weights read cold, kernels compiled, caches filled), so the pace is measured from the moment it finishes, and
    nothing is estimated until `min_items` more are done: an estimate from one slow item would shrink step after
    step. Items done before this run (a resumed stack) are in neither count."""

    def __init__(self, initial: int, start: float, min_items: int = 2):
        self.initial, self.min_items = initial, min_items
        self._mark: tuple[int, float] | None = None  # (items done, time) when this run's first item finished
        self._start = start

    def seconds(self, done: int, total: int, now: float) -> float | None:
        """Seconds left once `done` of `total` items are done at `now`, or None while too little is known."""
        if done >= total:
            return None
        if self._mark is None:
            if done > self.initial:
                self._mark = (done, now)
            return None
        items = done - self._mark[0]
        if items < self.min_items:
            return None
        return (now - self._mark[1]) / items * (total - done)


class _TqdmBar:
    """tqdm with TimeLeft's estimate in place of its own (an average that the first, slow item skews)."""

    def __init__(self, bar, clock: Callable[[], float], initial: int):
        self._bar, self._clock = bar, clock
        self._left = TimeLeft(initial, clock())
        self._text = ""

    def update(self, n: int = 1) -> None:
        bar = self._bar
        left = self._left.seconds(bar.n + n, bar.total, self._clock())
        text = "" if left is None else f"about {_clock_text(left)} left"
        bar.update(n)
        if text != self._text:  # shown at once: tqdm redraws at most every 0.1 s by itself
            self._text = text
            bar.set_postfix_str(text)

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
        self.left = TimeLeft(initial, self.start)

    def _step(self, done: int) -> int:
        return (100 * done) // (self.every * self.total)

    def update(self, n: int = 1) -> None:
        self.done += n
        left = self.left.seconds(self.done, self.total, self.clock())  # every item, so the pace sees each one
        step = self._step(self.done)
        if step > self.printed_step or self.done >= self.total:
            self.printed_step = step
            self._print(left)

    def grow(self, n: int = 1) -> None:
        self.total += n
        self.printed_step = self._step(self.done)

    def _print(self, left: float | None) -> None:
        elapsed = self.clock() - self.start
        head = f"{self.desc}: {100 * self.done // self.total:3d}% ({self.done}/{self.total})"
        if self.done >= self.total:
            line = f"{head} in {_clock_text(elapsed)}"
        else:
            line = f"{head}, {_clock_text(elapsed)} elapsed"
            line += "" if left is None else f", about {_clock_text(left)} left"
        print(line, file=self.stream, flush=True)


# tqdm's default less its `<remaining`: the postfix carries TimeLeft's estimate instead.
_BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}, {rate_fmt}{postfix}]"


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
                  initial=initial, bar_format=_BAR_FORMAT) as bar:
            yield _TqdmBar(bar, self.clock, initial)

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
