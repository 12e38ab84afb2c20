"""orin.model.positions against transformers' Qwen3-Omni M-RoPE positions (the oracle), on the tiny model's config:
the thinker's and the talker's position ids and rope deltas, exactly equal, for prompts the production processor
prepares (text, images, audio, several turns) and for videos laid out as HF's processor lays them out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from orin.audio_format import audio_token_count
from orin.errors import InputError
from orin.model.positions import mrope_positions, talker_spec, thinker_spec

TALKER_ASSISTANT_IDS = 9  # _get_talker_assistant_parts: 3 role tokens, 4 pads, bos, the first text token


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    """The HF model built from the tiny config on the meta device (positions need no weights), with the config
    fix-up the engine applies (orin.model.config_file)."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from quantize.hf_config import load_config

    config = load_config(tiny_model_dir)
    with torch.device("meta"):
        model = Qwen3OmniMoeForConditionalGeneration(config)
    return model


@pytest.fixture(scope="module")
def config_json(tiny_model_dir) -> dict:
    return json.loads((Path(tiny_model_dir) / "config.json").read_text())


@pytest.fixture(scope="module")
def processor(tiny_model_dir):
    from quantize.hf_processor import build_processor

    return build_processor(tiny_model_dir)


def prepare(processor, hf, messages):
    from module_oracle import hf_prompt_inputs

    return hf_prompt_inputs(processor, messages)


def hf_thinker(hf, ids, **media):
    tm = hf.thinker.model
    tm.rope_deltas = None
    pos = tm.compute_3d_position_ids(input_ids=ids, image_grid_thw=media.get("image_grid_thw"),
                                     video_grid_thw=media.get("video_grid_thw"), inputs_embeds=None,
                                     attention_mask=torch.ones_like(ids), past_key_values=None,
                                     use_audio_in_video=media.get("use_audio_in_video"),
                                     audio_feature_lengths=media.get("audio_lengths"),
                                     video_second_per_grid=media.get("video_second_per_grid"))
    return pos, tm.rope_deltas


def hf_talker(hf, ids, **media):
    talker = hf.talker
    talker.rope_deltas = None
    embeds = torch.zeros(1, ids.shape[1], 4)
    pos = talker.compute_3d_position_ids(embeds, talker_input_ids=ids, attention_mask=torch.ones_like(ids),
                                         past_key_values=None, image_grid_thw=media.get("image_grid_thw"),
                                         video_grid_thw=media.get("video_grid_thw"),
                                         use_audio_in_video=media.get("use_audio_in_video"),
                                         audio_feature_lengths=media.get("audio_lengths"),
                                         video_second_per_grid=media.get("video_second_per_grid"))
    return pos, talker.rope_deltas


def talker_ids(hf, ids):
    """The talker's input ids as orin/runtime/talker.py builds them: the user turns' tokens, then the assistant part's
    tts_pad ids."""
    cfg = hf.config
    seq_len = ids.shape[1]
    positions = torch.arange(seq_len).unsqueeze(0)
    im_start = torch.where(ids == cfg.im_start_token_id, positions, positions.new_full((), -1))
    prev = torch.cummax(im_start, dim=-1).values.clamp_min(0)
    roles = ids.gather(1, (prev + 1).clamp_max(seq_len - 1))
    user = ids[:, torch.nonzero((roles == cfg.user_token_id)[0]).flatten()]
    return torch.cat([user, torch.full((1, TALKER_ASSISTANT_IDS), cfg.tts_pad_token_id)], dim=1)


def media_of(inputs: dict) -> dict:
    fam = inputs.get("feature_attention_mask")
    return {"image_grid_thw": inputs.get("image_grid_thw"),
            "audio_lengths": fam.sum(dim=1) if fam is not None else None}


def assert_same(ours, theirs):
    (pos, delta), (hf_pos, hf_delta) = ours, theirs
    assert pos.shape == hf_pos.shape and pos.dtype == torch.float32
    assert torch.equal(pos, hf_pos.float()), (pos[:, 0], hf_pos[:, 0])
    assert delta.shape == (1, 1) and torch.equal(delta, hf_delta.float()), (delta, hf_delta)


def check_both(hf, config_json, ids, **media):
    """Thinker and talker positions of the prompt `ids` equal HF's."""
    ours = {k: v for k, v in media.items() if k != "use_audio_in_video"}
    thinker = mrope_positions(ids, thinker_spec(config_json), **ours)
    assert_same(thinker, hf_thinker(hf, ids, **media))
    t_ids = talker_ids(hf, ids)
    assert_same(mrope_positions(t_ids, talker_spec(config_json), **ours), hf_talker(hf, t_ids, **media))
    return thinker


def speech(seconds: float, seed: int = 0):
    from orin.inputs.media import synth_speechlike

    return synth_speechlike(seconds, seed=seed)


def image(size, seed: int = 0):
    from orin.inputs.media import synth_image

    return synth_image(size, seed=seed)


def user(*parts):
    content = []
    for part in parts:
        if isinstance(part, str):
            content.append({"type": "text", "text": part})
        elif hasattr(part, "size") and hasattr(part, "mode"):
            content.append({"type": "image", "image": part})
        else:
            content.append({"type": "audio", "audio": part})
    return {"role": "user", "content": content}


# ------------------------------------------------------------------------------------- prompts the engine prepares


def test_text_only(hf, config_json, processor):
    inputs = prepare(processor, hf, [{"role": "system", "content": "be brief"}, user("hello there")])
    pos, delta = check_both(hf, config_json, inputs["input_ids"], **media_of(inputs))
    assert torch.equal(pos[0, 0], torch.arange(inputs["input_ids"].shape[1]).float()) and float(delta) == 0


@pytest.mark.parametrize("size", [32, 100, (200, 64), (48, 160), 224])
def test_image_sizes(hf, config_json, processor, size):
    inputs = prepare(processor, hf, [user(image(size), "what is this?")])
    _, delta = check_both(hf, config_json, inputs["input_ids"], **media_of(inputs))
    assert float(delta) < 0  # the grid folds its tokens into fewer positions


def test_two_images_in_one_turn(hf, config_json, processor):
    inputs = prepare(processor, hf, [user("compare", image(64, 1), "with", image((120, 80), 2))])
    check_both(hf, config_json, inputs["input_ids"], **media_of(inputs))


@pytest.mark.parametrize("seconds", [0.3, 1.3, 2.0, 4.7])
def test_audio_lengths(hf, config_json, processor, seconds):
    inputs = prepare(processor, hf, [user(speech(seconds), "transcribe")])
    media = media_of(inputs)
    check_both(hf, config_json, inputs["input_ids"], **media)
    # HF lays audio out per token only on its media path, taken when any grid (here an empty one) is given.
    media["image_grid_thw"] = torch.zeros((0, 3), dtype=torch.long)
    check_both(hf, config_json, inputs["input_ids"], **media)


@pytest.mark.parametrize("order", ["image_first", "audio_first"])
def test_image_and_audio(hf, config_json, processor, order):
    parts = [image(100), speech(1.3)] if order == "image_first" else [speech(2.6), image((96, 160))]
    inputs = prepare(processor, hf, [user(*parts, "describe both")])
    check_both(hf, config_json, inputs["input_ids"], **media_of(inputs))


def test_two_user_turns_with_media(hf, config_json, processor):
    messages = [
        {"role": "system", "content": "you are helpful"},
        user(image(64), speech(0.9), "first"),
        {"role": "assistant", "content": "an answer"},
        user(speech(3.1, seed=1), "then", image((80, 144), 3)),
    ]
    inputs = prepare(processor, hf, messages)
    check_both(hf, config_json, inputs["input_ids"], **media_of(inputs))


def test_results_are_fresh_tensors(hf, config_json, processor):
    """The layout is cached; what a caller gets is its own copy."""
    inputs = prepare(processor, hf, [user(image(100), "what is this?")])
    media = media_of(inputs)
    pos, delta = mrope_positions(inputs["input_ids"], thinker_spec(config_json), **media)
    pos.add_(1000)
    delta.add_(1000)
    assert_same(mrope_positions(inputs["input_ids"], thinker_spec(config_json), **media),
                hf_thinker(hf, inputs["input_ids"], **media))


# ------------------------------------------------------------------------------------ videos (synthetic grids)


def video_text(processor, grid, spg, n_audio=None) -> str:
    """A video's tokens as HF's processor writes them: plain, or with its audio merged in by time."""
    import numpy as np
    from transformers import Qwen3OmniMoeProcessor

    grid = np.array(grid)
    if n_audio is None:
        return "<|vision_start|>" + "<|video_pad|>" * int(grid.prod() // 4) + "<|vision_end|>"
    fake = SimpleNamespace(audio_bos_token="<|audio_start|>", audio_eos_token="<|audio_end|>",
                           video_token="<|video_pad|>", audio_token="<|audio_pad|>",
                           video_processor=SimpleNamespace(merge_size=2))
    body = Qwen3OmniMoeProcessor.replace_video_with_audio_token(
        fake, {"video_grid_thw": grid[None], "video_second_per_grid": [spg]}, 0, {"num_audio_tokens": [n_audio]},
        0, position_id_per_seconds=13)
    return "<|vision_start|>" + body + "<|vision_end|>"


def video_prompt(processor, config_json, segments):
    """Token ids and media of a user turn of `segments`: ("video", grid, spg), ("video_audio", grid, spg,
    feature length), ("image", grid), ("audio", feature length) or text."""
    n_window = config_json["thinker_config"]["audio_config"]["n_window"]
    text, videos, spgs, images, audios = "<|im_start|>user\n", [], [], [], []
    for seg in segments:
        if isinstance(seg, str):
            text += seg
        elif seg[0] == "image":
            images.append(seg[1])
            text += "<|vision_start|>" + "<|image_pad|>" * (seg[1][0] * seg[1][1] * seg[1][2] // 4) + "<|vision_end|>"
        elif seg[0] == "audio":
            audios.append(seg[1])
            text += "<|audio_start|>" + "<|audio_pad|>" * audio_token_count(seg[1], n_window) + "<|audio_end|>"
        else:
            videos.append(seg[1])
            spgs.append(seg[2])
            n_audio = None
            if seg[0] == "video_audio":
                audios.append(seg[3])
                n_audio = audio_token_count(seg[3], n_window)
            text += video_text(processor, seg[1], seg[2], n_audio)
    text += "<|im_end|>\n<|im_start|>assistant\n"
    ids = torch.tensor([processor.tokenizer(text)["input_ids"]])
    media = {"image_grid_thw": torch.tensor(images) if images else None,
             "video_grid_thw": torch.tensor(videos) if videos else None,
             "video_second_per_grid": torch.tensor(spgs) if spgs else None,
             "audio_lengths": torch.tensor(audios) if audios else None}
    return ids, media


# 2 / 7 (7 fps): float32 times, as HF computes them, round differently from float64 ones.
@pytest.mark.parametrize("grid,spg", [([2, 4, 6], 1.0), ([3, 8, 4], 2.0), ([4, 4, 4], 2 / 3), ([1, 6, 2], 0.5),
                                      ([12, 2, 4], 2 / 7)])
def test_video(hf, config_json, processor, grid, spg):
    ids, media = video_prompt(processor, config_json, ["watch ", ("video", grid, spg), " now"])
    check_both(hf, config_json, ids, use_audio_in_video=False, **media)


@pytest.mark.parametrize("grid,spg,frames", [
    ([3, 4, 4], 1.0, 150),    # the audio outlasts the video: the audio's tail comes last
    ([6, 4, 6], 1.0, 90),     # the video outlasts the audio: a frame's grid comes last, its rows set what follows
    ([4, 8, 4], 2 / 3, 420),  # fractional times, audio beyond a full 100-frame chunk
    ([2, 2, 2], 0.5, 100),
    ([1, 40, 12], 1.0, 90),
    ([12, 4, 2], 0.1, 130),   # the audio's tail comes last but the grid's rows go higher: HF continues after the tail
])
def test_video_with_audio(hf, config_json, processor, grid, spg, frames):
    ids, media = video_prompt(processor, config_json, ["hear and see ", ("video_audio", grid, spg, frames), "."])
    check_both(hf, config_json, ids, use_audio_in_video=True, **media)


def test_videos_images_and_audio_together(hf, config_json, processor):
    ids, media = video_prompt(processor, config_json, [
        ("image", [1, 4, 6]), "a", ("video", [2, 4, 4], 1.0), ("audio", 230), "b", ("video", [3, 2, 6], 2 / 3)])
    check_both(hf, config_json, ids, use_audio_in_video=False, **media)
    ids, media = video_prompt(processor, config_json, [
        ("audio", 70), ("video_audio", [2, 4, 4], 1.0, 160), "x", ("image", [1, 6, 6]),
        ("video_audio", [3, 6, 2], 2 / 3, 310)])
    check_both(hf, config_json, ids, use_audio_in_video=True, **media)


# ---------------------------------------------------------------------------------------------- config and errors


def test_specs_read_what_hf_reads(real_config):
    from quantize.hf_config import load_config

    data = json.loads(Path(real_config).read_text())
    hf_cfg = load_config(real_config)
    for spec, part, merge in ((thinker_spec(data), hf_cfg.thinker_config,
                               hf_cfg.thinker_config.vision_config.spatial_merge_size),
                              (talker_spec(data), hf_cfg.talker_config, hf_cfg.talker_config.spatial_merge_size)):
        for key in ("image_token_id", "video_token_id", "audio_token_id", "vision_start_token_id",
                    "audio_start_token_id", "position_id_per_seconds"):
            assert getattr(spec, key) == getattr(part, key), key
        assert spec.spatial_merge_size == merge
        assert spec.n_window == hf_cfg.thinker_config.audio_config.n_window


def test_audio_token_count_matches_hf():
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    lengths = torch.arange(1, 3001)
    ours = torch.tensor([audio_token_count(int(n), 50) for n in lengths])
    assert torch.equal(ours, _get_feat_extract_output_lengths(lengths, 50))


def test_mismatched_media_is_an_input_error(hf, config_json, processor):
    inputs = prepare(processor, hf, [user(image(64), speech(1.0), "x")])
    media = media_of(inputs)
    spec = thinker_spec(config_json)
    with pytest.raises(InputError, match="image grids"):
        mrope_positions(inputs["input_ids"], spec, image_grid_thw=media["image_grid_thw"][:0],
                        audio_lengths=media["audio_lengths"])
    with pytest.raises(InputError, match="audio lengths"):
        mrope_positions(inputs["input_ids"], spec, image_grid_thw=media["image_grid_thw"])
    with pytest.raises(InputError, match="placeholder"):
        mrope_positions(inputs["input_ids"], spec, image_grid_thw=media["image_grid_thw"] * 2,
                        audio_lengths=media["audio_lengths"])
    with pytest.raises(InputError, match="one sequence"):
        mrope_positions(inputs["input_ids"].repeat(2, 1), spec, **media)


def test_imports_no_transformers(tiny_model_dir):
    code = (
        "import json, sys, torch\n"
        "from orin.model.positions import mrope_positions, thinker_spec\n"
        f"spec = thinker_spec(json.load(open({str(Path(tiny_model_dir) / 'config.json')!r})))\n"
        "ids = torch.tensor([[1, spec.vision_start_token_id] + [spec.image_token_id] * 4 + [2, 3]])\n"
        "pos, delta = mrope_positions(ids, spec, image_grid_thw=torch.tensor([[1, 4, 4]]))\n"
        "assert float(delta) == -2, delta\n"
        "assert 'transformers' not in sys.modules, 'orin.model.positions imported transformers'\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr
