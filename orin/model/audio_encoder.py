"""Qwen3-Omni's audio encoder: log-mel features [128, frames] to audio tokens [tokens, output_dim].

The module tree mirrors transformers' Qwen3OmniMoeAudioEncoder name for name and shape for shape (parameters and
the non-persistent sinusoid buffer), so the checkpoint's `thinker.audio_tower.*` tensors load into it by name, a
state dict moves between the two with strict=True, and INT4 conversion can swap any projection (an nn.Linear
child under HF's name) for an Int4Linear. The computation:

1. each audio is cut into chunks of 2*n_window frames (the last one shorter), and every chunk is zero-padded to
   the longest chunk of the call;
2. three stride-2 3x3 convolutions with GELU over (mel, time), `conv_out` over (channels x mel), and the sinusoid
   position table added per chunk (positions restart at 0 in every chunk);
3. the chunks' valid tokens (the convolutions' output lengths) are the token sequence; the encoder layers attend
   within windows of `n_window_infer` frames' worth of tokens per audio (windows never cross audios);
4. ln_post, proj1, GELU, proj2.

Shape logic, and why it is what it is: the zero padding of step 1 is not cosmetic. A padded frame of one layer
becomes gelu(bias) after the next convolution, and the last valid output of a short chunk reads it, so the
result depends on the padded width; we reproduce transformers' layout exactly (pad to the longest chunk of the
call), not a per-chunk one. Transformers' window is (tokens of the longest chunk) * n_window_infer // (2*n_window),
so with every audio under one chunk the window covers each whole audio; with full chunks it is a whole number of
chunks (13 tokens each for n_window=50). Everything above is a function of the feature lengths (and of how the
input is laid out) alone, so it is computed on the host once per (lengths, layout, device) as an `AudioPlan` and
cached (a small LRU; lengths vary per request): the gather index from the input frames into the padded chunks, the
index from the chunks' token grid into a window-major layout [windows, longest window], the index back to token
order, the key mask of the partial windows, cu_seqlens and the output lengths. forward then runs with no host
syncs and no data-dependent Python control flow: the hidden states stay in the window-major layout through every
layer (padding rows are computed and ignored: they are masked as keys and dropped at the end), attention is one
SDPA call over the windows as a batch, and `prepare()` fills the cache before a CUDA-graph capture.

Inference only (no dropout). Construction allocates no parameter storage on `device="meta"` (the buffer is then
computed on the CPU, as the loader's params_on_meta does).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..audio_format import audio_token_count, conv_batch, conv_length
from ..errors import InputError, ModelError
from .fields import activation, declared_values

PLAN_CACHE_SIZE = 32


@dataclass(frozen=True)
class AudioEncoderConfig:
    """config.json's `thinker_config.audio_config`, with transformers' defaults for keys it leaves out."""

    num_mel_bins: int = 128
    encoder_layers: int = 32
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    d_model: int = 1280
    activation_function: str = "gelu"
    scale_embedding: bool = False  # transformers reads it and never applies it; neither do we
    max_source_positions: int = 1500
    n_window: int = 50
    output_dim: int = 3584
    n_window_infer: int = 800
    conv_chunksize: int = 500
    downsample_hidden_size: int = 480

    @classmethod
    def from_dict(cls, data: Mapping) -> AudioEncoderConfig:
        config = cls(**declared_values(cls, data))
        activation(config.activation_function, "audio_config")
        if config.d_model % config.encoder_attention_heads or config.d_model % 2:
            raise ModelError("audio_config: d_model must be even and a multiple of encoder_attention_heads")
        if config.n_window < 1 or config.n_window_infer < 2 * config.n_window:
            raise ModelError("audio_config: n_window must be >= 1 and n_window_infer >= 2 * n_window")
        if conv_length(2 * config.n_window) > config.max_source_positions:
            raise ModelError("audio_config: max_source_positions is shorter than one chunk's tokens")
        return config

    @property
    def conv_mel_bins(self) -> int:
        """Mel bins left after the three stride-2 convolutions."""
        return conv_length(self.num_mel_bins)


def _split(lengths: np.ndarray, size: int) -> np.ndarray:
    """Each length cut into pieces of `size`, the last piece shorter where it does not divide; concatenated."""
    counts = -(-lengths // size)
    pieces = np.full(int(counts.sum()), size, dtype=np.int64)
    tail = lengths % size
    pieces[np.cumsum(counts) - 1] = np.where(tail == 0, size, tail)
    return pieces


def _first_n(widths: np.ndarray, n: int) -> np.ndarray:
    """Flat indices, into a [len(widths), n] grid, of each row's first widths[row] cells, row-major."""
    return np.flatnonzero(np.arange(n)[None, :] < widths[:, None])


@dataclass(frozen=True)
class AudioPlan:
    """Everything forward needs that depends on the lengths only, as host ints and device index tensors."""

    feature_lengths: tuple[int, ...]
    output_lengths: tuple[int, ...]
    num_chunks: int
    chunk_frames: int  # padded frames per chunk (the longest chunk)
    chunk_tokens: int  # tokens per padded chunk after the convolutions
    num_windows: int
    window: int  # the longest attention window, in tokens: the window-major layout's row length
    frame_index: torch.Tensor  # [num_chunks * chunk_frames] rows of the input's frames (last row: zeros)
    window_index: torch.Tensor  # [num_windows * window] rows of the [num_chunks * chunk_tokens] token grid
    token_index: torch.Tensor  # [tokens] rows of the window-major layout, in token order
    key_mask: torch.Tensor | None  # [num_windows, 1, 1, window] True where a key is real; None if none padded
    cu_seqlens: torch.Tensor  # [num_windows + 1] int32 window boundaries in token order (transformers' form)

    @property
    def tokens(self) -> int:
        return sum(self.output_lengths)


def build_plan(cfg: AudioEncoderConfig, feature_lengths: Sequence[int], batch_frames: int | None,
               device: torch.device) -> AudioPlan:
    """The plan for audios of `feature_lengths` frames, laid out concatenated ([mel, sum(lengths)], when
    `batch_frames` is None) or as a padded batch ([batch, mel, batch_frames])."""
    lengths = np.asarray(feature_lengths, dtype=np.int64)
    chunk = 2 * cfg.n_window
    chunk_lens = _split(lengths, chunk)
    chunk_frames = int(chunk_lens.max())
    chunk_tokens = conv_length(chunk_frames)
    if batch_frames is None:
        sources, source_rows = np.arange(int(lengths.sum())), int(lengths.sum())
    else:
        sources, source_rows = _first_n(lengths, batch_frames), len(lengths) * batch_frames
    frame_index = np.full(len(chunk_lens) * chunk_frames, source_rows, dtype=np.int64)
    frame_index[_first_n(chunk_lens, chunk_frames)] = sources
    valid = _first_n(conv_length(chunk_lens), chunk_tokens)

    out_lens = np.array([audio_token_count(int(n), cfg.n_window) for n in lengths], dtype=np.int64)
    window_lens = _split(out_lens, chunk_tokens * (cfg.n_window_infer // chunk))
    window = int(window_lens.max())
    token_index = _first_n(window_lens, window)
    # padding rows copy token row 0: finite values whose keys are masked and whose queries are dropped
    window_index = np.zeros(len(window_lens) * window, dtype=np.int64)
    window_index[token_index] = valid
    key_mask = None
    if (window_lens != window).any():
        key_mask = torch.from_numpy(np.arange(window)[None, :] < window_lens[:, None])[:, None, None, :]
    cu = np.concatenate([[0], np.cumsum(window_lens)]).astype(np.int32)

    def dev(array) -> torch.Tensor:
        return torch.as_tensor(array).to(device)

    return AudioPlan(
        feature_lengths=tuple(int(n) for n in lengths), output_lengths=tuple(int(n) for n in out_lens),
        num_chunks=len(chunk_lens), chunk_frames=chunk_frames, chunk_tokens=chunk_tokens,
        num_windows=len(window_lens), window=window, frame_index=dev(frame_index),
        window_index=dev(window_index), token_index=dev(token_index),
        key_mask=None if key_mask is None else key_mask.to(device), cu_seqlens=dev(cu))


class SinusoidsPositionEmbedding(nn.Module):
    """Whisper's sinusoid table [length, channels] (sin half, cos half), as the non-persistent buffer
    transformers keeps; computed with the same ops so it is bit-equal."""

    def __init__(self, length: int, channels: int, max_timescale: float = 10000, device=None):
        super().__init__()
        increment = math.log(max_timescale) / (channels // 2 - 1)
        inv_timescales = torch.exp(-increment * torch.arange(channels // 2, device=device).float())
        scaled = torch.arange(length, device=device)[:, None] * inv_timescales[None, :]
        table = torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1)
        self.register_buffer("positional_embedding", table, persistent=False)


class AudioAttention(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.num_heads = cfg.encoder_attention_heads
        self.head_dim = cfg.d_model // cfg.encoder_attention_heads
        self.k_proj = nn.Linear(cfg.d_model, cfg.d_model, **kw)
        self.v_proj = nn.Linear(cfg.d_model, cfg.d_model, **kw)
        self.q_proj = nn.Linear(cfg.d_model, cfg.d_model, **kw)
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model, **kw)

    def forward(self, x: torch.Tensor, windows: int, key_mask: torch.Tensor | None) -> torch.Tensor:
        """x: [windows * window, d_model], window-major; each window attends within itself."""
        rows, dim = x.shape
        shape = (windows, rows // windows, self.num_heads, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, scale=self.head_dim ** -0.5)
        return self.out_proj(out.transpose(1, 2).reshape(rows, dim))


class AudioEncoderLayer(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig, device=None, dtype=None):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.self_attn = AudioAttention(cfg, **kw)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.d_model, **kw)
        self.fc1 = nn.Linear(cfg.d_model, cfg.encoder_ffn_dim, **kw)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, cfg.d_model, **kw)
        self.final_layer_norm = nn.LayerNorm(cfg.d_model, **kw)
        self.act = activation(cfg.activation_function, "audio_config")

    def forward(self, x: torch.Tensor, windows: int, key_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), windows, key_mask)
        x = x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))
        if x.dtype == torch.float16:
            # transformers clamps float16 activations off infinity after every layer
            limit = torch.finfo(torch.float16).max - 1000
            x = x.clamp(min=-limit, max=limit)
        return x


class AudioEncoder(nn.Module):
    """forward(input_features, feature_lengths) -> audio tokens [sum(output_lengths), output_dim].

    `config` is config.json's `thinker_config.audio_config` (a mapping) or an AudioEncoderConfig. Parameters are
    created on `device`/`dtype`; the sinusoid buffer on `device`, or on the CPU when `device` is meta."""

    def __init__(self, config: Mapping | AudioEncoderConfig, *, device=None, dtype=None):
        super().__init__()
        cfg = config if isinstance(config, AudioEncoderConfig) else AudioEncoderConfig.from_dict(config)
        self.config = cfg
        buffer_device = None if device is None or torch.device(device).type == "meta" else device
        kw = {"device": device, "dtype": dtype}
        hidden = cfg.downsample_hidden_size
        self.positional_embedding = SinusoidsPositionEmbedding(cfg.max_source_positions, cfg.d_model,
                                                               device=buffer_device)
        self.layers = nn.ModuleList(AudioEncoderLayer(cfg, **kw) for _ in range(cfg.encoder_layers))
        self.ln_post = nn.LayerNorm(cfg.d_model, **kw)
        self.conv2d1 = nn.Conv2d(1, hidden, 3, 2, padding=1, **kw)
        self.conv2d2 = nn.Conv2d(hidden, hidden, 3, 2, padding=1, **kw)
        self.conv2d3 = nn.Conv2d(hidden, hidden, 3, 2, padding=1, **kw)
        self.conv_out = nn.Linear(hidden * cfg.conv_mel_bins, cfg.d_model, bias=False, **kw)
        self.proj1 = nn.Linear(cfg.d_model, cfg.d_model, **kw)
        self.proj2 = nn.Linear(cfg.d_model, cfg.output_dim, **kw)
        self.act = activation(cfg.activation_function, "audio_config")
        self._plans: OrderedDict[tuple, AudioPlan] = OrderedDict()

    def plan(self, feature_lengths, batch_frames: int | None = None, device=None) -> AudioPlan:
        """The cached plan for these lengths and layout (see build_plan); `feature_lengths` are host ints (a
        CUDA tensor here would cost a sync: pass the feature attention mask's sums from the CPU)."""
        if isinstance(feature_lengths, torch.Tensor):
            feature_lengths = feature_lengths.tolist()
        lengths = tuple(int(n) for n in feature_lengths)
        if not lengths or min(lengths) < 1:
            raise InputError(f"audio feature lengths must be one or more positive frame counts, got {lengths}")
        if batch_frames is not None and max(lengths) > batch_frames:
            raise InputError(f"audio feature lengths {lengths} exceed the batch's {batch_frames} frames")
        device = torch.device(device) if device is not None else self.conv2d1.weight.device
        key = (lengths, batch_frames, device)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = build_plan(self.config, lengths, batch_frames, device)
            if len(self._plans) > PLAN_CACHE_SIZE:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan

    def prepare(self, feature_lengths, batch_frames: int | None = None, device=None) -> AudioPlan:
        """Fill the plan cache for these lengths, e.g. before a CUDA-graph capture."""
        return self.plan(feature_lengths, batch_frames, device)

    def forward(self, input_features: torch.Tensor, feature_lengths) -> torch.Tensor:
        """input_features: [num_mel_bins, sum(lengths)] (the audios concatenated, as transformers' audio tower
        takes them) or [batch, num_mel_bins, frames] (padded, as the feature extractor gives them, with
        feature_lengths the feature attention mask's row sums)."""
        mel = self.config.num_mel_bins
        if input_features.dim() not in (2, 3) or input_features.shape[-2] != mel:
            raise InputError(f"audio features must be [{mel}, frames] or [batch, {mel}, frames], "
                             f"got {list(input_features.shape)}")
        batched = input_features.dim() == 3
        plan = self.plan(feature_lengths, input_features.shape[-1] if batched else None, input_features.device)
        if batched and input_features.shape[0] != len(plan.feature_lengths):
            raise InputError(f"{input_features.shape[0]} audios in the batch but {len(plan.feature_lengths)} "
                             "feature lengths")
        if not batched and input_features.shape[-1] != sum(plan.feature_lengths):
            raise InputError(f"audio features have {input_features.shape[-1]} frames but the lengths sum to "
                             f"{sum(plan.feature_lengths)}")
        dtype = self.conv2d1.weight.dtype
        frames = input_features.transpose(-1, -2).reshape(-1, mel).to(dtype)
        frames = F.pad(frames, (0, 0, 0, 1))  # the zero row every chunk's padding reads
        x = frames.index_select(0, plan.frame_index).view(plan.num_chunks, plan.chunk_frames, mel)
        x = x.transpose(1, 2).unsqueeze(1)
        convolved = []
        size = self.config.conv_chunksize
        for part in x.split(size, dim=0):  # bounds the convolutions' activation memory
            n, batch = part.shape[0], conv_batch(part.shape[0], size)
            if batch > n:  # a recurring shape (see conv_batch); each chunk is convolved on its own
                part = torch.cat([part, part.new_zeros((batch - n, *part.shape[1:]))])
            part = F.gelu(self.conv2d1(part))
            part = F.gelu(self.conv2d2(part))
            convolved.append(F.gelu(self.conv2d3(part))[:n])
        x = torch.cat(convolved) if len(convolved) > 1 else convolved[0]
        chunks, channels, bins, steps = x.shape
        x = self.conv_out(x.permute(0, 3, 1, 2).reshape(chunks, steps, channels * bins))
        x = x + self.positional_embedding.positional_embedding[:steps].to(x.dtype)
        h = x.reshape(chunks * steps, -1).index_select(0, plan.window_index)
        for layer in self.layers:
            h = layer(h, plan.num_windows, plan.key_mask)
        h = self.ln_post(h.index_select(0, plan.token_index))
        return self.proj2(self.act(self.proj1(h)))
