"""The largest single allocation a request makes (orin.memory.request_sizes.allocations) against the device's
ceiling on one allocation (the profile's memory.max_allocation_bytes: 1 GiB on the Orin), and the pinned staging
buffers a unified-memory device counts against the budget: the real model's figures on the Orin profile, worked
out by hand from its config, and the tiny model's, checked against the tensors its engine really makes."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from click.testing import CliRunner

from orin.cli import cli
from orin.device.profile import CPU, HOPPER, ORIN
from orin.errors import BudgetError
from orin.memory.plan import PlanConfig, make_plan, plan_request, require_fit
from orin.memory.request_sizes import (
    Request,
    allocations,
    max_clip_seconds,
    pinned_host_bytes,
    prompt_tokens,
    stage_margin,
    vision_sizes,
)

GiB, MiB = 1 << 30, 1 << 20


def _orin(real_config, budget: int = 60 * GiB, **request):
    return make_plan(PlanConfig(model=real_config, device_profile="orin", budget=budget, **request))


def _dims(real_config) -> dict:
    return json.load(open(real_config))


# ---------------------------------------------------------------- the real model on the Orin


def test_the_standard_requests_largest_allocation_is_the_embedding_and_its_own_the_audio_convolution(real_config):
    cfg = _dims(real_config)
    t = cfg["thinker_config"]["text_config"]
    result = _orin(real_config)
    largest = result.verdict.largest
    assert largest.what.startswith("weight thinker.model.language_model.embed_tokens.weight")
    assert largest.bytes == t["vocab_size"] * t["hidden_size"] * 2 == 594 * MiB < ORIN.memory.max_allocation_bytes
    own = next(a for a in result.allocations if a.own)
    # 30 s of audio: 30 one-second chunks, convolved as a batch of 32 (a power of two), 480 channels x 64 mel bins
    # x 50 frames after the first stride-2 convolution, in BF16
    a = cfg["thinker_config"]["audio_config"]
    assert own.what == "audio encoder's convolution over 32 one-second chunks"
    assert own.bytes == 32 * a["downsample_hidden_size"] * 64 * a["n_window"] * 2 == 93.75 * MiB
    assert result.verdict.time_sliced and not result.verdict.over_ceiling


def test_the_decoders_stay_under_the_ceiling_at_the_longest_prompt_the_runtime_takes(real_config):
    """The longest video the server takes (600 s at 2 fps, capped at 768 frames of 448x448, no soundtrack):
    75,292 prompt tokens, past the thinker's 65,536-token context. Every decoder allocation (the KV cache's layers,
    the whole-prompt hidden states, the deepstack levels, the long prefill's chunks, blocks and dequantized
    experts) is under the Orin's 1 GiB: nothing in orin.runtime.decode, attention or layer needs splitting."""
    cfg = _dims(real_config)
    t, k = cfg["thinker_config"]["text_config"], cfg["talker_config"]["text_config"]
    result = _orin(real_config, audio_seconds=0, images=0, video_seconds=600, video_audio=False)
    T = result.tokens["prompt"]
    assert T == 384 * 196 + 28 == 75_292 > t["max_position_embeddings"]
    assert result.verdict.time_sliced and result.verdict.largest.bytes <= ORIN.memory.max_allocation_bytes
    by = {a.what: a.bytes for a in result.allocations}
    positions = -(-(T + 256) // 1024) * 1024
    assert by["thinker KV cache, one layer's keys (its values alike)"] == 4 * positions * 128 * 2 == 74 * MiB
    assert by[f"thinker prompt's hidden states [{T}, 2048]"] == T * t["hidden_size"] * 2 < 295 * MiB
    assert by["visual features, each deepstack level [75264, 2048]"] == 294 * MiB
    # the talker's experts taken whole (128 x 2 x 384 x 1024 in BF16), the thinker's 14 at a time (128 MiB each
    # piece at most: 14 experts' gate, up and down)
    assert by["talker long prompt's experts dequantized, 128 at a time"] == 192 * MiB
    assert by["thinker long prompt's experts dequantized, 14 at a time"] == 14 * 2 * 768 * 2048 * 2
    assert by["thinker long prompt's MoE block, its rows gathered [32768, 2048]"] == 128 * MiB
    assert by["thinker long prompt's attention chunk, its queries [4096, 32, 128]"] == 32 * MiB
    decoders = [a for a in result.allocations if a.component in ("thinker_text", "talker") and a.own]
    assert max(a.bytes for a in decoders) < 300 * MiB
    # the whole-prompt hidden states, the decoders' largest, reach 1 GiB only at 4x the context
    assert ORIN.memory.max_allocation_bytes // (t["hidden_size"] * 2) == 262_144 == 4 * t["max_position_embeddings"]
    assert k["hidden_size"] < t["hidden_size"]


def test_an_audio_clip_over_256_s_is_refused_naming_the_allocation_the_ceiling_and_what_to_do(real_config):
    """The audio encoder convolves a clip's one-second chunks in batches of up to the config's conv_chunksize
    (500): 257 s and more is a batch of 500, 1.43 GiB in one tensor. The runtime does not split it (that is
    orin.model.audio_encoder's batch), so plan refuses such a clip on the Orin, whatever the budget."""
    assert max_clip_seconds(_orin(real_config).sizes.dims, 2, ORIN.memory.max_allocation_bytes) == 256
    fits = _orin(real_config, audio_seconds=256, images=0)
    assert fits.verdict.time_sliced
    assert fits.verdict.largest.what == "audio encoder's convolution over 256 one-second chunks"
    assert fits.verdict.largest.bytes == 750 * MiB
    refused = _orin(real_config, audio_seconds=257, images=0)
    v = refused.verdict
    assert v.over_ceiling and not v.time_sliced and v.largest.bytes == 500 * 480 * 64 * 50 * 2
    assert ("cannot run on this device: the audio encoder's convolution over 500 one-second chunks is one "
            "allocation of 1.43 GiB, over the 1.00 GiB this device allows one") in v.reason
    assert "send audio clips of at most 256 s each" in v.reason
    with pytest.raises(BudgetError, match="at most 256 s") as err:
        require_fit(v)
    assert "raise --budget" not in str(err.value)  # no budget helps
    # the same clip inside a video: its soundtrack is a clip of its own
    assert _orin(real_config, audio_seconds=0, images=0, video_seconds=300).verdict.over_ceiling
    assert not _orin(real_config, audio_seconds=0, images=0, video_seconds=300, video_audio=False).verdict.over_ceiling
    # a discrete GPU has no ceiling: the same request fits there
    hopper = make_plan(PlanConfig(model=refused.cfg.model, device_profile="hopper", budget=60 * GiB,
                                  audio_seconds=257, images=0))
    assert hopper.verdict.time_sliced and hopper.verdict.largest.bytes > GiB


def test_images_go_through_the_vision_encoder_together_up_to_the_ceiling(real_config):
    """All of a prompt's images are one vision-encoder pass: its position table, four taps per patch in float32
    (4 x 1152 x 4 bytes a patch), passes 1 GiB from 58,255 patches: 297 images of 224x224. Images of different
    sizes add a mask over all their patches, in BF16."""
    fits = _orin(real_config, images=296)
    assert fits.verdict.time_sliced and fits.verdict.largest.bytes == 296 * 196 * 4 * 1152 * 4
    refused = _orin(real_config, images=300)
    assert refused.verdict.over_ceiling and "position table, images (58800 patches" in refused.verdict.reason
    assert "send fewer or smaller images" in refused.verdict.reason
    grids = [(1, 100, 100), (1, 120, 120)]  # 10,000 and 14,400 patches: the mask is [24400, 24400]
    tokens = {"audio": 0, "image": 6100, "video": 0, "prompt": 6128, "generated": 1, "total": 6129,
              "talker_frames": 0, **vision_sizes(grids, [], ORIN.prefill.video_encode_patches)}
    mask = next(a for a in allocations(tokens, refused.sizes.dims, 2, ORIN) if "mask" in a.what)
    assert mask.bytes == 24_400 ** 2 * 2 > ORIN.memory.max_allocation_bytes
    assert mask.advice == "send fewer images, or images of one size"


def test_a_video_pass_is_split_by_the_profile_down_to_one_grid(real_config):
    """A video goes through the vision encoder video_encode_patches at a time (whole 2-frame grids): the default
    448x448 frames are 10 grids a pass; frames of 4096x4096 are one grid of 65,536 patches a pass, whose position
    table is over the ceiling: refused, asking for smaller frames."""
    usual = _orin(real_config, audio_seconds=0, images=0, video_seconds=60)
    table = next(a for a in usual.allocations if a.what.startswith("vision encoder's position table, video pass"))
    assert table.pieces and table.bytes == 10 * 784 * 4 * 1152 * 4
    huge = _orin(real_config, audio_seconds=0, images=0, video_seconds=10, video_frame_pixels=4096 * 4096)
    assert huge.verdict.over_ceiling and "--video-frame-pixels" in huge.verdict.reason


def test_the_plan_prints_where_pinned_host_memory_counts(real_config):
    """The Orin's unified memory: each loading thread's two 64 MiB staging buffers (256 MiB) count in every stage
    against the budget; a discrete GPU reports them as host memory."""
    orin = CliRunner().invoke(cli, ["plan", real_config, "--device-profile", "orin"])
    hopper = CliRunner().invoke(cli, ["plan", real_config, "--device-profile", "hopper"])
    assert orin.exit_code == 0 and hopper.exit_code == 0, orin.output + hopper.output
    assert ("pinned host memory: 256.00 MiB of staging buffers (2 loading threads x 2 x 64.00 MiB), counted in "
            "every stage against the budget") in orin.output
    assert "+ 768.00 MiB runtime margin + 256.00 MiB pinned staging" in orin.output
    assert "host memory, outside the device budget" in hopper.output and "pinned staging," not in hopper.output
    assert "largest single allocation: 594.00 MiB" in hopper.output and "(no ceiling on this device)" in hopper.output


def test_pinned_staging_is_counted_against_the_budget_only_on_unified_memory(real_config):
    unified = _orin(real_config, budget=24 * GiB)
    discrete = ORIN.with_capabilities(unified_memory=False)
    apart = plan_request(unified.sizes, unified.request, 24 * GiB, discrete)[3]
    pinned = pinned_host_bytes(ORIN.memory)
    assert pinned == 2 * 2 * ORIN.memory.stage_bytes == 256 * MiB
    assert stage_margin(ORIN) == ORIN.memory.runtime_margin + pinned and stage_margin(HOPPER) == 768 * MiB
    assert unified.verdict.all_resident_bytes == apart.all_resident_bytes + pinned
    assert unified.verdict.min_budget == apart.min_budget + pinned
    assert all(s.bytes == t.bytes + pinned for s, t in zip(unified.verdict.schedule, apart.schedule, strict=True))
    # a budget between the two: only the discrete device's plan fits it
    between = apart.min_budget + pinned // 2
    assert plan_request(unified.sizes, unified.request, between, discrete)[3].time_sliced
    assert not plan_request(unified.sizes, unified.request, between, ORIN)[3].time_sliced


# ---------------------------------------------------------------- the tiny model


def _tiny_sizes(tiny_model_dir):
    return make_plan(PlanConfig(model=tiny_model_dir, device_profile="cpu")).sizes


@pytest.mark.parametrize("pinned", [False, True])
def test_a_tiny_ceiling_refuses_at_the_largest_allocation_exactly(tiny_model_dir, pinned):
    sizes = _tiny_sizes(tiny_model_dir)
    req = Request(audio_seconds=3, images=1, text_tokens=8)
    base = CPU.with_capabilities(unified_memory=pinned)
    largest = plan_request(sizes, req, 1 << 40, base, 4)[3].largest
    for ceiling, refused in ((largest.bytes, False), (largest.bytes - 1, True)):
        profile = replace(base, memory=replace(base.memory, max_allocation_bytes=ceiling))
        v = plan_request(sizes, req, 1 << 40, profile, 4)[3]
        assert (v.over_ceiling, v.time_sliced) == (refused, not refused), v.reason
        assert v.largest == largest
    assert largest.what == "a loading thread's pinned staging buffer"  # 64 MiB: larger than the tiny model
    # a profile with small staging buffers: the request's own largest allocation sets the ceiling's verdict
    small = replace(base, memory=replace(base.memory, stage_bytes=1 << 16, max_allocation_bytes=1 << 20))
    v = plan_request(sizes, req, 1 << 40, small, 4)[3]
    assert v.largest.own and v.largest.bytes > 1 << 20 and v.over_ceiling


def test_no_tensor_the_engine_makes_is_larger_than_the_planned_allocations(quantized_dir):
    """The inventory is complete on the tiny model: every tensor a request makes on the CPU engine (all-resident,
    after a first request loaded the weights; new audio, so the encoder runs) is at most the largest allocation
    the plan lists for that prompt, and the two largest are the very allocations the plan names."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from allocations import Allocations

    from orin.contract import GenerationRequest
    from orin.inputs.media import synth_image, synth_speechlike
    from orin.runtime.engine import Engine, EngineConfig

    def request(seed: int) -> GenerationRequest:
        parts = [{"type": "image", "image": synth_image(224)}, {"type": "image", "image": synth_image(320)},
                 {"type": "audio", "audio": synth_speechlike(12.0, seed=seed)}, {"type": "text", "text": "What?"}]
        return GenerationRequest(messages=({"role": "user", "content": parts},), max_new_tokens=10,
                                 max_audio_frames=80, ignore_eos=True)

    engine = Engine(EngineConfig(model_dir=quantized_dir, device="cpu", power_backend="none"))
    made: list[int] = []
    try:
        engine.generate(request(0))
        req = request(1)
        prompt = engine.prepare(req)
        with Allocations().mode(lambda t: made.append(t.untyped_storage().nbytes())):
            engine.generate(req)
        tokens = prompt_tokens(prompt, req.max_new_tokens, req.frame_cap, engine.sizes.dims, engine.profile)
        planned = allocations(tokens, engine.sizes.dims, 4, engine.profile, engine.sizes)
    finally:
        engine.close()
    own = [a for a in planned if a.own]
    assert made and max(made) <= own[0].bytes, (max(made), own[:3])
    assert tokens["vision_mask_patches"] == tokens["image_patches"]  # the two images differ in size
    assert own[0].bytes in made  # the largest is made, not only bounded


def test_silence_is_no_clip(real_config):
    """A request without audio has no audio encoder allocation; one without speech no talker's."""
    result = _orin(real_config, audio_seconds=0, speech=False)
    assert not [a for a in result.allocations if a.component in ("audio_encoder", "talker", "code2wav")]
    assert {a.component for a in result.allocations if not a.own} == {"loader", "thinker_text"}
    assert result.verdict.largest.bytes == 594 * MiB
