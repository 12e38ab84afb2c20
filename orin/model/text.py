"""The decoders' module trees (the thinker's and the talker's MoE text decoders, the code predictor), built from
orin.model.config with transformers' parameter names and shapes, so a checkpoint's tensors load into them by
name and GPTQ's module paths (`...mlp.experts`, `...self_attn.q_proj`) find the modules they name.

These modules hold the weights; the layer math is orin.runtime.layer's pure function (orin.runtime.decode runs it), so a
decoder layer here has no forward of its own. What orin.runtime.decode calls directly has one: the RMS norms, the
rotary tables and the experts (the BF16 experts' per-expert loop, used on CPU and where a checkpoint keeps the
experts unquantized; INT4 experts are orin.int4.linear's shells, swapped in by the loader).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ModelError
from .config import CodePredictorConfig, TextConfig


def silu_module(name: str, where: str) -> nn.Module:
    """The decoders' activation as a module: orin.runtime.layer computes SiLU gates only (Qwen3-Omni's)."""
    if name not in ("silu", "swish"):
        raise ModelError(f"{where}.hidden_act is {name!r}; orin-omni's decoder layers run SiLU (Qwen3-Omni's)")
    return nn.SiLU()


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in float32, the weight applied after the cast back: transformers' order, so outputs are bit-equal
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)


def _inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


class MRopeTables(nn.Module):
    """cos/sin of the thinker's and talker's interleaved M-RoPE: frequency i takes its position from the time
    axis, except every third one from 1 (height) and from 2 (width) within their sections, then the halves are
    repeated (rotate-half layout). forward(x, position_ids [3, B, T] or [B, T]) -> (cos, sin) [B, T, head_dim]
    in x's dtype."""

    def __init__(self, config: TextConfig):
        super().__init__()
        self.register_buffer("inv_freq", _inv_freq(config.rope_theta, config.head_dim), persistent=False)
        half = config.head_dim // 2
        axis = torch.zeros(half, dtype=torch.long)
        for dim, offset in ((1, 1), (2, 2)):
            axis[offset:config.mrope_section[dim] * 3:3] = dim
        self.register_buffer("axis", axis, persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        position_ids = position_ids.expand(3, -1, -1)
        freqs = position_ids[..., None].float() * self.inv_freq.to(x.device)  # [3, B, T, half]
        index = self.axis.to(x.device).view(1, 1, 1, -1).expand(1, *freqs.shape[1:])
        freqs = freqs.gather(0, index)[0]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class RopeTables(nn.Module):
    """Plain RoPE (the code predictor's): forward(x, position_ids [B, T]) -> (cos, sin) [B, T, head_dim]."""

    def __init__(self, theta: float, head_dim: int):
        super().__init__()
        self.register_buffer("inv_freq", _inv_freq(theta, head_dim), persistent=False)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(x.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: TextConfig | CodePredictorConfig):
        super().__init__()
        hd, bias = config.head_dim, config.attention_bias
        self.head_dim = hd
        self.scaling = hd ** -0.5
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * hd, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * hd, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * hd, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * hd, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(hd, config.rms_norm_eps)
        self.k_norm = RMSNorm(hd, config.rms_norm_eps)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: nn.Module):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act_fn = act


def topk_routing(logits: torch.Tensor, top_k: int, norm_topk: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' top-k routing of router logits [T, E]: softmax in float32, top-k, renormalised where
    norm_topk, the weights back in the logits' dtype -> (top_k_weights, top_k_index)."""
    top_w, top_i = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float), top_k, dim=-1)
    if norm_topk:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return top_w.to(logits.dtype), top_i


class Router(nn.Module):
    def __init__(self, config: TextConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top_k_weights, top_k_index) of h [T, H]. orin.runtime.layer routes inside its layer function (the
        same topk_routing, or its Triton kernel); this is the router alone, for the experts' checks and the kernel
        benchmark."""
        return topk_routing(F.linear(h, self.weight), self.top_k, self.norm_topk_prob)


class Experts(nn.Module):
    """The fused BF16 experts (gate_up_proj [E, 2I, H], down_proj [E, H, I]). forward(h [T, H], top_k_index
    [T, k], top_k_weights [T, k]) -> [T, H]: each chosen expert over its tokens, weighted and summed. Python
    loops over the experts hit (a host sync per layer): the INT4 shell that replaces this module on the device
    is what runs fast; this runs on CPU and for checkpoints that keep experts in BF16."""

    def __init__(self, config: TextConfig, act: nn.Module):
        super().__init__()
        self.num_experts = config.num_experts
        self.hidden_dim = config.hidden_size
        self.intermediate_dim = config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))
        self.act_fn = act

    def forward(self, h: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(h)
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // top_k_index.shape[1]
        weights = top_k_weights.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts[:self.num_experts]):
            if n == 0:
                continue
            rows, w = tokens[start:start + n], weights[start:start + n]
            start += n
            gate, up = F.linear(h[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act_fn(gate) * up, self.down_proj[e]) * w[:, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out


class SparseMoe(nn.Module):
    def __init__(self, config: TextConfig, act: nn.Module, shared: bool):
        super().__init__()
        self.gate = Router(config)
        self.experts = Experts(config, act)
        if shared:
            self.shared_expert = MLP(config.hidden_size, config.shared_expert_intermediate_size, act)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)


class DecoderLayer(nn.Module):
    def __init__(self, config: TextConfig | CodePredictorConfig, mlp: nn.Module):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class TextModel(nn.Module):
    """A MoE decoder stack. The thinker's embeds text tokens (`embed_tokens`); the talker's embeds codec codes
    (`codec_embedding`) and has a shared expert beside the routed ones in every layer."""

    def __init__(self, config: TextConfig, where: str, talker: bool = False):
        super().__init__()
        self.config = config
        act = silu_module(config.hidden_act, where)
        if talker:
            if config.shared_expert_intermediate_size < 1:
                raise ModelError(f"{where}.shared_expert_intermediate_size must be positive for the talker")
            self.codec_embedding = nn.Embedding(config.vocab_size, config.hidden_size)
            mlps = [SparseMoe(config, act, shared=True) for _ in range(config.num_hidden_layers)]
        else:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            mlps = [SparseMoe(config, act, shared=False) if config.is_moe_layer(i)
                    else MLP(config.hidden_size, config.intermediate_size, act)
                    for i in range(config.num_hidden_layers)]
        self.layers = nn.ModuleList(DecoderLayer(config, mlp) for mlp in mlps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = MRopeTables(config)


class CodePredictorModel(nn.Module):
    """The code predictor's dense decoder and one codec embedding per residual group."""

    def __init__(self, config: CodePredictorConfig, where: str):
        super().__init__()
        self.config = config
        act = silu_module(config.hidden_act, where)
        self.layers = nn.ModuleList(DecoderLayer(config, MLP(config.hidden_size, config.intermediate_size, act))
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RopeTables(config.rope_theta, config.head_dim)
        self.codec_embedding = nn.ModuleList(nn.Embedding(config.vocab_size, config.hidden_size)
                                             for _ in range(config.num_code_groups - 1))


__all__ = ["CodePredictorModel", "Experts", "MRopeTables", "RMSNorm", "RopeTables", "TextModel"]
