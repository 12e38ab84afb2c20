"""A request's messages as the model's inputs (the chat template rendered, the text tokenized, audio as Whisper
features and images as patches, through the checkpoint's own processor, orin.inputs), and what the planner
counts of them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    inputs: dict  # the processor's tensors: input_ids, attention_mask, and the media's features
    input_ids: object  # [1, T]
    n_audio_tokens: int
    n_image_tokens: int
    vision_patches: int
    has_audio: bool
    has_image: bool
    # host copies of what shapes the encoders and positions (reading them from the device would cost a sync)
    audio_lengths: tuple[int, ...] = ()  # each audio's feature frames
    image_grids: tuple[tuple[int, int, int], ...] = ()  # each image's (t, h, w) patch grid

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[1])


def prepare_prompt(processor, thinker_config, messages, device) -> Prompt:
    """`processor`: an orin.inputs.Processor. On CUDA the Whisper features (an STFT of up to 30 s) and the image
    patches are computed on the GPU: ~1 ms instead of ~5-10 ms of host time ahead of everything else."""
    inputs = processor.prepare(messages, device=device if device.type == "cuda" else None)
    ids = inputs["input_ids"]
    fam, grids = inputs.get("feature_attention_mask"), inputs.get("image_grid_thw")
    return Prompt(
        inputs=dict(inputs), input_ids=ids,
        n_audio_tokens=int((ids == thinker_config.audio_token_id).sum()),
        n_image_tokens=int((ids == thinker_config.image_token_id).sum()),
        vision_patches=int(inputs["pixel_values"].shape[0]) if "pixel_values" in inputs else 0,
        has_audio="input_features" in inputs, has_image="pixel_values" in inputs,
        audio_lengths=tuple(int(n) for n in fam.sum(dim=1).tolist()) if fam is not None else (),
        image_grids=tuple(tuple(int(v) for v in g) for g in grids.tolist()) if grids is not None else (),
    )
