"""Running transformers' own generate() for many conversations over a decoder stack whose layers are loaded one at
a time: each layer is read once per decoding step for all of them, not once per conversation and token.

Each conversation's generate() runs in a thread of its own, but only one thread runs at any moment: a thread runs
until it is about to call a gated layer (a forward pre-hook), hands control back and waits. The scheduler loads
the layer the most threads wait at next in stack order, lets those threads through one after the other (each in
conversation order, each until its next gate), then releases the layer (unless it is among the first `keep`, which
stay loaded for the whole run). A decoding step of every conversation therefore costs one sweep over the stack.

Nothing runs concurrently, so each conversation computes exactly what a generate() of its own would; state that
generate() keeps on a module between steps is per conversation: `swapped` names such attributes, saved when a
thread hands control back and restored before it runs again. Two kinds matter: the thinker's M-RoPE `rope_deltas`,
and the experts implementation that transformers' generate() switches on the model's configs for its decoding
steps on a GPU (grouped_mm to batched_mm): shared, that switch made the next conversation's prefill run
batched_mm, which copies each token's experts' weights ([tokens x top_k, 2 x moe_intermediate, hidden] BF16:
50 MB per prompt token at the real widths).

A job that fails keeps its exception (the caller decides: a skipped conversation, or a stop), not the tensors its
frames held when it failed: the traceback's frames are cleared.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from .skips import release_frames


class _Cancelled(BaseException):
    """Ends a waiting generate() when the run stops (BaseException: generate() must not swallow it)."""


_current = threading.local()


class _Job:
    def __init__(self, gate: LayerGate, index: int, fn: Callable[[], object],
                 swapped: Sequence[tuple[object, str]]):
        self.gate = gate
        self.index = index
        self.fn = fn
        self.go = threading.Event()
        self.waiting_at: int | None = None
        self.done = False
        self.result: object = None
        self.error: BaseException | None = None
        self.state = {i: getattr(obj, attr) for i, (obj, attr) in enumerate(swapped)}
        self.thread: threading.Thread | None = None


class LayerGate:
    """`run(jobs)` over the decoder layers `layers`; `load(i)` and `release(i)` give layer i its weights and take
    them back."""

    def __init__(self, layers: torch.nn.ModuleList, load: Callable[[int], None], release: Callable[[int], None],
                 keep: int = 0, swapped: Sequence[tuple[object, str]] = (), device: torch.device | None = None,
                 on_sweep: Callable[[], None] | None = None):
        self.layers = layers
        self.load = load
        self.release = release
        self.keep = keep
        self.swapped = tuple(swapped)
        self.device = device
        self.on_sweep = on_sweep  # called as each pass over the stack starts (progress)
        self.sweeps = 0  # passes over the stack: the prefill and the slowest conversation's decoding steps
        self._back = threading.Event()
        self._cancelled = False
        self._loaded: set[int] = set()

    # ------------------------------------------------------------------ the jobs' side

    def _gate(self, index: int) -> None:
        job: _Job | None = getattr(_current, "job", None)
        if job is None or job.gate is not self:
            return  # the scheduler's own thread, or another gate's job: the layer is loaded already
        job.waiting_at = index
        self._wait_turn(job)

    def _wait_turn(self, job: _Job) -> None:
        self._back.set()
        job.go.wait()
        job.go.clear()
        if self._cancelled:
            raise _Cancelled

    def _thread(self, job: _Job) -> None:
        _current.job = job
        if self.device is not None and self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)
        try:
            job.go.wait()
            job.go.clear()
            if self._cancelled:
                return
            with torch.no_grad():
                job.result = job.fn()
        except _Cancelled:
            pass
        except BaseException as exc:  # handed to the caller, which decides (a skipped conversation, or a stop)
            release_frames(exc)
            job.error = exc
        finally:
            job.done = True
            self._back.set()

    # ------------------------------------------------------------------ the scheduler's side

    def _turn(self, job: _Job) -> None:
        """Let `job` run until its next gate or its end."""
        for i, (obj, attr) in enumerate(self.swapped):
            setattr(obj, attr, job.state[i])
        self._back.clear()
        job.go.set()
        self._back.wait()
        for i, (obj, attr) in enumerate(self.swapped):
            job.state[i] = getattr(obj, attr)

    def _ensure(self, index: int) -> None:
        for i in sorted(self._loaded):
            if i != index and i >= self.keep:
                self.release(i)
                self._loaded.discard(i)
        if index not in self._loaded:
            self.load(index)
            self._loaded.add(index)

    def run(self, jobs: Sequence[Callable[[], object]]) -> list[tuple[object, BaseException | None]]:
        """(result, error) of each job, in order."""
        handles = [layer.register_forward_pre_hook(lambda _m, _a, i=i: self._gate(i))
                   for i, layer in enumerate(self.layers)]
        saved = [getattr(obj, attr) for obj, attr in self.swapped]
        work = [_Job(self, n, fn, self.swapped) for n, fn in enumerate(jobs)]
        self._cancelled = False
        try:
            for job in work:
                job.thread = threading.Thread(target=self._thread, args=(job,), name=f"quantize-gen-{job.index}",
                                              daemon=True)
                job.thread.start()
                self._turn(job)  # up to its first gate: the encoders and embeddings before layer 0
            cursor = 0
            while True:
                live = [j for j in work if not j.done]
                if not live:
                    break
                at = sorted({j.waiting_at for j in live})
                index = next((i for i in at if i >= cursor), at[0])
                self._ensure(index)
                if index == 0:
                    self.sweeps += 1
                    if self.on_sweep is not None:
                        self.on_sweep()
                for job in live:
                    if not job.done and job.waiting_at == index:
                        self._turn(job)
                cursor = index + 1
        finally:
            self._stop(work)
            for h in handles:
                h.remove()
            for (obj, attr), value in zip(self.swapped, saved, strict=True):
                setattr(obj, attr, value)
            for i in sorted(self._loaded):
                self.release(i)
            self._loaded.clear()
        return [(j.result, j.error) for j in work]

    def _stop(self, work: list[_Job]) -> None:
        """End every thread still waiting (after an error or an interrupt in the scheduler)."""
        if any(not j.done for j in work):
            self._cancelled = True
            for job in work:
                if not job.done and job.thread is not None:
                    job.go.set()
        for job in work:
            if job.thread is not None:
                job.thread.join()
