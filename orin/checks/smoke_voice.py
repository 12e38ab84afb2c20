"""`orin-omni smoke --url`'s voice checks: the server's `/v1/audio/speech` (a WAV at 24 kHz), its
`/v1/audio/transcriptions` (that speech back to text) and a `/v1/realtime` session over its WebSocket (a text item
answered in speech and transcript, the GA events in their order). Each is one request through the same key and
model as the chat checks; what a failure says is what the server answered."""

from __future__ import annotations

import base64
import io
import json
import secrets
import wave

from .check import FAIL, PASS, Check
from .http import Unreachable, exchange

REALTIME_EVENTS = ("session.created", "session.updated", "conversation.item.added", "response.created",
                   "response.output_audio.delta", "response.output_audio_transcript.delta", "response.done")


def _post(target, path: str, data: bytes, content_type: str) -> tuple[int, bytes]:
    try:
        return exchange(target.url + path, "POST", data, {"Content-Type": content_type}, target.api_key,
                        target.timeout_s)
    except Unreachable as exc:
        return 0, str(exc).encode()


def _error_text(status: int, raw: bytes) -> str:
    try:
        message = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = raw[:200].decode("utf-8", "replace")
    return f"HTTP {status}: {message}" if status else message


def _wav_format(data: bytes) -> tuple[int, int, int, int]:
    """(rate, channels, sample width, frames) of a WAV, the frames counted from its data: the server streams WAV
    as it speaks, with the sizes in its header set to 0xFFFFFFFF as OpenAI's do."""
    try:
        with wave.open(io.BytesIO(data), "rb") as w:
            rate, channels, width = w.getframerate(), w.getnchannels(), w.getsampwidth()
            frames = len(w.readframes(1 << 30)) // max(1, channels * width)
    except (wave.Error, EOFError) as exc:
        raise ValueError(f"not a valid WAV file: {exc}") from exc
    return rate, channels, width, frames


def check_speech(target, text: str = "Hello from the Orin.") -> tuple[Check, bytes | None]:
    """POST /v1/audio/speech as WAV: (the check, the WAV for the transcription check)."""
    body = {"input": text, "response_format": "wav", **({"model": target.model} if target.model else {}),
            **({"voice": target.voice} if target.voice else {})}
    status, raw = _post(target, "/v1/audio/speech", json.dumps(body).encode(), "application/json")
    if status != 200:
        return Check("audio/speech", FAIL, _error_text(status, raw)), None
    try:
        sr, channels, width, samples = _wav_format(raw)
    except ValueError as exc:
        return Check("audio/speech", FAIL, f"not a WAV: {exc}"), None
    if (sr, channels, width) != (24_000, 1, 2) or not samples:
        return Check("audio/speech", FAIL, f"{sr} Hz, {channels} channel(s), {8 * width}-bit, {samples} samples; "
                     "expected 24000 Hz mono 16-bit speech"), None
    return Check("audio/speech", PASS, f"{samples / sr:.2f} s of WAV at 24 kHz"), raw


def check_transcription(target, wav: bytes | None) -> Check:
    """POST /v1/audio/transcriptions (multipart) with the speech check's WAV: a JSON with a text."""
    if wav is None:
        return Check("audio/transcriptions", FAIL, "no speech to send: the audio/speech check failed")
    boundary = secrets.token_hex(12)
    fields = [("model", target.model or ""), ("response_format", "json")]
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in fields if v]
    parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="speech.wav"\r\n'
                 "Content-Type: audio/wav\r\n\r\n".encode() + wav + b"\r\n")
    body = b"".join(parts) + f"--{boundary}--\r\n".encode()
    status, raw = _post(target, "/v1/audio/transcriptions", body, f"multipart/form-data; boundary={boundary}")
    if status != 200:
        return Check("audio/transcriptions", FAIL, _error_text(status, raw))
    try:
        text = json.loads(raw)["text"]
    except (ValueError, KeyError, TypeError):
        return Check("audio/transcriptions", FAIL, f"no text in the answer: {raw[:200]!r}")
    if not isinstance(text, str):
        return Check("audio/transcriptions", FAIL, f"text is {type(text).__name__}, not a string")
    return Check("audio/transcriptions", PASS, f"{len(text)} chars: {text[:60]!r}")


def check_realtime(target, prompt: str = "Say hello.", max_output_tokens: int = 8) -> Check:
    """One Realtime session: a text item answered in audio with its transcript, status completed or incomplete."""
    try:
        from websockets.exceptions import WebSocketException
        from websockets.sync.client import connect
    except ImportError:
        return Check("realtime", FAIL, "the websockets package is missing: pip install 'orin-omni[serve]'")
    url = target.url.replace("https://", "wss://").replace("http://", "ws://") + "/v1/realtime"
    if target.model:
        url += f"?model={target.model}"
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else None
    seen: list[str] = []
    audio = 0
    try:
        with connect(url, additional_headers=headers, open_timeout=target.timeout_s,
                     max_size=None) as ws:
            ws.send(json.dumps({"type": "session.update", "session": {
                "type": "realtime", "output_modalities": ["audio"], "max_output_tokens": max_output_tokens,
                "audio": {"input": {"turn_detection": None},
                          **({"output": {"voice": target.voice}} if target.voice else {})}}}))
            ws.send(json.dumps({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user", "content": [{"type": "input_text", "text": prompt}]}}))
            ws.send(json.dumps({"type": "response.create"}))
            while True:
                event = json.loads(ws.recv(timeout=target.timeout_s))
                kind = event.get("type")
                seen.append(kind)
                if kind == "error":
                    return Check("realtime", FAIL, f"error event: {(event.get('error') or {}).get('message')}")
                if kind == "response.output_audio.delta":
                    audio += len(base64.b64decode(event.get("delta") or ""))
                if kind == "response.done":
                    status = (event.get("response") or {}).get("status")
                    break
    except (OSError, TimeoutError, ValueError, WebSocketException) as exc:  # refused, closed, timed out, not JSON
        return Check("realtime", FAIL, f"{type(exc).__name__}: {exc}")
    missing = [e for e in REALTIME_EVENTS if e not in seen]
    if missing or status not in ("completed", "incomplete"):
        return Check("realtime", FAIL, f"response {status!r}; events missing: {', '.join(missing) or 'none'}")
    return Check("realtime", PASS, f"answered in {audio / 48_000:.2f} s of audio with its transcript ({status})")


def voice_checks(target) -> list[Check]:
    speech, wav = check_speech(target)
    return [speech, check_transcription(target, wav), check_realtime(target)]
