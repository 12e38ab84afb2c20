"""orin-omni bench on CPU at tiny dimensions: the synthetic checkpoint, and the whole benchmark (engine
all-resident per compile setting and time-sliced, HF reference, JSON, table). The CUDA kernel checks are
tests/test_device_kernels.py's."""

from __future__ import annotations

import json

import pytest
import torch


def test_synthetic_checkpoint_is_a_verified_quantized_checkpoint(synthetic_dir):
    from orin.checkpoint import Checkpoint
    from orin.layout import QuantSpec, find_targets
    from orin.manifest import read_manifest
    from orin.plan import meta_model

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
    from orin.devtools.synthetic import random_experts_gptq
    from orin.gptq_format import decode_qzeros_v1, dequantize_gptq_v1, gptq_v1_geometry

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

    from orin.safetensors_stream import PlannedTensor, write_safetensors_stream

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
    from orin.devtools.synthetic import config_dict, synthetic_tokenizer, token_ids

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
    # two requests in a row: the first loads from nothing, the summarised one is the steady state
    assert sliced["first_request"]["swap_in_bytes"] > 0 and sliced["first_request"]["peak_bytes"] <= 9 << 20
    assert sliced["swap_in_bytes"] > 0 and sliced["swap_in_gb_s"] > 0 and sliced["swap_out_bytes"] > 0
    storage = data["storage_bandwidth"]
    assert storage["bytes"] > 0 and storage["warm_gb_s"] > 0
    assert "kernel_timings" not in data  # CUDA only
    assert data["checkpoint"]["int4_payload_bytes"] > 0
    assert [t["target"] for t in data["targets"]][:2] == ["int4_weight_bytes", "peak_all_resident"]
    proj = data["orin_projection"]
    assert proj["thinker_tokens_per_s"] > 0 and proj["talker_frames_per_s"] > 0 and proj["ttft_s"] > 0
    table = result.stdout  # the table; the progress log went to stderr
    assert "thinker decode tokens/s" in table and "target decode >= 150 tokens/s" in table
    assert table.index("(graph)") < table.index("(compiled)") < table.index("time-sliced")


def test_compile_settings_parse():
    from orin.devtools.bench import parse_compile
    from orin.errors import UsageError

    assert parse_compile("off,on") == (False, True) and parse_compile(" ON ") == (True,)
    for bad in ("", "graph", "on,on"):
        with pytest.raises(UsageError, match="--compile"):
            parse_compile(bad)


def test_bench_refuses_ambiguous_sources():
    from orin.devtools.bench import BenchConfig, run_bench
    from orin.errors import UsageError

    with pytest.raises(UsageError, match="either --synthetic"):
        run_bench(BenchConfig(config="tiny", synthetic=False))
    with pytest.raises(UsageError, match="needs --config"):
        run_bench(BenchConfig(synthetic=True))


def test_active_bytes_at_real_dimensions(real_config, tmp_path):
    """The Orin projection's byte counts: a thinker token reads attention, 8 of 128 experts and lm_head (~2.1 GB);
    a speech frame reads the talker once and the BF16 code predictor 15 times (more than a text token)."""
    import shutil

    from orin.devtools.bench_projection import active_bytes, orin_projection
    from orin.model_config import load_omni_config

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
    from orin.devtools.bench_report import evaluate_targets, ttft_stats

    ours = {"decode_tokens_per_s": 200.0, **ttft_stats(0.30, [0.10, 0.11, 0.12]), "ttft_s": 0.30}
    hf = {"decode_tokens_per_s": 15.0, **ttft_stats(0.12, [0.125, 0.13, 0.12]), "ttft_s": 0.12}
    assert ours["ttft_median_s"] == pytest.approx(0.115) and ours["ttft_repeat_min_s"] == 0.10
    verdict = {t["target"]: t for t in evaluate_targets({"orin_graph": ours, "hf_bf16": hf})}
    assert verdict["ttft_vs_hf"]["met"] and verdict["ttft_vs_hf"]["value"] == pytest.approx(0.115 / 0.1225)
    slow = {**ours, **ttft_stats(0.09, [0.14, 0.15, 0.13])}
    assert not {t["target"]: t for t in evaluate_targets({"orin_graph": slow, "hf_bf16": hf})}["ttft_vs_hf"]["met"]
