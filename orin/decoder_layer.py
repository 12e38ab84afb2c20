"""A decoder layer of the thinker, the talker or the code predictor as one pure function of tensors
(`decoder_layer`): the same math as the HF layer it replaces, reorganised so that nothing depends on host values
and the whole step can be captured in a CUDA graph.

- the KV cache is a fixed [1, kv_heads, max_len, head_dim] buffer per layer; new keys/values are written at
  positions held in a device tensor and attention masks the unused tail;
- grouped-query attention is one SDPA call with the query heads of a group as query rows of its KV head;
- the MoE block gathers the chosen experts' packed INT4 weights on the device and runs them as two matmuls:
  gate/up of all k concatenated along N (same input), down of all k concatenated along K with each expert's
  routing weight applied to its input first, so the kernel sums the experts. torch's CUDA int4pack layout is
  tile-local ([N/8, K/(16*tiles), 32, tiles/2]): concatenating packed tiles is packing the concatenated
  matrix. With Triton, orin.kernels.int4_gemm's moe_gemv instead reads the chosen experts' tiles where they
  lie (no 19 MB gather per layer), one launch for gate/up and one for down. On CPU, in a prefill, and for BF16
  experts (where a checkpoint keeps them) the experts module itself computes the MoE.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from . import components as C
from .int4 import GRAPH_DEQUANT_MIN_ROWS, dequantize_packed
from .int4pack import SwitchedKernel, int4_mm
from .text_model import topk_routing

log = logging.getLogger("orin.decoder_layer")



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
    triton_moe: bool = False  # CUDA with Triton: orin.kernels.int4_gemm.moe_gemv reads the chosen experts in place


def _linear(x, spec: LinearSpec, w: tuple, dense: torch.Tensor | None = None):
    """x [T, k] -> [T, n]; w is (weight[, bias]) for dense, (packed, scales_and_zeros[, bias]) for INT4. Prefill
    rows go through the dequantized weight and one dense GEMM (from orin.int4.GRAPH_DEQUANT_MIN_ROWS: the
    prefill is meant to run in a CUDA graph, where the dequantizer's launch costs no host time); `dense`: that
    weight, dequantized once by a caller that projects many chunks with it (_dense_weight)."""
    if not spec.int4:
        return F.linear(x, w[0], w[1] if spec.bias else None)
    x = x.to(w[1].dtype)
    if spec.k_run > spec.k:
        x = F.pad(x, (0, spec.k_run - spec.k))
    if dense is not None:
        y = F.linear(x, dense)
    elif x.shape[0] >= GRAPH_DEQUANT_MIN_ROWS:
        y = F.linear(x, dequantize_packed(w[0], w[1], spec.group))
    else:
        y = int4_mm(x.contiguous(), w[0], spec.group, w[1])
    if spec.n_pad > spec.n:
        y = y[:, :spec.n]
    if spec.bias:
        y = y + w[2]
    return y


def _rms(x, weight, eps: float):
    """HF's RMSNorm: normalise in float32, round to the input dtype, then scale. torch's rms_norm does the first
    two in one kernel where they took six, 3,300 times in a 25k-token video prefill (BENCHMARKS.md, run 51): bit
    for bit HF's on CPU (tests/test_decode.py); on CUDA it sums in another order, so an element may round the
    other way (tests/test_device_kernels.py)."""
    return weight * F.rms_norm(x, (x.shape[-1],), None, eps)


def _rms_rows(x, weight, eps: float, chunk: int):
    """_rms of a long prompt's rows, `chunk` at a time into one output: whole, its float32 intermediates (two of
    [T, H]: 393 MiB at 25k tokens) set the 2 fps video prefill's peak (BENCHMARKS.md, run 50v)."""
    out = torch.empty_like(x)
    for s in range(0, x.shape[0], chunk):
        out[s:s + chunk] = _rms(x[s:s + chunk], weight, eps)
    return out


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class _NormRope(SwitchedKernel):
    """``out[:] = _rope(_rms(y, weight, eps).transpose(0, 1), cos, sin)``: a long prompt's queries and keys normed
    per head, rotated and written in place, as one Triton kernel on CUDA (orin.kernels.norm_rope) for the shapes
    it takes, the torch ops elsewhere or after the kernel failed once in this process (`error` says why)."""

    def __call__(self, out, y, weight, eps: float, cos, sin) -> None:
        if self.runs_on(y):
            try:
                from .kernels import norm_rope

                if norm_rope.supports(out, y, weight, cos, sin):
                    norm_rope.norm_rope_into(out, y, weight, eps, cos, sin)
                    return
            except Exception as exc:  # noqa: BLE001 - a kernel that cannot build must not stop inference
                self.switch_off(exc, "the Triton query/key norm and rotary kernel failed (%s); using torch ops")
        out.copy_(_rope(_rms(y, weight, eps).transpose(0, 1), cos, sin))


norm_rope_into = _NormRope()


def _route(h, spec: LayerSpec, w: dict):
    """HF's top-k router: softmax in float32, top-k, renormalised, in h's dtype."""
    logits = F.linear(h, w["router"])
    if not spec.triton_moe:
        return topk_routing(logits, spec.top_k, spec.norm_topk)
    top_w, top_i = torch.ops.orin.softmax_topk(logits, spec.top_k)  # one kernel for softmax and top-k
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
        else:
            gu_w = gu_all.index_select(0, sel)
            gu_w = gu_w.reshape(k * gu_w.shape[1], *gu_w.shape[2:])
            gu_sz = gu_sz_all.transpose(0, 1).index_select(1, sel)
            gu_sz = gu_sz.reshape(gu_sz.shape[0], k * Np_gu, 2)
            gu = int4_mm(xt, gu_w, kg_gu, gu_sz).view(k, Np_gu)
        act = F.silu(gu[:, :inter]) * gu[:, inter:2 * inter]
        act = act * top_w[t].reshape(k, 1).to(act.dtype)
        if K_dn > inter:
            act = F.pad(act, (0, K_dn - inter))
        if spec.triton_moe:
            out = torch.ops.orin.int4_moe_gemv(act, dn_all, dn_sz_all, sel, kg_dn).sum((0, 1)).unsqueeze(0)
        else:
            dn_w = dn_all.transpose(0, 1).index_select(1, sel)
            dn_w = dn_w.reshape(dn_w.shape[0], k * dn_w.shape[2], *dn_w.shape[3:])
            dn_sz = dn_sz_all.index_select(0, sel)
            dn_sz = dn_sz.reshape(k * dn_sz.shape[1], Np_dn, 2)
            out = int4_mm(act.reshape(1, k * K_dn).contiguous(), dn_w, kg_dn, dn_sz)
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


def _attend_after(q, k_cache, v_cache, prefix: int, spec: LayerSpec):
    """A prefill chunk's queries q [heads, T, hd] at positions prefix.. over the cache's first prefix + T keys,
    causally (lower-right aligned): on flash where it runs here (its causal mask is lower-right for a chunk
    shorter than its keys, and it reads grouped KV heads in place), else SDPA with the lower-right bias, one KV
    head's group of query heads at a time (its keys expanded over the group, not copied for all heads: a 25k-token
    cache repeated over 32 heads is 400 MB), which SDPA runs on its memory-efficient kernel at half flash's speed."""
    heads, T, hd = q.shape
    L = prefix + T
    if _flash_lower_right(q):
        k = k_cache[:, :, :L].transpose(1, 2)
        v = v_cache[:, :, :L].transpose(1, 2)
        out = torch.ops.aten._flash_attention_forward(q.transpose(0, 1).unsqueeze(0), k, v, None, None, T, L, 0.0,
                                                      True, False, scale=spec.scaling)[0]
        return out.reshape(T, heads * hd)
    kv = spec.kv_heads
    rep = heads // kv
    bias = causal_lower_right(T, L)
    out = q.new_empty((T, heads * hd))
    for g in range(kv):
        k = k_cache[0, g, :L].unsqueeze(0).expand(rep, L, hd)
        v = v_cache[0, g, :L].unsqueeze(0).expand(rep, L, hd)
        att = F.scaled_dot_product_attention(q[g * rep:(g + 1) * rep].unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
                                             attn_mask=bias, scale=spec.scaling)
        out[:, g * rep * hd:(g + 1) * rep * hd] = att[0].transpose(0, 1).reshape(T, rep * hd)
    return out


# A masked pass with at most this many query rows per KV head (a decode step, the code predictor's) goes through
# _attend_few; more rows (a continued prefill's) through SDPA.
SMALL_QUERY_ROWS = 64
# Up to this many cache positions _attend_few's attention stays SDPA's one fused kernel (the code predictor's ~17
# positions). Not further: at 4,096 the standard request's thinker (a 1,024-position cache) decoded 163-170
# tokens/s against 226 with the GEMMs (runs 33-34 against run 23; the talker's frames/s were the same either way).
FEW_ROWS_SDPA_MAX_KEYS = 256


@torch.compiler.disable
def _attend_few(q, k_new, v_new, pos, k_cache, v_cache, mask, scale: float):
    """Attention of a few query rows q [kv, n, hd] (a decode step's, the code predictor's) over a whole static
    cache [1, kv, L, hd], after writing the new keys and values k_new, v_new [kv, T, hd] at `pos`; mask [1 or n,
    L] (True: attend). Two batched GEMMs and a softmax in float32: SDPA's kernels spread a decode step's work
    over the batch, heads and query blocks only, not over the keys, so with one query block and 4 KV heads, 4
    blocks of the GPU walk the whole cache (run 21: 60 ms a token at 25k positions on the H200, where reading
    the cache takes 1 ms). The GEMMs split over the keys; the scores, [kv, n, L] in float32, are a few MB. A
    cache of up to FEW_ROWS_SDPA_MAX_KEYS positions keeps SDPA's kernel.

    Never compiled: everything that depends on the cache's length is in here, so a cache grown for a longer
    conversation recompiles nothing (the compiled rest of the layer sees the same shapes), and bmm's out_dtype
    has no inductor lowering on torch 2.9 (pytorch#165892)."""
    k_cache.index_copy_(2, pos, k_new.unsqueeze(0))
    v_cache.index_copy_(2, pos, v_new.unsqueeze(0))
    k, v = k_cache[0], v_cache[0]
    if k.shape[1] <= FEW_ROWS_SDPA_MAX_KEYS:  # one fused kernel where a few blocks read the cache quickly
        return F.scaled_dot_product_attention(q.unsqueeze(0), k_cache, v_cache, attn_mask=mask.unsqueeze(0),
                                              scale=scale)[0]
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        scores = torch.bmm(q, k.transpose(1, 2), out_dtype=torch.float32)
    else:
        scores = torch.bmm(q.float(), k.float().transpose(1, 2))
    scores = scores.mul_(scale).masked_fill_(~mask, float("-inf"))
    return torch.bmm(torch.softmax(scores, dim=-1).to(v.dtype), v)


_FLASH: dict = {}


def _flash_lower_right(q: torch.Tensor) -> bool:
    """Whether aten's flash kernel runs here and masks a chunk lower-right: checked once per device and dtype
    against SDPA with the lower-right bias on a small problem (a build without flash for this GPU, or one whose
    causal alignment differed, keeps the SDPA path)."""
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] > 256:
        return False
    key = (q.device.index, q.dtype, q.shape[-1])
    if key not in _FLASH:
        gen = torch.Generator(device=q.device).manual_seed(0)
        T, L, heads, kv, hd = 48, 160, 4, 2, q.shape[-1]
        qs = torch.randn((heads, T, hd), generator=gen, device=q.device, dtype=q.dtype)
        ks = torch.randn((1, kv, L, hd), generator=gen, device=q.device, dtype=q.dtype)
        vs = torch.randn((1, kv, L, hd), generator=gen, device=q.device, dtype=q.dtype)
        try:
            got = torch.ops.aten._flash_attention_forward(qs.transpose(0, 1).unsqueeze(0), ks.transpose(1, 2),
                                                          vs.transpose(1, 2), None, None, T, L, 0.0, True, False,
                                                          scale=hd ** -0.5)[0][0].transpose(0, 1)
            want = F.scaled_dot_product_attention(qs.unsqueeze(0), ks.repeat_interleave(heads // kv, 1),
                                                  vs.repeat_interleave(heads // kv, 1),
                                                  attn_mask=causal_lower_right(T, L), scale=hd ** -0.5)[0]
            _FLASH[key] = bool((got.float() - want.float()).abs().max() < 2e-2)
        except (RuntimeError, NotImplementedError) as exc:
            log.info("flash attention unavailable for prefill chunks (%s); using SDPA", exc)
            _FLASH[key] = False
    return _FLASH[key]


_CUDNN: dict = {}


def cudnn_whole_prompt(device: torch.device) -> bool:
    """Whether a long prompt's attention runs whole on cuDNN's kernel (attention_block_long): a Hopper or newer
    GPU, where cuDNN's causal attention runs at twice flash-attention 2's rate (25k tokens, 32 query heads over 4:
    8.0 ms a layer against 16.4, BENCHMARKS.md), and a build whose kernel computes a small causal GQA problem as
    the math path does (checked once per device). Elsewhere, the Orin (sm87) included, the prompt goes 4,096
    queries at a time on flash (attention_block)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    key = device.index
    if key not in _CUDNN:
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn((1, 4, 96, 128), generator=gen, device=device, dtype=torch.bfloat16)
        k = torch.randn((1, 1, 96, 128), generator=gen, device=device, dtype=torch.bfloat16)
        v = torch.randn((1, 1, 96, 128), generator=gen, device=device, dtype=torch.bfloat16)
        try:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                got = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            with sdpa_kernel([SDPBackend.MATH]):
                want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                                      enable_gqa=True)
            _CUDNN[key] = bool((got.float() - want).abs().max() < 2e-2)
        except (RuntimeError, NotImplementedError) as exc:
            log.info("cuDNN attention unavailable for long prompts (%s); using flash in chunks", exc)
            _CUDNN[key] = False
    return _CUDNN[key]


def _dense_weight(spec: LinearSpec, w: tuple) -> torch.Tensor:
    """A projection's weight as one dense [n_pad, k_run] matrix (INT4 dequantized, as _linear does for prefill
    rows)."""
    return dequantize_packed(w[0], w[1], spec.group) if spec.int4 else w[0]


def attention_block_long(x, cos, sin, k_cache, v_cache, w: dict, spec: LayerSpec, chunk: int, backend=None):
    """attention_block over a whole prompt, at the cache's positions from 0, on cuDNN (cudnn_whole_prompt),
    adding into x (the caller's own tensor) in place. Keys, values and queries are made `chunk` rows at a time;
    then one KV head's group of query heads at a time, one causal call over the whole prompt each, so besides x
    the working memory is every head's queries and the attention's output (at 25k tokens, 210 and 206 MB). Rows
    are padded to C.WHOLE_PROMPT_BUCKET: the padding's queries come after every real row and, the mask being
    causal, are never attended; the cache's padding positions are zeroed, so no stale value meets a zero weight.
    The projections, norms and rotary embedding are attention_block's, row for row. `backend`: SDPA's (None: cuDNN's, the reason this path exists; the CPU tests
    pass the math one, so the path is checked where no GPU is)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    T = x.shape[0]
    hd, kv = spec.head_dim, spec.kv_heads
    rep = spec.heads // kv
    padded = min(k_cache.shape[2], -(-T // C.WHOLE_PROMPT_BUCKET) * C.WHOLE_PROMPT_BUCKET)
    wq = _dense_weight(spec.q, w["q"])
    bq = w["q"][-1] if spec.q.bias else None
    # the other projections' INT4 weights dequantized once a layer too, not once a chunk (at 25k rows, 21
    # dequantizations a layer, 1,000 launches a prefill; 20 MB at the thinker's widths)
    dense = {n: _dense_weight(getattr(spec, n), w[n]) for n in ("k", "v", "o") if getattr(spec, n).int4}
    # every head's queries for every row, each chunk's rows normed and projected once for its keys, values and
    # queries together: one KV group's queries at a time normed each chunk again per group (five times a layer),
    # and at a video's 25k rows their elementwise work and launches were a fifth of the prefill (BENCHMARKS.md,
    # run 50v). The buffer (210 MB at 25k rows) is under what the deepstack levels held at the prefill's peak.
    q = x.new_zeros((1, spec.heads, padded, hd))
    for s in range(0, T, chunk):
        e = min(T, s + chunk)
        h = _rms(x[s:e], w["ln1"], spec.eps)
        # the prompt's positions are the cache's first T: slices, where index_copy_'s kernel along the cache's
        # third dimension took ~0.1 ms a chunk; keys and queries normed and rotated straight into place
        k = _linear(h, spec.k, w["k"], dense.get("k")).view(e - s, kv, hd)
        norm_rope_into(k_cache[0, :, s:e], k, w["k_norm"], spec.qk_eps, cos[s:e], sin[s:e])
        v_cache[0, :, s:e] = _linear(h, spec.v, w["v"], dense.get("v")).view(e - s, kv, hd).transpose(0, 1)
        h = h.to(wq.dtype)
        if spec.q.k_run > spec.q.k:
            h = F.pad(h, (0, spec.q.k_run - spec.q.k))
        norm_rope_into(q[0, :, s:e], F.linear(h, wq, bq).view(e - s, spec.heads, hd), w["q_norm"], spec.qk_eps,
                       cos[s:e], sin[s:e])
        del h, k
    k_cache[:, :, T:padded].zero_()
    v_cache[:, :, T:padded].zero_()
    out = x.new_empty((T, spec.heads * hd))
    for g in range(kv):
        cols = slice(g * rep * hd, (g + 1) * rep * hd)
        with sdpa_kernel([backend or SDPBackend.CUDNN_ATTENTION]):
            att = F.scaled_dot_product_attention(q[:, g * rep:(g + 1) * rep], k_cache[:, g:g + 1, :padded],
                                                 v_cache[:, g:g + 1, :padded], is_causal=True, scale=spec.scaling,
                                                 enable_gqa=True)
        out[:, cols] = att[0, :, :T].transpose(0, 1).reshape(T, rep * hd)
        del att
    del q
    for s in range(0, T, chunk):
        e = min(T, s + chunk)
        x[s:e] += _linear(out[s:e], spec.o, w["o"], dense.get("o"))
    return x


def decoder_layer(x, cos, sin, mask, pos, k_cache, v_cache, w: dict, spec: LayerSpec, prefix: int = 0):
    """One decoder layer for T positions. x [T, H]; cos/sin [T, head_dim]; pos [T] cache positions; mask
    [1, 1, rep*T, max_len] (row r*T+t: position t's query for head r of a group), or None for a prefill: from
    position 0 (`prefix` 0: causal over the T new keys, the cache's older contents unread), or a later chunk of
    one (`prefix` > 0: the T new keys after the prefix's, already in the cache); the caches are updated in
    place. Returns the layer's output [T, H]."""
    return mlp_block(attention_block(x, cos, sin, mask, pos, k_cache, v_cache, w, spec, prefix), w, spec)


def _keys_values(h, cos, sin, w: dict, spec: LayerSpec):
    """The keys (normed, rotated) and values [kv_heads, T, head_dim] of T normed rows h."""
    T, hd, kv = h.shape[0], spec.head_dim, spec.kv_heads
    k = _rms(_linear(h, spec.k, w["k"]).view(T, kv, hd), w["k_norm"], spec.qk_eps).transpose(0, 1)
    return _rope(k, cos, sin), _linear(h, spec.v, w["v"]).view(T, kv, hd).transpose(0, 1)


def attention_block(x, cos, sin, mask, pos, k_cache, v_cache, w: dict, spec: LayerSpec, prefix: int = 0):
    """The layer's first half (decoder_layer's arguments): x plus its attention's output."""
    T = x.shape[0]
    hd, kv = spec.head_dim, spec.kv_heads
    rep = spec.heads // kv
    h = _rms(x, w["ln1"], spec.eps)
    q = _rope(_rms(_linear(h, spec.q, w["q"]).view(T, spec.heads, hd), w["q_norm"], spec.qk_eps).transpose(0, 1),
              cos, sin)
    k, v = _keys_values(h, cos, sin, w, spec)
    if mask is not None and rep * T <= SMALL_QUERY_ROWS:
        att = _attend_few(q.reshape(kv, rep * T, hd), k, v, pos, k_cache, v_cache, mask[0], spec.scaling)
        return x + _linear(att.view(kv, rep, T, hd).permute(2, 0, 1, 3).reshape(T, spec.heads * hd), spec.o, w["o"])
    k_cache.index_copy_(2, pos, k.unsqueeze(0))
    v_cache.index_copy_(2, pos, v.unsqueeze(0))
    if mask is None and prefix:
        att = _attend_after(q, k_cache, v_cache, prefix, spec)
    elif mask is None:
        att = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), is_causal=True,
                                             scale=spec.scaling, enable_gqa=True)
        att = att[0].transpose(0, 1).reshape(T, spec.heads * hd)
    else:
        qg = q.reshape(1, kv, rep * T, hd)
        att = F.scaled_dot_product_attention(qg, k_cache, v_cache, attn_mask=mask, scale=spec.scaling)
        att = att.view(kv, rep, T, hd).permute(2, 0, 1, 3).reshape(T, spec.heads * hd)
    return x + _linear(att, spec.o, w["o"])


def mlp_block(x, w: dict, spec: LayerSpec):
    """The layer's second half: x plus its MLP's (dense, or routed experts and a shared one) output."""
    h = _rms(x, w["ln2"], spec.eps)
    if spec.mlp == "dense":
        g, u, d = spec.dense
        return x + _linear(F.silu(_linear(h, g, w["gate"])) * _linear(h, u, w["up"]), d, w["down"])
    return x + _moe(h, spec, w)


def mlp_block_long(x, w: dict, spec: LayerSpec, chunk: int, max_rows: int | None = None):
    """mlp_block over a whole long prompt, adding into x (the caller's own tensor) in place: the router and the
    experts see every row at once, so each expert's INT4 weights are dequantized once per layer
    (Int4Experts.add_long, its token-expert rows `max_rows` at a time: None, C.LONG_MOE_BLOCK_ROWS), not once per
    chunk of rows; a dense MLP and the shared expert go `chunk` rows at a time."""
    T = x.shape[0]
    if spec.mlp == "dense" or not hasattr(w.get("experts_module"), "add_long"):
        for s in range(0, T, chunk):
            x[s:s + chunk] = mlp_block(x[s:s + chunk], w, spec)
        return x
    h = _rms_rows(x, w["ln2"], spec.eps, chunk)
    top_w, top_i = _route(h, spec, w)
    if spec.mlp == "moe+shared":
        g, u, d = spec.dense
        for s in range(0, T, chunk):
            hs = h[s:s + chunk]
            shared = _linear(F.silu(_linear(hs, g, w["shared_gate"])) * _linear(hs, u, w["shared_up"]), d,
                             w["shared_down"])
            x[s:s + chunk] += torch.sigmoid(F.linear(hs, w["shared_expert_gate"])) * shared
    w["experts_module"].add_long(h, top_i, top_w, x, max_rows=max_rows)
    return x


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
    """Whether decoder_layer computes this HF layer: SiLU MLPs and experts (INT4 or BF16)."""
    mlp = layer.mlp
    if hasattr(mlp, "gate") and hasattr(mlp, "experts"):
        if not _silu(mlp.experts.act_fn):
            return False
        shared = getattr(mlp, "shared_expert", None)
        return shared is None or _silu(shared.act_fn)
    return _silu(getattr(mlp, "act_fn", None))


def _triton_moe(device: torch.device) -> bool:
    from .int4 import triton_available

    if device.type != "cuda" or not triton_available():
        return False
    try:  # registers torch.ops.orin.int4_moe_gemv and torch.ops.orin.softmax_topk
        from .kernels import int4_gemm, router  # noqa: F401
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
        from .int4 import Int4Experts

        ex = mlp.experts
        w["router"] = mlp.gate.weight
        if isinstance(ex, Int4Experts) and device.type == "cuda":
            w["experts"] = (ex.gate_up_packed, ex.gate_up_scales_and_zeros, ex.down_packed, ex.down_scales_and_zeros)
            geometry = dict(inter=ex.intermediate_dim, gate_up=ex._geom["gate_up"], down=ex._geom["down"],
                            triton_moe=_triton_moe(device))
        else:
            # The module computes them: on CPU (no graphs, so its per-expert loop costs nothing a graph could
            # save; its tinygemm route is the same math), and for BF16 experts (a checkpoint that keeps them).
            w["experts_module"] = ex
            geometry = dict(inter=ex.intermediate_dim)
        dense = ()
        kind = "moe"
        if hasattr(mlp, "shared_expert"):
            kind = "moe+shared"
            sp = mlp.shared_expert
            parts = [_linear_of(sp.gate_proj), _linear_of(sp.up_proj), _linear_of(sp.down_proj)]
            dense = tuple(p[0] for p in parts)
            w["shared_gate"], w["shared_up"], w["shared_down"] = (p[1] for p in parts)
            w["shared_expert_gate"] = mlp.shared_expert_gate.weight
        spec = LayerSpec(**common, mlp=kind, top_k=mlp.gate.top_k, norm_topk=mlp.gate.norm_topk_prob, dense=dense,
                         **geometry)
    else:
        parts = [_linear_of(mlp.gate_proj), _linear_of(mlp.up_proj), _linear_of(mlp.down_proj)]
        w["gate"], w["up"], w["down"] = (p[1] for p in parts)
        spec = LayerSpec(**common, mlp="dense", dense=tuple(p[0] for p in parts))
    return spec, w


def fused_moe_int4(experts, h: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
    """The routed-experts output as decoder_layer's CUDA decode computes it (Triton GEMV, else concatenated
    experts), for checks against Int4Experts.forward: h [T, H] on CUDA, top_idx [T, k], top_w [T, k] -> [T, H]."""
    spec = LayerSpec(hidden=experts.hidden_dim, heads=1, kv_heads=1, head_dim=1, eps=0.0, qk_eps=0.0, scaling=1.0,
                     q=None, k=None, v=None, o=None, mlp="moe", top_k=top_idx.shape[1],
                     inter=experts.intermediate_dim, gate_up=experts._geom["gate_up"], down=experts._geom["down"],
                     triton_moe=_triton_moe(h.device))
    tensors = (experts.gate_up_packed, experts.gate_up_scales_and_zeros, experts.down_packed,
               experts.down_scales_and_zeros)
    return _experts(h, spec, tensors, top_w.to(h.dtype), top_idx)
