"""A Realtime session's conversation: its items (GA `realtime.item` messages), what they become for the engine,
trimming to the model's context, and truncating an assistant's speech to what the user heard.

Items are messages: user (input_text, input_audio, input_image), assistant (output_text, output_audio with its
transcript) and system (input_text). The engine hears a user's audio and sees their images; of an assistant's
answer it reads the text (its transcript when it spoke): the model's own speech is not fed back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..audio_format import INPUT_SAMPLE_RATE, OUTPUT_SAMPLE_RATE, frame_aligned
from .audio import INPUT_FORMATS, decode
from .events import EventError, b64decode, new_id

ROLE_PARTS = {"user": ("input_text", "input_audio", "input_image"), "assistant": ("output_text", "output_audio"),
              "system": ("input_text",)}
MAX_ID_CHARS = 32  # OpenAI's limit on a client-chosen item id
MIN_AUDIO_MS = 100  # OpenAI refuses to commit less; a shorter clip carries no turn


@dataclass
class Part:
    """One content part. `audio`: a user's speech as float32 mono at the engine's 16 kHz; `image`: a decoded
    PIL image."""

    type: str
    text: str | None = None
    transcript: str | None = None
    audio: object = None
    image: object = None
    detail: str | None = None

    def to_json(self) -> dict:
        if self.type in ("input_text", "output_text"):
            return {"type": self.type, "text": self.text or ""}
        if self.type == "input_audio":
            return {"type": "input_audio", "transcript": self.transcript}
        if self.type == "output_audio":
            return {"type": "output_audio", "transcript": self.transcript or ""}
        return {"type": "input_image", "detail": self.detail or "auto"}

    @property
    def words(self) -> str:
        """What the engine reads of an assistant's part."""
        return (self.text if self.type == "output_text" else self.transcript) or ""


@dataclass
class Speech:
    """What the client received of an assistant's spoken answer, for conversation.item.truncate: the answer's
    text token ids and, per audio chunk sent, its samples and codec frames."""

    token_ids: tuple[int, ...] = ()
    chunks: list[tuple[int, int]] = field(default_factory=list)

    @property
    def samples(self) -> int:
        return sum(n for n, _ in self.chunks)

    @property
    def audio_ms(self) -> int:
        return self.samples * 1000 // OUTPUT_SAMPLE_RATE

    def frames_heard(self, audio_end_ms: int) -> int:
        """Codec frames wholly played by `audio_end_ms`. Each chunk's samples are spread evenly over its frames
        (code2wav gives 1920 samples a frame, less up to one frame at a chunk's edge)."""
        heard = audio_end_ms * OUTPUT_SAMPLE_RATE // 1000
        frames = 0
        for samples, n in self.chunks:
            if heard >= samples:
                heard -= samples
                frames += n
            else:
                return frames + (heard * n // samples if samples else 0)
        return frames

    def tokens_heard(self, audio_end_ms: int) -> tuple[int, ...]:
        """The text tokens spoken by `audio_end_ms`.

        Qwen3-Omni's streaming talker reads the thinker's text one token per codec step with no offset: its
        prefill ends on the first generated token and chooses frame 0, and step s adds token s + 1 to choose frame
        s + 1 (orin.runtime.talker, orin.runtime.engine._advance_talker). So frame f is made having read tokens 0..f, and the
        first F frames, F * 80 ms of speech (orin.audio_format), speak at most the first F tokens; once the text
        has ended the talker reads padding, so frames past the last token keep the whole text."""
        return self.token_ids[: self.frames_heard(audio_end_ms)]

    def truncate(self, audio_end_ms: int) -> None:
        """Keep what was heard by `audio_end_ms`: its tokens and its audio (a later truncation cuts within it)."""
        self.token_ids = self.tokens_heard(audio_end_ms)
        heard = audio_end_ms * OUTPUT_SAMPLE_RATE // 1000
        kept = []
        for samples, n in self.chunks:
            if heard <= 0:
                break
            take = min(samples, heard)
            kept.append((take, n if take == samples else take * n // samples))
            heard -= take
        self.chunks = kept


@dataclass
class Item:
    id: str
    role: str
    content: list[Part]
    status: str = "completed"
    tokens: int = 0  # prompt tokens the item adds (orin.realtime.tokens)
    audio_tokens: int = 0
    image_tokens: int = 0
    speech: Speech | None = None  # an assistant's spoken answer

    def to_json(self) -> dict:
        return {"id": self.id, "object": "realtime.item", "type": "message", "status": self.status,
                "role": self.role, "content": [p.to_json() for p in self.content]}

    def message(self) -> dict | None:
        """The item as the engine's message (None: nothing to say, such as an answer cut off before a word)."""
        if self.role == "assistant":
            text = "".join(p.words for p in self.content)
            return {"role": "assistant", "content": text} if text else None
        parts = []
        for p in self.content:
            if p.type == "input_text":
                parts.append({"type": "text", "text": p.text or ""})
            elif p.type == "input_audio":
                parts.append({"type": "audio", "audio": p.audio})
            else:
                parts.append({"type": "image", "image": p.image})
        return {"role": self.role, "content": parts}


def audio_item(samples, rate: int, item_id: str | None = None) -> Item:
    """A user item of committed input audio (float32 mono at `rate`), resampled to the engine's 16 kHz and
    aligned to whole feature frames (frame_aligned: every later turn then reads this one's rows from the cache)."""
    from ..inputs.media import resample

    audio = frame_aligned(resample(samples, rate, INPUT_SAMPLE_RATE) if rate != INPUT_SAMPLE_RATE else samples)
    return Item(item_id or new_id("item"), "user", [Part("input_audio", audio=audio)])


def assistant_item(speech: bool, item_id: str | None = None) -> Item:
    """The empty assistant item a response fills (spoken, or text only)."""
    part = Part("output_audio", transcript="") if speech else Part("output_text", text="")
    return Item(item_id or new_id("item"), "assistant", [part], status="in_progress",
                speech=Speech() if speech else None)


@dataclass(frozen=True)
class MediaLimits:
    max_audio_seconds: float
    max_image_pixels: int


def parse_item(obj: object, input_format: str, limits: MediaLimits, param: str = "item") -> Item:
    """A client's conversation item (conversation.item.create, or response.input), media decoded: audio in the
    session's input format, images as data: URLs. CPU work for large media: call it off the event loop."""
    if not isinstance(obj, dict):
        raise EventError(f"'{param}' must be an item object", code="invalid_type", param=param)
    kind = obj.get("type", "message")
    if kind in ("function_call", "function_call_output", "mcp_call", "mcp_approval_response"):
        raise EventError(f"{param}.type {kind!r}: tools and function calling are not supported by this server",
                         param=f"{param}.type")
    if kind != "message":
        raise EventError(f"{param}.type must be \"message\", got {kind!r}", param=f"{param}.type")
    unknown = sorted(set(obj) - {"type", "role", "content", "id", "object", "status"})
    if unknown:
        raise EventError(f"unknown parameter '{param}.{unknown[0]}'", code="unknown_parameter",
                         param=f"{param}.{unknown[0]}")
    role = obj.get("role")
    if role not in ROLE_PARTS:
        raise EventError(f"{param}.role must be \"user\", \"assistant\" or \"system\", got {role!r}",
                         param=f"{param}.role")
    item_id = obj.get("id")
    if item_id is not None and (not isinstance(item_id, str) or not 0 < len(item_id) <= MAX_ID_CHARS):
        raise EventError(f"{param}.id must be a string of 1 to {MAX_ID_CHARS} characters", param=f"{param}.id")
    content = obj.get("content")
    if not isinstance(content, list) or not content:
        raise EventError(f"{param}.content must be a non-empty list of content parts", param=f"{param}.content")
    parts = [_part(p, role, input_format, limits, f"{param}.content[{i}]") for i, p in enumerate(content)]
    return Item(item_id or new_id("item"), role, parts)


def _text(part: dict, key: str, where: str) -> str:
    value = part.get(key)
    if not isinstance(value, str):
        raise EventError(f"{where}.{key} must be a string", code="invalid_type", param=f"{where}.{key}")
    return value


def _part(part: object, role: str, input_format: str, limits: MediaLimits, where: str) -> Part:
    if not isinstance(part, dict):
        raise EventError(f"{where} must be an object with a 'type'", code="invalid_type", param=where)
    kind = part.get("type")
    if kind not in ROLE_PARTS[role]:
        raise EventError(f"{where}.type {kind!r} is not a {role} content type; use {', '.join(ROLE_PARTS[role])}",
                         param=f"{where}.type")
    if kind in ("input_text", "output_text"):
        return Part(kind, text=_text(part, "text", where))
    if kind == "output_audio":
        if not isinstance(part.get("transcript"), str):
            raise EventError(f"{where}: an assistant's output_audio part needs its 'transcript' (the model reads "
                             "an earlier answer as text)", param=f"{where}.transcript")
        return Part(kind, transcript=part["transcript"])
    if kind == "input_audio":
        return _audio_part(part, input_format, limits, where)
    return _image_part(part, limits, where)


def _audio_part(part: dict, input_format: str, limits: MediaLimits, where: str) -> Part:
    from ..inputs.media import resample

    raw = b64decode(part.get("audio"), f"{where}.audio")
    samples = decode(raw, input_format, f"{where}.audio")
    rate = INPUT_FORMATS[input_format]
    seconds = samples.size / rate
    if seconds * 1000 < MIN_AUDIO_MS:
        raise EventError(f"{where}.audio holds {seconds * 1000:.0f} ms of {input_format}; send at least "
                         f"{MIN_AUDIO_MS} ms", param=f"{where}.audio")
    if seconds > limits.max_audio_seconds:
        raise EventError(f"{where}.audio is {seconds:.1f} s long, over the server's {limits.max_audio_seconds:g} s "
                         "limit", param=f"{where}.audio")
    transcript = part.get("transcript")
    return Part("input_audio", audio=frame_aligned(resample(samples, rate, INPUT_SAMPLE_RATE)),
                transcript=transcript if isinstance(transcript, str) else None)


def _image_part(part: dict, limits: MediaLimits, where: str) -> Part:
    from ..errors import InputError
    from ..inputs.media import load_image

    url = part.get("image_url")
    detail = part.get("detail", "auto")
    if detail not in ("auto", "high"):
        raise EventError(f"{where}.detail {detail!r} is not supported: images are seen at the model's own "
                         "resolution (\"auto\" or \"high\")", param=f"{where}.detail")
    if not isinstance(url, str) or not url.startswith("data:"):
        raise EventError(f"{where}.image_url must be a data: URL such as data:image/png;base64,... (the server "
                         "never fetches URLs)", param=f"{where}.image_url")
    header, sep, payload = url.partition(",")
    if not sep or not header.lower().endswith(";base64"):
        raise EventError(f"{where}.image_url must be a base64 data: URL (data:image/png;base64,...)",
                         param=f"{where}.image_url")
    raw = b64decode(payload, f"{where}.image_url")
    try:
        image = load_image(raw, max_pixels=limits.max_image_pixels, name=f"{where}.image_url")
    except InputError as exc:
        raise EventError(str(exc), param=f"{where}.image_url") from exc
    return Part("input_image", image=image, detail=detail)


class Conversation:
    """The session's items in order."""

    def __init__(self) -> None:
        self.items: list[Item] = []

    def __len__(self) -> int:
        return len(self.items)

    def _index(self, item_id: str, param: str = "item_id") -> int:
        for i, item in enumerate(self.items):
            if item.id == item_id:
                return i
        raise EventError(f"no item with id {item_id!r} in this conversation", code="item_not_found", param=param)

    def get(self, item_id: str) -> Item:
        return self.items[self._index(item_id)]

    def add(self, item: Item, previous_item_id: str | None = None) -> str | None:
        """Insert `item` after `previous_item_id` (at the end: None; at the start: "root"); returns the id of
        the item now before it."""
        if any(i.id == item.id for i in self.items):
            raise EventError(f"an item with id {item.id!r} already exists; give a new id or none",
                             code="duplicate_item_id", param="item.id")
        if previous_item_id is None:
            at = len(self.items)
        elif previous_item_id == "root":
            at = 0
        else:
            at = self._index(previous_item_id, "previous_item_id") + 1
        self.items.insert(at, item)
        return self.items[at - 1].id if at else None

    def delete(self, item_id: str) -> Item:
        return self.items.pop(self._index(item_id))

    def messages(self, instructions: str, items: Sequence[Item] | None = None) -> tuple:
        """The engine's messages: the instructions as the leading system message, then the items."""
        out = [{"role": "system", "content": instructions}] if instructions else []
        for item in self.items if items is None else items:
            message = item.message()
            if message is not None:
                out.append(message)
        return tuple(out)

    def tokens(self) -> int:
        return sum(i.tokens for i in self.items)

    def trim(self, fixed_tokens: int, limit: int) -> list[Item]:
        """Drop the oldest items until `fixed_tokens` (instructions, generation prompt) plus the items' tokens
        fit in `limit`; returns the dropped items. Raises EventError, dropping nothing, when even the newest item
        alone does not fit."""
        if self.items and fixed_tokens + self.items[-1].tokens > limit:
            raise EventError(f"the newest item and the instructions take {fixed_tokens + self.items[-1].tokens} "
                             f"tokens, more than the {limit} the context leaves beside the answer; send a shorter "
                             "input or lower max_output_tokens", code="context_length_exceeded")
        dropped = []
        while fixed_tokens + self.tokens() > limit:
            dropped.append(self.items.pop(0))
        return dropped
