"""orin-omni's Qwen3-Omni processor: a checkpoint directory's chat template, tokenizer, Whisper features and image
patches, without transformers. `Processor.prepare(messages)` gives the model's inputs; `apply_chat_template`
and `__call__(text=..., images=..., audio=...)` are the two calls orin.prompt makes of transformers' processor,
with the same results, and `tokenizer.decode` / `decode` what the detokenizer needs.

The tensors, as transformers' Qwen3OmniMoeProcessor returns them for one prompt: input_ids and attention_mask
[1, T] int64; with images pixel_values [patches, 3 * T * P * P] float32 and image_grid_thw [n, 3] int64; with
audio input_features [n, mel bins, frames] float32 and feature_attention_mask [n, frames] int32. Features and
pixel values stay on the `device` they were computed on (transformers copies them back to the host); the rest
is on the host.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from ..audio_format import INPUT_SAMPLE_RATE
from ..errors import InputError, ModelError
from .audio_features import AudioSettings, LogMel
from .chat_template import ChatTemplate
from .checkpoint_files import QWEN3_OMNI_PREPROCESSOR, audio_window, chat_template_text, preprocessor_values
from .image_patches import ImagePatcher, ImageSettings
from .prompt import expand_placeholders, split_media
from .tokenizer import Tokenizer

# Qwen3-Omni's placeholder tokens, where tokenizer_config.json does not name them (image_token, audio_token).
DEFAULT_PLACEHOLDERS = {"image_token": "<|image_pad|>", "audio_token": "<|audio_pad|>"}


class Processor:
    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate, log_mel: LogMel, patcher: ImagePatcher,
                 source: str = ""):
        self.tokenizer = tokenizer
        self.template = template
        self.log_mel = log_mel
        self.patcher = patcher
        self.source = source  # where the feature extractor's and image processor's values came from
        added = {t.content for t in tokenizer.backend.get_added_tokens_decoder().values()}
        self.placeholder_ids = {}
        for key, default in DEFAULT_PLACEHOLDERS.items():
            token = tokenizer.special_tokens.get(key, default)
            if token not in added or tokenizer.backend.encode_special_tokens:
                raise ModelError(f"the tokenizer does not keep {token} ({key}) whole; restore tokenizer.json and "
                                 "tokenizer_config.json from the model's release")
            self.placeholder_ids[key] = tokenizer.token_id(token)
        self.image_token_id = self.placeholder_ids["image_token"]
        self.audio_token_id = self.placeholder_ids["audio_token"]

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Processor:
        """The processor of the checkpoint in `model_dir` (see orin.inputs.checkpoint_files for which files)."""
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise ModelError(f"{model_dir} is not a directory; give the checkpoint's directory")
        tokenizer = Tokenizer.from_dir(model_dir)
        template = ChatTemplate(chat_template_text(model_dir), tokenizer.special_tokens)
        values = preprocessor_values(model_dir)
        audio = AudioSettings.from_values(values.audio, QWEN3_OMNI_PREPROCESSOR, audio_window(model_dir),
                                          values.source)
        if audio.sampling_rate != INPUT_SAMPLE_RATE:
            raise ModelError(f"{model_dir / values.source}: sampling_rate {audio.sampling_rate}, but orin-omni "
                             f"feeds the audio encoder {INPUT_SAMPLE_RATE} Hz audio")
        image = ImageSettings.from_values(values.image, QWEN3_OMNI_PREPROCESSOR, values.source)
        return cls(tokenizer, template, LogMel(audio), ImagePatcher(image), values.source)

    def apply_chat_template(self, conversation, add_generation_prompt: bool = False, tokenize: bool = False,
                            **variables):
        """The rendered prompt of one conversation (a list of messages), or one per conversation of a list."""
        if tokenize:
            raise InputError("Processor.apply_chat_template renders text only; use prepare() for the tensors")
        batched = bool(conversation) and isinstance(conversation[0], (list, tuple))
        rendered = [self.template.render([_openai_image(m) for m in conv],
                                         add_generation_prompt=add_generation_prompt, **variables)
                    for conv in (conversation if batched else [conversation])]
        return rendered if batched else rendered[0]

    def prepare(self, messages: Sequence[Mapping], *, device: str | torch.device | None = None) -> dict:
        """The model's inputs for a request's messages, with the assistant's turn opened."""
        conv = split_media(messages)
        text = self.apply_chat_template(conv.messages, add_generation_prompt=True)
        return self(text=[text], images=conv.images or None, audio=conv.audios or None, device=device)

    def __call__(self, text=None, images=None, audio=None, return_tensors: str = "pt", padding: bool = True,
                 device: str | torch.device | None = None) -> dict:
        """The tensors of one rendered prompt whose placeholders stand for `images` and `audio`, in order."""
        if isinstance(text, (list, tuple)):
            if len(text) != 1:
                raise InputError(f"the processor takes one prompt at a time, not {len(text)}")
            text = text[0]
        if not isinstance(text, str):
            raise InputError("the processor needs the rendered prompt text")
        if return_tensors not in ("pt", None):
            raise InputError(f"the processor returns torch tensors, not {return_tensors!r}")
        out, expansions = {}, {}
        if images:
            patches = self.patcher(images, device)
            out.update(pixel_values=patches.pixel_values, image_grid_thw=patches.image_grid_thw)
            expansions[self.image_token_id] = patches.token_counts
        if audio:
            features = self.log_mel(audio, device)
            out.update(input_features=features.input_features,
                       feature_attention_mask=features.feature_attention_mask)
            expansions[self.audio_token_id] = features.token_counts
        names = {self.image_token_id: "image", self.audio_token_id: "audio"}
        ids = expand_placeholders(self.tokenizer.encode(text), expansions, names)
        input_ids = torch.from_numpy(ids).unsqueeze(0)
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), **out}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _openai_image(message):
    """OpenAI's {"type": "image_url", "image_url": {"url": ...}} parts as {"type": "image", "url": ...}, and keys
    whose value is None left out, as transformers' processor presents a conversation to its template."""
    if not isinstance(message, Mapping) or not isinstance(message.get("content"), list):
        return message
    parts = []
    for part in message["content"]:
        if isinstance(part, Mapping) and part.get("type") == "image_url" and "image_url" in part:
            info = part["image_url"]
            parts.append({"type": "image", "url": info.get("url", "") if isinstance(info, Mapping) else info})
        else:
            parts.append(part)
    return {**message, "content": parts}


__all__ = ["Processor"]
