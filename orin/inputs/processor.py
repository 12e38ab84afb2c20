"""orin-omni's Qwen3-Omni processor: a checkpoint directory's chat template, tokenizer, Whisper features and image
patches, without transformers. `Processor.prepare(messages)` gives the model's inputs; `apply_chat_template`
and `__call__(text=..., images=..., audio=..., videos=...)` are the two calls orin.inputs.prompt makes of transformers'
processor, with the same results, and `tokenizer.decode` / `decode` what the detokenizer needs.

The tensors, as transformers' Qwen3OmniMoeProcessor returns them for one prompt: input_ids and attention_mask
[1, T] int64; with images pixel_values [patches, 3 * T * P * P] float32 and image_grid_thw [n, 3] int64; with
videos pixel_values_videos (likewise), video_grid_thw [n, 3] int64 and video_second_per_grid [n] float32; with
audio input_features [n, mel bins, frames] float32 and feature_attention_mask [n, frames] int32. Features and
pixel values stay on the `device` they were computed on (transformers copies them back to the host); the rest
is on the host.

A video whose `audio` is set is a video with its audio (transformers' `load_audio_from_video`): its soundtrack's
features join the audio features in the order the prompt's audio appears (a plain audio part and a video's
soundtrack alike), and its placeholder becomes the interleaved run orin.inputs.video_patches describes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from ..audio_format import INPUT_SAMPLE_RATE
from ..errors import InputError, ModelError
from .audio_features import AudioSettings, LogMel, waveform_key
from .chat_template import ChatTemplate
from .checkpoint_files import (
    DEFAULT_POSITION_ID_PER_SECONDS,
    QWEN3_OMNI_PREPROCESSOR,
    audio_window,
    chat_template_text,
    position_id_per_seconds,
    preprocessor_values,
)
from .image_patches import ImagePatcher, ImageSettings
from .placeholders import check_placeholders, expand_placeholders, split_media
from .tokenizer import Tokenizer
from .video_patches import VideoPatcher, audio_in_video

# Qwen3-Omni's placeholder tokens, where tokenizer_config.json does not name them.
DEFAULT_PLACEHOLDERS = {"image_token": "<|image_pad|>", "audio_token": "<|audio_pad|>", "video_token": "<|video_pad|>",
                        "audio_bos_token": "<|audio_start|>", "audio_eos_token": "<|audio_end|>"}


class Processor:
    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate, log_mel: LogMel, patcher: ImagePatcher,
                 source: str = "", position_id_per_seconds: float = DEFAULT_POSITION_ID_PER_SECONDS):
        self.tokenizer = tokenizer
        self.template = template
        self.log_mel = log_mel
        self.patcher = patcher
        self.video_patcher = VideoPatcher(patcher)
        self.position_id_per_seconds = position_id_per_seconds  # audio-in-video interleaving's time unit
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
        self.video_token_id = self.placeholder_ids["video_token"]

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
        return cls(tokenizer, template, LogMel(audio), ImagePatcher(image), values.source,
                   position_id_per_seconds(model_dir))

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

    def prepare(self, messages: Sequence[Mapping], *, device: str | torch.device | None = None,
                video_dtype: torch.dtype = torch.float32, audio_keys: bool = False,
                lazy_videos: bool = False) -> dict:
        """The model's inputs for a request's messages, with the assistant's turn opened. `video_dtype`: of
        pixel_values_videos (orin.inputs.video_patches: the encoder's own dtype loses nothing); `audio_keys`,
        `lazy_videos`: as for __call__."""
        conv = split_media(messages)
        text = self.apply_chat_template(conv.messages, add_generation_prompt=True)
        return self(text=[text], images=conv.images or None, audio=conv.audios or None, videos=conv.videos or None,
                    device=device, video_dtype=video_dtype, audio_keys=audio_keys, lazy_videos=lazy_videos)

    def __call__(self, text=None, images=None, audio=None, videos=None, return_tensors: str = "pt",
                 padding: bool = True, device: str | torch.device | None = None,
                 video_dtype: torch.dtype = torch.float32, audio_keys: bool = False,
                 lazy_videos: bool = False) -> dict:
        """The tensors of one rendered prompt whose placeholders stand for `images`, `audio` and `videos`
        (orin.inputs.video.Video; with its `audio`, a video with its audio), in order. With `audio_keys`, also
        "audio_keys": a digest of each audio's samples and feature frames, in the features' order
        (orin.inputs.audio_features.waveform_key; not a model input: take it out before passing the rest to
        transformers). With
        `lazy_videos`, "video_pixels" (orin.inputs.video_patches.LazyVideoPixels, each pass's pixel values made
        when the encoder needs them) instead of pixel_values_videos."""
        if isinstance(text, (list, tuple)):
            if len(text) != 1:
                raise InputError(f"the processor takes one prompt at a time, not {len(text)}")
            text = text[0]
        if not isinstance(text, str):
            raise InputError("the processor needs the rendered prompt text")
        if return_tensors not in ("pt", None):
            raise InputError(f"the processor returns torch tensors, not {return_tensors!r}")
        out, expansions = {}, {}
        names = {self.image_token_id: "image", self.audio_token_id: "audio", self.video_token_id: "video"}
        ids = np.asarray(self.tokenizer.encode(text), dtype=np.int64)
        audio, videos = list(audio or []), list(videos or [])
        check_placeholders(ids, {self.audio_token_id: len(audio), self.video_token_id: len(videos)}, names)
        if images:
            patches = self.patcher(images, device)
            out.update(pixel_values=patches.pixel_values, image_grid_thw=patches.image_grid_thw)
            expansions[self.image_token_id] = patches.token_counts
        # every audio, a plain audio part's and a video's soundtrack alike, in the order the prompt places them
        waves, owners = [], []
        plain, seen = iter(audio), iter(range(len(videos)))
        for token in ids[np.isin(ids, (self.audio_token_id, self.video_token_id))]:
            if token == self.audio_token_id:
                waves.append(next(plain))
                owners.append(None)
            else:
                v = next(seen)
                if videos[v].audio is not None:
                    waves.append(videos[v].audio)
                    owners.append(v)
        counts = ()
        if waves:
            features = self.log_mel(waves, device)
            out.update(input_features=features.input_features,
                       feature_attention_mask=features.feature_attention_mask)
            counts = features.token_counts
            if audio_keys:
                out["audio_keys"] = tuple(waveform_key(w, n) for w, n in zip(waves, features.frames, strict=True))
            expansions[self.audio_token_id] = tuple(n for n, o in zip(counts, owners, strict=True) if o is None)
        if videos:
            vp = self.video_patcher.lazy(videos, video_dtype)
            if lazy_videos:
                out["video_pixels"] = vp
            else:
                out["pixel_values_videos"] = self.video_patcher(videos, device, video_dtype).pixel_values
            out.update(video_grid_thw=torch.tensor(vp.grids, dtype=torch.int64),
                       video_second_per_grid=torch.tensor(vp.second_per_grid, dtype=torch.float32))
            soundtrack = {o: n for n, o in zip(counts, owners, strict=True) if o is not None}
            expansions[self.video_token_id] = tuple(
                self._video_run(vp.grids[v], vp.second_per_grid[v], soundtrack[v])
                if v in soundtrack else vp.token_counts[v] for v in range(len(videos)))
        input_ids = torch.from_numpy(expand_placeholders(ids, expansions, names)).unsqueeze(0)
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), **out}

    def _video_run(self, grid: tuple[int, int, int], second_per_grid: float, n_audio: int) -> np.ndarray:
        """The ids a video with its audio becomes in place of its `<|video_pad|>`."""
        is_video = audio_in_video(grid, self.patcher.settings.merge_size, second_per_grid,
                                  self.position_id_per_seconds, n_audio)
        body = np.where(is_video, self.video_token_id, self.audio_token_id)
        return np.concatenate([[self.placeholder_ids["audio_bos_token"]], body,
                               [self.placeholder_ids["audio_eos_token"]]])

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
