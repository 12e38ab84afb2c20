"""orin.inputs (orin-omni's own processor) against transformers' (quantize.hf_processor, the oracle) on the tiny
checkpoint: the same rendered prompt, the same ids, the same features and patches (to 1e-5), grids and masks."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from orin.errors import InputError, ModelError
from orin.inputs import Processor
from orin.inputs.placeholders import split_media

QWEN_LIKE_TEMPLATE = """\
{%- set ns = namespace(system=none, turns=0) -%}
{%- for message in messages if message.role == 'system' %}{% set ns.system = message.content %}{% endfor -%}
{% if ns.system is not none %}
<|im_start|>system
{{ ns.system if ns.system is string else ns.system | map(attribute='text') | join('') }}<|im_end|>
{% endif %}
{% for message in messages if message.role != 'system' %}
    {% set ns.turns = ns.turns + 1 %}
<|im_start|>{{ message.role }}
    {% if message.content is string %}
{{ message.content }}
    {%- else %}
        {% for part in message.content %}
            {% if part.type == 'text' %}
{{ part.text }}
            {%- elif part.type == 'image' %}
<|vision_start|><|image_pad|><|vision_end|>
            {%- elif part.type == 'audio' %}
<|audio_start|><|audio_pad|><|audio_end|>
            {%- else %}
{{ raise_exception('unknown part ' ~ part.type) }}
            {%- endif %}
        {% endfor %}
    {% endif %}
{% if message.role == 'assistant' %}{% generation %}{{ eos_token }}{% endgeneration %}{% else %}<|im_end|>{% endif %}

{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{{ {'turns': ns.turns, 'note': 'é <b>&'} | tojson }}
{% endif %}
"""


def _hf_processor(model_dir):
    from quantize.hf_processor import build_processor

    return build_processor(model_dir)


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return _hf_processor(tiny_model_dir)


@pytest.fixture(scope="module")
def mine(tiny_model_dir):
    return Processor.from_dir(tiny_model_dir)


def hf_inputs(hf_proc, model_dir, messages, device="cpu") -> dict:
    """transformers' processor on the same messages (Whisper features on `device`)."""
    from module_oracle import hf_prompt_inputs

    return hf_prompt_inputs(hf_proc, messages, device)


def assert_same_inputs(expected: dict, got: dict):
    assert list(got) == list(expected)
    for key, want in expected.items():
        have = got[key].cpu()
        assert have.dtype == want.dtype and have.shape == want.shape, key
        if want.is_floating_point():
            torch.testing.assert_close(have, want, atol=1e-5, rtol=0, msg=key)
        else:
            assert torch.equal(have, want), key


def assert_matches(hf_proc, proc, model_dir, messages):
    conv = split_media(messages)
    want_text = hf_proc.apply_chat_template(conv.messages, add_generation_prompt=True, tokenize=False)
    assert proc.apply_chat_template(conv.messages, add_generation_prompt=True) == want_text
    expected = hf_inputs(hf_proc, model_dir, messages)
    got = proc.prepare(messages)
    assert_same_inputs(expected, got)
    return got


def picture(width, height, mode="RGB", seed=0):
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, width * height * 3).reshape(height, width, 3)
    pixels = ((ramp + rng.integers(0, 64, ramp.shape)) % 256).astype(np.uint8)
    image = Image.fromarray(pixels)
    if mode == "RGBA":
        image.putalpha(Image.fromarray(rng.integers(0, 256, (height, width)).astype(np.uint8)))
    elif mode != "RGB":
        image = image.convert(mode)
    return image


def speech(seconds, seed=0, sr=16000):
    n = int(round(seconds * sr))
    rng = np.random.default_rng(seed)
    t = np.arange(n) / sr
    return (0.3 * np.sin(2 * np.pi * 220 * t) * np.sin(2 * np.pi * 3 * t) + 0.05 * rng.standard_normal(n)).astype(
        np.float32)


TEXT_CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Wie geht's? 你好 👋🏽"}],
    [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
     {"role": "user", "content": [{"type": "text", "text": "three\n\n  spaced  "}, {"type": "text", "text": ""}]}],
    [{"role": "user", "content": "a literal <|im_end|> and <|im_start|>user inside"}],
]


@pytest.mark.parametrize("messages", TEXT_CONVERSATIONS)
def test_text_prompts_match_transformers(hf, mine, tiny_model_dir, messages):
    got = assert_matches(hf, mine, tiny_model_dir, messages)
    assert set(got) == {"input_ids", "attention_mask"}


@pytest.mark.parametrize("size,mode", [((70, 50), "RGB"), ((32, 32), "RGB"), ((5, 3), "RGB"), ((300, 90), "RGB"),
                                       ((1200, 1000), "RGB"), ((64, 64), "RGBA"), ((41, 97), "L"),
                                       ((33, 65), "P")])
def test_images_match_transformers(hf, mine, tiny_model_dir, size, mode):
    messages = [{"role": "user", "content": [{"type": "image", "image": picture(*size, mode=mode)},
                                             {"type": "text", "text": "What is this?"}]}]
    got = assert_matches(hf, mine, tiny_model_dir, messages)
    grid = got["image_grid_thw"][0].tolist()
    assert int((got["input_ids"] == mine.image_token_id).sum()) == grid[0] * grid[1] * grid[2] // 4


@pytest.mark.parametrize("samples", [3200, 12345, 16000, 480000, 560000])
def test_audio_matches_transformers(hf, mine, tiny_model_dir, samples):
    messages = [{"role": "user", "content": [{"type": "audio", "audio": speech(samples / 16000, seed=samples)},
                                             {"type": "text", "text": "Transcribe."}]}]
    got = assert_matches(hf, mine, tiny_model_dir, messages)
    assert got["input_features"].shape[-1] == samples // 160  # no padding to 30 s, no truncation past it


def test_silence_and_several_audios_in_one_prompt(hf, mine, tiny_model_dir):
    messages = [{"role": "user", "content": [
        {"type": "audio", "audio": speech(2.5, seed=1)}, {"type": "text", "text": "and"},
        {"type": "audio", "audio": np.zeros(8000, dtype=np.float32)},
        {"type": "audio", "audio": speech(7.31, seed=2)}]}]
    got = assert_matches(hf, mine, tiny_model_dir, messages)
    assert got["feature_attention_mask"].sum(-1).tolist() == [250, 50, 731]


def test_audio_keys_digest_the_samples_in_the_features_order(mine):
    """Asked for, each audio's key (a digest of its samples, what the engine keeps its tokens under) in the order
    of the features; not asked for, the dict holds only the model's inputs."""
    from orin.inputs.audio_features import waveform_key

    a, b = speech(1.0, seed=1), speech(2.0, seed=2)
    messages = [{"role": "user", "content": [{"type": "audio", "audio": a}, {"type": "audio", "audio": b}]}]
    assert "audio_keys" not in mine.prepare(messages)
    got = mine.prepare(messages, audio_keys=True)
    keys, frames = got["audio_keys"], got["feature_attention_mask"].sum(-1).tolist()
    assert keys == (waveform_key(a, frames[0]), waveform_key(b, frames[1])) and keys[0] != keys[1]
    swapped = [{"role": "user", "content": [{"type": "audio", "audio": b}, {"type": "audio", "audio": a}]}]
    assert mine.prepare(swapped, audio_keys=True)["audio_keys"] == keys[::-1]
    assert waveform_key(a[:-1], frames[0]) != keys[0]
    # the longest audio of a batch may have a frame fewer than beside a longer one: its tokens differ, so its key
    c = speech(1.234, seed=3)  # not a whole number of hops
    beside = mine.prepare([{"role": "user", "content": [{"type": "audio", "audio": c}, {"type": "audio",
                                                                                         "audio": b}]}], audio_keys=True)
    alone = mine.prepare([{"role": "user", "content": [{"type": "audio", "audio": c}]}], audio_keys=True)
    assert alone["feature_attention_mask"].sum() == beside["feature_attention_mask"][0].sum() - 1
    assert alone["audio_keys"][0] != beside["audio_keys"][0]


def test_images_and_audio_over_several_turns(hf, mine, tiny_model_dir):
    messages = [
        {"role": "system", "content": "Describe what you see and hear."},
        {"role": "user", "content": [{"type": "image", "image": picture(120, 80, seed=3)},
                                     {"type": "audio", "audio": speech(1.7, seed=3)},
                                     {"type": "text", "text": "First."}]},
        {"role": "assistant", "content": "A ramp and a tone."},
        {"role": "user", "content": [{"type": "text", "text": "Now these:"},
                                     {"type": "image", "image": picture(40, 200, mode="RGBA", seed=4)},
                                     {"type": "audio", "audio": speech(31.2, seed=4)},
                                     {"type": "image", "image": picture(16, 16, seed=5)}]},
    ]
    got = assert_matches(hf, mine, tiny_model_dir, messages)
    assert got["image_grid_thw"].shape == (3, 3) and got["input_features"].shape[0] == 2


def test_decode_matches_transformers(hf, mine):
    texts = ["plain words", "ümlaut 你好 👋🏽", "<|im_start|>assistant\nhi<|im_end|>", "<|audio_pad|><|image_pad|> x"]
    for text in texts:
        ids = hf.tokenizer(text)["input_ids"]
        assert mine.tokenizer.encode(text) == ids
        for skip in (True, False):
            assert mine.tokenizer.decode(ids, skip_special_tokens=skip) == hf.tokenizer.decode(
                ids, skip_special_tokens=skip)
        # The detokenizer decodes growing prefixes: half a UTF-8 character must come out as HF's does.
        for end in range(len(ids) + 1):
            assert mine.decode(ids[:end]) == hf.tokenizer.decode(ids[:end], skip_special_tokens=True)
    assert mine.decode(torch.tensor(ids)) == mine.decode(ids)


def _copy_checkpoint(src, dst: Path, skip=()) -> Path:
    dst.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "processor_config.json", "orin_tiny.json"):
        if name not in skip:
            shutil.copy(Path(src) / name, dst / name)
    return dst


def _hf_from_values(model_dir: Path, values: dict, template: str):
    """transformers' processor built from the same flat preprocessor values (as the released checkpoints have)."""
    from transformers import PreTrainedTokenizerFast, WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from quantize.hf_processor import _processor_class

    image_keys = ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels", "image_mean",
                  "image_std")
    fe_keys = ("feature_size", "sampling_rate", "hop_length", "n_fft", "chunk_length", "padding_value", "dither")
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    return _processor_class()(Qwen2VLImageProcessorPil(**{k: values[k] for k in image_keys}),
                              WhisperFeatureExtractor(**{k: values[k] for k in fe_keys}), tokenizer,
                              chat_template=template)


def test_released_preprocessor_values_match_transformers(tiny_model_dir, tmp_path):
    """The flat preprocessor_config.json of the released checkpoints (mean/std 0.5, up to 12845056 pixels)."""
    from orin.inputs.checkpoint_files import QWEN3_OMNI_PREPROCESSOR

    model_dir = _copy_checkpoint(tiny_model_dir, tmp_path / "released", skip=("processor_config.json",))
    values = {**QWEN3_OMNI_PREPROCESSOR, "n_samples": 4800000, "nb_max_frames": 30000,
              "feature_extractor_type": "WhisperFeatureExtractor", "image_processor_type": "Qwen2VLImageProcessor"}
    (model_dir / "preprocessor_config.json").write_text(json.dumps(values))
    proc = Processor.from_dir(model_dir)
    assert proc.source == "preprocessor_config.json"
    assert proc.patcher.settings.max_pixels == 12845056 and proc.patcher.settings.image_mean == (0.5, 0.5, 0.5)
    hf_proc = _hf_from_values(model_dir, values, (model_dir / "chat_template.jinja").read_text())
    for image in (picture(1200, 1000, seed=7), picture(9, 700, seed=8)):
        messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                                 {"type": "audio", "audio": speech(3.3, seed=9)}]}]
        assert_matches(hf_proc, proc, model_dir, messages)
    big = proc.prepare([{"role": "user", "content": [{"type": "image", "image": picture(1200, 1000)}]}])
    assert big["image_grid_thw"][0].tolist() == [1, 62, 76]  # not shrunk to transformers' default 1003520 px


def test_chat_template_rendering_matches_transformers(tiny_model_dir, tmp_path):
    from quantize.hf_processor import make_processor

    model_dir = _copy_checkpoint(tiny_model_dir, tmp_path / "qwen_like")
    (model_dir / "chat_template.jinja").write_text(QWEN_LIKE_TEMPLATE)
    proc = Processor.from_dir(model_dir)
    hf_proc = make_processor(_hf_processor(tiny_model_dir).tokenizer, QWEN_LIKE_TEMPLATE)
    conversations = [
        [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
         {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}, {"type": "audio"}]},
         {"role": "assistant", "content": "Hello.", "reasoning_content": None},
         {"role": "user", "content": "again"}],
        [{"role": "user", "content": "no system"}],
    ]
    for conv in conversations:
        for gen in (True, False):
            want = hf_proc.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False)
            assert proc.apply_chat_template(conv, add_generation_prompt=gen) == want
    assert proc.apply_chat_template(conversations) == hf_proc.apply_chat_template(conversations, tokenize=False)
    with pytest.raises(InputError, match="unknown part video"):
        proc.apply_chat_template([{"role": "user", "content": [{"type": "video"}]}])


@pytest.mark.parametrize("home", ["chat_template.json", "tokenizer_config.json"])
def test_chat_template_from_its_other_homes(tiny_model_dir, tmp_path, home):
    from quantize.hf_processor import make_processor

    model_dir = _copy_checkpoint(tiny_model_dir, tmp_path / "other", skip=("chat_template.jinja",))
    data = json.loads((model_dir / home).read_text()) if (model_dir / home).exists() else {}
    data["chat_template"] = ([{"name": "default", "template": QWEN_LIKE_TEMPLATE}, {"name": "x", "template": "x"}]
                             if home == "tokenizer_config.json" else QWEN_LIKE_TEMPLATE)
    (model_dir / home).write_text(json.dumps(data))
    hf_proc = make_processor(_hf_processor(tiny_model_dir).tokenizer, QWEN_LIKE_TEMPLATE)
    got = Processor.from_dir(model_dir).apply_chat_template(TEXT_CONVERSATIONS[1], add_generation_prompt=True)
    assert got == hf_proc.apply_chat_template(TEXT_CONVERSATIONS[1], add_generation_prompt=True, tokenize=False)
    assert got.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")


def test_tokenizer_config_tokens_match_transformers(tiny_model_dir, tmp_path):
    """A bos token the backend lacks, an extra non-special token: added and used as HF does; add_bos_token is
    ignored beside tokenizer.json, as HF ignores it."""
    from transformers import PreTrainedTokenizerFast

    model_dir = _copy_checkpoint(tiny_model_dir, tmp_path / "tok")
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config.update(bos_token="<s>", add_bos_token=True, added_tokens_decoder={
        "400": {"content": "<think>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                "special": False}})
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    hf_tok = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    proc = Processor.from_dir(model_dir)
    assert proc.tokenizer.token_id("<think>") == 272 and proc.tokenizer.token_id("<s>") == 273
    assert proc.tokenizer.encode("<s>") == [273] and proc.tokenizer.special_tokens["bos_token"] == "<s>"
    for text in ("<think>a</think> b", "<s>x<|im_end|>", "plain"):
        ids = hf_tok(text)["input_ids"]
        assert proc.tokenizer.encode(text) == ids
        for skip in (True, False):
            assert proc.tokenizer.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids,
                                                                                         skip_special_tokens=skip)


def test_missing_files_name_themselves(tiny_model_dir, tmp_path):
    with pytest.raises(ModelError, match="tokenizer.json"):
        Processor.from_dir(_copy_checkpoint(tiny_model_dir, tmp_path / "a", skip=("tokenizer.json",)))
    with pytest.raises(ModelError, match="chat_template.jinja"):
        Processor.from_dir(_copy_checkpoint(tiny_model_dir, tmp_path / "b", skip=("chat_template.jinja",)))
    with pytest.raises(ModelError, match="not a directory"):
        Processor.from_dir(tmp_path / "absent")
    split = _copy_checkpoint(tiny_model_dir, tmp_path / "c")
    config = json.loads((split / "tokenizer_config.json").read_text())
    (split / "tokenizer_config.json").write_text(json.dumps({**config, "split_special_tokens": True}))
    with pytest.raises(ModelError, match="does not keep <\\|image_pad\\|> \\(image_token\\) whole"):
        Processor.from_dir(split)


def test_checkpoint_without_processor_file_uses_released_values(tiny_model_dir, tmp_path):
    from orin.inputs.audio_features import AudioSettings
    from orin.inputs.image_patches import ImageSettings

    model_dir = _copy_checkpoint(tiny_model_dir, tmp_path / "bare", skip=("processor_config.json",))
    proc = Processor.from_dir(model_dir)
    assert proc.source == "defaults"
    assert proc.patcher.settings == ImageSettings() and proc.log_mel.settings == AudioSettings()


def test_synthetic_checkpoint_text_matches_transformers(synthetic_dir):
    proc = Processor.from_dir(synthetic_dir)
    hf_proc = _hf_processor(synthetic_dir)
    for messages in TEXT_CONVERSATIONS:
        conv = split_media(messages)
        text = hf_proc.apply_chat_template(conv.messages, add_generation_prompt=True, tokenize=False)
        assert proc.apply_chat_template(conv.messages, add_generation_prompt=True) == text
        assert_same_inputs(dict(hf_proc(text=[text], return_tensors="pt", padding=True)), proc(text=[text]))


def test_placeholders_must_match_media(mine):
    text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
    with pytest.raises(InputError, match="1 image placeholder"):
        mine(text=[text], images=[picture(32, 32), picture(32, 32)])
    with pytest.raises(InputError, match="0 audio placeholder"):
        mine(text=[text], images=[picture(32, 32)], audio=[speech(1.0)])
    with pytest.raises(InputError, match="unsupported content part"):
        mine.prepare([{"role": "user", "content": [{"type": "film", "film": b""}]}])
    with pytest.raises(InputError, match="a video part needs a decoded clip"):
        mine.prepare([{"role": "user", "content": [{"type": "video", "video": b""}]}])
    with pytest.raises(InputError, match="0 video placeholder"):
        mine(text=[text], images=[picture(32, 32)], videos=[None])
    with pytest.raises(InputError, match="aspect ratio"):
        mine.prepare([{"role": "user", "content": [{"type": "image", "image": picture(1, 300)}]}])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_features_and_patches_on_cuda_match_transformers(hf, mine, tiny_model_dir):
    """On CUDA the features are transformers' own CUDA path's (cuFFT): equal to it, and within 2e-5 of the host's
    (an H200 run differed from the host by up to 1.25e-5 in 6 of 896000 values, transformers' CUDA path alike)."""
    messages = [{"role": "user", "content": [{"type": "image", "image": picture(300, 90)},
                                             {"type": "audio", "audio": speech(12.3)}]}]
    got = mine.prepare(messages, device="cuda")
    assert got["input_features"].is_cuda and got["pixel_values"].is_cuda
    assert_same_inputs(hf_inputs(hf, tiny_model_dir, messages, device="cuda"), got)
    on_host = hf_inputs(hf, tiny_model_dir, messages)["input_features"]
    torch.testing.assert_close(got["input_features"].cpu(), on_host, atol=2e-5, rtol=0)


def test_inputs_import_no_transformers(tiny_model_dir):
    """The device side runs without transformers: import every orin.inputs module and prepare a prompt with an
    image and audio, then look for transformers in sys.modules."""
    code = """if True:
        import importlib, pkgutil, sys
        import numpy as np
        from PIL import Image
        import orin.inputs
        for info in pkgutil.iter_modules(orin.inputs.__path__):
            importlib.import_module("orin.inputs." + info.name)
        proc = orin.inputs.Processor.from_dir(sys.argv[1])
        image = Image.fromarray(np.zeros((40, 60, 3), dtype=np.uint8))
        out = proc.prepare([{"role": "user", "content": [{"type": "image", "image": image},
                                                         {"type": "audio", "audio": np.ones(16000, np.float32)}]}])
        proc.decode(out["input_ids"][0])
        loaded = sorted(m for m in sys.modules if m == "transformers" or m.startswith("transformers."))
        print(loaded)
        sys.exit(1 if loaded else 0)
    """
    result = subprocess.run([sys.executable, "-c", code, tiny_model_dir], capture_output=True, text=True,
                            timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stdout + result.stderr
