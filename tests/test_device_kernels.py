"""The CUDA paths of orin.runtime.decode and orin.int4.linear against the HF modules and routes they replace, on a loaded model
in BF16: the decode MoE (the layer's MoE backend: concatenated experts or Triton GEMV) against Int4Experts; the
thinker's static-cache prefill (eager and graph-replayed) and its graph-replayed steps against the HF language
model with a dynamic cache, with and without torch.compile; the code predictor's frame against HF generate(); the
prefill MoE's grouped routes (each backend built from the engine's profile) against tinygemm per expert; an INT4
projection's dense route against tinygemm. On CPU in float32 the same comparisons hold to 1e-5
(tests/test_decode.py); here BF16 and random weights allow more (a near-tie in a router flips an expert), and the
limits below sit a few times over what an H200 measured at the real dimensions, far under what a wrong position,
cache or weight layout gives (tens of percent).

`device` tests: they run with --device-model-dir DIR (the checkpoint to load: the real one on the Orin, or a
synthetic one at the real dimensions, `orin-omni bench --synthetic` / devtools.synthetic) or, given
--device-gpu (or --device-url), on the tiny synthetic checkpoint; they skip where torch sees no CUDA device.
"""

from __future__ import annotations

import pytest
from module_oracle import hf_twin

pytestmark = pytest.mark.device

MOE_DECODE_TOL = 0.03  # fused decode MoE vs Int4Experts: 0.67 % measured
PREFILL_TOL = 0.08  # last logits of a 61-token prefill: 0.42 % eager, 3.2 % graph-replayed
STEP_TOL = 0.10  # logits of the forced decode steps after it: 3.9-4.0 %
CODE_EMBED_TOL = 0.03  # code predictor's embedding sum: 0.52 %
MOE_ROUTE_TOL = 0.02  # grouped prefill MoE vs tinygemm per expert: 0.40 %
LINEAR_ROUTE_TOL = 2e-3  # dense vs tinygemm q_proj: 0.0095 %
PREFILL_ROWS = 467  # the standard request's prompt


def _rel(a, b) -> float:
    """Relative error of `a` against `b` (Frobenius norms, in float32)."""
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


def _cuda_engine(request, budget: int | None = None):
    """An engine on the GPU over the device model (--device-model-dir, else the synthetic checkpoint); with a
    budget nothing exceeds, time-sliced (weights in arenas), nothing evicted but what a test evicts."""
    from orin.runtime.engine import Engine, EngineConfig

    model_dir = request.config.getoption("--device-model-dir") or request.getfixturevalue("synthetic_dir")
    return Engine(EngineConfig(model_dir=model_dir, device="cuda", power_backend="none", verify_checksums=False,
                               compile=False, budget=budget))


@pytest.fixture(scope="module")
def cuda_engine(request):
    """An engine on CUDA with the thinker, talker and code predictor resident (its decoders are not used: each
    test builds the ones it compares)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    engine = _cuda_engine(request)
    with torch.inference_mode():
        for comp in ("thinker_text", "talker", "code_predictor"):
            engine.loader.ensure(comp)
    yield engine
    engine.close()


def _moe_layer(engine):
    lm = engine.model.thinker.model.language_model
    return next(layer for layer in lm.layers if hasattr(layer.mlp, "gate"))


def _with(profile, group: str, **numbers):
    """`profile` with some numbers of one of its groups replaced."""
    from dataclasses import replace

    return replace(profile, **{group: replace(getattr(profile, group), **numbers)})


def _per_expert(engine):
    """A backend of the engine's kind whose prompt route is tinygemm per expert at every row count."""
    experts = _moe_layer(engine).mlp.experts
    return type(experts.backend)(_with(engine.profile, "moe", grouped_min_rows_per_expert=1 << 62))


def test_fused_decode_moe_matches_the_experts_module(cuda_engine):
    """The decode step's MoE (the layer's backend: Triton GEMV, or the gathered experts through tinygemm) against
    the experts module's prompt route."""
    import torch

    from orin.runtime.layer import layer_weights

    layer = _moe_layer(cuda_engine)
    mlp = layer.mlp
    spec, tensors = layer_weights(layer, torch.device("cuda"), cuda_engine.profile)
    assert spec.backend is mlp.experts.backend and spec.backend.name in ("triton", "torch")
    H = cuda_engine.model.thinker.model.language_model.config.hidden_size
    gen = torch.Generator(device="cuda").manual_seed(1)
    errs = []
    with torch.inference_mode():
        for _ in range(4):
            h = torch.randn((1, H), generator=gen, device="cuda").to(torch.bfloat16)
            w, idx = mlp.gate(h)
            errs.append(_rel(spec.backend.decode(h, spec, tensors["experts"], w.to(h.dtype), idx),
                             mlp.experts(h, idx, w)))
    assert max(errs) < MOE_DECODE_TOL, errs


@pytest.mark.parametrize("compile,graph", [(False, False), (False, True), (True, True)],
                         ids=["eager-prefill", "graph", "compiled"])
def test_thinker_decoder_matches_the_hf_prefill_and_steps(cuda_engine, compile, graph):
    """61 random tokens (a graph prefill pads them to its 64-row bucket), then 6 forced tokens (not argmax: a
    random model falls into loops that would hide position errors)."""
    import torch
    from transformers import DynamicCache

    from orin.runtime.decode import PrefillInputs, StaticDecoder

    engine = cuda_engine
    own = engine.model.thinker
    thinker = hf_twin(engine.model, engine.cfg.model_dir).thinker
    lm = thinker.model.language_model
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, 256, (1, 61), generator=gen, device="cuda")  # byte tokens: no media placeholders
    forced = torch.randint(0, 256, (6,), generator=gen, device="cuda").tolist()
    with torch.inference_mode():
        cache = DynamicCache(config=lm.config)
        thinker.model.rope_deltas = None
        ref = thinker.model(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache, use_cache=True)
        ref_prefill = thinker.lm_head(ref.last_hidden_state[:, -1])
        embeds = own.model.language_model.embed_tokens(ids)
        positions = torch.arange(ids.shape[1], device="cuda").view(1, 1, -1).expand(3, 1, -1)
        dec = StaticDecoder(own.model.language_model, own.lm_head, torch.device("cuda"), engine.profile, compile)
        try:
            pre = dec.prefill(PrefillInputs(embeds[0], positions, ids.shape[1] + len(forced) + 24), graph=graph)
            assert _rel(pre.logits, ref_prefill) < PREFILL_TOL
            ours = [dec.step(t).float().clone() for t in forced]
            assert dec.runner.captures >= 1 and dec.runner.compile_error is None
        finally:
            dec.release()
        for t, logits in zip(forced, ours, strict=True):
            o = thinker.model(inputs_embeds=lm.embed_tokens(torch.tensor([[t]], device="cuda")),
                              past_key_values=cache, use_cache=True)
            assert _rel(logits, thinker.lm_head(o.last_hidden_state)[:, -1]) < STEP_TOL


@pytest.mark.parametrize("compile", [False, True], ids=["graph", "compiled"])
def test_code_predictor_matches_hf_generate(cuda_engine, compile):
    """One frame's residual codes, greedy, from a random talker state: the same codes as HF generate(), and the
    sum of the frame's codec embeddings the talker reads next."""
    import torch

    from orin.runtime.decode import CodePredictor

    model = cuda_engine.model
    cp = hf_twin(model, cuda_engine.cfg.model_dir).talker.code_predictor
    H = model.config.talker_config.text_config.hidden_size
    gen = torch.Generator(device="cuda").manual_seed(3)
    with torch.inference_mode():
        past = torch.randn((1, 1, H), generator=gen, device="cuda").to(torch.bfloat16)
        first = model.talker.model.codec_embedding(torch.tensor([[5]], device="cuda"))
        ref = cp.generate(inputs_embeds=torch.cat((past, first), dim=1), max_new_tokens=len(cp.lm_head),
                          output_hidden_states=True, return_dict_in_generate=True, do_sample=False)
        mid = [h[0] for h in ref.hidden_states[1:]]
        last = cp.get_input_embeddings()[-1](ref.sequences[..., -1:])
        ref_sum = torch.cat([first] + mid + [last], dim=1).sum(1, keepdim=True)
        predictor = CodePredictor(model, torch.device("cuda"), cuda_engine.profile, compile)
        try:
            codes, emb = predictor.run(past, first)
            assert predictor.runner.captures == 1 and predictor.runner.compile_error is None
        finally:
            predictor.release()
    assert codes.view(-1).tolist() == ref.sequences.view(-1).tolist()
    assert _rel(emb, ref_sum) < CODE_EMBED_TOL


@pytest.mark.parametrize("route", ["grouped_mm", "triton"])
def test_prefill_moe_routes_match_tinygemm_per_expert(cuda_engine, route):
    """One thinker MoE layer over a prompt's worth of rows: each grouped route (the torch backend's dequantized
    chunks, the triton backend's grouped INT4 GEMM) against tinygemm expert by expert (the decode-sized route);
    the layer's backend picks a grouped one for that many rows."""
    import torch

    from orin.int4.moe import TorchBackend

    layer = _moe_layer(cuda_engine)
    experts = layer.mlp.experts
    gen = torch.Generator(device="cuda").manual_seed(2)
    with torch.inference_mode():
        h = torch.randn((PREFILL_ROWS, experts.hidden_dim), generator=gen, device="cuda").to(torch.bfloat16)
        w, idx = layer.mlp.gate(h)
        picked = experts.route_for(h, idx.shape[1])
        assert picked != "tinygemm"
        if route == "triton" and picked != "triton":
            pytest.skip("the Triton grouped GEMM does not take this checkpoint's packed shapes here")
        backend = experts.backend if route == "triton" else TorchBackend(cuda_engine.profile)
        assert backend.prefill_route(experts, PREFILL_ROWS, idx.shape[1]) == route
        ref = _per_expert(cuda_engine).prefill(experts, h, idx, w)
        got = backend.prefill(experts, h, idx, w)
    assert _rel(got, ref) < MOE_ROUTE_TOL


@pytest.mark.parametrize("whole", [False, True], ids=["pieces", "whole"])
def test_long_prompt_moe_matches_tinygemm_per_expert(cuda_engine, whole):
    """A long prompt's MoE (add_long: experts dequantized once, a piece at a time or all at once, BF16 grouped GEMMs
    in row blocks, the Triton combine) against tinygemm expert by expert, with blocks small enough that experts'
    rows split across them. With all experts at once the host never waits for the GPU (torch's sync check
    raises on any wait)."""
    import torch

    layer = _moe_layer(cuda_engine)
    experts = layer.mlp.experts
    profile = _with(cuda_engine.profile, "moe", long_whole_experts_bytes=1 << 40 if whole else 0)
    backend = type(experts.backend)(profile)
    gen = torch.Generator(device="cuda").manual_seed(5)
    with torch.inference_mode():
        h = torch.randn((PREFILL_ROWS, experts.hidden_dim), generator=gen, device="cuda").to(torch.bfloat16)
        w, idx = layer.mlp.gate(h)
        ref = _per_expert(cuda_engine).prefill(experts, h, idx, w)
        got = backend.add_long(experts, h, idx, w, torch.zeros_like(h), max_rows=333)
        torch.cuda.synchronize()
        if whole:
            torch.cuda.set_sync_debug_mode("error")
        try:
            again = backend.add_long(experts, h, idx, w, torch.zeros_like(h), max_rows=333)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert _rel(got, ref) < MOE_ROUTE_TOL
    # the combine ran as the Triton kernel (the triton backend has no other), whose sums have no atomics: the same
    # bits every time
    assert backend.name == "triton" and torch.equal(got, again)


def test_prefill_chunk_attention_on_flash_matches_the_lower_right_bias():
    """A long prompt's chunk attends to the cache before it and itself, lower-right causal: on flash (the
    capability probe checks it against SDPA's bias; it must pass on an sm80+ GPU) as on the SDPA path, grouped KV
    heads in place."""
    import torch

    from orin.device.capabilities import flash_lower_right_works
    from orin.runtime.attention import _attend_after
    from orin.runtime.layer import LayerSpec

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator(device="cuda").manual_seed(6)
    heads, kv, hd, T, prefix = 32, 4, 128, 300, 700
    q = torch.randn((heads, T, hd), generator=gen, device="cuda").to(torch.bfloat16)
    k_cache = torch.randn((1, kv, 1200, hd), generator=gen, device="cuda").to(torch.bfloat16)
    v_cache = torch.randn((1, kv, 1200, hd), generator=gen, device="cuda").to(torch.bfloat16)
    specs = [LayerSpec(hidden=heads * hd, heads=heads, kv_heads=kv, head_dim=hd, eps=1e-6, qk_eps=1e-6,
                       scaling=hd ** -0.5, q=None, k=None, v=None, o=None, mlp="moe", flash_lower_right=flash)
             for flash in (True, False)]
    with torch.inference_mode():
        assert flash_lower_right_works(q.device, q.dtype, hd)
        got, want = (_attend_after(q, k_cache, v_cache, prefix, spec) for spec in specs)
    assert _rel(got, want) < 1e-2


def test_whole_prompt_attention_on_cudnn_matches_the_chunks_on_flash(cuda_engine):
    """A long prompt's attention whole on cuDNN, one KV group at a time (Hopper: attention_block_long) against
    the chunks on flash that run elsewhere, on a loaded thinker layer: the same layer output and cache rows, with
    the rows padded to the bucket and the cache's stale positions (NaN here) never read into a real row."""
    import torch

    import orin.runtime.attention as dl
    from orin.runtime.layer import layer_weights

    if not cuda_engine.profile.capabilities.cudnn_whole_prompt:
        pytest.skip("cuDNN's whole-prompt attention runs on sm90+ only")
    layer = _moe_layer(cuda_engine)
    spec, w = layer_weights(layer, torch.device("cuda"), cuda_engine.profile)
    gen = torch.Generator(device="cuda").manual_seed(8)
    T, chunk, cache = 700, 256, 1100
    x = torch.randn((T, spec.hidden), generator=gen, device="cuda").to(torch.bfloat16)
    angles = torch.rand((T, spec.head_dim // 2), generator=gen, device="cuda") * T
    cos = torch.cat([angles.cos()] * 2, -1).to(torch.bfloat16)
    sin = torch.cat([angles.sin()] * 2, -1).to(torch.bfloat16)
    pos = torch.arange(cache, device="cuda")
    shape = (1, spec.kv_heads, cache, spec.head_dim)
    k1, v1 = (torch.zeros(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k2, v2 = (torch.full(shape, float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(2))
    with torch.inference_mode():
        want = x.clone()
        for s in range(0, T, chunk):
            e = min(T, s + chunk)
            want[s:e] = dl.attention_block(want[s:e], cos[s:e], sin[s:e], None, pos[s:e], k1, v1, w, spec, prefix=s)
        got = dl.attention_block_long(x.clone(), cos, sin, k2, v2, w, spec, chunk)
    assert torch.isfinite(got).all()
    assert _rel(got, want) < 1e-2
    assert _rel(k2[:, :, :T], k1[:, :, :T]) < 1e-3 and _rel(v2[:, :, :T], v1[:, :, :T]) < 1e-3
    assert _rel(got - x, want - x) < 2e-2  # the attention's own contribution, not only the residual


def test_dense_projection_matches_tinygemm(cuda_engine):
    """The projection's dense route (dequantize + GEMM, as the engine's profile runs it) against tinygemm (the
    same buffers under a profile whose dense route never starts)."""
    import torch

    from orin.int4.linear import Int4Linear

    q = _moe_layer(cuda_engine).self_attn.q_proj
    assert isinstance(q, Int4Linear)
    tinygemm = Int4Linear(q.in_features, q.out_features, bias=q.has_bias).load_packed_(
        *q.packed_state(), "cuda", profile=_with(cuda_engine.profile, "prefill", linear_dequant_min_rows=1 << 62))
    gen = torch.Generator(device="cuda").manual_seed(4)
    with torch.inference_mode():
        h = torch.randn((PREFILL_ROWS, q.in_features), generator=gen, device="cuda").to(torch.bfloat16)
        assert q.route_for(PREFILL_ROWS) == "dense" and tinygemm.route_for(PREFILL_ROWS) == "tinygemm"
        got, ref = q(h), tinygemm(h)
    assert _rel(got, ref) < LINEAR_ROUTE_TOL


def test_encoders_replayed_from_graphs_equal_eager(cuda_engine):
    """The audio and vision encoders replayed from their CUDA graphs (orin.runtime.encoder_graphs) give the eager
    outputs, on the first replay and the next; a shape gets one capture; a swap of the encoder's weights
    (evict, load) gives the same output (a re-capture where the weights landed elsewhere)."""
    import torch

    from orin.contract import GenerationRequest
    from orin.inputs.media import synth_image, synth_speechlike
    from orin.runtime.thinker import AudioTokenCache

    engine = cuda_engine
    parts = [{"type": "image", "image": synth_image(224)}, {"type": "audio", "audio": synth_speechlike(2.0)},
             {"type": "text", "text": "hi"}]
    prompt = engine.prepare(GenerationRequest(messages=({"role": "user", "content": parts},)))
    x = {k: (v.to("cuda") if hasattr(v, "to") else v) for k, v in prompt.inputs.items()}
    graphs = engine.thinker.encoder_graphs
    engine.thinker.audio_tokens = AudioTokenCache(limit=0)  # keeps nothing: the encoder runs every time
    with torch.inference_mode():
        for comp in ("audio_encoder", "vision_encoder"):
            engine.loader.ensure(comp)
        eager_a = engine.thinker.encode_audio(x, prompt)
        eager_v = engine.thinker.encode_image(x, prompt)
        before = graphs.captures
        for _ in range(2):
            assert torch.equal(engine.thinker.encode_audio(x, prompt, graph=True), eager_a)
            v = engine.thinker.encode_image(x, prompt, graph=True)
            assert torch.equal(v.embeds, eager_v.embeds)
            assert all(torch.equal(a, b) for a, b in zip(v.deepstack, eager_v.deepstack, strict=True))
        assert graphs.captures == before + 2
        engine.loader.evict("audio_encoder")
        engine.loader.ensure("audio_encoder")
        assert torch.equal(engine.thinker.encode_audio(x, prompt, graph=True), eager_a)
    engine.thinker.audio_tokens = AudioTokenCache()


def _predictor_frame(engine, seed: int):
    """The code predictor resident, a random frame input, and the codes and embedding it gives."""
    import torch

    predictor = engine.decoders.code_predictor
    H = engine.model.config.talker_config.text_config.hidden_size
    gen = torch.Generator(device="cuda").manual_seed(seed)
    engine.loader.ensure("code_predictor")
    past = torch.randn((1, 1, H), generator=gen, device="cuda").to(torch.bfloat16)
    first = engine.model.talker.model.codec_embedding(torch.tensor([[5]], device="cuda"))
    codes, emb = (t.clone() for t in predictor.run(past, first))
    return predictor, past, first, codes, emb


def _back_in_place(engine, frame, captures: int, where: list[int]) -> None:
    """With the code predictor evicted and a squatter of half its size allocated in the common pool, loading it
    again puts its weights at `where`, and its frame graph replays (no capture) to the same codes."""
    import torch

    predictor, past, first, codes, emb = frame
    squatter = torch.full((engine.loader.sizes()["code_predictor"] // 2,), 7, dtype=torch.int16, device="cuda")
    engine.loader.ensure("code_predictor")
    engine.decoders.weights_may_have_moved()
    assert [p.data_ptr() for p in engine.model.talker.code_predictor.parameters()] == where
    again, emb_again = predictor.run(past, first)
    assert torch.equal(again, codes) and torch.equal(emb_again, emb)
    assert predictor.runner.captures == captures
    del squatter


def test_weights_swapped_out_and_in_land_where_they_were(cuda_engine):
    """Weights have a memory pool of their own (Loader.weights_memory): what the request allocates while a
    component is out (here a squatter of its size, in the common pool) cannot take its blocks, so it comes back
    at the same addresses and its decode graph is replayed, not captured again."""
    import torch

    engine = cuda_engine
    with torch.inference_mode():
        predictor, past, first, codes, emb = _predictor_frame(engine, seed=7)
        captures = predictor.runner.captures
        where = [p.data_ptr() for p in engine.model.talker.code_predictor.parameters()]
        engine.loader.evict("code_predictor")
        _back_in_place(engine, (predictor, past, first, codes, emb), captures, where)


def test_time_sliced_weights_are_unmapped_when_evicted_and_mapped_back_at_their_addresses(request):
    """Under a budget the loader maps each unit's weights at addresses of its own (orin.memory.arena): evicting
    the code predictor gives its memory back to the driver (the device's free memory grows by its size, which
    the common pool then takes), and loading it again maps it where it was, so its frame graph is replayed, not
    captured again, and gives the same codes."""
    import torch

    engine = _cuda_engine(request, budget=1 << 40)
    try:
        assert engine.loader.mapped_bytes() is not None, "this driver has no virtual memory management"
        with torch.inference_mode():
            engine.loader.ensure("talker")
            # a first load converts (and writes the packed copy), later ones read the copy: from then on the
            # unit's tensors come in the same order, to the same places
            engine.loader.ensure("code_predictor")
            engine.loader.evict("code_predictor")
            predictor, past, first, codes, emb = _predictor_frame(engine, seed=11)
            captures = predictor.runner.captures
            where = [p.data_ptr() for p in engine.model.talker.code_predictor.parameters()]
            size = engine.loader.sizes()["code_predictor"]
            torch.cuda.synchronize()
            free_in = torch.cuda.mem_get_info()[0]
            engine.loader.evict("code_predictor")
            freed = torch.cuda.mem_get_info()[0] - free_in
            assert freed >= size, (freed, size)
            _back_in_place(engine, (predictor, past, first, codes, emb), captures, where)
    finally:
        engine.close()


def test_a_budgeted_engine_hands_the_allocators_free_cache_back_before_counting_what_was_held(request):
    """The loader caps the allocator at what the budget leaves plus what the process held before the engine;
    blocks cached but free then (the bench's 17 GB storage read) are given back first, not counted as held: they
    let an 18 GiB engine hold 21.4 GiB."""
    import torch

    block = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    del block
    cached = torch.cuda.memory_reserved()
    assert cached >= 1 << 30
    engine = _cuda_engine(request, budget=1 << 40)
    try:
        assert engine.loader.mapped_bytes() is not None, "this driver has no virtual memory management"
        assert torch.cuda.memory_reserved() <= cached - (1 << 30)
    finally:
        engine.close()


def test_code_predictor_recaptures_after_its_weights_move(cuda_engine):
    """Swapped out and in between two requests, the code predictor's weights land elsewhere; its frame graph must
    be re-captured, not replayed onto the freed (here: reoccupied) memory. The engine tells the decoders after
    every stage (Decoders.weights_may_have_moved)."""
    import torch

    engine = cuda_engine
    with torch.inference_mode():
        predictor, past, first, codes, emb = _predictor_frame(engine, seed=5)
        captures = predictor.runner.captures
        engine.loader.evict("code_predictor")
        with engine.loader.weights_memory():  # where the weights are allocated: their old blocks taken
            squatter = torch.full((engine.loader.sizes()["code_predictor"] // 2,), 7, dtype=torch.int16,
                                  device="cuda")
        engine.loader.ensure("code_predictor")
        engine.decoders.weights_may_have_moved()
        again, emb_again = predictor.run(past, first)
        assert torch.equal(again, codes) and torch.equal(emb_again, emb)
        assert predictor.runner.captures == captures + 1
        del squatter


def test_a_capture_waits_for_the_background_load_under_way(cuda_engine):
    """A decoder graph captured while the prefetch thread loads another component (the thinker re-captures its
    step after taking a layer back, while the speech side arrives): the capture and the load take turns
    (orin.cuda_gate) instead of one failing with 'operation not permitted when stream is capturing'."""
    import torch

    engine = cuda_engine
    with torch.inference_mode():
        predictor, past, first, codes, emb = _predictor_frame(engine, seed=6)
        captures = predictor.runner.captures
        for _ in range(3):
            engine.loader.evict("talker")
            engine.loader.prefetch("talker")
            predictor.runner.release()  # the next run captures while the talker loads
            again, emb_again = predictor.run(past, first)
            engine.loader.settle()
            assert torch.equal(again, codes) and torch.equal(emb_again, emb)
        assert predictor.runner.captures == captures + 3 and engine.loader.is_resident("talker")


def test_time_sliced_replays_graphs_over_the_weights_that_stay_and_answers_as_all_resident(cuda_engine, request):
    """Under a budget where the thinker and the vision encoder stay and the rest moves, consecutive requests
    replay the thinker's prefill from one graph (captured once, not again as the other components come and go)
    and give the all-resident engine's tokens and codec frames."""
    import torch

    from orin.contract import AudioChunk, Done, GenerationRequest
    from orin.inputs.media import synth_image, synth_speechlike

    req = GenerationRequest(messages=({"role": "user", "content": [
        {"type": "image", "image": synth_image(96, seed=3)}, {"type": "audio", "audio": synth_speechlike(1.5, seed=4)},
        {"type": "text", "text": "What is this?"}]},), max_new_tokens=6, max_audio_frames=6, ignore_eos=True)

    def outcome(engine):
        events = list(engine.stream(req))
        report = next(e.report for e in events if isinstance(e, Done))
        return report, (report.token_ids, tuple(f for e in events if isinstance(e, AudioChunk) for f in e.frames))

    engine = _cuda_engine(request)
    try:
        verdict = engine.plan(req).verdict
        sizes = engine.loader.sizes()
        want = [outcome(engine)[1] for _ in range(2)][-1]
    finally:
        engine.close()
    budget = verdict.all_resident_bytes - sum(sizes[c] for c in ("talker", "code_predictor", "code2wav")) + \
        sizes["code2wav"] // 2
    engine = _cuda_engine(request, budget)
    try:
        with torch.inference_mode():
            for i in range(3):
                graphs = engine.plan(req).graphs
                report, got = outcome(engine)
                assert got == want, f"request {i} differs from all-resident"
                if i:
                    assert "thinker_text" in graphs and "prefill_graph" in report.timeline_s, report.timeline_s
                    assert {s.component for s in report.swaps} - set(graphs), report.swaps  # the rest moved
        assert engine.decoders.thinker.prefill_captures == 1
    finally:
        engine.close()


def test_no_two_units_share_a_device_block(cuda_engine):
    """Plain tensors are views of the block they were read in (BF16 on CUDA: no copy): a block must hold one
    unit's tensors only, or evicting that unit would free nothing while another unit's view pins the block."""
    from orin import components as C

    engine = cuda_engine
    engine.loader.ensure("thinker_text")
    engine.loader.ensure("talker")
    owner: dict[int, str] = {}
    shared = 0
    for name, p in engine.model.named_parameters():
        unit = C.unit_of(name)
        if unit is None or p.device.type != "cuda" or C.unit_component(unit) not in ("thinker_text", "talker"):
            continue
        ptr = p.untyped_storage().data_ptr()
        shared += owner.setdefault(ptr, unit) != unit
    assert shared == 0


def test_packed_copies_give_the_converted_buffers_on_cuda(cuda_engine, tmp_path):
    """The CUDA int4pack layout through orin.memory.packed_cache: the first load writes each INT4 unit's copy, the next
    reads it, and every buffer is bit-identical to what the conversion gave; a block read holds one unit only."""
    import torch

    from orin import components as C
    from orin.memory.packed_cache import PackedCache

    engine = cuda_engine
    loader = engine.loader
    comps = ("thinker_text", "talker")

    def buffers():
        return {(p, b): t.clone() for p, s in loader.shells.items() if C.component_of(p + ".") in comps
                for b, t in s.packed_state()[0].items()}

    loader.packed = PackedCache.open(tmp_path, engine.ckpt, engine.device, engine.dtype)
    try:
        with torch.inference_mode():
            for comp in comps:
                loader.ensure(comp)
            converted = buffers()
            loader.take_swaps()
            for _ in range(2):  # the first pass writes the copies, the second reads them
                for comp in comps:
                    loader.evict(comp)
                for comp in comps:
                    loader.ensure(comp)
            ins = [s for s in loader.take_swaps() if s.direction == "in"]
            units = {C.unit_of(p + ".") for p in loader.shells if C.component_of(p + ".") in comps}
            assert sum(s.written for s in ins) == len(units) and sum(s.packed for s in ins) == len(units)
            got = buffers()
            assert got.keys() == converted.keys()
            assert all(torch.equal(got[k], converted[k]) for k in converted)
            owner: dict[int, str] = {}
            for path, shell in loader.shells.items():
                if C.component_of(path + ".") in comps:
                    for t in shell.packed_state()[0].values():
                        unit = owner.setdefault(t.untyped_storage().data_ptr(), C.unit_of(path + "."))
                        assert unit == C.unit_of(path + "."), path
    finally:
        loader.packed = None
        engine.decoders.weights_may_have_moved()


def test_deferred_captures_give_the_eager_results(cuda_engine):
    """A server's engine (defer_captures): the first request of a shape runs its prefills and encoders eagerly
    and captures nothing; the idle turn captures the buckets (and an encoder shape once seen twice); the requests
    that replay them give the same tokens, codec frames and audio (code2wav's chunks replayed too), the same as
    without deferral."""
    import torch

    from orin.contract import AudioChunk, GenerationRequest
    from orin.inputs.media import synth_speechlike
    from orin.runtime.thinker import AudioTokenCache

    engine = cuda_engine
    parts = [{"type": "audio", "audio": synth_speechlike(2.0)}, {"type": "text", "text": "Answer."}]
    req = GenerationRequest(messages=({"role": "user", "content": parts},), max_new_tokens=8, max_audio_frames=6,
                            ignore_eos=True)

    def run():
        engine.thinker.audio_tokens = AudioTokenCache()  # the encoder runs each time (its graphs are under test)
        events = list(engine.stream(req))
        frames = [f for e in events if isinstance(e, AudioChunk) for f in e.frames]
        samples = [e.samples.tobytes() for e in events if isinstance(e, AudioChunk)]
        return events[-1].report.token_ids, frames, samples

    thinker, graphs = engine.decoders.thinker, engine.thinker.encoder_graphs
    reference = run()  # captures inline, as the CLI and the bench do
    engine.defer_captures(True)
    try:
        for dec in (thinker, engine.decoders.talker):
            dec.release()
        graphs.release()
        engine.vocoder_graphs.release()
        before = (thinker.prefill_captures, graphs.captures)
        assert run() == reference
        assert (thinker.prefill_captures, graphs.captures) == before  # the request captured no prefill or encoder
        assert engine.capture_deferred(lambda: False) > 0
        assert thinker.prefill_captures > before[0] and engine.vocoder_graphs.captures > 0
        assert run() == reference  # replayed; the encoder's shape now seen twice
        assert engine.capture_deferred(lambda: False) > 0 and graphs.captures > before[1]
        with torch.inference_mode():
            assert run() == reference
    finally:
        engine.defer_captures(False)


def test_decode_attention_over_a_long_cache_matches_sdpa():
    """A decode step's attention in bf16 on the GPU (scores in float32) against SDPA's, over a 25k-position cache
    a third of which is masked."""
    import torch
    import torch.nn.functional as F

    import orin.runtime.attention as dl
    from orin.device.profile import HOPPER

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator(device="cuda").manual_seed(8)
    kv, rep, hd, L = 4, 8, 128, 25600
    q = torch.randn((kv, rep, hd), generator=gen, device="cuda").to(torch.bfloat16)
    k = torch.randn((kv, L, hd), generator=gen, device="cuda").to(torch.bfloat16)
    v = torch.randn((kv, L, hd), generator=gen, device="cuda").to(torch.bfloat16)
    mask = (torch.arange(L, device="cuda") < 17000).view(1, 1, L)
    with torch.inference_mode():
        got = dl._attend_few(q, k[:, :1], v[:, :1], torch.zeros(1, dtype=torch.long, device="cuda"),
                             k.unsqueeze(0), v.unsqueeze(0), mask, hd ** -0.5,
                             HOPPER.attention.few_rows_sdpa_max_keys)
        want = F.scaled_dot_product_attention(q.unsqueeze(0).float(), k.unsqueeze(0).float(), v.unsqueeze(0).float(),
                                              attn_mask=mask.unsqueeze(0), scale=hd ** -0.5)[0]
    assert _rel(got, want) < 1e-2


def test_rms_norm_on_cuda_is_hfs_to_a_rounding():
    """The layer function's RMSNorm through torch's fused CUDA rms_norm, at the thinker's width and a video
    prefill's chunk, against HF's module (float32 steps, then rounding and scale): the fused kernel sums the
    squares in another order, so an element may round the other way (at most a bf16 step of the result, in few
    elements); whole and by rows alike."""
    import torch
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextRMSNorm

    import orin.runtime.attention as dl

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator(device="cuda").manual_seed(5)
    norm = Qwen3OmniMoeThinkerTextRMSNorm(2048, eps=1e-6).to("cuda", torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(2048, generator=gen, device="cuda"))
    x = (torch.randn((5000, 2048), generator=gen, device="cuda") * 4).to(torch.bfloat16)
    with torch.inference_mode():
        want = norm(x)
        for got in (dl._rms(x, norm.weight, 1e-6), dl._rms_rows(x, norm.weight, 1e-6, 4096)):
            torch.testing.assert_close(got, want, rtol=2 ** -6, atol=1e-6)  # two roundings
            assert (got != want).float().mean() < 0.01


def test_moe_activation_kernel_is_the_torch_ops_to_a_rounding():
    """A long prompt's MoE activation as one Triton pass (silu of the gate half times the up half, padded to the
    down projection's K) against Int4Experts' torch ops, bfloat16, at the thinker's and the talker's widths: an
    element may round the other way (Triton's exp is not CUDA's expf), in few elements; the kernel ran (the
    triton backend's activation for SiLU experts)."""
    import types

    import torch
    import torch.nn.functional as F
    from torch import nn

    from orin.device.profile import HOPPER
    from orin.int4.moe import TritonBackend

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    backend = TritonBackend(HOPPER)
    gen = torch.Generator(device="cuda").manual_seed(8)
    for inter, k_out in ((768, 768), (384, 384), (300, 384)):
        gate_up = (torch.randn((5000, 2 * inter + 16), generator=gen, device="cuda") * 4).to(torch.bfloat16)
        experts = types.SimpleNamespace(act_fn=nn.SiLU(), intermediate_dim=inter, _geom={"down": (0, k_out, 0)},
                                        _act=lambda _: None)  # the torch ops: never reached for SiLU
        with torch.inference_mode():
            got = backend._act_long(experts, gate_up)
            want = F.pad(F.silu(gate_up[:, :inter]) * gate_up[:, inter:2 * inter], (0, k_out - inter))
        assert got is not None
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=2 ** -12)  # one bfloat16 step
        assert (got != want).float().mean() < 0.01


def test_query_key_norm_and_rotary_kernel_is_the_torch_ops_to_a_rounding():
    """The long attention's per-head norm and rotary embedding as one Triton kernel, written into the queries'
    buffer and the KV cache slices, against the torch ops it replaces (_rms then _rope, bfloat16 at every step)
    at the thinker's query and key widths and a video prefill's chunk: the norm's sum runs in another order, so
    an element may round the other way (at most a step or two of the result, in few elements); nothing outside
    the written slice changes; the kernel ran (it takes these shapes)."""
    import torch

    import orin.runtime.attention as dl
    from orin.kernels import norm_rope

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator(device="cuda").manual_seed(7)
    T, hd = 4096, 128
    ang = torch.rand((T, hd // 2), generator=gen, device="cuda") * 100
    cos = torch.cat([ang.cos()] * 2, -1).to(torch.bfloat16)
    sin = torch.cat([ang.sin()] * 2, -1).to(torch.bfloat16)
    for heads in (32, 4):
        y = (torch.randn((T, heads * hd), generator=gen, device="cuda") * 3).to(torch.bfloat16).view(T, heads, hd)
        weight = torch.randn(hd, generator=gen, device="cuda").to(torch.bfloat16)
        buf = torch.zeros((1, heads, T + 1024, hd), dtype=torch.bfloat16, device="cuda")
        with torch.inference_mode():
            assert norm_rope.supports(buf[0, :, 512:512 + T], y, weight, cos, sin)
            dl.norm_rope_into(buf[0, :, 512:512 + T], y, weight, 1e-6, cos, sin, triton=True)
            want = dl._rope(dl._rms(y, weight, 1e-6).transpose(0, 1), cos, sin)
        got = buf[0, :, 512:512 + T]
        torch.testing.assert_close(got, want, rtol=2 ** -5, atol=2 ** -6)  # a rounding, carried through the rope
        assert (got != want).float().mean() < 0.01
        assert not buf[0, :, :512].any() and not buf[0, :, 512 + T:].any()
