"""The GPTQ v1 checkpoint format (orin.gptq_format), torch's int4pack layout (orin.int4pack) and the INT4 runtime
modules (orin.int4, orin.int4_experts)."""

from __future__ import annotations

import os
import types
from collections.abc import Mapping

import pytest
import torch
from int4pack_reference import cuda_int4pack_reference
from torch import nn

from orin import int4_experts, int4pack
from orin.errors import ModelError
from orin.gptq_format import (
    decode_qzeros_v1,
    dequantize_gptq_v1,
    gptq_v1_bytes,
    pack_gptq_v1,
    pad_in_features,
    quantize_rtn,
    random_gptq_v1,
    unpack_gptq_v1,
)
from orin.int4 import (
    Int4Experts,
    Int4Linear,
    convert_for_runtime,
    int4_tensor_keys,
    kernel_errors,
    load_int4_module,
    quantized_module_paths,
    triton_available,
    unload_int4_module,
)
from orin.layout import Target, runtime_int4_bytes, target_runtime_bytes

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# (device, dtype, relative tolerance); CUDA's kernel is bf16 only.
CASES = [("cpu", torch.float32, 1e-5), ("cpu", torch.bfloat16, 1e-2), ("cpu", torch.float16, 1e-2)]
CASES += [("cuda", torch.bfloat16, 1e-2)] if torch.cuda.is_available() else []


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


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
    from orin.gptq_format import _pack_rows

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
    # fresh draws; 300 rows: dequantize + dense GEMM (from LINEAR_DEQUANT_MIN_ROWS)
    for shape in [(2, 3, K), (1, K), (17, K), (2, 40, K), (3, 100, K)]:
        x = torch.randn(shape, generator=gen).to(dtype)
        y = layer(x.to(device))
        assert y.shape == (*shape[:-1], N) and y.dtype == dtype and y.device.type == device
        assert _rel(y, x.float() @ W.T + b) <= tol
    assert layer.route_for(17) == "tinygemm" and layer.route_for(300) == "dense"
    for route in ("tinygemm", "dense"):  # either route at any row count, chosen per call
        assert _rel(layer(x.to(device), route=route), x.float() @ W.T + b) <= tol
    with pytest.raises(ValueError, match="unknown route"):
        layer(x.to(device), route="cublas")
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


def test_cpu_conversion_in_row_chunks_matches_whole(monkeypatch):
    packed = random_gptq_v1(256, 320, 64, generator=_gen(10))
    whole = Int4Linear.from_gptq(packed, 256, "cpu", torch.float32).weight_packed
    monkeypatch.setattr(int4pack, "CPU_CONVERT_CHUNK_ROWS", 64)
    chunked = Int4Linear.from_gptq(packed, 256, "cpu", torch.float32).weight_packed
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton INT4 GEMM runs on CUDA")
@pytest.mark.parametrize("K,N,g,counts", [
    (256, 96, 128, [37, 0, 5, 16, 1]),  # experts with 0, 1 and block-crossing row counts
    (538, 72, 128, [70]),  # one expert = a dense layer; K padded to 640, N padded to 80
    (384, 64, 32, [3, 20]),  # kernel group below the 128-wide super-tile: scales per column
    (320, 48, 64, [9, 30]),  # 2 inner k-tile pairs: no grouped GEMM (dequantize only)
    (96, 32, 32, [17]),  # 1 pair
])
def test_triton_grouped_int4_mm_and_dequantize_match_tinygemm(K, N, g, counts):
    if not triton_available():
        pytest.skip("no Triton")
    from orin.kernels import int4_gemm

    gen = _gen(K + N + len(counts))
    layers = [Int4Linear.from_gptq(random_gptq_v1(K, N, g, generator=gen), K, "cuda") for _ in counts]
    packed = torch.stack([layer.weight_packed for layer in layers])
    sz = torch.stack([layer.scales_and_zeros for layer in layers])
    x = torch.randn(sum(counts) + 3, layers[0].padded_in_features, generator=gen).bfloat16().cuda()
    ends = torch.tensor(counts).cumsum(0).cuda()
    kg = layers[0].kernel_group_size
    if not int4_gemm.supports(packed):
        with pytest.raises(ValueError):
            int4_gemm.grouped_int4_mm(x, packed, sz, kg, ends)
    else:
        y = int4_gemm.grouped_int4_mm(x, packed, sz, kg, ends)
        assert torch.equal(y[sum(counts):], torch.zeros_like(y[sum(counts):]))  # rows past the last group
        start, refs = 0, []
        for layer, c in zip(layers, counts, strict=True):
            if c:  # tinygemm refuses 0 rows
                refs.append(int4pack.int4_mm(x[start:start + c].contiguous(), layer.weight_packed, kg,
                                             layer.scales_and_zeros))
            start += c
        assert _rel(y[:sum(counts)], torch.cat(refs)) <= 1e-2
    w = int4_gemm.dequantize(packed, sz, kg)  # the dense path's weights
    assert torch.allclose(w.float(), int4pack._dequantize(packed, sz, kg).float(), rtol=1e-2, atol=1e-3)
    assert _rel(w[0, :N, :K].float(), layers[0].dequantized_weight()) <= 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton INT4 GEMM runs on CUDA")
def test_int4_experts_fused_prefill_matches_per_expert_path(monkeypatch):
    if not triton_available():
        pytest.skip("no Triton")

    hidden, inter = 256, 128  # K a multiple of 128: the Triton kernel's layout
    flat = _expert_checkpoint(_gen(30), hidden=hidden, inter=inter, g=128)
    experts = Int4Experts.from_gptq({k: v.cuda() for k, v in flat.items()}, num_experts=E, hidden_dim=hidden,
                                    intermediate_dim=inter, act_fn=nn.SiLU(), device="cuda")
    gen = _gen(31)
    x = torch.randn(37, hidden, generator=gen).bfloat16().cuda()
    idx, w = _routing(37, gen)
    idx[3, 1] = E  # an out-of-range index is skipped on both paths
    idx, w = idx.cuda(), w.bfloat16().cuda()
    assert experts.route_for(x, TOPK) == "triton" and experts.fused(x, TOPK)
    fused = experts(x, idx, w)
    assert kernel_errors()["grouped_gemm"] is None
    assert _rel(fused, experts(x, idx, w, route="grouped_mm")) <= 1e-2  # the dequantized-chunk fallback
    assert _rel(fused, experts(x, idx, w, route="tinygemm")) <= 1e-2
    # A kernel that failed is off for the process: the chosen route falls back to the dequantized chunks.
    monkeypatch.setattr(int4pack.grouped_gemm, "error", "switched off by the test")
    assert kernel_errors()["grouped_gemm"] == "switched off by the test"
    assert experts.route_for(x, TOPK) == "grouped_mm"
    assert _rel(fused, experts(x, idx, w)) <= 1e-2
    with pytest.raises(ValueError, match="triton route"):
        experts(x, idx, w, route="triton")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton INT4 GEMV runs on CUDA")
@pytest.mark.parametrize("K,N,g", [(256, 96, 128), (384, 64, 32), (320, 48, 64)])
def test_triton_moe_gemv_matches_tinygemm(K, N, g):
    if not triton_available():
        pytest.skip("no Triton")
    from orin.kernels import int4_gemm  # noqa: F401 - registers torch.ops.orin.int4_moe_gemv

    gen = _gen(K * N)
    layers = [Int4Linear.from_gptq(random_gptq_v1(K, N, g, generator=gen), K, "cuda") for _ in range(6)]
    packed = torch.stack([layer.weight_packed for layer in layers])
    sz = torch.stack([layer.scales_and_zeros for layer in layers])
    kr, kg = layers[0].padded_in_features, layers[0].kernel_group_size
    sel = torch.tensor([4, 0, 5], device="cuda")
    shared = torch.randn(1, kr, generator=gen).bfloat16().cuda()
    each = torch.randn(3, kr, generator=gen).bfloat16().cuda()
    got_shared = torch.ops.orin.int4_moe_gemv(shared, packed, sz, sel, kg).sum(0)
    got_each = torch.ops.orin.int4_moe_gemv(each, packed, sz, sel, kg).sum(0)
    for j, e in enumerate(sel.tolist()):
        ref = int4pack.int4_mm(shared, packed[e], kg, sz[e])
        assert _rel(got_shared[j:j + 1], ref) <= 1e-2
        assert _rel(got_each[j:j + 1], int4pack.int4_mm(each[j:j + 1].contiguous(), packed[e], kg, sz[e])) <= 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("K,N,g,bias", [(200, 48, 128, True), (512, 72, 512, False)])
def test_runtime_bytes_match_buffers(K, N, g, bias, dtype):
    # orin.layout's formula (the planner's) against a loaded layer: K padded to whole groups, N (72) to 16, and
    # g above the kernel's 256 repeating the scales
    layer = Int4Linear.from_gptq(random_gptq_v1(K, N, g, generator=_gen(12), bias=bias), K, "cpu", dtype)
    assert runtime_int4_bytes(K, N, g, bias, scale_bytes=dtype.itemsize) == sum(b.nbytes for b in layer.buffers())


# ---------------------------------------------------------------- Int4Experts

E, H, INTER, TOPK, G = 8, 64, 48, 2, 32


def _expert_checkpoint(gen: torch.Generator, hidden=H, inter=INTER, g=G) -> dict[str, torch.Tensor]:
    """A flat GPTQModel-style defused expert checkpoint: '{e}.gate_proj.qweight', ..."""
    flat = {}
    for e in range(E):
        for proj, (K, N) in {
            "gate_proj": (hidden, inter),
            "up_proj": (hidden, inter),
            "down_proj": (inter, hidden),
        }.items():
            for key, t in random_gptq_v1(K, N, g, generator=gen).items():
                flat[f"{e}.{proj}.{key}"] = t
    return flat


def _dequantized_experts(flat: Mapping[str, torch.Tensor], hidden=H, inter=INTER):
    """HF's fused layout: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""

    def deq(e, proj, K):
        return dequantize_gptq_v1({k: flat[f"{e}.{proj}.{k}"] for k in ("qweight", "qzeros", "scales", "g_idx")}, K)

    gate_up = torch.stack([torch.cat([deq(e, "gate_proj", hidden), deq(e, "up_proj", hidden)]) for e in range(E)])
    down = torch.stack([deq(e, "down_proj", inter) for e in range(E)])
    return gate_up, down


def _routing(T: int, gen: torch.Generator, unused=(5,)):
    allowed = torch.tensor([e for e in range(E) if e not in unused])
    idx = torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:TOPK]] for _ in range(T)])
    w = torch.softmax(torch.randn(T, TOPK, generator=gen), dim=-1)
    return idx, w


def _reference_experts(x, idx, w, gate_up, down):
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            if e == E:
                continue
            gu = x[t].double() @ gate_up[e].double().T
            h = torch.nn.functional.silu(gu[:INTER]) * gu[INTER:]
            out[t] += w[t, j].double() * (h @ down[e].double().T)
    return out


def _hf_text_config():
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeTextConfig

    config = Qwen3OmniMoeTextConfig(
        hidden_size=H, moe_intermediate_size=INTER, num_experts=E, num_experts_per_tok=TOPK, hidden_act="silu"
    )
    config._experts_implementation = "eager"
    return config


@pytest.mark.parametrize("device,dtype,tol", CASES)
def test_int4_experts_match_reference_loop_and_hf(device, dtype, tol, monkeypatch):
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextExperts

    gen = _gen(20)
    flat = _expert_checkpoint(gen)
    gate_up, down = _dequantized_experts(flat)
    hf = Qwen3OmniMoeThinkerTextExperts(_hf_text_config())
    hf.gate_up_proj.data, hf.down_proj.data = gate_up.clone(), down.clone()
    experts = Int4Experts.from_gptq(
        {k: v.to(device) for k, v in flat.items()},
        num_experts=E,
        hidden_dim=H,
        intermediate_dim=INTER,
        act_fn=hf.act_fn,
        device=device,
        dtype=dtype,
    )
    gate_up_of = {w.data_ptr(): e for e, w in enumerate(experts.gate_up_packed)}
    calls = []
    real_mm = int4_experts.int4_mm

    def spy(x, w, group, sz):
        calls.append(gate_up_of.get(w.data_ptr(), "down"))
        return real_mm(x, w, group, sz)

    monkeypatch.setattr(int4_experts, "int4_mm", spy)
    monkeypatch.setattr(int4_experts, "PREFILL_DEQUANT_CHUNK", 3 * 2 * INTER * 64 * 4)  # grouped: 3 experts a chunk
    for T, grouped in ((37, True), (37, False), (1, False)):  # prefill-like batches and a decode token
        x = torch.randn(T, H, generator=gen)
        idx, w = _routing(T, gen)
        if T == 1 or device == "cpu":  # a decode token: tinygemm per expert; on CPU a prompt: grouped_mm
            assert experts.route_for(x, TOPK) == ("grouped_mm" if T > 1 else "tinygemm")
        route = "tinygemm" if T > 1 and not grouped else None  # a prompt through the decode route, asked for
        y = experts(x.to(device, dtype), idx.to(device), w.to(device, dtype), route=route)
        assert y.shape == (T, H) and y.dtype == dtype
        ref = _reference_experts(x.to(dtype).float(), idx, w.to(dtype).float(), gate_up, down)
        assert _rel(y, ref) <= tol
        with torch.no_grad():
            hf_out = hf.to(torch.float32)(x.to(dtype).float(), idx, w.to(dtype).float())
        assert _rel(y, hf_out) <= tol
        ran = [c for c in calls if c != "down"]
        if grouped:
            assert calls == []  # no tinygemm: dequantized chunks and grouped GEMMs
        else:
            assert sorted(ran) == sorted(set(idx.flatten().tolist()))  # only the picked experts ran, once each
            assert calls.count("down") == len(ran)
        calls.clear()


def test_int4_experts_skip_sentinel_index_and_accept_per_expert_lists():
    gen = _gen(21)
    flat = _expert_checkpoint(gen)
    per_expert = [
        {
            p: {k: flat[f"{e}.{p}.{k}"] for k in ("qweight", "qzeros", "scales", "g_idx")}
            for p in ("gate_proj", "up_proj", "down_proj")
        }
        for e in range(E)
    ]
    experts = Int4Experts.from_gptq(
        per_expert,
        num_experts=E,
        hidden_dim=H,
        intermediate_dim=INTER,
        act_fn=nn.SiLU(),
        device="cpu",
        dtype=torch.float32,
    )
    gate_up, down = _dequantized_experts(flat)
    x = torch.randn(9, H, generator=gen)
    idx, w = _routing(9, gen)
    idx[::3, 1] = E  # HF masks experts with the index num_experts
    assert _rel(experts(x, idx, w), _reference_experts(x, idx, w, gate_up, down)) <= 1e-5
    assert experts(x[:0], idx[:0], w[:0]).shape == (0, H)


@pytest.mark.parametrize("max_rows", [5, 16, 32768])
@pytest.mark.parametrize("whole", [False, True], ids=["pieces", "whole"])
def test_int4_experts_long_prompt_route_adds_the_same_output(max_rows, whole, monkeypatch):
    """add_long (a long prompt's MoE: experts dequantized a piece at a time, or all at once where they fit, rows in
    bounded blocks, an expert's rows split across blocks) adds what forward computes, skipped indices included.
    All experts at once through torch._grouped_mm takes the route without host counts."""
    import orin.int4_experts as int4_experts

    gen = _gen(25)
    flat = _expert_checkpoint(gen)
    experts = Int4Experts.from_gptq(flat, num_experts=E, hidden_dim=H, intermediate_dim=INTER, act_fn=nn.SiLU(),
                                    device="cpu", dtype=torch.float32)
    one = 4 * (experts.gate_up_scales_and_zeros.shape[-2] * experts._geom["gate_up"][1]
               + experts.down_scales_and_zeros.shape[-2] * experts._geom["down"][1])
    monkeypatch.setattr(int4_experts, "LONG_DEQUANT_CHUNK", 3 * one)  # pieces of 3 experts
    monkeypatch.setattr(int4_experts, "LONG_WHOLE_EXPERTS_BYTES", E * one if whole else E * one - 1)
    on_device = []
    real = Int4Experts._add_long_on_device
    monkeypatch.setattr(Int4Experts, "_add_long_on_device",
                        lambda self, *a: on_device.append(a[-1]) or real(self, *a))
    x = torch.randn(23, H, generator=gen)
    idx, w = _routing(23, gen)
    idx[::4, 0] = E
    base = torch.randn(23, H, generator=gen)
    got = experts.add_long(x, idx, w, base.clone(), max_rows=max_rows)
    assert _rel(got, base + experts(x, idx, w)) <= 1e-5
    grouped = int4_experts._grouped_mm_works(x.device, torch.float32)
    assert on_device == ([max(1, max_rows // 2)] if whole and grouped else [])


def test_int4_modules_follow_a_model_dtype_change():
    # model.to(dtype) converts the scales_and_zeros buffers; the modules must compute in the new dtype afterwards.
    gen = _gen(24)
    flat = _expert_checkpoint(gen)
    experts = Int4Experts.from_gptq(
        flat, num_experts=E, hidden_dim=H, intermediate_dim=INTER, act_fn=nn.SiLU(), device="cpu", dtype=torch.float32
    )
    packed = random_gptq_v1(H, 32, G, generator=gen, bias=True)
    model = nn.ModuleDict({"experts": experts, "proj": Int4Linear.from_gptq(packed, H, "cpu", torch.float32)})
    x = torch.randn(6, H, generator=gen)
    idx, w = _routing(6, gen)
    before = experts(x, idx, w)  # builds the per-expert views of the fp32 buffers
    model.to(torch.bfloat16)
    assert experts.compute_dtype == model["proj"].compute_dtype == torch.bfloat16
    after = experts(x.bfloat16(), idx, w.bfloat16())
    assert after.dtype == torch.bfloat16 and _rel(after, before) <= 1e-2
    ref = x @ dequantize_gptq_v1(packed, H).T + packed["bias"].float()
    assert _rel(model["proj"](x.bfloat16()), ref) <= 1e-2


def test_int4_experts_read_a_lazy_source_one_expert_at_a_time():
    flat = _expert_checkpoint(_gen(22))

    class Recording(Mapping):
        def __init__(self):
            self.read = []

        def __getitem__(self, key):
            self.read.append(key)
            return flat[key.removeprefix("model.experts.")]

        def __iter__(self):
            return ("model.experts." + k for k in flat)

        def __len__(self):
            return len(flat)

    source = Recording()
    experts = Int4Experts(E, H, INTER, nn.SiLU())
    experts.load_gptq_(source, "cpu", torch.float32, name="model.experts", prefix="model.experts.")
    order = [int(k.split(".")[2]) for k in source.read]
    assert order == sorted(order)  # experts are read in order, a batch at a time
    assert set(int4_tensor_keys(experts)) == set(flat)
    target = Target("model.experts", "thinker_text", "experts", H, H, num_experts=E, intermediate=INTER)
    assert target_runtime_bytes(target, G, scale_bytes=4) == sum(b.nbytes for b in experts.buffers())


def test_int4_experts_refuse_mismatched_checkpoint():
    flat = _expert_checkpoint(_gen(23))
    with pytest.raises(ModelError, match=r"experts\.0-7: expert output sizes in the checkpoint do not match"):
        Int4Experts.from_gptq(
            flat, num_experts=E, hidden_dim=H, intermediate_dim=INTER * 2, act_fn=nn.SiLU(), device="cpu"
        )
    del flat["3.up_proj.qweight"]
    with pytest.raises(ModelError, match=r"experts\.3\.up_proj\.qweight missing"):
        Int4Experts.from_gptq(flat, num_experts=E, hidden_dim=H, intermediate_dim=INTER, act_fn=nn.SiLU(), device="cpu")


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


def test_grouped_matmul_without_torch_grouped_mm_gives_the_same_rows():
    """torch 2.6/2.7 have no torch._grouped_mm and 2.8 only for CUDA sm90: the per-expert matmuls stand in."""
    from orin.int4_experts import _grouped_mm_works, grouped_matmul

    gen = torch.Generator().manual_seed(7)
    counts = [3, 0, 5, 1]
    x = torch.randn(sum(counts), 32, generator=gen)
    w = torch.randn(len(counts), 24, 32, generator=gen)
    ends = torch.tensor(counts).cumsum(0)
    loop = grouped_matmul(x, w, counts, ends, fused=False)
    rows = torch.cat([x[s:e] @ w[i].t() for i, (s, e) in enumerate(zip([0] + ends[:-1].tolist(), ends.tolist(), strict=True))])
    assert torch.allclose(loop, rows, atol=1e-6)
    # the fused path where this torch has a kernel for it (2.9+ on CPU; 2.8 only on CUDA sm90)
    if _grouped_mm_works(x.device, x.dtype):
        assert torch.allclose(grouped_matmul(x, w, counts, ends, fused=True), loop, atol=1e-5)
    assert grouped_matmul(x, w, counts, ends).shape == loop.shape  # the probe picks a path that runs here


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the CUDA int4pack layout needs a CUDA device"))])
def test_experts_converted_in_batches_equal_one_at_a_time(device, monkeypatch):
    """Loading converts a batch of experts as one layer joined along its outputs (orin.int4_experts.convert_batch):
    the buffers are bit-for-bit those of converting each expert alone."""
    import orin.int4_experts as ie

    inter = 64  # gate_up 128 and down 64 outputs per expert: whole row tiles, so a batch joins
    flat = _expert_checkpoint(_gen(31), inter=inter)
    calls = []
    convert = ie.to_kernel
    monkeypatch.setattr(ie, "to_kernel", lambda *a, **k: calls.append(a[-1]) or convert(*a, **k))

    def load(batch):
        monkeypatch.setattr(ie, "LOAD_BATCH_EXPERTS", batch)
        calls.clear()
        return Int4Experts.from_gptq(flat, num_experts=E, hidden_dim=H, intermediate_dim=inter, act_fn=nn.SiLU(),
                                     device=device, dtype=torch.bfloat16)

    one = load(1)
    assert len(calls) == 2 * E
    some = load(3)
    all_at_once = load(E)
    assert len(calls) == 2  # one conversion per projection for all the experts
    for name, buf in one.named_buffers():
        assert torch.equal(dict(some.named_buffers())[name], buf), name
        assert torch.equal(dict(all_at_once.named_buffers())[name], buf), name
    assert one._geom == some._geom == all_at_once._geom
