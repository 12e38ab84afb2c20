"""orin-omni bench on CPU at tiny dimensions: the synthetic checkpoint, and the whole benchmark (engine
all-resident per compile setting and time-sliced, HF reference, JSON, table). The CUDA kernel checks are
tests/test_device_kernels.py's."""

from __future__ import annotations

import json

import pytest
import torch


def test_synthetic_checkpoint_is_a_verified_quantized_checkpoint(synthetic_dir):
    from orin.checkpoint.manifest import read_manifest
    from orin.checkpoint.reader import Checkpoint
    from orin.checkpoint.targets import QuantSpec, find_targets
    from orin.memory.model_sizes import meta_model

    ckpt = Checkpoint.open(synthetic_dir, verify=True)  # every file's size and sha256 against the manifest
    targets = find_targets(meta_model(ckpt.config), QuantSpec())
    assert ckpt.quantized_modules == {t.path for t in targets}
    manifest = read_manifest(synthetic_dir)
    assert manifest.complete and manifest.quant_spec() == QuantSpec()
    from safetensors import safe_open

    for seg in manifest.segments.values():
        path = f"{synthetic_dir}/{seg.files[0].path}"
        with safe_open(path, framework="pt") as f:
            payload = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())
        assert payload == seg.int4_bytes


def test_stacked_random_experts_are_valid_gptq():
    from devtools.synthetic import random_experts_gptq
    from orin.checkpoint.gptq_format import decode_qzeros_v1, dequantize_gptq_v1, gptq_v1_geometry

    gen = torch.Generator().manual_seed(0)
    s = random_experts_gptq(3, 256, 64, 128, generator=gen, device="cpu")
    for e in range(3):
        layer = {k: (v[e] if k != "g_idx" else v) for k, v in s.items()}
        assert gptq_v1_geometry(layer) == (256, 64, 2, 128)
        zeros = decode_qzeros_v1(layer["qzeros"])
        assert int(zeros.min()) >= 4 and int(zeros.max()) <= 11
        w = dequantize_gptq_v1(layer, 256)
        assert torch.isfinite(w).all() and 0.005 < float(w.abs().mean()) < 0.1
    assert not torch.equal(s["qweight"][0], s["qweight"][1])


def test_safetensors_stream_matches_the_plan_and_hash(tmp_path):
    import hashlib

    from safetensors import safe_open

    from orin.checkpoint.safetensors_stream import PlannedTensor, write_safetensors_stream

    tensors = {"a": torch.randn(3, 5).to(torch.bfloat16), "b.qweight": torch.arange(12, dtype=torch.int32).view(3, 4),
               "c": torch.ones(7, dtype=torch.float16)}
    plan = [PlannedTensor(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    path = tmp_path / "x.safetensors"
    size, sha = write_safetensors_stream(path, plan, iter(tensors.items()), {"format": "pt"})
    assert size == path.stat().st_size and sha == hashlib.sha256(path.read_bytes()).hexdigest()
    with safe_open(str(path), framework="pt") as f:
        assert set(f.keys()) == set(tensors)
        for k, v in tensors.items():
            assert torch.equal(f.get_tensor(k), v)
    with pytest.raises(RuntimeError, match="does not match"):
        write_safetensors_stream(tmp_path / "y.safetensors", plan, iter(list(tensors.items())[::-1]), {})


def test_synthetic_tokenizer_covers_the_real_vocabulary(real_config):
    from devtools.synthetic import config_dict, synthetic_tokenizer, token_ids

    data = config_dict(real_config)
    tok = synthetic_tokenizer(data)
    ids = token_ids(data)
    assert ids["<|im_start|>"] == 151644 and ids["user"] == 872 and ids["<|audio_pad|>"] == 151675
    assert len(tok) == data["thinker_config"]["text_config"]["vocab_size"]
    enc = tok("<|im_start|>user\nhi<|im_end|>")["input_ids"]
    assert enc[:2] == [151644, 872] and enc[-1] == 151645 and len(enc) == 6 and max(enc[2:5]) < 256
    assert tok.decode(enc[2:5]) == "\nhi"
    assert tok.decode([151000]) == " t151000"


def test_bench_runs_every_side_and_writes_json(tmp_path):
    """The whole benchmark at tiny dimensions on CPU: both all-resident compile settings (one engine each),
    time-sliced under a budget that forces swaps, the HF reference, the projection, the JSON and the table."""
    from click.testing import CliRunner

    from orin.cli import cli
    from orin.components import PIPELINE

    out = tmp_path / "bench.json"
    result = CliRunner().invoke(cli, [
        "bench", "--config", "tiny", "--synthetic", "--workdir", str(tmp_path / "w"), "--device", "cpu",
        "--audio-seconds", "1", "--text-tokens", "3", "--audio-frames", "2", "--budget-sliced", "9MiB",
        "--compile", "off,on", "--power-backend", "none", "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["errors"] == {}
    runs = data["runs"]
    assert set(runs) == {"orin_graph", "orin_compiled", "orin_time_sliced", "hf_bf16"}
    prompts = {r["prompt_tokens"] for r in runs.values()}
    assert len(prompts) == 1  # the same request on every side
    for run in runs.values():
        assert run["completion_tokens"] == 3 and run["talker_frames"] == 2
        assert run["ttft_s"] > 0 and run["first_audio_s"] >= run["ttft_s"]
        assert run["decode_tokens_per_s"] > 0 and run["weight_bytes"] > 0
    assert runs["orin_graph"]["decoders"]["thinker"]["compiled"] is False
    assert runs["orin_compiled"]["decoders"]["thinker"]["compiled"] is True
    loaded = data["all_resident"]
    assert set(loaded["resident_by_component"]) == set(PIPELINE)
    assert sum(loaded["resident_by_component"].values()) == loaded["resident_bytes"] == runs["orin_graph"]["weight_bytes"]
    sliced = runs["orin_time_sliced"]
    assert sliced["swaps"] > 0 and 0 < sliced["peak_bytes"] <= 9 << 20
    assert not sliced["streaming_speech"] and runs["orin_graph"]["streaming_speech"]
    # the observer's stage trace: every stage's components resident, the peak never above the request's
    assert sliced["stage_memory"] and all(set(s["stage"]) <= set(s["resident"]) for s in sliced["stage_memory"])
    assert max(s["peak_so_far"] for s in sliced["stage_memory"]) <= sliced["peak_bytes"]
    # requests in a row: the first loads from nothing, the summarised one is the steady state
    assert sliced["first_request"]["swap_in_bytes"] > 0 and sliced["first_request"]["peak_bytes"] <= 9 << 20
    assert sliced["second_request"]["swap_in_bytes"] > 0  # three in a row: the third is the one summarised
    assert set(sliced["steady_captures"]) == set(sliced["decoders"]) and min(sliced["steady_captures"].values()) >= 0
    assert sliced["swap_in_bytes"] > 0 and sliced["swap_in_gb_s"] > 0 and sliced["swap_out_bytes"] > 0
    storage = data["storage_bandwidth"]
    assert storage["bytes"] > 0 and storage["warm_gb_s"] > 0 and storage["warm_single_gb_s"] > 0
    fraction = sliced["storage_fraction"]
    assert fraction["warm_gb_s"] == max(storage["warm_gb_s"], storage["warm_single_gb_s"])
    assert fraction["swap_in_gb_s"] == pytest.approx(sliced["swap_in_gb_s"] / fraction["warm_gb_s"])
    assert "kernel_timings" not in data  # CUDA only
    assert data["checkpoint"]["int4_payload_bytes"] > 0
    assert [t["target"] for t in data["targets"]][:2] == ["int4_weight_bytes", "peak_all_resident"]
    proj = data["orin_projection"]
    assert proj["thinker_tokens_per_s"] > 0 and proj["talker_frames_per_s"] > 0 and proj["ttft_s"] > 0
    table = result.stdout  # the table; the progress log went to stderr
    assert "thinker decode tokens/s" in table and "target decode >= 150 tokens/s" in table
    assert table.index("(graph)") < table.index("(compiled)") < table.index("time-sliced")


def test_compile_settings_parse():
    from devtools.bench import parse_compile
    from orin.errors import UsageError

    assert parse_compile("off,on") == (False, True) and parse_compile(" ON ") == (True,)
    for bad in ("", "graph", "on,on"):
        with pytest.raises(UsageError, match="--compile"):
            parse_compile(bad)


def test_bench_refuses_ambiguous_sources():
    from devtools.bench import BenchConfig, run_bench
    from orin.errors import UsageError

    with pytest.raises(UsageError, match="either --synthetic"):
        run_bench(BenchConfig(config="tiny", synthetic=False))
    with pytest.raises(UsageError, match="needs --config"):
        run_bench(BenchConfig(synthetic=True))


def test_active_bytes_at_real_dimensions(real_config, tmp_path):
    """The Orin projection's byte counts: a thinker token reads attention, 8 of 128 experts and lm_head (~2.1 GB);
    a speech frame reads the talker once and the BF16 code predictor 15 times (more than a text token)."""
    import shutil

    from devtools.bench_projection import active_bytes, orin_projection
    from orin.model.config import load_omni_config

    act = active_bytes(load_omni_config(real_config))
    assert 2.0e9 < act["thinker_text"] < 2.2e9
    assert 1.2e8 < act["talker"] < 2.5e8
    assert act["code_predictor_per_frame"] > act["thinker_text"]
    shutil.copy(real_config, tmp_path / "config.json")
    proj = orin_projection(str(tmp_path), 467, 256, 100, {"stages_s": {"encode": 0.04, "thinker_prefill": 0.17},
                                                           "peak_bytes": 1})
    assert 50 < proj["thinker_tokens_per_s"] < 100
    assert proj["ttft_s"] == pytest.approx(0.04 * 2.5 + 0.17 * (132 * 1.98) / (16 * 1.3))
    assert proj["first_audio_s"] > proj["ttft_s"]


def test_ttft_target_compares_medians_of_all_samples():
    from devtools.bench_report import evaluate_targets, ttft_stats

    ours = {"decode_tokens_per_s": 200.0, **ttft_stats(0.30, [0.10, 0.11, 0.12]), "ttft_s": 0.30}
    hf = {"decode_tokens_per_s": 15.0, **ttft_stats(0.12, [0.125, 0.13, 0.12]), "ttft_s": 0.12}
    assert ours["ttft_median_s"] == pytest.approx(0.115) and ours["ttft_repeat_min_s"] == 0.10
    verdict = {t["target"]: t for t in evaluate_targets({"orin_graph": ours, "hf_bf16": hf})}
    assert verdict["ttft_vs_hf"]["met"] and verdict["ttft_vs_hf"]["value"] == pytest.approx(0.115 / 0.1225)
    slow = {**ours, **ttft_stats(0.09, [0.14, 0.15, 0.13])}
    assert not {t["target"]: t for t in evaluate_targets({"orin_graph": slow, "hf_bf16": hf})}["ttft_vs_hf"]["met"]


def test_bench_video_cases_on_both_sides(tmp_path):
    """The video cases (issue 16) at tiny dimensions on CPU, alone (--video-only): per sampling rate, one image +
    a clip with its soundtrack through orin-omni all-resident and the HF reference, the same prompt on both (its
    video tokens T/2 x (N/32)^2), the phases from the engine's timeline, the decode timing, the Orin projection,
    the JSON's "video" key and the table."""
    from click.testing import CliRunner

    from orin.cli import cli

    out = tmp_path / "bench.json"
    result = CliRunner().invoke(cli, [
        "bench", "--config", "tiny", "--synthetic", "--workdir", str(tmp_path / "w"), "--device", "cpu",
        "--text-tokens", "3", "--audio-frames", "2", "--compile", "off", "--power-backend", "none",
        "--video-seconds", "4", "--video-size", "64", "--video-fps", "2", "--video-fps", "1", "--video-only",
        "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["errors"] == {}
    assert data["runs"] == {} and "orin_projection" not in data  # no standard request ran
    video = data["video"]
    cases = video["cases"]
    assert set(cases) == {"video_2fps", "video_1fps"}
    for name, frames in (("video_2fps", 8), ("video_1fps", 4)):
        case = cases[name]
        assert case["frames"] == frames and case["frame_size"] == [64, 64] and case["soundtrack_s"] == 4.0
        expected = frames // 2 * (64 // 32) ** 2
        assert case["expected_video_tokens"] == expected
        ours, hf = case["orin"], case["hf_bf16"]
        for run in (ours, hf):
            assert run["video_tokens"] == expected and run["audio_tokens"] > 0 and run["image_tokens"] > 0
            assert run["prompt_tokens"] > expected + run["audio_tokens"] + run["image_tokens"]
            assert run["completion_tokens"] == 3 and run["talker_frames"] == 2
            assert 0 < run["encode_s"] < run["ttft_s"] <= run["first_audio_s"] <= run["total_s"]
            assert run["video_encode_s"] > 0 and run["prefill_s"] > 0
        assert {k: ours[k] for k in ("prompt_tokens", "audio_tokens", "image_tokens", "video_grids")} == \
               {k: hf[k] for k in ("prompt_tokens", "audio_tokens", "image_tokens", "video_grids")}
        assert ours["video_grids"] == [[frames // 2, 4, 4]]
        assert ours["peak_bytes"] > 0 and ours["talker_prefill_s"] > 0
        proj = video["orin_projection"][name]
        assert proj["ttft_s"] > proj["stages"]["encode"]["s"] > 0 and proj["first_audio_s"] > proj["ttft_s"]
        assert proj["video_decode_s"] > 0
    assert cases["video_2fps"]["orin"]["prompt_tokens"] > cases["video_1fps"]["orin"]["prompt_tokens"]
    decode = video["decode"]
    assert decode["frames"] == 8 and decode["frame_size"] == [64, 64] and decode["decode_s_per_video_s"] > 0
    assert decode["audio_samples"] > 0
    table = result.stdout
    assert "video_2fps (2 fps, 8 frames)" in table and "AGX Orin (projected)" in table
    assert "HF fp32" in table and "video decode (PyAV" in table and "target" not in table


def test_bench_realtime_case(tmp_path):
    """The Realtime API case (issue 17) at tiny dimensions on CPU, alone: a spoken question (espeak-ng) streamed
    in real time to the real server's WebSocket through the official client; per turn the VAD's silence window
    and the server's time to the first audio delta, then a barge-in that cancels the answer."""
    import soundfile as sf
    from click.testing import CliRunner
    from speech_kit import speak

    from orin.cli import cli

    question = tmp_path / "question.wav"
    sf.write(question, speak("Which tool fixes the wheel?"), 24_000)
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(cli, [
        "bench", "--config", "tiny", "--synthetic", "--workdir", str(tmp_path / "w"), "--device", "cpu",
        "--compile", "off", "--power-backend", "none", "--skip-hf", "--realtime-question", str(question),
        "--cases-only", "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["errors"] == {} and data["runs"] == {}
    rt = data["realtime"]
    assert 1.0 < rt["question_s"] < 3.0 and rt["silence_duration_ms"] == 500 and len(rt["turns"]) == 3
    for turn in rt["turns"]:
        # the VAD cannot declare the end of a turn before its 500 ms of silence were sent (in real time, less a
        # 32 ms window); the upper bound only catches a turn that never ended on the silence
        assert 0.45 < turn["vad_window_s"] < 3.0
        assert turn["server_s"] > 0 and turn["voice_to_voice_s"] == pytest.approx(
            turn["vad_window_s"] + turn["server_s"])
    # The tiny model on a CPU may finish its capped answer before the barge-in's speech is detected (the
    # cancel itself is tests/test_realtime.py's, held deterministically): the figures are there when it cancels.
    barge = rt["barge_in"]
    assert barge["status"] in ("cancelled", "incomplete", "completed")
    if barge["status"] == "cancelled":
        assert barge["to_done_s"] >= 0 and barge["server_interrupt_to_stop_s"] is not None
    assert "realtime (" in result.stdout and f"barge-in ({barge['status']})" in result.stdout


def test_video_options_are_checked():
    from devtools.bench import BenchConfig, run_bench
    from orin.errors import UsageError

    with pytest.raises(UsageError, match="multiple of 32"):
        run_bench(BenchConfig(config="tiny", synthetic=True, video_seconds=2, video_size=100))
    with pytest.raises(UsageError, match="needs a case to run"):
        run_bench(BenchConfig(config="tiny", synthetic=True, video_only=True))
    with pytest.raises(UsageError, match="each sampling rate once"):
        run_bench(BenchConfig(config="tiny", synthetic=True, video_seconds=2, video_fps=(2.0, 2.0)))


def test_video_case_at_real_dimensions(real_config, tmp_path):
    """The product's case (120 s at 2 fps, 448x448, one 224x224 image): 240 frames, 23,520 video tokens; the Orin
    projection's FLOPs (the vision encoder over 94,080 patches, the thinker over the whole prompt) and its two
    estimates of each compute-bound stage."""
    import shutil

    from devtools.bench_config import BenchConfig, make_video_cases
    from devtools.bench_projection import gpu_flops_ratio, video_flops, video_projection
    from orin.model.config import load_omni_config

    (case,) = make_video_cases(BenchConfig(video_seconds=120, video_fps=(2.0,)))
    info = case.describe()
    assert info["frames"] == 240 and info["sampled_fps"] == 2.0 and info["expected_video_tokens"] == 23520
    assert info["images"] == 1 and info["soundtrack_s"] == 120.0
    counts = {"prompt_tokens": 25200, "audio_tokens": 1560, "image_tokens": 49, "video_grids": [[120, 28, 28]]}
    flops = video_flops(load_omni_config(real_config), counts)
    assert flops["vision_patches"] == 120 * 28 * 28 + 49 * 4
    assert 5e13 < flops["vision"] < 3e14 and 1e14 < flops["thinker_prefill"] < 1e15
    assert flops["talker_prefill"] < flops["thinker_prefill"]
    ratio, _ = gpu_flops_ratio("NVIDIA H200")
    assert ratio == pytest.approx(989 / 42.5)
    assert gpu_flops_ratio(None)[0] == pytest.approx((132 * 1.98) / (16 * 1.3))
    shutil.copy(real_config, tmp_path / "config.json")
    measured = {**counts, "prepare_s": 0.1, "encode_s": 0.5, "prefill_s": 1.5, "talker_prefill_s": 0.2,
                "peak_bytes": 1}
    proj = video_projection(str(tmp_path), counts, 256, 100, measured, "NVIDIA H200", 0.01, 120)
    st = proj["stages"]
    assert st["thinker_prefill"]["s"] == max(st["thinker_prefill"]["flops_s"], 1.5 * ratio)
    assert proj["ttft_s"] == pytest.approx(0.1 * 2.5 + st["encode"]["s"] + st["thinker_prefill"]["s"])
    assert proj["video_decode_s"] == pytest.approx(0.01 * 2.5 * 120)
    # decode at a 25k-token context reads about as many KV bytes per token as weights: slower than the standard's
    assert proj["thinker_tokens_per_s"] < 40 and proj["kv_bytes"] > 2e9
