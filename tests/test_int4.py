"""The GPTQ v1 checkpoint format (orin.checkpoint.gptq_format), torch's int4pack layout (orin.int4.pack), the INT4 Linear
(orin.int4.linear) and the conversion of HF blocks to INT4 modules; the experts and their MoE backends are
tests/test_int4_experts.py's."""

from __future__ import annotations

import os
import types

import pytest
import torch
from int4pack_reference import cuda_int4pack_reference
from test_int4_experts import CASES, INTER, TOPK, E, G, H, _dequantized_experts, _gen, _hf_text_config, _rel, _with
from torch import nn

from orin.checkpoint.gptq_format import (
    decode_qzeros_v1,
    dequantize_gptq_v1,
    gptq_v1_bytes,
    pack_gptq_v1,
    pad_in_features,
    quantize_rtn,
    random_gptq_v1,
    unpack_gptq_v1,
)
from orin.checkpoint.targets import runtime_int4_bytes
from orin.device.profile import CPU
from orin.errors import ModelError
from orin.int4 import pack as int4pack
from orin.int4.linear import (
    Int4Experts,
    Int4Linear,
    convert_for_runtime,
    int4_tensor_keys,
    load_int4_module,
    quantized_module_paths,
    unload_int4_module,
)


def _random_codes(N: int, K: int, g: int, gen: torch.Generator, sym: bool = False):
    groups = pad_in_features(K, g) // g
    q = torch.randint(0, 16, (N, K), generator=gen, dtype=torch.int32)
    z = (
        torch.full((groups, N), 8, dtype=torch.int32)
        if sym
        else torch.randint(0, 16, (groups, N), generator=gen, dtype=torch.int32)
    )
    if not sym:
        z[0, :8] = torch.tensor([0, 5, 0, 15, 0, 0, 1, 0])  # zero points of 0 make the v1 "-1" borrow across nibbles
    s = torch.rand((groups, N), generator=gen) * 0.01 + 0.001
    return q, z, s


# ---------------------------------------------------------------- format


@pytest.mark.parametrize(
    "K,N,g,sym", [(256, 64, 128, False), (256, 64, 64, True), (200, 48, 128, False), (538, 72, 32, False)]
)
def test_pack_unpack_round_trip(K, N, g, sym):
    q, z, s = _random_codes(N, K, g, _gen(K + N))
    packed = pack_gptq_v1(q, z, s, g)
    # GPTQ tools' layout: qweight rows ceil(K/8), a partial last group, g_idx of length K (no padding to K_pad).
    K_words, groups = -(-K // 8) * 8, -(-K // g)
    assert packed["qweight"].shape == (K_words // 8, N) and packed["qweight"].dtype == torch.int32
    assert packed["qzeros"].shape == (groups, N // 8) and packed["qzeros"].dtype == torch.int32
    assert packed["scales"].dtype == torch.float16 and torch.equal(
        packed["g_idx"], torch.arange(K, dtype=torch.int32) // g
    )
    q2, z2, s2, g2 = unpack_gptq_v1(packed)
    assert g2 == g
    assert torch.equal(q2[:, :K].int(), q)
    assert torch.equal(q2[:, K:].int(), z[-1].view(N, 1).expand(N, K_words - K))  # padding dequantizes to exactly 0
    assert torch.equal(z2.int(), z)
    assert torch.equal(s2, s.half())
    W = dequantize_gptq_v1(packed)
    assert W.shape == (N, K_words) and torch.all(W[:, K:] == 0)


def test_v1_zero_points_are_word_minus_0x11111111():
    # GPTQModel writes v1 qzeros as the packed word minus 0x11111111 (borrowing across nibbles), not nibble-wise -1.
    z = torch.tensor([[0, 5, 0, 15, 3, 0, 0, 8]], dtype=torch.int32)
    word = sum(int(v) << (4 * j) for j, v in enumerate(z[0]))
    packed = pack_gptq_v1(torch.zeros(8, 32, dtype=torch.int32), z, torch.ones(1, 8), 32)
    assert int(packed["qzeros"][0, 0]) & 0xFFFFFFFF == (word - 0x11111111) & 0xFFFFFFFF
    assert torch.equal(decode_qzeros_v1(packed["qzeros"]).int(), z)


@pytest.mark.parametrize(
    "K,N,g,bias", [(256, 64, 128, False), (4304, 1152, 128, True), (200, 48, 64, True), (2048, 768, 32, False)]
)
def test_gptq_v1_bytes_is_the_packed_size(K, N, g, bias):
    packed = random_gptq_v1(K, N, g, generator=_gen(1), bias=bias)
    assert gptq_v1_bytes(K, N, g, bias) == sum(t.nbytes for t in packed.values())


def test_pad_in_features():
    assert pad_in_features(4304, 128) == 4352
    assert pad_in_features(200, 128) == 256
    assert pad_in_features(2048, 128) == 2048


def test_non_contiguous_g_idx_is_refused():
    packed = random_gptq_v1(256, 64, 64, generator=_gen(2))
    packed["g_idx"] = packed["g_idx"][torch.randperm(256, generator=_gen(3))]  # what desc_act=True writes
    with pytest.raises(ModelError, match="desc_act"):
        unpack_gptq_v1(packed, name="thinker.x.q_proj")
    with pytest.raises(ModelError, match="thinker.x.q_proj.g_idx is not contiguous"):
        Int4Linear.from_gptq(packed, 256, "cpu", torch.float32, name="thinker.x.q_proj")


def test_missing_tensor_and_wrong_width_are_refused():
    packed = random_gptq_v1(256, 64, 128, generator=_gen(4))
    with pytest.raises(ModelError, match="qzeros"):
        unpack_gptq_v1({k: v for k, v in packed.items() if k != "qzeros"})
    with pytest.raises(ModelError, match="in_features=512"):
        dequantize_gptq_v1(packed, in_features=512)
    with pytest.raises(ModelError, match="in_features=100"):
        Int4Linear.from_gptq(packed, 100, "cpu", torch.float32)


def test_dequantize_drops_padding_columns():
    W = torch.randn(48, 200, generator=_gen(5))
    packed = _padded_layout(quantize_rtn(W, group_size=128), 200)
    assert packed["qweight"].shape[0] * 8 == 256
    deq = dequantize_gptq_v1(packed, in_features=200)
    assert deq.shape == (48, 200)
    assert torch.equal(deq, dequantize_gptq_v1(packed)[:, :200])


@pytest.mark.parametrize("sym", [False, True])
def test_quantize_rtn_error_is_within_half_a_step(sym):
    W = torch.randn(64, 320, generator=_gen(6)) * 0.02
    packed = quantize_rtn(W, group_size=64, sym=sym)
    _, zeros, scales, g = unpack_gptq_v1(packed)
    assert g == 64
    if sym:
        assert torch.all(zeros == 8)
    step = scales.float().repeat_interleave(64, dim=0).t()[:, :320]
    err = (dequantize_gptq_v1(packed, in_features=320) - W).abs()
    # Half a step, plus what the fp16 rounding (2**-11) of the stored scale moves the range ends (<= 8 steps) by.
    assert torch.all(err <= step * (0.5 + 8 * 2**-11) + 1e-7)
    assert _rel(dequantize_gptq_v1(packed, in_features=320), W) < 0.15  # 4-bit RTN on a Gaussian: ~0.1


# ---------------------------------------------------------------- Int4Linear


def _padded_layout(packed: dict, K: int) -> dict:
    """orin-omni 0.1's layout, still read: the input width zero-padded to a multiple of the group size
    (qweight rows K_pad/8 with the padded codes at the last group's zero point, g_idx of length K_pad)."""
    from orin.checkpoint.gptq_format import _pack_rows

    q, z, _, g = unpack_gptq_v1(packed)
    K_pad = pad_in_features(K, g)
    codes = torch.cat([q[:, :K].to(torch.int64), z[-1].to(torch.int64).view(-1, 1).expand(-1, K_pad - K)], dim=1)
    return {**packed, "qweight": _pack_rows(codes.t().contiguous()),
            "g_idx": torch.arange(K_pad, dtype=torch.int32) // g}


@pytest.mark.parametrize("device,dtype,tol", CASES)
@pytest.mark.parametrize(
    "K,N,g,bias,legacy_padded",
    [
        (256, 64, 128, False, False),
        (200, 48, 128, True, False),  # a partial last group, padded to K_pad 256 at load
        (200, 48, 128, True, True),  # the same in orin-omni 0.1's zero-padded layout
        (538, 72, 128, True, False),  # 4304-like (2*269) scaled down; N not a multiple of 16
        (538, 72, 128, False, True),
        (512, 64, 32, False, False),
        (512, 64, 512, True, False),  # g above the kernel's 256: scales repeat
    ],
)
def test_int4_linear_matches_dequantized_matmul(device, dtype, tol, K, N, g, bias, legacy_padded):
    gen = _gen(K * N + g)
    packed = random_gptq_v1(K, N, g, generator=gen, bias=bias)
    if legacy_padded:
        packed = _padded_layout(packed, K)
    W = dequantize_gptq_v1(packed, in_features=K)
    b = packed["bias"].float() if bias else 0.0
    layer = Int4Linear.from_gptq({k: v.to(device) for k, v in packed.items()}, K, device, dtype)
    assert (layer.in_features, layer.out_features, layer.padded_in_features) == (K, N, pad_in_features(K, g))
    # fresh draws; 300 rows: dequantize + dense GEMM (from the profile's prefill.linear_dequant_min_rows)
    for shape in [(2, 3, K), (1, K), (17, K), (2, 40, K), (3, 100, K)]:
        x = torch.randn(shape, generator=gen).to(dtype)
        y = layer(x.to(device))
        assert y.shape == (*shape[:-1], N) and y.dtype == dtype and y.device.type == device
        assert _rel(y, x.float() @ W.T + b) <= tol
    assert layer.route_for(17) == "tinygemm" and layer.route_for(300) == "dense"
    for route, first in (("tinygemm", 1 << 62), ("dense", 0)):  # either route at any row count, by the profile
        twin = Int4Linear.from_gptq({k: v.to(device) for k, v in packed.items()}, K, device, dtype,
                                    profile=_with(CPU, "prefill", linear_dequant_min_rows=first))
        assert twin.route_for(x.shape[0]) == route
        assert _rel(twin(x.to(device)), x.float() @ W.T + b) <= tol
    with pytest.raises(TypeError):  # the route is the profile's, never the caller's
        layer(x.to(device), route="dense")
    assert _rel(layer.dequantized_weight(), W) <= tol


def test_int4_linear_real_vision_fc2_dims():
    packed = random_gptq_v1(4304, 1152, 128, generator=_gen(7), bias=True)
    assert packed["qweight"].shape == (4304 // 8, 1152)  # stored at its true width, padded to 4352 at load
    layer = Int4Linear.from_gptq(packed, 4304, "cpu", torch.bfloat16)
    x = torch.randn(5, 4304, generator=_gen(8)).bfloat16()
    ref = x.float() @ dequantize_gptq_v1(packed, 4304).T + packed["bias"].float()
    assert _rel(layer(x), ref) <= 1e-2


def test_int4_linear_empty_batch_and_unload():
    layer = Int4Linear.from_gptq(random_gptq_v1(64, 32, 32, generator=_gen(9)), 64, "cpu", torch.float32)
    assert layer(torch.randn(0, 64)).shape == (0, 32)
    unload_int4_module(layer)
    assert not layer.is_loaded and list(layer.buffers()) == []
    with pytest.raises(RuntimeError, match="not loaded"):
        layer(torch.randn(2, 64))


def test_cpu_conversion_in_row_chunks_matches_whole():
    packed = random_gptq_v1(256, 320, 64, generator=_gen(10))
    whole = Int4Linear.from_gptq(packed, 256, "cpu", torch.float32).weight_packed
    chunked = Int4Linear.from_gptq(packed, 256, "cpu", torch.float32,
                                   profile=_with(CPU, "memory", cpu_convert_chunk_rows=64)).weight_packed
    assert torch.equal(whole, chunked)


def test_cuda_byte_layout_from_qweight():
    # CUDA's _convert_weight_to_int4pack takes uint8 [N, K/2] with q[n, 2j] in the high nibble (torchao's layout).
    packed = random_gptq_v1(64, 32, 32, generator=_gen(11))
    q = unpack_gptq_v1(packed)[0].int()
    assert torch.equal(int4pack._cuda_codes_bytes(packed["qweight"]).int(), (q[:, ::2] << 4) | q[:, 1::2])


@pytest.mark.parametrize("N,K,tiles", [(8, 32, 2), (16, 128, 8), (24, 128, 4)])
def test_cuda_layout_reader_inverts_the_kernels_converter(N, K, tiles):
    codes = torch.randint(0, 16, (N, K), generator=_gen(N + K), dtype=torch.int32)
    packed = cuda_int4pack_reference(codes, tiles)
    assert torch.equal(int4pack._codes_cuda(packed).int(), codes)
    stacked = torch.stack([packed, cuda_int4pack_reference(15 - codes, tiles)])  # leading (expert) dims
    assert torch.equal(int4pack._codes_cuda(stacked).int(), torch.stack([codes, 15 - codes]))


@pytest.mark.parametrize("N,K", [(16, 32), (48, 64), (64, 256), (192, 128)])
def test_cpu_layout_is_read_back_by_probing(N, K):
    codes = torch.randint(0, 16, (N, K), generator=_gen(N * K), dtype=torch.int32)
    packed = int4pack._convert_cpu_codes(codes)
    assert torch.equal(int4pack.unpack_codes(packed, N, K).int(), codes)
    assert torch.equal(int4pack.unpack_codes(torch.stack([packed, packed]), N, K)[1].int(), codes)


@pytest.mark.parametrize("K,N,g", [(200, 48, 128), (512, 64, 512), (256, 64, 32)])
def test_dequantize_packed_is_the_kernels_weight(K, N, g):
    packed = random_gptq_v1(K, N, g, generator=_gen(K + N + g))
    layer = Int4Linear.from_gptq(packed, K, "cpu", torch.float32)
    w = int4pack.dequantize_packed(layer.weight_packed, layer.scales_and_zeros, layer.kernel_group_size)
    assert w.shape == (layer.padded_out_features, layer.padded_in_features) and w.dtype == torch.float32
    assert torch.allclose(w[:N, :K], layer.dequantized_weight(), atol=1e-6)
    assert torch.allclose(w[:N, :K], dequantize_gptq_v1(packed, K), atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("K,N,g,bias", [(200, 48, 128, True), (512, 72, 512, False)])
def test_runtime_bytes_match_buffers(K, N, g, bias, dtype):
    # orin.checkpoint.targets's formula (the planner's) against a loaded layer: K padded to whole groups, N (72) to 16, and
    # g above the kernel's 256 repeating the scales
    layer = Int4Linear.from_gptq(random_gptq_v1(K, N, g, generator=_gen(12), bias=bias), K, "cpu", dtype)
    assert runtime_int4_bytes(K, N, g, bias, scale_bytes=dtype.itemsize) == sum(b.nbytes for b in layer.buffers())


# ---------------------------------------------------------------- conversion of a real HF block


def _talker_block_cls_and_config():
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTalkerTextConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeTalkerTextSparseMoeBlock

    config = Qwen3OmniMoeTalkerTextConfig(
        hidden_size=H,
        moe_intermediate_size=INTER,
        shared_expert_intermediate_size=96,
        num_experts=E,
        num_experts_per_tok=TOPK,
        hidden_act="silu",
    )
    config._experts_implementation = "eager"
    return Qwen3OmniMoeTalkerTextSparseMoeBlock, config


def _thinker_block_cls_and_config():
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextSparseMoeBlock

    return Qwen3OmniMoeThinkerTextSparseMoeBlock, _hf_text_config()


@pytest.mark.parametrize("which", ["thinker", "talker"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_convert_for_runtime_then_load_matches_hf_block(which, dtype, tol):
    cls, config = _thinker_block_cls_and_config() if which == "thinker" else _talker_block_cls_and_config()
    torch.manual_seed(30)
    original = cls(config)
    for p in original.parameters():
        nn.init.normal_(p, std=0.05)
    # Quantize like `orin-omni quantize` would: experts defused per GPTQModel, Linears as themselves.
    checkpoint = {}
    for e in range(E):
        gate, up = original.experts.gate_up_proj.data[e].chunk(2)
        for proj, W in (("gate_proj", gate), ("up_proj", up), ("down_proj", original.experts.down_proj.data[e])):
            checkpoint.update({f"experts.{e}.{proj}.{k}": v for k, v in quantize_rtn(W, group_size=G).items()})
    linears = [n for n, m in original.named_modules() if isinstance(m, nn.Linear) and n.startswith("shared_expert.")]
    for name in linears:
        checkpoint.update(
            {f"{name}.{k}": v for k, v in quantize_rtn(original.get_submodule(name).weight.data, group_size=G).items()}
        )
    paths = quantized_module_paths(checkpoint)
    assert paths == {"experts", *linears}

    # The reference: HF's own forward with the dequantized weights.
    reference = cls(config)
    reference.load_state_dict(original.state_dict())
    gate_up, down = _dequantized_experts({k.removeprefix("experts."): v for k, v in checkpoint.items()})
    reference.experts.gate_up_proj.data, reference.experts.down_proj.data = gate_up, down
    for name in linears:
        mod = reference.get_submodule(name)
        mod.weight.data = dequantize_gptq_v1(
            {k: checkpoint[f"{name}.{k}"] for k in ("qweight", "qzeros", "scales", "g_idx")}, mod.in_features
        )
    reference = reference.to(dtype)

    # The loader's flow: skeleton on meta, shells, materialize the rest, fill the shells.
    with torch.device("meta"):
        block = cls(config)
    shells = convert_for_runtime(block, paths)
    assert set(shells) == paths and isinstance(block.experts, Int4Experts)
    assert all(t.device.type == "meta" for t in block.parameters())  # the shells allocated nothing
    assert not any(True for s in shells.values() for _ in s.buffers())
    block = block.to_empty(device="cpu")
    block.load_state_dict(
        {k: v for k, v in reference.state_dict().items() if k in dict(block.named_parameters())}, strict=False
    )
    for path, shell in shells.items():
        load_int4_module(
            shell, {k: checkpoint[f"{path}.{k}"] for k in int4_tensor_keys(shell)}, "cpu", dtype, name=path
        )
    block = block.to(dtype)

    x = torch.randn(3, 11, H, generator=_gen(31)).to(dtype)
    with torch.no_grad():
        assert _rel(block(x), reference(x)) <= tol


def test_convert_for_runtime_refuses_unknown_or_unsupported_paths():
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU())
    with pytest.raises(ModelError, match="'2' does not exist"):
        convert_for_runtime(model, {"2"})
    with pytest.raises(ModelError, match="ReLU"):
        convert_for_runtime(model, {"1"})
    shells = convert_for_runtime(model, {"0"})
    assert isinstance(model[0], Int4Linear) and shells["0"] is model[0] and model[0].in_features == 64


def test_quantized_module_paths_collapse_defused_experts():
    keys = [
        "thinker.model.language_model.layers.0.self_attn.q_proj.qweight",
        "thinker.model.language_model.layers.0.self_attn.q_proj.scales",
        "thinker.model.language_model.layers.0.mlp.experts.0.gate_proj.qweight",
        "thinker.model.language_model.layers.0.mlp.experts.127.down_proj.qweight",
        "thinker.model.language_model.layers.0.mlp.gate.weight",
    ]
    assert quantized_module_paths(keys) == {
        "thinker.model.language_model.layers.0.self_attn.q_proj",
        "thinker.model.language_model.layers.0.mlp.experts",
    }


# ---------------------------------------------------------------- GPTQModel 7.6.0 cross-check


@pytest.fixture(scope="module")
def gptqmodel_api():
    # The pure-python packer only: the native pack extension would JIT-compile (~25 s) on first use.
    os.environ["GPTQMODEL_DISABLE_PACK_EXT"] = "1"
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    pytest.importorskip("gptqmodel")
    from gptqmodel.nn_modules.qlinear import PackableQuantLinear
    from gptqmodel.nn_modules.qlinear.torch import TorchLinear
    from gptqmodel.utils.model import convert_gptq_v1_to_v2_format_module, convert_gptq_v2_to_v1_format_module

    return types.SimpleNamespace(
        TorchLinear=TorchLinear,
        dequantize=PackableQuantLinear.dequantize_weight,
        v1_to_v2=convert_gptq_v1_to_v2_format_module,
        v2_to_v1=convert_gptq_v2_to_v1_format_module,
    )


def _gptqmodel_pack(api, q, z, s, g, bias, packer):
    """Pack codes the way GPTQModel's quantizer does (v2 internally), then export to v1 as its saver does."""
    N, K = q.shape
    grp = torch.arange(K) // g
    lin = nn.Linear(K, N, bias=bias is not None)
    s = s.half().float()
    lin.weight.data = (q.float() - z.t().float()[:, grp]) * s.t()[:, grp]
    if bias is not None:
        lin.bias.data = bias.float()
    m = api.TorchLinear(
        bits=4, group_size=g, sym=False, desc_act=False, in_features=K, out_features=N, bias=bias is not None
    )
    getattr(m, packer)(lin, s.t().contiguous(), z.t().float().contiguous(), grp.to(torch.int32))
    # Its v2->v1 export reads bits/pack_dtype off the module; a stand-in config avoids QuantizeConfig's temp dirs.
    api.v2_to_v1(m, types.SimpleNamespace(bits=4, pack_dtype=torch.int32))
    return m


@pytest.mark.parametrize("sym", [False, True])
def test_pack_is_bit_identical_to_gptqmodel(gptqmodel_api, sym):
    q, z, s = _random_codes(64, 256, 64, _gen(40), sym=sym)
    bias = torch.randn(64, generator=_gen(41)).half()
    m = _gptqmodel_pack(gptqmodel_api, q, z, s, 64, bias, "pack_block")
    ours = pack_gptq_v1(q, z, s, 64, bias)
    for key in ("qweight", "qzeros", "scales", "g_idx", "bias"):
        theirs = getattr(m, key)
        assert theirs.dtype == ours[key].dtype and torch.equal(theirs, ours[key]), key


def test_gptqmodel_unpadded_layout_dequantizes_and_runs(gptqmodel_api):
    # K=200 (not a multiple of 32 or g): GPTQModel's pack_original writes ceil(K/8) rows and a partial last group.
    K, N, g = 200, 48, 64
    q, z, s = _random_codes(N, K, g, _gen(42))
    m = _gptqmodel_pack(gptqmodel_api, q, z, s, g, None, "pack_original")
    tensors = {k: getattr(m, k).clone() for k in ("qweight", "qzeros", "scales", "g_idx")}
    assert tensors["qweight"].shape == (25, N) and tensors["scales"].shape == (4, N)
    ours = dequantize_gptq_v1(tensors, in_features=K)
    gptqmodel_api.v1_to_v2(m, 4, torch.int32)
    m.enable_wf_unsqueeze = True
    theirs = gptqmodel_api.dequantize(m).t()  # fp16 products; ours are the exact fp32 products before rounding
    assert theirs.dtype == torch.float16 and torch.equal(ours.half(), theirs)
    layer = Int4Linear.from_gptq(tensors, K, "cpu", torch.float32)
    x = torch.randn(4, K, generator=_gen(43))
    assert _rel(layer(x), x @ ours.T) <= 1e-5


def test_defuser_names_experts_like_our_format(gptqmodel_api):
    # GPTQModel quantizes Qwen3-Omni's MoE through defuser's per-expert modules; their names are our keys.
    from defuser.modeling.unfused_moe.qwen3_omni_moe import LinearQwen3OmniMoeThinkerTextSparseMoeBlock

    with torch.device("meta"):
        block = LinearQwen3OmniMoeThinkerTextSparseMoeBlock(_hf_text_config())
    linears = {n for n, mod in block.named_modules() if isinstance(mod, nn.Linear)}
    assert {"experts.0.gate_proj", "experts.0.up_proj", "experts.0.down_proj", f"experts.{E - 1}.down_proj"} <= linears
    assert quantized_module_paths(f"{n}.qweight" for n in linears) == {"experts"}
    assert set(int4_tensor_keys(Int4Experts(E, H, INTER, nn.SiLU()))) == {
        f"{n}.{k}"[len("experts.") :] for n in linears for k in ("qweight", "qzeros", "scales", "g_idx")
    }
