"""`orin-omni plan`: numbers checked against hand arithmetic from the configs, and its bad-input errors."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from orin.checkpoint.targets import gptq_v1_bytes
from orin.cli import cli
from orin.memory.plan import PlanConfig, make_plan
from orin.memory.request_sizes import audio_tokens


def _thinker_text_params(t: dict) -> int:
    """Thinker text decoder parameters from its dimensions alone."""
    h, hd, q, kv, e, i, v = (t["hidden_size"], t["head_dim"], t["num_attention_heads"], t["num_key_value_heads"],
                             t["num_experts"], t["moe_intermediate_size"], t["vocab_size"])
    attn = h * q * hd * 2 + h * kv * hd * 2 + 2 * hd  # q,o + k,v + q_norm,k_norm
    experts = e * 3 * h * i
    layer = attn + experts + e * h + 2 * h  # + router + two RMSNorms
    return t["num_hidden_layers"] * layer + 2 * v * h + h  # + embed, lm_head, final norm


def _thinker_text_int4(t: dict, g: int) -> int:
    """INT4 file bytes of the thinker text decoder: GPTQ v1 attention and experts, the rest BF16."""
    h, hd, q, kv, e, i, v = (t["hidden_size"], t["head_dim"], t["num_attention_heads"], t["num_key_value_heads"],
                             t["num_experts"], t["moe_intermediate_size"], t["vocab_size"])
    quant = (gptq_v1_bytes(h, q * hd, g, False) * 1 + gptq_v1_bytes(h, kv * hd, g, False) * 2
             + gptq_v1_bytes(q * hd, h, g, False) + e * (2 * gptq_v1_bytes(h, i, g, False) + gptq_v1_bytes(i, h, g, False)))
    bf16 = (2 * hd + e * h + 2 * h) * 2
    return t["num_hidden_layers"] * (quant + bf16) + (2 * v * h + h) * 2


def test_real_config_total_and_thinker(real_config):
    cfg = json.load(open(real_config))
    result = make_plan(PlanConfig(model=real_config, device_profile="orin")).to_json()
    assert result["total_params"] == 35_259_818_545
    t = cfg["thinker_config"]["text_config"]
    thinker = result["components"]["thinker_text"]
    assert thinker["params"] == _thinker_text_params(t) == 30_532_646_912
    assert thinker["bf16_bytes"] == 2 * thinker["params"]
    assert thinker["int4_bytes"] == _thinker_text_int4(t, 128)
    # ~15.7 GiB: the published arithmetic for INT4 g128 thinker with BF16 embeddings/lm_head
    assert 15.6 < thinker["int4_bytes"] / 2**30 < 15.9
    segs = result["segments"]
    assert segs["thinker"]["components"] == ["audio_encoder", "thinker_text"]
    assert segs["thinker"]["params"] + segs["talker_vision"]["params"] == 35_259_818_545
    for seg in segs.values():
        assert set(seg) >= {"params", "bf16_bytes", "int4_bytes"}


def test_real_config_vision_fc2_stays_bf16(real_config):
    result = make_plan(PlanConfig(model=real_config, device_profile="orin")).to_json()
    assert result["padded_layers"] == []  # the 4304-wide fc2 is not quantized, so nothing is padded
    vis = result["components"]["vision_encoder"]
    fc2_bf16 = 27 * (4304 * 1152 + 1152) * 2
    assert fc2_bf16 < vis["int4_bytes"] < vis["bf16_bytes"] * 0.7


def test_real_request_tokens_and_kv(real_config):
    cfg = json.load(open(real_config))
    result = make_plan(PlanConfig(model=real_config, device_profile="orin")).to_json()
    req = result["request"]
    # 30 s audio -> 390 tokens, one 224x224 image -> 49, plus the chat template: 467 prompt tokens.
    assert req["tokens"]["audio"] == 390 == audio_tokens(30, 50)
    assert req["tokens"]["image"] == 49
    assert req["tokens"]["prompt"] == 467
    t = cfg["thinker_config"]["text_config"]
    per_token = t["num_hidden_layers"] * 2 * t["num_key_value_heads"] * t["head_dim"] * 2
    # the cache is given whole granules (orin.components.cache_positions): 1,024 positions for 723
    assert req["kv_by_component"]["thinker_text"] == per_token * 1024
    assert req["activation_bytes"] > 0
    assert result["fits"] == {"all_resident": True, "time_sliced": True, "streaming": True}
    assert result["peak_bytes"] <= 24 * 2**30


def test_verdicts_change_with_budget(real_config):
    sliced = make_plan(PlanConfig(model=real_config, device_profile="orin", budget=19 * 2**30)).to_json()
    assert sliced["fits"]["all_resident"] is False and sliced["fits"]["time_sliced"] is True
    assert sliced["peak_bytes"] <= 19 * 2**30
    assert [s["name"] for s in sliced["schedule"]][0] == "encode"
    # 17.5 GiB: the Orin's stages hold its 256 MiB of pinned staging buffers too (unified memory)
    sequential = make_plan(PlanConfig(model=real_config, device_profile="orin", budget=35 * 2**29)).to_json()
    assert sequential["fits"]["time_sliced"] is True and sequential["fits"]["streaming"] is False
    nofit = make_plan(PlanConfig(model=real_config, device_profile="orin", budget=8 * 2**30)).to_json()
    assert nofit["fits"] == {"all_resident": False, "time_sliced": False, "streaming": False}
    assert "thinker_text" in nofit["verdict"]
    text_only = make_plan(PlanConfig(model=real_config, device_profile="orin", audio_seconds=0, images=0,
                                     speech=False)).to_json()
    assert text_only["request"]["needed"] == ["thinker_text"]


def test_the_products_video_case_is_sized_as_the_long_prefill_runs_it(real_config):
    """120 s at 2 fps with its soundtrack, one image, speech: 25k prompt tokens that the thinker and the talker
    prefill one layer at a time (orin.runtime.decode), so neither decoder's working memory grows with the square of the
    prompt (the talker's was once sized at 19.5 GiB of attention scores it never makes)."""
    result = make_plan(PlanConfig(model=real_config, device_profile="orin", audio_seconds=0, video_seconds=120,
                                  video_fps=2)).to_json()
    req = result["request"]
    assert req["tokens"]["prompt"] > 25_000
    act = req["activation_by_component"]
    assert act["talker"] < 2**30 and act["thinker_text"] < 2 * 2**30


def test_tiny_model_plan(tiny_model_dir):
    cfg = json.load(open(f"{tiny_model_dir}/config.json"))
    result = make_plan(PlanConfig(model=tiny_model_dir, audio_seconds=3, budget=64 * 2**20)).to_json()
    t = cfg["thinker_config"]["text_config"]
    assert result["components"]["thinker_text"]["params"] == _thinker_text_params(t)
    assert result["components"]["thinker_text"]["int4_bytes"] == _thinker_text_int4(t, 128)
    # The tiny vision MLP's fc2 is 200 wide and stays BF16, like the real 4304-wide one.
    assert result["padded_layers"] == []
    assert result["request"]["tokens"]["audio"] == audio_tokens(3, 50) == 39
    from devtools.tiny import build_tiny_model

    model = build_tiny_model(0)
    assert result["total_params"] == sum(p.numel() for p in model.parameters())


def test_cli_plan_json_and_table(real_config):
    runner = CliRunner()
    res = runner.invoke(cli, ["plan", real_config, "--device-profile", "orin", "--json"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    for key in ("components", "segments", "request", "fits", "peak_bytes"):
        assert key in data
    assert set(data["request"]) >= {"tokens", "kv_bytes", "activation_bytes"}
    assert set(data["fits"]) >= {"all_resident", "time_sliced"}
    assert set(data) >= {"largest_allocation", "largest_request_allocation", "max_allocation_bytes", "allocations"}
    assert data["largest_allocation"] == max(data["allocations"], key=lambda a: a["bytes"])
    assert set(data["request"]) >= {"pinned_host_bytes", "pinned_host_in_budget"}
    table = runner.invoke(cli, ["plan", real_config, "--device-profile", "orin", "--budget", "18GiB", "--no-speech"])
    assert table.exit_code == 0, table.output
    assert "35,259,818,545" in table.output and "thinker text decoder" in table.output
    assert "largest single allocation: 594.00 MiB, the weight thinker.model.language_model.embed_tokens.weight" \
        in table.output and "(the ceiling 1.00 GiB)" in table.output
    assert "the request's own largest: 93.75 MiB, the audio encoder's convolution over 32 one-second chunks" \
        in table.output


def test_cli_segment_split(real_config):
    res = CliRunner().invoke(cli, ["plan", real_config, "--json", "--segments",
                                   "a=thinker_text;b=audio_encoder+vision_encoder;c=talker+code_predictor+code2wav"])
    assert res.exit_code == 0, res.output
    assert list(json.loads(res.output)["segments"]) == ["a", "b", "c"]


@pytest.mark.parametrize("budget", ["24GB", "24 GiB", "abc", "-1", "0"])
def test_bad_budget(real_config, budget):
    res = CliRunner().invoke(cli, ["plan", real_config, "--budget", budget])
    assert res.exit_code == 2
    assert "budget" in res.output.lower() and budget.strip() in res.output


@pytest.mark.parametrize("spec, word", [
    ("thinker=audio_encoder+thinker_text+warp_drive;talker_vision=vision_encoder+talker+code_predictor+code2wav",
     "warp_drive"),
    ("thinker=audio_encoder+thinker_text;talker_vision=vision_encoder+talker+code_predictor", "code2wav"),
    ("thinker=audio_encoder+thinker_text;x=thinker_text+vision_encoder+talker+code_predictor+code2wav", "both"),
])
def test_bad_segment_split(real_config, spec, word):
    res = CliRunner().invoke(cli, ["plan", real_config, "--segments", spec])
    assert res.exit_code == 2
    assert word in res.output


def test_bad_model_paths(tmp_path):
    runner = CliRunner()
    missing = runner.invoke(cli, ["plan", str(tmp_path / "nope")])
    assert missing.exit_code == 1 and "no such file" in missing.output
    other = tmp_path / "config.json"
    other.write_text(json.dumps({"model_type": "llama"}))
    res = runner.invoke(cli, ["plan", str(other)])
    assert res.exit_code == 1 and "llama" in res.output and "Qwen3-Omni" in res.output
    empty = tmp_path / "emptydir"
    empty.mkdir()
    res = runner.invoke(cli, ["plan", str(empty)])
    assert res.exit_code == 1 and "no config.json" in res.output
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    res = runner.invoke(cli, ["plan", str(bad)])
    assert res.exit_code == 1 and "JSON" in res.output


def test_bad_group_size(real_config):
    res = CliRunner().invoke(cli, ["plan", real_config, "--group-size", "100"])
    assert res.exit_code == 2 and "100" in res.output


@pytest.mark.parametrize("cuda, capability, tegra, want", [
    (False, None, False, "cpu"), (False, None, True, "orin"), (True, (8, 7), False, "orin"),
    (True, (9, 0), False, "hopper"), (True, (8, 6), False, "ampere"), (True, (8, 6), True, "orin"),
])
def test_auto_is_this_machines_kind_without_probing(monkeypatch, cuda, capability, tegra, want):
    import torch

    from orin.memory.plan import machine_profile, plan_profile

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert machine_profile(tegra=tegra).name == want
    monkeypatch.setattr("orin.device.capabilities.is_tegra", lambda root="/": tegra)
    assert plan_profile("auto").name == want and plan_profile("hopper").name == "hopper"


def test_the_demos_plan_uses_this_machines_arithmetic(tiny_model_dir, monkeypatch):
    """`make demo`'s own plan on a CPU machine: the CPU's arithmetic (no runtime margin, float32 as the engine
    computes there) fits the 64 MiB the demo serves at; planning for the board says it is the board's."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("orin.device.capabilities.is_tegra", lambda root="/": False)
    args = ["plan", tiny_model_dir, "--budget", "64MiB", "--audio-seconds", "30"]
    here = CliRunner().invoke(cli, args)
    assert here.exit_code == 0, here.output
    first = here.output.splitlines()[1]
    assert first == "planned for device profile cpu (this machine's; --device-profile orin plans for the board)"
    assert "budget 64.00 MiB: fits all-resident" in here.output and "+ 0 B runtime margin" in here.output
    board = CliRunner().invoke(cli, [*args, "--device-profile", "orin"])
    assert board.output.splitlines()[1] == "planned for device profile orin (--device-profile)"
    assert "budget 64.00 MiB: does not fit" in board.output and "+ 768.00 MiB runtime margin" in board.output
    # float32 on the CPU: the BF16 parts' resident bytes are twice the board's.
    cpu = make_plan(PlanConfig(model=tiny_model_dir, device_profile="cpu")).sizes.components["audio_encoder"]
    orin = make_plan(PlanConfig(model=tiny_model_dir, device_profile="orin")).sizes.components["audio_encoder"]
    assert cpu.runtime_int4_bytes == 2 * orin.runtime_int4_bytes
