"""A conversation's next turn (GenerationRequest.continues, set by the Realtime API) reads the rows its prompt
shares with the last one from the KV cache instead of computing them again (orin.runtime.decode.StaticDecoder.prefill):
the same logits and recorded hidden states as a whole prefill, only where the rows are truly the same and still
in the cache; and a Realtime conversation's every turn replaying its graph. CPU, through the graph path's
bookkeeping as in tests/test_deferred_captures.py."""

from __future__ import annotations

import pytest
import torch

from orin.device.profile import CPU
from orin.runtime.decode import PrefillInputs, PrefillRoute
from orin.runtime.prefill_route import GraphKey, prefill_bucket

GRANULE = CPU.memory.cache_granule


def _turns(decoder, first: int, more: int, seed: int = 0):
    """Two prompts' (embeddings [n, H], M-RoPE positions [3, 1, n]): the second is the first plus `more` rows."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (1, first + more), generator=gen)
    embeds = decoder.model.embed_tokens(ids)[0]
    positions = torch.arange(first + more).view(1, 1, -1).expand(3, 1, -1)
    return (embeds[:first], positions[..., :first]), (embeds, positions)


def _prefill(dec, prompt, continues: bool, steps: int = 0, max_len: int | None = None):
    embeds, positions = prompt
    out = dec.prefill(PrefillInputs(embeds, positions, max_len or int(embeds.shape[0]) + 16, record=(0, 2)),
                      continues=continues)
    for token in range(steps):  # the answer's tokens, written after the prompt's rows
        dec.step(token)
    return out


def _assert_same(got, want):
    torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
    assert set(got.states) == set(want.states) == {0, 2}
    for i in want.states:
        torch.testing.assert_close(got.states[i], want.states[i], atol=1e-4, rtol=1e-4)


def test_a_next_turn_reads_the_shared_rows_and_equals_a_whole_prefill(decoder):
    one, two = _turns(decoder, 150, 90)
    want = _prefill(decoder, two, continues=False)
    decoder.release()
    _prefill(decoder, one, continues=True, steps=5)
    got = _prefill(decoder, two, continues=True)
    assert decoder.last_prefill.continued
    _assert_same(got, want)
    # and the turn after reads this one's rows in turn
    three = (torch.cat([two[0], one[0][:70]]), torch.arange(310).view(1, 1, -1).expand(3, 1, -1))
    want3 = _prefill(decoder, three, continues=False)
    decoder.release()
    _prefill(decoder, one, continues=True)
    _prefill(decoder, two, continues=True)
    assert decoder.last_prefill.continued
    got3 = _prefill(decoder, three, continues=True)
    assert decoder.last_prefill.continued
    _assert_same(got3, want3)


def test_rows_are_read_only_where_they_are_the_same_and_still_in_the_cache(decoder):
    one, two = _turns(decoder, 150, 90)
    # a conversation's first turn does not say it is one: its rows are held all the same
    _prefill(decoder, one, continues=False)
    _prefill(decoder, two, continues=True)
    assert decoder.last_prefill.continued
    # not asked for: a request that does not continue one prefills whole
    _prefill(decoder, one, continues=True)
    _prefill(decoder, two, continues=False)
    assert not decoder.last_prefill.continued
    # another conversation in between: its prefill overwrote the rows
    _prefill(decoder, one, continues=True)
    _prefill(decoder, _turns(decoder, 150, 0, seed=1)[0], continues=False)
    _prefill(decoder, two, continues=True)
    assert not decoder.last_prefill.continued
    # a prompt that differs early (an item deleted): fewer shared rows than are worth reading
    _prefill(decoder, one, continues=True)
    other = two[0].clone()
    other[CPU.capture.reuse_min_rows - 1] += 1
    _prefill(decoder, (other, two[1]), continues=True)
    assert not decoder.last_prefill.continued
    # a prompt that differs later reads what is the same, and equals a whole prefill
    _prefill(decoder, one, continues=True)
    other = two[0].clone()
    other[100] += 1
    got = _prefill(decoder, (other, two[1]), continues=True)
    assert decoder.last_prefill.continued
    want_dec_out = got
    decoder.release()
    _assert_same(want_dec_out, _prefill(decoder, (other, two[1]), continues=False))


def test_idle_captures_keep_the_held_rows(make_decoder):
    """Between turns a server grows the cache ahead of the conversation and captures prefill buckets, each
    writing the cache from row 0: the held rows are put back, in the grown cache, and the next turn reads them."""
    decoder = make_decoder()
    one, two = _turns(decoder, 150, 90)
    want = _prefill(make_decoder(), two, continues=False)
    # as a conversation nearing its cache's end: the idle time grows the cache
    _prefill(decoder, one, continues=True, steps=3, max_len=GRANULE - 8)
    before, wanted = decoder.max_len, decoder.policy.wanted()
    assert wanted
    made = decoder.capture_deferred(lambda: False)
    assert decoder.max_len > before and made == 1 + len(wanted) and not decoder.policy.wanted()
    got = _prefill(decoder, two, continues=True)
    assert decoder.last_prefill.continued
    _assert_same(got, want)


def test_a_turns_new_rows_replay_their_own_graph_once_captured(make_decoder):
    """A continued prefill's new rows go through a graph of their own (positions and the mask over the whole
    cache as inputs, so one capture serves any prefix): eager the first time (deferred), wanted, captured while
    idle, then replayed by the next turn of about as many new rows, with a whole prefill's results."""
    decoder = make_decoder()
    one, three = _turns(decoder, 150, 180, seed=2)
    two = (three[0][:240], three[1][..., :240])
    want = _prefill(make_decoder(), three, continues=False)
    _prefill(decoder, one, continues=True, steps=3)
    # the first turn already wants the buckets of a next turn about as long as itself
    assert any(key.after for key in decoder.policy.wanted())
    # the idle time grows the cache too (this turn nears its end): the graph's mask spans the new one
    _prefill(decoder, two, continues=True, steps=3, max_len=GRANULE - 8)
    assert decoder.last_prefill is PrefillRoute.REUSED_DEFERRED
    key = GraphKey(128, (0, 2), after=True)  # its 90 new rows' bucket
    assert key in decoder.policy.wanted()
    before = decoder.max_len
    decoder.capture_deferred(lambda: False)
    assert decoder.max_len > before and decoder.policy.is_captured(key)
    got = _prefill(decoder, three, continues=True)
    assert decoder.last_prefill is PrefillRoute.REUSED_GRAPH
    _assert_same(got, want)


def test_an_ended_turn_wants_the_bucket_of_its_answer_and_a_question(make_decoder):
    """At a turn's prefill only its own length is known, and it wants a next turn about as long. Once the answer
    is done, turn_ended is told the next turn's likely new rows: their bucket is wanted first, captured while idle
    and replayed, with a whole prefill's results, where the prefill's guess had missed it."""
    decoder = make_decoder()
    one, two = _turns(decoder, 100, 420, seed=4)
    want = _prefill(make_decoder(), two, continues=False)
    _prefill(decoder, one, continues=True, steps=3)
    key = GraphKey(prefill_bucket(420), (0, 2), after=True)
    assert key not in decoder.policy.wanted()  # the prefill's guess: a next turn of about 100 new rows
    decoder.turn_ended(420)
    assert decoder.policy.wanted()[0] == key
    wanted = decoder.policy.wanted()
    decoder.turn_ended(420)  # once a turn
    assert decoder.policy.wanted() == wanted
    decoder.capture_deferred(lambda: False)
    assert decoder.policy.is_captured(key)
    got = _prefill(decoder, two, continues=True)
    assert decoder.last_prefill is PrefillRoute.REUSED_GRAPH
    _assert_same(got, want)


def test_a_turn_whose_mask_would_be_too_large_prefills_its_rows_eagerly(make_decoder):
    """A continued prefill's graph holds a mask of (query heads of a group x rows x cache positions): past the
    profile's after_mask_max the new rows go the eager way (no mask), with the same results, and no such graph is
    wanted."""
    decoder = make_decoder(after_mask_max=0)
    one, two = _turns(decoder, 150, 90, seed=4)
    want = _prefill(make_decoder(), two, continues=False)
    _prefill(decoder, one, continues=True, steps=2)
    got = _prefill(decoder, two, continues=True)
    assert decoder.last_prefill is PrefillRoute.REUSED
    assert not any(key.after for key in decoder.policy.wanted())  # no capture that could never be used
    _assert_same(got, want)


def test_a_conversations_turns_through_the_engine_equal_whole_prefills(engine):
    """Two Realtime-like turns through the engine: the second, continuing the first, gives the same text and
    speech as the same request prefilled whole, and reads its shared rows (the timeline says so)."""
    from orin.contract import AudioChunk, Done, GenerationRequest, TextDelta
    from orin.inputs.media import synth_speechlike

    first = [{"role": "user", "content": [{"type": "audio", "audio": synth_speechlike(6.0, seed=3)},
                                          {"type": "text", "text": "What did you hear?"}]}]

    def run(messages, continues):
        req = GenerationRequest(messages=tuple(messages), max_new_tokens=6, max_audio_frames=6,
                                continues=continues)
        events = list(engine.stream(req))
        report = next(e.report for e in events if isinstance(e, Done))
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        frames = tuple(f for e in events if isinstance(e, AudioChunk) for f in e.frames)
        return text, report, frames

    text1, _, _ = run(first, continues=True)
    second = [*first, {"role": "assistant", "content": text1},
              {"role": "user", "content": [{"type": "audio", "audio": synth_speechlike(1.5, seed=4)}]}]
    text_c, report_c, frames_c = run(second, continues=True)
    assert "prefill_reused" in report_c.timeline_s
    assert "talker_prefill_reused" in report_c.timeline_s  # its projections are row-stable (talker._in_blocks)
    text_w, report_w, frames_w = run(second, continues=False)
    assert "prefill_reused" not in report_w.timeline_s
    assert report_c.token_ids == report_w.token_ids and text_c == text_w
    assert frames_c == frames_w


def _run(engine, messages, continues: bool = True, **kw):
    """(text, report) of a request through `engine`."""
    from orin.contract import Done, GenerationRequest, TextDelta

    events = list(engine.stream(GenerationRequest(messages=tuple(messages), continues=continues, ignore_eos=True,
                                                  **kw)))
    report = next(e.report for e in events if isinstance(e, Done))
    return "".join(e.text for e in events if isinstance(e, TextDelta)), report


def _route(report) -> str:
    """How the report says the thinker's prefill ran (the timeline's `prefill_<route>` mark)."""
    return next(k.removeprefix("prefill_") for k in report.timeline_s if k.startswith("prefill_"))


def _fresh_thinker(engine):
    thinker = engine.decoders.thinker
    thinker.release()
    thinker.policy.forget()
    engine.defer_captures(True)
    return thinker


def test_a_conversations_second_turn_replays_the_bucket_its_first_answer_wanted(graph_engine):
    """Through the engine: once a turn's answer is done, the next turn's new rows (that answer, then a user turn
    as long as this one) are predicted from the prompt and the answer's length, and their bucket is captured while
    idle, so the second turn replays a graph; the first turn's prefill had only wanted buckets as long as itself
    (its system prompt included), which the second turn's rows outgrow here."""
    from orin.inputs.media import synth_speechlike

    thinker = _fresh_thinker(graph_engine)
    first = [{"role": "user", "content": [{"type": "audio", "audio": synth_speechlike(6.0, seed=3)},
                                          {"type": "text", "text": "What did you hear?"}]}]
    text, one = _run(graph_engine, first, max_new_tokens=120, max_audio_frames=4)
    graph_engine.capture_deferred(lambda: False)
    second = [*first, {"role": "assistant", "content": text},
              {"role": "user", "content": [{"type": "audio", "audio": synth_speechlike(6.0, seed=4)},
                                           {"type": "text", "text": "And now?"}]}]
    _, two = _run(graph_engine, second, max_new_tokens=120, max_audio_frames=4)
    # past the buckets the first prefill wanted (its own length and up to half the lookahead more)
    assert prefill_bucket(two.prompt_tokens - one.prompt_tokens) > prefill_bucket(one.prompt_tokens
                                                                                 + CPU.capture.lookahead // 2)
    assert thinker.last_prefill is PrefillRoute.REUSED_GRAPH and _route(two) == "reused_graph"


def _realtime_routes(engine, turns: int = 5, captures: int = 2) -> tuple[list[str], list[int], int]:
    """A Realtime-like session on `engine` after a server's warm-up: `turns` turns, each continuing the last (its
    answer, then a question as long), with the idle time of `captures` captures between turns (the user speaks the
    next question; a request then waits). (The prefill routes, the prompts' tokens, the warm-up's tokens.)"""
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()

    def stop_after(n: int):
        left = [n]

        def stop() -> bool:
            left[0] -= 1
            return left[0] < 0

        return stop

    _, warm = _run(engine, [{"role": "user", "content": "Warming up: " + " ".join(reversed(words * 2))}],
                   continues=False, max_new_tokens=4, speech=False)  # the server's warm-up, its captures after
    engine.capture_deferred(lambda: False)
    messages, routes, prompts = [], [], []
    for turn in range(turns):
        messages.append({"role": "user", "content": " ".join(words[(turn + i) % len(words)] for i in range(60))})
        text, report = _run(engine, messages, max_new_tokens=64, speech=False)
        routes.append(_route(report))
        prompts.append(report.prompt_tokens)
        messages.append({"role": "assistant", "content": text})
        engine.capture_deferred(stop_after(captures))
    return routes, prompts, warm.prompt_tokens


def test_every_turn_of_a_realtime_conversation_replays_its_graph(graph_engine):
    """A Realtime session through the engine with, between turns, only the idle time of two captures: once a
    turn's answer is done the cache grows to what the next turn needs and that turn's bucket is captured first,
    over that cache, before the guesses made at the prefill and the graphs the growth released: every turn's
    prefill replays a graph, the first one's from the server warm-up's lookahead."""
    _fresh_thinker(graph_engine)
    routes, prompts, warm = _realtime_routes(graph_engine)
    assert prompts[0] <= warm + CPU.capture.lookahead < prompts[1]  # the warm-up's lookahead holds the first
    assert prompts[-1] > 2 * GRANULE  # the cache grew on the way
    assert routes == ["graph"] + ["reused_graph"] * 4


def _warm(engine) -> int:
    """A server's warm-up on `engine` (a short request, then its idle captures): its prompt's tokens."""
    _, warm = _run(engine, [{"role": "user", "content": "Warming up."}], continues=False, max_new_tokens=4,
                   speech=False)
    engine.capture_deferred(lambda: False)
    return warm.prompt_tokens


def test_a_conversations_first_turn_replays_the_graph_its_session_expected(graph_engine):
    """A Realtime session tells the engine, before its first turn, how long that turn's prompt will be (its
    instructions and a question of a few seconds): a first prompt past the server warm-up's lookahead (a long
    system prompt) then replays a graph captured while idle, where without the expectation it runs eagerly."""
    system = {"role": "system", "content": " ".join(["You steer a wheeled robot; answer in one sentence."] * 30)}
    first = [system, {"role": "user", "content": "Where is the red tool?"}]
    n = graph_engine.count_tokens(first, generation_prompt=True)
    routes = []
    for expect in (False, True):
        _fresh_thinker(graph_engine)
        warm = _warm(graph_engine)
        assert n > warm + CPU.capture.lookahead  # beyond what the warm-up's lookahead captures
        if expect:
            graph_engine.expect_conversation((n - 8, n + 120), answer=16)
            graph_engine.capture_deferred(lambda: False)
        _, report = _run(graph_engine, first, max_new_tokens=16, speech=False)
        assert report.prompt_tokens == n
        routes.append(_route(report))
    assert routes == ["deferred", "graph"]


def test_a_realtime_sessions_first_turn_replays_the_graph_its_instructions_asked_for(graph_engine, quantized_dir):
    """Through the Realtime API and the official client: a session's instructions (a system prompt past the server
    warm-up's lookahead) make the server capture the first turn's prefill graphs while the user speaks, so the first
    spoken question replays one (the engine-level test above shows the same prompt runs eagerly without)."""
    import base64
    import time

    import realtime_kit as rt
    import server_kit as kit
    from speech_kit import pcm16

    from orin.inputs.media import synth_speechlike

    policy = _fresh_thinker(graph_engine).policy
    warm = _warm(graph_engine)
    instructions = " ".join(["You steer a wheeled robot; answer in one sentence."] * 30)
    system = graph_engine.count_tokens([{"role": "system", "content": instructions}])
    assert system > warm + CPU.capture.lookahead
    srv = kit.start_server(graph_engine, quantized_dir)
    try:
        with rt.session(srv) as conn:
            rt.configure(conn, instructions=instructions, output_modalities=["text"], max_output_tokens=8,
                         audio={"input": {"turn_detection": None}})
            deadline = time.monotonic() + 60  # the captures run on the server's spare turn, in the background
            while (policy.wanted() or srv.gate.busy
                   or not any(not k.after and k.rows > system for k in policy.captured())):
                assert time.monotonic() < deadline, policy.captured()
                time.sleep(0.05)
            audio = base64.b64encode(pcm16(synth_speechlike(3.0, seed=5, sr=24_000))).decode()
            conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                {"type": "input_audio", "audio": audio}]})
            rt.until(conn, "conversation.item.done")
            done = rt.respond(conn)
    finally:
        srv.stop()
    orin = done.response.model_extra["orin"]
    assert orin["prompt_tokens"] > warm + CPU.capture.lookahead and orin["routes"]["prefill"] == "graph"


def test_a_realtime_conversations_turns_encode_only_their_new_audio_and_read_the_rest_from_the_cache(graph_engine):
    """Each Realtime turn's prompt holds every earlier turn's audio. An audio whose length is not a whole number
    of feature frames gets a frame fewer as the longest of its batch, so once a longer turn joins it, it would be
    encoded again, to other tokens and rows: the Realtime items are aligned to whole frames (frame_aligned), so
    every turn encodes its new audio only and reads all of the previous prompt's rows from the cache."""
    from orin.audio_format import INPUT_HOP
    from orin.inputs.media import synth_speechlike
    from orin.realtime.conversation import audio_item

    _fresh_thinker(graph_engine)
    _warm(graph_engine)
    messages, last = [{"role": "system", "content": "You steer a wheeled robot; answer in one sentence."}], 0
    for turn, seconds in enumerate((5.0, 6.0, 7.0)):  # each longer than the last: the case that re-encoded
        item = audio_item(synth_speechlike(seconds, seed=turn)[:-37], 24_000)  # not a whole frame at 24 kHz
        assert len(item.content[0].audio) % INPUT_HOP == 0
        messages.append(item.message())
        text, report = _run(graph_engine, messages, max_new_tokens=8, speech=False)
        assert graph_engine.thinker.audio_tokens.last["encoded"] == 1, turn
        assert _route(report).startswith("reused") == (turn > 0), turn
        assert report.cached_tokens == last, turn
        last = report.prompt_tokens
        messages.append({"role": "assistant", "content": text})


@pytest.mark.device
def test_every_turn_of_a_realtime_conversation_replays_its_cuda_graph(request):
    """The same on a GPU, where the graphs are real captures (the synthetic INT4 checkpoint): every turn after
    the first replays its new rows' graph, captured in the idle time of two captures."""
    torch_ = pytest.importorskip("torch")
    if not torch_.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from orin.runtime.engine import Engine, EngineConfig

    model_dir = request.config.getoption("--device-model-dir") or request.getfixturevalue("synthetic_dir")
    engine = Engine(EngineConfig(model_dir=model_dir, device="cuda", power_backend="none", verify_checksums=False,
                                 compile=False))
    try:
        engine.defer_captures(True)
        routes, prompts, warm = _realtime_routes(engine)
    finally:
        engine.close()
    first = "graph" if prompts[0] <= warm + engine.profile.capture.lookahead else "deferred"
    assert routes == [first] + ["reused_graph"] * 4, (routes, prompts)


def test_a_failed_idle_capture_leaves_nothing_to_read(decoder):
    """A capture that fails midway may have written over the held rows: nothing is read from them after it."""
    one, two = _turns(decoder, 150, 90)
    _prefill(decoder, one, continues=True)
    assert decoder.policy.wanted()
    calls = []

    def stop() -> bool:  # the second capture fails, after the first wrote over the rows
        calls.append(None)
        if len(calls) > 1:
            raise RuntimeError("capture failed")
        return False

    with pytest.raises(RuntimeError, match="capture failed"):
        decoder.capture_deferred(stop)
    _prefill(decoder, two, continues=True)
    assert not decoder.last_prefill.continued


@pytest.mark.parametrize("rows", [None, 40])
def test_the_talkers_projections_run_on_fixed_blocks(rows):
    """The talker's user-turn projections see only blocks of the profile's projection_rows (a long prompt's:
    long_projection_rows, here 40), whatever the prompt's length, so a row's projection has the same bits in every
    turn (on CUDA a GEMM's kernel depends on its rows)."""
    from orin.runtime.talker import in_blocks

    block = rows or CPU.prefill.projection_rows
    proj = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.Linear(32, 8))
    seen: list[int] = []
    proj.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[1]))
    x = torch.randn(1, 3 * block + 5, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = in_blocks(proj, x, block)
        shorter = in_blocks(proj, x[:, :block + 9], block)
    assert set(seen) == {block} and len(seen) == 4 + 2
    assert whole.shape == (1, x.shape[1], 8)
    assert torch.equal(shorter, whole[:, :block + 9])
    torch.testing.assert_close(whole, proj(x))


def test_a_prompt_over_the_held_bytes_is_not_held(make_decoder):
    """Holding keeps a prompt's embeddings and recorded states alive between requests: never more than the
    profile's held_max_bytes of them (outside the plan, inside its runtime margin)."""
    probe = make_decoder()
    one, two = _turns(probe, 150, 90)
    row = one[0].element_size() * one[0].shape[-1] * 3  # the embeddings and the two recorded states
    decoder = make_decoder(held_max_bytes=150 * row - 1)
    _prefill(decoder, one, continues=True)
    _prefill(decoder, two, continues=True)
    assert not decoder.last_prefill.continued
    decoder = make_decoder(held_max_bytes=150 * row)
    _prefill(decoder, one, continues=True)
    _prefill(decoder, two, continues=True)
    assert decoder.last_prefill.continued


@pytest.mark.parametrize("holds", [True, False])
def test_a_long_prompt_overwrites_its_embeddings_only_where_none_are_held(make_decoder, holds):
    """A long prompt's prefill (one layer at a time) overwrites its input embeddings in place, no whole-prompt
    copy, where nothing reads them after: not recorded, and not held for a next turn; a prompt small enough to
    hold keeps them. The results are those of the copying prefill."""
    held = {} if holds else {"held_max_bytes": 0}
    decoder = make_decoder(prefill={"long_prefill_tokens": 100}, **held)
    one, two = _turns(decoder, 150, 90, seed=5)
    embeds = one[0].clone()
    got = decoder.prefill(PrefillInputs(embeds, one[1], 200, record=(2,)), continues=True)
    assert decoder.last_prefill is PrefillRoute.LONG
    assert torch.equal(embeds, one[0]) == holds
    decoder.prefill(PrefillInputs(two[0].clone(), two[1], 256, record=(2,)), continues=True)
    assert decoder.last_prefill.continued == holds  # a next turn reads the rows only where they were held
    fresh = make_decoder(prefill={"long_prefill_tokens": 100}, **held)
    want = fresh.prefill(PrefillInputs(one[0].clone(), one[1], 200, record=(0, 2)))  # recorded: never overwritten
    torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.states[2], want.states[2], atol=1e-4, rtol=1e-4)
