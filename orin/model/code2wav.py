"""Qwen3-Omni's code2wav: codec frames [B, num_quantizers, frames] to a 24 kHz waveform [B, 1, samples].

The module tree mirrors transformers' Qwen3OmniMoeCode2Wav name for name and shape for shape (parameters and
buffers), so the checkpoint's `code2wav.*` tensors load into it by name and a state dict moves between the two
with strict=True. The stages:

1. embed: each quantizer's code is offset into one shared table (`code_offset`) and the groups are averaged;
2. pre_transformer: RMSNorm decoder layers with RoPE and sliding-window causal self-attention (`sliding_window`
   keys, the query's own included), layer-scaled residuals, a final RMSNorm;
3. upsample: per ratio, a transposed convolution with kernel == stride (no overlap) and a ConvNeXt block;
4. decoder: a causal convolution to `decoder_dim`, one block per rate (SnakeBeta, a transposed convolution with
   kernel 2*rate, three dilated residual units), SnakeBeta, a causal convolution to one channel, clamp to [-1, 1].

Shape logic, and why it is what it is: every causal convolution here has stride 1, so transformers' "extra
padding" is always zero and the convolution is a left pad of (kernel-1)*dilation and a valid convolution: the
length is kept. Its transposed convolutions crop kernel-stride samples from each side of their output; with
kernel 2*rate that leaves (n-1)*rate samples, not n*rate, so a chunk of n frames yields n*total_upsample minus a
constant number of samples (the vocoder cuts the left context off the front, where whole frames are intact). We
do that crop as the transposed convolution's own `padding` (the same sums, the edge samples never computed).
Every length is a function of the frame count alone; the only host-side work per length (the RoPE tables and,
beyond `sliding_window` frames, the attention mask) is computed once per (frames, device, dtype) and cached, and
`prepare()` fills those caches ahead of a CUDA-graph capture. forward has no host syncs.

Inference only: no dropout, no KV cache (each chunk is decoded from scratch with its left context).
Construction allocates no parameter storage on `device="meta"` (buffers are then computed on the CPU, as the
loader's params_on_meta does); nn modules' own init runs only on real devices.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InputError, ModelError
from .fields import activation, declared_values


@dataclass(frozen=True)
class Code2WavConfig:
    """config.json's `code2wav_config`, with transformers' defaults for keys it leaves out."""

    codebook_size: int = 2048
    num_quantizers: int = 16
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 8
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int | None = None
    hidden_act: str = "silu"
    attention_bias: bool = False
    rms_norm_eps: float = 1e-5
    layer_scale_initial_scale: float = 0.01
    sliding_window: int = 72
    rope_theta: float = 10000.0
    decoder_dim: int = 1536
    upsample_rates: tuple[int, ...] = (8, 5, 4, 3)
    upsampling_ratios: tuple[int, ...] = (2, 2)

    @classmethod
    def from_dict(cls, data: Mapping) -> Code2WavConfig:
        values = declared_values(cls, data, rope_default="default", where="code2wav_config")
        for key in ("upsample_rates", "upsampling_ratios"):
            if key in values:
                values[key] = tuple(int(v) for v in values[key])
        config = cls(**values)
        activation(config.hidden_act, "code2wav_config")
        if config.num_attention_heads % config.num_key_value_heads:
            raise ModelError("code2wav_config: num_attention_heads must be a multiple of num_key_value_heads")
        return config

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def total_upsample(self) -> int:
        return math.prod(self.upsample_rates + self.upsampling_ratios)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalised in float32 whatever the weights' dtype, as transformers does
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class LayerScale(nn.Module):
    def __init__(self, dim: int, initial: float, device=None, dtype=None):
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), initial, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x


class RotaryEmbedding(nn.Module):
    """RoPE inverse frequencies (the two non-persistent buffers transformers keeps) and cos/sin tables per
    length; positions restart at 0 in every chunk."""

    def __init__(self, head_dim: int, theta: float, device=None):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, frames: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        key = (frames, device, dtype)
        if key not in self._tables:
            positions = torch.arange(frames, device=device, dtype=torch.float32)
            freqs = positions[:, None] * self.inv_freq.to(device=device, dtype=torch.float32)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._tables[key] = (emb.cos().to(dtype), emb.sin().to(dtype))
        return self._tables[key]


class Attention(nn.Module):
    def __init__(self, cfg: Code2WavConfig, device=None, dtype=None):
        super().__init__()
        kw = {"bias": cfg.attention_bias, "device": device, "dtype": dtype}
        self.head_dim = cfg.dim_per_head
        self.kv_groups = cfg.num_attention_heads // cfg.num_key_value_heads
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * self.head_dim, **kw)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * self.head_dim, **kw)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * self.head_dim, **kw)
        self.o_proj = nn.Linear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size, **kw)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None):
        batch, frames, _ = x.shape
        shape = (batch, frames, -1, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if self.kv_groups > 1:
            k = k.repeat_interleave(self.kv_groups, dim=1)
            v = v.repeat_interleave(self.kv_groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                             scale=self.head_dim ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(batch, frames, -1))


class Mlp(nn.Module):
    def __init__(self, cfg: Code2WavConfig, device=None, dtype=None):
        super().__init__()
        kw = {"bias": False, "device": device, "dtype": dtype}
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, **kw)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, **kw)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, **kw)
        self.act = activation(cfg.hidden_act, "code2wav_config")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class TransformerLayer(nn.Module):
    def __init__(self, cfg: Code2WavConfig, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.self_attn = Attention(cfg, **kw)
        self.mlp = Mlp(cfg, **kw)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale, **kw)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size, cfg.layer_scale_initial_scale, **kw)

    def forward(self, x, cos, sin, mask):
        x = x + self.self_attn_layer_scale(self.self_attn(self.input_layernorm(x), cos, sin, mask))
        return x + self.mlp_layer_scale(self.mlp(self.post_attention_layernorm(x)))


class PreTransformer(nn.Module):
    def __init__(self, cfg: Code2WavConfig, device=None, dtype=None, buffer_device=None):
        super().__init__()
        self.window = cfg.sliding_window
        self.layers = nn.ModuleList(TransformerLayer(cfg, device, dtype) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.rotary_emb = RotaryEmbedding(cfg.dim_per_head, cfg.rope_theta, buffer_device)
        self._masks: dict[tuple, torch.Tensor | None] = {}

    def mask(self, frames: int, device: torch.device) -> torch.Tensor | None:
        """None (plain causal attention, the fast kernels) while the window covers every earlier frame; else a
        boolean [frames, frames] mask, True where key j is in query i's window: i - window < j <= i."""
        key = (frames, device)
        if key not in self._masks:
            if frames <= self.window:
                self._masks[key] = None
            else:
                i = torch.arange(frames, device=device)
                offset = i[:, None] - i[None, :]
                self._masks[key] = (offset >= 0) & (offset < self.window)
        return self._masks[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frames = x.shape[1]
        cos, sin = self.rotary_emb.tables(frames, x.device, x.dtype)
        mask = self.mask(frames, x.device)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)


class CausalConv(nn.Module):
    """Stride-1 causal convolution: left pad (kernel-1)*dilation, output as long as the input."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1, groups: int = 1, device=None,
                 dtype=None):
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, dilation=dilation, groups=groups, device=device, dtype=dtype)
        self.left = (kernel - 1) * dilation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (self.left, 0)))


class CausalTransConv(nn.Module):
    """Transposed convolution cropped by kernel-stride samples on both sides (the crop as its padding)."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, device=None, dtype=None):
        super().__init__()
        self.conv = nn.ConvTranspose1d(cin, cout, kernel, stride=stride, padding=kernel - stride, device=device,
                                       dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.dwconv = CausalConv(dim, dim, 7, groups=dim, **kw)
        self.norm = nn.LayerNorm(dim, eps=1e-6, **kw)
        self.pwconv1 = nn.Linear(dim, 4 * dim, **kw)
        self.pwconv2 = nn.Linear(4 * dim, dim, **kw)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6, **kw))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.dwconv(x).transpose(1, 2))
        h = self.gamma * self.pwconv2(F.gelu(self.pwconv1(h)))
        return x + h.transpose(1, 2)


class SnakeBeta(nn.Module):
    """x + 1/exp(beta) * sin^2(x * exp(alpha)), per channel, on [B, C, T]."""

    def __init__(self, dim: int, device=None, dtype=None):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))
        self.beta = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = torch.exp(self.alpha)[None, :, None]
        beta = torch.exp(self.beta)[None, :, None]
        return x + (1.0 / (beta + 1e-9)) * torch.pow(torch.sin(x * alpha), 2)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.act1 = SnakeBeta(dim, **kw)
        self.conv1 = CausalConv(dim, dim, 7, dilation=dilation, **kw)
        self.act2 = SnakeBeta(dim, **kw)
        self.conv2 = CausalConv(dim, dim, 1, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.act2(self.conv1(self.act1(x))))


class DecoderBlock(nn.Module):
    def __init__(self, cin: int, cout: int, rate: int, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.block = nn.ModuleList([SnakeBeta(cin, **kw), CausalTransConv(cin, cout, 2 * rate, rate, **kw)]
                                   + [ResidualUnit(cout, d, **kw) for d in (1, 3, 9)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in self.block:
            x = module(x)
        return x


class Code2Wav(nn.Module):
    """forward(codes [B, num_quantizers, frames] int64) -> waveform [B, 1, samples] in [-1, 1].

    `config` is config.json's `code2wav_config` (a mapping) or a Code2WavConfig. Parameters are created on
    `device`/`dtype`; buffers on `device`, or on the CPU when `device` is meta."""

    def __init__(self, config: Mapping | Code2WavConfig, *, device=None, dtype=None):
        super().__init__()
        cfg = config if isinstance(config, Code2WavConfig) else Code2WavConfig.from_dict(config)
        self.config = cfg
        self.total_upsample = cfg.total_upsample
        buffer_device = None if device is None or torch.device(device).type == "meta" else device
        kw = {"device": device, "dtype": dtype}
        self.pre_transformer = PreTransformer(cfg, buffer_device=buffer_device, **kw)
        self.code_embedding = nn.Embedding(cfg.codebook_size * cfg.num_quantizers, cfg.hidden_size, **kw)
        offset = torch.arange(cfg.num_quantizers, device=buffer_device).view(1, -1, 1) * cfg.codebook_size
        self.register_buffer("code_offset", offset, persistent=False)
        self.upsample = nn.ModuleList(
            nn.ModuleList([CausalTransConv(cfg.hidden_size, cfg.hidden_size, r, r, **kw),
                           ConvNeXtBlock(cfg.hidden_size, **kw)])
            for r in cfg.upsampling_ratios)
        dims = [cfg.decoder_dim // 2 ** i for i in range(len(cfg.upsample_rates) + 1)]
        self.decoder = nn.ModuleList(
            [CausalConv(cfg.hidden_size, cfg.decoder_dim, 7, **kw)]
            + [DecoderBlock(dims[i], dims[i + 1], rate, **kw) for i, rate in enumerate(cfg.upsample_rates)]
            + [SnakeBeta(dims[-1], **kw), CausalConv(dims[-1], 1, 7, **kw)])

    def prepare(self, frames: int, device=None, dtype=None) -> None:
        """Fill the per-length caches (RoPE tables, attention mask) for `frames`, e.g. before a CUDA-graph
        capture; device and dtype default to the code embedding's."""
        weight = self.code_embedding.weight
        device = torch.device(device) if device is not None else weight.device
        self.pre_transformer.rotary_emb.tables(frames, device, dtype or weight.dtype)
        self.pre_transformer.mask(frames, device)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        if codes.dim() != 3 or codes.shape[1] != self.config.num_quantizers:
            raise InputError(f"code2wav takes codes [batch, {self.config.num_quantizers}, frames], "
                             f"got {list(codes.shape)}")
        hidden = self.code_embedding(codes + self.code_offset).mean(1)
        hidden = self.pre_transformer(hidden).transpose(1, 2)
        for blocks in self.upsample:
            for block in blocks:
                hidden = block(hidden)
        for block in self.decoder:
            hidden = block(hidden)
        return hidden.clamp(min=-1, max=1)

    def chunked_decode(self, codes: torch.Tensor, chunk_size: int = 300, left_context_size: int = 25):
        """Decode `chunk_size` frames at a time, each with up to `left_context_size` frames before it, and
        join the chunks' new samples; the schedule of transformers' chunked_decode."""
        wavs, start, frames = [], 0, codes.shape[-1]
        while start < frames:
            end = min(start + chunk_size, frames)
            ctx = min(left_context_size, start)
            wavs.append(self(codes[..., start - ctx:end])[..., ctx * self.total_upsample:])
            start = end
        return torch.cat(wavs, dim=-1)
