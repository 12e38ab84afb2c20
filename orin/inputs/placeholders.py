"""A request's messages split into what the chat template renders and the media it stands for, and the
rendered prompt's placeholders expanded to one token per encoder output.

Messages are as orin.inputs.prompt takes them: content a string, or a list of parts {"type": "text", "text": ...},
{"type": "image", "image": <PIL image>}, {"type": "audio", "audio": <mono samples at 16 kHz>} and
{"type": "video", "video": <orin.inputs.video.Video>}. The template sees the parts without their media ({"type": "image"}),
in order; the media are collected in the same order.

Expansion happens on token ids, not on text as transformers does: each placeholder (`<|image_pad|>`,
`<|audio_pad|>`, `<|video_pad|>`) is an added special token, which the tokenizer never merges with its neighbours,
so the ids a placeholder stands for are exactly what the expanded text tokenizes to, without building and
tokenizing a string of thousands of placeholders. The i-th placeholder of a kind takes the i-th medium of that
kind.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import InputError
from .video import Video


@dataclass(frozen=True)
class Conversation:
    messages: list  # for the chat template: role and content parts, media left out
    images: list  # in the order their parts appear
    audios: list  # np.float32 mono samples, likewise
    videos: list = ()  # orin.inputs.video.Video, likewise


def split_media(messages: Sequence[Mapping]) -> Conversation:
    images, audios, videos, rendered = [], [], [], []
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
            elif kind == "video":
                if not isinstance(part.get("video"), Video):
                    raise InputError("a video part needs a decoded clip (orin.inputs.video.load_video), not "
                                     f"{type(part.get('video')).__name__}")
                videos.append(part["video"])
                parts.append({"type": "video"})
            else:
                raise InputError(f"unsupported content part type {kind!r}: use text, image, audio or video")
        rendered.append({"role": msg["role"], "content": parts})
    return Conversation(rendered, images, audios, videos)


def check_placeholders(ids: np.ndarray, counts: Mapping[int, int], names: Mapping[int, str]) -> None:
    """A placeholder count that differs from its media count is the caller's error (the model would misplace the
    media), so it is refused here, placeholders without any media included."""
    for token, n in counts.items():
        found = int(np.count_nonzero(ids == token))
        if found != n:
            raise InputError(f"the prompt has {found} {names[token]} placeholder(s) for {n} {names[token]}(s); "
                             f"give one {names[token]} part per {names[token]}")


def expand_placeholders(ids: Sequence[int], expansions: Mapping[int, Sequence], names: Mapping[int, str]) -> np.ndarray:
    """`ids` with the i-th occurrence of each placeholder id in `expansions` replaced by expansions[id][i]: a
    count (the placeholder repeated so many times) or an array of ids."""
    ids = np.asarray(ids, dtype=np.int64)
    check_placeholders(ids, {token: len(items) for token, items in expansions.items()}, names)
    if all(isinstance(n, (int, np.integer)) for items in expansions.values() for n in items):
        repeats = np.ones(len(ids), dtype=np.int64)
        for token, counts in expansions.items():
            repeats[ids == token] = counts
        return np.repeat(ids, repeats)
    pieces, at, taken = [], 0, dict.fromkeys(expansions, 0)
    for where in np.flatnonzero(np.isin(ids, list(expansions))):
        token = int(ids[where])
        item = expansions[token][taken[token]]
        taken[token] += 1
        pieces += [ids[at:where], np.full(item, token, dtype=np.int64) if np.isscalar(item)
                   else np.asarray(item, dtype=np.int64)]
        at = where + 1
    pieces.append(ids[at:])
    return np.concatenate(pieces)
