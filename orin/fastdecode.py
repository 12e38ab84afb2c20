"""Thinker decode with a static KV cache, one token per call, captured in a CUDA graph on the GPU.

Decoding one token through the HF modules with a dynamic cache costs ~3,000 kernel launches and a host sync
per MoE layer (the per-expert token counts): at batch 1 the GPU waits on Python. Here the step is the same math
over the same modules (norms, rotary, router, INT4 projections are called as they are), reorganised so that
nothing depends on host values:

- the KV cache is a fixed [1, kv_heads, max_len, head_dim] buffer per layer; the new key/value is written at the
  position held in a device tensor and attention masks the unused tail;
- grouped-query attention runs as one SDPA call with the query heads of a group as the query rows of its KV head;
- the MoE block gathers the 8 chosen experts' packed INT4 weights on the device and runs them as two matmuls:
  gate/up of all 8 concatenated along N (same input), down of all 8 concatenated along K (the routing weight
  applied to each expert's input first), which sums the experts inside the kernel. torch's int4pack layout is
  tile-local ([N/8, K/(16*tiles), 32, tiles/2]), so concatenating packed tiles is packing the concatenated
  matrix.

On CUDA the whole step (48 layers, lm_head) is captured once per weight placement and replayed per token; a
placement change (the thinker swapped out and back in) is detected from the tensors' addresses and recaptured.
On CPU the same code runs eagerly with the experts' own forward (tests compare it with the HF path).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger("orin.fastdecode")


def _int4_experts(module) -> bool:
    from .int4 import Int4Experts

    return isinstance(module, Int4Experts)


def fused_moe_int4(experts, h: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
    """One token's MoE output through the chosen experts of an Int4Experts (CUDA packed layout), no host sync.

    h [1, H] bf16, top_idx [1, k] long, top_w [1, k]. Returns [1, H] in h's dtype."""
    k = top_idx.shape[1]
    sel = top_idx.reshape(-1)
    H, inter = experts.hidden_dim, experts.intermediate_dim
    kg_gu, K_gu, Np_gu = experts._geom["gate_up"]
    kg_dn, K_dn, Np_dn = experts._geom["down"]
    x = h.to(experts.compute_dtype)
    if K_gu > H:
        x = F.pad(x, (0, K_gu - H))
    # gate/up: the k experts stacked along N (packed dim 0, scales dim 1).
    gu_w = experts.gate_up_packed.index_select(0, sel)
    gu_w = gu_w.reshape(k * gu_w.shape[1], *gu_w.shape[2:])
    gu_sz = experts.gate_up_scales_and_zeros.transpose(0, 1).index_select(1, sel)
    gu_sz = gu_sz.reshape(gu_sz.shape[0], k * Np_gu, 2)
    gu = torch.ops.aten._weight_int4pack_mm(x.contiguous(), gu_w, kg_gu, gu_sz).view(k, Np_gu)
    act = experts.act_fn(gu[:, :inter]) * gu[:, inter:2 * inter]
    act = act * top_w.reshape(k, 1).to(act.dtype)
    if K_dn > inter:
        act = F.pad(act, (0, K_dn - inter))
    # down: the k experts stacked along K (packed dim 1, scales dim 0): one matmul sums them.
    dn_w = experts.down_packed.transpose(0, 1).index_select(1, sel)
    dn_w = dn_w.reshape(dn_w.shape[0], k * dn_w.shape[2], *dn_w.shape[3:])
    dn_sz = experts.down_scales_and_zeros.index_select(0, sel)
    dn_sz = dn_sz.reshape(k * dn_sz.shape[1], Np_dn, 2)
    out = torch.ops.aten._weight_int4pack_mm(act.reshape(1, k * K_dn).contiguous(), dn_w, kg_dn, dn_sz)
    return out[:, :H].to(h.dtype)


class ThinkerDecoder:
    """Static-cache thinker decoding for one sequence. `start(cache, max_len)` after the HF prefill, then
    `step(token) -> logits [1, vocab]` per generated token."""

    def __init__(self, model, device: torch.device, graph: bool | None = None):
        thinker = model.thinker
        self.thinker = thinker
        self.lm = thinker.model.language_model
        self.cfg = self.lm.config
        self.device = device
        self.graph_enabled = device.type == "cuda" if graph is None else graph
        self.max_len = 0
        self.k_cache: list[torch.Tensor] = []
        self.v_cache: list[torch.Tensor] = []
        self._graph = None
        self._fingerprint = None
        self.length = 0
        self.captures = 0

    # ------------------------------------------------------------------ state

    def _weights(self) -> list[torch.Tensor]:
        tensors = [t for t in self.lm.parameters()] + [t for t in self.lm.buffers() if t is not None]
        tensors += [t for t in self.thinker.lm_head.parameters()]
        return tensors

    def _fused_ok(self) -> bool:
        return self.device.type == "cuda" and all(
            _int4_experts(getattr(layer.mlp, "experts", None)) for layer in self.lm.layers
            if hasattr(layer.mlp, "gate"))

    def _alloc(self, max_len: int) -> None:
        cfg = self.cfg
        dtype = self.lm.embed_tokens.weight.dtype
        shape = (1, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(cfg.num_hidden_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(cfg.num_hidden_layers)]
        self.positions = torch.arange(max_len, device=self.device)
        self.tok = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        self.idx = torch.zeros((1,), dtype=torch.long, device=self.device)
        self.delta = torch.zeros((1,), dtype=torch.long, device=self.device)
        self.max_len = max_len
        self._graph = None

    def release(self) -> None:
        """Drop the cache buffers and the graph (their memory goes back to the allocator)."""
        self.k_cache, self.v_cache, self._graph, self._fingerprint, self.max_len = [], [], None, None, 0

    def start(self, cache, max_len: int) -> ThinkerDecoder:
        """Take over the prefill's DynamicCache (keys/values copied into the static buffers)."""
        layers = cache.layers
        n = int(layers[0].keys.shape[2])
        if max_len > self.max_len or not self.k_cache:
            # Rounded up so that requests of similar length reuse the buffers and the captured graph.
            self._alloc(-(-max(max_len, n + 1) // 64) * 64)
        for i, layer in enumerate(layers):
            self.k_cache[i][:, :, :n].copy_(layer.keys)
            self.v_cache[i][:, :, :n].copy_(layer.values)
        deltas = self.thinker.model.rope_deltas
        self.delta.fill_(int(deltas.reshape(-1)[0]) if deltas is not None else 0)
        self.length = n
        return self

    # ------------------------------------------------------------------ the step

    def _attention(self, i: int, attn, h: torch.Tensor, cos, sin, mask) -> torch.Tensor:
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import apply_rotary_pos_emb

        hd = attn.head_dim
        q = attn.q_norm(attn.q_proj(h).view(1, 1, -1, hd)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(h).view(1, 1, -1, hd)).transpose(1, 2)
        v = attn.v_proj(h).view(1, 1, -1, hd).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        self.k_cache[i].index_copy_(2, self.idx, k)
        self.v_cache[i].index_copy_(2, self.idx, v)
        kv_heads = k.shape[1]
        # The query heads of group g are rows of one query block against KV head g (HF's repeat_kv order).
        qg = q.reshape(1, kv_heads, -1, hd)
        out = F.scaled_dot_product_attention(qg, self.k_cache[i], self.v_cache[i], attn_mask=mask,
                                             scale=attn.scaling)
        return attn.o_proj(out.reshape(1, 1, -1))

    def _mlp(self, mlp, h: torch.Tensor) -> torch.Tensor:
        if not hasattr(mlp, "gate"):
            return mlp(h)
        flat = h.reshape(1, -1)
        _, weights, index = mlp.gate(flat)
        if self.device.type == "cuda" and _int4_experts(mlp.experts):
            out = fused_moe_int4(mlp.experts, flat, index, weights)
        else:
            out = mlp.experts(flat, index, weights)
        return out.view_as(h)

    def _forward(self) -> torch.Tensor:
        lm = self.lm
        x = lm.embed_tokens(self.tok)
        pos = (self.idx + self.delta).view(1, 1, 1).expand(3, 1, 1)
        cos, sin = lm.rotary_emb(x, pos)
        mask = (self.positions <= self.idx).view(1, 1, 1, -1)
        for i, layer in enumerate(lm.layers):
            x = x + self._attention(i, layer.self_attn, layer.input_layernorm(x), cos, sin, mask)
            x = x + self._mlp(layer.mlp, layer.post_attention_layernorm(x))
        return self.thinker.lm_head(lm.norm(x))[:, -1]

    def _capture(self) -> None:
        torch.cuda.synchronize(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up: library handles and workspaces are made outside the capture
                self._forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._out = self._forward()
        self._graph = graph
        self.captures += 1

    def step(self, token: int) -> torch.Tensor:
        if self.length >= self.max_len:
            raise RuntimeError(f"static KV cache full ({self.max_len} positions); start() with a larger max_len")
        self.tok.fill_(token)
        self.idx.fill_(self.length)
        if self.graph_enabled and self._fused_ok():
            fingerprint = tuple(t.data_ptr() for t in self._weights())
            if self._graph is None or fingerprint != self._fingerprint:
                self._capture()
                self._fingerprint = fingerprint
            self._graph.replay()
            logits = self._out
            torch.cuda.current_stream(self.device).synchronize()  # the step's time is its own, not the next op's
        else:
            logits = self._forward()
        self.length += 1
        return logits


__all__ = ["ThinkerDecoder", "fused_moe_int4"]
