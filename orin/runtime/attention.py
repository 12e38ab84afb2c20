"""A decoder layer's attention half (orin.runtime.layer composes it with the MLP), and the projection and norm
primitives both halves use. Everything the device decides (the attention tuning, flash's lower-right masking,
whether orin's Triton kernels run) comes in the layer's LayerSpec, taken from the device profile when its
weights were read (orin.runtime.layer.layer_weights): nothing here probes the device or reads a module constant.

- the KV cache is a fixed [1, kv_heads, max_len, head_dim] buffer per layer; new keys/values are written at
  positions held in a device tensor and attention masks the unused tail, so a step can be captured in a CUDA
  graph;
- grouped-query attention is one SDPA call with the query heads of a group as query rows of its KV head; a few
  query rows (a decode step's) are two GEMMs split over the keys instead (`_attend_few`);
- a long prompt runs a chunk of queries at a time over the keys before it (`_attend_after`), or on Hopper whole on
  cuDNN one KV group at a time (`attention_block_long`).

`without_cudnn_attention` holds SDPA off cuDNN for the engine's and quantize's work (see its doc).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ..device.profile import CPU
from ..int4.pack import dequantize_packed, int4_mm


@contextlib.contextmanager
def without_cudnn_attention() -> Iterator[None]:
    """SDPA restricted to flash, memory-efficient and math kernels, never cuDNN's: for the engine's work and for
    quantize's BF16 passes. torch >= 2.10 prefers cuDNN's attention on sm90 and sm100 once its bundled cuDNN is
    new enough, and cuDNN builds an execution plan for every input shape on its first sight, while new shapes come
    all the time: every Realtime turn's audio in the audio encoder (an eager pass over a new shape took eight
    times one over a shape seen before), a prefill bucket before its graph is captured, a continued turn's
    prefill, quantize's passes through generate() whose cache grows by a row every token. Flash and
    memory-efficient kernels build nothing per shape; the Orin (sm87) never preferred cuDNN. The switch is torch's
    global one (the quantize gate's threads are covered too), held for the work and given back after, so other
    code in the process (the benchmark's HF reference) keeps torch's choice. attention_block_long asks for cuDNN
    itself, where it is the point."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        yield


# ---------------------------------------------------------------------- projections and norms


@dataclass(frozen=True)
class LinearSpec:
    """Static shape of one projection: dense (bf16 weight) or INT4 (int4pack weight + scales_and_zeros), and for
    INT4 how its many rows run: from `dequant_min_rows` rows dequantized for one dense GEMM (the profile's
    prefill.graph_dequant_min_rows: the prefill is meant to run in a CUDA graph, where the dequantizer's launch
    costs no host time), by the Triton dequantizer where `triton`."""

    int4: bool
    k: int
    n: int
    k_run: int = 0
    n_pad: int = 0
    group: int = 0
    bias: bool = False
    dequant_min_rows: int = CPU.prefill.graph_dequant_min_rows
    triton: bool = False


def _linear(x, spec: LinearSpec, w: tuple, dense: torch.Tensor | None = None):
    """x [T, k] -> [T, n]; w is (weight[, bias]) for dense, (packed, scales_and_zeros[, bias]) for INT4; `dense`:
    that weight, dequantized once by a caller that projects many chunks with it (_dense_weight)."""
    if not spec.int4:
        return F.linear(x, w[0], w[1] if spec.bias else None)
    x = x.to(w[1].dtype)
    if spec.k_run > spec.k:
        x = F.pad(x, (0, spec.k_run - spec.k))
    if dense is not None:
        y = F.linear(x, dense)
    elif x.shape[0] >= spec.dequant_min_rows:
        y = F.linear(x, dequantize_packed(w[0], w[1], spec.group, spec.triton))
    else:
        y = int4_mm(x.contiguous(), w[0], spec.group, w[1])
    if spec.n_pad > spec.n:
        y = y[:, :spec.n]
    if spec.bias:
        y = y + w[2]
    return y


def _dense_weight(spec: LinearSpec, w: tuple) -> torch.Tensor:
    """A projection's weight as one dense [n_pad, k_run] matrix (INT4 dequantized, as _linear does for many
    rows)."""
    return dequantize_packed(w[0], w[1], spec.group, spec.triton) if spec.int4 else w[0]


def _rms(x, weight, eps: float):
    """HF's RMSNorm: normalise in float32, round to the input dtype, then scale. torch's rms_norm does the first
    two in one kernel where they took six (thousands of times in a long video's prefill): bit for bit HF's on CPU
    (tests/test_decode.py); on CUDA it sums in another order, so an element may round the other way
    (tests/test_device_kernels.py)."""
    return weight * F.rms_norm(x, (x.shape[-1],), None, eps)


def _rms_rows(x, weight, eps: float, chunk: int):
    """_rms of a long prompt's rows, `chunk` at a time into one output: whole, its float32 intermediates (two of
    [T, H]: 393 MiB at 25k tokens) would set the video prefill's peak."""
    out = torch.empty_like(x)
    for s in range(0, x.shape[0], chunk):
        out[s:s + chunk] = _rms(x[s:s + chunk], weight, eps)
    return out


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def norm_rope_into(out, y, weight, eps: float, cos, sin, triton: bool) -> None:
    """``out[:] = _rope(_rms(y, weight, eps).transpose(0, 1), cos, sin)``: a long prompt's queries and keys normed
    per head, rotated and written in place; with `triton` (the layer's kernels passed their start-up check) as
    one Triton kernel (orin.kernels.norm_rope) for the shapes it takes, else the torch ops."""
    if triton:
        from ..kernels import norm_rope

        if norm_rope.supports(out, y, weight, cos, sin):
            norm_rope.norm_rope_into(out, y, weight, eps, cos, sin)
            return
    out.copy_(_rope(_rms(y, weight, eps).transpose(0, 1), cos, sin))


# ---------------------------------------------------------------------- attention


def _keys_values(h, cos, sin, w: dict, spec):
    """The keys (normed, rotated) and values [kv_heads, T, head_dim] of T normed rows h."""
    T, hd, kv = h.shape[0], spec.head_dim, spec.kv_heads
    k = _rms(_linear(h, spec.k, w["k"]).view(T, kv, hd), w["k_norm"], spec.qk_eps).transpose(0, 1)
    return _rope(k, cos, sin), _linear(h, spec.v, w["v"]).view(T, kv, hd).transpose(0, 1)


def _attend_after(q, k_cache, v_cache, prefix: int, spec):
    """A prefill chunk's queries q [heads, T, hd] at positions prefix.. over the cache's first prefix + T keys,
    causally (lower-right aligned): on flash where the profile says it masks so here (its causal mask is
    lower-right for a chunk shorter than its keys, and it reads grouped KV heads in place), else SDPA with the
    lower-right bias, one KV head's group of query heads at a time (its keys expanded over the group, not copied
    for all heads: a 25k-token cache repeated over 32 heads is 400 MB), which SDPA runs on its memory-efficient
    kernel at half flash's speed."""
    heads, T, hd = q.shape
    L = prefix + T
    if spec.flash_lower_right and q.dtype in (torch.float16, torch.bfloat16) and hd <= 256:
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


@torch.compiler.disable
def _attend_few(q, k_new, v_new, pos, k_cache, v_cache, mask, scale: float, sdpa_max_keys: int):
    """Attention of a few query rows q [kv, n, hd] (a decode step's, the code predictor's) over a whole static
    cache [1, kv, L, hd], after writing the new keys and values k_new, v_new [kv, T, hd] at `pos`; mask [1 or n,
    L] (True: attend). Two batched GEMMs and a softmax in float32: SDPA's kernels spread a decode step's work
    over the batch, heads and query blocks only, not over the keys, so with one query block and 4 KV heads, 4
    blocks of the GPU walk the whole cache (60 ms a token at 25k positions on an H200, where reading the cache
    takes 1 ms). The GEMMs split over the keys; the scores, [kv, n, L] in float32, are a few MB. A cache of up
    to `sdpa_max_keys` positions (the profile's attention.few_rows_sdpa_max_keys) keeps SDPA's one fused kernel.

    Never compiled: everything that depends on the cache's length is in here, so a cache grown for a longer
    conversation recompiles nothing (the compiled rest of the layer sees the same shapes), and bmm's out_dtype
    has no inductor lowering on torch 2.9 (pytorch#165892)."""
    k_cache.index_copy_(2, pos, k_new.unsqueeze(0))
    v_cache.index_copy_(2, pos, v_new.unsqueeze(0))
    k, v = k_cache[0], v_cache[0]
    if k.shape[1] <= sdpa_max_keys:  # one fused kernel where a few blocks read the cache quickly
        return F.scaled_dot_product_attention(q.unsqueeze(0), k_cache, v_cache, attn_mask=mask.unsqueeze(0),
                                              scale=scale)[0]
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        scores = torch.bmm(q, k.transpose(1, 2), out_dtype=torch.float32)
    else:
        scores = torch.bmm(q.float(), k.float().transpose(1, 2))
    scores = scores.mul_(scale).masked_fill_(~mask, float("-inf"))
    return torch.bmm(torch.softmax(scores, dim=-1).to(v.dtype), v)


def attention_block(x, cos, sin, mask, pos, k_cache, v_cache, w: dict, spec, prefix: int = 0):
    """The layer's first half (orin.runtime.layer.decoder_layer's arguments): x plus its attention's output."""
    T = x.shape[0]
    hd, kv = spec.head_dim, spec.kv_heads
    rep = spec.heads // kv
    h = _rms(x, w["ln1"], spec.eps)
    q = _rope(_rms(_linear(h, spec.q, w["q"]).view(T, spec.heads, hd), w["q_norm"], spec.qk_eps).transpose(0, 1),
              cos, sin)
    k, v = _keys_values(h, cos, sin, w, spec)
    if mask is not None and rep * T <= spec.attention.small_query_rows:
        att = _attend_few(q.reshape(kv, rep * T, hd), k, v, pos, k_cache, v_cache, mask[0], spec.scaling,
                          spec.attention.few_rows_sdpa_max_keys)
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


def attention_block_long(x, cos, sin, k_cache, v_cache, w: dict, spec, chunk: int, backend=None):
    """attention_block over a whole prompt, at the cache's positions from 0, on cuDNN (where the profile's
    capabilities.cudnn_whole_prompt says it runs: twice flash-attention 2's rate on Hopper), adding into x (the
    caller's own tensor) in place. Keys, values and queries are made `chunk` rows at a time; then one KV head's
    group of query heads at a time, one causal call over the whole prompt each, so besides x the working memory
    is every head's queries and the attention's output (at 25k tokens, 210 and 206 MB). Rows are padded to a
    multiple of the profile's attention.whole_prompt_bucket (so nearby lengths share cuDNN's per-shape plan): the
    padding's queries come after every real row and, the mask being causal, are never attended; the cache's
    padding positions are zeroed, so no stale value meets a zero weight. The projections, norms and rotary
    embedding are attention_block's, row for row. `backend`: SDPA's (None: cuDNN's on CUDA, the reason this path
    exists; the math one on the CPU, where a profile that asks for this path has the tests check it)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend is None:
        backend = SDPBackend.CUDNN_ATTENTION if x.is_cuda else SDPBackend.MATH

    T = x.shape[0]
    hd, kv = spec.head_dim, spec.kv_heads
    rep = spec.heads // kv
    bucket = spec.attention.whole_prompt_bucket
    padded = min(k_cache.shape[2], -(-T // bucket) * bucket)
    wq = _dense_weight(spec.q, w["q"])
    bq = w["q"][-1] if spec.q.bias else None
    # the other projections' INT4 weights dequantized once a layer too, not once a chunk (at 25k rows, 21
    # dequantizations a layer, 1,000 launches a prefill; 20 MB at the thinker's widths)
    dense = {n: _dense_weight(getattr(spec, n), w[n]) for n in ("k", "v", "o") if getattr(spec, n).int4}
    # every head's queries for every row, each chunk's rows normed and projected once for its keys, values and
    # queries together: normed again per KV group, their elementwise work and launches were a fifth of a long
    # video's prefill. The buffer (210 MB at 25k rows) is under what the deepstack levels hold at the prefill's peak.
    q = x.new_zeros((1, spec.heads, padded, hd))
    for s in range(0, T, chunk):
        e = min(T, s + chunk)
        h = _rms(x[s:e], w["ln1"], spec.eps)
        # the prompt's positions are the cache's first T: slices, where index_copy_'s kernel along the cache's
        # third dimension took ~0.1 ms a chunk; keys and queries normed and rotated straight into place
        k = _linear(h, spec.k, w["k"], dense.get("k")).view(e - s, kv, hd)
        norm_rope_into(k_cache[0, :, s:e], k, w["k_norm"], spec.qk_eps, cos[s:e], sin[s:e], spec.triton)
        v_cache[0, :, s:e] = _linear(h, spec.v, w["v"], dense.get("v")).view(e - s, kv, hd).transpose(0, 1)
        h = h.to(wq.dtype)
        if spec.q.k_run > spec.q.k:
            h = F.pad(h, (0, spec.q.k_run - spec.q.k))
        norm_rope_into(q[0, :, s:e], F.linear(h, wq, bq).view(e - s, spec.heads, hd), w["q_norm"], spec.qk_eps,
                       cos[s:e], sin[s:e], spec.triton)
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


__all__ = ["LinearSpec", "attention_block", "attention_block_long", "norm_rope_into", "without_cudnn_attention"]
