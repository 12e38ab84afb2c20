"""A request's messages as the model's inputs (the chat template rendered, the text tokenized, audio as Whisper
features, images and videos as patches, through the checkpoint's own processor, orin.inputs), and what the planner
counts of them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    inputs: dict  # the processor's tensors: input_ids, attention_mask, and the media's features
    input_ids: object  # [1, T]
    n_audio_tokens: int
    n_image_tokens: int
    has_audio: bool
    has_image: bool
    # host copies of what shapes the encoders and positions (reading them from the device would cost a sync)
    audio_lengths: tuple[int, ...] = ()  # each audio's feature frames, a video's soundtrack included
    image_grids: tuple[tuple[int, int, int], ...] = ()  # each image's (t, h, w) patch grid
    video_grids: tuple[tuple[int, int, int], ...] = ()  # each video's (t, h, w) patch grid
    video_seconds: tuple[float, ...] = ()  # each video's seconds per temporal grid
    n_video_tokens: int = 0
    audio_keys: tuple[bytes, ...] = ()  # each audio's samples and frames, digested (audio_features.waveform_key)
    video_pixels: object = None  # orin.inputs.video_patches.LazyVideoPixels: each encoder pass's pixel values

    @property
    def has_video(self) -> bool:
        return bool(self.video_grids)

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[1])


def prepare_prompt(processor, thinker_config, messages, device, video_dtype=None) -> Prompt:
    """`processor`: an orin.inputs.Processor. On CUDA the Whisper features (an STFT of up to 30 s) and the image
    patches are computed on the GPU: ~1 ms instead of ~5-10 ms of host time ahead of everything else.
    `video_dtype`: the vision encoder's dtype (a video's pixel values in it lose nothing and take half the
    memory); None: float32, as transformers gives them."""
    import torch

    video_dtype = video_dtype or torch.float32
    inputs = processor.prepare(messages, device=device if device.type == "cuda" else None, video_dtype=video_dtype,
                               audio_keys=True, lazy_videos=True)
    audio_keys, video_pixels = inputs.pop("audio_keys", ()), inputs.pop("video_pixels", None)
    ids = inputs["input_ids"]
    fam, grids, videos = inputs.get("feature_attention_mask"), inputs.get("image_grid_thw"), inputs.get("video_grid_thw")
    return Prompt(
        inputs=dict(inputs), input_ids=ids,
        n_audio_tokens=int((ids == thinker_config.audio_token_id).sum()),
        n_image_tokens=int((ids == thinker_config.image_token_id).sum()),
        has_audio="input_features" in inputs, has_image="pixel_values" in inputs,
        audio_lengths=tuple(int(n) for n in fam.sum(dim=1).tolist()) if fam is not None else (),
        image_grids=tuple(tuple(int(v) for v in g) for g in grids.tolist()) if grids is not None else (),
        video_grids=tuple(tuple(int(v) for v in g) for g in videos.tolist()) if videos is not None else (),
        video_seconds=tuple(float(s) for s in inputs["video_second_per_grid"].tolist()) if videos is not None else (),
        n_video_tokens=int((ids == thinker_config.video_token_id).sum()),
        audio_keys=tuple(audio_keys), video_pixels=video_pixels,
    )
