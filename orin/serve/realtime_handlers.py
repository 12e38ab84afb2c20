"""A Realtime session's client events, handled: session.update, the input audio buffer and the server VAD's turns,
the conversation's items, and the responses, driven through the server's worker (the one GPU lane chat uses too)
with barge-in. The state they share is SessionHandlers'; the WebSocket's frames (accepting, reading, writing,
closing) are orin.serve.realtime's, whose session class supplies `emit`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import numpy as np
from starlette.concurrency import run_in_threadpool

from ..audio_format import INPUT_SAMPLE_RATE
from ..contract import AudioChunk, Done, GenerationRequest, TextDelta
from ..errors import OrinError
from ..realtime import events as ev
from ..realtime.audio import INPUT_FORMATS, PCM_RATE, Upsampler, decode
from ..realtime.conversation import (
    MIN_AUDIO_MS,
    Conversation,
    Item,
    MediaLimits,
    assistant_item,
    audio_item,
    parse_item,
)
from ..realtime.events import EventError, error_event, new_id, server_event
from ..realtime.response import ResponseRun
from ..realtime.session import Capabilities, InputAudioBuffer, SessionConfig, apply_update, response_params
from ..realtime.vad import SpeechStarted, TurnDetector
from .admission import Abandoned, Closed, QueueFull
from .chat_request import speech_frames
from .protocol import to_api_error

log = logging.getLogger("orin.serve.app")  # one logger for the server's lines, whichever module writes them

IDLE_KEEP_MS = 1000  # audio kept before the prefix padding while nobody speaks (the VAD reports onsets late)
# max_output_tokens "inf": OpenAI's largest explicit value. The planner sizes the KV caches (the talker's too, at 8
# frames a token unless --max-speech-seconds caps speech) for the whole allowance, so "inf" must stay bounded.
INF_TOKENS = 4096
# The spoken question a session's first turn is expected to hold, in seconds, least and most (with the VAD's
# prefix padding and closing silence): a robot's spoken commands and questions are a few seconds.
FIRST_QUESTION_S = (1.0, 10.0)


class SessionHandlers:
    """One session's state and its client events' handlers. `hub` is orin.serve.realtime.RealtimeHub (the server,
    the token counter, the context length, the model's capabilities)."""

    def __init__(self, hub):
        srv = hub.server
        self.hub, self.server, self.cfg_srv = hub, srv, srv.cfg
        self.id = new_id("sess")
        self.started = time.monotonic()
        self.deadline = self.started + srv.cfg.realtime_max_session_s
        self.expires_at = int(time.time() + srv.cfg.realtime_max_session_s)
        self.limits = MediaLimits(srv.cfg.max_audio_seconds, srv.cfg.max_image_pixels)
        self.buffer = InputAudioBuffer(srv.cfg.realtime_max_buffer_s)
        self.conversation = Conversation()
        self.conversation_id = new_id("conv")
        self.caps: Capabilities | None = None
        self.cfg: SessionConfig | None = None
        self.detector = None
        self.detector_offset_ms = 0  # the session timeline's position when the detector started
        self.upsample = Upsampler(1)
        self.pending_item_id: str | None = None  # the user item the VAD's current turn will become
        self.response: ResponseRun | None = None
        self.response_task: asyncio.Future | None = None
        self.cancel: threading.Event | None = None
        self.truncates: list = []  # truncations of the running response's item, applied once it is done
        self.follow_up = False  # the VAD ended a turn while an interrupted response was stopping
        self.spoke = False  # the model has answered with audio (the voice is fixed from then on)
        self.idle_from = time.monotonic()  # idle_timeout_ms counts from here
        self.gone = False

    async def emit(self, *events: dict) -> None:
        """Send events to the client, in order (the WebSocket side's)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ events

    async def _guard(self, event_id: str | None, work) -> None:
        """Run a handler; its refusal is an `error` answering `event_id`, and the session goes on."""
        try:
            await work
        except EventError as exc:
            await self.emit(error_event(exc.for_event(event_id)))
        except OrinError as exc:
            await self.emit(error_event(EventError(str(exc), event_id=event_id)))
        except Exception as exc:
            log.exception("realtime event failed")
            await self.emit(error_event(EventError(f"internal error ({type(exc).__name__}: {exc}); see the "
                                                   "server log", code="internal_error", type="server_error",
                                                   event_id=event_id)))

    async def _dispatch(self, event) -> None:
        handler = {
            ev.SessionUpdate: self._session_update, ev.AudioAppend: self._append, ev.AudioCommit: self._commit,
            ev.AudioClear: self._clear, ev.OutputAudioClear: self._output_clear, ev.ItemCreate: self._item_create,
            ev.ItemTruncate: self._truncate, ev.ItemDelete: self._delete, ev.ItemRetrieve: self._retrieve,
            ev.ResponseCreate: self._response_create, ev.ResponseCancel: self._response_cancel,
        }[type(event)]
        await handler(event)

    # ------------------------------------------------------------------ session and input audio

    async def _session_update(self, event: ev.SessionUpdate) -> None:
        old = self.cfg
        new = apply_update(old, event.session, self.caps, spoke=self.spoke, buffered=len(self.buffer) > 0)
        if new.input_format != old.input_format:
            self.buffer.set_rate(INPUT_FORMATS[new.input_format])
            self.upsample = Upsampler(PCM_RATE // INPUT_FORMATS[new.input_format])
        self.cfg = new
        if new.turn_detection != old.turn_detection:
            await self._configure_vad()
        await self.emit(server_event("session.updated", session=new.to_json(self.id, self.expires_at)))
        if (new.instructions, new.max_output_tokens) != (old.instructions, old.max_output_tokens):
            self.expect_first_turn()

    def expect_first_turn(self) -> None:
        """Before the conversation's first turn: the engine captures its prefill graphs while the user speaks,
        for the instructions and a spoken question of FIRST_QUESTION_S seconds (a long system prompt is beyond
        what the server warm-up's graphs reach; docs/architecture.md, "Capture policy")."""
        if len(self.conversation):
            return
        counter = self.hub.counter()
        fixed = counter.system(self.cfg.instructions) + counter.generation_prompt
        lo, hi = (fixed + counter.count(audio_item(np.zeros(int(s * INPUT_SAMPLE_RATE), np.float32),
                                                   INPUT_SAMPLE_RATE)).tokens for s in FIRST_QUESTION_S)
        answer = self.cfg.max_output_tokens or min(self.server.cfg.max_new_tokens, INF_TOKENS)
        self.server.worker.expect_conversation((lo, hi), answer)

    async def _configure_vad(self) -> None:
        """A detector for the session's turn_detection (none for null), its timeline continuing the session's."""
        vad = self.cfg.turn_detection
        if vad is None:
            self.detector = None
            return
        # The first detector of the process loads Silero's model (tens of ms): off the event loop.
        self.detector = await run_in_threadpool(TurnDetector, vad)
        self.detector_offset_ms = self.buffer.end_ms
        self.idle_from = time.monotonic()

    async def _append(self, event: ev.AudioAppend) -> None:
        samples = decode(event.audio, self.cfg.input_format)
        self.buffer.append(samples)
        if self.detector is None:
            return
        vad = self.cfg.turn_detection
        for turn in self.detector.feed(self.upsample(samples)):
            if isinstance(turn, SpeechStarted):
                await self._speech_started(turn.audio_start_ms + self.detector_offset_ms)
            else:
                await self._speech_stopped(turn.audio_end_ms + self.detector_offset_ms)
        if not self.detector.speaking:
            # Nobody speaks: keep only what a turn starting now could reach back to.
            self.buffer.trim_before(self.buffer.end_ms - vad.prefix_padding_ms - IDLE_KEEP_MS)

    async def _speech_started(self, audio_start_ms: int) -> None:
        self.pending_item_id = new_id("item")
        self.buffer.trim_before(audio_start_ms)
        if self.response is not None and self.cfg.turn_detection.interrupt_response:
            self._interrupt("turn_detected")
        await self.emit(server_event("input_audio_buffer.speech_started", audio_start_ms=audio_start_ms,
                                     item_id=self.pending_item_id))

    async def _speech_stopped(self, audio_end_ms: int) -> None:
        item_id = self.pending_item_id or new_id("item")
        self.pending_item_id = None
        self.idle_from = time.monotonic()
        await self.emit(server_event("input_audio_buffer.speech_stopped", audio_end_ms=audio_end_ms,
                                     item_id=item_id))
        samples, _, _ = self.buffer.take(until_ms=audio_end_ms)
        if samples.size:
            await self._add_audio(samples, item_id)
        vad = self.cfg.turn_detection
        if vad is not None and vad.create_response:
            if self.response is None:
                await self._start_response(response_params(self.cfg, {}, self.caps))
            elif self.response.interrupted:
                self.follow_up = True  # answered once the interrupted response has stopped

    async def _add_audio(self, samples, item_id: str) -> None:
        item = await run_in_threadpool(audio_item, samples, self.buffer.rate, item_id)
        self.hub.counter().count(item)
        previous = self.conversation.add(item)
        await self.emit(server_event("input_audio_buffer.committed", previous_item_id=previous, item_id=item.id),
                        server_event("conversation.item.added", previous_item_id=previous, item=item.to_json()),
                        server_event("conversation.item.done", previous_item_id=previous, item=item.to_json()))

    async def _commit(self, event: ev.AudioCommit) -> None:
        if self.buffer.duration_ms < MIN_AUDIO_MS:
            raise EventError(f"the input audio buffer holds {self.buffer.duration_ms} ms of audio; commit at least "
                             f"{MIN_AUDIO_MS} ms (append audio first)", code="input_audio_buffer_commit_empty")
        samples, _, _ = self.buffer.take()
        if self.detector is not None:
            self.detector.reset_turn()
        item_id = self.pending_item_id or new_id("item")
        self.pending_item_id = None
        await self._add_audio(samples, item_id)

    async def _clear(self, event: ev.AudioClear) -> None:
        self.buffer.clear()
        if self.detector is not None:
            self.detector.reset_turn()
        self.pending_item_id = None
        await self.emit(server_event("input_audio_buffer.cleared"))

    async def _output_clear(self, event: ev.OutputAudioClear) -> None:
        raise EventError("output_audio_buffer.clear is for WebRTC and SIP calls; over a WebSocket the client plays "
                         "the audio: stop playback, send response.cancel and conversation.item.truncate",
                         code="unsupported_event", param="type")

    async def _idle_timeout(self) -> None:
        """turn_detection.idle_timeout_ms passed without speech: the audio since (if any) is committed and the
        model answers, as OpenAI does."""
        item_id = new_id("item")
        self.idle_from = time.monotonic()
        await self.emit(server_event("input_audio_buffer.timeout_triggered", audio_start_ms=self.buffer.start_ms,
                                     audio_end_ms=self.buffer.end_ms, item_id=item_id))
        samples, _, _ = self.buffer.take()
        if samples.size * 1000 >= MIN_AUDIO_MS * self.buffer.rate:
            await self._add_audio(samples, item_id)
        if self.conversation.items:
            await self._start_response(response_params(self.cfg, {}, self.caps))

    # ------------------------------------------------------------------ conversation

    async def _item_create(self, event: ev.ItemCreate) -> None:
        item = await run_in_threadpool(parse_item, event.item, self.cfg.input_format, self.limits)
        self.hub.counter().count(item)
        previous = self.conversation.add(item, event.previous_item_id)
        await self.emit(server_event("conversation.item.added", previous_item_id=previous, item=item.to_json()),
                        server_event("conversation.item.done", previous_item_id=previous, item=item.to_json()))

    async def _truncate(self, event: ev.ItemTruncate) -> None:
        item = self.conversation.get(event.item_id)
        if item.role != "assistant" or item.speech is None:
            raise EventError("only an assistant item's audio can be truncated; this item has none",
                             param="item_id")
        if event.content_index != 0:
            raise EventError(f"content_index {event.content_index}: an assistant item has one content part (0)",
                             param="content_index")
        if self.response is not None and self.response.item is item:
            self.truncates.append(event)  # the answer is still being cut off: applied once the engine has stopped
            return
        await self._apply_truncate(item, event.audio_end_ms)

    async def _apply_truncate(self, item: Item, audio_end_ms: int) -> None:
        speech = item.speech
        if audio_end_ms > speech.audio_ms:
            raise EventError(f"audio_end_ms {audio_end_ms} is past the item's audio ({speech.audio_ms} ms were sent)",
                             param="audio_end_ms")
        speech.truncate(audio_end_ms)
        item.content[0].transcript = self.server.engine.decode_tokens(speech.token_ids)
        self.hub.counter().count(item)
        await self.emit(server_event("conversation.item.truncated", item_id=item.id, content_index=0,
                                     audio_end_ms=audio_end_ms))

    async def _delete(self, event: ev.ItemDelete) -> None:
        if self.response is not None and self.response.item.id == event.item_id:
            raise EventError("the item is the running response's answer: cancel the response first",
                             param="item_id")
        self.conversation.delete(event.item_id)
        await self.emit(server_event("conversation.item.deleted", item_id=event.item_id))

    async def _retrieve(self, event: ev.ItemRetrieve) -> None:
        item = self.conversation.get(event.item_id)
        await self.emit(server_event("conversation.item.retrieved", item=item.to_json()))

    # ------------------------------------------------------------------ responses

    async def _response_create(self, event: ev.ResponseCreate) -> None:
        if self.response is not None:
            raise EventError(f"response {self.response.id} is still in progress: wait for its response.done or "
                             "send response.cancel", code="conversation_already_has_active_response")
        params = response_params(self.cfg, event.response, self.caps)
        await self._start_response(params)

    async def _response_cancel(self, event: ev.ResponseCancel) -> None:
        run = self.response
        if run is None or run.interrupted or (event.response_id and event.response_id != run.id):
            raise EventError("there is no response in progress to cancel" if run is None or run.interrupted else
                             f"response {event.response_id!r} is not the one in progress ({run.id})",
                             code="response_cancel_not_active", param="response_id" if event.response_id else None)
        self._interrupt("client_cancelled")

    def _interrupt(self, reason: str) -> None:
        if self.response is not None and not self.response.interrupted:
            self.response.interrupt(reason)
            self.cancel.set()

    async def _context(self, params) -> tuple[list[Item], int]:
        """The items the response answers (the conversation, trimmed to fit, or response.input) and its
        max_new_tokens."""
        counter, srv = self.hub.counter(), self.server
        context = self.hub.context_tokens()
        fixed = counter.system(params.instructions) + counter.generation_prompt
        most = min(srv.cfg.max_new_tokens, INF_TOKENS)  # what "inf" may reach
        reserve = params.max_output_tokens or min(most, context // 4)
        if params.input is not None:
            items = [await self._input_item(obj, i) for i, obj in enumerate(params.input)]
            need = fixed + sum(i.tokens for i in items)
            if need > context - reserve:
                raise EventError(f"response.input takes {need} tokens, more than the {context - reserve} the "
                                 "context leaves beside the answer", code="context_length_exceeded")
        else:
            if self.cfg.truncation == "disabled":
                need = fixed + self.conversation.tokens()
                if need > context - reserve:
                    raise EventError(f"the conversation takes {need} tokens, more than the {context - reserve} the "
                                     "context leaves beside the answer, and truncation is disabled: delete items "
                                     "or set session.truncation \"auto\"", code="context_length_exceeded")
            for dropped in self.conversation.trim(fixed, context - reserve):
                await self.emit(server_event("conversation.item.deleted", item_id=dropped.id))
            items = list(self.conversation.items)
        prompt = fixed + sum(i.tokens for i in items)
        limit = params.max_output_tokens or min(most, context - prompt)
        return items, max(1, limit)

    async def _input_item(self, obj: object, index: int) -> Item:
        if isinstance(obj, dict) and obj.get("type") == "item_reference":
            return self.conversation.get(obj.get("id"))
        item = await run_in_threadpool(parse_item, obj, self.cfg.input_format, self.limits, f"response.input[{index}]")
        return self.hub.counter().count(item)

    async def _start_response(self, params) -> None:
        srv = self.server
        if self.cfg_srv.realtime_busy == "error" and srv.gate.busy:
            raise EventError("the GPU is answering another session or request; retry when it is done (the server "
                             "runs one generation at a time; --realtime-busy wait queues instead)",
                             code="server_busy", type="server_error")
        items, max_new = await self._context(params)
        messages = self.conversation.messages(params.instructions, items)
        if not any(m["role"] == "user" for m in messages):
            raise EventError("nothing to answer: add a user item (conversation.item.create) or commit audio first",
                             code="conversation_empty")
        extra = {}
        if srv.cfg.max_speech_seconds is not None:
            extra["max_audio_frames"] = speech_frames(srv.cfg.max_speech_seconds)
        # a session's responses continue one conversation: each prompt starts with the one before (unless items
        # were deleted or dropped), whose rows the engine reads from its cache instead of computing them again
        req = GenerationRequest(messages=messages, max_new_tokens=max_new, speech=params.speech, voice=params.voice,
                                continues=True, **extra)
        item = assistant_item(params.speech)
        joins = params.conversation == "auto"
        run = ResponseRun(params, item, self.conversation_id if joins else None)
        details = (sum(i.audio_tokens for i in items), sum(i.image_tokens for i in items))
        previous = self.conversation.add(item) if joins else None
        self.response, self.cancel = run, threading.Event()
        await self.emit(*run.start(previous))
        self.response_task = asyncio.ensure_future(self._drive(run, req, self.cancel, details))

    async def _drive(self, run: ResponseRun, req: GenerationRequest, cancel: threading.Event, details) -> None:
        """Pump the engine's events into the response's; always ends with response.done."""
        srv = self.server
        engine_run = srv.worker.submit(req, cancel)
        closing: list[dict] = []
        try:
            event = await engine_run.get()
            while not isinstance(event, Done):
                if isinstance(event, TextDelta):
                    await self.emit(*run.on_text(event.text))
                elif isinstance(event, AudioChunk):
                    await self.emit(*run.on_audio(event.samples, len(event.frames)))
                event = await engine_run.get()
            if run.interrupted:
                run.stop_s = time.perf_counter() - run.interrupted_at
            await self._released(engine_run)
            closing = run.finish(event.report, details)
            self.spoke = self.spoke or bool(run.speech and run.item.speech.chunks)
            self.hub.counter().count(run.item)
        except QueueFull:
            closing = run.fail("queue_full", f"the server is busy: {srv.gate.max_queue} requests are already "
                               "waiting for the GPU (--max-queue); retry later")
        except Closed:
            closing = run.fail("shutting_down", "the server is shutting down")
        except Abandoned:
            closing = run.finish(None, details)  # cancelled while it waited for the GPU: the engine never ran
        except Exception as exc:  # noqa: BLE001 - the engine's error ends this response, not the session
            err = to_api_error(exc)
            oom = err.code == "out_of_memory"  # an answer, not a fault: a warning, and an error event too
            level = logging.WARNING if oom else logging.ERROR if err.status >= 500 else logging.INFO
            log.log(level, "realtime response failed: %s", err.message)
            closing = run.fail(err.code or "engine_error", err.message, err.type)
            if oom:  # the session goes on; its client may retry
                closing.insert(0, error_event(EventError(err.message, code=err.code, type=err.type)))
        finally:
            self.response, self.cancel, self.response_task = None, None, None
            audio_s = run.item.speech.audio_ms / 1000 if run.item.speech else 0.0
            self.idle_from = time.monotonic() + (0.0 if run.interrupted else audio_s)  # once it has been played
            srv.metrics.realtime_response(run.status, run.stop_s)
        await self.emit(*closing)
        truncates, self.truncates = self.truncates, []
        for t in truncates:
            await self._guard(t.event_id, self._apply_truncate(run.item, t.audio_end_ms))
        if self.follow_up and not self.gone:
            self.follow_up = False
            await self._guard(None, self._start_response(response_params(self.cfg, {}, self.caps)))

    @staticmethod
    async def _released(engine_run) -> None:
        """Wait for the worker's end marker, which follows its release of the GPU: once response.done is out, the
        GPU is free (a response that follows at once is not refused as busy by this one's tail)."""
        try:
            await engine_run.get()
        except OrinError:
            pass  # the end marker reads as "ended without a report", the report having come before it
        except Exception:  # noqa: BLE001 - a failure after the report (closing the stream) does not undo the answer
            log.warning("the engine failed after its report", exc_info=True)

    async def _stop_response(self) -> None:
        """On the session's end: cancel the running response and wait (without blocking the loop) until the
        engine has stopped, so the GPU and the slot are free when the session is gone."""
        while self.response_task is not None:
            task = self.response_task
            if self.cancel is not None:
                self.cancel.set()
            try:
                await task
            except Exception:  # noqa: BLE001 - the session is over; what failed was logged by _drive
                log.debug("realtime response ended with an error after the session closed", exc_info=True)
            if self.response_task is task:
                break


