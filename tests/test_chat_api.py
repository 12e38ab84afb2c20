"""The chat-completions protocol layer: validation of every field and part, media decoding limits, and the
response / chunk shapes the openai client parses."""

from __future__ import annotations

import base64
import io
import json
import wave
from dataclasses import replace

import numpy as np
import pytest
from PIL import Image

from orin.contract import Report
from orin.errors import BudgetError, InputError, ModelError
from orin.inputs.media import encode_pcm16, encode_wav, synth_image, synth_tone
from orin.serve.chat_request import generation_request, parse_chat
from orin.serve.protocol import (
    ApiError,
    Limits,
    audio_delta,
    check_model,
    chunk,
    completion_body,
    parse_json,
    sse,
    text_delta,
    to_api_error,
)

LIMITS = Limits(max_audio_seconds=5.0, max_image_pixels=10_000)
VOICES = ("aiden", "chelsie", "ethan")  # the tiny model's talker speakers


def _png(size=(32, 24)) -> str:
    buf = io.BytesIO()
    synth_image(size).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _wav_b64(seconds=0.5, sr=16000) -> str:
    return base64.b64encode(encode_wav(synth_tone(seconds, sr=sr), sr=sr)).decode()


def _user(*parts) -> dict:
    return {"messages": [{"role": "user", "content": list(parts)}]}


def _parse(data: dict, limits: Limits = LIMITS):
    return parse_chat(data, limits, VOICES, random_seed=lambda: 7)


def _bad(data: dict, fragment: str, status: int = 400, limits: Limits = LIMITS):
    with pytest.raises((ApiError, InputError)) as info:
        _parse(data, limits)
    exc = info.value
    if isinstance(exc, ApiError):
        assert exc.status == status
    assert fragment in str(exc), str(exc)
    return exc


def test_plain_text_request_defaults():
    req = _parse({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert req.messages == ({"role": "user", "content": "hi"},)
    assert (req.max_new_tokens, req.temperature, req.top_p, req.seed) == (256, 0.0, 1.0, 7)
    assert not req.audio_out and not req.stream and req.model == "m"


def test_parts_are_decoded_to_engine_format():
    req = _parse({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": _png(), "detail": "auto"}},
            {"type": "input_audio", "input_audio": {"data": _wav_b64(0.5, 8000), "format": "wav"}},
        ]},
        {"role": "assistant", "content": [{"type": "text", "text": "earlier answer"}]},
    ]})
    system, user, assistant = req.messages
    assert system == {"role": "system", "content": "be brief"}
    text, image, audio = user["content"]
    assert text == {"type": "text", "text": "what is this?"}
    assert image["type"] == "image" and isinstance(image["image"], Image.Image) and image["image"].size == (32, 24)
    assert audio["type"] == "audio" and audio["audio"].dtype == np.float32
    assert audio["audio"].shape == (8000,)  # 0.5 s resampled to 16 kHz
    assert assistant["content"] == [{"type": "text", "text": "earlier answer"}]


def test_sampling_and_audio_out_options():
    req = _parse({**_user({"type": "text", "text": "x"}), "max_completion_tokens": 9, "temperature": 0.7,
                  "top_p": 0.9, "seed": 42, "modalities": ["text", "audio"],
                  "audio": {"voice": "Chelsie", "format": "pcm16"}, "stream": True,
                  "stream_options": {"include_usage": True}})
    assert (req.max_new_tokens, req.temperature, req.top_p, req.seed) == (9, 0.7, 0.9, 42)
    assert req.audio_out and req.voice == "chelsie" and req.audio_format == "pcm16"
    assert req.stream and req.include_usage
    # Defaults: WAV for a whole response, PCM16 (as OpenAI) for a stream; voice left to the engine.
    assert _parse({**_user({"type": "text", "text": "x"}), "modalities": ["audio", "text"]}).audio_format == "wav"
    streamed = _parse({**_user({"type": "text", "text": "x"}), "modalities": ["text", "audio"], "stream": True})
    assert streamed.audio_format == "pcm16" and streamed.voice is None


@pytest.mark.parametrize("body, fragment", [
    ({}, "missing required parameter 'messages'"),
    ({"messages": []}, "non-empty list"),
    ({"messages": "hi"}, "non-empty list"),
    ({"messages": ["hi"]}, "must be an object"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "role 'tool' is not supported"),
    ({"messages": [{"role": "user"}]}, "content is missing"),
    ({"messages": [{"role": "assistant", "content": None, "audio": {"id": "a1"}}]}, "not stored"),
    ({"messages": [{"role": "user", "content": []}]}, "non-empty list of content parts"),
    ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {}}]}]},
     "video_url.url must be a non-empty string"),
    ({"messages": [{"role": "user", "content": [{"type": "file", "file": {}}]}]},
     "content type 'file' is not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "text must be a string"),
    ({"messages": [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
     "only accepted in user messages"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "'n' must be 1"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": ["\n"]}, "'stop'"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 3}, "'temperature' is 3"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "must be a number"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "'top_p' is 0"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "'max_tokens' is 0"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": True}, "must be an integer"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**9}, "between 1 and 8192"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "'stream' must be true or false"),
    ({"messages": [{"role": "user", "content": "x"}], "modalities": ["text", "video"]}, "unknown modalities"),
    ({"messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"],
      "audio": {"voice": "ethan", "format": "mp3"}}, "audio.format 'mp3' is not supported"),
    ({"messages": [{"role": "user", "content": "x"}], "model": 3}, "'model' must be a string"),
])
def test_protocol_errors_are_400_with_a_message(body, fragment):
    exc = _bad(body, fragment)
    assert isinstance(exc, ApiError) and exc.body()["error"]["message"]


def _image_part(url: str) -> dict:
    return _user({"type": "image_url", "image_url": {"url": url}})


def _audio_part(data, fmt="wav") -> dict:
    return _user({"type": "input_audio", "input_audio": {"data": data, "format": fmt}})


def test_media_errors():
    _bad(_image_part("https://example.com/cat.png"), "never fetches from the network")
    _bad(_image_part("ftp://example.com/cat.png"), "must be a data: URL")
    _bad(_image_part("data:image/png;base64,@@@"), "not valid base64")
    _bad(_image_part("data:image/png;base64,"), "holds no image bytes")
    text = _bad(_image_part("data:image/png;base64," + base64.b64encode(b"not an image at all").decode()),
                "not an image: PNG, JPEG or WebP expected (the bytes look like text)")
    assert text.param == "messages[0].content[0].image_url" and str(text).startswith(text.param)
    assert _bad(_image_part(_png((200, 100))), "over the 0.01-megapixel limit").param == \
        "messages[0].content[0].image_url"
    _bad(_audio_part("!!notbase64!!"), "input_audio.data is not valid base64")
    _bad(_audio_part(""), "input_audio.data is empty")
    noise = _bad(_audio_part(base64.b64encode(b"hello, this is text and not audio").decode()),
                 "not a supported audio file")
    assert noise.param == "messages[0].content[0].input_audio.data" and str(noise).startswith(noise.param)
    _bad(_audio_part(base64.b64encode(encode_wav(np.zeros(0, np.float32), sr=16000)).decode()), "zero length")
    _bad(_audio_part(_wav_b64(6.0)), "over the 5 s limit")
    _bad(_audio_part(_wav_b64(), fmt="aac"), "input_audio.format 'aac' is not supported")


def test_base64_may_be_line_wrapped():
    wrapped = "\n".join(_wav_b64()[i:i + 76] for i in range(0, len(_wav_b64()), 76))
    assert _parse(_audio_part(wrapped)).messages[0]["content"][0]["type"] == "audio"


def test_file_urls_only_under_allow_dir(tmp_path):
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    synth_image(16).save(allowed / "a.png")
    synth_image(16).save(tmp_path / "outside.png")
    (allowed / "escape.png").symlink_to(tmp_path / "outside.png")
    url = (allowed / "a.png").as_uri()
    _bad(_image_part(url), "file:// URLs are refused")
    limits = Limits(allow_dir=str(allowed), max_image_pixels=10_000)
    assert _parse(_image_part(url), limits).messages[0]["content"][0]["image"].size == (16, 16)
    _bad(_image_part((tmp_path / "outside.png").as_uri()), "outside the allowed directory", limits=limits)
    _bad(_image_part((allowed / "escape.png").as_uri()), "outside the allowed directory", limits=limits)
    _bad(_image_part((allowed / "missing.png").as_uri()), "is not a file", limits=limits)
    _bad(_image_part("file://otherhost/etc/passwd"), "is not local", limits=limits)


def test_parse_json():
    assert parse_json(b'{"a": 1}') == {"a": 1}
    for raw, fragment in ((b"{nope", "not valid JSON"), (b"[1]", "must be a JSON object"), (b"\xff", "not valid JSON")):
        with pytest.raises(ApiError, match=fragment) as info:
            parse_json(raw)
        assert info.value.status == 400


def test_unknown_model_is_404_model_not_found():
    check_model(None, "tiny")
    check_model("tiny", "tiny")
    with pytest.raises(ApiError) as info:
        check_model("gpt-4o", "tiny")
    assert info.value.status == 404 and info.value.code == "model_not_found"


def _report(**overrides) -> Report:
    from orin.power.energy import Energy, EnergyReport

    fields = dict(text="hello", prompt_tokens=11, completion_tokens=4, token_ids=(1, 2, 3, 4), ttft_s=0.1,
                  first_audio_s=None, tokens_per_s=None, total_s=0.5, talker_frames=0, talker_s=0.0,
                  audio_seconds=0.0, peak_bytes=1, budget_bytes=None, device="cpu", schedule=(),
                  streaming_speech=False, swaps=(), resident_after=(), cancelled=False, finish_reason="length",
                  energy=EnergyReport("request", "none", ("none",), Energy(None, None, None, 0.5)))
    return Report(**{**fields, **overrides})


REPORT = _report()  # 4 tokens of max_tokens 4: the engine says "length"


def test_completion_body_text_and_audio():
    req = _parse({**_user({"type": "text", "text": "x"}), "max_tokens": 4})
    ids = ("chatcmpl-1", "audio_1", 1700000000)
    body = completion_body(req, "tiny", ids, "hello", None, REPORT)
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "hello", "refusal": None}
    assert choice["finish_reason"] == "length"  # 4 of max 4 tokens
    assert body["usage"] == {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert body["orin"]["ttft_s"] == 0.1
    json.dumps(body)

    req = _parse({**_user({"type": "text", "text": "x"}), "max_tokens": 8, "modalities": ["text", "audio"]})
    samples = np.linspace(-1, 1, 2400, dtype=np.float32)
    body = completion_body(req, "tiny", ids, "hello", samples, replace(REPORT, finish_reason="stop"))
    msg = body["choices"][0]["message"]
    assert msg["content"] is None and body["choices"][0]["finish_reason"] == "stop"
    assert msg["audio"]["id"] == "audio_1" and msg["audio"]["transcript"] == "hello"
    assert msg["audio"]["expires_at"] == 1700000000
    with wave.open(io.BytesIO(base64.b64decode(msg["audio"]["data"]))) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()) == (24000, 1, 2, 2400)


def test_stream_chunks_and_sse_framing():
    ids = ("chatcmpl-1", "audio_1", 1700000000)
    text_req = _parse(_user({"type": "text", "text": "x"}))
    audio_req = _parse({**_user({"type": "text", "text": "x"}), "modalities": ["text", "audio"], "stream": True})
    assert text_delta(text_req, ids, "hi") == {"content": "hi"}
    assert text_delta(audio_req, ids, "hi") == {"audio": {"id": "audio_1", "transcript": "hi"}}
    pcm = base64.b64decode(audio_delta(audio_req, ids, np.array([0.0, 1.0, -1.0, 2.0]))["audio"]["data"])
    assert np.frombuffer(pcm, "<i2").tolist() == [0, 32767, -32767, 32767]
    c = chunk(ids, "tiny", {"content": "hi"})
    assert c["object"] == "chat.completion.chunk"
    assert c["choices"] == [{"index": 0, "delta": {"content": "hi"}, "logprobs": None, "finish_reason": None}]
    assert chunk(ids, "tiny", None, extra={"usage": {"total_tokens": 1}})["choices"] == []
    framed = sse({"a": "line\nbreak"})
    assert framed.startswith(b"data: ") and framed.endswith(b"\n\n") and framed.count(b"\n") == 2
    assert sse("[DONE]") == b"data: [DONE]\n\n"
    assert sse({"x": np.float32(1.5), "y": np.arange(2)}) == b'data: {"x":1.5,"y":[0,1]}\n\n'


def test_encode_pcm16_clips():
    assert np.frombuffer(encode_pcm16(np.array([2.0, -2.0, 0.5])), "<i2").tolist() == [32767, -32767, 16384]


def test_generation_request_from_a_chat_request():
    req = _parse({**_user({"type": "text", "text": "x"}), "max_tokens": 9, "temperature": 0.5, "seed": 4,
                  "modalities": ["text", "audio"], "audio": {"voice": "Chelsie"}})
    greq = generation_request(req, max_speech_seconds=0.8)
    assert (greq.max_new_tokens, greq.temperature, greq.seed, greq.speech) == (9, 0.5, 4, True)
    assert greq.voice == "chelsie" and greq.max_audio_frames == 10  # 0.8 s at 12.5 codec frames a second
    plain = generation_request(_parse(_user({"type": "text", "text": "x"})))
    assert not plain.speech and plain.max_audio_frames is None and plain.voice == "ethan"  # the engine's default


def test_one_voice_parser_for_every_api():
    """The chat's audio.voice, /v1/audio/speech's voice and the Realtime session's voice: a name in any case or an
    object with its id, checked against the talker's speakers, a refusal naming the field."""
    from orin.serve.voice import VoiceError, parse_voice

    assert parse_voice("Chelsie", "voice", VOICES) == parse_voice({"id": " chelsie"}, "audio.voice", VOICES) == "chelsie"
    assert parse_voice(None, "voice", VOICES) is None and parse_voice({}, "voice", VOICES) is None
    for bad in ("alloy", "", 3):
        with pytest.raises(VoiceError) as info:
            parse_voice(bad, "session.audio.output.voice", VOICES)
        assert info.value.param == "session.audio.output.voice" and "aiden, chelsie, ethan" in str(info.value)
    with pytest.raises(VoiceError, match="no talker voices"):
        parse_voice("ethan", "voice", ())
    err = to_api_error(VoiceError("unknown voice 'alloy'", "audio.voice"))
    assert (err.status, err.param, err.code) == (400, "audio.voice", "unsupported_voice")
    _bad({**_user({"type": "text", "text": "x"}), "modalities": ["text", "audio"], "audio": {"voice": "alloy"}},
         "unknown voice 'alloy' in 'audio.voice'")

def test_finish_reason_and_errors_map_to_the_api():
    ids = ("chatcmpl-1", "audio_1", 1700000000)
    req = _parse(_user({"type": "text", "text": "x"}))
    for engine_reason, api_reason in (("stop", "stop"), ("length", "length"), ("cancelled", "stop")):
        body = completion_body(req, "tiny", ids, "x", None, replace(REPORT, finish_reason=engine_reason))
        assert body["choices"][0]["finish_reason"] == api_reason
    assert (to_api_error(BudgetError("too big")).status, to_api_error(BudgetError("x")).code) == (400, "budget_exceeded")
    assert to_api_error(InputError("bad clip")).status == 400
    assert to_api_error(ModelError("weights missing")).type == "server_error"
    err = to_api_error(RuntimeError("boom"))
    assert err.status == 500 and "RuntimeError: boom" in err.message


def test_a_text_file_sent_as_an_image_is_a_400_naming_the_part(engine, quantized_dir):
    """Through the real server and the official client, as a user meets it: the refusal says what the bytes are
    and `param` names the part, as for every other media refusal."""
    import openai
    import server_kit as kit

    srv = kit.start_server(engine, quantized_dir)
    try:
        content = [{"type": "text", "text": "What is this?"},
                   {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                       + base64.b64encode(b"notes from the meeting\n").decode()}}]
        with pytest.raises(openai.BadRequestError) as info:
            kit.client(srv).chat.completions.create(model=engine.model_name, max_tokens=2,
                                                    messages=[{"role": "user", "content": content}])
        assert info.value.param == "messages[0].content[1].image_url"
        assert info.value.body["message"] == ("messages[0].content[1].image_url: not an image: PNG, JPEG or WebP "
                                              "expected (the bytes look like text)")
    finally:
        srv.stop()
