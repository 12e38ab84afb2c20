"""Server metrics in the Prometheus text exposition format (0.0.4), written by hand: a dozen counters, gauges
and histograms do not justify prometheus_client as a dependency.

Per-request figures come from the engine's report (orin.contract.Report, the Done event's); memory gauges are
read from the engine at scrape time. Thread-safe: the generation thread and the event loop record, the scraper
renders.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..contract import Report

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
RATE_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0)
DURATION_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
INTERRUPT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def escape_label(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


def _labels(labels: Mapping[str, object]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{escape_label(v)}"' for k, v in labels.items()) + "}"


def family(name: str, kind: str, help_text: str, samples: Iterable[tuple[Mapping[str, object], float]],
           suffix: str = "") -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{suffix}{_labels(labels)} {format_value(value)}" for labels, value in samples]
    return lines


@dataclass
class Histogram:
    buckets: Sequence[float]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.count += 1

    def lines(self, name: str, help_text: str) -> list[str]:
        out = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        for bound, n in zip(self.buckets, self.counts, strict=True):
            out.append(f'{name}_bucket{{le="{format_value(bound)}"}} {n}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {format_value(self.total)}")
        out.append(f"{name}_count {self.count}")
        return out


def _num(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.connections = 0
        self.cancelled = 0
        self.rejected_queue_full = 0
        self.out_of_memory_counts = {"running": 0, "admission": 0}  # orin_out_of_memory_total{when}
        self.ttft = Histogram(TTFT_BUCKETS)
        self.first_audio = Histogram(TTFT_BUCKETS)
        self.rate = Histogram(RATE_BUCKETS)
        self.duration = Histogram(DURATION_BUCKETS)
        self.last_rate: float | None = None
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.audio_seconds = 0.0
        self.swaps: dict[tuple[str, str], list[float]] = {}  # -> [count, bytes, seconds]
        self.last_peak: float | None = None
        self.joules: dict[str, float] = {}
        self.stage_joules: dict[str, float] = {}
        self.last_power: dict[str, tuple[float | None, float | None]] = {}
        self.realtime_open = 0
        self.realtime_responses: dict[str, int] = {}
        self.interrupt = Histogram(INTERRUPT_BUCKETS)

    def request(self, endpoint: str, status: int) -> None:
        with self._lock:
            key = (endpoint, int(status))
            self.requests[key] = self.requests.get(key, 0) + 1

    def queue_full(self) -> None:
        with self._lock:
            self.rejected_queue_full += 1

    def out_of_memory(self, tried: bool) -> None:
        """One out-of-memory answer: an allocation failed while the request ran (`tried`), or admission refused
        a request as large as one that failed before (orin.serve.admission.MemoryPolicy)."""
        with self._lock:
            self.out_of_memory_counts["running" if tried else "admission"] += 1

    def connection(self) -> None:
        with self._lock:
            self.connections += 1

    def realtime_session(self, delta: int) -> None:
        with self._lock:
            self.realtime_open += delta

    def realtime_response(self, status: str, interrupt_to_stop_s: float | None = None) -> None:
        """One Realtime response's end: its status, and for an interrupted one (barge-in, response.cancel) the
        seconds from the cancel to the engine's stop."""
        with self._lock:
            self.realtime_responses[status] = self.realtime_responses.get(status, 0) + 1
            if interrupt_to_stop_s is not None:
                self.interrupt.observe(interrupt_to_stop_s)

    def generation(self, report: Report, seconds: float) -> None:
        """Record one finished (or cancelled) generation from its engine report."""
        with self._lock:
            if report.cancelled:
                self.cancelled += 1
            self.duration.observe(seconds)
            ttft = _num(report.ttft_s)
            if ttft is not None:
                self.ttft.observe(ttft)
            first_audio = _num(report.first_audio_s)
            if first_audio is not None:
                self.first_audio.observe(first_audio)
            rate = _num(report.tokens_per_s)
            if rate is not None:
                self.rate.observe(rate)
                self.last_rate = rate
            self.prompt_tokens += int(report.prompt_tokens)
            self.completion_tokens += int(report.completion_tokens)
            self.audio_seconds += _num(report.audio_seconds) or 0.0
            for swap in report.swaps:
                acc = self.swaps.setdefault((swap.component, swap.direction), [0, 0.0, 0.0])
                acc[0] += 1
                acc[1] += swap.bytes
                acc[2] += swap.seconds
            peak = _num(report.peak_bytes)
            if peak is not None:
                self.last_peak = peak
            energy = report.energy
            joules = _num(energy.joules)
            if joules is not None:
                self.joules[energy.backend] = self.joules.get(energy.backend, 0.0) + joules
                self.last_power[energy.backend] = (_num(energy.mean_w), _num(energy.peak_w))
            for stage, stage_energy in energy.by_stage.items():
                stage_j = _num(stage_energy.joules)
                if stage_j is not None:
                    self.stage_joules[stage] = self.stage_joules.get(stage, 0.0) + stage_j

    def render(self, *, model: str, ready: bool, in_flight: int, queued: int, memory: Mapping | None,
               rss_bytes: int | None) -> str:
        with self._lock:
            lines = family("orin_up", "gauge", "1 when the model is loaded and serving.",
                           [({"model": model}, 1.0 if ready else 0.0)])
            lines += family("orin_requests_total", "counter", "HTTP requests by endpoint and status.",
                            [({"endpoint": e, "status": s}, n) for (e, s), n in sorted(self.requests.items())])
            lines += family("orin_http_connections_total", "counter",
                            "TCP connections accepted (fewer than requests while clients keep them alive).",
                            [({}, self.connections)])
            lines += family("orin_requests_cancelled_total", "counter",
                            "Generations stopped early because the client went away.", [({}, self.cancelled)])
            lines += family("orin_requests_rejected_queue_full_total", "counter",
                            "Requests answered 429 because the queue was full.", [({}, self.rejected_queue_full)])
            lines += family("orin_out_of_memory_total", "counter",
                            "Requests answered 503 out_of_memory: an allocation failed while running, or refused at "
                            "admission until more memory is free.",
                            [({"when": w}, n) for w, n in self.out_of_memory_counts.items()])
            lines += family("orin_requests_in_flight", "gauge", "Generations running on the GPU (0 or 1).",
                            [({}, in_flight)])
            lines += family("orin_queue_depth", "gauge", "Requests waiting for the GPU.", [({}, queued)])
            lines += family("orin_realtime_sessions", "gauge", "Realtime API sessions open.",
                            [({}, self.realtime_open)])
            lines += family("orin_realtime_responses_total", "counter", "Realtime API responses by final status.",
                            [({"status": s}, n) for s, n in sorted(self.realtime_responses.items())])
            lines += self.interrupt.lines("orin_realtime_interrupt_seconds",
                                          "Realtime barge-in or response.cancel: from the cancel to the engine's "
                                          "stop.")
            lines += self.ttft.lines("orin_ttft_seconds", "Time to first text token.")
            lines += self.first_audio.lines("orin_first_audio_seconds", "Time to the first audio chunk.")
            lines += self.duration.lines("orin_generation_seconds", "Wall time of a generation on the GPU.")
            lines += self.rate.lines("orin_decode_tokens_per_second", "Text decode rate per request.")
            lines += family("orin_last_decode_tokens_per_second", "gauge", "Decode rate of the last request.",
                            [({}, self.last_rate)] if self.last_rate is not None else [])
            lines += family("orin_prompt_tokens_total", "counter", "Prompt tokens processed.",
                            [({}, self.prompt_tokens)])
            lines += family("orin_completion_tokens_total", "counter", "Tokens generated.",
                            [({}, self.completion_tokens)])
            lines += family("orin_audio_seconds_total", "counter", "Seconds of speech generated.",
                            [({}, self.audio_seconds)])
            swaps = sorted(self.swaps.items())
            lines += family("orin_swaps_total", "counter", "Segment swaps by component and direction.",
                            [({"component": c, "direction": d}, v[0]) for (c, d), v in swaps])
            lines += family("orin_swap_bytes_total", "counter", "Bytes moved by segment swaps.",
                            [({"component": c, "direction": d}, v[1]) for (c, d), v in swaps])
            lines += family("orin_swap_seconds_total", "counter", "Time spent in segment swaps.",
                            [({"component": c, "direction": d}, v[2]) for (c, d), v in swaps])
            mem = memory or {}
            for key, name, help_text in (
                ("resident_bytes", "orin_memory_resident_bytes", "Model weights resident on the device."),
                ("allocated_bytes", "orin_memory_allocated_bytes", "Device memory the loader accounts for."),
                ("budget", "orin_memory_budget_bytes", "The configured memory budget."),
            ):
                value = _num(mem.get(key))
                lines += family(name, "gauge", help_text, [({}, value)] if value is not None else [])
            lines += family("orin_memory_peak_bytes", "gauge", "Peak device memory of the last request.",
                            [({}, self.last_peak)] if self.last_peak is not None else [])
            lines += family("orin_process_resident_memory_bytes", "gauge", "Resident set size of the server.",
                            [({}, rss_bytes)] if rss_bytes is not None else [])
            lines += family("orin_energy_joules_total", "counter", "Board energy used by generations.",
                            [({"backend": b}, j) for b, j in sorted(self.joules.items())])
            lines += family("orin_stage_energy_joules_total", "counter", "Energy by pipeline stage.",
                            [({"stage": s}, j) for s, j in sorted(self.stage_joules.items())])
            lines += family("orin_power_watts", "gauge", "Mean board power during the last generation.",
                            [({"backend": b}, w[0]) for b, w in sorted(self.last_power.items()) if w[0] is not None])
            lines += family("orin_power_peak_watts", "gauge", "Peak board power during the last generation.",
                            [({"backend": b}, w[1]) for b, w in sorted(self.last_power.items()) if w[1] is not None])
        return "\n".join(lines) + "\n"


def process_rss_bytes(proc_root: str = "/proc") -> int | None:
    """This process's resident set size from /proc/self/statm (Linux); None elsewhere."""
    import os

    try:
        with open(f"{proc_root}/self/statm") as fh:
            pages = int(fh.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def parse_metrics(text: str) -> dict[str, float]:
    """`name{labels}` -> value for every sample line; for tests and `orin-omni smoke`."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        out[key] = float(value)
    return out
