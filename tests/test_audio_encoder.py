"""orin.model.audio_encoder against transformers' Qwen3OmniMoeAudioEncoder (the oracle), reached the way the engine
reaches it today (Qwen3OmniMoeThinkerModel.get_audio_features): same state dict both ways, same tokens to 1e-5
in float32 on CPU for one audio and several, short, chunk-aligned, window-aligned, partial-tailed and 30 s long,
the plan cache keyed by lengths and layout, and the real config's tree on meta."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from module_oracle import assert_same_tree, checkpoint_state, random_state, real_meta_trees

from orin.audio_format import audio_token_count
from orin.errors import InputError
from orin.model.audio_encoder import AudioEncoder
from orin.model.config_file import read_config_dict
from quantize.hf_config import load_config

ATOL = 1e-5
PREFIX = "thinker.audio_tower."
MAX_FRAMES = 3000  # 30 s: the Whisper feature extractor's padded length, 100 frames a second
# short (under a chunk), exactly one chunk, a partial tail, exactly one attention window (8 chunks), one window
# and a bit, many chunks with a partial tail, and the 30 s maximum
LENGTHS = (7, 37, 100, 155, 800, 850, 2345, MAX_FRAMES)
BATCHES = ((37, 60), (37, MAX_FRAMES, 155), (100, 1, 800, 999))


def hf_encoder(config, attn: str):
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeAudioEncoder

    config._attn_implementation = attn
    return Qwen3OmniMoeAudioEncoder(config).eval()


def hf_features(hf, features: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """transformers' own get_audio_features (the padded batch and its mask, as orin/runtime/thinker.py calls it) on a
    stand-in thinker that holds only the audio tower, the one attribute that method reads."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerModel

    thinker = SimpleNamespace(audio_tower=hf, config=hf.config)
    return Qwen3OmniMoeThinkerModel.get_audio_features(thinker, features, mask, return_dict=True).last_hidden_state





def padded_batch(lengths, seed: int, frames: int = MAX_FRAMES) -> tuple[torch.Tensor, torch.Tensor]:
    """Features [batch, 128, frames] and their mask as the feature extractor gives them; the padding holds
    noise, not zeros, so reading it anywhere shows."""
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(len(lengths), 128, frames, generator=gen)
    mask = (torch.arange(frames)[None, :] < torch.tensor(lengths)[:, None]).long()
    return features, mask


@pytest.fixture(scope="module")
def config_data(tiny_model_dir) -> dict:
    return read_config_dict(tiny_model_dir)["thinker_config"]["audio_config"]


@pytest.fixture(scope="module")
def tiny_pair(tiny_model_dir, config_data):
    """(ours, hf_eager, hf_sdpa) for each weight set, all three loaded with the same tensors."""
    pairs = {}
    for weights in ("checkpoint", "random"):
        audio_config = load_config(tiny_model_dir).thinker_config.audio_config
        hf_eager, hf_sdpa = hf_encoder(audio_config, "eager"), hf_encoder(audio_config, "sdpa")
        ours = AudioEncoder(config_data).eval()
        state = checkpoint_state(tiny_model_dir, PREFIX) if weights == "checkpoint" else random_state(ours, 5, matrix_scale=1.0)
        for model in (hf_eager, hf_sdpa, ours):
            model.load_state_dict(state, strict=True)
        pairs[weights] = (ours, hf_eager, hf_sdpa)
    return pairs


def test_state_dicts_load_strictly_both_ways(tiny_model_dir, config_data):
    hf = hf_encoder(load_config(tiny_model_dir).thinker_config.audio_config, "sdpa")
    ours = AudioEncoder(config_data)
    ours.load_state_dict(checkpoint_state(tiny_model_dir, PREFIX), strict=True)
    hf.load_state_dict(ours.state_dict(), strict=True)
    ours.load_state_dict(random_state(hf, 3, matrix_scale=1.0), strict=True)
    hf.load_state_dict(ours.state_dict(), strict=True)
    assert list(ours.state_dict()) == list(hf.state_dict())
    for a, b in zip(ours.state_dict().values(), hf.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    hf_buffers = dict(hf.named_buffers())
    assert sorted(dict(ours.named_buffers())) == sorted(hf_buffers) == ["positional_embedding.positional_embedding"]
    for name, buf in ours.named_buffers():
        assert buf.dtype == hf_buffers[name].dtype and torch.equal(buf, hf_buffers[name]), name
    linears = {n for n, m in ours.named_modules() if isinstance(m, torch.nn.Linear)}
    assert linears == {n for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear)}
    assert "layers.1.self_attn.q_proj" in linears and "conv_out" in linears  # INT4 conversion finds them by path


@pytest.mark.parametrize("weights", ["checkpoint", "random"])
def test_forward_matches_transformers(tiny_pair, weights):
    ours, hf_eager, hf_sdpa = tiny_pair[weights]
    with torch.no_grad():
        for i, length in enumerate(LENGTHS):
            features, mask = padded_batch([length], seed=i)
            expected = hf_features(hf_sdpa, features, mask)
            torch.testing.assert_close(hf_features(hf_eager, features, mask), expected, atol=ATOL, rtol=0)
            assert expected.shape == (audio_token_count(length), 128), length
            got = ours(features, [length])
            torch.testing.assert_close(got, expected, atol=ATOL, rtol=0, msg=f"{length} frames")
            # the audio tower's own form: the frames alone, [128, length]
            torch.testing.assert_close(ours(features[0, :, :length], [length]), expected, atol=ATOL, rtol=0)
            assert expected.abs().mean() > 1000 * ATOL, length  # outputs far above the tolerance: a real comparison


@pytest.mark.parametrize("weights", ["checkpoint", "random"])
def test_several_audios_match_transformers(tiny_pair, weights):
    ours, _, hf = tiny_pair[weights]
    with torch.no_grad():
        for i, lengths in enumerate(BATCHES):
            features, mask = padded_batch(lengths, seed=10 + i)
            expected = hf_features(hf, features, mask)
            assert expected.shape[0] == sum(audio_token_count(n) for n in lengths)
            torch.testing.assert_close(ours(features, torch.tensor(lengths)), expected, atol=ATOL, rtol=0,
                                       msg=str(lengths))
            concatenated = torch.cat([f[:, :n] for f, n in zip(features, lengths, strict=True)], dim=1)
            torch.testing.assert_close(ours(concatenated, lengths), expected, atol=ATOL, rtol=0)


def test_convolutions_run_at_recurring_batch_sizes(tiny_pair, config_data):
    """The chunks go through the convolutions padded to a power of two, capped at conv_chunksize, so cuDNN
    plans a handful of shapes once instead of one per audio length (a Realtime turn's); no token changes."""
    ours = tiny_pair["random"][0]
    small = AudioEncoder({**config_data, "conv_chunksize": 5}).eval()
    small.load_state_dict(ours.state_dict(), strict=True)
    seen: dict[str, list[int]] = {"ours": [], "small": []}
    hooks = [m.conv2d1.register_forward_pre_hook(lambda _m, args, k=k: seen[k].append(args[0].shape[0]))
             for k, m in (("ours", ours), ("small", small))]
    try:
        with torch.no_grad():
            for n in (250, 550, 2345):  # 3, 6 and 24 chunks
                features, _ = padded_batch([n], seed=n)
                torch.testing.assert_close(small(features, [n]), ours(features, [n]), atol=ATOL, rtol=0)
    finally:
        for h in hooks:
            h.remove()
    assert seen["ours"] == [4, 8, 32]
    assert seen["small"] == [4, 5, 1, 5, 5, 5, 5, 4]  # parts of 5 chunks, the last padded to its own power of two


def test_padding_layout_is_transformers(tiny_pair):
    """A short audio's tokens depend on the width its chunk is padded to (a padded frame becomes gelu(bias)
    after a convolution): alone it is padded to its own length, beside a long audio to a whole chunk."""
    ours = tiny_pair["random"][0]
    features, _ = padded_batch([37, 400], seed=3)
    with torch.no_grad():
        alone = ours(features[:1], [37])
        beside = ours(features, [37, 400])[:audio_token_count(37)]
    assert not torch.allclose(alone, beside, atol=1e-3)


def test_plans_are_cached_per_lengths_and_layout(tiny_pair):
    ours, _, hf = tiny_pair["random"]
    ours._plans.clear()
    short, long = padded_batch([155], seed=20), padded_batch([2345], seed=21)
    with torch.no_grad():
        for _ in range(2):
            for features, mask in (short, long):
                length = int(mask.sum())
                torch.testing.assert_close(ours(features, [length]), hf_features(hf, features, mask),
                                           atol=ATOL, rtol=0, msg=f"{length} frames")
    assert len(ours._plans) == 2
    plan = ours.plan([2345], MAX_FRAMES)
    assert ours.plan([2345], MAX_FRAMES) is plan and ours.prepare([2345], MAX_FRAMES) is plan
    assert plan.output_lengths == (audio_token_count(2345),) and plan.tokens == 305
    # 24 chunks of 100 frames (the last 45), windows of 8 chunks * 13 tokens, the last one partial
    assert (plan.num_chunks, plan.chunk_frames, plan.chunk_tokens) == (24, 100, 13)
    assert plan.cu_seqlens.tolist() == [0, 104, 208, 305] and plan.key_mask is not None
    assert ours.plan([2345]) is not plan  # the same lengths laid out concatenated: another gather
    assert ours.plan([800], MAX_FRAMES).key_mask is None  # one whole window: nothing to mask
    for n in range(1, 40):
        ours.plan([n])
    assert len(ours._plans) <= 32 and ours.plan([2345], MAX_FRAMES) is not plan  # bounded: evicted oldest first


def test_audio_token_count_is_transformers():
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    lengths = torch.arange(1, MAX_FRAMES + 1)
    assert [audio_token_count(n) for n in lengths.tolist()] == _get_feat_extract_output_lengths(lengths).tolist()


def test_bad_inputs_are_refused(tiny_pair):
    ours = tiny_pair["random"][0]
    features, _ = padded_batch([50, 60], seed=0, frames=100)
    for args, match in (((features[:, :80], [50, 60]), r"\[batch, 128, frames\]"),
                        ((features, [50]), "2 audios"),
                        ((features, [50, 101]), "exceed"),
                        ((features, [50, 0]), "positive"),
                        ((features[0, :, :60], [50]), "sum to 50")):
        with pytest.raises(InputError, match=match):
            ours(*args)


def test_real_config_tree_on_meta(real_config):
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeAudioEncoder

    hf, skeleton, ours, expected = real_meta_trees(real_config, "audio_config", Qwen3OmniMoeAudioEncoder, AudioEncoder)
    assert expected["layers.31.fc1.weight"][0] == (5120, 1280)  # the real dimensions
    assert expected["conv_out.weight"][0] == (1280, 480 * 16) and expected["proj2.weight"][0] == (2048, 1280)
    assert_same_tree((ours, skeleton), hf)
