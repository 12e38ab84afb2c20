"""orin-omni's own model tree and config reader (orin.model.omni, orin.model.config, orin.model.text) against
transformers' (the oracle): the same parameters under the same names and shapes, the same config values, the
same rotary tables, router and BF16 experts; and bad configs refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from orin.errors import ModelError
from orin.model.config import omni_config
from orin.model.omni import OmniModel


def _hf(data):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from quantize.hf_config import fix_config, new_config

    return Qwen3OmniMoeForConditionalGeneration(fix_config(new_config(data)))


@pytest.mark.parametrize("which", ["tiny", "real"])
def test_the_tree_has_transformers_names_and_shapes(which, real_config):
    pytest.importorskip("transformers", reason="transformers not installed (compat env): the HF oracle")
    from devtools.tiny import tiny_config_dict

    data = tiny_config_dict() if which == "tiny" else json.loads(open(real_config).read())
    with torch.device("meta"):
        own, hf = OmniModel(omni_config(data)), _hf(data)
    ours = {n: tuple(p.shape) for n, p in own.named_parameters()}
    assert ours == {n: tuple(p.shape) for n, p in hf.named_parameters()}
    if which == "real":
        assert sum(p.numel() for p in own.parameters()) == 35_259_818_545  # the released checkpoint's count


def test_config_values_are_transformers_values(real_config):
    pytest.importorskip("transformers", reason="transformers not installed (compat env): the HF oracle")
    from quantize.hf_config import load_config

    ours, theirs = omni_config(json.loads(open(real_config).read())), load_config(real_config)
    for section in ("thinker_config.text_config", "talker_config.text_config",
                    "talker_config.code_predictor_config"):
        a, b = ours, theirs
        for part in section.split("."):
            a, b = getattr(a, part), getattr(b, part)
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "head_dim", "rms_norm_eps", "hidden_act"):
            assert getattr(a, key) == getattr(b, key), (section, key)
        assert a.rope_theta == b.rope_parameters["rope_theta"]
    for key in ("num_experts", "num_experts_per_tok", "norm_topk_prob", "moe_intermediate_size"):
        assert getattr(ours.talker_config.text_config, key) == getattr(theirs.talker_config.text_config, key), key
    for key in ("accept_hidden_layer", "codec_eos_token_id", "codec_bos_id", "num_code_groups", "thinker_hidden_size"):
        assert getattr(ours.talker_config, key) == getattr(theirs.talker_config, key), key
    for key in ("im_start_token_id", "im_end_token_id", "tts_bos_token_id", "assistant_token_id"):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert dict(ours.talker_config.speaker_id) == {k.lower(): v for k, v in theirs.talker_config.speaker_id.items()}


def test_rotary_router_and_experts_compute_what_transformers_computes():
    pytest.importorskip("transformers", reason="transformers not installed (compat env): the HF oracle")
    from devtools.tiny import tiny_config_dict

    torch.manual_seed(0)
    own, hf = OmniModel(omni_config(tiny_config_dict())), _hf(tiny_config_dict())
    hf.load_state_dict(own.state_dict(), strict=False)
    pos = torch.tensor([[[0, 1, 2, 9, 9]], [[0, 1, 2, 4, 5]], [[0, 1, 2, 7, 3]]])
    x = torch.zeros(1, 5, 8)
    for ours, theirs in ((own.thinker.model.language_model, hf.thinker.model.language_model),
                         (own.talker.model, hf.talker.model)):
        for a, b in zip(ours.rotary_emb(x, pos), theirs.rotary_emb(x, pos), strict=True):
            assert torch.equal(a, b)
    mlp, ref = own.thinker.model.language_model.layers[0].mlp, hf.thinker.model.language_model.layers[0].mlp
    with torch.no_grad():
        for p in (mlp.gate.weight, mlp.experts.gate_up_proj, mlp.experts.down_proj):
            p.normal_(0, 0.2)
        hf.load_state_dict(own.state_dict(), strict=False)
        h = torch.randn(7, mlp.gate.weight.shape[1])
        w, idx = mlp.gate(h)
        _, ref_w, ref_idx = ref.gate(h)
        assert torch.equal(idx, ref_idx) and torch.allclose(w, ref_w)
        assert torch.allclose(mlp.experts(h, idx, w), ref.experts(h, ref_idx, ref_w), atol=1e-6)


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["thinker_config"]["text_config"].update(hidden_act="gelu"), "hidden_act is 'gelu'"),
    (lambda d: d["thinker_config"]["text_config"].update(num_key_value_heads=3), "not a multiple"),
    (lambda d: d["thinker_config"]["text_config"]["rope_parameters"].update(rope_type="yarn"), "rope_type 'yarn'"),
    (lambda d: d["thinker_config"]["text_config"]["rope_parameters"].update(mrope_section=[8, 8]), "mrope_section"),
    (lambda d: d["talker_config"]["text_config"].update(hidden_size=0), "hidden_size must be a positive"),
    (lambda d: d["thinker_config"].update(text_config=[1, 2]), "must be an object"),
])
def test_bad_configs_are_refused_naming_the_key(edit, message):
    from devtools.tiny import tiny_config_dict

    data = tiny_config_dict()
    edit(data)
    with pytest.raises(ModelError, match=message):
        OmniModel(omni_config(data))


def test_without_audio_output_there_is_no_talker():
    from devtools.tiny import tiny_config_dict

    data = {**tiny_config_dict(), "enable_audio_output": False}
    with torch.device("meta"):
        model = OmniModel(omni_config(data))
    assert not hasattr(model, "talker") and not hasattr(model, "code2wav")
