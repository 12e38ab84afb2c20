"""The audio and vision encoders replayed from CUDA graphs, one capture per input shape.

Eager, an encoder is hundreds of small kernels launched from Python (the real audio encoder's 32 layers, the
vision encoder's 27 blocks): on an H200 they took ~60 ms of a ~108 ms time to first token, the host setting the
pace, and the Orin's CPU is slower. Their host-side shape logic is computed once per shape (orin.audio_encoder's
and orin.vision_encoder's plans, no host sync in forward), so a shape's whole forward can be captured once and
replayed: the request then costs one copy of its features into the graph's input buffer, one replay and one copy
out. A capture holds its plan (the graph reads the plan's index and rotary tensors) and re-captures when the
weights move (a swap). Used only for an encoder whose weights stay put between requests (all-resident, or one a
time-sliced stream never moves: orin.engine.RequestPlan.graphs; the graph's memory pool sits in the runtime
margin, as the prefill graphs' does); elsewhere, and off CUDA, the encoders run eagerly, with the same results.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from .graph_runner import GraphRunner

GRAPHS_KEPT = 8  # captured shapes kept per engine, least recently used dropped first
SEEN_KEPT = 64  # deferred: shapes remembered as seen once


def _clone(out):
    """A replay's output, copied out of the graph's buffers (the next replay overwrites them)."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    return type(out)(*(_clone(part) for part in out)) if isinstance(out, tuple) else [_clone(p) for p in out]


class EncoderGraphs:
    """`run(key, module, inputs, call)`: `call(*inputs)` on `module`, replayed from the graph captured for `key`
    (the input shape, with everything else the output depends on) on CUDA, eagerly elsewhere or when `graph`
    is false."""

    def __init__(self, device: torch.device):
        self.device = device
        self._entries: OrderedDict[tuple, tuple[GraphRunner, tuple, object]] = OrderedDict()
        self._pool = None  # one pool for every encoder graph: they never run at the same time
        self.captures = 0
        # A server's encoders defer captures (`defer`): a shape is run eagerly until it comes a second time, and
        # is then captured by capture_deferred() while the GPU is idle. A microphone's turns are each of their own
        # length: capturing each (four passes and a capture) cost more than it ever saved.
        self.defer = False
        self._seen: OrderedDict[tuple, None] = OrderedDict()
        self._wanted: OrderedDict[tuple, tuple] = OrderedDict()  # key -> (module, input specs, call, keep)

    def run(self, key: tuple, module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], call: Callable,
            graph: bool = True, keep: object = None, recurring: bool = False):
        """`keep`: what the capture reads besides its inputs and weights (the encoder's plan), held for as long
        as the graph lives. `recurring`: a shape every request has (deferred, it is captured after its first
        sighting, not its second)."""
        if not graph or self.device.type != "cuda":
            return call(*inputs)
        if self.defer and key not in self._entries:
            if key in self._seen or recurring:
                self._wanted[key] = (module, tuple((t.shape, t.dtype) for t in inputs), call, keep)
                while len(self._wanted) > GRAPHS_KEPT:
                    self._wanted.popitem(last=False)
            self._seen[key] = None
            while len(self._seen) > SEEN_KEPT:
                self._seen.popitem(last=False)
            return call(*inputs)
        return self._replay(key, module, inputs, call, keep)

    def capture_deferred(self, stop: Callable[[], bool]) -> int:
        """While the GPU is idle: capture the shapes seen twice, newest first, until `stop()` (each replays once
        on zeros). Returns the captures made."""
        made = 0
        while self._wanted and not stop():
            key, (module, specs, call, keep) = self._wanted.popitem()
            if key not in self._entries:
                inputs = tuple(torch.zeros(shape, dtype=dtype, device=self.device) for shape, dtype in specs)
                self._replay(key, module, inputs, call, keep)
                made += 1
        return made

    def _replay(self, key: tuple, module: torch.nn.Module, inputs: tuple, call: Callable, keep: object):
        entry = self._entries.pop(key, None)
        if entry is None:
            while len(self._entries) >= GRAPHS_KEPT:
                self._entries.popitem(last=False)[1][0].release()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            entry = (GraphRunner(self.device, True, False, pool=self._pool, warmups=1),  # seen twice: warm
                     tuple(torch.empty_like(t) for t in inputs), keep)
        self._entries[key] = entry
        runner, static, _ = entry
        for buf, value in zip(static, inputs, strict=True):
            buf.copy_(value)
        before = runner.captures
        try:
            out = runner.run(lambda _layer: call(*static), lambda: list(module.parameters()))
        except Exception:
            self._entries.pop(key)[0].release()  # no graph-less entry is left to be replayed
            raise
        self.captures += runner.captures - before
        runner.check = True  # the weights may have moved by the next request
        return _clone(out)

    def release(self) -> None:
        for runner, _, _ in self._entries.values():
            runner.release()
        self._entries.clear()
        self._wanted.clear()
        self._pool = None


__all__ = ["EncoderGraphs"]
