"""Qwen3-Omni's vision encoder: patchified pixels [patches, C*T*P*P] and their grids [(t, h, w), ...] to merged
image embeddings [patches / merge^2, out_hidden] and the deepstack features the first decoder layers add.

The module tree mirrors transformers' Qwen3OmniMoeVisionEncoder name for name and shape for shape (parameters and
buffers), so the checkpoint's `thinker.visual.*` tensors load into it by name, a state dict moves between the two
with strict=True, and INT4 conversion finds the block linears (`blocks.N.attn.qkv`, ...) as nn.Linear children
at the paths orin/checkpoint/targets.py names. The stages:

1. patch_embed: a Conv3d whose kernel equals its stride, i.e. one linear map of each flattened patch; we run it
   as that matmul (the same sums, no cuDNN 3D convolution for a [patches, 1536] input);
2. the learned side x side position table (48 x 48 in the real model), bilinearly resampled (align_corners) to
   each image's (h, w) grid, added;
3. `depth` pre-LayerNorm blocks: attention with 2D rotary embeddings (row and column angles, each over a quarter
   of the head) inside each frame of each image only, and a GELU MLP; after the blocks listed in
   `deepstack_visual_indexes` a post-shuffle merger (LayerNorm over 2x2 patches, MLP) gives a deepstack feature;
4. merger: LayerNorm per patch, 2x2 patches concatenated, MLP to the language model's width.

Shape logic, and why it is what it is: the processor already emits each image's patches in merge-block order
(every 2x2 block of patches contiguous, blocks in raster order, frames one after another), so merging is a
reshape, and the rotary angles and the position-table resampling follow that order: patch i of a frame sits at
row (i // (m*m*(w/m)))*m + (i // m) % m and column ((i // (m*m)) % (w/m))*m + i % m. A frame attends only to
itself (transformers' cu_seqlens give one segment per frame of each image). None of this depends on pixel values:
it is a function of the grids alone. `plan(grid_thw, device, dtype)` computes it on the host once per grid tuple,
device and compute dtype (cached): the rotary cos/sin tables [patches, 1, head_dim] (float32, as transformers
applies them), the four resampling taps and weights per patch, the attention structure and the merged tokens per
image. When every frame has the same number of patches (one image, a video, same-size images) attention is one SDPA
over a batch of frames with no mask, which keeps the fused kernels; otherwise one SDPA with a block-diagonal
additive mask, made once in the compute dtype (SDPA would otherwise turn a boolean mask into one in every layer).
forward then runs with no host syncs and no data-dependent control flow, so it can be captured in a CUDA graph
per grid (a captured graph must hold on to its VisionPlan; the cache keeps the last PLAN_CACHE_SIZE).

Inference only. Construction allocates no parameter storage on `device="meta"` (buffers are then computed on
the CPU, as the loader's params_on_meta does).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InputError, ModelError
from .fields import activation, declared_values

PLAN_CACHE_SIZE = 32
_LN_EPS = 1e-6


Grid = tuple[tuple[int, int, int], ...]


@dataclass(frozen=True)
class VisionConfig:
    """config.json's `thinker_config.vision_config`, with transformers' defaults for keys it leaves out."""

    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    rope_theta: float = 10000.0

    @classmethod
    def from_dict(cls, data: Mapping) -> VisionConfig:
        values = declared_values(cls, data, rope_default="axial", where="vision_config")
        for key in ("patch_size", "temporal_patch_size"):
            if not isinstance(values.get(key, 1), int):
                raise ModelError(f"vision_config: {key} must be one integer, got {values[key]!r}")
        if "deepstack_visual_indexes" in values:
            values["deepstack_visual_indexes"] = tuple(int(i) for i in values["deepstack_visual_indexes"])
        config = cls(**values)
        activation(config.hidden_act, "vision_config")
        if config.hidden_size % config.num_heads or (config.hidden_size // config.num_heads) % 4:
            raise ModelError("vision_config: hidden_size / num_heads must be a multiple of 4 (2D rotary halves)")
        side = int(config.num_position_embeddings ** 0.5)
        if side * side != config.num_position_embeddings:
            raise ModelError("vision_config: num_position_embeddings must be a square (a side x side table)")
        if any(not 0 <= i < config.depth for i in config.deepstack_visual_indexes):
            raise ModelError(f"vision_config: deepstack_visual_indexes {config.deepstack_visual_indexes} must "
                             f"name blocks 0..{config.depth - 1}")
        return config

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def grid_side(self) -> int:
        return int(self.num_position_embeddings ** 0.5)


@dataclass(frozen=True, eq=False)
class VisionPlan:
    """Everything forward needs that depends on the grids alone, on one device."""

    grid: Grid
    tokens: int  # patches in, sum of t*h*w
    merged_sizes: tuple[int, ...]  # merged tokens out, per image
    cos: torch.Tensor  # [tokens, 1, head_dim] float32
    sin: torch.Tensor
    pos_index: torch.Tensor  # [tokens, 4] into the flattened position table
    pos_weight: torch.Tensor  # [tokens, 4] float32 bilinear weights
    segments: int  # attention batch: frames of equal length, or 1 with `mask`
    mask: torch.Tensor | None  # [tokens, tokens] block-diagonal, 0 where attention is allowed, else -inf
    dtype: torch.dtype  # the compute dtype the mask is in


class VisionFeatures(NamedTuple):
    embeds: torch.Tensor  # [sum(merged_sizes), out_hidden], images one after another
    deepstack: list[torch.Tensor]  # one [sum(merged_sizes), out_hidden] per deepstack index

    def per_image(self, sizes: Sequence[int]) -> tuple[tuple[torch.Tensor, ...], list[tuple[torch.Tensor, ...]]]:
        """Split per image as transformers' get_image_features returns them (pooler_output, deepstack_features)."""
        sizes = list(sizes)
        return torch.split(self.embeds, sizes), [torch.split(f, sizes) for f in self.deepstack]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig, device=None, dtype=None):
        super().__init__()
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=kernel, stride=kernel, bias=True,
                              device=device, dtype=dtype)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        # kernel == stride over a single patch: the convolution is one matmul with the flattened kernel
        weight = self.proj.weight
        return F.linear(patches.to(weight.dtype), weight.reshape(weight.shape[0], -1), self.proj.bias)


class RotaryEmbedding(nn.Module):
    """The axial inverse frequencies (the two non-persistent buffers transformers keeps): head_dim/4 of them,
    shared by the row and the column angles."""

    def __init__(self, head_dim: int, theta: float, device=None):
        super().__init__()
        spatial = head_dim // 2
        inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float, device=device) / spatial))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    def tables(self, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self.inv_freq.to(device=rows.device, dtype=torch.float32)
        fh, fw = rows[:, None].float() * inv, cols[:, None].float() * inv
        cos = torch.cat((fh.cos(), fw.cos()), dim=-1)
        sin = torch.cat((fh.sin(), fw.sin()), dim=-1)
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: VisionConfig, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, cfg.hidden_size * 3, bias=True, **kw)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True, **kw)

    def forward(self, x: torch.Tensor, plan: VisionPlan) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv(x).view(tokens, 3, self.num_heads, self.head_dim).unbind(1)
        # rotary in float32 and back, as transformers applies it
        qf, kf = q.float(), k.float()
        q = (qf * plan.cos + _rotate_half(qf) * plan.sin).to(v.dtype)
        k = (kf * plan.cos + _rotate_half(kf) * plan.sin).to(v.dtype)
        shape = (plan.segments, tokens // plan.segments, self.num_heads, self.head_dim)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask, scale=self.head_dim ** -0.5)
        return self.proj(out.transpose(1, 2).reshape(tokens, -1))


class Mlp(nn.Module):
    def __init__(self, cfg: VisionConfig, device=None, dtype=None):
        super().__init__()
        kw = {"bias": True, "device": device, "dtype": dtype}
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, **kw)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, **kw)
        self.act = activation(cfg.hidden_act, "vision_config")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: VisionConfig, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=_LN_EPS, **kw)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=_LN_EPS, **kw)
        self.attn = Attention(cfg, **kw)
        self.mlp = Mlp(cfg, **kw)

    def forward(self, x: torch.Tensor, plan: VisionPlan) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), plan)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm, then merge^2 neighbouring patches concatenated, then Linear-GELU-Linear. The post-shuffle
    variant (the deepstack mergers) normalises after concatenating instead of before."""

    def __init__(self, cfg: VisionConfig, postshuffle: bool, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.width = cfg.hidden_size * cfg.spatial_merge_size ** 2
        self.postshuffle = postshuffle
        self.ln_q = nn.LayerNorm(self.width if postshuffle else cfg.hidden_size, eps=_LN_EPS, **kw)
        self.mlp = nn.ModuleList([nn.Linear(self.width, self.width, **kw), nn.GELU(),
                                  nn.Linear(self.width, cfg.out_hidden_size, **kw)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_q(x.reshape(-1, self.width)) if self.postshuffle else self.ln_q(x).reshape(-1, self.width)
        for layer in self.mlp:
            x = layer(x)
        return x


class VisionEncoder(nn.Module):
    """forward(pixel_values [patches, C*T*P*P], grid_thw) -> VisionFeatures(embeds, deepstack).

    `config` is config.json's `thinker_config.vision_config` (a mapping) or a VisionConfig. `grid_thw` is a
    [images, 3] tensor (keep it on the CPU: reading a CUDA tensor is a host sync), a sequence of (t, h, w), or a
    VisionPlan from `plan()`. Parameters are created on `device`/`dtype`; buffers on `device`, or on the CPU
    when `device` is meta."""

    def __init__(self, config: Mapping | VisionConfig, *, device=None, dtype=None):
        super().__init__()
        cfg = config if isinstance(config, VisionConfig) else VisionConfig.from_dict(config)
        self.config = cfg
        self.spatial_merge_size = cfg.spatial_merge_size
        buffer_device = None if device is None or torch.device(device).type == "meta" else device
        kw = {"device": device, "dtype": dtype}
        self.merger_list = nn.ModuleList(PatchMerger(cfg, True, **kw) for _ in cfg.deepstack_visual_indexes)
        self.patch_embed = PatchEmbed(cfg, **kw)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size, **kw)
        self.rotary_pos_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, buffer_device)
        self.blocks = nn.ModuleList(Block(cfg, **kw) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, False, **kw)
        self._deepstack_at = {layer: i for i, layer in enumerate(cfg.deepstack_visual_indexes)}
        self._plans: OrderedDict[tuple, VisionPlan] = OrderedDict()

    @property
    def deepstack_merger_list(self) -> nn.ModuleList:
        return self.merger_list

    def _grid(self, grid_thw) -> Grid:
        rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else list(grid_thw)
        m = self.spatial_merge_size
        try:
            grid = tuple((int(t), int(h), int(w)) for t, h, w in rows)
        except (TypeError, ValueError) as exc:
            raise InputError(f"grid_thw must be [(t, h, w), ...] per image, got {grid_thw!r}") from exc
        if not grid:
            raise InputError("grid_thw names no image; pass one (t, h, w) per image")
        for t, h, w in grid:
            if t < 1 or h < m or w < m or h % m or w % m:
                raise InputError(f"grid (t, h, w) = {(t, h, w)} is not a grid of whole {m}x{m} merge blocks; "
                                 "use the processor's image_grid_thw for these pixel values")
        return grid

    def plan(self, grid_thw, device=None, dtype=None) -> VisionPlan:
        """The per-grid tables on `device`, for activations of `dtype` (default: the patch embedding's),
        computed once and cached."""
        if isinstance(grid_thw, VisionPlan):
            return grid_thw
        grid = self._grid(grid_thw)
        weight = self.patch_embed.proj.weight
        device = torch.device(device) if device is not None else weight.device
        key = (grid, device, dtype or weight.dtype)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._build_plan(grid, *key[1:])
            self._plans[key] = plan
            while len(self._plans) > PLAN_CACHE_SIZE:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan

    prepare = plan  # fill the cache ahead of a CUDA-graph capture; hold on to the plan it returns

    def _frame_tables(self, h: int, w: int) -> tuple[torch.Tensor, ...]:
        """cos, sin, taps and weights of one h x w frame, in merge-block order, on the CPU."""
        m, side = self.spatial_merge_size, self.config.grid_side
        rows = torch.arange(h)[:, None].expand(h, w).reshape(h // m, m, w // m, m).transpose(1, 2).flatten()
        cols = torch.arange(w)[None, :].expand(h, w).reshape(h // m, m, w // m, m).transpose(1, 2).flatten()
        cos, sin = self.rotary_pos_emb.tables(rows, cols)
        h_taps, h_weights = _bilinear_taps(rows, h, side)
        w_taps, w_weights = _bilinear_taps(cols, w, side)
        index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
        weight = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
        return cos.cpu(), sin.cpu(), index, weight

    def _build_plan(self, grid: Grid, device: torch.device, dtype: torch.dtype) -> VisionPlan:
        frames: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        parts = []
        for t, h, w in grid:
            if (h, w) not in frames:
                frames[h, w] = self._frame_tables(h, w)
            parts.append([p.repeat(t, 1) for p in frames[h, w]])
        cos, sin, index, weight = (torch.cat(col, dim=0) for col in zip(*parts, strict=True))
        lengths = [h * w for t, h, w in grid for _ in range(t)]
        tokens = sum(lengths)
        mask = None
        segments = len(lengths)
        if len(set(lengths)) > 1:
            seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
            allowed = seg[:, None] == seg[None, :]
            mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf")).to(device)
            segments = 1
        m2 = self.spatial_merge_size ** 2
        return VisionPlan(
            grid=grid, tokens=tokens, merged_sizes=tuple(t * h * w // m2 for t, h, w in grid),
            cos=cos[:, None, :].to(device), sin=sin[:, None, :].to(device),
            pos_index=index.to(device), pos_weight=weight.to(device), segments=segments, mask=mask, dtype=dtype)

    def split_sizes(self, grid_thw) -> tuple[int, ...]:
        """Merged tokens per image: how `VisionFeatures.per_image` splits the output."""
        return self.plan(grid_thw).merged_sizes

    def forward(self, pixel_values: torch.Tensor, grid_thw) -> VisionFeatures:
        plan = self.plan(grid_thw, pixel_values.device)
        cfg = self.config
        if pixel_values.dim() != 2 or tuple(pixel_values.shape) != (plan.tokens, cfg.patch_dim):
            raise InputError(f"pixel_values must be [{plan.tokens}, {cfg.patch_dim}] for grids {list(plan.grid)}, "
                             f"got {list(pixel_values.shape)}; pass the processor's pixel_values and grid together")
        x = self.patch_embed(pixel_values)
        if plan.dtype != x.dtype:
            raise InputError(f"this plan was made for {plan.dtype} activations, the encoder computes in {x.dtype}; "
                             "make it with plan(grid_thw) after moving the encoder")
        # the four resampling taps summed in float32, then cast, as transformers does
        pos = (self.pos_embed(plan.pos_index) * plan.pos_weight[:, :, None]).sum(1)
        x = x + pos.to(x.dtype)
        deepstack = []
        for layer, block in enumerate(self.blocks):
            x = block(x, plan)
            if layer in self._deepstack_at:
                deepstack.append(self.merger_list[self._deepstack_at[layer]](x))
        return VisionFeatures(self.merger(x), deepstack)


def _bilinear_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two taps into a `side`-long table, and their weights, that F.interpolate(mode="bilinear",
    align_corners=True) uses to resample it to `size` positions, at positions `index` (float32 as in
    transformers, so the weights are bit-equal)."""
    src = index.to(torch.float32) * (side - 1) / max(size - 1, 1)
    floor = torch.floor(src)
    offsets = torch.arange(2)
    taps = floor.long()[:, None] + offsets
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps.clamp(0, side - 1), weights
