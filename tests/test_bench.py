"""orin-omni bench on CPU at tiny dimensions: the synthetic checkpoint, the static-cache decoder against the HF
step, and the whole benchmark through the CLI (engine all-resident and time-sliced, HF reference, JSON)."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture(scope="module")
def synthetic_dir(tmp_path_factory) -> str:
    from orin.synthetic import SyntheticConfig, write_synthetic_checkpoint

    out = tmp_path_factory.mktemp("synthetic") / "ckpt"
    write_synthetic_checkpoint(SyntheticConfig(config="tiny", out=str(out), device="cpu", seed=3))
    return str(out)


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
    from orin.gptq_format import decode_qzeros_v1, dequantize_gptq_v1, gptq_v1_geometry
    from orin.synthetic import random_experts_gptq

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
    from orin.synthetic import config_dict, synthetic_tokenizer, token_ids

    data = config_dict(real_config)
    tok = synthetic_tokenizer(data)
    ids = token_ids(data)
    assert ids["<|im_start|>"] == 151644 and ids["user"] == 872 and ids["<|audio_pad|>"] == 151675
    assert len(tok) == data["thinker_config"]["text_config"]["vocab_size"]
    enc = tok("<|im_start|>user\nhi<|im_end|>")["input_ids"]
    assert enc[:2] == [151644, 872] and enc[-1] == 151645 and len(enc) == 6 and max(enc[2:5]) < 256
    assert tok.decode(enc[2:5]) == "\nhi"
    assert tok.decode([151000]) == " t151000"


def test_static_decoder_matches_the_hf_step(synthetic_dir):
    """Same logits as the HF modules with a dynamic cache, over forced tokens (not argmax: a random tiny model
    falls into loops that would hide position errors)."""
    from transformers import DynamicCache

    from orin.checkpoint import Checkpoint
    from orin.fastdecode import ThinkerDecoder
    from orin.loader import Loader

    loader = Loader(Checkpoint.open(synthetic_dir, verify=False), torch.device("cpu"), torch.float32)
    loader.ensure("thinker_text")
    model = loader.model
    lm = model.thinker.model.language_model
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, 20), generator=gen)
    with torch.inference_mode():
        cache = DynamicCache(config=lm.config)
        model.thinker.model(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache, use_cache=True)
        dec = ThinkerDecoder(model, torch.device("cpu")).start(cache, 40)
        assert dec.max_len % 64 == 0 and dec.length == 20
        for token in torch.randint(0, 256, (12,), generator=gen).tolist():
            fast = dec.step(token)
            tok = torch.tensor([[token]])
            out = model.thinker.model(inputs_embeds=lm.embed_tokens(tok), past_key_values=cache, use_cache=True)
            ref = model.thinker.lm_head(out.last_hidden_state)[:, -1]
            assert float((fast - ref).norm() / ref.norm()) < 1e-5
    loader.close()


def _speech_request(tokens=10, frames=5):
    from orin.engine import GenerationRequest
    from orin.media import synth_image, synth_speechlike

    parts = [{"type": "image", "image": synth_image(224)}, {"type": "audio", "audio": synth_speechlike(1.0)},
             {"type": "text", "text": "Describe it all."}]
    return GenerationRequest(messages=({"role": "user", "content": parts},), max_new_tokens=tokens,
                             max_audio_frames=frames, ignore_eos=True)


def test_fast_talker_and_code_predictor_give_the_eager_frames(synthetic_dir):
    """decode="static" (orin.fastdecode for thinker, talker and code predictor) against the HF modules and
    generate(): same text tokens, same codec frames, same audio."""
    from orin.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model_dir=synthetic_dir, device="cpu", power_backend="none", verify_checksums=False))
    try:
        results = {}
        for mode in ("eager", "static"):
            engine.decode = mode
            _, audio, report = engine.generate(_speech_request())
            results[mode] = (report["token_ids"], [f.tolist() for f in engine.last_frames], audio)
        assert engine._fast("talker").length > 0  # the static talker really ran
        assert results["eager"][0] == results["static"][0]
        assert results["eager"][1] == results["static"][1] and len(results["static"][1]) == 5
        assert float(abs(results["eager"][2] - results["static"][2]).max()) < 1e-4
    finally:
        engine.close()


def test_fast_prefill_matches_the_hf_prefill(synthetic_dir):
    """orin.fastdecode's prefill (audio and image merged, deepstack on the first layers, M-RoPE) against the HF
    language model with a dynamic cache: last logits, the hidden states the talker reads, every layer's keys
    and values, and the decode steps that follow; unpadded and padded to a bucket as the CUDA graphs are."""
    from transformers import DynamicCache

    from orin.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model_dir=synthetic_dir, device="cpu", power_backend="none", verify_checksums=False))
    try:
        prompt = engine._prepare(_speech_request())
        for comp in ("audio_encoder", "vision_encoder", "thinker_text"):
            engine.loader.ensure(comp)
        inputs, ids = prompt.inputs, prompt.input_ids
        n, accept = int(ids.shape[1]), engine.config.talker_config.accept_hidden_layer
        thinker = engine.model.thinker
        gen = torch.Generator().manual_seed(1)
        forced = torch.randint(0, 256, (6,), generator=gen).tolist()
        with torch.inference_mode():
            audio = thinker.model.get_audio_features(inputs["input_features"], inputs["feature_attention_mask"],
                                                     return_dict=True).last_hidden_state
            image = thinker.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"],
                                                     return_dict=True)
            for bucket in (1, n + 5):
                engine.decode = "eager"
                merged = engine._thinker_inputs(inputs, ids, audio, image)
                cache, ref_states, ref_logits = engine._thinker_prefill(merged, inputs["attention_mask"], True, n + 8)
                assert isinstance(cache, DynamicCache) and set(ref_states) == {0, accept}
                embeds, positions, visual = engine._thinker_inputs(inputs, ids, audio, image)
                assert visual is not None and len(visual[1]) == 2  # deepstack into layers 0 and 1
                fast = engine._fast("thinker")
                engine.decode = "static"
                out = fast.prefill(embeds[0], positions, n + 8, record=(0, accept), visual=visual, bucket=bucket)
                assert fast.length == n and fast.max_len >= n + 8
                assert float((out.logits - ref_logits).norm() / ref_logits.norm()) < 1e-5
                for i in (0, accept):
                    assert out.states[i].shape == ref_states[i].shape
                    assert torch.allclose(out.states[i], ref_states[i], atol=1e-5, rtol=1e-4)
                for i, layer in enumerate(cache.layers):
                    assert torch.allclose(fast.k_cache[i][:, :, :n], layer.keys, atol=1e-5, rtol=1e-4)
                    assert torch.allclose(fast.v_cache[i][:, :, :n], layer.values, atol=1e-5, rtol=1e-4)
                for token in forced:
                    ours = fast.step(token)
                    ref = engine._thinker_step(token, cache)
                    assert float((ours - ref).norm() / ref.norm()) < 1e-5
    finally:
        engine.close()


def test_talker_gets_text_embeddings_after_the_thinker_is_swapped_out(synthetic_dir):
    from orin.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model_dir=synthetic_dir, device="cpu", power_backend="none", verify_checksums=False))
    try:
        engine.loader.ensure("thinker_text")
        ids = torch.tensor([[7, 42, engine.config.tts_pad_token_id]])
        with torch.inference_mode():
            want = engine._text_embeddings(ids).clone()
            engine._remember_embeddings([7, 42])
            engine.loader.evict("thinker_text")
            assert torch.equal(engine._text_embeddings(ids), want)
            from orin.errors import ModelError

            with pytest.raises(ModelError, match="no remembered embedding"):
                engine._text_embeddings(torch.tensor([[99]]))
    finally:
        engine.close()


def test_bench_cli_runs_every_side_and_writes_json(tmp_path):
    from click.testing import CliRunner

    from orin.cli import cli

    out = tmp_path / "bench.json"
    result = CliRunner().invoke(cli, [
        "bench", "--config", "tiny", "--synthetic", "--workdir", str(tmp_path / "w"), "--device", "cpu",
        "--audio-seconds", "1", "--text-tokens", "3", "--audio-frames", "2", "--budget-sliced", "9MiB",
        "--decode", "graph", "--power-backend", "none", "--json", str(out),
    ])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert data["errors"] == {}
    runs = data["runs"]
    assert set(runs) == {"orin_graph", "orin_time_sliced", "hf_bf16"}
    prompts = {r["prompt_tokens"] for r in runs.values()}
    assert len(prompts) == 1  # the same request on every side
    for run in runs.values():
        assert run["completion_tokens"] == 3 and run["talker_frames"] == 2
        assert run["ttft_s"] > 0 and run["first_audio_s"] >= run["ttft_s"]
        assert run["decode_tokens_per_s"] > 0 and run["weight_bytes"] > 0
    sliced = runs["orin_time_sliced"]
    assert sliced["swaps"] > 0 and 0 < sliced["peak_bytes"] <= 9 << 20
    assert not sliced["streaming_speech"] and runs["orin_graph"]["streaming_speech"]
    assert data["checkpoint"]["int4_payload_bytes"] > 0
    assert [t["target"] for t in data["targets"]][:2] == ["int4_weight_bytes", "peak_all_resident"]
    proj = data["orin_projection"]
    assert proj["thinker_tokens_per_s"] > 0 and proj["talker_frames_per_s"] > 0 and proj["ttft_s"] > 0
    assert "thinker decode tokens/s" in result.output and "target decode >= 150 tokens/s" in result.output


def test_bench_refuses_ambiguous_sources():
    from orin.bench import BenchConfig, run_bench
    from orin.errors import UsageError

    with pytest.raises(UsageError, match="either --synthetic"):
        run_bench(BenchConfig(config="tiny", synthetic=False))
    with pytest.raises(UsageError, match="needs --config"):
        run_bench(BenchConfig(synthetic=True))


def test_active_bytes_at_real_dimensions(real_config, tmp_path):
    """The Orin projection's byte counts: a thinker token reads attention, 8 of 128 experts and lm_head (~2.1 GB);
    a speech frame reads the talker once and the BF16 code predictor 15 times (more than a text token)."""
    import shutil

    from orin.bench import active_bytes, orin_projection
    from orin.modelcfg import load_config

    act = active_bytes(load_config(real_config))
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
    from orin.bench import _ttft_stats, evaluate_targets

    ours = {"decode_tokens_per_s": 200.0, **_ttft_stats(0.30, [0.10, 0.11, 0.12]), "ttft_s": 0.30}
    hf = {"decode_tokens_per_s": 15.0, **_ttft_stats(0.12, [0.125, 0.13, 0.12]), "ttft_s": 0.12}
    assert ours["ttft_median_s"] == pytest.approx(0.115) and ours["ttft_repeat_min_s"] == 0.10
    verdict = {t["target"]: t for t in evaluate_targets({"orin_graph": ours, "hf_bf16": hf})}
    assert verdict["ttft_vs_hf"]["met"] and verdict["ttft_vs_hf"]["value"] == pytest.approx(0.115 / 0.1225)
    slow = {**ours, **_ttft_stats(0.09, [0.14, 0.15, 0.13])}
    assert not {t["target"]: t for t in evaluate_targets({"orin_graph": slow, "hf_bf16": hf})}["ttft_vs_hf"]["met"]
