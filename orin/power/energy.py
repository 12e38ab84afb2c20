"""Energy from power samples: trapezoid integration over a window, per rail and per pipeline stage, into the
report a request carries (orin.contract's Energy and EnergyReport). Pure functions over `PowerSample`s; the
sampling itself is orin.power.meter.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..contract import Energy, EnergyReport
from .backends import PowerSample

__all__ = ["Energy", "EnergyReport", "combine", "integrate", "render_report"]  # the types are orin.contract's


def _unmeasured(seconds: float, count: int = 1) -> Energy:
    return Energy(joules=None, mean_w=None, peak_w=None, seconds=seconds, count=count)


def combine(parts: Sequence[Energy]) -> Energy:
    """Several windows of one stage: energy and time add, the peak is the largest."""
    seconds = sum(p.seconds for p in parts)
    measured = [p for p in parts if p.available]
    if not measured:
        return _unmeasured(seconds, count=len(parts))
    joules = sum(p.joules for p in measured)
    covered = sum(p.covered_seconds for p in measured)
    peaks = [p.peak_w for p in measured if p.peak_w is not None]
    means = [p.mean_w for p in measured if p.mean_w is not None]
    mean = joules / covered if covered > 0 else (max(means) if means else None)
    return Energy(joules=joules, mean_w=mean, peak_w=max(peaks) if peaks else None, seconds=seconds,
                  covered_seconds=covered, samples=sum(p.samples for p in measured), count=len(parts))


class _Series:
    """Accumulates one quantity (the total or a rail) over clipped sample segments."""

    __slots__ = ("joules", "covered", "peak", "point")

    def __init__(self):
        self.joules = 0.0
        self.covered = 0.0
        self.peak: float | None = None
        self.point: float | None = None

    def add(self, joules: float, p0: float, p1: float, *, dt: float) -> None:
        self.joules += joules
        self.covered += dt
        self.peak = max(p0, p1) if self.peak is None else max(self.peak, p0, p1)

    def energy(self, seconds: float, samples: int) -> Energy:
        if self.covered > 0:
            return Energy(joules=self.joules, mean_w=self.joules / self.covered, peak_w=self.peak, seconds=seconds,
                          covered_seconds=self.covered, samples=samples)
        if self.point is not None and seconds == 0:
            # A zero-length window inside the readings: no energy, but the power at that instant is known.
            return Energy(joules=0.0, mean_w=self.point, peak_w=self.point, seconds=0.0, samples=samples)
        return _unmeasured(seconds)


def _lerp(t0: float, v0: float, t1: float, v1: float, t: float) -> float:
    return v0 + (v1 - v0) * (t - t0) / (t1 - t0)


def _segment(a: PowerSample, b: PowerSample, x0: float, x1: float, w0: float, w1: float,
             c0: float | None, c1: float | None) -> tuple[float, float, float]:
    """Energy and the clipped end powers of one quantity between samples a and b, over [x0, x1] inside them.
    Linear power gives the trapezoid; a counter present at both ends (same backend, not reset) gives its share
    of the counted energy instead."""
    p0, p1 = _lerp(a.t, w0, b.t, w1, x0), _lerp(a.t, w0, b.t, w1, x1)
    if c0 is not None and c1 is not None and a.backend == b.backend and c1 >= c0:
        return (c1 - c0) * (x1 - x0) / (b.t - a.t), p0, p1
    return (p0 + p1) / 2 * (x1 - x0), p0, p1


def integrate(samples: Sequence[PowerSample], start: float, end: float) -> tuple[Energy, dict[str, Energy]]:
    """Trapezoid integral of the total and of each rail over [start, end], samples sorted by time. Power
    between samples is linear, so a window shorter than the sampling period still gets the interpolated power
    at its bounds. Where two consecutive samples of one backend carry an energy counter (total or rail), the
    counter's difference replaces the trapezoid; peaks always come from the readings. Outside the first..last
    sample nothing is known."""
    if end < start:
        raise ValueError(f"window ends before it starts ({start} > {end})")
    seconds = end - start
    total = _Series()
    rails: dict[str, _Series] = {}
    n = len(samples)
    if n == 0 or start > samples[-1].t or end < samples[0].t:
        return _unmeasured(seconds), {}
    lo, hi = max(start, samples[0].t), min(end, samples[-1].t)
    inside = sum(1 for s in samples if lo <= s.t <= hi)
    if n == 1 or lo == hi:
        # The window meets the readings at one instant.
        for i, s in enumerate(samples):
            if s.t == lo:
                total.point = s.total_w
                for rail, w in s.rails.items():
                    rails.setdefault(rail, _Series()).point = w
                break
            if i + 1 < n and s.t < lo < samples[i + 1].t:
                b = samples[i + 1]
                total.point = _lerp(s.t, s.total_w, b.t, b.total_w, lo)
                for rail in s.rails.keys() & b.rails.keys():
                    rails.setdefault(rail, _Series()).point = _lerp(s.t, s.rails[rail], b.t, b.rails[rail], lo)
                break
    else:
        for a, b in zip(samples, samples[1:], strict=False):
            if b.t <= lo or a.t >= hi or b.t <= a.t:
                continue
            x0, x1 = max(a.t, lo), min(b.t, hi)
            total.add(*_segment(a, b, x0, x1, a.total_w, b.total_w, a.energy_j, b.energy_j), dt=x1 - x0)
            for rail in a.rails.keys() & b.rails.keys():
                rails.setdefault(rail, _Series()).add(
                    *_segment(a, b, x0, x1, a.rails[rail], b.rails[rail], a.rail_energy_j.get(rail),
                              b.rail_energy_j.get(rail)), dt=x1 - x0)
    rail_energy = {name: series.energy(seconds, inside) for name, series in sorted(rails.items())}
    return total.energy(seconds, inside), {k: v for k, v in rail_energy.items() if v.available}


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render_report(report: EnergyReport) -> str:
    """A table of mean/peak watts and joules per rail and for the board total."""
    backends = " -> ".join(report.backends)
    lines = [f"power backend: {backends} ({report.total.samples} samples over {report.seconds:.2f} s)"]
    if not report.available:
        lines.append("no power readings: on a Jetson run `sudo systemctl start jtop` (or use --backend ina3221); "
                     "on a discrete GPU install nvidia-ml-py")
        return "\n".join(lines)
    width = max([len("rail"), len("total")] + [len(name) for name in report.rails])
    lines.append(f"{'rail':<{width}}  {'mean W':>9}  {'peak W':>9}  {'energy J':>10}")
    for name, e in report.rails.items():
        lines.append(f"{name:<{width}}  {_fmt(e.mean_w):>9}  {_fmt(e.peak_w):>9}  {_fmt(e.joules):>10}")
    t = report.total
    lines.append(f"{'total':<{width}}  {_fmt(t.mean_w):>9}  {_fmt(t.peak_w):>9}  {_fmt(t.joules):>10}")
    if report.note:
        lines.append(f"note: {report.note}")
    return "\n".join(lines)
