"""orin.model.vision_encoder against transformers' Qwen3OmniMoeVisionEncoder (the oracle): same state dict both ways,
same merged embeddings and deepstack features to 1e-5 in float32 on CPU over single images of several shapes, several
images in one call and video grids, the per-grid plan cached by grid, and the real config's tree on meta."""

from __future__ import annotations

import re

import pytest
import torch
from module_oracle import assert_same_tree, checkpoint_state, random_state, real_meta_trees
from torch import nn

from orin.model.config_file import read_config_dict
from orin.model.vision_encoder import PLAN_CACHE_SIZE, VisionEncoder, VisionPlan
from quantize.hf_config import load_config

ATOL = 1e-5
PREFIX = "thinker.visual."
PATCH_DIM = 3 * 2 * 16 * 16

# (t, h, w) per image: square, non-square both ways, one merge block, wider than the 48-wide position table (the
# resampling stretches it), same-size images (one batched SDPA), different sizes (the block-diagonal mask),
# videos (t > 1: one attention segment per frame), and a video beside an image.
GRIDS = [
    [(1, 4, 4)],
    [(1, 6, 10)],
    [(1, 12, 4)],
    [(1, 2, 2)],
    [(1, 2, 60)],
    [(1, 4, 6), (1, 4, 6)],
    [(1, 4, 6), (1, 8, 8)],
    [(1, 2, 2), (1, 6, 4), (1, 4, 10)],
    [(2, 4, 6)],
    [(3, 6, 4), (1, 8, 8)],
]


def hf_encoder(model_dir: str, attn: str = "eager"):
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeVisionEncoder

    config = load_config(model_dir).thinker_config.vision_config
    config._attn_implementation = attn
    return Qwen3OmniMoeVisionEncoder(config).float().eval()


def vision_dict(model_dir: str) -> dict:
    return read_config_dict(model_dir)["thinker_config"]["vision_config"]





def random_pixels(grid, seed: int) -> torch.Tensor:
    tokens = sum(t * h * w for t, h, w in grid)
    return torch.randn(tokens, PATCH_DIM, generator=torch.Generator().manual_seed(seed))


def assert_matches(ours: VisionEncoder, hf, pixels: torch.Tensor, grid) -> None:
    with torch.no_grad():
        got = ours(pixels, grid)
        expected = hf(pixels, grid_thw=torch.as_tensor(grid))
    assert got.embeds.shape == expected.pooler_output.shape, grid
    torch.testing.assert_close(got.embeds, expected.pooler_output, atol=ATOL, rtol=0, msg=f"embeds {grid}")
    assert len(got.deepstack) == len(expected.deepstack_features) == len(ours.config.deepstack_visual_indexes)
    for i, (a, b) in enumerate(zip(got.deepstack, expected.deepstack_features, strict=True)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0, msg=f"deepstack {i} {grid}")
    # a collapsed output (all tokens alike) would compare equal whatever the attention did
    assert got.embeds.shape[0] == 1 or got.embeds.std(0).mean() > 1e-3, grid


@pytest.fixture(scope="module")
def encoders(tiny_model_dir):
    """{weights: (ours, hf_eager, hf_sdpa)}, all three holding the same tensors."""
    out = {}
    for weights in ("checkpoint", "random"):
        hf_eager, hf_sdpa = hf_encoder(tiny_model_dir, "eager"), hf_encoder(tiny_model_dir, "sdpa")
        ours = VisionEncoder(vision_dict(tiny_model_dir)).eval()
        state = checkpoint_state(tiny_model_dir, PREFIX) if weights == "checkpoint" else random_state(ours, 5)
        for model in (ours, hf_eager, hf_sdpa):
            model.load_state_dict(state, strict=True)
        out[weights] = (ours, hf_eager, hf_sdpa)
    return out


def test_state_dicts_load_strictly_both_ways(tiny_model_dir):
    hf = hf_encoder(tiny_model_dir)
    ours = VisionEncoder(vision_dict(tiny_model_dir))
    checkpoint = checkpoint_state(tiny_model_dir, PREFIX)
    assert len(checkpoint) == len(hf.state_dict()) > 40
    ours.load_state_dict(checkpoint, strict=True)
    hf.load_state_dict(ours.state_dict(), strict=True)
    ours.load_state_dict(random_state(hf, 3), strict=True)
    hf.load_state_dict(ours.state_dict(), strict=True)
    assert list(ours.state_dict()) == list(hf.state_dict())
    for (name, a), b in zip(ours.state_dict().items(), hf.state_dict().values(), strict=True):
        assert a.shape == b.shape and torch.equal(a, b), name
    hf_buffers = dict(hf.named_buffers())
    assert sorted(dict(ours.named_buffers())) == sorted(hf_buffers)
    for name, buf in ours.named_buffers():
        assert buf.dtype == hf_buffers[name].dtype and torch.equal(buf, hf_buffers[name]), name


@pytest.mark.parametrize("weights", ["checkpoint", "random"])
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: "+".join("x".join(map(str, thw)) for thw in g))
def test_forward_matches_transformers(encoders, weights, grid):
    ours, hf_eager, hf_sdpa = encoders[weights]
    pixels = random_pixels(grid, seed=len(grid) * 100 + grid[0][2])
    for hf in (hf_eager, hf_sdpa):
        assert_matches(ours, hf, pixels, grid)


def test_processor_images_match_transformers(encoders, tiny_model_dir):
    """The production input path: images of several sizes and aspect ratios through the checkpoint's processor,
    one call per image and all of them in one call, split per image as get_image_features splits."""
    from orin.inputs.media import synth_image
    from quantize.hf_processor import build_processor

    images = [synth_image((64, 64), seed=1), synth_image((160, 96), seed=2, kind="gradient"),
              synth_image((72, 200), seed=3, kind="checker")]
    image_processor = build_processor(tiny_model_dir).image_processor
    ours, hf, _ = encoders["random"]
    batch = image_processor(images=images, return_tensors="pt")
    grids = batch["image_grid_thw"]
    assert len({tuple(g) for g in grids.tolist()}) == 3  # three different grids
    offset = 0
    for grid in grids.tolist():
        tokens = grid[0] * grid[1] * grid[2]
        assert_matches(ours, hf, batch["pixel_values"][offset:offset + tokens], [tuple(grid)])
        offset += tokens
    assert_matches(ours, hf, batch["pixel_values"], grids)
    with torch.no_grad():
        feats = ours(batch["pixel_values"], grids)
        expected = hf(batch["pixel_values"], grid_thw=grids)
    sizes = ours.split_sizes(grids)
    assert sizes == tuple((grids.prod(-1) // 4).tolist())
    per_image, deepstack = feats.per_image(sizes)
    for a, b in zip(per_image, torch.split(expected.pooler_output, list(sizes)), strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    assert [len(d) for d in deepstack] == [3] * len(feats.deepstack)


def test_plan_is_cached_per_grid(encoders):
    ours, hf, _ = encoders["random"]
    ours._plans.clear()
    tall, wide = [(1, 8, 4)], [(1, 4, 8)]  # same token count, different tables
    plan = ours.plan(tall)
    assert ours.plan(torch.tensor(tall)) is plan and ours.plan([[1, 8, 4]]) is plan
    assert ours.plan(plan) is plan
    other = ours.plan(wide)
    assert other is not plan and not torch.equal(other.cos, plan.cos)
    assert not torch.equal(other.pos_index, plan.pos_index)
    assert plan.mask is None and plan.segments == 1
    for grid in (tall, wide, tall):
        assert_matches(ours, hf, random_pixels(grid, seed=9), grid)
    assert len(ours._plans) == 2
    # a video attends per frame: one batch of frames, no mask; unequal frames need the block-diagonal mask
    video = ours.plan([(3, 4, 6)])
    assert video.segments == 3 and video.mask is None and video.merged_sizes == (18,)
    mixed = ours.plan([(1, 4, 6), (2, 2, 2)])
    assert mixed.segments == 1 and mixed.mask.shape == (32, 32)
    allowed = mixed.mask == 0
    assert mixed.mask.dtype == torch.float32 and torch.isinf(mixed.mask[~allowed]).all()
    assert allowed[:24, :24].all() and not allowed[:24, 24:].any() and not allowed[24:28, 28:].any()
    assert allowed[28:, 28:].all() and allowed.sum() == 24 * 24 + 2 * 4 * 4
    assert ours.plan([(1, 4, 6), (2, 2, 2)], dtype=torch.bfloat16).mask.dtype == torch.bfloat16
    # a plan passed in place of the grid is used as it is
    with torch.no_grad():
        via_plan = ours(random_pixels(tall, 4), plan)
        via_grid = ours(random_pixels(tall, 4), torch.tensor(tall))
    torch.testing.assert_close(via_plan.embeds, via_grid.embeds, atol=0, rtol=0)
    # least recently used plans go first
    for i in range(PLAN_CACHE_SIZE):
        ours.plan([(1, 2, 2 * (i + 1))])
    assert len(ours._plans) == PLAN_CACHE_SIZE
    assert ours.plan(tall) is not plan


def test_forward_reads_nothing_back_and_recomputes_no_tables(encoders):
    """With the plan cached, forward is pure device work: no op that copies a value to the host (.item(),
    .tolist(), nonzero: the host syncs that stop a CUDA-graph capture) and none of the table-building ops."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    ours = encoders["random"][0]
    for grid in ([(1, 4, 6)], [(1, 4, 6), (2, 2, 4)]):
        pixels = random_pixels(grid, 1)
        ours.prepare(grid)
        with torch.no_grad(), Ops() as ops:
            ours(pixels, grid)
        assert "scaled_dot_product_attention" in ops.seen or "_scaled_dot_product_flash_attention_for_cpu" in ops.seen
        assert not ops.seen & {"_local_scalar_dense", "nonzero", "item", "arange", "cos", "sin", "floor",
                               "repeat_interleave", "eq", "where", "logical_not"}, ops.seen


def test_bad_inputs_are_refused(encoders):
    from orin.errors import InputError

    ours = encoders["random"][0]
    with pytest.raises(InputError, match="merge blocks"):
        ours(random_pixels([(1, 3, 4)], 0), [(1, 3, 4)])
    with pytest.raises(InputError, match="pixel_values"):
        ours(random_pixels([(1, 4, 4)], 0), [(1, 4, 6)])
    with pytest.raises(InputError, match="grid_thw"):
        ours(random_pixels([(1, 4, 4)], 0), [(4, 4)])
    with pytest.raises(InputError, match="no image"):
        ours.plan([])
    with pytest.raises(InputError, match="bfloat16"):
        ours(random_pixels([(1, 4, 4)], 0), ours.plan([(1, 4, 4)], dtype=torch.bfloat16))


def test_projections_are_called_as_children(encoders, tiny_model_dir):
    """INT4 conversion swaps the linears layout.py names for Int4Linear by path: they must be nn.Linear children
    at HF's paths, and forward must call them (not read their .weight)."""
    from orin.checkpoint.targets import _RULES
    from orin.int4.linear import Int4Linear, convert_for_runtime

    ours, hf, _ = encoders["random"]
    rule = re.compile(_RULES["vision_encoder"])
    ours_paths = sorted(n for n, _ in ours.named_modules() if rule.match("thinker.model.visual." + n))
    hf_paths = sorted(n for n, _ in hf.named_modules() if rule.match("thinker.model.visual." + n))
    assert ours_paths == hf_paths and len(ours_paths) == 3 * ours.config.depth
    assert all(isinstance(ours.get_submodule(p), nn.Linear) for p in ours_paths)

    calls: list[str] = []

    class Spy(nn.Module):
        def __init__(self, inner: nn.Linear, path: str):
            super().__init__()
            self.inner, self.path = inner, path

        def forward(self, x):
            calls.append(self.path)
            return self.inner(x)

    spied = VisionEncoder(vision_dict(tiny_model_dir)).eval()
    spied.load_state_dict(ours.state_dict(), strict=True)
    for path in ours_paths:
        parent, _, child = path.rpartition(".")
        setattr(spied.get_submodule(parent), child, Spy(spied.get_submodule(path), path))
    assert_matches(spied, hf, random_pixels([(1, 4, 6)], 2), [(1, 4, 6)])
    assert sorted(set(calls)) == ours_paths

    shells = convert_for_runtime(VisionEncoder(vision_dict(tiny_model_dir), device="meta"), ours_paths)
    assert sorted(shells) == ours_paths and all(isinstance(s, Int4Linear) for s in shells.values())


def test_real_config_tree_on_meta(real_config):
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeVisionEncoder

    hf, skeleton, ours, expected = real_meta_trees(real_config, "vision_config", Qwen3OmniMoeVisionEncoder, VisionEncoder)
    assert expected["blocks.26.mlp.linear_fc2.weight"][0] == (1152, 4304)  # the real dimensions
    assert expected["merger_list.2.mlp.2.weight"][0] == (2048, 4608)
    assert expected["patch_embed.proj.weight"][0] == (1152, 3, 2, 16, 16)
    assert_same_tree((ours, skeleton), hf)
    # the host-side plan needs no weights: it is computed for the real grid sizes with the tree on meta
    plan = ours.plan([(1, 48, 48), (2, 20, 34)], device="cpu")
    assert isinstance(plan, VisionPlan) and plan.cos.shape == (2304 + 1360, 1, 72)
    assert plan.merged_sizes == (576, 340) and plan.mask is not None
