"""`POST /v1/audio/transcriptions` and `POST /v1/audio/speech` end to end: the real server on port 0 around the tiny
quantized model (CPU), the official `openai` client, real speech from espeak-ng as the input. The tiny model's
words are random, so the tests check shapes, formats and what must agree between responses (greedy decoding is
deterministic), never content."""

from __future__ import annotations

import base64
import io
import json
import socket
import struct
import threading
import uuid

import numpy as np
import openai
import pytest
import server_kit as kit
import soundfile as sf
from speech_kit import silence, speak, wav_bytes

from orin.contract import Done
from orin.serve.audio_api import LANGUAGES, encodable_formats, instruction, parse_transcription, transcription_request
from orin.serve.metrics import parse_metrics
from orin.serve.protocol import Limits

SENTENCE = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def speech_wav() -> bytes:
    return wav_bytes(speak(SENTENCE, 16_000), 16_000)


def _encoded(fmt: str) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, speak(SENTENCE, 24_000), 24_000, format=fmt)
    return buf.getvalue()


def _multipart(fields: dict, files: dict | None = None) -> tuple[bytes, dict]:
    """A multipart/form-data body, for the requests the official client will not send."""
    boundary = uuid.uuid4().hex
    out = b""
    for name, value in fields.items():
        out += f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
    for name, (filename, data) in (files or {}).items():
        out += (f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
                "Content-Type: application/octet-stream\r\n\r\n").encode() + data + b"\r\n"
    out += f"--{boundary}--\r\n".encode()
    return out, {"Content-Type": f"multipart/form-data; boundary={boundary}"}


# --------------------------------------------------------------------------- transcription


def test_transcription_formats_agree_with_the_openai_client(server, engine, speech_wav):
    client = kit.client(server)
    common = dict(model=engine.model_name, language="en", prompt="Words: fox, dog.")
    whole = client.audio.transcriptions.create(file=("speech.wav", speech_wav), response_format="json", **common)
    assert isinstance(whole.text, str) and whole.text
    assert whole.usage.type == "tokens" and whole.usage.output_tokens >= 1 and whole.usage.input_tokens > 0
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens

    text = client.audio.transcriptions.create(file=("speech.wav", speech_wav), response_format="text", **common)
    assert text == whole.text

    verbose = client.audio.transcriptions.create(file=("speech.wav", speech_wav), response_format="verbose_json",
                                                 **common)
    seconds = sf.info(io.BytesIO(speech_wav)).duration
    assert verbose.text == whole.text and verbose.language == "english"
    assert verbose.duration == pytest.approx(seconds, abs=1e-3)
    [segment] = verbose.segments  # one segment spanning the audio: the model gives no timings
    assert (segment.id, segment.start, segment.end, segment.text) == (0, 0.0, verbose.duration, whole.text)
    assert len(segment.tokens) == whole.usage.output_tokens and segment.avg_logprob is None
    assert verbose.usage.type == "duration" and verbose.usage.seconds == verbose.duration
    assert verbose.model_extra["task"] == "transcribe"

    # The same audio as a stream: deltas that add up to the whole transcript, then the done event.
    events = list(client.audio.transcriptions.create(file=("speech.wav", speech_wav), stream=True, **common))
    *deltas, done = events
    assert deltas and all(e.type == "transcript.text.delta" for e in deltas)
    assert done.type == "transcript.text.done" and done.text == "".join(e.delta for e in deltas) == whole.text
    assert done.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize("fmt", ["FLAC", "MP3", "OGG"])
def test_transcription_reads_the_format_from_the_bytes_not_the_name(server, engine, fmt):
    # Named .wav whatever it holds: the decoder sniffs the container.
    resp = kit.client(server).audio.transcriptions.create(model=engine.model_name, file=("upload.wav", _encoded(fmt)),
                                                          response_format="verbose_json")
    assert resp.duration == pytest.approx(sf.info(io.BytesIO(_encoded("WAV"))).duration, abs=0.1)
    assert resp.language == "unknown"  # no language given, and none is guessed


def test_transcription_instruction_and_engine_request(speech_wav):
    limits = Limits(max_new_tokens=40)
    form = {"file": speech_wav, "language": "en-US", "prompt": " Orin, Jetson ", "temperature": "0"}
    req = parse_transcription(form, limits)
    assert req.language == "en" and req.response_format == "json" and not req.stream and req.seed == 0
    greq = transcription_request(req, limits)
    [message] = greq.messages
    audio, text = message["content"]
    assert message["role"] == "user" and audio["type"] == "audio" and audio["audio"].dtype == np.float32
    assert text["text"] == ("Transcribe the English audio into text. Context that may help with names and spelling "
                            "(do not transcribe it): Orin, Jetson")
    assert not greq.speech and greq.temperature == 0.0 and greq.max_new_tokens == 40  # the server's cap
    assert instruction(None, None) == "Transcribe the audio into text."
    assert instruction("zh", "") == "Transcribe the Chinese audio into text."
    assert set(LANGUAGES) >= {"en", "zh", "yue", "ja", "ko", "de", "fr", "es"}


# --------------------------------------------------------------------------- speech


def _speech(client, engine, **kw):
    return client.audio.speech.with_raw_response.create(model=engine.model_name, voice="ethan", input="Hello there.",
                                                        **kw)


def test_speech_in_every_format(server, engine, speech_wav):
    client = kit.client(server)
    pcm = _speech(client, engine, response_format="pcm")
    assert pcm.headers["content-type"] == "audio/pcm"
    samples = np.frombuffer(pcm.content, "<i2")
    # Capped by the server's --max-speech-seconds (0.8 s: 10 codec frames of 1920 samples).
    assert 0 < samples.size <= 10 * 1920 and len(pcm.content) % 2 == 0

    wav = _speech(client, engine, response_format="wav")
    assert wav.headers["content-type"] == "audio/wav"
    # Streamed: the header goes first with the sizes unknown (0xFFFFFFFF, as OpenAI writes them), then the PCM.
    assert wav.content[:4] == b"RIFF" and struct.unpack("<I", wav.content[4:8])[0] == 0xFFFFFFFF
    assert struct.unpack("<I", wav.content[40:44])[0] == 0xFFFFFFFF
    info = sf.info(io.BytesIO(wav.content))
    assert (info.samplerate, info.channels, info.subtype) == (24_000, 1, "PCM_16")
    assert wav.content[44:] == pcm.content  # greedy: the same speech

    for fmt in ("flac", "mp3"):
        if fmt not in encodable_formats():
            with pytest.raises(openai.BadRequestError, match="this machine can encode") as info:
                _speech(client, engine, response_format=fmt)
            assert info.value.body["param"] == "response_format"
            continue
        resp = _speech(client, engine, response_format=fmt)
        assert resp.headers["content-type"] == {"flac": "audio/flac", "mp3": "audio/mpeg"}[fmt]
        decoded, sr = sf.read(io.BytesIO(resp.content), dtype="int16")
        assert sr == 24_000 and decoded.ndim == 1 and decoded.size > 0
        if fmt == "flac":  # lossless
            assert np.array_equal(decoded, samples)

    # OpenAI's default format is mp3; where this machine cannot encode it, WAV.
    default = _speech(client, engine)
    assert default.headers["content-type"] == ("audio/mpeg" if "mp3" in encodable_formats() else "audio/wav")

    # The streamed WAV, whose header does not know its length, goes back into the transcription endpoint.
    back = client.audio.transcriptions.create(model=engine.model_name, file=("speech.wav", wav.content),
                                              response_format="verbose_json")
    assert back.duration == pytest.approx(samples.size / 24_000, abs=1e-3)


def test_speech_streams_as_it_is_made(server, engine):
    client = kit.client(server)
    whole = _speech(client, engine, response_format="pcm").content
    with client.audio.speech.with_streaming_response.create(
            model=engine.model_name, voice="ethan", input="Hello there.", response_format="pcm") as resp:
        assert resp.headers["content-type"] == "audio/pcm" and "content-length" not in resp.headers
        assert b"".join(resp.iter_bytes()) == whole

    with client.audio.speech.with_streaming_response.create(
            model=engine.model_name, voice="Ethan", input="Hello there.", stream_format="sse") as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[len("data: "):]) for line in resp.iter_lines() if line.startswith("data: ")]
    *deltas, done = events
    assert deltas and all(e["type"] == "speech.audio.delta" for e in deltas)
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == whole
    assert done["type"] == "speech.audio.done"
    usage = done["usage"]
    assert usage["output_tokens"] == done["orin"]["talker_frames"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


# --------------------------------------------------------------------------- refusals


def _refused(call, status: int, param: str | None, fragment: str):
    with pytest.raises(openai.APIStatusError) as info:
        call()
    err = info.value
    assert err.status_code == status, (err.status_code, err.message)
    assert fragment in err.message, err.message
    if param is not None:
        assert err.body["param"] == param and param.split(".")[0] in err.message, err.body


def test_every_refusal_is_a_4xx_naming_the_field(server, engine, speech_wav):
    client = kit.client(server)
    model = engine.model_name

    def transcribe(**kw):
        return lambda: client.audio.transcriptions.create(**{"model": model, "file": ("a.wav", speech_wav), **kw})

    too_long = wav_bytes(silence(301.0, 8_000), 8_000)
    _refused(transcribe(file=("a.wav", b"")), 400, "file", "empty")
    _refused(transcribe(file=("a.wav", b"plain text, not audio at all")), 400, "file", "not a supported audio file")
    _refused(transcribe(file=("a.wav", too_long)), 400, "file", "over the 300 s limit")
    _refused(transcribe(response_format="srt"), 400, "response_format", "timestamps")
    _refused(transcribe(response_format="diarized_json"), 400, "response_format", "use json, text or verbose_json")
    _refused(transcribe(language="xx"), 400, "language", "ISO-639-1")
    _refused(transcribe(temperature=1.5), 400, "temperature", "between 0 and 1")
    _refused(transcribe(timestamp_granularities=["word"]), 400, "timestamp_granularities", "no timings")
    _refused(transcribe(model="whisper-1"), 404, "model", "does not exist")

    body, headers = _multipart({"model": model})
    status, _, payload = kit.http_request(server, "POST", "/v1/audio/transcriptions", body, headers)
    assert status == 400 and payload["error"]["param"] == "file" and "missing" in payload["error"]["message"]
    body, headers = _multipart({"model": model, "file": "not a file part"})
    status, _, payload = kit.http_request(server, "POST", "/v1/audio/transcriptions", body, headers)
    assert status == 400 and "file upload" in payload["error"]["message"]
    status, _, payload = kit.http_request(server, "POST", "/v1/audio/transcriptions", {"file": "x"})
    assert status == 400 and "multipart/form-data" in payload["error"]["message"]
    body, headers = _multipart({}, {"file": ("a.wav", speech_wav), "other": ("b.wav", speech_wav)})
    status, _, payload = kit.http_request(server, "POST", "/v1/audio/transcriptions", body, headers)
    assert status == 400 and "Too many files" in payload["error"]["message"]
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:  # refused before it is read
        sock.sendall(b"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; "
                     b"boundary=b\r\nContent-Length: %d\r\n\r\n" % (65 << 20))
        reply = b""
        while b"\r\n\r\n" not in reply:
            reply += sock.recv(65536)
        head, _, body = reply.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        while len(body) < length:
            body += sock.recv(65536)
    assert head.startswith(b"HTTP/1.1 413") and "--max-body" in json.loads(body)["error"]["message"]

    def say(**kw):
        return lambda: client.audio.speech.create(**{"model": model, "voice": "ethan", "input": "Hi.", **kw})

    _refused(say(voice="alloy"), 400, "voice", "aiden, chelsie, ethan")
    _refused(say(input=""), 400, "input", "non-empty")
    _refused(say(input="x" * 4097), 400, "input", "4096-character limit")
    _refused(say(speed=1.5), 400, "speed", "only 1.0")
    _refused(say(response_format="opus"), 400, "response_format", "this machine can encode: wav, pcm")
    _refused(say(stream_format="sse", response_format="wav"), 400, "response_format", "use response_format 'pcm'")
    _refused(say(model="tts-1"), 404, "model", "does not exist")
    status, _, payload = kit.http_request(server, "POST", "/v1/audio/speech", {"voice": "ethan"})
    assert status == 400 and payload["error"]["param"] == "input"

    # Still healthy, and still answering.
    assert kit.http_request(server, "GET", "/health")[0] == 200
    assert client.audio.transcriptions.create(model=model, file=("a.wav", speech_wav)).usage.output_tokens >= 1
    assert kit.http_request(server, "GET", "/v2/nothing")[2]["error"]["message"].count("/v1/audio/") == 2


def test_api_keys_guard_both_endpoints(engine, quantized_dir, tmp_path, speech_wav):
    key_file = tmp_path / "keys"
    key_file.write_text("secret-key\n")
    key_file.chmod(0o600)
    srv = kit.start_server(engine, quantized_dir, api_key_file=str(key_file))
    try:
        def calls(client):
            yield lambda: client.audio.transcriptions.create(model=engine.model_name, file=("a.wav", speech_wav))
            yield lambda: client.audio.speech.create(model=engine.model_name, voice="ethan", input="Hi.",
                                                     response_format="pcm")

        for call in calls(kit.client(srv, "wrong")):
            with pytest.raises(openai.AuthenticationError):
                call()
        for call in calls(kit.client(srv, "secret-key")):
            call()
        m = parse_metrics(srv.render_metrics())  # /metrics needs the key too
        for endpoint in ("/v1/audio/transcriptions", "/v1/audio/speech"):
            assert m[f'orin_requests_total{{endpoint="{endpoint}",status="401"}}'] == 1
            assert m[f'orin_requests_total{{endpoint="{endpoint}",status="200"}}'] == 1
    finally:
        srv.stop()


# --------------------------------------------------------------------------- queueing, hang-ups, shutdown


def test_queue_full_is_429_and_shutdown_503_on_the_audio_endpoints(engine, quantized_dir, speech_wav):
    hook = kit.Holder()
    srv = kit.start_server(engine, quantized_dir, hook=hook, max_queue=1)
    results: dict = {}

    def run(name, call):
        try:
            results[name] = call()
        except openai.APIStatusError as exc:
            results[name] = exc

    client = kit.client(srv)
    speak_call = lambda: client.audio.speech.create(model=engine.model_name, voice="ethan", input="Hi.",  # noqa: E731
                                                    response_format="pcm")
    transcribe = lambda: client.audio.transcriptions.create(model=engine.model_name,  # noqa: E731
                                                            file=("a.wav", speech_wav))
    try:
        running = threading.Thread(target=run, args=("running", speak_call))
        running.start()
        assert hook.admitted.wait(30)
        queued = threading.Thread(target=run, args=("queued", transcribe))
        queued.start()
        kit.wait_for(lambda: srv.gate.queued == 1, what="the transcription to queue")
        with pytest.raises(openai.RateLimitError, match="--max-queue"):
            speak_call()
        stopper = threading.Thread(target=srv.stop, kwargs={"drain_s": 30})
        stopper.start()
        queued.join(30)
        assert isinstance(results["queued"], openai.APIStatusError) and results["queued"].status_code == 503
        hook.release.set()  # the running request finishes inside the drain time
        running.join(60)
        stopper.join(60)
        assert isinstance(results["running"].content, bytes) and len(results["running"].content) > 0
    finally:
        hook.release.set()
        srv.stop()


class _HangUpProbe:
    """Holds the request at its second engine event (the response's headers have gone out with the first) until
    the server sees the client has gone, then keeps the report."""

    def __init__(self):
        self.events = 0
        self.reached = threading.Event()
        self.saw_cancel = threading.Event()
        self.report = None

    def __call__(self, stage, event, cancel):
        if stage != "event":
            return
        if isinstance(event, Done):
            self.report = event.report
            return
        self.events += 1
        if self.events == 2:
            self.reached.set()
            if cancel.wait(30):
                self.saw_cancel.set()


def test_a_client_that_hangs_up_cancels_its_speech(engine, quantized_dir):
    probe = _HangUpProbe()
    srv = kit.start_server(engine, quantized_dir, hook=probe)
    try:
        data = json.dumps({"input": "A long story. " * 40, "voice": "ethan", "response_format": "pcm"}).encode()
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        sock.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
        assert probe.reached.wait(60)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")  # the audio stream had started
        sock.close()
        assert probe.saw_cancel.wait(10), "the server did not notice the hang-up"
        kit.wait_for(lambda: probe.report is not None and not srv.gate.busy, what="the engine to stop")
        assert probe.report.cancelled and probe.report.completion_tokens < len("A long story. " * 40)
        closed = 'orin_requests_total{endpoint="/v1/audio/speech",status="499"}'
        # counted when the request's handler returns, which follows the engine's stop
        kit.wait_for(lambda: closed in kit.metrics(srv), what="the 499 to be counted")
        assert kit.metrics(srv)[closed] == 1
        assert kit.http_request(srv, "GET", "/health")[0] == 200
    finally:
        srv.stop()
