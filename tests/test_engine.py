"""The device runtime on the tiny quantized model (CPU): pipeline, streaming, time-slicing, refusals."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from click.testing import CliRunner
from module_oracle import hf_twin

from orin.cli import cli
from orin.contract import AudioChunk, Done, GenerationRequest, TextDelta
from orin.errors import BudgetError, ChecksumError, InputError
from orin.inputs.media import synth_image, synth_speechlike
from orin.runtime.engine import Engine, EngineConfig

SAMPLES_PER_FRAME = 1920  # 24 kHz / 12.5 frames per second


def _mm_messages(seconds: float = 3.0):
    return ({"role": "user", "content": [
        {"type": "image", "image": synth_image(224, seed=1)},
        {"type": "audio", "audio": synth_speechlike(seconds, seed=2)},
        {"type": "text", "text": "What do you see and hear?"},
    ]},)


def _collect(engine, req):
    events = list(engine.stream(req))
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    chunks = [e.samples for e in events if isinstance(e, AudioChunk)]
    report = next(e.report for e in events if isinstance(e, Done))
    return events, text, chunks, report


def test_text_only_loads_no_encoder_and_no_talker(quantized_dir):
    eng = Engine(EngineConfig(model_dir=quantized_dir, device="cpu", power_backend="none"))
    try:
        req = GenerationRequest(messages=({"role": "user", "content": "Hello there"},), max_new_tokens=6, speech=False)
        _, text, chunks, report = _collect(eng, req)
        assert chunks == []
        assert [s.component for s in report.swaps] == ["thinker_text"]
        assert report.resident_after == ("thinker_text",)
        assert 1 <= report.completion_tokens <= 6
        assert text == report.text
        for key in ("ttft_s", "tokens_per_s", "peak_bytes", "swaps", "energy"):
            assert key in report.to_json()
        assert report.energy.backend == "none" and report.energy.joules is None
    finally:
        eng.close()


def test_image_audio_text_with_speech(engine):
    req = GenerationRequest(messages=_mm_messages(), max_new_tokens=10, max_audio_frames=20)
    events, text, chunks, report = _collect(engine, req)
    assert report.talker_frames > 0 and chunks
    audio = np.concatenate(chunks)
    assert audio.dtype == np.float32 and np.isfinite(audio).all() and np.abs(audio).max() <= 1.0
    # Causal code2wav trims a little at each chunk edge; never more than a frame per chunk.
    frames = report.talker_frames
    assert frames * SAMPLES_PER_FRAME - len(chunks) * SAMPLES_PER_FRAME <= audio.size <= frames * SAMPLES_PER_FRAME
    assert report.audio_seconds == pytest.approx(audio.size / 24000)
    # The first audio packet is out before the last text token: speech streams.
    kinds = [type(e).__name__ for e in events]
    assert kinds.index("AudioChunk") < max(i for i, k in enumerate(kinds) if k == "TextDelta") or \
        report.completion_tokens < 8
    assert report.streaming_speech is True
    assert 0 < report.ttft_s <= report.first_audio_s <= report.total_s
    # where the time to the first outputs went, in the order it happened
    timeline = report.timeline_s
    assert list(timeline) == sorted(timeline, key=timeline.get)
    assert {"prepared", "planned", "encoded", "prefilled", "first_token", "talker_prefilled",
            "first_audio"} <= set(timeline)
    assert timeline["first_token"] == pytest.approx(report.ttft_s, abs=1e-3)
    assert timeline["first_audio"] == pytest.approx(report.first_audio_s, abs=1e-3)
    # the named routes it took, each chosen once: the profile and MoE backend at start, the prefills' by their route
    from orin.runtime.prefill_route import PrefillRoute

    routes = report.routes
    assert routes["profile"] == engine.profile.name == "cpu" and routes["moe"] == "cpu"
    assert PrefillRoute(routes["prefill"]) and PrefillRoute(routes["talker_prefill"])
    assert f"prefill_{routes['prefill']}" in timeline and report.to_json()["routes"] == dict(routes)


def test_first_audio_waits_for_no_second_thinker_token(engine, monkeypatch):
    """Frame 0 is the prefill's first code and the code predictor's residuals, which read no text: its audio goes
    out before the thinker decodes its second token (it waited for that token, a talker step and a sync)."""
    from orin.runtime.decode import StaticDecoder

    steps = []
    real = StaticDecoder.step
    monkeypatch.setattr(StaticDecoder, "step", lambda self, token: steps.append(token) or real(self, token))
    req = GenerationRequest(messages=_mm_messages(), max_new_tokens=6, max_audio_frames=8, ignore_eos=True)
    at_audio = [len(steps) for e in engine.stream(req) if isinstance(e, AudioChunk)]
    assert at_audio and at_audio[0] == 0
    # and the thinker's steps went on: the speech came with the text, not after it
    assert len(steps) == 5 and at_audio[1] <= 2


def test_streamed_equals_non_streamed(engine):
    base = dict(messages=_mm_messages(), max_new_tokens=12, max_audio_frames=24)
    _, text_s, chunks_s, rep_s = _collect(engine, GenerationRequest(stream_speech=True, **base))
    _, text_n, chunks_n, rep_n = _collect(engine, GenerationRequest(stream_speech=False, **base))
    assert rep_s.streaming_speech and not rep_n.streaming_speech
    assert rep_s.token_ids == rep_n.token_ids and text_s == text_n
    assert rep_s.talker_frames == rep_n.talker_frames
    assert np.array_equal(np.concatenate(chunks_s), np.concatenate(chunks_n))
    # Streaming starts the audio earlier in the token stream than speaking after the text.
    assert rep_s.first_audio_s is not None


def test_engine_matches_hf_generate(engine):
    """The engine's pipeline against transformers' own generate() on the same (INT4) weights, greedy."""
    import torch

    req = GenerationRequest(messages=_mm_messages(), max_new_tokens=8, max_audio_frames=400, ignore_eos=False)
    events, _, chunks, report = _collect(engine, req)
    # Every component is resident now; run the reference pipeline on the very same modules.
    prompt = engine.prepare(req)
    inputs = {k: (v.to(engine.dtype) if torch.is_floating_point(v) else v) for k, v in prompt.inputs.items()}
    model = hf_twin(engine.model, engine.cfg.model_dir)
    with torch.inference_mode():
        seq, wav = model.generate(
            **inputs, return_audio=True, speaker="ethan", thinker_max_new_tokens=8, thinker_do_sample=False,
            talker_do_sample=False, talker_max_new_tokens=report.talker_frames + 1,
            thinker_eos_token_id=engine.config.im_end_token_id,
        )
    n = prompt.input_ids.shape[1]
    assert tuple(seq[0, n:].tolist()) == report.token_ids
    frames = [f for e in events if isinstance(e, AudioChunk) for f in e.frames]
    assert len(frames) == report.talker_frames
    codes = torch.tensor(frames).T.unsqueeze(0)
    ours = engine.model.code2wav.chunked_decode(codes, chunk_size=300, left_context_size=25).reshape(-1)
    ref = wav.reshape(-1)
    k = min(ours.numel(), ref.numel())
    assert k > 0
    assert torch.allclose(ours[:k].float(), ref[:k].float(), atol=1e-4)


def test_time_sliced_small_budget_equals_all_resident(quantized_dir, engine):
    base = dict(messages=_mm_messages(), max_new_tokens=10, max_audio_frames=20)
    _, text_a, chunks_a, rep_a = _collect(engine, GenerationRequest(**base))
    largest = max(engine.sizes.components[c].runtime_int4_bytes for c in engine.sizes.components)
    budget = int(largest * 1.6)
    small = Engine(EngineConfig(model_dir=quantized_dir, device="cpu", power_backend="none", budget=budget))
    try:
        _, text_b, chunks_b, rep_b = _collect(small, GenerationRequest(**base))
        outs = [s for s in rep_b.swaps if s.direction == "out"]
        assert outs, "a budget this small must swap components out"
        assert rep_b.peak_bytes <= budget
        assert rep_b.token_ids == rep_a.token_ids and text_b == text_a
        assert rep_b.talker_frames == rep_a.talker_frames
        assert np.array_equal(np.concatenate(chunks_a), np.concatenate(chunks_b))
        for swap in rep_b.swaps:
            assert swap.component and swap.direction in ("in", "out") and swap.seconds >= 0 and swap.bytes > 0
    finally:
        small.close()


def test_budget_below_largest_component_refused_before_loading(quantized_dir):
    eng = Engine(EngineConfig(model_dir=quantized_dir, device="cpu", power_backend="none", budget=64 * 1024))
    try:
        with pytest.raises(BudgetError, match="before loading anything"):
            list(eng.stream(GenerationRequest(messages=_mm_messages(), max_new_tokens=4)))
        assert eng.loader.resident() == ()
        assert eng.loader.swaps() == ()
    finally:
        eng.close()


def test_corrupt_checkpoint_refused_naming_file(quantized_dir, tmp_path):
    bad = tmp_path / "q"
    shutil.copytree(quantized_dir, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    victim = next(iter(manifest["segments"].values()))["files"][0]["path"]
    with open(bad / victim, "r+b") as fh:
        fh.seek(-64, 2)
        fh.write(b"\0" * 64)
    with pytest.raises(ChecksumError, match=victim.split("/")[-1]):
        Engine(EngineConfig(model_dir=str(bad), device="cpu", power_backend="none"))


def test_power_from_fake_ina3221_tree(quantized_dir, tmp_path):
    hw = tmp_path / "sys" / "bus" / "i2c" / "devices" / "1-0040" / "hwmon" / "hwmon3"
    hw.mkdir(parents=True)
    (hw.parent.parent / "name").write_text("ina3221\n")
    (hw / "name").write_text("ina3221\n")
    for i, (label, mv, ma) in enumerate([("VDD_GPU_SOC", 5000, 2000), ("VDD_CPU_CV", 5000, 1000),
                                         ("VIN_SYS_5V0", 5000, 800)], start=1):
        (hw / f"in{i}_label").write_text(label + "\n")
        (hw / f"in{i}_input").write_text(f"{mv}\n")
        (hw / f"curr{i}_input").write_text(f"{ma}\n")
    eng = Engine(EngineConfig(model_dir=quantized_dir, device="cpu", power_backend="ina3221",
                              sysfs_root=str(tmp_path / "sys")))
    try:
        _, _, _, report = _collect(eng, GenerationRequest(messages=({"role": "user", "content": "hi"},),
                                                          max_new_tokens=3, speech=False))
    finally:
        eng.close()
    energy = report.energy
    assert energy.backend == "ina3221" and energy.joules > 0
    assert energy.mean_w == pytest.approx(19.0, rel=0.05)
    assert "VDD_GPU_SOC" in energy.rails and "thinker_prefill" in energy.by_stage


def test_unknown_voice_and_empty_messages(engine):
    with pytest.raises(InputError, match="voice"):
        list(engine.stream(GenerationRequest(messages=_mm_messages(), voice="nobody")))
    with pytest.raises(InputError, match="empty"):
        list(engine.stream(GenerationRequest(messages=())))


def test_cancel_stops_the_request(engine):
    import threading

    cancel = threading.Event()
    events = []
    for event in engine.stream(GenerationRequest(messages=({"role": "user", "content": "go"},), max_new_tokens=50,
                                                 speech=False, ignore_eos=True), cancel):
        events.append(event)
        if isinstance(event, TextDelta) or len(events) == 1:
            cancel.set()
    report = events[-1].report
    assert report.cancelled is True and report.completion_tokens < 50


# ---------------------------------------------------------------- the CLI


def test_cli_generate_json_and_wav(quantized_dir, tmp_path):
    from orin.inputs.media import write_wav

    img = tmp_path / "cam.png"
    synth_image(64, seed=3).save(img)
    wav_in = tmp_path / "q.wav"
    write_wav(wav_in, synth_speechlike(2.0, sr=44100, seed=4), 44100)  # resampled to 16 kHz on the way in
    out_wav = tmp_path / "answer.wav"
    res = CliRunner().invoke(cli, ["generate", quantized_dir, "--text", "hi", "--image", str(img), "--audio",
                                   str(wav_in), "--out-wav", str(out_wav), "--max-new-tokens", "5",
                                   "--max-audio-frames", "12", "--device", "cpu", "--power-backend", "none", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.output[res.output.index("{"):])
    for key in ("text", "ttft_s", "first_audio_s", "tokens_per_s", "peak_bytes", "swaps", "energy"):
        assert key in report
    assert set(report["energy"]) >= {"backend", "joules", "by_stage"}
    import soundfile

    data, sr = soundfile.read(out_wav)
    assert sr == 24000 and len(data) > 0


@pytest.mark.parametrize("content, message", [
    (b"", "empty"),
    (b"this is not an image at all", "image"),
])
def test_cli_generate_bad_image(quantized_dir, tmp_path, content, message):
    bad = tmp_path / "bad.png"
    bad.write_bytes(content)
    res = CliRunner().invoke(cli, ["generate", quantized_dir, "--image", str(bad), "--text", "x", "--device", "cpu"])
    assert res.exit_code != 0
    assert "bad.png" in res.output and message in res.output.lower()


def test_cli_generate_bad_audio_and_budget(quantized_dir, tmp_path):
    runner = CliRunner()
    gif = tmp_path / "clip.gif"
    gif.write_bytes(b"GIF89a" + b"\0" * 64)
    res = runner.invoke(cli, ["generate", quantized_dir, "--audio", str(gif), "--text", "x", "--device", "cpu"])
    assert res.exit_code != 0 and "clip.gif" in res.output
    missing = runner.invoke(cli, ["generate", quantized_dir, "--audio", str(tmp_path / "none.wav"), "--device", "cpu"])
    assert missing.exit_code != 0 and "none.wav" in missing.output
    small = runner.invoke(cli, ["generate", quantized_dir, "--text", "x", "--budget", "64KiB", "--device", "cpu",
                                "--power-backend", "none"])
    assert small.exit_code == 1 and "budget" in small.output


def test_heap_frozen_after_each_growth_of_captures_and_released_on_close(quantized_dir):
    """A long-lived engine freezes the heap whenever its captures grew (a warm-up, a new bucket, an idle
    capture), not only once: what later compiles leave stays out of the full collections too; close() makes it
    collectable again."""
    import gc

    from orin.runtime.heap import HeapSettler

    heap = HeapSettler()
    try:
        assert not heap.settle(0) and not heap.frozen and gc.get_freeze_count() == 0  # nothing captured yet
        assert heap.settle(2) and heap.frozen and gc.get_freeze_count() > 0
        assert not heap.settle(2)  # no new capture: no collection
        assert heap.settle(3) and heap.frozen_at == 3
    finally:
        heap.release()
    assert not heap.frozen and gc.get_freeze_count() == 0
    eng = Engine(EngineConfig(model_dir=quantized_dir, device="cpu", power_backend="none"))
    eng.heap.settle(1)
    eng.close()
    assert not eng.heap.frozen and gc.get_freeze_count() == 0


def test_prefetch_counts_the_prefetches_it_has_queued(quantized_dir):
    """Two next components that each fit beside the stage but not together: only the first is prefetched (a
    queued prefetch lands later, so the budget check must count it itself: on the H200 the 18 GiB run went over
    its budget by prefetching code_predictor and code2wav together)."""
    from orin.memory.residency import StageCall

    eng = Engine(EngineConfig(model_dir=quantized_dir, device="cpu", power_backend="none", budget=1 << 40))
    try:
        est = eng.loader.sizes()
        eng.loader.budget = est["thinker_text"] + est["code_predictor"] + est["code2wav"] - 1
        eng.loader.stage(StageCall(("thinker_text",), 0, next_comps=("code_predictor", "code2wav"),
                                   later=("code_predictor", "code2wav")))
        eng.loader.ensure("code_predictor")  # waits for the prefetch
        assert eng.loader.is_resident("code_predictor") and not eng.loader.is_resident("code2wav")
        assert "code2wav" not in eng.loader._pending
    finally:
        eng.close()


def test_engine_runs_with_transformers_unimportable(quantized_dir):
    """The whole request path (own processor, encoders, positions, decoders, code2wav) in a process where
    importing transformers fails, as on a JetPack 6 board."""
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "sys.modules['transformers'] = None  # any import of it raises ImportError\n"
        "from orin.runtime.engine import Engine, EngineConfig\n"
        "from orin.contract import GenerationRequest\n"
        "from orin.inputs.media import synth_image, synth_speechlike\n"
        f"e = Engine(EngineConfig(model_dir={str(quantized_dir)!r}, device='cpu', power_backend='none'))\n"
        "parts = [{'type': 'image', 'image': synth_image(64)}, {'type': 'audio', 'audio': synth_speechlike(0.5)},\n"
        "         {'type': 'text', 'text': 'hi'}]\n"
        "text, audio, report = e.generate(GenerationRequest(messages=({'role': 'user', 'content': parts},),\n"
        "                                 max_new_tokens=3, max_audio_frames=4, ignore_eos=True))\n"
        "print(report.completion_tokens, report.talker_frames, audio.size > 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["3", "4", "True"], out.stdout


def test_the_engine_attends_without_cudnn_and_gives_the_choice_back(engine):
    """While the engine serves a request SDPA may not pick cuDNN's attention, which plans every new shape on
    first sight (orin.attention_kernels); torch's own choice is back afterwards."""
    import torch

    seen: list[bool] = []
    layer = engine.model.thinker.model.audio_tower.layers[0]
    hook = layer.register_forward_pre_hook(lambda *_: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    try:
        assert torch.backends.cuda.cudnn_sdp_enabled()
        _collect(engine, GenerationRequest(messages=_mm_messages(1.0), max_new_tokens=2, speech=False))
    finally:
        hook.remove()
    assert seen and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()
