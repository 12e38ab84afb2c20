"""The request's videos (orin.inputs.video.Video: sampled, resized frames) as the vision encoder's patches, the layout
transformers' Qwen2VLVideoProcessor gives under the checkpoint's image settings (Qwen3-Omni ships no separate
video settings: its video processor reads preprocessor_config.json's mean, std and rescale factor), each video's
`video_grid_thw`, its `video_second_per_grid`, and the placeholder tokens it becomes.

Shape logic, as Qwen2-VL's processors do it: the frames [T, H, W, C] are padded to a multiple of the temporal
patch (2) by repeating the last frame, and every two consecutive frames form one temporal grid; the patch of a
grid at (row, column) is the [C, 2, P, P] block of both frames, flattened channel-major; patches are in merge-block
order (every 2x2 block contiguous, blocks in raster order), grids one after another. A video of T frames of H x W
becomes T/2 * (H/32) * (W/32) `<|video_pad|>` tokens.

Audio in video, as Qwen3OmniMoeProcessor.replace_video_with_audio_token lays it out: the placeholder becomes
`<|audio_start|>`, then each temporal grid's video tokens at the grid's time (g * second_per_grid *
position_id_per_seconds, in position ids) with the audio tokens (one position each, 13 a second) whose index is
smaller than that time before it, the rest of the audio after the last grid, then `<|audio_end|>`; the chat
template's `<|vision_start|>`/`<|vision_end|>` stay around it. The frames carry no resizing here: orin.inputs.video
already sized them to 32-pixel tiles under the per-frame cap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InputError
from .image_patches import ImagePatcher

PATCHIFY_GRIDS = 16  # temporal grids patchified at once


@dataclass(frozen=True)
class VideoPatches:
    pixel_values: torch.Tensor  # [patches, C * T * P * P] float32 ("pixel_values_videos"), on the device asked for
    video_grid_thw: torch.Tensor  # [n_video, 3] int64, on the host
    second_per_grid: tuple[float, ...]  # seconds one temporal grid spans, per video
    token_counts: tuple[int, ...]  # `<|video_pad|>` tokens of each video


class VideoPatcher:
    """The video side of one checkpoint's processor; `__call__` patchifies the videos of one prompt."""

    def __init__(self, images: ImagePatcher):
        self.images = images  # the image side's settings and value tables: a video's frames are normalised alike
        self.settings = images.settings

    def grid(self, video) -> tuple[int, int, int]:
        """(t, h, w) patch grid of one video, checking that its frames tile."""
        s = self.settings
        frames = np.asarray(video.frames)
        if frames.ndim != 4 or frames.shape[3] != 3 or frames.dtype != np.uint8 or frames.shape[0] == 0:
            raise InputError(f"a video's frames must be [T, H, W, 3] uint8 with T > 0, not {frames.shape} "
                             f"{frames.dtype}; decode it with orin.inputs.video.load_video")
        t, height, width = frames.shape[:3]
        if height % s.factor or width % s.factor:
            raise InputError(f"video frames of {width}x{height} pixels: sides must be multiples of {s.factor} "
                             "(orin.inputs.video.load_video sizes them so)")
        return -(-t // s.temporal_patch_size), height // s.patch_size, width // s.patch_size

    def __call__(self, videos: Sequence, device: str | torch.device | None = None,
                 dtype: torch.dtype = torch.float32) -> VideoPatches:
        """`dtype`: of the pixel values. The vision encoder casts them to its own dtype first thing, and a value
        cast from the float32 table is the same value whether cast here or there: asking for the encoder's dtype
        halves a long clip's pixel values (120 s at 2 fps and 448²: 1.2 GB in float32) at no cost in accuracy."""
        lazy = self.lazy(videos, dtype)
        device = torch.device(device or "cpu")
        out = torch.empty((sum(t * h * w for t, h, w in lazy.grids), lazy.patch_dim), dtype=dtype, device=device)
        row = 0
        for v, (t, h, w) in enumerate(lazy.grids):
            for first in range(0, t, PATCHIFY_GRIDS):  # a few grids at a time: the temporaries stay small
                last = min(t, first + PATCHIFY_GRIDS)
                n = (last - first) * h * w
                out[row:row + n] = lazy.patches(v, first, last, device)
                row += n
        return VideoPatches(out, torch.tensor(lazy.grids, dtype=torch.int64), lazy.second_per_grid,
                            lazy.token_counts)

    def lazy(self, videos: Sequence, dtype: torch.dtype = torch.float32) -> LazyVideoPixels:
        """The videos' grids and token counts now, their pixel values when asked (LazyVideoPixels.patches)."""
        s = self.settings
        grids, seconds = [], []
        for video in videos:
            grids.append(self.grid(video))
            if not (isinstance(video.fps, (int, float)) and math.isfinite(video.fps) and video.fps > 0):
                raise InputError(f"a video's sampling rate must be positive, not {video.fps!r}")
            seconds.append(s.temporal_patch_size / float(video.fps))
        if not grids:
            raise InputError("no video to patchify")
        merge2 = s.merge_size ** 2
        return LazyVideoPixels(self, tuple(videos), tuple(grids), tuple(seconds),
                               tuple(t * h * w // merge2 for t, h, w in grids), dtype)

    def _patchify(self, frames: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """[T, H, W, C] uint8 (T a multiple of the temporal patch) -> [T/tp * gh * gw, C * tp * P * P] in the
        table's dtype, in merge-block order."""
        s = self.settings
        p, m, tp = s.patch_size, s.merge_size, s.temporal_patch_size
        t, height, width, channels = frames.shape
        gt, gh, gw = t // tp, height // p, width // p
        # (gt, tp, gh/m, mh, ph, gw/m, mw, pw, C) -> (gt, gh/m, gw/m, mh, mw, C, tp, ph, pw)
        blocks = frames.view(gt, tp, gh // m, m, p, gw // m, m, p, channels).permute(0, 2, 5, 3, 6, 8, 1, 4, 7)
        offsets = torch.arange(channels, device=frames.device, dtype=torch.int32).view(1, 1, 1, 1, 1, -1, 1, 1, 1)
        values = table[blocks.to(torch.int32) + offsets * 256]
        return values.reshape(gt * gh * gw, channels * tp * p * p)


@dataclass(frozen=True)
class LazyVideoPixels:
    """A prompt's videos as the engine encodes them: the uint8 frames stay where they are (the decoded clip, half
    the bytes of its pixel values in BF16) and each vision-encoder pass patchifies its own grids, so no pass holds
    a two-minute clip's pixel values (0.27 GiB at 2 fps, beside the encoder's features at the request's
    peak)."""

    patcher: VideoPatcher
    videos: tuple
    grids: tuple[tuple[int, int, int], ...]
    second_per_grid: tuple[float, ...]
    token_counts: tuple[int, ...]
    dtype: torch.dtype

    @property
    def patch_dim(self) -> int:
        s = self.patcher.settings
        return 3 * s.temporal_patch_size * s.patch_size ** 2

    def whole(self, device: str | torch.device) -> torch.Tensor:
        """Every video's pixel values at once: pixel_values_videos, as transformers takes them."""
        return torch.cat([self.patches(v, 0, t, device) for v, (t, _, _) in enumerate(self.grids)])

    def patches(self, video: int, first: int, last: int, device: str | torch.device) -> torch.Tensor:
        """Temporal grids [first, last) of video `video` as pixel values [(last-first)*h*w, patch_dim] on
        `device`, in merge-block order: rows of the whole clip's pixel values, bit for bit."""
        s = self.patcher.settings
        device = torch.device(device)
        frames = _frames(self.videos[video].frames, first * s.temporal_patch_size, last * s.temporal_patch_size,
                         device)
        return self.patcher._patchify(frames, self.patcher.images.table(device).to(self.dtype))


def _frames(frames: np.ndarray, first: int, last: int, device: torch.device) -> torch.Tensor:
    """Frames [first, last) on `device`, the clip's last frame repeated past its end (Qwen2-VL's processors pad
    an odd count so)."""
    have = frames[first:min(last, len(frames))]
    if len(have) < last - first:
        have = np.concatenate([have, np.repeat(frames[-1:], last - first - len(have), axis=0)])
    return torch.from_numpy(np.ascontiguousarray(have)).to(device)


def audio_in_video(grid_thw: tuple[int, int, int], merge_size: int, second_per_grid: float,
                   position_id_per_seconds: float, n_audio: int) -> np.ndarray:
    """Whether each token between `<|audio_start|>` and `<|audio_end|>` of a video with its audio is a video
    token (True) or an audio token (False), in Qwen3OmniMoeProcessor's order (float64 times, a video token first
    on a tie)."""
    t, h, w = grid_thw
    per_grid = (h // merge_size) * (w // merge_size)
    times = np.arange(t, dtype=np.float64) * second_per_grid * position_id_per_seconds
    # audio tokens before grid g: those whose index a < time_g (the video goes first when time_g <= a)
    before = np.clip(np.ceil(times), 0, n_audio).astype(np.int64)
    order = np.empty(t * per_grid + n_audio, dtype=bool)
    order[:] = False
    starts = np.arange(t) * per_grid + before  # where grid g's tokens begin in the merged run
    index = (starts[:, None] + np.arange(per_grid)[None, :]).reshape(-1)
    order[index] = True
    return order


__all__ = ["LazyVideoPixels", "VideoPatcher", "VideoPatches", "audio_in_video"]
