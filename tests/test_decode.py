"""orin.runtime.decode, the engine's only decode path, against the HF modules it replaces (the oracle): the thinker's
prefill and steps, the talker and code predictor through the whole pipeline against HF generate(), and the text
embeddings the talker reads once the thinker is swapped out. CPU, on the synthetic INT4 checkpoint."""

from __future__ import annotations

import pytest
import torch
from module_oracle import hf_twin

from orin.contract import AudioChunk, GenerationRequest


def _speech_request(tokens=10, frames=5, ignore_eos=True):
    from orin.inputs.media import synth_image, synth_speechlike

    parts = [{"type": "image", "image": synth_image(224)}, {"type": "audio", "audio": synth_speechlike(1.0)},
             {"type": "text", "text": "Describe it all."}]
    return GenerationRequest(messages=({"role": "user", "content": parts},), max_new_tokens=tokens,
                             max_audio_frames=frames, ignore_eos=ignore_eos)


@pytest.fixture(scope="module")
def synthetic_engine(synthetic_dir):
    from orin.runtime.engine import Engine, EngineConfig

    engine = Engine(EngineConfig(model_dir=synthetic_dir, device="cpu", power_backend="none", verify_checksums=False))
    yield engine
    engine.close()


def test_static_decoder_matches_the_hf_step(synthetic_engine):
    """Same logits as the HF modules with a dynamic cache, over forced tokens (not argmax: a random tiny model
    falls into loops that would hide position errors)."""
    from transformers import DynamicCache

    from orin.runtime.decode import PrefillInputs, StaticDecoder

    engine = synthetic_engine
    engine.loader.ensure("thinker_text")
    own = engine.model.thinker.model.language_model
    model = hf_twin(engine.model, engine.cfg.model_dir)
    lm = model.thinker.model.language_model
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, 20), generator=gen)
    with torch.inference_mode():
        cache = DynamicCache(config=lm.config)
        model.thinker.model.rope_deltas = None
        model.thinker.model(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache, use_cache=True)
        dec = StaticDecoder(own, engine.model.thinker.lm_head, torch.device("cpu"), engine.profile)
        positions = torch.arange(20).view(1, 1, -1).expand(3, 1, -1)
        dec.prefill(PrefillInputs(lm.embed_tokens(ids)[0], positions, 40))
        assert dec.max_len % 64 == 0 and dec.length == 20
        for token in torch.randint(0, 256, (12,), generator=gen).tolist():
            fast = dec.step(token)
            tok = torch.tensor([[token]])
            out = model.thinker.model(inputs_embeds=lm.embed_tokens(tok), past_key_values=cache, use_cache=True)
            ref = model.thinker.lm_head(out.last_hidden_state)[:, -1]
            assert float((fast - ref).norm() / ref.norm()) < 1e-5


def test_fast_talker_and_code_predictor_give_the_hf_frames(synthetic_engine):
    """The pipeline (orin.runtime.decode for thinker, talker and code predictor) against HF generate() on the same
    weights, greedy: same text tokens, same codec frames (through HF's code2wav), same audio."""
    engine = synthetic_engine
    req = _speech_request(tokens=10, frames=5, ignore_eos=False)
    events = list(engine.stream(req))
    report = events[-1].report
    frames = [f for e in events if isinstance(e, AudioChunk) for f in e.frames]
    assert len(frames) == report.talker_frames > 0
    assert engine.decoders.talker.length > 0  # the static talker really ran
    prompt = engine.prepare(req)
    model = hf_twin(engine.model, engine.cfg.model_dir)
    with torch.inference_mode():
        seq, wav = model.generate(
            **prompt.inputs, return_audio=True, speaker="ethan", thinker_max_new_tokens=10, thinker_do_sample=False,
            talker_do_sample=False, talker_max_new_tokens=report.talker_frames + 1,
            thinker_eos_token_id=engine.config.im_end_token_id)
        assert tuple(seq[0, prompt.length:].tolist()) == report.token_ids
        codes = torch.tensor(frames).T.unsqueeze(0)
        ours = engine.model.code2wav.chunked_decode(codes, chunk_size=300, left_context_size=25).reshape(-1)
    ref = wav.reshape(-1)
    k = min(ours.numel(), ref.numel())
    assert k > 0 and float(abs(ours[:k] - ref[:k]).max()) < 1e-4


def test_fast_prefill_matches_the_hf_prefill(synthetic_engine):
    """orin.runtime.decode's prefill (audio and image merged, deepstack on the first layers, M-RoPE) against the HF
    language model with a dynamic cache: last logits, the hidden states the talker reads, every layer's keys
    and values, and the decode steps that follow; unpadded and padded to a bucket as the CUDA graphs are."""
    from transformers import DynamicCache

    from orin.runtime.decode import PrefillInputs

    engine = synthetic_engine
    prompt = engine.prepare(_speech_request())
    for comp in ("audio_encoder", "vision_encoder", "thinker_text"):
        engine.loader.ensure(comp)
    inputs = prompt.inputs
    n, accept = prompt.length, engine.config.talker_config.accept_hidden_layer
    thinker = hf_twin(engine.model, engine.cfg.model_dir).thinker
    gen = torch.Generator().manual_seed(1)
    forced = torch.randint(0, 256, (6,), generator=gen).tolist()
    with torch.inference_mode():
        audio = engine.thinker.encode_audio(inputs, prompt)
        image = engine.thinker.encode_image(inputs, prompt)
        for bucket in (1, n + 5):
            embeds, positions, delta, visual = engine.thinker.merge(inputs, prompt, audio, image)
            assert visual is not None and len(visual[1]) == 2  # deepstack into layers 0 and 1
            image_mask = torch.zeros((1, n), dtype=torch.bool)
            image_mask[0, visual[0]] = True
            cache = DynamicCache(config=thinker.model.language_model.config)
            out = thinker.model.language_model(
                inputs_embeds=embeds, attention_mask=inputs["attention_mask"], position_ids=positions,
                past_key_values=cache, use_cache=True, output_hidden_states=True, visual_pos_masks=image_mask,
                deepstack_visual_embeds=visual[1])
            ref_logits = thinker.lm_head(out.last_hidden_state[:, -1:])[:, -1]
            ref_states = {i: out.hidden_states[i] for i in (0, accept)}
            thinker.model.rope_deltas = torch.tensor([[delta]])  # HF's decode steps continue from it
            embeds, positions, delta, visual = engine.thinker.merge(inputs, prompt, audio, image)
            fast = engine.decoders.thinker
            res = fast.prefill(PrefillInputs(embeds[0], positions, n + 8, record=(0, accept), visual=visual,
                                             rope_delta=delta, bucket=bucket))
            assert fast.length == n and fast.max_len >= n + 8
            assert float((res.logits - ref_logits).norm() / ref_logits.norm()) < 1e-5
            for i in (0, accept):
                assert res.states[i].shape == ref_states[i].shape
                assert torch.allclose(res.states[i], ref_states[i], atol=1e-5, rtol=1e-4)
            for i, layer in enumerate(cache.layers):
                assert torch.allclose(fast.k_cache[i][:, :, :n], layer.keys, atol=1e-5, rtol=1e-4)
                assert torch.allclose(fast.v_cache[i][:, :, :n], layer.values, atol=1e-5, rtol=1e-4)
            for token in forced:
                ours = fast.step(token)
                o = thinker.model(inputs_embeds=thinker.model.get_input_embeddings()(torch.tensor([[token]])),
                                  past_key_values=cache, use_cache=True)
                ref = thinker.lm_head(o.last_hidden_state)[:, -1]
                assert float((ours - ref).norm() / ref.norm()) < 1e-5


def test_sampled_talker_is_seeded_and_differs_from_greedy(synthetic_engine):
    """talker_temperature > 0 samples the talker and the code predictor (on the same decode path) from the
    request's seed: the same seed gives the same frames, the greedy request other frames."""

    def frames_of(**kw):
        req = GenerationRequest(messages=({"role": "user", "content": "Say something."},), max_new_tokens=4,
                                max_audio_frames=6, ignore_eos=True, **kw)
        return [f for e in synthetic_engine.stream(req) if isinstance(e, AudioChunk) for f in e.frames]

    a = frames_of(talker_temperature=0.9, seed=5)
    assert len(a) == 6 and a == frames_of(talker_temperature=0.9, seed=5)
    assert a != frames_of(talker_temperature=0.0)


def test_talker_gets_text_embeddings_after_the_thinker_is_swapped_out(synthetic_engine):
    from orin.errors import ModelError
    from orin.runtime.thinker import TextEmbeddings

    engine = synthetic_engine
    engine.loader.ensure("thinker_text")
    embeddings = TextEmbeddings(engine.model, engine.config, engine.device, engine.loader.is_resident)
    ids = torch.tensor([[7, 42, engine.config.tts_pad_token_id]])
    with torch.inference_mode():
        want = embeddings(ids).clone()
        embeddings.remember([7, 42])
        engine.loader.evict("thinker_text")
        assert torch.equal(embeddings(ids), want)
        with pytest.raises(ModelError, match="no remembered embedding"):
            embeddings(torch.tensor([[99]]))


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("gemms", [True, False])
def test_few_query_rows_attend_as_sdpa_over_the_masked_cache(rows, gemms):
    """A decode step's (and the code predictor's) attention: the new keys and values written at their
    positions, then two GEMMs over the whole static cache with the unwritten positions masked, equal to SDPA's
    with the same mask; positions past the mask never count."""
    import torch.nn.functional as F

    import orin.runtime.attention as dl

    sdpa_max_keys = 0 if gemms else 4096  # the profile's attention.few_rows_sdpa_max_keys
    gen = torch.Generator().manual_seed(3)
    kv, rep, hd, L, upto = 2, 4, 16, 40, 23
    q = torch.randn((kv, rep * rows, hd), generator=gen)
    k_cache = torch.randn((1, kv, L, hd), generator=gen)
    v_cache = torch.randn((1, kv, L, hd), generator=gen)
    k_new, v_new = torch.randn((kv, rows, hd), generator=gen), torch.randn((kv, rows, hd), generator=gen)
    pos = torch.arange(upto + 1 - rows, upto + 1)
    mask = (torch.arange(L) <= upto).view(1, 1, L).expand(1, rep * rows, L)
    got = dl._attend_few(q, k_new, v_new, pos, k_cache, v_cache, mask[0], 0.25, sdpa_max_keys)
    assert torch.equal(k_cache[0, :, pos], k_new) and torch.equal(v_cache[0, :, pos], v_new)
    want = F.scaled_dot_product_attention(q.unsqueeze(0), k_cache, v_cache, attn_mask=mask, scale=0.25)
    torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-5)
    k_cache[:, :, upto + 1:] = 1e4  # garbage past the mask
    torch.testing.assert_close(dl._attend_few(q, k_new, v_new, pos, k_cache, v_cache, mask[0], 0.25, sdpa_max_keys),
                               got)


def test_whole_prompt_attention_equals_the_chunks(engine):
    """A long prompt's attention whole, one KV group at a time (attention_block_long: cuDNN's on Hopper, run
    here with SDPA's math kernel, so the path is checked without a GPU) against the chunks that run elsewhere,
    on the tiny thinker's INT4 layer: the same layer output and cache rows, with rows padded to the bucket and the
    cache's stale positions (NaN here) never read into a real row."""
    from torch.nn.attention import SDPBackend

    import orin.runtime.attention as dl
    from orin.runtime.layer import layer_weights

    engine.loader.ensure("thinker_text")
    layer = engine.model.thinker.model.language_model.layers[0]
    spec, w = layer_weights(layer, torch.device("cpu"), engine.profile)
    dtype = w["ln1"].dtype
    gen = torch.Generator().manual_seed(8)
    T, chunk, cache = 300, 128, 1100  # three chunks, the last a short one; padded to 1,024 rows
    x = torch.randn((T, spec.hidden), generator=gen).to(dtype)
    angles = torch.rand((T, spec.head_dim // 2), generator=gen) * T
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(dtype) for f in (torch.cos, torch.sin))
    pos = torch.arange(cache)
    shape = (1, spec.kv_heads, cache, spec.head_dim)
    k1, v1 = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    k2, v2 = torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)
    with torch.inference_mode():
        want = x.clone()
        for s in range(0, T, chunk):
            e = min(T, s + chunk)
            want[s:e] = dl.attention_block(want[s:e], cos[s:e], sin[s:e], None, pos[s:e], k1, v1, w, spec, prefix=s)
        got = dl.attention_block_long(x.clone(), cos, sin, k2, v2, w, spec, chunk, backend=SDPBackend.MATH)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(k2[:, :, :T], k1[:, :, :T])
    torch.testing.assert_close(v2[:, :, :T], v1[:, :, :T])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got - x, want - x, atol=tol, rtol=tol)  # the attention's own contribution


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_is_hfs_bit_for_bit_whole_and_by_rows(dtype):
    """The layer function's RMSNorm (torch's fused rms_norm, then HF's rounding and scale) against HF's module,
    exactly; a long prompt's rows normed a chunk at a time (its last chunk short) give the same rows."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeThinkerTextRMSNorm

    import orin.runtime.attention as dl

    gen = torch.Generator().manual_seed(3)
    norm = Qwen3OmniMoeThinkerTextRMSNorm(256, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(256, generator=gen))
    x = (torch.randn((300, 256), generator=gen) * 4).to(dtype)
    with torch.inference_mode():
        want = norm(x)
        assert torch.equal(dl._rms(x, norm.weight, 1e-6), want)
        assert torch.equal(dl._rms_rows(x, norm.weight, 1e-6, 128), want)
