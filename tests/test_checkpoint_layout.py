"""The checkpoint's on-disk contract: hub names both ways, the quantization_config, and reading a GPTQ checkpoint
that another tool wrote (thinker quantized, everything else BF16, experts stored one weight per expert)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from module_oracle import hf_twin

from orin.checkpoint.files import quantization_config, segment_shards
from orin.checkpoint.hub_names import expert_part, to_hub, to_runtime, unfused_names

PAIRS = [
    ("thinker.model.language_model.layers.3.self_attn.q_proj.weight", "thinker.model.layers.3.self_attn.q_proj.weight"),
    ("thinker.model.language_model.embed_tokens.weight", "thinker.model.embed_tokens.weight"),
    ("thinker.model.language_model.norm.weight", "thinker.model.norm.weight"),
    ("thinker.model.visual.blocks.0.mlp.linear_fc2.weight", "thinker.visual.blocks.0.mlp.linear_fc2.weight"),
    ("thinker.model.audio_tower.layers.1.fc1.bias", "thinker.audio_tower.layers.1.fc1.bias"),
    ("thinker.lm_head.weight", "thinker.lm_head.weight"),
    ("talker.model.layers.0.mlp.experts.5.down_proj.qweight", "talker.model.layers.0.mlp.experts.5.down_proj.qweight"),
    ("code2wav.decoder.0.conv.weight", "code2wav.decoder.0.conv.weight"),
]


@pytest.mark.parametrize("runtime, hub", PAIRS)
def test_names_map_both_ways_and_are_idempotent(runtime, hub):
    assert to_hub(runtime) == hub and to_runtime(hub) == runtime
    assert to_hub(hub) == hub and to_runtime(runtime) == runtime


def test_the_tiny_checkpoint_on_disk_uses_exactly_the_hub_names(tiny_model_dir):
    """transformers 5.23's save_pretrained is the reference for the hub's names: every key it wrote maps to a
    parameter of the runtime model and back to itself."""
    from safetensors import safe_open

    from devtools.tiny import build_tiny_model

    runtime = dict(build_tiny_model(0).named_parameters())
    with safe_open(f"{tiny_model_dir}/model.safetensors", framework="pt") as f:
        keys = list(f.keys())
    fused_seen = set()
    for key in keys:
        name = to_runtime(key)
        part = expert_part(name)
        if part is not None:
            fused_seen.add(part.fused)
            assert part.fused in runtime
        else:
            assert name in runtime, key
            assert to_hub(name) == key
    assert fused_seen and all(unfused_names(f, 1)[0].startswith(to_hub(f.rsplit(".", 1)[0])) for f in fused_seen)


def test_quantization_config_lists_full_names_and_declares_bf16_parts():
    q = quantization_config(bits=4, group_size=128, sym=True, damp=0.05, quantizer="x",
                            quantized_linears=["thinker.model.language_model.layers.0.self_attn.q_proj",
                                               "thinker.model.language_model.layers.0.mlp.experts.7.up_proj",
                                               "thinker.model.visual.blocks.0.attn.qkv"],
                            all_experts_quantized=True, bf16_components=["audio_encoder", "code2wav"])
    entries = q["modules_in_block_to_quantize"][0]
    assert "thinker.model.layers.0.self_attn.q_proj" in entries  # hub name: vLLM maps it to its own prefix
    assert "thinker.model.language_model.layers.0.self_attn.q_proj" in entries  # transformers' own name
    assert "mlp.experts.7.up_proj" in entries and "thinker.visual.blocks.0.attn.qkv" in entries
    assert q["sym"] is True and q["desc_act"] is False and q["block_name_to_quantize"] == ""
    assert set(q["dynamic"]) == {r"-:.*audio_tower\..*", r"-:.*code2wav\..*", r"-:.*visual\.blocks\.\d+\.mlp\.linear_fc2"}
    assert segment_shards({"a": (), "b": ()}) == {"a": "model-00001-of-00002.safetensors",
                                                   "b": "model-00002-of-00002.safetensors"}


@pytest.fixture(scope="module")
def published_style_dir(tiny_model_dir, tmp_path_factory):
    """What another GPTQ tool publishes: the tiny model's own hub-named file with the thinker's attention and
    experts replaced by GPTQ v1 tensors (symmetric RTN), everything else BF16 with experts one weight per expert,
    config.json with a GPTQ quantization_config, no manifest."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from orin.checkpoint.gptq_format import quantize_rtn

    out = tmp_path_factory.mktemp("published") / "ckpt"
    shutil.copytree(tiny_model_dir, out)
    tensors, quantized = {}, []
    with safe_open(f"{tiny_model_dir}/model.safetensors", framework="pt") as f:
        for key in f.keys():
            t = f.get_tensor(key)
            is_target = key.startswith("thinker.model.layers.") and key.endswith("_proj.weight") and (
                ".self_attn." in key or ".mlp.experts." in key)
            if not is_target:
                tensors[key] = t
                continue
            module = key[: -len(".weight")]
            for name, v in quantize_rtn(t.float(), group_size=32, sym=True).items():
                tensors[f"{module}.{name}"] = v
            quantized.append(to_runtime(module))
    (out / "model.safetensors").unlink()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quantization_config(
        bits=4, group_size=32, sym=True, damp=0.01, quantized_linears=quantized, all_experts_quantized=False,
        bf16_components=[], quantizer="another-tool")
    (out / "config.json").write_text(json.dumps(config))
    return out, quantized


def test_a_published_gptq_checkpoint_loads_with_experts_fused_at_load_time(published_style_dir, caplog):
    from devtools.tiny import build_tiny_model
    from orin.checkpoint.gptq_format import dequantize_gptq_v1, quantize_rtn
    from orin.checkpoint.reader import Checkpoint
    from orin.memory.loader import Loader

    root, quantized = published_style_dir
    ckpt = Checkpoint.open(root)
    assert ckpt.foreign and ckpt.spec.group_size == 32 and ckpt.spec.sym
    assert ckpt.name == "qwen3-omni-int4"
    assert "no checksums" in caplog.text
    # Every per-expert quantized Linear belongs to its fused experts module; the talker's stay BF16.
    assert all(".talker." not in m for m in ckpt.quantized_modules)
    assert "thinker.model.language_model.layers.0.mlp.experts" in ckpt.quantized_modules
    loader = Loader(ckpt, torch.device("cpu"), torch.float32)
    for comp in ("thinker_text", "talker", "code2wav"):
        loader.ensure(comp)
    ref = {n: p.detach().to(torch.bfloat16).float() for n, p in build_tiny_model(0).named_parameters()}
    loaded = dict(loader.model.named_parameters())
    # The talker's BF16 experts, stored one weight per expert, are the fused tensors the model computes with.
    talker_experts = [n for n in ref if n.startswith("talker.model.") and n.endswith(("experts.gate_up_proj",
                                                                                     "experts.down_proj"))]
    assert talker_experts
    for name in talker_experts + ["talker.codec_head.weight", "thinker.model.language_model.embed_tokens.weight"]:
        assert torch.equal(loaded[name].float(), ref[name]), name
    # The thinker computes what its GPTQ tensors say: the same logits as the HF model whose quantized weights are
    # replaced by their dequantized values.
    oracle = build_tiny_model(0).to(torch.bfloat16).float().eval()
    params = dict(oracle.named_parameters())
    with torch.no_grad():
        for module in quantized:
            if ".mlp.experts." in module:
                experts, e, proj = module.rsplit(".", 2)
                fused = params[f"{experts}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"]
                rows = fused[int(e)] if proj == "down_proj" else fused[int(e)].chunk(2)[proj == "up_proj"]
            else:
                rows = params[f"{module}.weight"]
            rows.copy_(dequantize_gptq_v1(quantize_rtn(rows.clone(), group_size=32, sym=True), rows.shape[1]))
        ids = torch.tensor([[5, 17, 42, 99, 3, 250]])
        want = oracle.thinker(input_ids=ids).logits
        got = hf_twin(loader.model, root).thinker(input_ids=ids).logits
    # The runtime keeps each group's scale and zero as one bf16 pair (torch's int4pack layout): that rounding,
    # not a wrong weight, is the remaining difference.
    assert float((got - want).norm() / want.norm()) < 5e-3
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_directory_without_weights_or_gptq_config_is_refused_clearly(tiny_model_dir, tmp_path):
    from orin.checkpoint.reader import Checkpoint
    from orin.errors import ModelError

    with pytest.raises(ModelError, match="no GPTQ quantization_config.*orin-omni quantize"):
        Checkpoint.open(tiny_model_dir)
    empty = tmp_path / "empty"
    empty.mkdir()
    config = json.loads(open(f"{tiny_model_dir}/config.json").read())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (empty / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="no manifest.json, model.safetensors.index.json or model.safetensors"):
        Checkpoint.open(empty)
    act_order = tmp_path / "act"
    shutil.copytree(tiny_model_dir, act_order)
    config = json.loads((act_order / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True}
    (act_order / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="desc_act"):
        Checkpoint.open(act_order)
