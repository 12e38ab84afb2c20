"""Prefill and decoding with static KV caches, one position per decode call, captured in CUDA graphs: the
thinker, the talker and the talker's code predictor.

Decoding one token through the HF modules with a dynamic cache costs thousands of kernel launches and a host
sync per MoE layer (the per-expert token counts); at batch 1 the GPU waits on Python. Here a decoder layer is one
pure function of tensors (`decoder_layer`), the same math as the HF layer it replaces, reorganised so that
nothing depends on host values:

- the KV cache is a fixed [1, kv_heads, max_len, head_dim] buffer per layer; new keys/values are written at
  positions held in a device tensor and attention masks the unused tail;
- grouped-query attention is one SDPA call with the query heads of a group as query rows of its KV head;
- the MoE block gathers the chosen experts' packed INT4 weights on the device and runs them as two matmuls:
  gate/up of all k concatenated along N (same input), down of all k concatenated along K with each expert's
  routing weight applied to its input first, so the kernel sums the experts. torch's CUDA int4pack layout is
  tile-local ([N/8, K/(16*tiles), 32, tiles/2]): concatenating packed tiles is packing the concatenated
  matrix. With Triton (CUDA), `orin.int4_triton.moe_gemv` instead reads the chosen experts' tiles where they
  lie (no 19 MB gather per layer), one launch for gate/up and one for down. On CPU the k experts run one by
  one (same math, no host sync either).

The prompt goes through the same layer function (`StaticDecoder.prefill`): causal attention over the new keys,
which are written straight into the static caches; the MoE through Int4Experts' grouped path (one Triton launch
per projection, no host sync); dense INT4 layers dequantized for one cuBLAS GEMM. With graphs enabled and the
weights staying put, the whole prefill is replayed from a CUDA graph per prompt-length bucket: eager, its ~5,000
launches made the host, not the GPU, set the time to first token.

On CUDA each decoder is captured once per weight placement and replayed per position (a placement change, the
component swapped out and back in, is detected from the tensors' addresses and recaptured). With `compile=True`
the layer function goes through torch.compile first (one compilation per layer shape, shared by all layers),
fusing the elementwise work between the matmuls; if that fails the plain function is captured instead.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .int4 import GRAPH_DEQUANT_MIN_ROWS, dequantize_packed

log = logging.getLogger("orin.fastdecode")

PREFILL_BUCKET = 64  # graph prefill: prompts padded to a multiple of this, one capture per bucket
PREFILL_GRAPHS = 8  # captured prefill buckets kept per decoder, least recently used dropped first


# ---------------------------------------------------------------------- the layer, as a pure function


@dataclass(frozen=True)
class LinearSpec:
    """Static shape of one projection: dense (bf16 weight) or INT4 (int4pack weight + scales_and_zeros)."""

    int4: bool
    k: int
    n: int
    k_run: int = 0
    n_pad: int = 0
    group: int = 0
    bias: bool = False


@dataclass(frozen=True)
class LayerSpec:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    qk_eps: float
    scaling: float
    q: LinearSpec
    k: LinearSpec
    v: LinearSpec
    o: LinearSpec
    mlp: str  # "dense" | "moe" | "moe+shared"
    top_k: int = 0
    norm_topk: bool = True
    inter: int = 0
    gate_up: tuple = ()  # MoE: (kernel group, K_run, N_pad) of the fused gate/up and of down
    down: tuple = ()
    dense: tuple[LinearSpec, ...] = ()  # gate, up, down of a dense MLP or of the shared expert
    fused_moe: bool = True  # the concatenated-experts path (CUDA packed layout)
    triton_moe: bool = False  # CUDA with Triton: orin.int4_triton.moe_gemv reads the chosen experts in place


def _int4_mm(x, w, group, sz):
    if x.is_cuda:
        return torch.ops.aten._weight_int4pack_mm(x, w, group, sz)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, group, sz)


def _linear(x, spec: LinearSpec, w: tuple):
    """x [T, k] -> [T, n]; w is (weight[, bias]) for dense, (packed, scales_and_zeros[, bias]) for INT4. Prefill
    rows go through the dequantized weight and one dense GEMM (from orin.int4.GRAPH_DEQUANT_MIN_ROWS: the
    prefill is meant to run in a CUDA graph, where the dequantizer's launch costs no host time)."""
    if not spec.int4:
        return F.linear(x, w[0], w[1] if spec.bias else None)
    x = x.to(w[1].dtype)
    if spec.k_run > spec.k:
        x = F.pad(x, (0, spec.k_run - spec.k))
    if x.shape[0] >= GRAPH_DEQUANT_MIN_ROWS:
        y = F.linear(x, dequantize_packed(w[0], w[1], spec.group))
    else:
        y = _int4_mm(x.contiguous(), w[0], spec.group, w[1])
    if spec.n_pad > spec.n:
        y = y[:, :spec.n]
    if spec.bias:
        y = y + w[2]
    return y


def _rms(x, weight, eps: float):
    """HF's RMSNorm: normalise in float32, round to the input dtype, then scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _route(h, spec: LayerSpec, w: dict):
    """HF's top-k router: softmax in float32, top-k, renormalised, in h's dtype."""
    logits = F.linear(h, w["router"])
    if spec.triton_moe:  # one kernel for softmax and top-k (orin.router_triton)
        top_w, top_i = torch.ops.orin.softmax_topk(logits, spec.top_k)
    else:
        top_w, top_i = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), spec.top_k, dim=-1)
    if spec.norm_topk:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return top_w.to(h.dtype), top_i


def _experts(h, spec: LayerSpec, experts: tuple, top_w, top_i):
    """The chosen INT4 experts of T tokens, weighted and summed (see the module doc), no host sync."""
    T = h.shape[0]
    kg_gu, K_gu, Np_gu = spec.gate_up
    kg_dn, K_dn, Np_dn = spec.down
    H, inter, k = spec.hidden, spec.inter, spec.top_k
    gu_all, gu_sz_all, dn_all, dn_sz_all = experts
    x = h.to(gu_sz_all.dtype)
    if K_gu > H:
        x = F.pad(x, (0, K_gu - H))
    outs = []
    for t in range(T):
        sel = top_i[t]
        xt = x[t:t + 1].contiguous()
        if spec.triton_moe:
            gu = torch.ops.orin.int4_moe_gemv(xt, gu_all, gu_sz_all, sel, kg_gu).sum(0).to(x.dtype)
        elif spec.fused_moe:
            gu_w = gu_all.index_select(0, sel)
            gu_w = gu_w.reshape(k * gu_w.shape[1], *gu_w.shape[2:])
            gu_sz = gu_sz_all.transpose(0, 1).index_select(1, sel)
            gu_sz = gu_sz.reshape(gu_sz.shape[0], k * Np_gu, 2)
            gu = _int4_mm(xt, gu_w, kg_gu, gu_sz).view(k, Np_gu)
        else:
            gu = torch.cat([_int4_mm(xt, gu_all.index_select(0, sel[j:j + 1])[0], kg_gu,
                                     gu_sz_all.index_select(0, sel[j:j + 1])[0]) for j in range(k)])
        act = F.silu(gu[:, :inter]) * gu[:, inter:2 * inter]
        act = act * top_w[t].reshape(k, 1).to(act.dtype)
        if K_dn > inter:
            act = F.pad(act, (0, K_dn - inter))
        if spec.triton_moe:
            out = torch.ops.orin.int4_moe_gemv(act, dn_all, dn_sz_all, sel, kg_dn).sum((0, 1)).unsqueeze(0)
        elif spec.fused_moe:
            dn_w = dn_all.transpose(0, 1).index_select(1, sel)
            dn_w = dn_w.reshape(dn_w.shape[0], k * dn_w.shape[2], *dn_w.shape[3:])
            dn_sz = dn_sz_all.index_select(0, sel)
            dn_sz = dn_sz.reshape(k * dn_sz.shape[1], Np_dn, 2)
            out = _int4_mm(act.reshape(1, k * K_dn).contiguous(), dn_w, kg_dn, dn_sz)
        else:
            out = sum(_int4_mm(act[j:j + 1].contiguous(), dn_all.index_select(0, sel[j:j + 1])[0], kg_dn,
                               dn_sz_all.index_select(0, sel[j:j + 1])[0]) for j in range(k))
        outs.append(out[:, :H])
    return (torch.cat(outs) if T > 1 else outs[0]).to(h.dtype)


def _moe(h, spec: LayerSpec, w: dict):
    """Routed experts (+ the gated shared expert, as the talker has) for T tokens. A prefill's weights carry the
    Int4Experts module: its grouped path (one Triton launch per projection on CUDA, no host sync) is the
    prefill's MoE, the same one the HF modules call."""
    top_w, top_i = _route(h, spec, w)
    if "valid_rows" in w:  # an expert id past the last is no expert: Int4Experts skips those rows
        top_i = torch.where(w["valid_rows"], top_i, w["router"].shape[0])
    if "experts_module" in w:
        y = w["experts_module"](h, top_i, top_w)
    else:
        y = _experts(h, spec, w["experts"], top_w, top_i)
    if spec.mlp == "moe+shared":
        g, u, d = spec.dense
        shared = _linear(F.silu(_linear(h, g, w["shared_gate"])) * _linear(h, u, w["shared_up"]), d,
                         w["shared_down"])
        y = y + torch.sigmoid(F.linear(h, w["shared_expert_gate"])) * shared
    return y


def decoder_layer(x, cos, sin, mask, pos, k_cache, v_cache, w: dict, spec: LayerSpec):
    """One decoder layer for T positions. x [T, H]; cos/sin [T, head_dim]; pos [T] cache positions; mask
    [1, 1, rep*T, max_len] (row r*T+t: position t's query for head r of a group), or None for a prefill from
    position 0 (causal over the T new keys, the cache's older contents unread); the caches are updated in
    place. Returns the layer's output [T, H]."""
    T = x.shape[0]
    hd, kv = spec.head_dim, spec.kv_heads
    rep = spec.heads // kv
    h = _rms(x, w["ln1"], spec.eps)
    q = _rms(_linear(h, spec.q, w["q"]).view(T, spec.heads, hd), w["q_norm"], spec.qk_eps).transpose(0, 1)
    k = _rms(_linear(h, spec.k, w["k"]).view(T, kv, hd), w["k_norm"], spec.qk_eps).transpose(0, 1)
    v = _linear(h, spec.v, w["v"]).view(T, kv, hd).transpose(0, 1)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    k_cache.index_copy_(2, pos, k.unsqueeze(0))
    v_cache.index_copy_(2, pos, v.unsqueeze(0))
    if mask is None:
        att = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), is_causal=True,
                                             scale=spec.scaling, enable_gqa=True)
        att = att[0].transpose(0, 1).reshape(T, spec.heads * hd)
    else:
        qg = q.reshape(1, kv, rep * T, hd)
        att = F.scaled_dot_product_attention(qg, k_cache, v_cache, attn_mask=mask, scale=spec.scaling)
        att = att.view(kv, rep, T, hd).permute(2, 0, 1, 3).reshape(T, spec.heads * hd)
    x = x + _linear(att, spec.o, w["o"])
    h = _rms(x, w["ln2"], spec.eps)
    if spec.mlp == "dense":
        g, u, d = spec.dense
        return x + _linear(F.silu(_linear(h, g, w["gate"])) * _linear(h, u, w["up"]), d, w["down"])
    return x + _moe(h, spec, w)


# ---------------------------------------------------------------------- reading the HF modules


def _linear_of(module) -> tuple[LinearSpec, tuple]:
    from .int4 import Int4Linear

    if isinstance(module, Int4Linear):
        spec = LinearSpec(True, module.in_features, module.out_features, module.padded_in_features,
                          module.padded_out_features, module.kernel_group_size, module.bias is not None)
        tensors = (module.weight_packed, module.scales_and_zeros) + ((module.bias,) if spec.bias else ())
        return spec, tensors
    spec = LinearSpec(False, module.in_features, module.out_features, bias=module.bias is not None)
    return spec, (module.weight,) + ((module.bias,) if spec.bias else ())


def _silu(act) -> bool:
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation")


def supported(layer) -> bool:
    """Whether decoder_layer computes this HF layer: SiLU MLPs, and INT4 experts where there is a MoE."""
    from .int4 import Int4Experts

    mlp = layer.mlp
    if hasattr(mlp, "gate") and hasattr(mlp, "experts"):
        if not isinstance(mlp.experts, Int4Experts) or not _silu(mlp.experts.act_fn):
            return False
        shared = getattr(mlp, "shared_expert", None)
        return shared is None or _silu(shared.act_fn)
    return _silu(getattr(mlp, "act_fn", None))


def _triton_moe(device: torch.device) -> bool:
    from .int4 import triton_available

    if device.type != "cuda" or not triton_available():
        return False
    try:  # registers torch.ops.orin.int4_moe_gemv and torch.ops.orin.softmax_topk
        from . import int4_triton, router_triton  # noqa: F401
    except ImportError as exc:  # a Triton too old for the kernels: the torch-ops path still decodes
        log.warning("orin's Triton kernels cannot load (%s); decoding the MoE with torch ops", exc)
        return False
    return True


def layer_weights(layer, device: torch.device) -> tuple[LayerSpec, dict]:
    attn = layer.self_attn
    w: dict = {"ln1": layer.input_layernorm.weight, "ln2": layer.post_attention_layernorm.weight,
               "q_norm": attn.q_norm.weight, "k_norm": attn.k_norm.weight}
    specs = {}
    for name in ("q", "k", "v", "o"):
        specs[name], w[name] = _linear_of(getattr(attn, f"{name}_proj"))
    mlp = layer.mlp
    common = dict(hidden=layer.input_layernorm.weight.shape[0], heads=specs["q"].n // attn.head_dim,
                  kv_heads=specs["k"].n // attn.head_dim, head_dim=attn.head_dim,
                  eps=layer.input_layernorm.variance_epsilon, qk_eps=attn.q_norm.variance_epsilon,
                  scaling=attn.scaling, **specs)
    if hasattr(mlp, "gate") and hasattr(mlp, "experts"):
        ex = mlp.experts
        w["router"] = mlp.gate.weight
        w["experts"] = (ex.gate_up_packed, ex.gate_up_scales_and_zeros, ex.down_packed, ex.down_scales_and_zeros)
        dense = ()
        kind = "moe"
        if hasattr(mlp, "shared_expert"):
            kind = "moe+shared"
            sp = mlp.shared_expert
            parts = [_linear_of(sp.gate_proj), _linear_of(sp.up_proj), _linear_of(sp.down_proj)]
            dense = tuple(p[0] for p in parts)
            w["shared_gate"], w["shared_up"], w["shared_down"] = (p[1] for p in parts)
            w["shared_expert_gate"] = mlp.shared_expert_gate.weight
        spec = LayerSpec(**common, mlp=kind, top_k=mlp.gate.top_k, norm_topk=mlp.gate.norm_topk_prob,
                         inter=ex.intermediate_dim, gate_up=ex._geom["gate_up"], down=ex._geom["down"], dense=dense,
                         fused_moe=device.type == "cuda", triton_moe=_triton_moe(device))
    else:
        parts = [_linear_of(mlp.gate_proj), _linear_of(mlp.up_proj), _linear_of(mlp.down_proj)]
        w["gate"], w["up"], w["down"] = (p[1] for p in parts)
        spec = LayerSpec(**common, mlp="dense", dense=tuple(p[0] for p in parts))
    return spec, w


class _Runner:
    """Captures a zero-argument step function in a CUDA graph (re-captured when the weights move), or calls
    it eagerly off CUDA; optionally compiles the layer function first."""

    def __init__(self, device: torch.device, graph: bool, compile: bool, pool=None):
        self.device = device
        self.pool = pool  # a memory pool shared with other graphs that never run at the same time
        self.graph_enabled = graph and device.type == "cuda"
        self.compile = compile
        self.layer_fn = decoder_layer
        self._compiled = None
        self._graph = None
        self._fingerprint = None
        self._out = None
        self.captures = 0
        self.compile_error: str | None = None
        self.check = True  # compare the weights' addresses with the capture's before the next replay

    def _layer(self):
        if not self.compile:
            return decoder_layer
        if self._compiled is None:
            import torch._dynamo

            # One compiled variant per layer shape and cache length (thinker, talker, code predictor prefill
            # and step, each KV length): more than dynamo's default of 8 over a server's life.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
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

    def _capture_with(self, fn, layer):
        torch.cuda.synchronize(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up: compilation, library handles and workspaces stay out of the capture
                fn(layer)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn(layer)
        return graph, out

    def release(self) -> None:
        self._graph, self._out, self._fingerprint = None, None, None


# ---------------------------------------------------------------------- thinker and talker


class _GraphToggle:
    """`graph_enabled` of a decoder that owns a `_Runner`: CUDA graphs only ever on CUDA."""

    runner: _Runner
    device: torch.device

    @property
    def graph_enabled(self) -> bool:
        return self.runner.graph_enabled

    @graph_enabled.setter
    def graph_enabled(self, value: bool) -> None:
        self.runner.graph_enabled = value and self.device.type == "cuda"


@dataclass
class Prefilled:
    """What a prefill gives the engine: the last position's logits [1, vocab] and normed hidden state
    [1, 1, H], and the recorded hidden states {HF index: [1, T, H]}."""

    logits: torch.Tensor
    hidden: torch.Tensor
    states: dict


class StaticDecoder(_GraphToggle):
    """Static-cache decoding of one sequence: `prefill(embeds, positions, max_len)` (or `start(cache, max_len)`
    after an HF prefill), then `step(token)` (thinker: returns logits [1, vocab]) or `step_embeds(embeds)`
    (talker: returns (logits, last hidden))."""

    def __init__(self, text_model, head, rope_owner, device: torch.device, graph: bool | None = None,
                 compile: bool = False):
        self.model, self.head, self.rope_owner = text_model, head, rope_owner
        self.cfg = text_model.config
        self.device = device
        self.runner = _Runner(device, device.type == "cuda" if graph is None else graph, compile)
        self.max_len = 0
        self.length = 0
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        # bucket key -> (its runner, its graph's static input buffers)
        self._prefill_graphs: OrderedDict[tuple, tuple[_Runner, dict]] = OrderedDict()
        # One memory pool for all prefill buckets (they never run at once and their outputs are copied out),
        # so the buckets kept cost about one prefill's activations, not one each.
        self._prefill_pool = None

    @property
    def captures(self) -> int:
        return self.runner.captures

    @property
    def prefill_captures(self) -> int:
        return sum(runner.captures for runner, _ in self._prefill_graphs.values())

    def supported(self) -> bool:
        return all(supported(layer) for layer in self.model.layers)

    def _alloc(self, max_len: int) -> None:
        cfg = self.cfg
        dtype = self.head.weight.dtype
        shape = (1, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(cfg.num_hidden_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(cfg.num_hidden_layers)]
        self.positions = torch.arange(max_len, device=self.device)
        self.tok = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        self.embeds = torch.zeros((1, 1, cfg.hidden_size), dtype=dtype, device=self.device)
        self.idx = torch.zeros((1,), dtype=torch.long, device=self.device)
        self.delta = torch.zeros((1,), dtype=torch.long, device=self.device)
        self.max_len = max_len
        self.runner.release()
        self._release_prefill_graphs()

    def _release_prefill_graphs(self) -> None:
        for runner, _ in self._prefill_graphs.values():
            runner.release()
        self._prefill_graphs.clear()
        self._prefill_pool = None

    def release(self) -> None:
        """Drop the cache buffers and the graphs (their memory goes back to the allocator)."""
        self.k_cache, self.v_cache, self.max_len = [], [], 0
        self.runner.release()
        self._release_prefill_graphs()

    def start(self, cache, max_len: int) -> StaticDecoder:
        """Take over an HF DynamicCache after the prefill (keys/values copied into the static buffers)."""
        layers = cache.layers
        n = int(layers[0].keys.shape[2])
        if max_len > self.max_len or not self.k_cache:
            # Rounded up so that requests of similar length reuse the buffers and the captured graph.
            self._alloc(-(-max(max_len, n + 1) // 64) * 64)
        for i, layer in enumerate(layers):
            self.k_cache[i][:, :, :n].copy_(layer.keys)
            self.v_cache[i][:, :, :n].copy_(layer.values)
        deltas = getattr(self.rope_owner, "rope_deltas", None)
        self.delta.fill_(int(deltas.reshape(-1)[0]) if deltas is not None else 0)
        self.length = n
        self.runner.check = True  # weights cannot move during a request, but may have between requests
        return self

    def _weights(self) -> list[torch.Tensor]:
        return list(self.model.parameters()) + [b for b in self.model.buffers() if b is not None] + \
            list(self.head.parameters())

    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_cache + self.v_cache)

    # ------------------------------------------------------------------ prefill

    def prefill(self, embeds: torch.Tensor, position_ids: torch.Tensor, max_len: int, record: tuple[int, ...] = (),
                visual: tuple | None = None, bucket: int | None = None, graph: bool = True) -> Prefilled:
        """The prompt through decoder_layer from position 0, its keys and values written into the static caches
        (no DynamicCache, no copy). embeds [T, H] (multimodal features already merged); position_ids [3, 1, T]
        (M-RoPE, as the HF model computes them; `rope_owner.rope_deltas` set by that computation); record: the
        HF hidden-state indices to return (0 = the embeddings, i = layer i-1's output before any deepstack);
        visual: (visual_pos_masks [1, T], deepstack features [n, H] for the first layers) for an image.

        With graphs enabled (CUDA, and `graph`: the caller's word that the weights stay where they are, so a
        capture is replayed more than once) the prompt is padded to a multiple of `bucket` (PREFILL_BUCKET) and
        the whole prefill replayed from a CUDA graph captured once per bucket: the eager prefill is ~5,000
        kernel launches, and the host, not the GPU, sets its time. Padding rows come after the prompt, so
        causal attention keeps them out of its rows; their cache entries lie past the prompt, where decoding
        masks them until it overwrites them."""
        T = int(embeds.shape[0])
        graph = graph and self.runner.graph_enabled and self._prefill_capturable(embeds)
        bucket = bucket or (PREFILL_BUCKET if graph else 1)
        Tb = -(-T // bucket) * bucket
        if max(max_len, Tb) > self.max_len or not self.k_cache:
            self._alloc(-(-max(max_len, Tb, T + 1) // 64) * 64)
        m = self.model
        cos, sin = m.rotary_emb(embeds.unsqueeze(0), position_ids)
        inputs = {"x": embeds, "cos": cos[0], "sin": sin[0]}
        if visual is not None and visual[1]:
            rows = torch.nonzero(visual[0].reshape(-1)).flatten()
            ds = embeds.new_zeros((len(visual[1]), T, embeds.shape[1]))
            for i, feat in enumerate(visual[1]):
                ds[i].index_copy_(0, rows, feat.to(ds.dtype))
            inputs["ds"] = ds
        if Tb > T:
            inputs = {k: F.pad(v, (0, 0, 0, Tb - T)) for k, v in inputs.items()}
        if Tb > T or graph:  # padding rows route to no expert: the MoE, most of a prefill's work, skips them
            inputs["valid"] = (torch.arange(Tb, device=self.device) < T).unsqueeze(1)
        inputs["last"] = torch.tensor([T - 1], device=self.device)
        record = tuple(sorted(set(record)))
        if graph:
            logits, hidden, states = self._prefill_graph(Tb, record, inputs)
        else:
            logits, hidden, states = self._prefill_forward(decoder_layer, inputs, record)
        deltas = getattr(self.rope_owner, "rope_deltas", None)
        self.delta.fill_(int(deltas.reshape(-1)[0]) if deltas is not None else 0)
        self.length = T
        self.runner.check = True
        return Prefilled(logits, hidden, {i: s[:T].unsqueeze(0) for i, s in states.items()})

    def _prefill_capturable(self, rows: torch.Tensor) -> bool:
        """Whether every MoE layer's prefill runs without a host sync (orin.int4's fused Triton path): else
        the prefill stays eager (CPU; no Triton; packed shapes the kernel does not take, as the tiny model's)."""
        return all(layer.mlp.experts.fused(rows, layer.mlp.gate.top_k) for layer in self.model.layers
                   if hasattr(layer.mlp, "experts"))

    def _prefill_forward(self, layer_fn, inputs: dict, record: tuple[int, ...]):
        m = self.model
        x = inputs["x"]
        pos = self.positions[:x.shape[0]]
        ds = inputs.get("ds")
        states = {0: x} if 0 in record else {}
        for i, layer in enumerate(m.layers):
            spec, w = layer_weights(layer, self.device)
            if spec.mlp != "dense":
                w["experts_module"] = layer.mlp.experts
                if "valid" in inputs:
                    w["valid_rows"] = inputs["valid"]
            x = layer_fn(x, inputs["cos"], inputs["sin"], None, pos, self.k_cache[i], self.v_cache[i], w, spec)
            if i + 1 in record:
                states[i + 1] = m.norm(x) if i + 1 == len(m.layers) else x  # HF's last entry is normed
            if ds is not None and i < ds.shape[0]:
                x = x + ds[i]
        hidden = m.norm(x.index_select(0, inputs["last"]))
        return self.head(hidden), hidden.unsqueeze(0), states

    def _prefill_graph(self, Tb: int, record: tuple[int, ...], inputs: dict):
        """Replay (capturing first where needed) the prefill graph of bucket Tb; outputs are copied out, so
        the next prefill may overwrite them."""
        key = (Tb, record, tuple(inputs["ds"].shape) if "ds" in inputs else None)
        entry = self._prefill_graphs.pop(key, None)
        if entry is None:
            while len(self._prefill_graphs) >= PREFILL_GRAPHS:  # least recently used first
                self._prefill_graphs.pop(next(iter(self._prefill_graphs)))[0].release()
            # the layer function is captured uncompiled: a prefill is a few large kernels per layer, not
            # worth a compilation per bucket
            if self._prefill_pool is None:
                self._prefill_pool = torch.cuda.graph_pool_handle()
            entry = (_Runner(self.device, True, False, pool=self._prefill_pool),
                     {k: torch.empty_like(v) for k, v in inputs.items()})
        self._prefill_graphs[key] = entry
        runner, static = entry
        for k, v in inputs.items():
            static[k].copy_(v)
        runner.check = True
        logits, hidden, states = runner.run(lambda fn: self._prefill_forward(fn, static, record),
                                            lambda: self._weights() + self.k_cache + self.v_cache)
        return logits.clone(), hidden.clone(), {i: s.clone() for i, s in states.items()}

    def _forward(self, layer_fn, from_tokens: bool):
        m = self.model
        x = m.embed_tokens(self.tok)[0] if from_tokens else self.embeds[0]
        pos = (self.idx + self.delta).view(1, 1, 1).expand(3, 1, 1)
        cos, sin = m.rotary_emb(x.unsqueeze(0), pos)
        cos, sin = cos[0], sin[0]
        mask = (self.positions <= self.idx).view(1, 1, 1, -1)
        for i, layer in enumerate(m.layers):
            spec, w = layer_weights(layer, self.device)
            x = layer_fn(x, cos, sin, mask, self.idx, self.k_cache[i], self.v_cache[i], w, spec)
        hidden = m.norm(x)
        return self.head(hidden), hidden.unsqueeze(0)

    def _advance(self):
        if self.length >= self.max_len:
            raise RuntimeError(f"static KV cache full ({self.max_len} positions); start() with a larger max_len")
        self.idx.fill_(self.length)

    def step(self, token: int) -> torch.Tensor:
        self._advance()
        self.tok.fill_(token)
        logits, _ = self.runner.run(lambda fn: self._forward(fn, True), self._weights)
        self.length += 1
        return logits

    def step_embeds(self, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._advance()
        self.embeds.copy_(embeds.reshape(self.embeds.shape))
        logits, hidden = self.runner.run(lambda fn: self._forward(fn, False), self._weights)
        self.length += 1
        return logits, hidden


# Back-compatible name: the thinker's decoder.
def ThinkerDecoder(model, device: torch.device, graph: bool | None = None, compile: bool = False) -> StaticDecoder:
    thinker = model.thinker
    return StaticDecoder(thinker.model.language_model, thinker.lm_head, thinker.model, device, graph, compile)


def TalkerDecoder(model, device: torch.device, graph: bool | None = None, compile: bool = False) -> StaticDecoder:
    talker = model.talker
    return StaticDecoder(talker.model, talker.codec_head, talker, device, graph, compile)


# ---------------------------------------------------------------------- code predictor


class CodePredictor(_GraphToggle):
    """The talker's code predictor, greedy, as one graph per frame: a 2-position prefill (the talker's last
    hidden state and the frame's first code) then one position per residual code group, each with its own
    lm_head and codec embedding. Returns (codes [groups-1], sum of the frame's codec embeddings)."""

    def __init__(self, model, device: torch.device, graph: bool | None = None, compile: bool = False):
        cp = model.talker.code_predictor
        self.cp = cp
        self.cfg = cp.config
        self.device = device
        self.runner = _Runner(device, device.type == "cuda" if graph is None else graph, compile)
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

    def _forward(self, layer_fn):
        m = self.cp.model
        x = self.inputs
        codes, embeds = [], self.inputs[1:2]
        for s in range(self.groups):
            pos = self.positions[s]
            mask = self.prefill_mask if s == 0 else self.step_masks[s - 1]
            cos, sin = m.rotary_emb(x.unsqueeze(0), pos.view(1, -1))
            cos, sin = cos[0], sin[0]
            for i, layer in enumerate(m.layers):
                spec, w = layer_weights(layer, self.device)
                x = layer_fn(x, cos, sin, mask, pos, self.k_cache[i], self.v_cache[i], w, spec)
            logits = self.cp.lm_head[s](m.norm(x[-1:]))
            code = torch.argmax(logits, dim=-1)
            codes.append(code)
            emb = m.codec_embedding[s](code)
            embeds = embeds + emb
            x = emb
        return torch.cat(codes), embeds.unsqueeze(0)

    def run(self, past_hidden: torch.Tensor, last_id_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.built:
            self._build()
        self.inputs[0].copy_(past_hidden.reshape(-1))
        self.inputs[1].copy_(last_id_hidden.reshape(-1))
        return self.runner.run(self._forward, self._weights)

    def release(self) -> None:
        self.built = False
        self.runner.release()


def fused_moe_int4(experts, h: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
    """The routed-experts output as decoder_layer computes it (concatenated experts on CUDA), for checks
    against Int4Experts.forward: h [T, H], top_idx [T, k], top_w [T, k] -> [T, H]."""
    spec = LayerSpec(hidden=experts.hidden_dim, heads=1, kv_heads=1, head_dim=1, eps=0.0, qk_eps=0.0, scaling=1.0,
                     q=None, k=None, v=None, o=None, mlp="moe", top_k=top_idx.shape[1],
                     inter=experts.intermediate_dim, gate_up=experts._geom["gate_up"], down=experts._geom["down"],
                     fused_moe=h.is_cuda, triton_moe=_triton_moe(h.device))
    tensors = (experts.gate_up_packed, experts.gate_up_scales_and_zeros, experts.down_packed,
               experts.down_scales_and_zeros)
    return _experts(h, spec, tensors, top_w.to(h.dtype), top_idx)


__all__ = ["CodePredictor", "LayerSpec", "LinearSpec", "StaticDecoder", "TalkerDecoder", "ThinkerDecoder",
           "decoder_layer", "fused_moe_int4", "layer_weights", "supported"]
