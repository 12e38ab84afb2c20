"""A server's CUDA-graph captures wait for idle time (orin.decode's deferred prefill buckets, the growing KV cache,
the worker's spare turn): the bucket and cache sizes, the bookkeeping of what is wanted and captured, and that a
deferred request computes exactly what its graph will. CPU: a prefill "graph" there runs its function eagerly,
through the same code as on CUDA (tests/test_device_kernels.py replays the real captures)."""

from __future__ import annotations

import threading

import torch

from orin import components as C
from orin.decode import PREFILL_GRAPHS, PREFILL_LOOKAHEAD, prefill_bucket


def test_prefill_buckets_are_few_and_tight():
    buckets = sorted({prefill_bucket(n) for n in range(1, C.LONG_PREFILL_TOKENS + 1)})
    assert len(buckets) == 20 and buckets[0] == 64 and buckets[-1] == C.LONG_PREFILL_TOKENS
    assert all(b % 64 == 0 for b in buckets)
    for n in range(1, C.LONG_PREFILL_TOKENS + 1):
        b = prefill_bucket(n)
        assert n <= b < max(n + 64, n * 1.25)
        assert prefill_bucket(b) == b


def test_cache_positions_round_to_the_granule():
    assert C.cache_positions(1) == C.CACHE_GRANULE == C.cache_positions(C.CACHE_GRANULE)
    assert C.cache_positions(C.CACHE_GRANULE + 1) == 2 * C.CACHE_GRANULE
    for n in (1, 100, 1023, 1024, 5000):  # a bucket never needs more than the cache its prompt gets
        assert C.cache_positions(n) >= prefill_bucket(min(n, C.LONG_PREFILL_TOKENS))


def _prompt(engine, n: int, seed: int = 0):
    lm = engine.model.thinker.model.language_model
    gen = torch.Generator().manual_seed(seed)
    embeds = lm.embed_tokens(torch.randint(0, 256, (1, n), generator=gen))[0]
    return embeds, torch.arange(n).view(1, 1, -1).expand(3, 1, -1)


def test_a_deferred_bucket_runs_eagerly_then_is_captured_ahead_of_a_growing_prompt(engine, decoder):
    n = 70
    embeds, positions = _prompt(engine, n)
    with torch.inference_mode():
        first = decoder.prefill(embeds, positions, n + 30)
        assert decoder.prefill_captures == 0 and not decoder._prefill_graphs  # nothing captured by the request
        rows = [key[0] for key in decoder._wanted]
        # this prompt's bucket is taken first, then those of prompts up to PREFILL_LOOKAHEAD tokens longer
        assert rows[-1] == prefill_bucket(n) == 128
        assert sorted(rows) == sorted({prefill_bucket(m) for m in range(n, n + PREFILL_LOOKAHEAD + 1)})
        assert decoder.capture_deferred(lambda: True) == 0  # a request waits: nothing starts
        made = decoder.capture_deferred(lambda: False)
        assert made == len(rows) and not decoder._wanted
        assert sorted(k[0] for k in decoder._prefill_graphs) == sorted(rows)
        # the captured bucket gives the eagerly deferred result exactly (same function, same padded rows)
        again = decoder.prefill(embeds, positions, n + 30)
        assert torch.equal(again.logits, first.logits)
        assert not decoder._wanted  # a bucket with its graph is not wanted again


def test_growing_prompts_are_captured_around_the_next_one(engine, decoder):
    """A conversation whose prompt grows by ~600 tokens a turn: the buckets wanted surround the next prompt's
    predicted length, not only PREFILL_LOOKAHEAD past this one, and the next turn finds its bucket captured."""
    with torch.inference_mode():
        for n in (100, 700):
            embeds, positions = _prompt(engine, n)
            decoder.prefill(embeds, positions, n + 8)
            decoder.step(5)
        rows = sorted(key[0] for key in decoder._wanted)
        assert prefill_bucket(1300) in rows and max(rows) >= prefill_bucket(700 + 900)
        # the predicted next prompt's bucket (700 + 600) is taken first, this prompt's own (a repeat) last
        assert list(decoder._wanted)[-1][0] == prefill_bucket(1300)
        order = [k[0] for k in decoder._wanted]
        assert order.index(prefill_bucket(700)) < order.index(prefill_bucket(1600)) < order.index(1536)
        decoder.capture_deferred(lambda: False)
        assert decoder.max_len >= prefill_bucket(1300)  # grown ahead while idle
        embeds, positions = _prompt(engine, 1300)
        decoder.prefill(embeds, positions, 1308)
        assert (prefill_bucket(1300), (), None) in decoder._prefill_graphs
        assert not decoder._wanted  # the bucket was there: nothing new to capture


def test_the_wanted_buckets_are_bounded(engine, decoder):
    with torch.inference_mode():
        for n in range(40, 4000, 150):
            embeds, positions = _prompt(engine, n)
            decoder.prefill(embeds, positions, n + 8)
            assert len(decoder._wanted) <= PREFILL_GRAPHS // 2


def test_idle_time_grows_the_cache_ahead_of_a_conversation(engine, decoder):
    """A prompt that leaves less than PREFILL_LOOKAHEAD positions of the cache: idle time grows it by a granule
    (re-making the decode step and the prefill graphs that read the old cache), so the next, longer turn finds
    both ready; the garbage those captures wrote is overwritten by its prefill."""
    n = 70
    embeds, positions = _prompt(engine, n)
    with torch.inference_mode():
        decoder.prefill(embeds, positions, C.CACHE_GRANULE - 8)
        assert decoder.max_len == C.CACHE_GRANULE
        decoder.capture_deferred(lambda: False)
        assert decoder.max_len == C.CACHE_GRANULE  # no step has run yet: nothing tells how a step goes
        decoder.step(5)
        captured = sorted(decoder._prefill_graphs)
        made = decoder.capture_deferred(lambda: False)
        assert decoder.max_len == 2 * C.CACHE_GRANULE and decoder.length == 0
        assert made == 1 + len(captured) and sorted(decoder._prefill_graphs) == captured
        ref = decoder.prefill(embeds, positions, n + 8)
        fresh = torch.zeros_like(decoder.k_cache[0])
        decoder.k_cache[0].copy_(fresh)  # a clean cache gives the same answer: the garbage is never read
        assert torch.equal(decoder.prefill(embeds, positions, n + 8).logits, ref.logits)
        assert decoder.capture_deferred(lambda: False) == 0  # nothing left to do


def test_the_server_captures_between_requests(server, engine, monkeypatch):
    """After each request the worker offers the engine a spare turn; its stop() is false while nobody waits."""
    import openai

    calls: list = []
    done = threading.Event()

    def capture(stop):
        calls.append(stop())
        done.set()
        return 0

    monkeypatch.setattr(engine, "capture_deferred", capture)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    client.chat.completions.create(model=server.model_name, messages=[{"role": "user", "content": "Hi"}],
                                   max_tokens=2)
    assert done.wait(10)
    assert calls == [False]
    assert engine.decoders.thinker.defer  # the server's engine defers its captures


def test_a_conversations_earlier_audio_is_not_encoded_again(engine):
    """Each turn's prompt holds every earlier turn's audio: only the new audio goes through the encoder (found by
    its samples, whatever its features' last bits), and the tokens are those of encoding all of them at once."""
    from orin.contract import GenerationRequest
    from orin.media import synth_speechlike

    def prompt_of(seconds):
        parts = [{"type": "audio", "audio": synth_speechlike(s, seed=i)} for i, s in enumerate(seconds)]
        req = GenerationRequest(messages=({"role": "user", "content": parts},))
        return engine.prepare(req)

    engine.loader.ensure("audio_encoder")
    thinker, tower = engine.thinker, engine.model.thinker.model.audio_tower
    calls: list = []
    real = tower.forward
    tower.forward = lambda f, lengths: calls.append(tuple(lengths)) or real(f, lengths)
    try:
        with torch.inference_mode():
            one, two, three = prompt_of((1.0,)), prompt_of((1.0, 1.5)), prompt_of((1.0, 1.5, 0.7))
            thinker.encode_audio(one.inputs, one)
            hits = thinker.audio_tokens.hits
            # the same samples in another batch: on a GPU the features round differently with the batch's shape
            two.inputs["input_features"][0] += 1e-6
            first = thinker.encode_audio(two.inputs, two)
            # found though its last frames differ: alone it was its batch's longest, padding shaped none of them
            assert thinker.audio_tokens.hits == hits + 1 and calls[-1] == (two.audio_lengths[1],)
            hits = thinker.audio_tokens.hits
            both = thinker.encode_audio(three.inputs, three)
            assert thinker.audio_tokens.hits == hits + 2 and calls[-1] == (three.audio_lengths[2],)
            assert torch.equal(both[:first.shape[0]], first)
            assert len(set(three.audio_keys)) == 3 and three.audio_keys[:2] == two.audio_keys
            whole = real(three.inputs["input_features"], three.audio_lengths)  # one pass over the three
            assert torch.allclose(both, whole, atol=1e-5, rtol=1e-4)
    finally:
        tower.forward = real
