"""A request's messages as the model's inputs: the chat template rendered, the text tokenized, audio as Whisper
features and images as patches, through the checkpoint's processor (orin.processor)."""

from __future__ import annotations

from dataclasses import dataclass

from .inputs.prompt import split_media


@dataclass(frozen=True)
class Prompt:
    inputs: dict  # the processor's tensors: input_ids, attention_mask, and the media's features
    input_ids: object  # [1, T]
    n_audio_tokens: int
    n_image_tokens: int
    vision_patches: int
    has_audio: bool
    has_image: bool

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[1])


def prepare_prompt(processor, thinker_config, messages, device) -> Prompt:
    conv = split_media(messages)
    images, audios, rendered = conv.images, conv.audios, conv.messages
    text = processor.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
    # On CUDA the Whisper features of the audio (an STFT of up to 30 s) are computed on the GPU: ~1 ms
    # instead of ~5-10 ms of host time ahead of everything else in the request.
    extra = {"device": str(device)} if audios and device.type == "cuda" else {}
    inputs = processor(text=[text], images=images or None, audio=audios or None, return_tensors="pt",
                       padding=True, **extra)
    ids = inputs["input_ids"]
    return Prompt(
        inputs=dict(inputs), input_ids=ids,
        n_audio_tokens=int((ids == thinker_config.audio_token_id).sum()),
        n_image_tokens=int((ids == thinker_config.image_token_id).sum()),
        vision_patches=int(inputs["pixel_values"].shape[0]) if images else 0,
        has_audio=bool(audios), has_image=bool(images),
    )
