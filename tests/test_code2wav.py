"""orin.model.code2wav against transformers' Qwen3OmniMoeCode2Wav (the oracle): same state dict both ways, same
waveform to 1e-5 in float32 on CPU, whole and in the vocoder's chunks, and the real config's tree on meta."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from module_oracle import assert_same_tree, checkpoint_state, random_state

from orin.device.profile import CPU
from orin.model.code2wav import Code2Wav
from orin.model.config_file import read_config_dict
from quantize.hf_config import load_config

SPEECH = CPU.speech  # the chunk schedule (every profile's today)

ATOL = 1e-5
PREFIX = "code2wav."
WINDOW_PLUS_ONE = 73  # one frame past the pre-transformer's 72-frame window: the banded mask is used


def hf_code2wav(config, attn: str = "eager"):
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    config._attn_implementation = attn
    return Qwen3OmniMoeCode2Wav(config).eval()





@pytest.fixture(scope="module")
def tiny_pair(tiny_model_dir, request):
    """(ours, hf_eager, hf_sdpa) for each weight set, all three loaded with the same tensors."""
    pairs = {}
    for weights in ("checkpoint", "random"):
        hf_eager = hf_code2wav(load_config(tiny_model_dir).code2wav_config, "eager")
        hf_sdpa = hf_code2wav(load_config(tiny_model_dir).code2wav_config, "sdpa")
        ours = Code2Wav(read_config_dict(tiny_model_dir)["code2wav_config"]).eval()
        state = checkpoint_state(tiny_model_dir, PREFIX) if weights == "checkpoint" else random_state(ours, 7)
        for model in (hf_eager, hf_sdpa, ours):
            model.load_state_dict(state, strict=True)
        pairs[weights] = (ours, hf_eager, hf_sdpa)
    return pairs


def random_codes(frames: int, seed: int, quantizers: int = 4, codebook: int = 64) -> torch.Tensor:
    return torch.randint(0, codebook, (1, quantizers, frames), generator=torch.Generator().manual_seed(seed))


def vocoder_schedule(model, codes: torch.Tensor) -> torch.Tensor:
    """orin/runtime/vocoder.py's chunking: chunks of SPEECH.chunk_frames(done) frames, each with up to LEFT_CONTEXT
    frames before it, whose samples are cut off the front."""
    wavs, done, frames = [], 0, codes.shape[-1]
    while done < frames:
        end = min(done + SPEECH.chunk_frames(done), frames)
        ctx = min(SPEECH.code2wav_left_context, done)
        wavs.append(model(codes[..., done - ctx:end])[..., ctx * int(model.total_upsample):])
        done = end
    return torch.cat(wavs, dim=-1)


def test_state_dicts_load_strictly_both_ways(tiny_model_dir):
    hf = hf_code2wav(load_config(tiny_model_dir).code2wav_config)
    ours = Code2Wav(read_config_dict(tiny_model_dir)["code2wav_config"])
    ours.load_state_dict(checkpoint_state(tiny_model_dir, PREFIX), strict=True)
    hf.load_state_dict(ours.state_dict(), strict=True)
    ours.load_state_dict(random_state(hf, 3), strict=True)
    hf.load_state_dict(ours.state_dict(), strict=True)
    for a, b in zip(ours.state_dict().values(), hf.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    hf_buffers = dict(hf.named_buffers())
    assert sorted(dict(ours.named_buffers())) == sorted(hf_buffers)
    for name, buf in ours.named_buffers():
        assert buf.dtype == hf_buffers[name].dtype and torch.equal(buf, hf_buffers[name]), name
    assert ours.total_upsample == int(hf.total_upsample) == 1920


FRAMES = (1, SPEECH.code2wav_first_chunk, SPEECH.code2wav_first_chunk + SPEECH.code2wav_left_context, SPEECH.code2wav_chunk,
          SPEECH.code2wav_chunk + SPEECH.code2wav_left_context, WINDOW_PLUS_ONE, 200)


@pytest.mark.parametrize("weights", ["checkpoint", "random"])
def test_forward_matches_transformers(tiny_pair, weights):
    ours, hf_eager, hf_sdpa = tiny_pair[weights]
    with torch.no_grad():
        for i, frames in enumerate(FRAMES):
            codes = random_codes(frames, seed=i)
            wav = ours(codes)
            for hf in (hf_eager, hf_sdpa):
                expected = hf(codes)
                assert wav.shape == expected.shape, frames
                torch.testing.assert_close(wav, expected, atol=ATOL, rtol=0, msg=f"{frames} frames")
            # a waveform pinned at the clamp would compare equal whatever the path computed
            assert (wav.abs() < 0.999).float().mean() > 0.5, frames


def test_chunked_decode_matches_transformers(tiny_pair):
    ours, hf, _ = tiny_pair["random"]
    codes = random_codes(2 * SPEECH.code2wav_chunk + WINDOW_PLUS_ONE, seed=11)
    with torch.no_grad():
        for chunk, ctx in ((SPEECH.code2wav_chunk, SPEECH.code2wav_left_context), (100, 25), (WINDOW_PLUS_ONE, 40)):
            expected = hf.chunked_decode(codes, chunk_size=chunk, left_context_size=ctx)
            torch.testing.assert_close(ours.chunked_decode(codes, chunk, ctx), expected, atol=ATOL, rtol=0)
        expected = vocoder_schedule(hf, codes)
        torch.testing.assert_close(vocoder_schedule(ours, codes), expected, atol=ATOL, rtol=0)
        # left context matters: without it the second chunk's samples differ
        cut = SPEECH.code2wav_first_chunk * ours.total_upsample
        bare = ours(codes[..., SPEECH.code2wav_first_chunk:SPEECH.code2wav_first_chunk + SPEECH.code2wav_chunk])
        assert not torch.allclose(bare[..., :1000], expected[..., cut:cut + 1000], atol=1e-3)


def test_chunk_schedule_doubles_to_a_few_recurring_shapes():
    sizes, done = [], 0
    while done < 200:
        sizes.append(SPEECH.chunk_frames(done))
        done += sizes[-1]
    # the first packet waits for one frame; each chunk is as long as all before it, so it is ready before they
    # have played (a frame is 80 ms of audio, a few tens of ms of talker steps)
    assert sizes == [1, 2, 4, 8, 16] + [32] * 6 and sum(sizes) >= 200
    shapes, done = set(), 0
    for size in sizes:
        shapes.add(size + min(SPEECH.code2wav_left_context, done))
        done += size
    assert shapes == {1, 3, 7, 15, 31, SPEECH.code2wav_chunk + SPEECH.code2wav_left_context}
    assert len(shapes) <= CPU.capture.encoder_graphs  # every shape keeps its graph
    assert [SPEECH.chunk_count(n) for n in (1, 2, 3, 4, 63, 64, 95, 96)] == [1, 2, 2, 3, 6, 7, 7, 8]
    # a warm-up speaking every_shape_frames meets them all (the server's, the benchmark's)
    assert SPEECH.every_shape_frames() == 32 and _recurring_shapes(SPEECH.every_shape_frames()) == shapes
    assert _recurring_shapes(SPEECH.every_shape_frames() - 1) != shapes


def test_tables_and_masks_are_cached_per_length(tiny_pair):
    ours = tiny_pair["random"][0]
    pre = ours.pre_transformer
    ours.prepare(SPEECH.code2wav_chunk + SPEECH.code2wav_left_context)
    ours.prepare(WINDOW_PLUS_ONE)
    cos, sin = pre.rotary_emb.tables(WINDOW_PLUS_ONE, torch.device("cpu"), torch.float32)
    assert pre.rotary_emb.tables(WINDOW_PLUS_ONE, torch.device("cpu"), torch.float32)[0] is cos
    assert pre.mask(SPEECH.code2wav_chunk + SPEECH.code2wav_left_context, torch.device("cpu")) is None  # plain causal
    mask = pre.mask(WINDOW_PLUS_ONE, torch.device("cpu"))
    assert mask is pre.mask(WINDOW_PLUS_ONE, torch.device("cpu"))
    assert mask[-1].sum() == pre.window and not mask[-1, 0] and mask[-1, -1] and not mask[0, 1]


def test_codes_of_the_wrong_shape_are_refused(tiny_pair):
    from orin.errors import InputError

    with pytest.raises(InputError, match="codes"):
        tiny_pair["random"][0](random_codes(4, seed=0, quantizers=3))


def test_real_config_tree_on_meta(real_config):
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeCode2Wav

    from orin.memory.skeleton import params_on_meta

    with params_on_meta():
        hf = Qwen3OmniMoeCode2Wav(load_config(real_config).code2wav_config)
    data = read_config_dict(real_config)["code2wav_config"]
    with params_on_meta():
        skeleton = Code2Wav(data)
    ours = Code2Wav(data, device="meta")
    expected = {n: (p.shape, p.dtype) for n, p in hf.named_parameters()}
    assert expected["pre_transformer.layers.7.mlp.down_proj.weight"][0] == (1024, 3072)  # the real dimensions
    assert expected["decoder.6.conv.weight"][0] == (1, 1536 // 16, 7)
    assert_same_tree((ours, skeleton), hf)
    assert ours.total_upsample == int(hf.total_upsample)


def _recurring_shapes(frames: int) -> set[int]:
    shapes, done = set(), 0
    while done < frames:
        shapes.add(SPEECH.chunk_frames(done) + min(SPEECH.code2wav_left_context, done))
        done += SPEECH.chunk_frames(done)
    return shapes


# a chunk cut short at each place in the schedule: the second chunk, the fourth, the first whole-size one, a later
@pytest.mark.parametrize("frames", [1, 2, 5, SPEECH.code2wav_chunk + 10, 3 * SPEECH.code2wav_chunk + 5])
@pytest.mark.parametrize("graphs", [True, False])
def test_the_vocoders_odd_chunks_replay_the_recurring_shapes(tiny_pair, frames, graphs):
    """The vocoder's last chunk, and a reply shorter than the first chunks, go through code2wav padded to the
    shape of their place in the schedule (each a CUDA graph where graphs are kept, and padded alike where not, so
    every budget gives the same samples): the samples are those of the unpadded chunks, and code2wav never sees
    another length."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from orin.contract import GenerationRequest
    from orin.runtime.encoder_graphs import EncoderGraphs
    from orin.runtime.request_state import RequestState
    from orin.runtime.vocoder import Vocoder

    ours = tiny_pair["random"][0]
    codes = random_codes(frames, seed=frames)
    seen: list[int] = []
    hook = ours.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[-1]))
    state = RequestState(GenerationRequest(messages=({"role": "user", "content": "hi"},)), None)
    vocoder = Vocoder(SimpleNamespace(code2wav=ours), torch.device("cpu"), state, lambda: None,
                      EncoderGraphs(torch.device("cpu"), CPU.capture) if graphs else None, lambda _stage: nullcontext(),
                      SPEECH)
    try:
        with torch.no_grad():
            chunks = list(vocoder.feed(list(codes[0].unbind(-1)), final=True))
            seen_by_vocoder, seen[:] = list(seen), []
            expected = vocoder_schedule(ours, codes)
    finally:
        hook.remove()
    got = torch.from_numpy(np.concatenate([c.samples for c in chunks]))
    assert got.shape[0] == expected.shape[-1]
    torch.testing.assert_close(got, expected.reshape(-1).float(), atol=ATOL, rtol=0)
    assert set(seen_by_vocoder) == _recurring_shapes(frames)
    assert set(seen_by_vocoder) <= {1, 3, 7, 15, 31, SPEECH.code2wav_chunk + SPEECH.code2wav_left_context}
    assert sum(len(c.frames) for c in chunks) == frames
