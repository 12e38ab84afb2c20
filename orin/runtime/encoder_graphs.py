"""The audio and vision encoders (and code2wav's chunks) replayed from CUDA graphs, one capture per input shape.

Eager, an encoder is hundreds of small kernels launched from Python (the real audio encoder's 32 layers, the
vision encoder's 27 blocks): they took over half of a short request's time to first token, the host setting the
pace, and the Orin's CPU is slower. Their host-side shape logic is computed once per shape (orin.model.audio_encoder's
and orin.model.vision_encoder's plans, no host sync in forward), so a shape's whole forward can be captured once and
replayed: the request then costs one copy of its features into the graph's input buffer, one replay and one copy
out. A capture holds its plan (the graph reads the plan's index and rotary tensors) and re-captures when the
weights move (a swap). Used only for an encoder whose weights stay put between requests (all-resident, or one a
time-sliced stream never moves: orin.runtime.engine.RequestPlan.graphs; the graph's memory pool sits in the runtime
margin, as the prefill graphs' does); elsewhere, and off CUDA, the encoders run eagerly, with the same results.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from ..device.profile import CaptureTuning
from .graph_runner import GraphSet


class EncoderGraphs:
    """`run(key, module, inputs, call)`: `call(*inputs)` on `module`, replayed from the graph captured for `key`
    (the input shape, with everything else the output depends on) on CUDA, eagerly elsewhere or when `graph`
    is false. `capture`: the profile's numbers (shapes kept, shapes remembered as seen)."""

    def __init__(self, device: torch.device, capture: CaptureTuning):
        self.device = device
        self.kept, self.seen_kept = capture.encoder_graphs, capture.encoder_seen
        self._graphs = GraphSet(device, capture.capture_warmups)  # a shape seen twice is warm: one warm-up
        self._used: OrderedDict[tuple, None] = OrderedDict()  # the shapes captured, least recently used first
        # A server's encoders defer captures (`defer`): a shape is run eagerly until it comes a second time, and
        # is then captured by capture_deferred() while the GPU is idle. A microphone's turns are each of their own
        # length: capturing each (four passes and a capture) cost more than it ever saved.
        self.defer = False
        self._seen: OrderedDict[tuple, None] = OrderedDict()
        self._wanted: OrderedDict[tuple, tuple] = OrderedDict()  # key -> (module, input specs, call, keep)

    @property
    def captures(self) -> int:
        return self._graphs.captures

    def run(self, key: tuple, module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], call: Callable,
            graph: bool = True, keep: object = None, recurring: bool = False):
        """`keep`: what the capture reads besides its inputs and weights (the encoder's plan), held for as long
        as the graph lives. `recurring`: a shape every request has (deferred, it is captured after its first
        sighting, not its second)."""
        if not graph or self.device.type != "cuda":
            return call(*inputs)
        if self.defer and key not in self._graphs:
            if key in self._seen or recurring:
                self._wanted[key] = (module, tuple((t.shape, t.dtype) for t in inputs), call, keep)
                while len(self._wanted) > self.kept:
                    self._wanted.popitem(last=False)
            self._seen[key] = None
            while len(self._seen) > self.seen_kept:
                self._seen.popitem(last=False)
            return call(*inputs)
        return self._replay(key, module, inputs, call, keep)

    def capture_deferred(self, stop: Callable[[], bool]) -> int:
        """While the GPU is idle: capture the shapes seen twice, newest first, until `stop()` (each replays once
        on zeros). Returns the captures made."""
        made = 0
        while self._wanted and not stop():
            key, (module, specs, call, keep) = self._wanted.popitem()
            if key not in self._graphs:
                inputs = tuple(torch.zeros(shape, dtype=dtype, device=self.device) for shape, dtype in specs)
                self._replay(key, module, inputs, call, keep)
                made += 1
        return made

    def _replay(self, key: tuple, module: torch.nn.Module, inputs: tuple, call: Callable, keep: object):
        drop = []
        if key not in self._graphs:  # least recently used first
            while len(self._used) >= self.kept:
                drop.append(self._used.popitem(last=False)[0])
        self._used.pop(key, None)
        self._used[key] = None
        try:
            return self._graphs.replay(key, dict(enumerate(inputs)), lambda _layer, static: call(*static.values()),
                                       lambda: list(module.parameters()), drop, keep)
        except Exception:
            self._used.pop(key, None)
            raise

    def release(self) -> None:
        self._graphs.release()
        self._used.clear()
        self._wanted.clear()


__all__ = ["EncoderGraphs"]
