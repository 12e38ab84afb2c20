"""The Realtime API's voice-to-voice latency and barge-in, measured as a robot's client sees them: the
real server on loopback around an already-loaded engine, the official `openai` client over its WebSocket, a
spoken question streamed as a microphone would (20 ms packets of 24 kHz PCM, paced in real time, then silence).

Per turn: the end of the user's speech (the last speech packet sent) → `input_audio_buffer.speech_stopped` (the
server VAD's silence window, `silence_duration_ms`, plus its 32 ms windows) → the first
`response.output_audio.delta` (the server's time: commit, prompt, encoders, prefill, the first speech frames and
their vocoding). Then a barge-in: the same speech streamed again while the answer plays; from
`speech_started` to the last audio delta received (the silence the listener hears) and to `response.done`
(`cancelled`), and the server's own cancel-to-engine-stop time (`response.orin.interrupt_to_stop_s`)."""

from __future__ import annotations

import json
import statistics
import threading
import time

PACKET_S = 0.02


def load_question(path: str, rate: int = 24_000):
    """The spoken question (any file orin.inputs.media reads) at the API's 24 kHz, trimmed to where its speech is."""
    import numpy as np

    from orin.inputs.media import load_audio

    samples = np.asarray(load_audio(path, target_sr=rate), dtype=np.float32)
    loud = np.flatnonzero(np.abs(samples) > 0.02)
    return samples[loud[0]:loud[-1] + 1] if loud.size else samples


class _Sender(threading.Thread):
    """Streams `samples` in real-time 20 ms packets, then silence packets until stopped: a live microphone."""

    def __init__(self, conn, samples, silence_after: bool = True):
        super().__init__(daemon=True, name="bench-mic")
        self.conn, self.samples, self.silence_after = conn, samples, silence_after
        self.speech_end: float | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        import base64

        from orin.inputs.media import encode_pcm16

        step = int(24_000 * PACKET_S)
        pcm = encode_pcm16(self.samples)
        quiet = bytes(2 * step)
        t0 = time.perf_counter()
        n = 0
        for i in range(0, len(pcm), 2 * step):
            self._send(base64, pcm[i:i + 2 * step])
            n += 1
            time.sleep(max(0.0, t0 + n * PACKET_S - time.perf_counter()))
        self.speech_end = time.perf_counter()
        while self.silence_after and not self.stop.is_set():
            self._send(base64, quiet)
            n += 1
            time.sleep(max(0.0, t0 + n * PACKET_S - time.perf_counter()))

    def _send(self, base64, chunk: bytes) -> None:
        if not self.stop.is_set():
            self.conn.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()})


def _events(conn):
    """(arrival time, event dict) for each server event."""
    for raw in iter(conn.recv_bytes, None):
        yield time.perf_counter(), json.loads(raw)


def _turn(conn, question, barge_in: bool) -> dict:
    mic = _Sender(conn, question)
    mic.start()
    out: dict = {}
    barge = None
    try:
        for t, ev in _events(conn):
            kind = ev.get("type")
            if kind == "error":
                raise RuntimeError(f"server error event: {ev.get('error')}")
            if kind == "input_audio_buffer.speech_stopped" and "stopped" not in out:
                out["stopped"] = t
            elif kind == "response.output_audio.delta":
                out.setdefault("first_audio", t)
                out["last_audio"] = t
                if barge_in and barge is None:
                    mic.stop.set()
                    mic.join()
                    barge = _Sender(conn, question, silence_after=True)
                    barge.start()
            elif kind == "input_audio_buffer.speech_started" and barge is not None:
                out.setdefault("barge_started", t)
            elif kind == "response.done":
                out["done"] = t
                resp = ev.get("response") or {}
                out["status"] = resp.get("status")
                out["orin"] = resp.get("orin") or {}
                break
    finally:
        mic.stop.set()
        if barge is not None:
            barge.stop.set()
            barge.join()
        mic.join()
    out["speech_end"] = mic.speech_end
    return out


def _encoder_alone(engine, question) -> tuple[float, float]:
    """Seconds of an eager audio-encoder pass over the question, the engine alone in the process: the first (a
    shape never seen: what cuDNN's per-shape planning costs shows here) and the best of 3 (what the kernels
    cost); the turns' encoder times beside them show what the server adds to the eager path."""
    import torch

    from orin.contract import GenerationRequest
    from orin.inputs.media import resample
    from orin.runtime.attention import without_cudnn_attention
    from orin.runtime.thinker import AudioTokenCache

    audio = resample(question, 24_000, 16_000)
    prompt = engine.prepare(GenerationRequest(messages=({"role": "user", "content": [
        {"type": "audio", "audio": audio}]},)))
    inputs = {k: (v.to(engine.device) if hasattr(v, "to") else v) for k, v in prompt.inputs.items()}
    engine.loader.ensure("audio_encoder")
    times = []
    with torch.inference_mode(), without_cudnn_attention():  # as the engine runs it
        for _ in range(3):
            engine.thinker.audio_tokens = AudioTokenCache(engine.profile.memory.audio_token_cache_bytes)
            start = time.perf_counter()
            engine.thinker.encode_audio(inputs, prompt, graph=False)
            if engine.device.type == "cuda":
                torch.cuda.synchronize(engine.device)
            times.append(time.perf_counter() - start)
    engine.thinker.audio_tokens = AudioTokenCache(engine.profile.memory.audio_token_cache_bytes)
    return times[0], min(times)


def _client(url: str, model: str, question, turns: int, silence_ms: int, out) -> None:
    """The client's side, in a process of its own as on a robot (in the server's process its threads took the
    GIL from the engine's eager launches: an audio-encoder pass of 10 ms took 80-110 ms): `turns` spoken
    questions answered in speech after a warm-up turn, then a barge-in; each turn's figures go to `out` (a
    multiprocessing queue), then None, or the error's text."""
    try:
        import openai

        client = openai.OpenAI(base_url=url + "/v1", api_key="bench", max_retries=0,
                               websocket_base_url=url.replace("http://", "ws://") + "/v1")
        with client.realtime.connect(model=model) as conn:
            conn.send({"type": "session.update", "session": {
                "type": "realtime", "output_modalities": ["audio"], "max_output_tokens": 64,
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24_000},
                                    "turn_detection": {"type": "server_vad", "silence_duration_ms": silence_ms}},
                          "output": {"voice": "ethan"}}}})
            for i in range(turns + 1):
                r = _turn(conn, question, barge_in=False)
                if i:  # the first response is a warm-up: it pays one-off costs (graph captures)
                    out.put(("turn", r))
            out.put(("barge", _turn(conn, question, barge_in=True)))
        out.put(None)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
        out.put(("error", f"{type(exc).__name__}: {exc}"))


def measure_realtime(engine, model_dir: str, question_path: str, log_fn, *, turns: int = 3,
                     silence_ms: int = 500, max_speech_seconds: float = 20.0) -> dict:
    """`turns` spoken questions answered in speech, then one barge-in, on one session; seconds per turn. The
    server runs here around `engine`; the client (the official `openai` package) in a child process."""
    import multiprocessing

    from orin.runtime.engine import EngineConfig
    from orin.runtime.prefill_route import prefill_bucket
    from orin.serve.app import ServeConfig, Server

    question = load_question(question_path)
    encoder_first, encoder_alone = _encoder_alone(engine, question)
    served = EngineConfig(model_dir=model_dir, device=str(engine.device), power_backend="none", verify_checksums=False)
    srv = Server(ServeConfig(served, port=0, warmup=True, max_speech_seconds=max_speech_seconds),
                 engine=engine).start()
    rows, barge = [], None
    try:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process holding CUDA and the server's threads
        results = ctx.Queue()
        child = ctx.Process(target=_client, args=(srv.url, srv.model_name, question, turns, silence_ms, results),
                            name="bench-realtime-client", daemon=True)
        child.start()
        try:
            while (msg := results.get(timeout=600)) is not None:
                kind, r = msg
                if kind == "error":
                    raise RuntimeError(f"the realtime client failed: {r}")
                if kind == "barge":
                    barge = {"status": r["status"],
                             "to_silence_s": max(0.0, r["last_audio"] - r["barge_started"])
                             if "barge_started" in r else None,
                             "to_done_s": r["done"] - r["barge_started"] if "barge_started" in r else None,
                             "server_interrupt_to_stop_s": r["orin"].get("interrupt_to_stop_s")}
                    log_fn(f"[realtime] barge-in: {barge}")
                    continue
                orin = r["orin"]
                timeline = orin.get("timeline_s") or {}
                rows.append({"vad_window_s": r["stopped"] - r["speech_end"],
                             "server_s": r["first_audio"] - r["stopped"],
                             "voice_to_voice_s": r["first_audio"] - r["speech_end"], "status": r["status"],
                             # the engine's own view: from its start to the first token and audio, and whether
                             # the prefill replayed its bucket's graph (captured while idle) or ran eagerly
                             "prompt_tokens": orin.get("prompt_tokens"), "engine_ttft_s": orin.get("ttft_s"),
                             "engine_first_audio_s": orin.get("first_audio_s"), "timeline_s": timeline,
                             "bucket": prefill_bucket(orin.get("prompt_tokens") or 1),
                             "prefill_path": next((k[len("prefill_"):] for k in timeline
                                                   if k.startswith("prefill_")), None),
                             "audio_encoder_host": dict(engine.thinker.audio_tokens.last)})
                row = rows[-1]
                log_fn(f"[realtime] turn {len(rows)}: speech end -> stopped {row['vad_window_s']:.3f} s, "
                       f"stopped -> first audio {row['server_s']:.3f} s ({row['prompt_tokens']} prompt tokens, "
                       f"engine ttft {row['engine_ttft_s'] or 0:.3f} s, first audio "
                       f"{row['engine_first_audio_s'] or 0:.3f} s, prefill {row['prefill_path']})")
        finally:
            child.join(10)
            if child.is_alive():
                child.kill()
    finally:
        srv.stop()
    if not rows or barge is None:
        raise RuntimeError("the realtime client ended without its turns")
    server = [r["server_s"] for r in rows]
    return {"question_s": len(question) / 24_000, "silence_duration_ms": silence_ms, "turns": rows,
            "server_s_median": statistics.median(server), "server_s_max": max(server),
            "vad_window_s_median": statistics.median(r["vad_window_s"] for r in rows),
            "voice_to_voice_s_median": statistics.median(r["voice_to_voice_s"] for r in rows),
            "barge_in": barge, "audio_encoder_alone_s": encoder_alone,
            "audio_encoder_alone_first_s": encoder_first, "client": "separate process"}
