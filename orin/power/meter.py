"""Board power sampling and per-request / per-stage energy.

A sampler thread reads one backend (orin.power.backends) at `hz` (default 10 Hz). `auto` picks the first that
opens of jtop, ina3221, nvml, none. A backend that fails while running is closed and the next one in the chain
takes over, so a flaky sensor never stops inference. Energy comes from orin.power.energy.

Deliberately free of torch: the server imports this before any model is loaded.
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from ..errors import PowerError, UsageError
from .backends import (
    JTOP_SOCKET,
    Ina3221Backend,
    JtopBackend,
    NullBackend,
    NvmlBackend,
    PowerBackend,
    PowerReading,
    PowerSample,
    find_ina3221_rails,
)
from .energy import Energy, EnergyReport, combine, integrate, render_report

__all__ = [
    "BACKENDS", "Energy", "EnergyReport", "Ina3221Backend", "JtopBackend", "Measurement", "NullBackend",
    "NvmlBackend", "PowerBackend", "PowerConfig", "PowerError", "PowerMeter", "PowerProbeConfig", "PowerReading",
    "PowerSample", "Stage", "backend_chain", "combine", "find_ina3221_rails", "integrate", "make_backend",
    "open_backend", "probe_power", "render_report",
]

log = logging.getLogger(__name__)

BACKENDS = ("auto", "jtop", "ina3221", "nvml", "none")
_AUTO_ORDER = ("jtop", "ina3221", "nvml", "none")

Clock = Callable[[], float]


@dataclass(frozen=True)
class PowerConfig:
    backend: str = "auto"
    hz: float = 10.0
    sysfs_root: str = "/sys"
    jtop_socket: str = JTOP_SOCKET
    nvml_index: int = 0

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise UsageError(f"unknown power backend {self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if not (isinstance(self.hz, (int, float)) and 0 < self.hz <= 1000):
            raise UsageError(f"power sampling rate {self.hz!r} Hz is out of range; use a value in (0, 1000]")


def make_backend(name: str, cfg: PowerConfig | None = None) -> PowerBackend:
    cfg = cfg or PowerConfig()
    if name == "jtop":
        return JtopBackend(socket=cfg.jtop_socket, interval=max(0.1, 1.0 / cfg.hz))
    if name == "ina3221":
        return Ina3221Backend(cfg.sysfs_root)
    if name == "nvml":
        return NvmlBackend(cfg.nvml_index)
    if name == "none":
        return NullBackend()
    raise UsageError(f"unknown power backend {name!r}; choose one of {', '.join(BACKENDS)}")


def backend_chain(cfg: PowerConfig | None = None) -> list[PowerBackend]:
    """Unopened backends in fallback order. An explicit choice is followed by the auto order after it, so a
    jtop service that dies mid-run hands over to the same rails read from sysfs."""
    cfg = cfg or PowerConfig()
    start = 0 if cfg.backend == "auto" else _AUTO_ORDER.index(cfg.backend)
    return [make_backend(name, cfg) for name in _AUTO_ORDER[start:]]


def _open_first(chain: Sequence[PowerBackend], strict: bool) -> tuple[PowerBackend, int]:
    """Open the first backend that works; with `strict`, the first one must."""
    for i, backend in enumerate(chain):
        try:
            backend.open()
        except Exception as exc:  # a third-party library may fail in its own way; the chain goes on
            if strict and i == 0:
                if isinstance(exc, PowerError):
                    raise
                raise PowerError(f"power backend {backend.name} failed to open: {exc}") from exc
            log.info("power backend %s unavailable: %s", backend.name, exc)
            continue
        return backend, i
    null = NullBackend()
    null.open()
    return null, len(chain)


def open_backend(preference: str = "auto", sysfs_root: str | os.PathLike = "/sys", *,
                 jtop_socket: str = JTOP_SOCKET, nvml_index: int = 0) -> PowerBackend:
    """An opened backend. `auto` tries jtop, ina3221, nvml and ends at none; an explicit name that cannot be
    opened raises PowerError saying what to do."""
    cfg = PowerConfig(backend=preference, sysfs_root=str(sysfs_root), jtop_socket=jtop_socket, nvml_index=nvml_index)
    if preference == "auto":
        return _open_first(backend_chain(cfg), strict=False)[0]
    return _open_first([make_backend(preference, cfg)], strict=True)[0]


@dataclass
class _Window:
    name: str
    start: float
    is_stage: bool
    end: float | None = None


class Stage:
    """Handle of one `meter.stage(...)` block; `energy` is set when the block ends."""

    def __init__(self, window: _Window):
        self._window = window
        self.energy: Energy | None = None

    @property
    def name(self) -> str:
        return self._window.name


class Measurement:
    """Handle of one `meter.measure(...)` block; `report` is set when the block ends."""

    def __init__(self, window: _Window):
        self._window = window
        self.report: EnergyReport | None = None

    @property
    def name(self) -> str:
        return self._window.name


class PowerMeter:
    """Samples a chain of backends on a thread and integrates energy over measured windows.

    The first backend of `chain` that opens is used (with `strict`, the first must open or PowerError is raised).
    After `max_failures` reads in a row fail, the backend is closed and the next one in the chain is opened;
    the chain always ends at `none`, and nothing here ever raises into the caller's inference. Samples are
    kept only as far back as the oldest open window (and at most `max_samples`), so a long-running server
    holds a bounded history. Each window also reads the backend at its start and end, so windows shorter than
    the sampling period are measured rather than guessed.
    """

    def __init__(self, chain: Sequence[PowerBackend] | None = None, *, hz: float = 10.0, strict: bool = False,
                 clock: Clock = time.monotonic, max_failures: int = 3, max_samples: int = 36_000):
        if not 0 < hz <= 1000:
            raise UsageError(f"power sampling rate {hz!r} Hz is out of range; use a value in (0, 1000]")
        self.hz = float(hz)
        self._chain = list(chain) if chain is not None else backend_chain()
        self._strict = strict
        self._clock = clock
        self._max_failures = max(1, int(max_failures))
        self._max_samples = max(2, int(max_samples))
        self._lock = threading.RLock()
        self._backend: PowerBackend | None = None
        self._next = 0
        self._failures = 0
        self._samples: list[PowerSample] = []
        self._switches: list[tuple[float, str]] = []
        self._events: list[str] = []
        self._open_windows: list[_Window] = []
        self._closed_stages: list[_Window] = []
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @classmethod
    def from_config(cls, cfg: PowerConfig, *, clock: Clock = time.monotonic) -> PowerMeter:
        return cls(backend_chain(cfg), hz=cfg.hz, strict=cfg.backend != "auto", clock=clock)

    # -- lifecycle

    def open(self) -> PowerMeter:
        """Open the first working backend without starting the thread (tests drive `sample_now` by hand)."""
        with self._lock:
            if self._backend is None:
                backend, i = _open_first(self._chain, self._strict)
                self._backend, self._next = backend, i + 1
                self._switches.append((self._clock(), backend.name))
                log.info("power backend: %s", backend.name)
        return self

    def start(self) -> PowerMeter:
        self.open()
        if self._thread is None and self.measuring:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="orin-power", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            if self._backend is not None:
                self._close_backend(self._backend)
                self._backend = None

    def __enter__(self) -> PowerMeter:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- state

    @property
    def backend(self) -> str:
        with self._lock:
            return self._backend.name if self._backend is not None else "none"

    @property
    def measuring(self) -> bool:
        with self._lock:
            return self._backend is not None and not isinstance(self._backend, NullBackend)

    @property
    def backends_used(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(name for _, name in self._switches)

    @property
    def events(self) -> tuple[str, ...]:
        """Human-readable record of every backend switch after a failure."""
        with self._lock:
            return tuple(self._events)

    def samples(self) -> list[PowerSample]:
        with self._lock:
            return list(self._samples)

    def latest(self) -> PowerSample | None:
        with self._lock:
            return self._samples[-1] if self._samples else None

    # -- sampling

    def _run(self) -> None:
        period = 1.0 / self.hz
        next_tick = time.monotonic() + period
        while self.measuring:
            if self._stop.wait(max(0.0, next_tick - time.monotonic())):
                return
            try:
                self.sample_now()
            except Exception:  # the sampler must outlive any bug rather than silently stop measuring
                log.exception("power sampler tick failed")
            next_tick += period
            now = time.monotonic()
            if next_tick < now:
                # Ticks missed while the machine was busy are skipped, not replayed in a burst.
                next_tick = now + period

    def sample_now(self) -> PowerSample | None:
        """Read the current backend once; on repeated failure degrade down the chain. Never raises for a
        backend problem: returns None when there was nothing to read (or the meter is not open)."""
        with self._lock:
            while self._backend is not None and not isinstance(self._backend, NullBackend):
                backend = self._backend
                before = self._clock()
                try:
                    reading = backend.read()
                except Exception as exc:  # any backend error: inference goes on, power degrades
                    self._failures += 1
                    if self._failures < self._max_failures:
                        log.debug("power backend %s read failed (%d): %s", backend.name, self._failures, exc)
                        return None
                    self._degrade(exc)
                    continue
                self._failures = 0
                # Stamp the middle of the read: the value was taken somewhere inside it.
                sample = PowerSample(t=(before + self._clock()) / 2, backend=backend.name, rails=dict(reading.rails),
                                     total_w=float(reading.total_w), energy_j=reading.energy_j,
                                     rail_energy_j=dict(reading.rail_energy_j))
                self._samples.append(sample)
                if len(self._samples) > self._max_samples:
                    del self._samples[: len(self._samples) - self._max_samples]
                return sample
            return None

    def _degrade(self, exc: BaseException) -> None:
        failed = self._backend
        self._close_backend(failed)
        self._failures = 0
        nxt, i = _open_first(self._chain[self._next:], strict=False)
        self._backend, self._next = nxt, self._next + i + 1
        self._switches.append((self._clock(), nxt.name))
        message = f"power backend {failed.name} failed ({exc}); switched to {nxt.name}"
        self._events.append(message)
        log.warning(message)

    @staticmethod
    def _close_backend(backend: PowerBackend) -> None:
        try:
            backend.close()
        except Exception as exc:  # a broken backend may fail to close too; that must not matter
            log.warning("closing power backend %s failed: %s", backend.name, exc)

    # -- windows

    def _open_window(self, name: str, is_stage: bool, read: bool = True) -> _Window:
        sample = self.sample_now() if read else None
        with self._lock:
            window = _Window(name=name, start=sample.t if sample else self._clock(), is_stage=is_stage)
            self._open_windows.append(window)
            return window

    def _close_window(self, window: _Window, read: bool = True) -> tuple[list[PowerSample], list[_Window],
                                                                          tuple[str, ...]]:
        """End a window: its samples, the closed stages that overlap it, and the backends that were active."""
        sample = self.sample_now() if read else None
        with self._lock:
            window.end = max(window.start, sample.t if sample else self._clock())
            self._open_windows.remove(window)
            if window.is_stage:
                # A stage needs only the samples around it (one either side, for interpolation): per-token
                # stages would otherwise copy and integrate the whole request's history each time.
                times = [x.t for x in self._samples]
                lo = max(0, bisect.bisect_left(times, window.start) - 1)
                hi = bisect.bisect_right(times, window.end) + 1
                snapshot = self._samples[lo:hi]
            else:
                snapshot = list(self._samples)
            stages = [] if window.is_stage else [
                s for s in self._closed_stages if s.start < window.end and s.end > window.start]
            backends = self._backends_during(window.start, window.end)
            if window.is_stage and any(not w.is_stage for w in self._open_windows):
                self._closed_stages.append(window)
            self._prune()
            return snapshot, stages, backends

    def _backends_during(self, start: float, end: float) -> tuple[str, ...]:
        names: list[str] = []
        for i, (t, name) in enumerate(self._switches):
            later = self._switches[i + 1][0] if i + 1 < len(self._switches) else math.inf
            if t <= end and later >= start and name not in names:
                names.append(name)
        return tuple(names) or ("none",)

    def _prune(self) -> None:
        """Keep samples back to the oldest open window (plus one before it, for interpolation) and the
        closed stages that an open measurement may still claim."""
        if self._open_windows:
            horizon = min(w.start for w in self._open_windows)
        else:
            horizon = self._samples[-1].t if self._samples else -math.inf
        keep = 0
        while keep + 1 < len(self._samples) and self._samples[keep + 1].t <= horizon:
            keep += 1
        if keep:
            del self._samples[:keep]
        measuring_from = [w.start for w in self._open_windows if not w.is_stage]
        if not measuring_from:
            self._closed_stages.clear()
        else:
            oldest = min(measuring_from)
            self._closed_stages = [s for s in self._closed_stages if s.end > oldest]

    @contextmanager
    def stage(self, name: str, edge_reads: bool = True) -> Iterator[Stage]:
        """Mark a pipeline stage (e.g. "thinker_prefill"). Its energy lands in the `by_stage` of every request
        measured around it, and on the handle's `energy`. With `edge_reads=False` the backend is not read at
        the stage's edges (a read costs ~1 ms on NVML): for stages entered once per token, whose energy the
        request's report interpolates from the sampler's readings; the handle's own energy then covers only
        what was already sampled."""
        window = self._open_window(name, is_stage=True, read=edge_reads)
        handle = Stage(window)
        try:
            yield handle
        finally:
            samples, _, _ = self._close_window(window, read=edge_reads)
            handle.energy = integrate(samples, window.start, window.end)[0]

    @contextmanager
    def measure(self, name: str = "request") -> Iterator[Measurement]:
        """Measure one request; the handle's `report` (an EnergyReport) is set when the block ends."""
        window = self._open_window(name, is_stage=False)
        handle = Measurement(window)
        try:
            yield handle
        finally:
            samples, stages, backends = self._close_window(window)
            handle.report = _report(window, samples, stages, backends)


def _report(window: _Window, samples: list[PowerSample], stages: list[_Window],
            backends: tuple[str, ...]) -> EnergyReport:
    start, end = window.start, window.end
    total, rails = integrate(samples, start, end)
    grouped: dict[str, list[Energy]] = {}
    for s in sorted(stages, key=lambda w: w.start):
        grouped.setdefault(s.name, []).append(integrate(samples, max(s.start, start), min(s.end, end))[0])
    by_stage = {name: parts[0] if len(parts) == 1 else combine(parts) for name, parts in grouped.items()}
    # The backend reading at the window's end names the report; all of them are listed in `backends`.
    return EnergyReport(name=window.name, backend=backends[-1], backends=backends, total=total, rails=rails,
                        by_stage=by_stage)


@dataclass(frozen=True)
class PowerProbeConfig:
    """`orin-omni power`: sample the board for `seconds` and report each rail."""

    backend: str = "auto"
    hz: float = 10.0
    seconds: float = 2.0
    sysfs_root: str = "/sys"
    jtop_socket: str = JTOP_SOCKET

    def __post_init__(self):
        if not (isinstance(self.seconds, (int, float)) and 0 < self.seconds <= 3600):
            raise UsageError(f"--seconds {self.seconds!r} is out of range; use a value in (0, 3600]")
        PowerConfig(backend=self.backend, hz=self.hz)  # validates backend and rate with the same messages

    @property
    def power(self) -> PowerConfig:
        return PowerConfig(backend=self.backend, hz=self.hz, sysfs_root=self.sysfs_root, jtop_socket=self.jtop_socket)


def probe_power(cfg: PowerProbeConfig, *, sleep: Callable[[float], None] = time.sleep) -> EnergyReport:
    """Sample for cfg.seconds and return the energy report. An explicit backend that cannot open raises
    PowerError; `auto` with nothing available returns an unavailable report."""
    with PowerMeter.from_config(cfg.power) as meter:
        with meter.measure("probe") as m:
            sleep(cfg.seconds)
    return m.report
