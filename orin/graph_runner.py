"""Replaying a step from a CUDA graph: captured once per weight placement, re-captured when the weights move
(detected from the tensors' addresses), run eagerly off CUDA; optionally through torch.compile first."""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from .cuda_gate import GATE
from .decoder_layer import decoder_layer

log = logging.getLogger("orin.graph_runner")

# One side stream per device for every capture's warm-up: cuBLAS keeps a workspace per stream for the life of the
# process, so a new stream per capture left ~225 MiB behind each engine (counted in the next engine's peak).
_CAPTURE_STREAMS: dict = {}


def _capture_stream(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[index] = torch.cuda.Stream(index)
    return _CAPTURE_STREAMS[index]


class GraphRunner:
    """Captures a zero-argument step function in a CUDA graph (re-captured when the weights move), or calls
    it eagerly off CUDA; optionally compiles the layer function first."""

    def __init__(self, device: torch.device, graph: bool, compile: bool, pool=None, warmups: int = 3):
        self.device = device
        self.warmups = warmups  # runs before the capture: compilation, library handles, workspaces
        self.pool = pool  # a memory pool shared with other graphs that never run at the same time
        self.graph_enabled = graph and device.type == "cuda"
        self.compile = compile
        self._compiled = None
        self._graph = None
        self._fingerprint = None
        self._out = None
        self.captures = 0
        self.capture_s = 0.0  # the captures' wall time, warm-ups included
        self.compile_error: str | None = None
        self.check = True  # compare the weights' addresses with the capture's before the next replay

    def _layer(self):
        if not self.compile:
            return decoder_layer
        if self._compiled is None:
            import torch._dynamo

            # One compiled variant per layer shape and cache length (thinker, talker, code predictor prefill
            # and step, each KV length): more than dynamo's default of 8 over a server's life.
            # (`cache_size_limit` in older torch)
            name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))
            # Inductor's pool of compile worker processes competes with the requests that follow for CPU:
            # on an H200 host the next requests' feature extraction took 0.12 s instead of 0.01 s (BENCHMARKS.md).
            # Compiling in-process is slower once (the warm-up absorbs it) and leaves nothing running.
            import torch._inductor.config as inductor_config

            inductor_config.compile_threads = 1
            self._compiled = torch.compile(decoder_layer, dynamic=False, fullgraph=False)
        return self._compiled

    def run(self, fn, fingerprint_of):
        if not self.graph_enabled:
            return fn(decoder_layer)
        if self._graph is None or self.check:
            fingerprint = tuple(t.data_ptr() for t in fingerprint_of())
            if self._graph is None or fingerprint != self._fingerprint:
                self._capture(fn)
                self._fingerprint = fingerprint
            self.check = False
        self._graph.replay()
        torch.cuda.current_stream(self.device).synchronize()  # a step's time is its own, not the next op's
        return self._out

    def _capture(self, fn) -> None:
        start = time.perf_counter()
        layer = self._layer()
        try:
            self._graph, self._out = self._capture_with(fn, layer)
        except Exception as exc:  # noqa: BLE001 - a compiler failure must not stop decoding
            if layer is decoder_layer:
                raise
            self.compile_error = f"{type(exc).__name__}: {exc}"[:500]
            log.warning("torch.compile of the decoder layer failed (%s); capturing it uncompiled", exc)
            self.compile = False
            self._graph, self._out = self._capture_with(fn, decoder_layer)
        self.captures += 1
        self.capture_s += time.perf_counter() - start

    def _capture_with(self, fn, layer):
        torch.cuda.synchronize(self.device)
        side = _capture_stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmups):  # compilation, library handles and workspaces stay out of the capture
                fn(layer)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # Not torch.cuda.graph(): it empties the allocator's cache (and the pinned host cache) before each capture.
        # Time-sliced, a swap of the talker re-captures, and that handed the blocks the loader keeps for the next
        # load (orin.loader._trim) back to the driver, to be allocated again.
        with GATE, torch.cuda.stream(side):
            torch.cuda.synchronize(self.device)
            graph.capture_begin(*(() if self.pool is None else (self.pool,)))
            try:
                out = fn(layer)
            except BaseException:
                with contextlib.suppress(RuntimeError):  # the capture is invalid: end it, report the cause
                    graph.capture_end()
                raise
            graph.capture_end()
        return graph, out

    def release(self) -> None:
        self._graph, self._out, self._fingerprint = None, None, None


