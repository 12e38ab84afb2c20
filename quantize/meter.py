"""Where a quantize run's time and memory go: wall time per stage and the peaks of GPU memory and host RSS, for
`orin-omni quantize --json` and BENCHMARKS.md.

Stages are exclusive, like a profiler's self time: entering one pauses the one around it, so the stages' seconds
add up to the run's. At each switch the GPU's peak (torch.cuda.max_memory_allocated, then reset) and the host's
(VmHWM from /proc/self/status, then reset through /proc/self/clear_refs) are read and charged to the stage that
was running, so every stage has the peak of its own intervals. On CUDA each switch synchronises first, or the
time of queued kernels would be charged to whichever stage waits for them.
"""

from __future__ import annotations

import contextlib
import re
import resource
import time
from collections.abc import Iterator
from pathlib import Path

STAGES = ("load", "calibration_forward", "hessians", "solves", "metrics", "writing", "other")

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def host_rss_peak() -> int:
    """The process's peak resident set since the last reset, in bytes (getrusage's lifetime peak where /proc
    cannot say)."""
    try:
        match = re.search(r"VmHWM:\s+(\d+)\s+kB", _STATUS.read_text())
    except OSError:
        match = None
    if match:
        return int(match.group(1)) << 10
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10


def host_rss_now() -> int:
    try:
        match = re.search(r"VmRSS:\s+(\d+)\s+kB", _STATUS.read_text())
    except OSError:
        match = None
    return int(match.group(1)) << 10 if match else host_rss_peak()


def _reset_host_peak() -> bool:
    try:
        _CLEAR_REFS.write_text("5")  # "5": reset the peak RSS to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


class RunMeter:
    """Exclusive stage timers with per-stage memory peaks (see the module docstring)."""

    def __init__(self, device=None, clock=time.perf_counter):
        import torch

        self.cuda = device is not None and torch.device(device).type == "cuda"
        self.device = torch.device(device) if self.cuda else None
        self.clock = clock
        self.seconds: dict[str, float] = {}
        self.peak_gpu: dict[str, int] = {}
        self.peak_rss: dict[str, int] = {}
        self.counts: dict[str, int] = {}
        self._stack: list[str] = ["other"]
        self._resettable = _reset_host_peak()
        self._start = self._mark = clock()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def _switch(self) -> None:
        """Charge the interval since the last switch to the running stage."""
        import torch

        if self.cuda:
            torch.cuda.synchronize(self.device)
        now = self.clock()
        stage = self._stack[-1]
        self.seconds[stage] = self.seconds.get(stage, 0.0) + now - self._mark
        self._mark = now
        rss = host_rss_peak()
        self.peak_rss[stage] = max(self.peak_rss.get(stage, 0), rss)
        if self._resettable:
            _reset_host_peak()
        if self.cuda:
            self.peak_gpu[stage] = max(self.peak_gpu.get(stage, 0), torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if name == self._stack[-1]:  # already there: no switch (a load inside a load)
            yield
            return
        self._switch()
        self._stack.append(name)
        self.counts[name] = self.counts.get(name, 0) + 1
        try:
            yield
        finally:
            self._switch()
            self._stack.pop()

    def figures(self) -> dict:
        """The run so far: seconds and peaks per stage, the overall peaks, the wall time."""
        self._switch()
        stages = {name: {"seconds": round(self.seconds.get(name, 0.0), 3),
                         "peak_host_rss_bytes": self.peak_rss.get(name, 0),
                         **({"peak_gpu_bytes": self.peak_gpu.get(name, 0)} if self.cuda else {})}
                  for name in STAGES if name in self.seconds}
        out = {"wall_seconds": round(self.clock() - self._start, 3), "stages": stages,
               "peak_host_rss_bytes": max(self.peak_rss.values(), default=host_rss_peak()),
               "peak_host_rss_scope": "run" if self._resettable else "process"}
        if self.cuda:
            out["peak_gpu_bytes"] = max(self.peak_gpu.values(), default=0)
        return out
