"""A request's messages split into what the chat template renders and the media it stands for, and the
rendered prompt's placeholders expanded to one token per encoder output.

Messages are as orin.prompt takes them: content a string, or a list of parts {"type": "text", "text": ...},
{"type": "image", "image": <PIL image>} and {"type": "audio", "audio": <mono samples at 16 kHz>}. The template
sees the parts without their media ({"type": "image"}), in order; the media are collected in the same order.

Expansion happens on token ids, not on text as transformers does: each placeholder (`<|image_pad|>`,
`<|audio_pad|>`) is an added special token, which the tokenizer never merges with its neighbours, so one id
repeated n times is exactly what n placeholders in the text tokenize to, without building and tokenizing a
string of thousands of placeholders. The i-th placeholder of a kind takes the i-th medium of that kind.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import InputError


@dataclass(frozen=True)
class Conversation:
    messages: list  # for the chat template: role and content parts, media left out
    images: list  # in the order their parts appear
    audios: list  # np.float32 mono samples, likewise


def split_media(messages: Sequence[Mapping]) -> Conversation:
    images, audios, rendered = [], [], []
    for msg in messages:
        if not isinstance(msg, Mapping) or "role" not in msg:
            raise InputError("each message needs a role and a content")
        content = msg.get("content")
        if isinstance(content, str):
            rendered.append({"role": msg["role"], "content": [{"type": "text", "text": content}]})
            continue
        parts = []
        for part in content or []:
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text":
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image":
                images.append(part["image"])
                parts.append({"type": "image"})
            elif kind == "audio":
                audios.append(np.asarray(part["audio"], dtype=np.float32))
                parts.append({"type": "audio"})
            else:
                raise InputError(f"unsupported content part type {kind!r}: use text, image or audio")
        rendered.append({"role": msg["role"], "content": parts})
    return Conversation(rendered, images, audios)


def expand_placeholders(ids: Sequence[int], expansions: Mapping[int, Sequence[int]],
                        names: Mapping[int, str]) -> np.ndarray:
    """`ids` with the i-th occurrence of each placeholder id in `expansions` repeated expansions[id][i] times.
    A placeholder count that differs from its media count is the caller's error (the model would misplace the
    media), so it is refused here, placeholders without any media included."""
    ids = np.asarray(ids, dtype=np.int64)
    repeats = np.ones(len(ids), dtype=np.int64)
    for token, counts in expansions.items():
        where = np.flatnonzero(ids == token)
        if len(where) != len(counts):
            raise InputError(f"the prompt has {len(where)} {names[token]} placeholder(s) for {len(counts)} "
                             f"{names[token]}(s); give one {names[token]} part per {names[token]}")
        repeats[where] = counts
    return np.repeat(ids, repeats)
