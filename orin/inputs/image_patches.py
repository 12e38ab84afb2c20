"""The request's images as the vision encoder's patches, the values transformers' Qwen2VLImageProcessorPil gives
(the PIL flavour orin.processor uses) under the checkpoint's settings, and how many `<|image_pad|>` tokens each
image becomes.

Shape logic, as Qwen2-VL's processor does it: `smart_resize` picks the size nearest the image's whose sides are
multiples of patch * merge and whose area lies in [min_pixels, max_pixels] (aspect ratios over 200 refused); the
image is converted to RGB (transparency composited onto white), resized there with PIL (bicubic unless the
checkpoint says otherwise), then cut into patch x patch squares ordered merge-block by merge-block (each
merge x merge block of patches consecutive, as the encoder's patch merger expects), each patch flattened as
(channel, time, row, column) with the one still image repeated over temporal_patch_size. The grid is
(1, H / patch, W / patch) and the image becomes grid_t * grid_h * grid_w / merge^2 tokens.

Rescale and normalise map a uint8 value to one float32 through a [channel, 256] table computed once per setting
with transformers' operations (float64 rescale, float32 normalise), so the values are bit-identical to it and the
device does one gather per element; the patch layout is a view and one copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from PIL import Image

from ..errors import InputError, ModelError


@dataclass(frozen=True)
class ImageSettings:
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 12845056
    resample: int = 3  # PIL's BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    do_convert_rgb: bool = True

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_values(cls, values: dict, defaults: dict, source: str) -> ImageSettings:
        """`values` from the checkpoint's file, completed by `defaults`; min_pixels/max_pixels win over
        size.shortest_edge/longest_edge, as in Qwen2VLImageProcessor."""
        get = {**defaults, **values}.get
        size = values.get("size") if isinstance(values.get("size"), dict) else {}
        try:
            settings = cls(
                int(get("patch_size")), int(get("temporal_patch_size")), int(get("merge_size")),
                int(values.get("min_pixels", size.get("shortest_edge", defaults["min_pixels"]))),
                int(values.get("max_pixels", size.get("longest_edge", defaults["max_pixels"]))),
                int(get("resample")), bool(get("do_resize")), bool(get("do_rescale")), float(get("rescale_factor")),
                bool(get("do_normalize")), _channels(get("image_mean")), _channels(get("image_std")),
                bool(get("do_convert_rgb")))
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelError(f"{source}: the image processor's settings are unreadable ({exc!r})") from exc
        if min(settings.patch_size, settings.temporal_patch_size, settings.merge_size) <= 0:
            raise ModelError(f"{source}: patch_size, temporal_patch_size and merge_size must be positive")
        if len(settings.image_mean) != 3 or len(settings.image_std) != 3:
            raise ModelError(f"{source}: image_mean and image_std need one value per RGB channel")
        return settings


def _channels(value) -> tuple[float, ...]:
    return tuple(float(v) for v in value) if isinstance(value, (list, tuple)) else (float(value),) * 3


@lru_cache(maxsize=1024)
def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's target size: sides multiples of `factor`, area within [min_pixels, max_pixels], aspect kept."""
    if max(height, width) / min(height, width) > 200:
        raise InputError(f"an image of {width}x{height} pixels has an aspect ratio over 200; crop or pad it")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@lru_cache(maxsize=8)
def value_table(do_rescale: bool, rescale_factor: float, do_normalize: bool, mean: tuple, std: tuple) -> np.ndarray:
    """[channels, 256] float32: what rescale then normalise make of each uint8 value, in transformers' dtypes."""
    x = np.tile(np.arange(256, dtype=np.uint8), (len(mean), 1))
    if do_rescale:
        x = (x.astype(np.float64) * rescale_factor).astype(np.float32)
    if do_normalize:
        x = x if np.issubdtype(x.dtype, np.floating) else x.astype(np.float32)
        x = ((x.T - np.array(mean, dtype=x.dtype)) / np.array(std, dtype=x.dtype)).T
    return np.ascontiguousarray(x, dtype=np.float32)


def to_rgb(image) -> Image.Image:
    """A PIL image (or an HxW / HxWx3 uint8 array) in RGB, transparency composited onto white."""
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or not (image.ndim == 2 or (image.ndim == 3 and image.shape[2] == 3)):
            raise InputError(f"an image array must be HxW or HxWx3 uint8, not {image.shape} {image.dtype}")
        image = Image.fromarray(image)
    if not isinstance(image, Image.Image):
        raise InputError(f"an image must be a PIL image or a uint8 array, not {type(image).__name__}")
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


@dataclass(frozen=True)
class ImagePatches:
    pixel_values: torch.Tensor  # [patches, 3 * temporal * patch * patch] float32, on the device asked for
    image_grid_thw: torch.Tensor  # [n_image, 3] int64, on the host
    token_counts: tuple[int, ...]  # `<|image_pad|>` tokens of each image


class ImagePatcher:
    """The image processor of one checkpoint; `__call__` patchifies the images of one prompt."""

    def __init__(self, settings: ImageSettings):
        self.settings = settings
        self._tables: dict[str, torch.Tensor] = {}

    def table(self, device: torch.device) -> torch.Tensor:
        """[channels * 256] float32 on `device`: what each uint8 value of each channel becomes (kept per device;
        the video side uses it too)."""
        key = str(device)
        if key not in self._tables:
            s = self.settings
            table = value_table(s.do_rescale, s.rescale_factor, s.do_normalize, s.image_mean, s.image_std)
            self._tables[key] = torch.from_numpy(table.copy()).reshape(-1).to(device)
        return self._tables[key]

    def resized(self, image) -> Image.Image:
        s = self.settings
        if s.do_convert_rgb:
            image = to_rgb(image)
        elif not isinstance(image, Image.Image) or image.mode != "RGB":
            raise InputError("this checkpoint does not convert images to RGB (do_convert_rgb false): give RGB images")
        if not s.do_resize:
            if image.height % s.factor or image.width % s.factor:
                raise InputError(f"this checkpoint does not resize images: give sides that are multiples of "
                                 f"{s.factor}, not {image.width}x{image.height}")
            return image
        height, width = smart_resize(image.height, image.width, s.factor, s.min_pixels, s.max_pixels)
        return image.resize((width, height), resample=Image.Resampling(s.resample))

    def __call__(self, images, device: str | torch.device | None = None) -> ImagePatches:
        s = self.settings
        device = torch.device(device or "cpu")
        table = self.table(device)
        patches, grids = [], []
        for image in images:
            rgb = self.resized(image)
            pixels = torch.from_numpy(np.array(rgb, dtype=np.uint8)).to(device)
            patches.append(self._patchify(pixels, table))
            grids.append((1, rgb.height // s.patch_size, rgb.width // s.patch_size))
        if not patches:
            raise InputError("no image to patchify")
        merge2 = s.merge_size ** 2
        return ImagePatches(torch.cat(patches), torch.tensor(grids, dtype=torch.int64),
                            tuple(t * h * w // merge2 for t, h, w in grids))

    def _patchify(self, pixels: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """[H, W, C] uint8 -> [grid_h * grid_w, C * T * P * P] float32, in merge-block order."""
        s = self.settings
        p, m, t = s.patch_size, s.merge_size, s.temporal_patch_size
        height, width, channels = pixels.shape
        gh, gw = height // p, width // p
        # (gh/m, mh, ph, gw/m, mw, pw, C) -> (gh/m, gw/m, mh, mw, C, ph, pw)
        blocks = pixels.view(gh // m, m, p, gw // m, m, p, channels).permute(0, 3, 1, 4, 6, 2, 5)
        offsets = torch.arange(channels, device=pixels.device, dtype=torch.int32).view(1, 1, 1, 1, -1, 1, 1) * 256
        values = table[blocks.to(torch.int32) + offsets]
        values = values.unsqueeze(5).expand(gh // m, gw // m, m, m, channels, t, p, p)
        return values.reshape(gh * gw, channels * t * p * p)
