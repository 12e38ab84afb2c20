"""The OpenAI `voice` field, parsed once for every API that takes one: the chat request's `audio.voice`,
`/v1/audio/speech`'s `voice` and the Realtime session's `audio.output.voice` (session.update and response.create).
Each accepts a speaker name ("Ethan", any case) or the object form `{"id": "ethan"}`; the name must be one of the
talker's speakers (orin.runtime.engine.Engine.voices). A refusal is a VoiceError naming the field, which each protocol
answers in its own error shape (an HTTP 400, a Realtime `error` event)."""

from __future__ import annotations

from ..errors import InputError


class VoiceError(InputError):
    """A `voice` the served model cannot speak; `param` is the field's dotted path."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def parse_voice(value: object, param: str, voices: tuple[str, ...]) -> str | None:
    """The speaker name (lower case) that `value`, the request's field at `param`, asks for; None when it is left
    out (the engine's default voice)."""
    if isinstance(value, dict):
        value = value.get("id")
    if value is None:
        return None
    if not voices:
        raise VoiceError(f"'{param}': this checkpoint has no talker voices, so it cannot speak", param)
    if not isinstance(value, str) or not value.strip():
        raise VoiceError(f"'{param}' must be a voice name (or an object with its 'id'); this model's voices are "
                         f"{', '.join(voices)}", param)
    name = value.strip().lower()
    if name not in voices:
        raise VoiceError(f"unknown voice {value!r} in '{param}'; this model's voices are {', '.join(voices)} "
                         "(OpenAI's voice names such as 'alloy' are not this model's)", param)
    return name
