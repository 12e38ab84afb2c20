"""`orin-omni serve` end to end: the real server on loopback (port 0) around the real engine on the tiny quantized
model (CPU). The official `openai` client for the happy paths, streaming and audio out; raw HTTP (http.client,
sockets) for framing, keep-alive, the bad-input battery, limits, auth, queueing and disconnects; a subprocess
for systemd's notify protocol and SIGTERM.

Slow requests are made deterministic with the server's test hook (it holds a request at a known point), never
with a stand-in engine.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import wave

import numpy as np
import openai
import pytest
from PIL import Image

from orin.engine import Done, TextDelta
from orin.media import encode_wav, synth_image, synth_speechlike
from orin.metrics import parse_metrics
from orin.server import ServeConfig, Server
from orin.smoke import expected_samples

# --------------------------------------------------------------------------- fixtures and helpers

# The tiny model's random talker never says "end of speech", and a CPU codec frame costs ~80 ms: cap speech
# at 10 frames with the server's own --max-speech-seconds.
SPEECH_S = 0.8


@pytest.fixture(scope="module")
def server(engine, quantized_dir):
    # The shared server runs the real warm-up, as under systemd.
    srv = Server(ServeConfig(model_dir=quantized_dir, port=0, device="cpu", power_backend="none", warmup=True,
                             max_speech_seconds=SPEECH_S), engine=engine).start()
    yield srv
    srv.stop()


def _server(engine, quantized_dir, hook=None, **overrides) -> Server:
    cfg = ServeConfig(model_dir=quantized_dir, port=0, device="cpu", power_backend="none", warmup=False,
                      max_speech_seconds=SPEECH_S, **overrides)
    return Server(cfg, engine=engine, hook=hook).start()


def _client(srv: Server, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=120)


def _http(srv: Server, method: str, path: str, body=None, headers=None, timeout=120):
    """(status, headers, parsed JSON or text) over a fresh connection."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=timeout)
    try:
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        raw = resp.read()
        kind = resp.getheader("Content-Type", "")
        parsed = json.loads(raw) if kind.startswith("application/json") else raw.decode()
        return resp.status, dict(resp.getheaders()), parsed
    finally:
        conn.close()


def _png_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _wav_b64(samples, sr=16000) -> str:
    return base64.b64encode(encode_wav(samples, sr=sr)).decode()


def _mm_content(seconds: float = 2.0) -> list[dict]:
    return [
        {"type": "image_url", "image_url": {"url": _png_url(synth_image(64, seed=1))}},
        {"type": "input_audio", "input_audio": {"data": _wav_b64(synth_speechlike(seconds, seed=2)), "format": "wav"}},
        {"type": "text", "text": "What do you see and hear?"},
    ]


def _wav_info(data: bytes) -> tuple[int, int, int, np.ndarray]:
    with wave.open(io.BytesIO(data)) as w:
        frames = w.readframes(w.getnframes())
        return w.getframerate(), w.getnchannels(), w.getsampwidth(), np.frombuffer(frames, "<i2")


def _metrics(srv: Server) -> dict[str, float]:
    status, _, text = _http(srv, "GET", "/metrics")
    assert status == 200
    return parse_metrics(text)


def _wait_for(cond, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# --------------------------------------------------------------------------- happy paths, official client


def test_models_health_and_port_zero(server, engine):
    assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}"
    models = _client(server).models.list()
    assert [m.id for m in models.data] == [engine.model_name]
    assert _client(server).models.retrieve(engine.model_name).id == engine.model_name
    status, _, body = _http(server, "GET", "/health")
    assert status == 200 and body["status"] == "ok" and body["model"] == engine.model_name
    assert body["memory"]["resident_bytes"] > 0


def test_text_completion_with_the_openai_client(server, engine):
    resp = _client(server).chat.completions.create(
        model=engine.model_name, messages=[{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": "Hello!"}], max_tokens=6)
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.message.audio is None
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= resp.usage.completion_tokens <= 6 and resp.usage.prompt_tokens > 0
    report = resp.model_extra["orin"]  # the non-standard report the client keeps as an extra
    assert report["ttft_s"] > 0 and report["peak_bytes"] > 0 and report["energy"]["backend"] == "none"
    assert report["completion_tokens"] == resp.usage.completion_tokens


def test_image_audio_in_speech_out_with_the_openai_client(server, engine):
    resp = _client(server).chat.completions.create(
        model=engine.model_name, messages=[{"role": "user", "content": _mm_content()}], max_tokens=8,
        modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"})
    msg = resp.choices[0].message
    assert msg.content is None and msg.audio is not None
    assert msg.audio.id.startswith("audio_") and isinstance(msg.audio.expires_at, int)
    report = resp.model_extra["orin"]
    assert msg.audio.transcript == report["text"]
    sr, channels, width, pcm = _wav_info(base64.b64decode(msg.audio.data))
    assert (sr, channels, width) == (24000, 1, 2)
    lo, hi = expected_samples(report["talker_frames"])
    assert report["talker_frames"] > 0 and lo <= pcm.size <= hi
    assert pcm.size == pytest.approx(report["audio_seconds"] * 24000, abs=1)


def test_streaming_text_and_audio_match_the_whole_response(server, engine):
    client = _client(server)
    common = dict(model=engine.model_name, messages=[{"role": "user", "content": _mm_content()}], max_tokens=8,
                  modalities=["text", "audio"], seed=3)
    whole = client.chat.completions.create(audio={"voice": "ethan", "format": "wav"}, **common)
    stream = client.chat.completions.create(audio={"voice": "ethan", "format": "pcm16"}, stream=True,
                                            stream_options={"include_usage": True}, **common)
    transcript, pcm, finish, usage, audio_ids, report, order = "", b"", None, None, set(), None, []
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        if ch.model_extra.get("orin"):
            report = ch.model_extra["orin"]
        if not ch.choices:
            continue
        delta = ch.choices[0].delta
        finish = ch.choices[0].finish_reason or finish
        assert delta.content in (None, "")  # with audio out, text comes as the transcript
        if delta.audio is not None:
            audio_ids.add(delta.audio.id)
            if delta.audio.transcript:
                transcript += delta.audio.transcript
                order.append("text")
            if delta.audio.data:
                pcm += base64.b64decode(delta.audio.data)
                order.append("audio")
    assert len(audio_ids) == 1
    assert transcript == whole.choices[0].message.audio.transcript
    _, _, _, whole_pcm = _wav_info(base64.b64decode(whole.choices[0].message.audio.data))
    assert np.array_equal(np.frombuffer(pcm, "<i2"), whole_pcm)  # same samples, streamed as raw PCM16
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    assert report is not None and report["first_audio_s"] > 0
    assert "audio" in order and "text" in order


def test_streaming_text_only_with_the_openai_client(server, engine):
    client = _client(server)
    common = dict(model=engine.model_name, messages=[{"role": "user", "content": "Count to three."}], max_tokens=8)
    whole = client.chat.completions.create(**common)
    roles, text = [], ""
    for ch in client.chat.completions.create(stream=True, **common):
        if ch.choices:
            roles.append(ch.choices[0].delta.role)
            text += ch.choices[0].delta.content or ""
            assert ch.choices[0].delta.audio is None
    assert roles[0] == "assistant" and text == whole.choices[0].message.content


def test_sse_framing_and_keep_alive_over_raw_http(server, engine):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    body = json.dumps({"model": engine.model_name, "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 4, "stream": True}).encode()
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.getheader("Content-Type").startswith("text/event-stream")
    assert resp.getheader("Transfer-Encoding") == "chunked"
    raw = resp.read().decode()  # http.client de-chunks; a bad chunk framing raises here
    sock = conn.sock
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ") and "\n" not in event
        chunk = json.loads(event[len("data: "):])
        assert chunk["object"] == "chat.completion.chunk"
    # Keep-alive: the next request goes over the same socket.
    conn.request("GET", "/health")
    resp2 = conn.getresponse()
    assert resp2.status == 200 and json.loads(resp2.read())["status"] == "ok"
    assert conn.sock is sock
    conn.close()


# --------------------------------------------------------------------------- bad input


def _user_parts(*parts, **extra) -> dict:
    return {"messages": [{"role": "user", "content": list(parts)}], "max_tokens": 2, **extra}


def _audio_part(data: str) -> dict:
    return {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}


def _big_png() -> str:
    buf = io.BytesIO()
    Image.new("1", (7072, 7072)).save(buf, format="PNG")  # 50 megapixels, a few kB as a 1-bit PNG
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


BAD_INPUTS = [
    ("malformed JSON", b'{"messages": [', 400, "not valid JSON"),
    ("not an object", b"[1, 2]", 400, "JSON object"),
    ("missing messages", {"max_tokens": 2}, 400, "messages"),
    ("bad base64", _user_parts(_audio_part("this is %%% not base64")), 400, "not valid base64"),
    ("non-audio bytes", _user_parts(_audio_part(base64.b64encode(b"GIF89a not audio, honestly" * 4).decode())),
     400, "not a supported audio file"),
    ("zero-length audio", _user_parts(_audio_part("")), 400, "empty"),
    ("zero-sample WAV", _user_parts(_audio_part(_wav_b64(np.zeros(0, np.float32)))), 400, "zero length"),
    ("over-limit audio", _user_parts(_audio_part(_wav_b64(np.zeros(301 * 8000, np.float32), sr=8000))), 400,
     "over the 300 s limit"),
    ("50-megapixel image", _user_parts({"type": "image_url", "image_url": {"url": _big_png()}}), 400,
     "megapixel limit"),
    ("remote image", _user_parts({"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}), 400,
     "never fetches"),
    ("file image without --allow-dir", _user_parts({"type": "image_url", "image_url": {"url": "file:///etc/hosts"}}),
     400, "file:// URLs are refused"),
    ("unknown content type", _user_parts({"type": "input_video", "video": "x"}), 400, "'input_video' is not supported"),
    ("unknown model", {"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}, 404, "does not exist"),
    ("unknown voice", {"messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"],
                       "audio": {"voice": "alloy", "format": "wav"}}, 400, "unknown voice 'alloy'"),
    ("unknown voice, streamed", {"messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"],
                                 "stream": True, "audio": {"voice": "alloy", "format": "pcm16"}}, 400,
     "unknown voice 'alloy'"),
    ("max_tokens too large", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}, 400,
     "between 1 and"),
]


def test_bad_input_battery_gives_4xx_with_a_message_and_the_server_stays_healthy(server, engine):
    for name, body, status, fragment in BAD_INPUTS:
        got, headers, payload = _http(server, "POST", "/v1/chat/completions", body)
        assert got == status, (name, got, payload)
        assert headers["Content-Type"] == "application/json", name
        error = payload["error"]
        assert fragment in error["message"], (name, error["message"])
        assert error["type"] == "invalid_request_error" and "code" in error, name
    for method, path, status in (("GET", "/v1/chat/completions", 405), ("GET", "/v2/nothing", 404),
                                 ("DELETE", "/v1/models", 405), ("GET", "/v1/models/gpt-4o", 404)):
        got, _, payload = _http(server, method, path)
        assert got == status and payload["error"]["message"], (method, path, got)
    # The openai client maps them to its exception types.
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        _client(server).chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="not valid base64"):
        _client(server).chat.completions.create(model=engine.model_name, messages=[
            {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "@@", "format": "wav"}}]}])
    # Still healthy, and still answering.
    assert _http(server, "GET", "/health")[0] == 200
    ok = _client(server).chat.completions.create(model=engine.model_name,
                                                 messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert ok.usage.completion_tokens >= 1


def _raw_exchange(srv: Server, head: bytes, body: bytes = b"") -> tuple[int, dict]:
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.sendall(head + body)
        data = b""
        while b"\r\n\r\n" not in data:
            part = sock.recv(65536)
            if not part:
                break
            data += part
        head_text, _, rest = data.partition(b"\r\n\r\n")
        status = int(head_text.split()[1])
        length = int(next(line.split(b":")[1] for line in head_text.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        while len(rest) < length:
            part = sock.recv(65536)
            if not part:
                break
            rest += part
        return status, json.loads(rest[:length])


def test_body_limits_are_checked_before_reading(server):
    too_big = 65 << 20
    status, body = _raw_exchange(server, (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                                          f"Content-Type: application/json\r\nContent-Length: {too_big}\r\n\r\n").encode())
    assert status == 413 and "over the" in body["error"]["message"]
    status, body = _raw_exchange(server, (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                                          f"Content-Length: {too_big}\r\n\r\n").encode())
    assert status == 413  # refused instead of "100 Continue"
    status, body = _raw_exchange(server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 411 and "Content-Length" in body["error"]["message"]
    status, body = _raw_exchange(server, b"BREW /pot HTTP/1.1\r\nHost: x\r\n\r\n")
    assert status == 501 and body["error"]["message"]
    assert _http(server, "GET", "/health")[0] == 200


# --------------------------------------------------------------------------- memory over many requests


def test_fifty_sequential_requests_do_not_grow_memory(server, engine):
    """RSS (what MemoryMax= and the board's shared DRAM see: Python objects, torch CPU tensors, allocator
    fragmentation) must not grow by 2 % after warm-up, and the engine's own accounting of device memory
    (allocated_bytes, which is what counts on CUDA where RSS does not see it) must come back to the same value."""
    from orin.metrics import process_rss_bytes

    client = _client(server)
    text = dict(messages=[{"role": "user", "content": "Hello!"}], max_tokens=3)
    media_in = dict(messages=[{"role": "user", "content": _mm_content(1.0)}], max_tokens=3)
    speech_out = dict(messages=[{"role": "user", "content": "Hi"}], max_tokens=2, modalities=["text", "audio"],
                      audio={"voice": "ethan", "format": "wav"})
    requests = [text, media_in, text, speech_out, text]  # every path, in proportions that keep it quick on CPU

    def run(i: int):
        resp = client.chat.completions.create(model=engine.model_name, **requests[i % len(requests)])
        assert resp.usage.completion_tokens >= 1

    for i in range(len(requests)):  # warm-up: allocator pools, first-call caches
        run(i)
    rss0, alloc0 = process_rss_bytes(), engine.memory()["allocated_bytes"]
    for i in range(50):
        run(i)
    rss1, alloc1 = process_rss_bytes(), engine.memory()["allocated_bytes"]
    assert rss1 <= rss0 * 1.02, f"RSS grew from {rss0} to {rss1} bytes ({(rss1 / rss0 - 1) * 100:.2f} %)"
    assert alloc1 <= alloc0 * 1.02
    assert _metrics(server)['orin_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 55


# --------------------------------------------------------------------------- auth


def test_api_key_is_enforced(engine, quantized_dir, tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# rotated keys, one a line\nold-key\nsecret-key\n")
    key_file.chmod(0o600)
    srv = _server(engine, quantized_dir, api_key_file=str(key_file))
    try:
        for key in ("wrong", ""):
            with pytest.raises(openai.AuthenticationError) as info:
                _client(srv, key or "x").models.list()
            assert info.value.status_code == 401
        status, headers, body = _http(srv, "POST", "/v1/chat/completions",
                                      {"messages": [{"role": "user", "content": "x"}]})
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert headers["WWW-Authenticate"].startswith("Bearer")
        assert _http(srv, "GET", "/metrics")[0] == 401
        assert _http(srv, "GET", "/health")[0] == 200  # probes need no key
        for key in ("secret-key", "old-key"):
            resp = _client(srv, key).chat.completions.create(
                model=engine.model_name, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            assert resp.usage.completion_tokens >= 1
        status, _, _ = _http(srv, "GET", "/metrics", headers={"Authorization": "Bearer secret-key"})
        assert status == 200
    finally:
        srv.stop()


# --------------------------------------------------------------------------- queueing, disconnects, shutdown


class _Holder:
    """A test hook that holds the first request once it has the GPU, until released."""

    def __init__(self):
        self.admitted = threading.Event()
        self.release = threading.Event()
        self.held = False
        self.lock = threading.Lock()

    def __call__(self, stage, event, cancel):
        if stage != "admitted":
            return
        with self.lock:
            first, self.held = not self.held, True
        if first:
            self.admitted.set()
            self.release.wait(30)


def _post_in_thread(srv: Server, body: dict, results: list, key: str):
    def run():
        results.append((key,) + _http(srv, "POST", "/v1/chat/completions", body)[::2])

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_queue_full_gives_429_and_the_queue_drains_in_order(engine, quantized_dir):
    hook = _Holder()
    srv = _server(engine, quantized_dir, hook=hook, max_queue=1)
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        results: list = []
        t1 = _post_in_thread(srv, body, results, "first")
        assert hook.admitted.wait(30)
        t2 = _post_in_thread(srv, body, results, "second")
        _wait_for(lambda: srv.gate.queued == 1, what="the second request to queue")
        status, headers, payload = _http(srv, "POST", "/v1/chat/completions", body)
        assert status == 429 and payload["error"]["code"] == "queue_full" and headers["Retry-After"] == "1"
        with pytest.raises(openai.RateLimitError):
            _client(srv).chat.completions.create(model=engine.model_name, **body)
        assert _metrics(srv)["orin_queue_depth"] == 1
        hook.release.set()
        t1.join(60)
        t2.join(60)
        assert sorted((k, s) for k, s, _ in results) == [("first", 200), ("second", 200)]
        m = _metrics(srv)
        assert m["orin_requests_rejected_queue_full_total"] == 2
        assert m['orin_requests_total{endpoint="/v1/chat/completions",status="429"}'] == 2
    finally:
        hook.release.set()
        srv.stop()


class _DisconnectProbe:
    """Holds the request at its first text event until the server notices the client is gone (its cancel
    event is set), then counts what the engine still produces."""

    def __init__(self, hold_at: int = 1):
        self.hold_at = hold_at
        self.reached = threading.Event()
        self.saw_cancel = threading.Event()
        self.text_events = 0
        self.after_cancel = 0
        self.report = None

    def __call__(self, stage, event, cancel):
        if stage != "event":
            return
        if isinstance(event, Done):
            self.report = event.report
            return
        if isinstance(event, TextDelta):
            self.text_events += 1
            if self.saw_cancel.is_set():
                self.after_cancel += 1
            if self.text_events == self.hold_at:
                self.reached.set()
                if cancel.wait(30):
                    self.saw_cancel.set()


def _send_request(port: int, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return sock


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_disconnects_cancels_its_request(engine, quantized_dir, stream):
    probe = _DisconnectProbe(hold_at=2 if stream else 1)
    srv = _server(engine, quantized_dir, hook=probe)
    try:
        body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 200,
                "modalities": ["text", "audio"], "stream": stream}
        sock = _send_request(srv.port, body)
        assert probe.reached.wait(60)
        if stream:
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")  # the stream had started
        sock.close()
        assert probe.saw_cancel.wait(10), "the server did not notice the disconnect"
        _wait_for(lambda: probe.report is not None and not srv.gate.busy, what="the engine to stop")
        assert probe.report["cancelled"] is True
        assert probe.after_cancel <= 1  # the engine stops at its next step
        assert probe.report["completion_tokens"] < 200
        assert probe.report["audio_seconds"] < 200 / 12.5
        m = _metrics(srv)
        assert m["orin_requests_cancelled_total"] == 1
        assert m['orin_requests_total{endpoint="/v1/chat/completions",status="499"}'] == 1
        assert _http(srv, "GET", "/health")[0] == 200
    finally:
        srv.stop()


def test_a_client_that_disconnects_while_queued_leaves_the_queue(engine, quantized_dir):
    hook = _Holder()
    srv = _server(engine, quantized_dir, hook=hook, max_queue=2)
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        results: list = []
        t1 = _post_in_thread(srv, body, results, "first")
        assert hook.admitted.wait(30)
        sock = _send_request(srv.port, body)
        _wait_for(lambda: srv.gate.queued == 1, what="the request to queue")
        sock.close()
        _wait_for(lambda: srv.gate.queued == 0, what="the abandoned request to leave the queue")
        hook.release.set()
        t1.join(60)
        assert results[0][1] == 200
    finally:
        hook.release.set()
        srv.stop()


def test_stop_drains_the_running_request_and_refuses_the_queue(engine, quantized_dir):
    hook = _Holder()
    srv = _server(engine, quantized_dir, hook=hook, max_queue=2)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    results: list = []
    t1 = _post_in_thread(srv, body, results, "running")
    assert hook.admitted.wait(30)
    t2 = _post_in_thread(srv, body, results, "queued")
    _wait_for(lambda: srv.gate.queued == 1, what="the request to queue")
    stopper = threading.Thread(target=srv.stop, kwargs={"drain_s": 30})
    stopper.start()
    t2.join(30)
    assert results == [("queued", 503, results[0][2])] and results[0][2]["error"]["code"] == "shutting_down"
    hook.release.set()  # the running request finishes inside the drain time
    t1.join(60)
    stopper.join(60)
    assert results[1][:2] == ("running", 200)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", srv.port), timeout=2).close()


def test_stop_cancels_a_request_that_outlives_the_drain_time(engine, quantized_dir):
    probe = _DisconnectProbe(hold_at=1)
    srv = _server(engine, quantized_dir, hook=probe)
    results: list = []
    t = _post_in_thread(srv, {"messages": [{"role": "user", "content": "Go on."}], "max_tokens": 200}, results, "r")
    assert probe.reached.wait(60)
    srv.stop(drain_s=0.2)
    t.join(60)
    status, payload = results[0][1:]
    assert status == 503 and "shutting down" in payload["error"]["message"]
    assert probe.report["cancelled"] is True


# --------------------------------------------------------------------------- systemd: notify, watchdog, SIGTERM


def test_watchdog_pings_stop_while_a_request_is_stuck(engine, quantized_dir, tmp_path):
    from orin.sdnotify import Notifier

    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify.sock")
    notify.bind(path)
    notify.settimeout(10)

    def drain() -> list[bytes]:
        notify.setblocking(False)
        out = []
        try:
            while True:
                out.append(notify.recv(4096))
        except BlockingIOError:
            pass
        notify.settimeout(10)
        return out

    hook = _Holder()
    cfg = ServeConfig(model_dir=quantized_dir, port=0, device="cpu", power_backend="none", warmup=False, stall_s=0.3)
    srv = Server(cfg, engine=engine, hook=hook, notifier=Notifier(socket_path=path, watchdog_s=0.05)).start()
    results: list = []
    try:
        assert notify.recv(4096).startswith(b"READY=1")
        assert notify.recv(4096) == b"WATCHDOG=1"
        t = _post_in_thread(srv, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, results, "r")
        assert hook.admitted.wait(30)
        time.sleep(0.6)  # no progress for longer than stall_s
        assert not srv.healthy()
        status, _, body = _http(srv, "GET", "/health")
        assert status == 503 and body["status"] == "unhealthy"
        drain()
        time.sleep(0.3)
        assert b"WATCHDOG=1" not in drain()  # systemd will restart a stuck server
        hook.release.set()
        t.join(60)
        assert results[0][1] == 200
        assert notify.recv(4096) == b"WATCHDOG=1"  # healthy again
    finally:
        hook.release.set()
        srv.stop()
        notify.close()


def test_systemd_notify_ready_watchdog_and_sigterm(quantized_dir, tmp_path):
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify_path = str(tmp_path / "notify.sock")
    notify.bind(notify_path)
    notify.settimeout(120)
    env = {**os.environ, "NOTIFY_SOCKET": notify_path, "WATCHDOG_USEC": "200000", "PYTHONUNBUFFERED": "1"}
    env.pop("WATCHDOG_PID", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "orin.cli", "serve", "--model-dir", quantized_dir, "--port", "0", "--device", "cpu",
         "--power-backend", "none", "--drain-seconds", "5"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    messages: list[dict] = []

    def receive_until(key: str) -> dict:
        while True:
            msg = dict(line.split("=", 1) for line in notify.recv(4096).decode().split("\n"))
            messages.append(msg)
            if key in msg:
                return msg

    try:
        ready = receive_until("READY")
        assert ready["MAINPID"] == str(proc.pid)
        url = ready["STATUS"].rsplit(" on ", 1)[1]
        port = int(url.rsplit(":", 1)[1])
        statuses = [m.get("STATUS", "") for m in messages]
        assert any(s.startswith("loading") for s in statuses) and "warming up" in statuses
        receive_until("WATCHDOG")  # pinged every 0.1 s once ready
        receive_until("WATCHDOG")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        conn.close()
        proc.send_signal(signal.SIGTERM)
        stopping = receive_until("STOPPING")
        assert stopping["STOPPING"] == "1"
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "SIGTERM received" in out and "stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        notify.close()


# --------------------------------------------------------------------------- startup errors (no model loaded)


def test_startup_errors_fail_fast_with_usage_errors(tmp_path):
    from click.testing import CliRunner

    from orin.cli import cli

    runner = CliRunner()
    empty = tmp_path / "empty-key"
    empty.write_text("\n# only a comment\n")
    result = runner.invoke(cli, ["serve", "--model-dir", str(tmp_path), "--api-key-file", str(empty)])
    assert result.exit_code == 2 and "holds no key" in result.output
    result = runner.invoke(cli, ["serve", "--model-dir", str(tmp_path), "--api-key-file", str(tmp_path / "nope")])
    assert result.exit_code == 2 and "cannot read it" in result.output
    # A taken port fails at once, before any model load.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = runner.invoke(cli, ["serve", "--model-dir", str(tmp_path), "--port", str(port)])
        assert result.exit_code == 2 and f"cannot listen on 127.0.0.1:{port}" in result.output
    # A missing model: the server bound, then the engine refused the directory, and the error says so.
    result = runner.invoke(cli, ["serve", "--model-dir", str(tmp_path), "--port", "0", "--device", "cpu",
                                 "--power-backend", "none"])
    assert result.exit_code == 1 and "manifest.json" in result.output


def test_journald_log_lines_carry_priorities():
    import logging

    from orin.server import _JournalFormatter

    fmt = _JournalFormatter("%(name)s: %(message)s")
    for level, prio in ((logging.ERROR, 3), (logging.WARNING, 4), (logging.INFO, 6), (logging.DEBUG, 7)):
        record = logging.LogRecord("orin.server", level, __file__, 1, "hello", None, None)
        assert fmt.format(record) == f"<{prio}>orin.server: hello"


# --------------------------------------------------------------------------- the model's name, and quiet logs


def test_served_name_comes_from_the_manifest_not_the_directory(engine, quantized_dir, tmp_path):
    import shutil

    # A copy under another directory name still answers to the name recorded at quantize time.
    copy = tmp_path / "whatever-dir-name"
    shutil.copytree(quantized_dir, copy)
    from orin.manifest import read_manifest

    assert read_manifest(copy).model_name == "qwen3-omni-int4" == engine.model_name
    srv = _server(engine, str(copy))
    try:
        assert [m.id for m in _client(srv).models.list().data] == ["qwen3-omni-int4"]
    finally:
        srv.stop()
    named = _server(engine, quantized_dir, served_model_name="robot-brain")
    try:
        client = _client(named)
        assert [m.id for m in client.models.list().data] == ["robot-brain"]
        reply = client.chat.completions.create(model="robot-brain", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2)
        assert reply.model == "robot-brain"
        with pytest.raises(openai.NotFoundError, match="robot-brain"):
            client.chat.completions.create(model="qwen3-omni-int4", messages=[{"role": "user", "content": "hi"}])
    finally:
        named.stop()


def test_a_bad_served_name_is_a_usage_error(quantized_dir):
    from click.testing import CliRunner

    from orin.cli import cli

    result = CliRunner().invoke(cli, ["serve", "--model-dir", quantized_dir, "--served-model-name", "two words",
                                      "--port", "0"])
    assert result.exit_code == 2 and "served model name 'two words'" in result.output


def test_a_client_reset_is_not_a_traceback_and_probes_are_not_logged(server, caplog, capfd):
    import logging
    import struct

    caplog.set_level(logging.DEBUG, logger="orin.server")
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b"200 OK" in sock.recv(65536)
    sock.sendall(b"GET /heal")  # the server now waits for the rest of the request line
    time.sleep(0.2)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a TCP reset
    sock.close()
    _wait_for(lambda: any("closed the connection" in r.getMessage() for r in caplog.records), what="the reset")
    assert _http(server, "GET", "/metrics")[0] == 200
    _wait_for(lambda: any("GET /metrics 200" in r.getMessage() for r in caplog.records), what="the probe line")
    assert _http(server, "GET", "/v1/models")[0] == 200
    # The access line is written after the response is sent: wait for it rather than race it.
    _wait_for(lambda: any("GET /v1/models 200" in r.getMessage() for r in caplog.records), what="the access line")
    assert "Traceback" not in capfd.readouterr().err
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("GET /v1/models 200" in m for m in info)
    assert not any("/health" in m or "/metrics" in m for m in info)
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any("GET /health 200" in m for m in debug) and any("GET /metrics 200" in m for m in debug)


def test_no_rope_parameters_warning_on_any_command(tiny_model_dir):
    result = subprocess.run([sys.executable, "-m", "orin.cli", "plan", tiny_model_dir], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "rope_parameters" not in result.stderr and "Unrecognized keys" not in result.stderr
