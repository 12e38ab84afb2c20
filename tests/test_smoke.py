"""`orin-omni smoke`: its checks one by one, then the whole run against a real server over HTTP and against
the engine in-process (tiny quantized model, CPU), through the CLI. The `device` test runs the same checks on
real hardware when --device-url or --device-model-dir is given (see conftest.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from orin.checks.check import FAIL, PASS, SKIP, Check
from orin.checks.smoke import (
    VIDEO_CASE,
    HttpTarget,
    Inputs,
    SmokeConfig,
    SmokeResult,
    render_table,
    run_smoke,
    video_prompt_tokens,
)
from orin.checks.smoke_checks import (
    Answer,
    SmokeRequestError,
    check_peak,
    check_power,
    check_prompt_tokens,
    check_text,
    check_ttft,
    check_wav,
    expected_samples,
)
from orin.cli import cli
from orin.device.profile import CPU
from orin.errors import UsageError
from orin.inputs.media import encode_wav
from orin.runtime.engine import EngineConfig

# --------------------------------------------------------------------------- single checks

SPEECH = CPU.speech  # code2wav's chunk schedule (every profile's)


def _speech(samples: int, report: dict) -> Answer:
    return Answer(text="hi", wav=encode_wav(np.zeros(samples, np.float32), sr=24000), report=report)


def test_wav_length_is_judged_from_codec_frames():
    CH, FIRST, vocoder_chunks = SPEECH.code2wav_chunk, SPEECH.code2wav_first_chunk, SPEECH.chunk_count

    assert vocoder_chunks(1) == 1 and vocoder_chunks(FIRST) == 1 and vocoder_chunks(FIRST + 1) == 2
    assert vocoder_chunks(63) == 6 and vocoder_chunks(63 + CH) == 7 and vocoder_chunks(64 + CH) == 8
    chunks = vocoder_chunks(10)
    assert expected_samples(10, SPEECH) == ((10 - chunks) * 1920, 10 * 1920)
    assert check_wav("s", _speech(10 * 1920, {"talker_frames": 10}), SPEECH).status == PASS
    assert check_wav("s", _speech(9 * 1920, {"talker_frames": 10}), SPEECH).status == PASS  # trimmed at a chunk edge
    too_short = check_wav("s", _speech(5 * 1920, {"talker_frames": 10}), SPEECH)
    assert too_short.status == FAIL and f"expected {(10 - chunks) * 1920}..19200" in too_short.detail
    assert check_wav("s", _speech(11 * 1920, {"talker_frames": 10}), SPEECH).status == FAIL
    assert check_wav("s", _speech(0, {"talker_frames": 0}), SPEECH).status == FAIL
    # Report and WAV must agree on the length.
    mismatch = check_wav("s", _speech(10 * 1920, {"talker_frames": 10, "audio_seconds": 0.5}), SPEECH)
    assert mismatch.status == FAIL and "report says" in mismatch.detail


def test_wav_without_frame_count_needs_a_tenth_of_a_second():
    assert check_wav("s", _speech(2400, {}), SPEECH).status == FAIL
    assert check_wav("s", _speech(2401, {}), SPEECH).status == PASS


def test_invalid_or_wrong_format_wav_fails():
    assert check_wav("s", Answer("hi", None, {}), SPEECH).detail == "no audio returned"
    assert "not a valid WAV" in check_wav("s", Answer("hi", b"RIFF....WAVEjunk", {}), SPEECH).detail
    wrong_rate = Answer("hi", encode_wav(np.zeros(48000, np.float32), sr=16000), {})
    assert "expected 24000 Hz mono 16-bit" in check_wav("s", wrong_rate, SPEECH).detail
    truncated = encode_wav(np.zeros(4800, np.float32), sr=24000)[:-100]
    assert check_wav("s", Answer("hi", truncated, {}), SPEECH).status == FAIL


def test_text_ttft_and_peak_checks():
    assert check_text("t", Answer("  ", None, {})).status == FAIL
    assert check_text("t", Answer("Paris.", None, {})).status == PASS
    assert check_ttft("t", {"ttft_s": 0.5}, 1.0).status == PASS
    assert check_ttft("t", {"ttft_s": 1.5}, 1.0).status == FAIL
    assert check_ttft("t", {}, None).status == FAIL  # missing is a failure, never a pass
    assert check_ttft("t", {"ttft_s": 0.5}, None).detail.endswith("(no --max-ttft)")
    assert check_peak("t", {"peak_bytes": 1000}, 2000).status == PASS
    assert check_peak("t", {"peak_bytes": 3000}, 2000).status == FAIL
    assert check_peak("t", {"peak_bytes": None}, 2000).status == FAIL


def test_video_prompt_tokens_count_frames_and_soundtrack():
    # 4 s at 2 fps: 8 frames, 4 temporal grids of (128/32)·(160/32) = 20 tokens; 400 feature frames: 4 chunks of 13
    assert video_prompt_tokens(4.0, (128, 160)) == 4 * 20 + 52
    assert video_prompt_tokens(4.0, (128, 160), audio=False) == 80
    assert video_prompt_tokens(1.0, (64, 64)) == 2 * 4 + 13  # at least 4 frames, whatever the length
    assert check_prompt_tokens("v", {"prompt_tokens": 140}, 132).status == PASS
    short = check_prompt_tokens("v", {"prompt_tokens": 90}, 132)
    assert short.status == FAIL and short.name == "v: prompt tokens" and "at least 132" in short.detail
    assert check_prompt_tokens("v", {}, 132).status == FAIL  # missing is a failure, never a pass


def _refusing(code: str):
    """HttpTarget._request as a server answers a part type it does not know."""
    def request(self, method, path, body=None):
        error = {"message": "content type 'video_url' is not supported", "type": "invalid_request_error",
                 "param": "messages[0].content[0].type", "code": code}
        return 400, json.dumps({"error": error}).encode()
    return request


def test_a_server_without_video_support_fails_the_video_check(monkeypatch):
    inputs = Inputs.make(1.0, video=True)
    monkeypatch.setattr(HttpTarget, "_request", _refusing("unsupported_content_type"))
    with pytest.raises(SmokeRequestError, match="the server predates video support.*--no-video"):
        HttpTarget("http://x", None, 5).ask(VIDEO_CASE, inputs, 4)
    # another 400 is reported as it came
    monkeypatch.setattr(HttpTarget, "_request", _refusing("invalid_value"))
    with pytest.raises(SmokeRequestError, match="^HTTP 400: .content type") as err:
        HttpTarget("http://x", None, 5).ask(VIDEO_CASE, inputs, 4)
    assert "predates" not in str(err.value)


def test_power_is_skipped_without_a_backend_and_checked_with_one():
    none = {"energy": {"backend": "none", "joules": None}}
    assert check_power({"a": none, "b": none}).status == SKIP
    jtop = {"energy": {"backend": "jtop", "joules": 12.5, "mean_w": 25.0}}
    assert check_power({"a": jtop, "b": jtop}).status == PASS
    missing = {"energy": {"backend": "jtop", "joules": None, "mean_w": None, "note": "power not measured"}}
    result = check_power({"a": jtop, "b": missing})
    assert result.status == FAIL and "b (jtop: power not measured)" in result.detail
    assert check_power({}).status == FAIL


def test_table_and_json():
    result = SmokeResult("x", (Check("a: answer", PASS, "ok"), Check("power", SKIP, "none"),
                               Check("b: ttft", FAIL, "slow")))
    table = render_table(result)
    assert "a: answer  PASS" in table and "FAILED: 1 passed, 1 failed, 1 skipped" in table
    assert not result.ok and result.to_json()["checks"][2] == {"name": "b: ttft", "status": "fail", "detail": "slow"}
    assert SmokeResult("x", (Check("power", SKIP, "none"),)).ok


def test_exactly_one_target():
    with pytest.raises(UsageError, match="exactly one"):
        run_smoke(SmokeConfig())
    with pytest.raises(UsageError, match="exactly one"):
        run_smoke(SmokeConfig(url="http://127.0.0.1:1", engine=EngineConfig(model_dir="/x")))
    runner = CliRunner()
    result = runner.invoke(cli, ["smoke"])
    assert result.exit_code == 2 and "exactly one of --url" in result.output


def test_unreachable_server_fails_every_request_check():
    result = run_smoke(SmokeConfig(url="http://127.0.0.1:9", timeout_s=5))
    assert not result.ok
    assert all(c.status in (FAIL, SKIP) for c in result.checks)
    assert any("cannot reach" in c.detail for c in result.checks)


# --------------------------------------------------------------------------- end to end

# The tiny model's random talker never ends its speech on its own: cap it (10 codec frames) to keep CPU time low.
SPEECH_S = 0.8


@pytest.fixture(scope="module")
def server(engine, quantized_dir):
    from orin.serve.app import ServeConfig, Server

    srv = Server(ServeConfig(EngineConfig(model_dir=quantized_dir, device="cpu", power_backend="none"), port=0,
                             warmup=False, max_speech_seconds=SPEECH_S), engine=engine).start()
    yield srv
    srv.stop()


def _statuses(result: SmokeResult) -> dict[str, str]:
    return {c.name: c.status for c in result.checks}


VIDEO = {"video: answer", "video: ttft", "video: peak memory", "video: prompt tokens"}
EXPECTED = {
    "text: answer", "text: ttft", "text: peak memory",
    "image+audio+text: answer", "image+audio+text: ttft", "image+audio+text: peak memory",
    "speech: answer", "speech: ttft", "speech: peak memory", "speech: wav", "speech: first audio", "power",
} | VIDEO


VOICE = {"audio/speech", "audio/transcriptions", "realtime"}


def test_smoke_over_http_passes_on_the_tiny_model(server):
    result = run_smoke(SmokeConfig(url=server.url, max_new_tokens=8))
    statuses = _statuses(result)
    assert set(statuses) == EXPECTED | VOICE | {"health", "metrics"}
    assert statuses["power"] == SKIP  # backend none: skipped, not passed
    assert all(s == PASS for name, s in statuses.items() if name != "power"), render_table(result)
    assert result.ok


def test_smoke_in_process_passes_on_the_tiny_model(engine, quantized_dir):
    result = run_smoke(SmokeConfig(engine=EngineConfig(model_dir=quantized_dir),
                                   max_new_tokens=8, max_speech_seconds=SPEECH_S),
                       engine=engine)
    statuses = _statuses(result)
    assert set(statuses) == EXPECTED and result.ok, render_table(result)
    assert all(statuses[name] == PASS for name in VIDEO), render_table(result)
    tokens = next(c for c in result.checks if c.name == "video: prompt tokens")
    assert f"at least {video_prompt_tokens()} expected" in tokens.detail


def test_smoke_no_video_leaves_the_video_check_out(engine, quantized_dir):
    result = run_smoke(SmokeConfig(engine=EngineConfig(model_dir=quantized_dir),
                                   max_new_tokens=2, max_speech_seconds=SPEECH_S,
                                   video=False), engine=engine)
    assert set(_statuses(result)) == EXPECTED - VIDEO and result.ok, render_table(result)


class _BlankVideoAnswers:
    """The shared engine, but a request with a video part gets an empty answer."""

    def __init__(self, engine):
        self.engine = engine
        self.profile = engine.profile

    def memory(self):
        return self.engine.memory()

    def generate(self, req):
        text, audio, report = self.engine.generate(req)
        has_video = any(p.get("type") == "video" for m in req.messages for p in m["content"])
        return ("" if has_video else text), audio, report


def test_smoke_video_fails_on_an_empty_answer_or_too_few_prompt_tokens(engine, quantized_dir, monkeypatch):
    import orin.checks.smoke as smoke

    # as if the video or its soundtrack had been dropped: the prompt is shorter than the clip's tokens
    monkeypatch.setattr(smoke, "video_prompt_tokens", lambda: 10**6)
    result = run_smoke(SmokeConfig(engine=EngineConfig(model_dir=quantized_dir),
                                   max_new_tokens=2, max_speech_seconds=SPEECH_S),
                       engine=_BlankVideoAnswers(engine))
    statuses = _statuses(result)
    assert not result.ok
    assert statuses["video: answer"] == FAIL and statuses["video: prompt tokens"] == FAIL, render_table(result)
    assert statuses["video: ttft"] == PASS and statuses["text: answer"] == PASS
    details = {c.name: c.detail for c in result.checks}
    assert details["video: answer"] == "empty text" and "at least 1000000 expected" in details["video: prompt tokens"]
    assert "video: answer" in render_table(result) and "FAILED:" in render_table(result)


def test_smoke_video_goes_through_the_real_decoder(engine, quantized_dir, monkeypatch):
    import orin.inputs.video

    monkeypatch.setattr(orin.inputs.video, "synth_clip", lambda *a, **k: b"\x00\x00\x00\x18ftypmp42 not really a video")
    result = run_smoke(SmokeConfig(engine=EngineConfig(model_dir=quantized_dir),
                                   max_new_tokens=2, max_speech_seconds=SPEECH_S),
                       engine=engine)
    statuses = _statuses(result)
    assert statuses["video: request"] == FAIL and not result.ok
    assert not set(statuses) & VIDEO  # no answer to check
    detail = next(c.detail for c in result.checks if c.name == "video: request")
    assert "the smoke clip" in detail, detail


def test_smoke_cli_exit_codes_and_thresholds(server, tmp_path):
    runner = CliRunner()
    ok = runner.invoke(cli, ["smoke", "--url", server.url, "--json"])
    assert ok.exit_code == 0, ok.output
    data = json.loads(ok.output)
    assert data["ok"] is True and data["target"] == server.url
    assert {c["name"] for c in data["checks"]} >= VIDEO
    no_video = runner.invoke(cli, ["smoke", "--url", server.url, "--json", "--no-video"])
    assert no_video.exit_code == 0, no_video.output
    names = {c["name"] for c in json.loads(no_video.output)["checks"]}
    assert not any(n.startswith("video") for n in names) and "text: answer" in names
    no_voice = runner.invoke(cli, ["smoke", "--url", server.url, "--json", "--no-video", "--no-voice-endpoints"])
    assert no_voice.exit_code == 0 and not VOICE & {c["name"] for c in json.loads(no_voice.output)["checks"]}
    # Impossible limits fail the TTFT and peak checks, and the command exits 1 with the table.
    bad = runner.invoke(cli, ["smoke", "--url", server.url, "--max-ttft", "0.000001", "--max-peak", "1KiB"])
    assert bad.exit_code == 1
    assert "text: ttft" in bad.output and "FAIL" in bad.output and "FAILED:" in bad.output
    rows = {line.split("  ")[0]: line for line in bad.output.splitlines()}
    assert "FAIL" in rows["text: peak memory"] and "limit 1.00 KiB" in rows["text: peak memory"]
    assert "FAIL" in rows["speech: ttft"]


def test_smoke_with_an_api_key(engine, quantized_dir, tmp_path):
    from orin.serve.app import ServeConfig, Server

    key = tmp_path / "key"
    key.write_text("k-123\n")
    key.chmod(0o600)
    srv = Server(ServeConfig(EngineConfig(model_dir=quantized_dir, device="cpu", power_backend="none"), port=0,
                             warmup=False, api_key_file=str(key), max_speech_seconds=SPEECH_S),
                 engine=engine).start()
    try:
        denied = run_smoke(SmokeConfig(url=srv.url, max_new_tokens=2))
        assert not denied.ok and any("HTTP 401" in c.detail for c in denied.checks)
        voice = {c.name: c for c in denied.checks if c.name in VOICE}
        assert all(c.status == FAIL for c in voice.values()) and "HTTP 401" in voice["audio/speech"].detail
        assert "API key" in voice["realtime"].detail or "1008" in voice["realtime"].detail, voice["realtime"].detail
        allowed = run_smoke(SmokeConfig(url=srv.url, max_new_tokens=4, api_key_file=str(key)))
        assert allowed.ok, render_table(allowed)
    finally:
        srv.stop()


# --------------------------------------------------------------------------- real hardware


@pytest.mark.device
def test_device_smoke(device_target):
    """The same checks on a Jetson (or any GPU box): `pytest -m device --device-url http://orin:8000` against an
    installed service, or `--device-model-dir DIR` in-process. Limits come from ORIN_OMNI_SMOKE_MAX_TTFT and
    ORIN_OMNI_SMOKE_MAX_PEAK when set."""
    import os

    from orin.units import parse_bytes

    max_ttft = os.environ.get("ORIN_OMNI_SMOKE_MAX_TTFT")
    max_peak = os.environ.get("ORIN_OMNI_SMOKE_MAX_PEAK")
    model_dir = device_target.get("model_dir")
    cfg = SmokeConfig(url=device_target.get("url"), engine=EngineConfig(model_dir=model_dir) if model_dir else None,
                      max_ttft=float(max_ttft) if max_ttft else None,
                      max_peak=parse_bytes(max_peak) if max_peak else None,
                      api_key_file=device_target.get("api_key_file"))
    result = run_smoke(cfg)
    print(render_table(result))
    assert result.ok, render_table(result)
