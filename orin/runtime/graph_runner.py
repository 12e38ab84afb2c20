"""Replaying work from CUDA graphs: a step captured once per weight placement, re-captured when the weights move
(detected from the tensors' addresses), run eagerly off CUDA, optionally through torch.compile first
(`GraphRunner`); a set of such graphs kept by key (a prefill bucket, an encoder's input shape), each replayed on
static copies of its inputs (`GraphSet`); and the talker's code predictor, a whole frame's code groups replayed
as one graph (`CodePredictor`; orin.runtime.decode's Decoders makes it beside the thinker's and talker's decoders)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import torch

from ..device.gate import GATE
from ..device.profile import DeviceProfile
from .layer import decoder_layer, layer_weights

log = logging.getLogger("orin.runtime.graph_runner")

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
            # Inductor's pool of compile worker processes competes with the requests that follow for CPU (their
            # feature extraction ran ten times slower beside it). Compiling in-process is slower once (the warm-up
            # absorbs it) and leaves nothing running.
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
        # load (orin.memory.loader._trim) back to the driver, to be allocated again.
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


def _clone(out):
    """A replay's output, copied out of the graph's buffers (the next replay overwrites them)."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, dict):
        return {k: _clone(v) for k, v in out.items()}
    parts = [_clone(part) for part in out]
    if isinstance(out, tuple):
        return type(out)(*parts) if hasattr(out, "_fields") else tuple(parts)  # a named tuple's fields, or a tuple
    return parts


class GraphSet:
    """CUDA graphs kept by key, each replaying `fn(layer_fn, static)` on static copies of its inputs (a dict of
    tensors), its outputs copied out. They share one memory pool: they never run at once, so the graphs kept
    cost about one run's activations, not one each. Which keys are kept is the caller's policy (`drop`); off
    CUDA each runs its function eagerly on the copies, through the same code."""

    def __init__(self, device: torch.device, warmups: int):
        self.device = device
        self.warmups = warmups  # a keyed graph's capture runs its function this many times first
        self._entries: dict = {}  # key -> (its runner, its static inputs, what it must keep alive)
        self._pool = None
        self.captures = 0  # over the set's life, released graphs included

    def __contains__(self, key) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def replay(self, key, inputs: dict, fn, fingerprint_of, drop=(), keep: object = None):
        """`fn(layer_fn, static)`'s outputs, cloned, from `key`'s graph (captured first where there is none, after
        the graphs `drop` names are released); the weights' addresses (`fingerprint_of()`) are checked first, so
        a graph whose weights moved is captured again. `keep`: what the graph reads besides its inputs and
        weights (an encoder's plan), held as long as it lives."""
        entry = self._entries.get(key)
        if entry is None:
            for old in drop:
                gone = self._entries.pop(old, None)
                if gone is not None:
                    gone[0].release()
            if self._pool is None and self.device.type == "cuda":
                self._pool = torch.cuda.graph_pool_handle()
            entry = (GraphRunner(self.device, True, False, pool=self._pool, warmups=self.warmups),
                     {k: torch.empty_like(v) for k, v in inputs.items()}, keep)
            self._entries[key] = entry
        runner, static, _ = entry
        for k, v in inputs.items():
            static[k].copy_(v)
        runner.check = True  # the weights may have moved since the last replay
        before = runner.captures
        try:
            # captured uncompiled: a few large kernels per layer, not worth a compilation per key
            out = runner.run(lambda layer: fn(layer, static), fingerprint_of)
        except Exception:
            self._entries.pop(key)[0].release()  # no graph-less entry is left to be replayed
            raise
        self.captures += runner.captures - before
        return _clone(out)

    def release(self) -> None:
        for runner, _, _ in self._entries.values():
            runner.release()
        self._entries.clear()
        self._pool = None


class CodePredictor:
    """The talker's code predictor: a 2-position prefill (the talker's last hidden state and the frame's first
    code) then one position per residual code group, each with its own lm_head and codec embedding. Returns
    (codes [groups-1], sum of the frame's codec embeddings). Greedy, it is one CUDA graph per frame; sampled, the
    same steps run eagerly with the caller's sampler choosing each code."""

    def __init__(self, model, device: torch.device, profile: DeviceProfile, compile: bool = False):
        cp = model.talker.code_predictor
        self.cp = cp
        self.cfg = cp.config
        self.device = device
        self.profile = profile
        self.runner = GraphRunner(device, device.type == "cuda", compile)
        self.groups = len(cp.lm_head)  # residual code groups (num_code_groups - 1)
        self.built = False

    def _build(self) -> None:
        cfg, dev = self.cfg, self.device
        dtype = self.cp.lm_head[0].weight.dtype
        max_len = -(-(self.groups + 1) // 8) * 8
        shape = (1, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(cfg.num_hidden_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=dev) for _ in range(cfg.num_hidden_layers)]
        self.inputs = torch.zeros((2, cfg.hidden_size), dtype=dtype, device=dev)
        rep = cfg.num_attention_heads // cfg.num_key_value_heads
        keys = torch.arange(max_len, device=dev)
        # Prefill rows r*2+t (t = 0, 1) see keys <= t; step s (position s+1) sees keys <= s+1.
        self.prefill_mask = (keys.view(1, -1) <= torch.arange(2, device=dev).repeat(rep).view(-1, 1)).view(
            1, 1, 2 * rep, max_len)
        self.step_masks = [(keys <= s + 1).view(1, 1, 1, max_len) for s in range(1, self.groups)]
        self.positions = [torch.arange(2, device=dev)] + [torch.tensor([s + 1], device=dev)
                                                          for s in range(1, self.groups)]
        self.built = True

    def _weights(self) -> list[torch.Tensor]:
        return list(self.cp.parameters()) + [b for b in self.cp.buffers() if b is not None]

    def _forward(self, layer_fn, choose: Callable[[torch.Tensor], torch.Tensor] | None = None):
        m = self.cp.model
        x = self.inputs
        codes, embeds = [], self.inputs[1:2]
        for s in range(self.groups):
            pos = self.positions[s]
            mask = self.prefill_mask if s == 0 else self.step_masks[s - 1]
            cos, sin = m.rotary_emb(x.unsqueeze(0), pos.view(1, -1))
            cos, sin = cos[0], sin[0]
            for i, layer in enumerate(m.layers):
                spec, w = layer_weights(layer, self.device, self.profile)
                x = layer_fn(x, cos, sin, mask, pos, self.k_cache[i], self.v_cache[i], w, spec)
            logits = self.cp.lm_head[s](m.norm(x[-1:]))
            code = torch.argmax(logits, dim=-1) if choose is None else choose(logits)
            codes.append(code)
            emb = m.codec_embedding[s](code)
            embeds = embeds + emb
            x = emb
        return torch.cat(codes), embeds.unsqueeze(0)

    def run(self, past_hidden: torch.Tensor, last_id_hidden: torch.Tensor,
            choose: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`choose(logits [1, vocab]) -> code [1]` samples a code; None is greedy."""
        if not self.built:
            self._build()
        self.inputs[0].copy_(past_hidden.reshape(-1))
        self.inputs[1].copy_(last_id_hidden.reshape(-1))
        if choose is not None:
            return self._forward(decoder_layer, choose)
        return self.runner.run(self._forward, self._weights)

    def release(self) -> None:
        self.built = False
        self.runner.release()
