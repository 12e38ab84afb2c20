"""Prompt tokens of a Realtime conversation, counted item by item with the engine's own template and tokenizer,
so the oldest items can be dropped to fit the model's context before a response.

Each item is rendered alone by the checkpoint's chat template and tokenized (orin.runtime.engine.Engine.count_tokens), and
each media placeholder counted as the tokens it expands to (Engine.audio_tokens: an audio's Whisper frames;
Engine.image_tokens: an image's patch grid after the processor's resize). Qwen3-Omni's template renders each
message on its own, so the sum over the items, the instructions' system message and the generation prompt is the
prompt's length (the tests check it against the engine's count); a template that joins messages would make it an
estimate. No media is featurised: counting costs a tokenization of the item's text.
"""

from __future__ import annotations

from .conversation import Item

_PLACEHOLDER = {"audio": 1, "image": 1}  # the one pad token each medium's placeholder holds before expansion


class TokenCounter:
    def __init__(self, engine):
        """`engine`: the served orin.runtime.engine.Engine (its count_tokens, audio_tokens and image_tokens)."""
        self.engine = engine
        probe = [{"role": "user", "content": [{"type": "text", "text": "x"}]}]
        self.generation_prompt = self._length(probe, True) - self._length(probe, False)

    def _length(self, messages: list, generation_prompt: bool = False) -> int:
        return self.engine.count_tokens(messages, generation_prompt=generation_prompt)

    def system(self, text: str) -> int:
        """Tokens of the instructions' system message (0 when there are none)."""
        return self._length([{"role": "system", "content": [{"type": "text", "text": text}]}]) if text else 0

    def audio_tokens(self, samples_16k: int) -> int:
        return self.engine.audio_tokens(samples_16k)

    def image_tokens(self, image) -> int:
        return self.engine.image_tokens(image)

    def count(self, item: Item) -> Item:
        """Set the item's `tokens` (and of them `audio_tokens`, `image_tokens`); returns the item."""
        message = item.message()
        if message is None:
            item.tokens = item.audio_tokens = item.image_tokens = 0
            return item
        content = message["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        rendered = [{"type": p["type"], "text": p["text"]} if p["type"] == "text" else {"type": p["type"]}
                    for p in content]
        audio = sum(self.audio_tokens(len(p["audio"])) for p in content if p["type"] == "audio")
        image = sum(self.image_tokens(p["image"]) for p in content if p["type"] == "image")
        pads = sum(_PLACEHOLDER.get(p["type"], 0) for p in content)
        item.tokens = self._length([{"role": message["role"], "content": rendered}]) - pads + audio + image
        item.audio_tokens, item.image_tokens = audio, image
        return item
