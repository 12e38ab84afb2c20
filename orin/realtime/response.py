"""One Realtime response: the server events that frame it, its engine events (orin.contract's TextDelta,
AudioChunk, Done) turned into GA delta events, and the assistant item it fills. No I/O.

Speech (output_modalities ["audio"]): text deltas are the transcript (`response.output_audio_transcript.delta`)
and audio chunks `response.output_audio.delta` (base64 audio/pcm at 24 kHz). Text only: `response.output_text.delta`.
Once the response is interrupted (barge-in, response.cancel) nothing more is sent of it but its closing events.
"""

from __future__ import annotations

import time

from .audio import encode_pcm
from .conversation import Item
from .events import new_id, server_event
from .session import ResponseParams, format_json


class ResponseRun:
    """The events of one response, in the GA order: response.created, response.output_item.added,
    conversation.item.added, response.content_part.added, the deltas, then the done events and response.done."""

    def __init__(self, params: ResponseParams, item: Item, conversation_id: str | None):
        self.id = new_id("resp")
        self.params = params
        self.item = item
        self.conversation_id = conversation_id  # None: out of band (conversation "none")
        self.text: list[str] = []
        self.report = None
        self.status = "in_progress"
        self.reason: str | None = None  # cancelled: turn_detected / client_cancelled; incomplete: max_output_tokens
        self.interrupted_at: float | None = None  # perf_counter when the cancel was asked for
        self.stop_s: float | None = None  # from then until the engine stopped
        self.error: dict | None = None  # failed: what failed

    @property
    def speech(self) -> bool:
        return self.params.speech

    @property
    def interrupted(self) -> bool:
        return self.interrupted_at is not None

    def interrupt(self, reason: str) -> None:
        if self.interrupted_at is None:
            self.interrupted_at = time.perf_counter()
            self.reason = reason

    def _ids(self) -> dict:
        return {"response_id": self.id, "item_id": self.item.id, "output_index": 0, "content_index": 0}

    def _object(self, usage: dict | None = None) -> dict:
        return {"object": "realtime.response", "id": self.id, "status": self.status,
                "status_details": self._status_details(),
                "output": [] if self.status == "in_progress" else [self.item.to_json()],
                "conversation_id": self.conversation_id, "output_modalities": list(self.params.output_modalities),
                "max_output_tokens": self.params.max_output_tokens or "inf",
                "audio": {"output": {"format": format_json("audio/pcm"), "voice": self.params.voice}},
                "usage": usage, "metadata": self.params.metadata}

    def _status_details(self) -> dict | None:
        if self.status in ("cancelled", "incomplete"):
            return {"type": self.status, "reason": self.reason}
        if self.status == "failed":
            return {"type": "failed", "error": self.error}
        return None

    def start(self, previous_item_id: str | None) -> list[dict]:
        """The events that open the response (the item's conversation.item.added when it joins the
        conversation)."""
        part = {"type": "audio", "transcript": ""} if self.speech else {"type": "text", "text": ""}
        opened = {**self.item.to_json(), "content": []}  # its part comes with response.content_part.added
        events = [server_event("response.created", response=self._object()),
                  server_event("response.output_item.added", response_id=self.id, output_index=0, item=opened)]
        if self.conversation_id is not None:
            events.append(server_event("conversation.item.added", previous_item_id=previous_item_id, item=opened))
        events.append(server_event("response.content_part.added", **self._ids(), part=part))
        return events

    def on_text(self, text: str) -> list[dict]:
        self.text.append(text)
        if self.interrupted or not text:
            return []
        kind = "response.output_audio_transcript.delta" if self.speech else "response.output_text.delta"
        return [server_event(kind, **self._ids(), delta=text)]

    def on_audio(self, samples, frames: int) -> list[dict]:
        """Audio sent is recorded (samples and codec frames) for conversation.item.truncate; audio held back
        after an interruption is neither sent nor recorded: the client never had it."""
        if self.interrupted or not self.speech or samples.size == 0:
            return []
        self.item.speech.chunks.append((int(samples.size), int(frames)))
        return [server_event("response.output_audio.delta", **self._ids(), delta=encode_pcm(samples))]

    def finish(self, report, prompt_details: tuple[int, int]) -> list[dict]:
        """The closing events once the engine's Done has come (`report`; None when the response was cancelled
        before the engine started): the item's text becomes the report's whole text (deltas held back after an
        interruption included), its status completed or incomplete."""
        self.report = report
        text = "".join(self.text)
        if self.interrupted or report is None or report.cancelled:
            # Not interrupted here, yet cancelled: the server stopped it (shutdown).
            self.status = "cancelled"
        elif report.finish_reason == "length":
            self.status, self.reason = "incomplete", "max_output_tokens"
        else:
            self.status = "completed"
        self.item.status = "completed" if self.status == "completed" else "incomplete"
        part = self.item.content[0]
        if self.speech:
            part.transcript = text
            self.item.speech.token_ids = tuple(report.token_ids) if report is not None else ()
            done = [server_event("response.output_audio.done", **self._ids()),
                    server_event("response.output_audio_transcript.done", **self._ids(), transcript=text)]
            part_json = {"type": "audio", "transcript": text}
        else:
            part.text = text
            done = [server_event("response.output_text.done", **self._ids(), text=text)]
            part_json = {"type": "text", "text": text}
        done += [server_event("response.content_part.done", **self._ids(), part=part_json),
                 server_event("response.output_item.done", response_id=self.id, output_index=0,
                              item=self.item.to_json())]
        if self.conversation_id is not None:
            done.append(server_event("conversation.item.done", item=self.item.to_json()))
        return done + [self.done_event(report, prompt_details)]

    def fail(self, code: str, message: str, error_type: str = "server_error") -> list[dict]:
        """response.done with status failed: the engine never answered (the queue refused it, the server is
        stopping, the engine raised)."""
        self.status = "failed"
        self.error = {"type": error_type, "code": code, "message": message}
        self.item.status = "incomplete"
        return [self.done_event(None, (0, 0))]

    def done_event(self, report, prompt_details: tuple[int, int]) -> dict:
        obj = self._object(usage(report, prompt_details) if report is not None else None)
        if report is not None:
            obj["orin"] = {**report.to_json(), "interrupt_to_stop_s": self.stop_s}
        return server_event("response.done", response=obj)


def usage(report, prompt_details: tuple[int, int]) -> dict:
    """GA usage: the engine's prompt and completion tokens; of the prompt, the audio and image tokens counted in
    the conversation (`prompt_details`); of the output, text tokens and codec frames (the talker's audio
    tokens); of the input, the tokens read from the engine's cache (a turn's rows shared with the turn before:
    Report.cached_tokens), not broken down by kind."""
    audio_in, image_in = prompt_details
    prompt, text_out, audio_out = int(report.prompt_tokens), int(report.completion_tokens), int(report.talker_frames)
    return {"total_tokens": prompt + text_out + audio_out, "input_tokens": prompt,
            "output_tokens": text_out + audio_out,
            "input_token_details": {"text_tokens": max(0, prompt - audio_in - image_in), "audio_tokens": audio_in,
                                    "image_tokens": image_in, "cached_tokens": int(report.cached_tokens)},
            "output_token_details": {"text_tokens": text_out, "audio_tokens": audio_out}}
