"""A server's CUDA-graph captures wait for idle time (orin.runtime.capture_policy's wanted prefill buckets, the growing KV
cache, the worker's spare turn): the bucket and cache sizes, the route a prefill takes, the order of what is
wanted and captured, and that a deferred request computes exactly what its graph will. The policy alone with
plain ints; the decoder on CPU, where a prefill "graph" runs its function eagerly through the same code as on CUDA
(the profile's capture.cpu_graph_path; tests/test_device_kernels.py replays the real captures)."""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from orin.device.profile import CPU
from orin.runtime.capture_policy import CapturePolicy
from orin.runtime.decode import PrefillInputs
from orin.runtime.prefill_route import GraphKey, PrefillRoute, PromptShape, choose_route, prefill_bucket

LONG = CPU.prefill.long_prefill_tokens
GRANULE = CPU.memory.cache_granule
LOOKAHEAD = CPU.capture.lookahead
KEPT = CPU.capture.prefill_graphs


def test_prefill_buckets_are_few_and_tight():
    buckets = sorted({prefill_bucket(n) for n in range(1, LONG + 1)})
    assert len(buckets) == 20 and buckets[0] == 64 and buckets[-1] == LONG
    assert all(b % 64 == 0 for b in buckets)
    for n in range(1, LONG + 1):
        b = prefill_bucket(n)
        assert n <= b < max(n + 64, n * 1.25)
        assert prefill_bucket(b) == b


def test_cache_positions_round_to_the_granule():
    positions = CPU.memory.cache_positions
    assert positions(1) == GRANULE == positions(GRANULE)
    assert positions(GRANULE + 1) == 2 * GRANULE
    for n in (1, 100, 1023, 1024, 5000):  # a bucket never needs more than the cache its prompt gets
        assert positions(n) >= prefill_bucket(min(n, LONG))


# --------------------------------------------------------------------------- the policy, in plain ints


def test_the_capture_policy_is_torch_free():
    """The policy and the route decide over ints alone: importing them imports no torch."""
    import subprocess
    import sys

    code = "import sys, orin.runtime.capture_policy, orin.runtime.prefill_route; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_the_route_is_one_decision_of_the_prompt_the_cache_and_the_residency():
    R = PrefillRoute
    assert choose_route(700, 0, graph=True, captured=True, defer=True, long_tokens=LONG) is R.GRAPH
    assert choose_route(700, 0, graph=True, captured=False, defer=True, long_tokens=LONG) is R.DEFERRED
    assert choose_route(700, 0, graph=True, captured=False, defer=False, long_tokens=LONG) is R.GRAPH  # captures now
    assert choose_route(700, 0, graph=False, captured=False, defer=True, long_tokens=LONG) is R.EAGER
    assert choose_route(LONG + 1, 0, graph=False, captured=False, defer=True, long_tokens=LONG) is R.LONG
    assert choose_route(500, 200, graph=True, captured=True, defer=True, long_tokens=LONG) is R.REUSED_GRAPH
    assert choose_route(500, 200, graph=True, captured=False, defer=True, long_tokens=LONG) is R.REUSED_DEFERRED
    assert choose_route(500, 200, graph=False, captured=True, defer=True, long_tokens=LONG) is R.REUSED
    assert f"prefill_{R.REUSED_GRAPH}" == "prefill_reused_graph" and R.REUSED_GRAPH == "reused_graph"

    policy = CapturePolicy(CPU, graphs=True, heads_per_kv=8)
    policy.defer = True
    whole = policy.route(PromptShape(700, (2,)), 0, stays=True, capturable=True, cache=GRANULE, need=764)
    assert (whole.kind, whole.padded, whole.key) == (R.DEFERRED, 768, GraphKey(768, (2,)))
    assert policy.route(PromptShape(700, (2,)), 0, stays=False, capturable=True, cache=GRANULE, need=764).kind \
        is R.EAGER  # the weights move: a capture would be replayed once
    assert policy.route(PromptShape(700, (2,)), 0, stays=True, capturable=True, cache=0, need=764).grows
    after = policy.route(PromptShape(1200, (2,)), 670, stays=True, capturable=True, cache=2 * GRANULE, need=1264)
    assert (after.kind, after.rows, after.padded, after.key) == (R.REUSED_DEFERRED, 530, 640,
                                                                 GraphKey(640, (2,), after=True))
    policy.admit(after.key)
    assert policy.route(PromptShape(1200, (2,)), 670, stays=True, capturable=True, cache=2 * GRANULE,
                        need=1264).kind is R.REUSED_GRAPH
    # a mask of 8 x 640 rows over 8,192 positions is over the limit: the rows go the eager way
    assert policy.route(PromptShape(1200, (2,)), 670, stays=True, capturable=True, cache=8 * GRANULE,
                        need=1264).kind is R.REUSED
    assert policy.reusable(63, 500) == 0 and policy.reusable(64, 500) == 64
    assert policy.reusable(100, 100 + LONG + 1) == 0  # the rest is a long prompt: prefilled whole


class _Turns:
    """What orin.runtime.decode does with its policy, in ints: a cache of `cache` positions, the prompt held (its rows),
    each idle time `captures` long (a cache growth counts as one, as it re-captures the decode step)."""

    def __init__(self, policy: CapturePolicy):
        self.policy, self.cache, self.held = policy, 0, 0

    def prefill(self, rows: int, new_tokens: int, continues: bool = True, shares: bool = True) -> PrefillRoute:
        """A prompt of `rows` (a conversation's where it `continues`), whose first rows are the held prompt's
        where it `shares` them."""
        p, need = self.policy, rows + new_tokens
        shared = p.reusable(min(self.held, rows - 1), rows) if continues and shares and need <= self.cache else 0
        route = p.route(PromptShape(rows, (2,)), shared, stays=True, capturable=True, cache=self.cache, need=need)
        if route.grows:
            self.cache = p.cache_positions(max(need, route.padded))
            p.released()
        if route.kind.replayed:
            p.used(route.key)
        p.prefilled(route, need, self.cache, continues)
        self.held = rows
        return route.kind

    def idle(self, captures: int) -> None:
        size = self.policy.grow_to(self.cache, stepped=True)
        if size is not None:
            self.cache, captures = size, captures - 1
            self.policy.released()
        while captures > 0 and (key := self.policy.next_capture(self.cache)) is not None:
            self.policy.admit(key)
            captures -= 1


def test_a_conversations_next_turn_is_captured_first_whatever_the_idle_time_holds():
    """A spoken conversation (a question of ~130 rows, an answer of ~400 as the next prompt holds it) with the
    idle time of two captures between turns: once a turn's answer is done, the cache grows to what the next turn
    needs and the next turn's bucket comes first, before the guesses made at the prefill and the graphs the
    growth released: every turn replays its graph."""
    policy = CapturePolicy(CPU, graphs=True, heads_per_kv=8)
    policy.defer = True
    turns = _Turns(policy)
    assert turns.prefill(100, 4, continues=False) is PrefillRoute.DEFERRED  # the server's warm-up
    turns.idle(99)
    rows, grow, next_key = 140, 532, GraphKey(prefill_bucket(532), (2,), after=True)
    # the warm-up's lookahead holds the first turn's bucket (a session's first prompt shares nothing with it)
    assert turns.prefill(rows, 64, shares=False) is PrefillRoute.GRAPH
    policy.turn_ended(grow, turns.cache)
    assert policy.wanted()[0] == next_key  # not the first turn's own bucket, nor its guesses
    for _ in range(5):
        turns.idle(2)
        assert policy.is_captured(next_key)
        rows += grow
        assert turns.prefill(rows, 64) is PrefillRoute.REUSED_GRAPH
        policy.turn_ended(grow, turns.cache)
    assert turns.cache > 2 * GRANULE  # grown twice on the way


def test_an_ended_turn_drops_the_guesses_and_wants_its_prediction_over_the_cache_it_needs():
    policy = CapturePolicy(CPU, graphs=True, heads_per_kv=8)
    policy.defer = True
    turns = _Turns(policy)
    turns.prefill(150, 16)
    guesses = [k for k in policy.wanted() if k.after]
    assert guesses and all(k.rows <= prefill_bucket(150 + LOOKAHEAD // 2) for k in guesses)
    policy.turn_ended(900, turns.cache)
    after = [k.rows for k in policy.wanted() if k.after]
    assert after == [prefill_bucket(900), prefill_bucket(900 + LOOKAHEAD // 2)]  # the prediction's, nearest first
    assert policy.grow_to(GRANULE, stepped=True) == policy.cache_positions(150 + prefill_bucket(900 + 128))
    policy.turn_ended(900, turns.cache)  # once a turn
    assert [k.rows for k in policy.wanted() if k.after] == after


def test_the_captured_graphs_are_bounded_least_recently_used_first():
    policy = CapturePolicy(replace(CPU, capture=replace(CPU.capture, prefill_graphs=3)), graphs=True)
    keys = [GraphKey(64 * i) for i in range(1, 5)]
    assert [policy.admit(k) for k in keys[:3]] == [[], [], []]
    policy.used(keys[0])
    assert policy.admit(keys[3]) == [keys[1]] and policy.captured() == (keys[2], keys[0], keys[3])
    policy.failed(keys[2])
    assert not policy.is_captured(keys[2])


# --------------------------------------------------------------------------- the decoder (CPU, the graph path)


def _prompt(decoder, n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    embeds = decoder.model.embed_tokens(torch.randint(0, 256, (1, n), generator=gen))[0]
    return embeds, torch.arange(n).view(1, 1, -1).expand(3, 1, -1)


def test_a_deferred_bucket_runs_eagerly_then_is_captured_ahead_of_a_growing_prompt(decoder):
    n = 70
    embeds, positions = _prompt(decoder, n)
    with torch.inference_mode():
        first = decoder.prefill(PrefillInputs(embeds, positions, n + 30))
        assert decoder.last_prefill is PrefillRoute.DEFERRED
        assert decoder.prefill_captures == 0 and not decoder.policy.captured()  # nothing captured by the request
        rows = [key.rows for key in decoder.policy.wanted()]
        # this prompt's bucket is taken first, then those of prompts up to the lookahead longer
        assert rows[0] == prefill_bucket(n) == 128
        assert sorted(rows) == sorted({prefill_bucket(m) for m in range(n, n + LOOKAHEAD + 1)})
        assert decoder.capture_deferred(lambda: True) == 0  # a request waits: nothing starts
        made = decoder.capture_deferred(lambda: False)
        assert made == len(rows) and not decoder.policy.wanted()
        assert sorted(k.rows for k in decoder.policy.captured()) == sorted(rows)
        # the captured bucket gives the eagerly deferred result exactly (same function, same padded rows)
        again = decoder.prefill(PrefillInputs(embeds, positions, n + 30))
        assert decoder.last_prefill is PrefillRoute.GRAPH
        assert torch.equal(again.logits, first.logits)
        assert not decoder.policy.wanted()  # a bucket with its graph is not wanted again


def test_growing_prompts_are_captured_around_the_next_one(decoder):
    """A conversation whose prompt grows by ~600 tokens a turn: the buckets wanted surround the next prompt's
    predicted length, not only the lookahead past this one, and the next turn finds its bucket captured."""
    with torch.inference_mode():
        for n in (100, 700):
            embeds, positions = _prompt(decoder, n)
            decoder.prefill(PrefillInputs(embeds, positions, n + 8))
            decoder.step(5)
        rows = sorted(key.rows for key in decoder.policy.wanted())
        assert prefill_bucket(1300) in rows and max(rows) >= prefill_bucket(700 + 900)
        # the predicted next prompt's bucket (700 + 600) is taken first, this prompt's own (a repeat) last
        order = [k.rows for k in decoder.policy.wanted()]
        assert order[0] == prefill_bucket(1300)
        assert order.index(1536) < order.index(prefill_bucket(1600)) < order.index(prefill_bucket(700))
        decoder.capture_deferred(lambda: False)
        assert decoder.max_len >= prefill_bucket(1300)  # grown ahead while idle
        embeds, positions = _prompt(decoder, 1300)
        decoder.prefill(PrefillInputs(embeds, positions, 1308))
        assert decoder.last_prefill is PrefillRoute.GRAPH
        assert GraphKey(prefill_bucket(1300)) in decoder.policy.captured()
        assert not decoder.policy.wanted()  # the bucket was there: nothing new to capture


def test_the_wanted_buckets_are_bounded(decoder):
    with torch.inference_mode():
        for n in range(40, 4000, 150):
            embeds, positions = _prompt(decoder, n)
            decoder.prefill(PrefillInputs(embeds, positions, n + 8))
            assert len(decoder.policy.wanted()) <= KEPT // 2


def test_idle_time_grows_the_cache_ahead_of_a_conversation(decoder):
    """A prompt that leaves less than the lookahead's positions of the cache: idle time grows it by a granule
    (re-making the decode step and the prefill graphs that read the old cache), so the next, longer turn finds
    both ready; the garbage those captures wrote is overwritten by its prefill."""
    n = 70
    embeds, positions = _prompt(decoder, n)
    with torch.inference_mode():
        decoder.prefill(PrefillInputs(embeds, positions, GRANULE - 8))
        assert decoder.max_len == GRANULE
        decoder.capture_deferred(lambda: False)
        assert decoder.max_len == GRANULE  # no step has run yet: nothing tells how a step goes
        decoder.step(5)
        captured = set(decoder.policy.captured())
        made = decoder.capture_deferred(lambda: False)
        assert decoder.max_len == 2 * GRANULE and decoder.length == 0
        assert made == 1 + len(captured) and set(decoder.policy.captured()) == captured
        ref = decoder.prefill(PrefillInputs(embeds, positions, n + 8))
        fresh = torch.zeros_like(decoder.k_cache[0])
        decoder.k_cache[0].copy_(fresh)  # a clean cache gives the same answer: the garbage is never read
        assert torch.equal(decoder.prefill(PrefillInputs(embeds, positions, n + 8)).logits, ref.logits)
        assert decoder.capture_deferred(lambda: False) == 0  # nothing left to do


def test_the_server_captures_between_requests(graph_engine, quantized_dir):
    """After each request the worker offers the engine a spare turn whose stop() stays false while nobody waits:
    the prefill buckets the request ran eagerly (deferred) are captured before the next request comes."""
    import openai

    from orin.runtime.engine import EngineConfig
    from orin.serve.app import ServeConfig, Server

    thinker = graph_engine.decoders.thinker
    thinker.release()
    thinker.policy.forget()
    srv = Server(ServeConfig(EngineConfig(model_dir=quantized_dir, device="cpu", power_backend="none"), port=0,
                             warmup=False), engine=graph_engine).start()
    try:
        assert thinker.policy.defer  # the server's engine defers its captures
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        client.chat.completions.create(model=srv.model_name, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=2)
        assert thinker.last_prefill is PrefillRoute.DEFERRED
        deadline = time.monotonic() + 10
        while thinker.policy.wanted() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not thinker.policy.wanted() and thinker.policy.captured()
    finally:
        srv.stop()
        graph_engine.defer_captures(True)  # stopping hands a shared engine back undeferred


def test_a_conversations_earlier_audio_is_not_encoded_again(engine):
    """Each turn's prompt holds every earlier turn's audio: only the new audio goes through the encoder (found by
    its samples, whatever its features' last bits), and the tokens are those of encoding all of them at once."""
    from orin.contract import GenerationRequest
    from orin.inputs.media import synth_speechlike

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
