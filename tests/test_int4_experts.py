"""The INT4 experts (orin.int4.experts) and the MoE backends they run on (orin.int4.moe): each backend's
decode, prompt and long-prompt routes against a float64 loop and HF's experts module, the choice of backend from
the device profile, and the Triton kernels the backends run (on CUDA)."""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import replace

import pytest
import torch
from torch import nn

from orin.checkpoint.gptq_format import dequantize_gptq_v1, random_gptq_v1
from orin.checkpoint.targets import Target, target_runtime_bytes
from orin.device.capabilities import grouped_mm_works, triton_installed
from orin.device.profile import AMPERE, CPU, HOPPER, ORIN
from orin.errors import ModelError
from orin.int4 import moe as moe_backends
from orin.int4 import pack as int4pack
from orin.int4.linear import Int4Experts, Int4Linear, int4_tensor_keys
from orin.int4.moe import CpuBackend, TorchBackend, TritonBackend, choose_backend

# (device, dtype, relative tolerance); CUDA's kernel is bf16 only.
CASES = [("cpu", torch.float32, 1e-5), ("cpu", torch.bfloat16, 1e-2), ("cpu", torch.float16, 1e-2)]
CASES += [("cuda", torch.bfloat16, 1e-2)] if torch.cuda.is_available() else []


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


def _with(profile, group: str, **numbers):
    """`profile` with some numbers of one of its groups (a tuning group, or its capabilities) replaced."""
    return replace(profile, **{group: replace(getattr(profile, group), **numbers)})


# A profile whose MoE runs every row count on tinygemm per expert (the decode-sized route).
PER_EXPERT = {"group": "moe", "grouped_min_rows_per_expert": 1 << 62}


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
    profile = _with(CPU, "moe", prefill_dequant_chunk=3 * 2 * INTER * 64 * 4)  # grouped: 3 experts a chunk
    experts = Int4Experts.from_gptq(
        {k: v.to(device) for k, v in flat.items()},
        num_experts=E,
        hidden_dim=H,
        intermediate_dim=INTER,
        act_fn=hf.act_fn,
        device=device,
        dtype=dtype,
        profile=profile,
    )
    per_expert = type(experts.backend)(_with(profile, **PER_EXPERT))  # any prompt through the decode route
    gate_up_of = {w.data_ptr(): e for e, w in enumerate(experts.gate_up_packed)}
    calls = []
    real_mm = moe_backends.int4_mm

    def spy(x, w, group, sz):
        calls.append(gate_up_of.get(w.data_ptr(), "down"))
        return real_mm(x, w, group, sz)

    monkeypatch.setattr(moe_backends, "int4_mm", spy)
    for T, grouped in ((37, True), (37, False), (1, False)):  # prefill-like batches and a decode token
        x = torch.randn(T, H, generator=gen)
        idx, w = _routing(T, gen)
        if T == 1 or device == "cpu":  # a decode token: tinygemm per expert; on CPU a prompt: grouped_mm
            assert experts.route_for(x, TOPK) == ("grouped_mm" if T > 1 else "tinygemm")
        args = (x.to(device, dtype), idx.to(device), w.to(device, dtype))
        y = per_expert.prefill(experts, *args) if T > 1 and not grouped else experts(*args)
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
@pytest.mark.parametrize("grouped", [False, True], ids=["per-expert", "grouped_mm"])
def test_int4_experts_long_prompt_route_adds_the_same_output(max_rows, whole, grouped):
    """add_long (a long prompt's MoE: experts dequantized a piece at a time, or all at once where they fit, rows in
    bounded blocks, an expert's rows split across blocks) adds what forward computes, skipped indices included.
    All experts at once through torch._grouped_mm (where the profile has it) takes the route without host counts."""
    if grouped and not grouped_mm_works(torch.device("cpu"), torch.float32):
        pytest.skip("this torch has no torch._grouped_mm on CPU")
    gen = _gen(25)
    flat = _expert_checkpoint(gen)
    experts = Int4Experts.from_gptq(flat, num_experts=E, hidden_dim=H, intermediate_dim=INTER, act_fn=nn.SiLU(),
                                    device="cpu", dtype=torch.float32)
    one = 4 * (experts.gate_up_scales_and_zeros.shape[-2] * experts._geom["gate_up"][1]
               + experts.down_scales_and_zeros.shape[-2] * experts._geom["down"][1])
    profile = _with(_with(CPU, "capabilities", grouped_mm=grouped), "moe", long_dequant_chunk=3 * one,  # 3 a piece
                    long_whole_experts_bytes=E * one if whole else E * one - 1)
    on_device = []

    class Recording(CpuBackend):
        def _add_long_on_device(self, *a):
            on_device.append(a[-1])
            return super()._add_long_on_device(*a)

    x = torch.randn(23, H, generator=gen)
    idx, w = _routing(23, gen)
    idx[::4, 0] = E
    base = torch.randn(23, H, generator=gen)
    got = Recording(profile).add_long(experts, x, idx, w, base.clone(), max_rows=max_rows)
    assert _rel(got, base + experts(x, idx, w)) <= 1e-5
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


def test_moe_backend_is_chosen_once_from_the_profile():
    """A layer's MoE backend is one pure choice from the device profile and the packed shapes (no GPU needed to
    make it): "cpu" for the CPU's layout, "triton" where the profile has Triton and orin's kernels pass their
    start-up check, "torch" otherwise; one object per kind and profile, its numbers the profile's."""
    pytest.importorskip("triton")  # the triton backend registers its kernels when built
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    passed, failed = (lambda device: True), (lambda device: False)
    assert choose_backend(CPU, cpu).name == "cpu"
    assert choose_backend(HOPPER, cpu, check=passed).name == "cpu"  # weights in the CPU's layout
    for profile in (HOPPER, ORIN, AMPERE):
        assert choose_backend(profile, cuda, check=passed).name == "triton"
        assert choose_backend(profile, cuda, check=failed).name == "torch"
        assert choose_backend(_with(profile, "capabilities", triton=False), cuda, check=passed).name == "torch"
    assert choose_backend(HOPPER, cuda, check=passed) is choose_backend(HOPPER, cuda, check=passed)
    # the grouped INT4 GEMM takes 4 inner k-tile pairs (a K multiple of 128); other shapes dequantize instead
    tiles = {pairs: torch.empty((E, 8, 2, 32, pairs), dtype=torch.int32, device="meta") for pairs in (2, 4)}
    assert choose_backend(HOPPER, cuda, (tiles[4], tiles[4]), check=passed).grouped_gemm
    assert not choose_backend(HOPPER, cuda, (tiles[4], tiles[2]), check=passed).grouped_gemm
    backends = (CpuBackend(CPU), TorchBackend(HOPPER), TritonBackend(HOPPER))
    assert [b.name for b in backends] == ["cpu", "torch", "triton"]
    backend = TorchBackend(_with(HOPPER, "moe", prefill_dequant_chunk=1 << 20))
    assert backend.tuning.prefill_dequant_chunk == 1 << 20 and backend.grouped_mm
    assert backend.long_block_rows == HOPPER.prefill.long_moe_block_rows
    assert not CpuBackend(CPU).grouped_mm and not CpuBackend(CPU).graph_decode and TorchBackend(CPU).graph_decode


def test_layer_spec_carries_the_profile_and_the_experts_backend():
    """layer_weights puts what the layer functions need of the profile in the spec (the attention tuning, the
    capabilities on this device, the INT4 projections' dequantization row count) and the experts' backend, whose
    name is what the engine's stats show; on CPU the experts module computes the MoE."""
    from orin.model.config import TextConfig
    from orin.model.text import DecoderLayer, SparseMoe
    from orin.runtime.layer import layer_weights

    config = TextConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=E,
                        moe_intermediate_size=INTER, num_experts_per_tok=TOPK)
    layer = DecoderLayer(config, SparseMoe(config, nn.SiLU(), shared=False))
    layer.mlp.experts = Int4Experts.from_gptq(_expert_checkpoint(_gen(26)), num_experts=E, hidden_dim=H,
                                              intermediate_dim=INTER, act_fn=nn.SiLU(), device="cpu",
                                              dtype=torch.float32)
    layer.self_attn.q_proj = Int4Linear.from_gptq(random_gptq_v1(H, 64, G, generator=_gen(27)), H, "cpu",
                                                  torch.float32)
    profile = _with(_with(HOPPER, "attention", few_rows_sdpa_max_keys=7), "prefill", graph_dequant_min_rows=5)
    spec, w = layer_weights(layer, torch.device("cpu"), profile)
    assert spec.backend is layer.mlp.experts.backend and spec.backend.name == "cpu"
    assert w["experts_module"] is layer.mlp.experts and "experts" not in w
    assert spec.attention.few_rows_sdpa_max_keys == 7 and spec.q.dequant_min_rows == 5 and spec.q.int4
    assert not spec.flash_lower_right and not spec.triton  # Hopper's capabilities, on a CPU device
    assert "backend=cpu" in repr(layer.mlp.experts)


def test_grouped_matmul_without_torch_grouped_mm_gives_the_same_rows():
    """torch 2.6/2.7 have no torch._grouped_mm and 2.8 only for CUDA sm90: the per-expert matmuls stand in."""
    from orin.int4.moe import grouped_matmul

    gen = torch.Generator().manual_seed(7)
    counts = [3, 0, 5, 1]
    x = torch.randn(sum(counts), 32, generator=gen)
    w = torch.randn(len(counts), 24, 32, generator=gen)
    ends = torch.tensor(counts).cumsum(0)
    loop = grouped_matmul(x, w, counts, ends, fused=False)
    rows = torch.cat([x[s:e] @ w[i].t() for i, (s, e) in enumerate(zip([0] + ends[:-1].tolist(), ends.tolist(), strict=True))])
    assert torch.allclose(loop, rows, atol=1e-6)
    # the fused path where this torch has a kernel for it (2.9+ on CPU; 2.8 only on CUDA sm90)
    if grouped_mm_works(x.device, x.dtype):
        assert torch.allclose(grouped_matmul(x, w, counts, ends, fused=True), loop, atol=1e-5)
    # the capability probe picks a path that runs here
    assert grouped_matmul(x, w, counts, ends, grouped_mm_works(x.device, x.dtype)).shape == loop.shape


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the CUDA int4pack layout needs a CUDA device"))])
def test_experts_converted_in_batches_equal_one_at_a_time(device, monkeypatch):
    """Loading converts a batch of experts as one layer joined along its outputs (orin.int4.experts.convert_batch):
    the buffers are bit-for-bit those of converting each expert alone."""
    import orin.int4.experts as ie

    inter = 64  # gate_up 128 and down 64 outputs per expert: whole row tiles, so a batch joins
    flat = _expert_checkpoint(_gen(31), inter=inter)
    calls = []
    convert = ie.to_kernel
    monkeypatch.setattr(ie, "to_kernel", lambda *a, **k: calls.append(a[-1]) or convert(*a, **k))

    def load(batch):
        calls.clear()
        return Int4Experts.from_gptq(flat, num_experts=E, hidden_dim=H, intermediate_dim=inter, act_fn=nn.SiLU(),
                                     device=device, dtype=torch.bfloat16,
                                     profile=_with(CPU, "moe", load_batch_experts=batch))

    one = load(1)
    assert len(calls) == 2 * E
    some = load(3)
    all_at_once = load(E)
    assert len(calls) == 2  # one conversion per projection for all the experts
    for name, buf in one.named_buffers():
        assert torch.equal(dict(some.named_buffers())[name], buf), name
        assert torch.equal(dict(all_at_once.named_buffers())[name], buf), name
    assert one._geom == some._geom == all_at_once._geom
    # (kernel group, K_run, N_pad) of each projection, the N_pad the decode step's gathered experts are viewed by
    assert one._geom == {"gate_up": (32, H, 2 * inter), "down": (32, inter, H)}

# ---------------------------------------------------------------- the backends' Triton kernels (CUDA)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton INT4 GEMM runs on CUDA")
@pytest.mark.parametrize("K,N,g,counts", [
    (256, 96, 128, [37, 0, 5, 16, 1]),  # experts with 0, 1 and block-crossing row counts
    (538, 72, 128, [70]),  # one expert = a dense layer; K padded to 640, N padded to 80
    (384, 64, 32, [3, 20]),  # kernel group below the 128-wide super-tile: scales per column
    (320, 48, 64, [9, 30]),  # 2 inner k-tile pairs: no grouped GEMM (dequantize only)
    (96, 32, 32, [17]),  # 1 pair
])
def test_triton_grouped_int4_mm_and_dequantize_match_tinygemm(K, N, g, counts):
    if not triton_installed():
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton INT4 GEMV runs on CUDA")
@pytest.mark.parametrize("K,N,g", [(256, 96, 128), (384, 64, 32), (320, 48, 64)])
def test_triton_moe_gemv_matches_tinygemm(K, N, g):
    if not triton_installed():
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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton INT4 GEMM runs on CUDA")
def test_int4_experts_fused_prefill_matches_per_expert_path():
    from orin.device.capabilities import detect

    device = torch.device("cuda")
    profile = detect(device)
    hidden, inter = 256, 128  # K a multiple of 128: the Triton kernel's layout
    flat = _expert_checkpoint(_gen(30), hidden=hidden, inter=inter, g=128)
    experts = Int4Experts.from_gptq({k: v.cuda() for k, v in flat.items()}, num_experts=E, hidden_dim=hidden,
                                    intermediate_dim=inter, act_fn=nn.SiLU(), device="cuda", profile=profile)
    if experts.backend.name != "triton":
        pytest.skip("no Triton, or orin's kernels failed their start-up check here")
    gen = _gen(31)
    x = torch.randn(37, hidden, generator=gen).bfloat16().cuda()
    idx, w = _routing(37, gen)
    idx[3, 1] = E  # an out-of-range index is skipped on every backend
    idx, w = idx.cuda(), w.bfloat16().cuda()
    assert experts.route_for(x, TOPK) == "triton" and experts.fused(x, TOPK)
    fused = experts(x, idx, w)
    torch_backend = TorchBackend(profile)  # the dequantized chunks, as where Triton is not chosen
    assert torch_backend.prefill_route(experts, 37, TOPK) == "grouped_mm"
    assert _rel(fused, torch_backend.prefill(experts, x, idx, w)) <= 1e-2
    assert _rel(fused, TorchBackend(_with(profile, **PER_EXPERT)).prefill(experts, x, idx, w)) <= 1e-2
    # Kernels that fail their start-up check: the torch backend is chosen when the experts load, not switched to.
    assert choose_backend(profile, device, (experts.gate_up_packed, experts.down_packed),
                          check=lambda device: False).name == "torch"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA backends need a CUDA device")
def test_cuda_backends_compute_the_same_moe():
    """Each CUDA backend (torch, and triton where it is chosen here) on the same experts and inputs: a decode
    step's experts (gathered, or read in place), a prompt's grouped route, and a long prompt's blocks (pieces, and
    every expert at once), against tinygemm per expert."""
    from orin.device.capabilities import detect

    profile = detect(torch.device("cuda"))
    hidden, inter = 256, 128  # K a multiple of 128: the Triton grouped GEMM's layout
    flat = _expert_checkpoint(_gen(32), hidden=hidden, inter=inter, g=128)
    experts = Int4Experts.from_gptq({k: v.cuda() for k, v in flat.items()}, num_experts=E, hidden_dim=hidden,
                                    intermediate_dim=inter, act_fn=nn.SiLU(), device="cuda", profile=profile)
    backends = [TorchBackend(profile)] + ([experts.backend] if experts.backend.name == "triton" else [])
    spec = types.SimpleNamespace(hidden=hidden, inter=inter, top_k=TOPK, gate_up=experts._geom["gate_up"],
                                 down=experts._geom["down"])
    tensors = (experts.gate_up_packed, experts.gate_up_scales_and_zeros, experts.down_packed,
               experts.down_scales_and_zeros)
    gen = _gen(33)
    x = torch.randn(40, hidden, generator=gen).bfloat16().cuda()
    idx, w = _routing(40, gen)
    idx, w = idx.cuda(), w.bfloat16().cuda()
    want = TorchBackend(_with(profile, **PER_EXPERT)).prefill(experts, x, idx, w)
    for backend in backends:
        assert _rel(backend.decode(x[:3], spec, tensors, w[:3], idx[:3]), want[:3]) <= 2e-2, backend
        assert _rel(backend.prefill(experts, x, idx, w), want) <= 1e-2, backend
        for whole in (0, 1 << 40):
            long = type(backend)(_with(profile, "moe", long_whole_experts_bytes=whole))
            assert _rel(long.add_long(experts, x, idx, w, torch.zeros_like(x), max_rows=7), want) <= 1e-2, long
