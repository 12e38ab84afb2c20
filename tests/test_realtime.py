"""The Realtime API (GA) over WebSocket, end to end: the real server on port 0 around the real engine on the tiny
quantized model (CPU), the official `openai` client's `client.realtime.connect`, and real speech from espeak-ng.

The tiny model answers random tokens and its talker never ends speech by itself (server_kit caps it at 0.8 s), so
the tests assert the protocol's structure, order and bookkeeping, not what is said. Slow generations are made
deterministic with the server's worker hook (realtime_kit.HoldProbe), never with a stand-in engine.
"""

from __future__ import annotations

import base64
import io
import json
import math
import socket
import threading

import numpy as np
import pytest
import realtime_kit as rt
import server_kit as kit
import websockets.sync.client as ws_client
from speech_kit import pcm16, silence, speak
from websockets.exceptions import ConnectionClosed

from orin.contract import GenerationRequest
from orin.inputs.media import synth_image
from orin.realtime.audio import Upsampler, decode, g711_table
from orin.realtime.conversation import Conversation, Item, Part, Speech, assistant_item
from orin.realtime.events import EventError, parse_client_event
from orin.realtime.session import InputAudioBuffer
from orin.realtime.tokens import TokenCounter
from orin.realtime.vad import ServerVad, SpeechStarted, SpeechStopped, TurnDetector

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def srv(engine, quantized_dir):
    server = kit.start_server(engine, quantized_dir)
    yield server
    server.stop()


def _pcm(events) -> bytes:
    return b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")


def _png_url(size=64) -> str:
    buf = io.BytesIO()
    synth_image(size, seed=3).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# --------------------------------------------------------------------------- spoken turns


def test_a_spoken_question_committed_by_the_client_is_answered_in_audio_and_transcript(srv, engine):
    with rt.session(srv) as conn:
        session = conn.created.session
        assert conn.created.type == "session.created" and session.type == "realtime"
        assert session.model == engine.model_name and session.output_modalities == ["audio"]
        assert session.audio.input.format.type == "audio/pcm" and session.audio.input.format.rate == 24000
        assert session.audio.input.turn_detection.type == "server_vad"  # OpenAI's default
        assert session.audio.output.voice == "ethan"
        updated = rt.configure(conn, audio={"input": {"turn_detection": None}}, max_output_tokens=6)
        assert updated.audio.input.turn_detection is None and updated.max_output_tokens == 6
        rt.stream(conn, speak(QUESTION))
        conn.input_audio_buffer.commit()
        committed = rt.until(conn, "input_audio_buffer.committed")
        added = rt.until(conn, "conversation.item.added")
        assert added.item.id == committed.item_id and added.item.role == "user"
        assert [c.type for c in added.item.content] == ["input_audio"]
        rt.until(conn, "conversation.item.done")
        seen: list = []
        done = rt.respond(conn, seen)
    kinds = rt.types(seen)
    head = ["response.created", "response.output_item.added", "conversation.item.added", "response.content_part.added"]
    tail = ["response.output_audio.done", "response.output_audio_transcript.done", "response.content_part.done",
            "response.output_item.done", "conversation.item.done", "response.done"]
    assert kinds[:4] == head and kinds[-6:] == tail
    assert set(kinds[4:-6]) == {"response.output_audio_transcript.delta", "response.output_audio.delta"}
    response = done.response
    assert response.status in ("completed", "incomplete") and response.output_modalities == ["audio"]
    item = response.output[0]
    assert item.role == "assistant" and item.content[0].type == "output_audio"
    transcript = "".join(e.delta for e in seen if e.type == "response.output_audio_transcript.delta")
    assert transcript == seen[-5].transcript == item.content[0].transcript
    assert {e.response_id for e in seen[1:-1] if hasattr(e, "response_id")} == {response.id}
    report = response.model_extra["orin"]
    pcm = np.frombuffer(_pcm(seen), "<i2")
    assert pcm.size > 0 and pcm.size == pytest.approx(report["audio_seconds"] * 24000, abs=1)
    usage = response.usage
    assert usage.input_tokens == report["prompt_tokens"]
    assert usage.output_token_details.text_tokens == report["completion_tokens"] <= 6
    assert usage.output_token_details.audio_tokens == report["talker_frames"] > 0
    assert usage.input_token_details.audio_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    if response.status == "incomplete":
        assert response.status_details.reason == "max_output_tokens"


def test_server_vad_finds_the_turn_and_answers_without_a_commit(srv):
    lead = 0.6
    with rt.session(srv) as conn:
        rt.configure(conn, max_output_tokens=4)
        rt.stream(conn, np.concatenate([silence(lead), speak(QUESTION), silence(1.2)]))
        seen: list = []
        done = rt.until(conn, "response.done", seen)
    kinds = rt.types(seen)
    order = ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped", "input_audio_buffer.committed",
             "conversation.item.added", "conversation.item.done", "response.created"]
    opening = kinds[:kinds.index("response.created") + 1]
    assert [k for k in opening if k in order] == order
    started, stopped, committed = (seen[kinds.index(k)] for k in order[:3])
    # the turn's audio starts prefix_padding_ms (300) before the onset
    assert 0 <= started.audio_start_ms <= lead * 1000 - 300 + 150
    assert started.audio_start_ms < stopped.audio_end_ms
    assert started.item_id == stopped.item_id == committed.item_id
    assert done.response.status in ("completed", "incomplete")


def test_g711_mu_law_input_is_heard_and_committed(srv):
    table = g711_table("mu")
    assert table[0xFF] == 0.0 and table[0x00] == -table[0x80] < -0.9  # G.711: 0xFF is zero, 0x00 the lowest
    speech = np.concatenate([silence(0.5, 8000), speak(QUESTION, 8000), silence(1.0, 8000)])
    order = np.argsort(table)  # mu-law by nearest code
    codes = order[np.clip(np.searchsorted(table[order], speech), 0, 255)].astype(np.uint8).tobytes()
    assert np.abs(decode(codes, "audio/pcmu") - speech).max() < 0.05
    with rt.session(srv) as conn:
        updated = rt.configure(conn, audio={"input": {"format": {"type": "audio/pcmu"}, "turn_detection": {
            "type": "server_vad", "create_response": False}}})
        assert updated.audio.input.format.type == "audio/pcmu"
        for at in range(0, len(codes), 320):  # 40 ms appends
            conn.input_audio_buffer.append(audio=base64.b64encode(codes[at:at + 320]).decode())
        seen: list = []
        committed = rt.until(conn, "input_audio_buffer.committed", seen)
        started = next(e for e in seen if e.type == "input_audio_buffer.speech_started")
        assert 0 <= started.audio_start_ms <= 500 - 300 + 150 and committed.item_id == started.item_id
        item = rt.until(conn, "conversation.item.done").item
        assert [c.type for c in item.content] == ["input_audio"]


def test_the_vad_upsampling_keeps_g711_turns():
    speech = np.concatenate([silence(0.5, 8000), speak(QUESTION, 8000), silence(1.0, 8000)])
    up, detector, found = Upsampler(3), TurnDetector(ServerVad()), []
    for at in range(0, speech.size, 160):
        found += detector.feed(up(speech[at:at + 160]))
    assert [type(e) for e in found] == [SpeechStarted, SpeechStopped]


# --------------------------------------------------------------------------- barge-in, cancel, truncate


def test_barge_in_cancels_the_response_stops_the_engine_and_answers_the_new_turn(engine, quantized_dir):
    probe = rt.HoldProbe()
    server = kit.start_server(engine, quantized_dir, hook=probe)
    try:
        with rt.session(server) as conn:
            rt.configure(conn, max_output_tokens=200)
            rt.text_item(conn, "Tell me a long story.")
            probe.armed.set()
            conn.response.create()
            created = rt.until(conn, "response.created")
            assert probe.reached.wait(60)
            rt.stream(conn, speak("Stop, please."))
            seen: list = []
            done = rt.until(conn, "response.done", seen)
            assert "input_audio_buffer.speech_started" in rt.types(seen)
            response = done.response
            assert response.id == created.response.id and response.status == "cancelled"
            assert response.status_details.reason == "turn_detected"
            assert response.model_extra["orin"]["interrupt_to_stop_s"] >= 0
            assert response.output[0].status == "incomplete"
            # the engine saw the cancel and stopped within one step; the GPU is free for the new turn
            assert probe.saw_cancel.is_set() and probe.done.wait(30)
            assert probe.report.cancelled is True and probe.after_cancel <= 1
            assert probe.report.completion_tokens < 200
            rt.configure(conn, max_output_tokens=3)
            rt.stream(conn, silence(1.2))
            seen = []
            again = rt.until(conn, "response.done", seen)
            assert "input_audio_buffer.committed" in rt.types(seen)
            assert again.response.status in ("completed", "incomplete")
        metrics = kit.metrics(server)
        assert metrics['orin_realtime_responses_total{status="cancelled"}'] == 1
        assert metrics["orin_realtime_interrupt_seconds_count"] == 1
    finally:
        server.stop()


def test_response_cancel_and_the_active_response_rules(engine, quantized_dir):
    probe = rt.HoldProbe()
    server = kit.start_server(engine, quantized_dir, hook=probe)
    try:
        with rt.session(server) as conn:
            rt.configure(conn, audio={"input": {"turn_detection": None}}, output_modalities=["text"],
                         max_output_tokens=100)
            rt.text_item(conn, "Go on.")
            probe.armed.set()
            conn.response.create()
            created = rt.until(conn, "response.created")
            assert probe.reached.wait(60)
            rt.send_raw(conn, {"type": "response.create", "event_id": "evt_twice"})
            error = rt.until(conn, "error")
            assert error.error.code == "conversation_already_has_active_response"
            assert error.error.event_id == "evt_twice"
            rt.send_raw(conn, {"type": "response.cancel", "event_id": "evt_other", "response_id": "resp_other"})
            assert rt.until(conn, "error").error.event_id == "evt_other"
            conn.response.cancel(response_id=created.response.id)
            done = rt.until(conn, "response.done")
            assert done.response.status == "cancelled" and done.response.status_details.reason == "client_cancelled"
            assert probe.done.wait(30) and probe.report.cancelled is True and probe.after_cancel <= 1
    finally:
        server.stop()


def test_truncate_keeps_the_transcript_of_what_was_heard(srv, engine):
    with rt.session(srv) as conn:
        rt.configure(conn, audio={"input": {"turn_detection": None}}, max_output_tokens=8)
        rt.text_item(conn, "Say something.")
        seen: list = []
        done = rt.respond(conn, seen)
        item_id = done.response.output[0].id
        tokens = done.response.model_extra["orin"]["token_ids"]
        first = next(e for e in seen if e.type == "response.output_audio.delta")
        first_ms = math.ceil(len(base64.b64decode(first.delta)) / 2 / 24)
        total_ms = len(_pcm(seen)) // 2 // 24
        conn.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=total_ms + 50)
        error = rt.until(conn, "error")
        assert error.error.param == "audio_end_ms"
        # The first audio chunk is code2wav's first chunk of codec frames (the engine profile's schedule), which
        # speak as many first tokens.
        first_frames = engine.profile.speech.code2wav_first_chunk
        conn.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=first_ms)
        truncated = rt.until(conn, "conversation.item.truncated")
        assert (truncated.item_id, truncated.content_index, truncated.audio_end_ms) == (item_id, 0, first_ms)
        conn.conversation.item.retrieve(item_id=item_id)
        item = rt.until(conn, "conversation.item.retrieved").item
        assert item.content[0].transcript == engine.tokenizer.decode(tokens[:first_frames], skip_special_tokens=True)
        conn.conversation.item.truncate(item_id=item_id, content_index=0, audio_end_ms=0)
        rt.until(conn, "conversation.item.truncated")
        conn.conversation.item.retrieve(item_id=item_id)
        assert rt.until(conn, "conversation.item.retrieved").item.content[0].transcript == ""


def test_speech_maps_heard_audio_to_frames_and_tokens():
    speech = Speech(token_ids=tuple(range(100, 112)), chunks=[(7000, 4), (11520, 6)])
    assert speech.audio_ms == 18520 * 1000 // 24000
    assert speech.frames_heard(0) == 0
    assert speech.frames_heard(7000 // 24) == 3  # 6984 of the first chunk's 7000 samples: 3 whole frames
    assert speech.frames_heard(math.ceil(7000 / 24)) == 4
    assert speech.frames_heard(10_000) == 10  # past the end: every frame
    assert speech.tokens_heard(math.ceil(7000 / 24) + 80) == tuple(range(100, 105))
    speech.truncate(math.ceil(7000 / 24) + 80)
    assert speech.token_ids == tuple(range(100, 105)) and speech.frames_heard(10_000) == 5


# --------------------------------------------------------------------------- text, images, turns, context


def test_a_text_only_session(srv):
    with rt.session(srv) as conn:
        updated = rt.configure(conn, output_modalities=["text"], max_output_tokens=5,
                               audio={"input": {"turn_detection": None}})
        assert updated.output_modalities == ["text"]
        rt.text_item(conn, "Hello!")
        seen: list = []
        done = rt.respond(conn, seen)
    kinds = rt.types(seen)
    assert not any("audio" in k for k in kinds)
    assert seen[3].part.type == "text"
    text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
    assert text == next(e for e in seen if e.type == "response.output_text.done").text
    item = done.response.output[0]
    assert item.content[0].type == "output_text" and item.content[0].text == text
    assert done.response.usage.output_token_details.audio_tokens == 0


def test_image_and_audio_content_in_a_created_item(srv, engine):
    audio = speak(QUESTION)
    with rt.session(srv) as conn:
        rt.configure(conn, output_modalities=["text"], max_output_tokens=3, audio={"input": {"turn_detection": None}})
        conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
            {"type": "input_image", "image_url": _png_url(64)},
            {"type": "input_audio", "audio": base64.b64encode(pcm16(audio)).decode()},
            {"type": "input_text", "text": "What is in the picture, and what did I ask?"}]})
        added = rt.until(conn, "conversation.item.added")
        assert [c.type for c in added.item.content] == ["input_image", "input_audio", "input_text"]
        done = rt.respond(conn)
    details = done.response.usage.input_token_details
    counter = TokenCounter(engine)
    assert details.image_tokens == counter.image_tokens(synth_image(64, seed=3)) > 0
    assert details.audio_tokens == counter.audio_tokens(math.ceil(audio.size * 2 / 3)) > 0


def test_per_response_overrides_and_out_of_band_responses(srv):
    with rt.session(srv) as conn:
        rt.configure(conn, output_modalities=["text"], max_output_tokens=5, audio={"input": {"turn_detection": None}})
        first = rt.text_item(conn, "Hello!")
        seen: list = []
        done = rt.respond(conn, seen, output_modalities=["audio"], audio={"output": {"voice": "chelsie"}},
                          max_output_tokens=2, instructions="Answer in one word.", metadata={"topic": "greeting"})
        response = done.response
        assert seen[0].response.audio.output.voice == "chelsie" and response.output_modalities == ["audio"]
        assert response.usage.output_token_details.text_tokens <= 2 and response.metadata == {"topic": "greeting"}
        assert "response.output_audio.delta" in rt.types(seen)
        # out of band: answers the given input, and neither it nor the answer joins the conversation
        seen = []
        done = rt.respond(conn, seen, conversation="none", input=[
            {"type": "item_reference", "id": first.id},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Classify that."}]}])
        assert done.response.conversation_id is None and done.response.output_modalities == ["text"]
        assert "conversation.item.added" not in rt.types(seen)
        conn.conversation.item.retrieve(item_id=done.response.output[0].id)
        assert rt.until(conn, "error").error.code == "item_not_found"


def test_the_next_response_reads_the_answer_before_it(srv, engine):
    with rt.session(srv) as conn:
        rt.configure(conn, output_modalities=["text"], max_output_tokens=5, instructions="Be brief.",
                     audio={"input": {"turn_detection": None}})
        rt.text_item(conn, "Name a colour.")
        first = rt.respond(conn)
        answer = first.response.output[0].content[0].text
        rt.text_item(conn, "And another?")
        second = rt.respond(conn)
    messages = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": answer}, {"role": "user", "content": "And another?"})
    expected = engine.prepare(GenerationRequest(messages=messages)).length
    assert second.response.usage.input_tokens == expected


def test_token_counts_match_the_engines_prompt(engine):
    counter = TokenCounter(engine)
    audio = speak(QUESTION, 16000)
    items = [Item("a", "user", [Part("input_text", text="Look and listen."), Part("input_image",
                                                                                   image=synth_image(80, seed=1)),
                                Part("input_audio", audio=audio)]),
             Item("b", "assistant", [Part("output_audio", transcript="A house, and a question.")]),
             Item("c", "system", [Part("input_text", text="Answer in French.")]),
             Item("d", "user", [Part("input_text", text="Why?")])]
    conversation = Conversation()
    for item in items:
        conversation.add(counter.count(item))
    messages = conversation.messages("You are a helpful robot.")
    fixed = counter.system("You are a helpful robot.") + counter.generation_prompt
    assert fixed + conversation.tokens() == engine.prepare(GenerationRequest(messages=messages)).length


def test_the_oldest_items_are_dropped_to_fit_the_context(engine, quantized_dir):
    counter = TokenCounter(engine)
    text = "Item {}: " + "word " * 8
    per_item = counter.count(Item("x", "user", [Part("input_text", text=text.format(0))])).tokens
    context = counter.generation_prompt + 3 * per_item + per_item // 2 + 4  # room for three items and the answer
    server = kit.start_server(engine, quantized_dir, realtime_context_tokens=context)
    try:
        with rt.session(server) as conn:
            rt.configure(conn, output_modalities=["text"], max_output_tokens=4,
                         audio={"input": {"turn_detection": None}})
            ids = [rt.text_item(conn, text.format(i)).id for i in range(6)]
            seen: list = []
            done = rt.respond(conn, seen)
            deleted = [e.item_id for e in seen if e.type == "conversation.item.deleted"]
            assert deleted == ids[:3]  # the oldest first, before the response starts
            assert rt.types(seen).index("response.created") > rt.types(seen).index("conversation.item.deleted")
            assert done.response.usage.input_tokens == counter.generation_prompt + 3 * per_item <= context - 4
            conn.conversation.item.retrieve(item_id=ids[0])
            assert rt.until(conn, "error").error.code == "item_not_found"
            rt.configure(conn, truncation="disabled")
            rt.text_item(conn, text.format(6))
            rt.send_raw(conn, {"type": "response.create", "event_id": "evt_long"})
            error = rt.until(conn, "error")
            assert error.error.code == "context_length_exceeded" and error.error.event_id == "evt_long"
    finally:
        server.stop()


# --------------------------------------------------------------------------- bad events, limits, safety

BAD_EVENTS = [
    ("malformed JSON", '{"type": "response.create",', "invalid_json", None),
    ("unknown type", {"type": "response.make", "event_id": "e1"}, "invalid_value", "type"),
    ("unknown key", {"type": "input_audio_buffer.commit", "event_id": "e2", "extra": 1}, "unknown_parameter", "extra"),
    ("bad base64", {"type": "input_audio_buffer.append", "event_id": "e3", "audio": "%%% not base64"},
     "invalid_base64", "audio"),
    ("odd PCM bytes", {"type": "input_audio_buffer.append", "event_id": "e4",
                       "audio": base64.b64encode(b"abc").decode()}, "invalid_audio", "audio"),
    ("16 kHz input", {"type": "session.update", "event_id": "e5", "session": {
        "type": "realtime", "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}},
     "invalid_value", "session.audio.input.format.rate"),
    ("wav input", {"type": "session.update", "event_id": "e6", "session": {
        "type": "realtime", "audio": {"input": {"format": {"type": "audio/wav"}}}}},
     "invalid_value", "session.audio.input.format.type"),
    ("VAD threshold", {"type": "session.update", "event_id": "e7", "session": {
        "type": "realtime", "audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": 2}}}}},
     "invalid_value", "session.audio.input.turn_detection.threshold"),
    ("OpenAI voice", {"type": "session.update", "event_id": "e8", "session": {
        "type": "realtime", "audio": {"output": {"voice": "alloy"}}}}, "invalid_value", "session.audio.output.voice"),
    ("transcription model", {"type": "session.update", "event_id": "e9", "session": {
        "type": "realtime", "audio": {"input": {"transcription": {"model": "whisper-1"}}}}},
     "invalid_value", "session.audio.input.transcription"),
    ("tools", {"type": "session.update", "event_id": "e10", "session": {
        "type": "realtime", "tools": [{"type": "function", "name": "f"}]}}, "invalid_value", "session.tools"),
    ("two modalities", {"type": "session.update", "event_id": "e11", "session": {
        "type": "realtime", "output_modalities": ["audio", "text"]}}, "invalid_value", "session.output_modalities"),
    ("no session type", {"type": "session.update", "event_id": "e12", "session": {"instructions": "x"}},
     "missing_required_parameter", "session.type"),
    ("truncate an unknown item", {"type": "conversation.item.truncate", "event_id": "e13", "item_id": "item_nope",
                                  "content_index": 0, "audio_end_ms": 10}, "item_not_found", "item_id"),
    ("delete an unknown item", {"type": "conversation.item.delete", "event_id": "e14", "item_id": "item_nope"},
     "item_not_found", "item_id"),
    ("cancel with no response", {"type": "response.cancel", "event_id": "e15"}, "response_cancel_not_active", None),
    ("commit an empty buffer", {"type": "input_audio_buffer.commit", "event_id": "e16"},
     "input_audio_buffer_commit_empty", None),
    ("function call item", {"type": "conversation.item.create", "event_id": "e17", "item": {
        "type": "function_call", "name": "f", "arguments": "{}"}}, "invalid_value", "item.type"),
    ("remote image", {"type": "conversation.item.create", "event_id": "e18", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "http://x/a.png"}]}},
     "invalid_value", "item.content[0].image_url"),
    ("output buffer clear", {"type": "output_audio_buffer.clear", "event_id": "e19"}, "unsupported_event", "type"),
    ("binary frame", b"\x00\x01", "invalid_json", None),
]


def test_bad_events_get_an_error_with_their_event_id_and_the_session_goes_on(srv):
    with rt.session(srv) as conn:
        for name, event, code, param in BAD_EVENTS:
            rt.send_raw(conn, event)
            error = rt.until(conn, "error")
            assert error.error.type == "invalid_request_error", name
            assert (error.error.code, error.error.param) == (code, param), (name, error.error)
            assert error.error.event_id == (event.get("event_id") if isinstance(event, dict) else None), name
            assert error.event_id.startswith("event_") and error.error.message, name
        # still working: a text answer
        rt.configure(conn, output_modalities=["text"], max_output_tokens=2, audio={"input": {"turn_detection": None}})
        rt.text_item(conn, "Still there?")
        assert rt.respond(conn).response.status in ("completed", "incomplete")


def test_event_parsing_refusals_carry_the_event_id():
    with pytest.raises(EventError) as info:
        parse_client_event('{"type": "conversation.item.truncate", "event_id": "x", "item_id": "i", '
                           '"content_index": 0, "audio_end_ms": -1}')
    assert (info.value.event_id, info.value.param) == ("x", "audio_end_ms")
    assert parse_client_event('{"type": "response.create"}').response == {}


def test_api_keys_and_the_model_are_checked(engine, quantized_dir, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("secret-key\n")
    keys.chmod(0o600)
    server = kit.start_server(engine, quantized_dir, api_key_file=str(keys))
    try:
        for key, model, code in (("wrong", None, "invalid_api_key"), ("secret-key", "gpt-realtime", "model_not_found")):
            with rt.connect(server, key, model) as conn:
                error = conn.recv()
                assert error.type == "error" and error.error.code == code
                with pytest.raises(ConnectionClosed) as info:
                    conn.recv()
                assert info.value.rcvd.code == 1008
        with rt.session(server, key="secret-key") as conn:
            assert conn.created.type == "session.created"
        # a browser sends its key as a subprotocol
        url = server.url.replace("http", "ws", 1) + f"/v1/realtime?model={server.model_name}"
        with ws_client.connect(url, subprotocols=["realtime", "openai-insecure-api-key.secret-key"]) as ws:
            assert ws.subprotocol == "realtime" and json.loads(ws.recv(timeout=30))["type"] == "session.created"
        metrics = rt.metrics(server, "secret-key")
        assert metrics['orin_requests_total{endpoint="/v1/realtime",status="401"}'] == 1
        assert metrics['orin_requests_total{endpoint="/v1/realtime",status="404"}'] == 1
    finally:
        server.stop()


def test_session_cap_refuses_or_waits_as_configured(engine, quantized_dir):
    server = kit.start_server(engine, quantized_dir, realtime_max_sessions=1, realtime_busy="error")
    try:
        with rt.session(server):
            with rt.connect(server) as second:
                error = second.recv()
                assert error.type == "error" and error.error.code == "session_limit_reached"
                with pytest.raises(ConnectionClosed) as info:
                    second.recv()
                assert info.value.rcvd.code == 1013
        with rt.session(server) as conn:  # the slot is free again
            assert conn.created.type == "session.created"
    finally:
        server.stop()
    server = kit.start_server(engine, quantized_dir, realtime_max_sessions=1, realtime_busy="wait")
    try:
        url = server.url.replace("http", "ws", 1) + f"/v1/realtime?model={server.model_name}"
        with rt.session(server) as first, ws_client.connect(url) as waiting:  # accepted, waiting for the slot
            assert kit.metrics(server)["orin_realtime_sessions"] == 1
            first.close()
            assert json.loads(waiting.recv(timeout=30))["type"] == "session.created"
    finally:
        server.stop()


def test_busy_policy_error_refuses_a_response_while_another_session_generates(engine, quantized_dir):
    probe = rt.HoldProbe()
    server = kit.start_server(engine, quantized_dir, hook=probe, realtime_busy="error")
    try:
        with rt.session(server) as first, rt.session(server) as second:
            for conn in (first, second):
                rt.configure(conn, output_modalities=["text"], max_output_tokens=2,
                             audio={"input": {"turn_detection": None}})
                rt.text_item(conn, "Hi")
            probe.armed.set()
            first.response.create()
            assert probe.reached.wait(60)
            rt.send_raw(second, {"type": "response.create", "event_id": "evt_busy"})
            error = rt.until(second, "error")
            assert (error.error.code, error.error.type, error.error.event_id) == ("server_busy", "server_error",
                                                                                 "evt_busy")
            first.response.cancel()
            assert rt.until(first, "response.done").response.status == "cancelled"
            assert rt.respond(second).response.status in ("completed", "incomplete")
    finally:
        server.stop()


def test_oversized_messages_and_the_session_length_end_the_session(engine, quantized_dir):
    server = kit.start_server(engine, quantized_dir, realtime_max_message_bytes=64 * 1024,
                              realtime_max_session_s=2.0)
    try:
        with rt.session(server) as conn:
            rt.send_raw(conn, {"type": "input_audio_buffer.append", "audio": base64.b64encode(bytes(60_000)).decode()})
            error = rt.until(conn, "error")
            assert error.error.code == "message_too_large"
            with pytest.raises(ConnectionClosed) as info:
                conn.recv()
            assert info.value.rcvd.code == 1009
        with rt.session(server) as conn:
            error = rt.until(conn, "error")  # the session ran out of time
            assert error.error.code == "session_expired"
            with pytest.raises(ConnectionClosed) as info:
                conn.recv()
            assert info.value.rcvd.code == 1008
    finally:
        server.stop()


def test_the_input_buffer_cap_and_item_deletion_through_a_session(engine, quantized_dir):
    server = kit.start_server(engine, quantized_dir, realtime_max_buffer_s=1.0)
    try:
        with rt.session(server) as conn:
            rt.configure(conn, audio={"input": {"turn_detection": None}})
            rt.stream(conn, silence(0.9))
            rt.send_raw(conn, {"type": "input_audio_buffer.append", "event_id": "evt_full",
                               "audio": base64.b64encode(pcm16(silence(0.2))).decode()})
            error = rt.until(conn, "error")
            assert (error.error.code, error.error.event_id) == ("input_audio_buffer_full", "evt_full")
            conn.input_audio_buffer.commit()  # what was held is intact
            committed = rt.until(conn, "input_audio_buffer.committed")
            conn.conversation.item.delete(item_id=committed.item_id)
            assert rt.until(conn, "conversation.item.deleted").item_id == committed.item_id
            conn.input_audio_buffer.clear()
            rt.until(conn, "input_audio_buffer.cleared")
    finally:
        server.stop()


def test_a_vanished_client_frees_its_slot_and_the_gpu(engine, quantized_dir):
    probe = rt.HoldProbe()
    server = kit.start_server(engine, quantized_dir, hook=probe, realtime_max_sessions=1, realtime_busy="error")
    try:
        url = server.url.replace("http", "ws", 1) + f"/v1/realtime?model={server.model_name}"
        with ws_client.connect(url) as ws:
            assert json.loads(ws.recv(timeout=30))["type"] == "session.created"
            ws.send(json.dumps({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                "content": [{"type": "input_text", "text": "A long story, please."}]}}))
            probe.armed.set()
            ws.send(json.dumps({"type": "response.create", "response": {"max_output_tokens": 200}}))
            assert probe.reached.wait(60)
            ws.socket.shutdown(socket.SHUT_RDWR)  # gone without a close frame
        assert probe.saw_cancel.wait(30), "the server did not notice the client had gone"
        assert probe.done.wait(30) and probe.report.cancelled is True and probe.after_cancel <= 1
        kit.wait_for(lambda: not server.gate.busy and kit.metrics(server)["orin_realtime_sessions"] == 0,
                     what="the session to end")
        with rt.session(server) as conn:  # the only slot, and the GPU at once
            rt.configure(conn, output_modalities=["text"], max_output_tokens=2,
                         audio={"input": {"turn_detection": None}})
            rt.text_item(conn, "Hi")
            assert rt.respond(conn).response.status in ("completed", "incomplete")
    finally:
        server.stop()


def test_shutdown_cancels_a_running_response_and_closes_the_session(engine, quantized_dir):
    probe = rt.HoldProbe()
    server = kit.start_server(engine, quantized_dir, hook=probe)
    with rt.session(server) as conn:
        rt.configure(conn, output_modalities=["text"], max_output_tokens=200, audio={"input": {"turn_detection": None}})
        rt.text_item(conn, "Go on.")
        probe.armed.set()
        conn.response.create()
        assert probe.reached.wait(60)
        stopper = threading.Thread(target=server.stop, kwargs={"drain_s": 0.2})
        stopper.start()
        with pytest.raises(ConnectionClosed) as info:
            rt.until(conn, "response.done")  # never comes: the server closes first
        assert info.value.rcvd.code == 1012  # service restart
        stopper.join(60)
    assert not stopper.is_alive() and probe.done.is_set() and probe.report.cancelled is True


def test_idle_timeout_answers_after_silence(srv):
    with rt.session(srv) as conn:
        rt.text_item(conn, "Are you there?")
        rt.configure(conn, output_modalities=["text"], max_output_tokens=2,
                     audio={"input": {"turn_detection": {"type": "server_vad", "idle_timeout_ms": 1000}}})
        rt.stream(conn, silence(0.3))
        seen: list = []
        done = rt.until(conn, "response.done", seen)
    kinds = rt.types(seen)
    assert kinds.index("input_audio_buffer.timeout_triggered") < kinds.index("response.created")
    assert done.response.status in ("completed", "incomplete")


# --------------------------------------------------------------------------- the pieces, without a server


def test_the_input_buffer_keeps_the_session_timeline():
    buf = InputAudioBuffer(max_seconds=2.0)
    buf.append(np.zeros(24_000, np.float32))  # 1 s
    buf.trim_before(400)
    assert (buf.start_ms, buf.end_ms, buf.duration_ms) == (400, 1000, 600)
    samples, start, end = buf.take(until_ms=700)
    assert (samples.size, start, end, buf.start_ms) == (7200, 400, 700, 700)
    buf.clear()
    assert (buf.start_ms, buf.end_ms, len(buf)) == (1000, 1000, 0)
    buf.set_rate(8000)
    buf.append(np.zeros(8000, np.float32))  # G.711: 1 s at 8 kHz, on the same timeline
    assert (buf.start_ms, buf.end_ms, buf.duration_ms) == (1000, 2000, 1000)
    assert buf.take(until_ms=1500)[0].size == 4000
    with pytest.raises(EventError) as info:
        buf.append(np.zeros(20_000, np.float32))
    assert info.value.code == "input_audio_buffer_full"


def test_the_upsampler_does_not_depend_on_how_audio_is_cut():
    x = np.sin(np.arange(1000) / 7).astype(np.float32)
    whole = Upsampler(3)(x)
    up, parts, at = Upsampler(3), [], 0
    for n in (1, 0, 17, 300, 2, 680):
        parts.append(up(x[at:at + n]))
        at += n
    assert whole.size == 3000 and np.array_equal(np.concatenate(parts), whole)
    assert np.array_equal(whole[2::3], x)


def test_a_cancelled_answer_before_any_word_adds_nothing_to_the_context():
    item = assistant_item(True)
    assert item.message() is None and item.to_json()["status"] == "in_progress"
