"""The assumptions quantize makes about its pinned libraries: if GPTQModel or transformers move, these fail
first and say which assumption broke (quantize/adapters.py, quantize/gptq.py)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch

from orin.checkpoint.targets import QuantSpec, find_targets
from orin.errors import UsageError
from quantize import adapters as A
from quantize.gptq import GPTQSolver, import_gptq, output_error, rtn


def test_pinned_versions_are_installed():
    import transformers

    gptq_cls, _factory = import_gptq()  # raises if gptqmodel is not the pinned version
    assert transformers.__version__ == A.PINNED["transformers"]
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text().lower()
    assert f"gptqmodel=={A.PINNED['gptqmodel']}" in pyproject
    assert "auto-gptq" not in pyproject and "auto_gptq" not in pyproject


def test_gptqmodel_solver_api():
    """GPTQ(module, qcfg).add_batch(inp, out) / adopt_hessian_from / quantize() -> 8-tuple, as 7.6.0 has them."""
    gptq_cls, factory = import_gptq()
    assert list(inspect.signature(gptq_cls.add_batch).parameters)[:3] == ["self", "inp", "out"]
    assert hasattr(gptq_cls, "adopt_hessian_from") and hasattr(gptq_cls, "free")
    qcfg = factory(bits=4, group_size=32, sym=False, desc_act=False, act_group_aware=False, fallback=None,
                   offload_to_disk=False)
    linear = torch.nn.Linear(64, 16, bias=False)
    task = gptq_cls(linear, qcfg)
    task.quantizer.configure(perchannel=True)
    task.add_batch(torch.randn(40, 64), None)
    out = task.quantize()
    assert len(out) == 8
    q, scale, zero, g_idx = out[:4]
    assert q.shape == (16, 64) and scale.shape == (16, 2) and zero.shape == (16, 2)
    assert torch.equal(g_idx, torch.arange(64, dtype=torch.int32) // 32)


def test_gptq_beats_rtn_on_correlated_inputs_and_stores_odd_widths():
    gen = torch.Generator().manual_seed(0)
    solver = GPTQSolver(4, 64)
    for k in (128, 200):  # 200: solved padded to 256, stored as GPTQ tools do (25 qweight rows, a partial group)
        mix = torch.randn(k, k, generator=gen) * 0.2
        x, xh = torch.randn(800, k, generator=gen) @ mix, torch.randn(300, k, generator=gen) @ mix
        w = torch.randn(32, k, generator=gen) * 0.05
        task = solver.task(w)
        task.add(x)
        result = task.solve()
        packed = result.pack()
        assert packed["qweight"].shape == (-(-k // 8), 32) and packed["g_idx"].shape == (k,)
        gptq_err = output_error(xh, w, result.dequantize()).relative
        rtn_err = output_error(xh, w, rtn(w, 4, 64).dequantize()).relative
        assert gptq_err < 0.9 * rtn_err


def test_tiny_model_layout_matches_the_adapters(tiny_model_dir):
    """Every quantize target of every component (all options on) sits in a known stage; fused experts have the
    concatenated, untransposed, bias-free layout; each stack's first layer is where the adapters look."""
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from quantize.hf_config import load_config

    with torch.device("meta"):  # quantize runs transformers' modules: the adapters are checked against them
        model = Qwen3OmniMoeForConditionalGeneration(load_config(tiny_model_dir))
    spec = QuantSpec(quantize_audio_encoder=True, quantize_code_predictor=True, quantize_code2wav=True,
                     quantize_lm_head=True)
    targets = find_targets(model, spec)
    by_stack, tail = A.group_targets(targets)
    assert set(by_stack) == {s.component for s in A.STACKS}
    assert [t.path for t in tail] == [A.LM_HEAD]
    covered = 0
    for comp, layers in by_stack.items():
        stack = A.STACK_OF[comp]
        assert len(model.get_submodule(stack.layers)) == len(layers)
        for index, layer_targets in layers.items():
            stages = A.layer_stages(stack, index, layer_targets)
            covered += sum(len(s) for s in stages)
            for member in (m for s in stages for m in s if m.kind != "linear"):
                A.check_experts(model.get_submodule(member.path), member.path)
    experts_halves = sum(1 for t in targets if t.kind == "experts")  # each counted twice (gate_up, down)
    assert covered == len(targets) - len(tail) + experts_halves
    assert model.get_submodule(A.STACK_OF["thinker_text"].final_norm) is not None
    lm = model.get_submodule("thinker.model.language_model")
    assert "deepstack_visual_embeds" in inspect.signature(lm.forward).parameters
    assert hasattr(lm, "_deepstack_process")


def test_expert_slices_are_views_into_the_fused_tensors():
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as M

    from devtools.tiny import tiny_config_dict

    cfg = M.Qwen3OmniMoeConfig(**tiny_config_dict()).thinker_config.text_config
    experts = M.Qwen3OmniMoeThinkerTextExperts(cfg)
    torch.nn.init.normal_(experts.gate_up_proj)
    torch.nn.init.normal_(experts.down_proj)
    A.check_experts(experts, "experts")
    x = torch.randn(5, cfg.hidden_size)
    gate, up = A.expert_weight(experts, 3, "gate_proj"), A.expert_weight(experts, 3, "up_proj")
    hidden = A.expert_intermediate(experts, x, gate, up)
    expected = experts(x, torch.full((5, 1), 3), torch.ones(5, 1))
    assert torch.allclose(torch.nn.functional.linear(hidden, A.expert_weight(experts, 3, "down_proj")), expected,
                          atol=1e-5)
    A.set_expert_weight(experts, 3, "up_proj", torch.zeros_like(up))
    assert experts.gate_up_proj[3, cfg.moe_intermediate_size:].abs().sum() == 0


def test_group_size_checks(tiny_model_dir):
    from orin.memory.model_sizes import meta_model
    from orin.model.config import load_omni_config

    targets = find_targets(meta_model(load_omni_config(tiny_model_dir)), QuantSpec())
    A.check_group_size(targets, 128, 4)  # vision linear_fc2 (200 wide) is the designed padded exception
    A.check_group_size(targets, 32, 4)
    with pytest.raises(UsageError, match="--group-size 100 is not supported"):
        A.check_group_size(targets, 100, 4)
    with pytest.raises(UsageError, match="does not divide in_features 128 .*use --group-size 128"):
        A.check_group_size(targets, 256, 4)
    with pytest.raises(UsageError, match="--bits 8"):
        A.check_group_size(targets, 128, 8)


def test_real_model_layout_matches_the_adapters(real_config):
    """The real Qwen3-Omni-30B-A3B config on the meta device: every target of every component has a stage, the
    fused experts have the expected layout, and the group-size rules accept 128 and refuse 256 (the talker's
    expert down_proj is 384 wide)."""
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from quantize.hf_config import load_config

    with torch.device("meta"):
        model = Qwen3OmniMoeForConditionalGeneration(load_config(real_config))
    spec = QuantSpec(quantize_audio_encoder=True, quantize_code_predictor=True, quantize_code2wav=True)
    targets = find_targets(model, spec)
    by_stack, tail = A.group_targets(targets)
    assert {c: len(layers) for c, layers in by_stack.items()} == {
        "audio_encoder": 32, "vision_encoder": 27, "thinker_text": 48, "talker": 20, "code_predictor": 5,
        "code2wav": 8}
    assert tail == []
    for comp, layers in by_stack.items():
        for index, layer_targets in layers.items():
            A.layer_stages(A.STACK_OF[comp], index, layer_targets)
    for path in ("thinker.model.language_model.layers.47.mlp.experts", "talker.model.layers.19.mlp.experts"):
        A.check_experts(model.get_submodule(path), path)
    # The vision MLP's fc2 (4304 inputs: no group size divides it) stays BF16.
    assert not [t for t in targets if t.path.endswith("mlp.linear_fc2")]
    assert len([t for t in targets if t.component == "vision_encoder"]) == 27 * 3
    default = find_targets(model, QuantSpec())
    A.check_group_size(default, 128, 4)
    with pytest.raises(UsageError, match="in_features 384 of talker.model.layers.0.mlp.experts.0.down_proj"):
        A.check_group_size(default, 256, 4)
