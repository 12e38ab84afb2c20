"""The tiny random Qwen3-Omni: offline, deterministic, complete, and able to speak on CPU."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from devtools.tiny import build_tiny_model
from orin.checkpoint.targets import QuantSpec, find_targets
from orin.cli import cli
from orin.inputs.media import synth_image, synth_speechlike
from quantize.hf_processor import build_processor

FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
         "processor_config.json", "generation_config.json")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_cli_writes_a_complete_checkpoint(tiny_model_dir):
    for name in FILES:
        assert (Path(tiny_model_dir) / name).is_file(), name


def test_deterministic_per_seed(tiny_model_dir, tmp_path):
    runner = CliRunner()
    same = tmp_path / "same"
    other = tmp_path / "other"
    assert runner.invoke(cli, ["tiny-model", str(same), "--seed", "0"]).exit_code == 0
    assert runner.invoke(cli, ["tiny-model", str(other), "--seed", "1"]).exit_code == 0
    ref = Path(tiny_model_dir) / "model.safetensors"
    assert _sha(same / "model.safetensors") == _sha(ref)
    assert _sha(other / "model.safetensors") != _sha(ref)


def test_refuses_to_overwrite_without_force(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    res = CliRunner().invoke(cli, ["tiny-model", str(out)])
    assert res.exit_code == 2 and "--force" in res.output
    assert (out / "keep.txt").read_text() == "mine"


def test_every_sub_model_initialised():
    model = build_tiny_model(0)
    for name, param in model.named_parameters():
        assert torch.isfinite(param).all(), name
        if param.ndim >= 2:
            # transformers leaves the talker experts at ~1e-43 and routers at zero; ours are real draws
            assert param.abs().max() > 1e-3, f"{name} looks uninitialised"
    for name, module in model.named_modules():
        if name.endswith("mlp.gate") and hasattr(module, "weight"):
            assert module.weight.std() > 0.1, f"router {name} would route every token alike"


def test_shaped_for_group_128():
    targets = find_targets(build_tiny_model(0), QuantSpec())
    comps = {t.component for t in targets}
    assert comps == {"thinker_text", "vision_encoder", "talker"}
    for t in targets:
        for _, k, n, _ in t.linears():
            assert k % 128 == 0, (t.path, k)
            assert n % 8 == 0
    # Like the real 4304-wide one, the tiny vision fc2 has in_features no group size divides; it stays BF16.
    fc2 = build_tiny_model(0).get_submodule("thinker.model.visual.blocks.0.mlp.linear_fc2")
    assert fc2.in_features % 32 and not any(t.path.endswith("linear_fc2") for t in targets)


def test_generate_text_image_audio_with_speech(tiny_model_dir):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from quantize.hf_config import load_config

    config = load_config(tiny_model_dir)
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(tiny_model_dir, config=config,
                                                                 dtype=torch.float32).eval()
    processor = build_processor(tiny_model_dir)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "audio"},
                                             {"type": "text", "text": "What is this?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[synth_image(224, seed=0)], audio=[synth_speechlike(2.0, seed=0)],
                       return_tensors="pt", padding=True)
    assert int((inputs["input_ids"] == config.thinker_config.image_token_id).sum()) == 49
    with torch.inference_mode():
        seq, wav = model.generate(**inputs, return_audio=True, speaker="ethan", thinker_max_new_tokens=6,
                                  thinker_do_sample=False, talker_do_sample=False, talker_max_new_tokens=12,
                                  thinker_eos_token_id=config.im_end_token_id)
    assert seq.shape[1] > inputs["input_ids"].shape[1]
    samples = wav.reshape(-1).numpy()
    assert samples.size > 0 and np.isfinite(samples).all()


@pytest.mark.parametrize("speaker", ["Ethan", "chelsie", "AIDEN"])
def test_speakers_are_looked_up_lower_case(tiny_model_dir, speaker):
    from quantize.hf_config import load_config

    assert speaker.lower() in load_config(tiny_model_dir).talker_config.speaker_id
