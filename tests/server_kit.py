"""Helpers shared by the server tests: starting a real server on port 0 around the shared engine, the official
client, raw HTTP, and reading its metrics."""

from __future__ import annotations

import base64
import http.client
import io
import json
import threading
import time
import wave

import numpy as np
import openai
from PIL import Image

from orin.inputs.media import encode_wav, synth_image, synth_speechlike
from orin.runtime.engine import EngineConfig
from orin.serve.app import ServeConfig, Server
from orin.serve.metrics import parse_metrics

# --------------------------------------------------------------------------- fixtures and helpers

# The tiny model's random talker never says "end of speech", and a CPU codec frame costs ~80 ms: cap speech
# at 10 frames with the server's own --max-speech-seconds.
SPEECH_S = 0.8


def start_server(engine, quantized_dir, hook=None, **overrides) -> Server:
    cfg = ServeConfig(EngineConfig(model_dir=quantized_dir, device="cpu", power_backend="none"), port=0,
                      warmup=False, max_speech_seconds=SPEECH_S, **overrides)
    return Server(cfg, engine=engine, hook=hook).start()


def client(srv: Server, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=120)


def http_request(srv: Server, method: str, path: str, body=None, headers=None, timeout=120):
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


def png_url(image: Image.Image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def wav_b64(samples, sr=16000) -> str:
    return base64.b64encode(encode_wav(samples, sr=sr)).decode()


def mm_content(seconds: float = 2.0) -> list[dict]:
    return [
        {"type": "image_url", "image_url": {"url": png_url(synth_image(64, seed=1))}},
        {"type": "input_audio", "input_audio": {"data": wav_b64(synth_speechlike(seconds, seed=2)), "format": "wav"}},
        {"type": "text", "text": "What do you see and hear?"},
    ]


def wav_info(data: bytes) -> tuple[int, int, int, np.ndarray]:
    with wave.open(io.BytesIO(data)) as w:
        frames = w.readframes(w.getnframes())
        return w.getframerate(), w.getnchannels(), w.getsampwidth(), np.frombuffer(frames, "<i2")


def metrics(srv: Server) -> dict[str, float]:
    status, _, text = http_request(srv, "GET", "/metrics")
    assert status == 200
    return parse_metrics(text)


def wait_for(cond, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class Holder:
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


def post_in_thread(srv: Server, body: dict, results: list, key: str):
    def run():
        results.append((key,) + http_request(srv, "POST", "/v1/chat/completions", body)[::2])

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t
