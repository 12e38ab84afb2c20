"""A conversation's next turn (GenerationRequest.continues, set by the Realtime API) reads the rows its prompt
shares with the last one from the KV cache instead of computing them again (orin.decode.StaticDecoder.prefill):
the same logits and recorded hidden states as a whole prefill, only where the rows are truly the same and still
in the cache. CPU, through the graph path's bookkeeping as in tests/test_deferred_captures.py."""

from __future__ import annotations

import pytest
import torch

from orin.decode import REUSE_MIN_ROWS


def _turns(engine, first: int, more: int, seed: int = 0):
    """Two prompts' (embeddings [n, H], M-RoPE positions [3, 1, n]): the second is the first plus `more` rows."""
    lm = engine.model.thinker.model.language_model
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (1, first + more), generator=gen)
    embeds = lm.embed_tokens(ids)[0]
    positions = torch.arange(first + more).view(1, 1, -1).expand(3, 1, -1)
    return (embeds[:first], positions[..., :first]), (embeds, positions)


def _prefill(dec, prompt, continues: bool, steps: int = 0):
    embeds, positions = prompt
    out = dec.prefill(embeds, positions, int(embeds.shape[0]) + 16, record=(0, 2), continues=continues)
    for token in range(steps):  # the answer's tokens, written after the prompt's rows
        dec.step(token)
    return out


def _assert_same(got, want):
    torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
    assert set(got.states) == set(want.states) == {0, 2}
    for i in want.states:
        torch.testing.assert_close(got.states[i], want.states[i], atol=1e-4, rtol=1e-4)


def test_a_next_turn_reads_the_shared_rows_and_equals_a_whole_prefill(engine, decoder):
    one, two = _turns(engine, 150, 90)
    want = _prefill(decoder, two, continues=False)
    decoder.release()
    _prefill(decoder, one, continues=True, steps=5)
    got = _prefill(decoder, two, continues=True)
    assert decoder.last_prefill.startswith("reused")
    _assert_same(got, want)
    # and the turn after reads this one's rows in turn
    three = (torch.cat([two[0], one[0][:70]]), torch.arange(310).view(1, 1, -1).expand(3, 1, -1))
    want3 = _prefill(decoder, three, continues=False)
    decoder.release()
    _prefill(decoder, one, continues=True)
    _prefill(decoder, two, continues=True)
    assert decoder.last_prefill.startswith("reused")
    got3 = _prefill(decoder, three, continues=True)
    assert decoder.last_prefill.startswith("reused")
    _assert_same(got3, want3)


def test_rows_are_read_only_where_they_are_the_same_and_still_in_the_cache(engine, decoder):
    one, two = _turns(engine, 150, 90)
    # a conversation's first turn does not say it is one: its rows are held all the same
    _prefill(decoder, one, continues=False)
    _prefill(decoder, two, continues=True)
    assert decoder.last_prefill.startswith("reused")
    # not asked for: a request that does not continue one prefills whole
    _prefill(decoder, one, continues=True)
    _prefill(decoder, two, continues=False)
    assert not decoder.last_prefill.startswith("reused")
    # another conversation in between: its prefill overwrote the rows
    _prefill(decoder, one, continues=True)
    _prefill(decoder, _turns(engine, 150, 0, seed=1)[0], continues=False)
    _prefill(decoder, two, continues=True)
    assert not decoder.last_prefill.startswith("reused")
    # a prompt that differs early (an item deleted): fewer shared rows than are worth reading
    _prefill(decoder, one, continues=True)
    other = two[0].clone()
    other[REUSE_MIN_ROWS - 1] += 1
    _prefill(decoder, (other, two[1]), continues=True)
    assert not decoder.last_prefill.startswith("reused")
    # a prompt that differs later reads what is the same, and equals a whole prefill
    _prefill(decoder, one, continues=True)
    other = two[0].clone()
    other[100] += 1
    got = _prefill(decoder, (other, two[1]), continues=True)
    assert decoder.last_prefill.startswith("reused")
    want_dec_out = got
    decoder.release()
    _assert_same(want_dec_out, _prefill(decoder, (other, two[1]), continues=False))


def test_idle_captures_keep_the_held_rows(engine, decoder):
    """Between turns a server grows the cache ahead of the conversation and captures prefill buckets, each
    writing the cache from row 0: the held rows are put back, in the grown cache, and the next turn reads them."""
    one, two = _turns(engine, 150, 90)
    want = _prefill(decoder, two, continues=False)
    decoder.release()
    decoder._wanted.clear()
    _prefill(decoder, one, continues=True, steps=3)
    decoder._need = decoder.max_len  # as a conversation nearing its cache's end: the idle time grows the cache
    before, wanted = decoder.max_len, list(decoder._wanted)
    assert wanted
    made = decoder.capture_deferred(lambda: False)
    assert decoder.max_len > before and made == 1 + len(wanted) and not decoder._wanted
    got = _prefill(decoder, two, continues=True)
    assert decoder.last_prefill.startswith("reused")
    _assert_same(got, want)


def test_a_turns_new_rows_replay_their_own_graph_once_captured(engine, decoder):
    """A continued prefill's new rows go through a graph of their own (positions and the mask over the whole
    cache as inputs, so one capture serves any prefix): eager the first time (deferred), wanted, captured while
    idle, then replayed by the next turn of about as many new rows, with a whole prefill's results."""
    from orin.decode import AFTER

    one, three = _turns(engine, 150, 180, seed=2)
    two = (three[0][:240], three[1][..., :240])
    want = _prefill(decoder, three, continues=False)
    decoder.release()
    decoder._wanted.clear()
    _prefill(decoder, one, continues=True, steps=3)
    # the first turn already wants the buckets of a next turn about as long as itself
    assert any(key[3:] == (AFTER,) for key in decoder._wanted)
    _prefill(decoder, two, continues=True, steps=3)
    assert decoder.last_prefill == "reused_deferred"
    assert (128, (0, 2), None, AFTER) in decoder._wanted  # its 90 new rows' bucket
    decoder._need = decoder.max_len  # the idle time grows the cache too: the graph's mask spans the new one
    before = decoder.max_len
    decoder.capture_deferred(lambda: False)
    assert decoder.max_len > before and (128, (0, 2), None, AFTER) in decoder._prefill_graphs
    got = _prefill(decoder, three, continues=True)
    assert decoder.last_prefill == "reused_graph"
    _assert_same(got, want)


def test_an_ended_turn_wants_the_bucket_of_its_answer_and_a_question(engine, decoder):
    """At a turn's prefill only its own length is known, and it wants a next turn about as long. Once the answer
    is done, turn_ended is told the next turn's likely new rows: their bucket is wanted, captured while idle and
    replayed, with a whole prefill's results, where the prefill's guess had missed it."""
    from orin.decode import AFTER, prefill_bucket

    one, two = _turns(engine, 100, 420, seed=4)
    want = _prefill(decoder, two, continues=False)
    decoder.release()
    decoder._wanted.clear()
    _prefill(decoder, one, continues=True, steps=3)
    key = (prefill_bucket(420), (0, 2), None, AFTER)
    assert key not in decoder._wanted  # the prefill's guess: a next turn of about 100 new rows
    decoder.turn_ended(420)
    assert key in decoder._wanted
    decoder._wanted.clear()
    decoder.turn_ended(420)  # once a turn
    assert not decoder._wanted
    _prefill(decoder, one, continues=True, steps=3)
    decoder.turn_ended(420)
    decoder.capture_deferred(lambda: False)
    assert key in decoder._prefill_graphs
    got = _prefill(decoder, two, continues=True)
    assert decoder.last_prefill == "reused_graph"
    _assert_same(got, want)


def test_a_turn_whose_mask_would_be_too_large_prefills_its_rows_eagerly(engine, decoder, monkeypatch):
    """A continued prefill's graph holds a mask of (query heads of a group x rows x cache positions): past
    AFTER_MASK_MAX the new rows go the eager way (no mask), with the same results, and no such graph is wanted."""
    import orin.decode as D

    one, two = _turns(engine, 150, 90, seed=4)
    want = _prefill(decoder, two, continues=False)
    decoder.release()
    monkeypatch.setattr(D, "AFTER_MASK_MAX", 0)
    decoder._wanted.clear()
    _prefill(decoder, one, continues=True, steps=2)
    got = _prefill(decoder, two, continues=True)
    assert decoder.last_prefill == "reused"
    assert not any(key[3:] == (D.AFTER,) for key in decoder._wanted)  # no capture that could never be used
    _assert_same(got, want)


def test_a_conversations_turns_through_the_engine_equal_whole_prefills(engine):
    """Two Realtime-like turns through the engine: the second, continuing the first, gives the same text and
    speech as the same request prefilled whole, and reads its shared rows (the timeline says so)."""
    from orin.contract import AudioChunk, Done, GenerationRequest, TextDelta
    from orin.media import synth_speechlike

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


def test_a_conversations_second_turn_replays_the_bucket_its_first_answer_wanted(engine, decoder):
    """Through the engine: once a turn's answer is done, the next turn's new rows (that answer, then a user turn
    as long as this one) are predicted from the prompt and the answer's length, and their bucket is captured while
    idle, so the second turn replays a graph; the first turn's prefill had only wanted buckets as long as itself
    (its system prompt included), which the second turn's rows outgrow here."""
    from orin.contract import Done, GenerationRequest, TextDelta
    from orin.decode import PREFILL_LOOKAHEAD, prefill_bucket
    from orin.media import synth_speechlike

    first = [{"role": "user", "content": [{"type": "audio", "audio": synth_speechlike(6.0, seed=3)},
                                          {"type": "text", "text": "What did you hear?"}]}]

    def run(messages):
        req = GenerationRequest(messages=tuple(messages), max_new_tokens=120, max_audio_frames=4, continues=True,
                                ignore_eos=True)
        events = list(engine.stream(req))
        report = next(e.report for e in events if isinstance(e, Done))
        return "".join(e.text for e in events if isinstance(e, TextDelta)), report

    text, one = run(first)
    engine.capture_deferred(lambda: False)
    second = [*first, {"role": "assistant", "content": text},
              {"role": "user", "content": [{"type": "audio", "audio": synth_speechlike(6.0, seed=4)},
                                           {"type": "text", "text": "And now?"}]}]
    _, two = run(second)
    # past the buckets the first prefill wanted (its own length and up to PREFILL_LOOKAHEAD/2 more)
    assert prefill_bucket(two.prompt_tokens - one.prompt_tokens) > prefill_bucket(one.prompt_tokens
                                                                                 + PREFILL_LOOKAHEAD // 2)
    assert decoder.last_prefill == "reused_graph"


def test_a_failed_idle_capture_leaves_nothing_to_read(engine, decoder):
    """A capture that fails midway may have written over the held rows: nothing is read from them after it."""
    one, two = _turns(engine, 150, 90)
    _prefill(decoder, one, continues=True)
    assert decoder._wanted

    def fail(key, inputs):
        decoder.k_cache[0].zero_()  # what a capture does to the rows before it fails
        raise RuntimeError("capture failed")

    decoder._prefill_graph = fail
    try:
        with pytest.raises(RuntimeError, match="capture failed"):
            decoder.capture_deferred(lambda: False)
    finally:
        del decoder._prefill_graph
    _prefill(decoder, two, continues=True)
    assert not decoder.last_prefill.startswith("reused")


@pytest.mark.parametrize("rows", [None, 40])
def test_the_talkers_projections_run_on_fixed_blocks(rows):
    """The talker's user-turn projections see only PROJECTION_ROWS-row inputs (a long prompt's: blocks of
    LONG_PROJECTION_ROWS, here 40), whatever the prompt's length, so a row's projection has the same bits in every
    turn (on CUDA a GEMM's kernel depends on its rows)."""
    from orin.talker import PROJECTION_ROWS, _in_blocks

    block = rows or PROJECTION_ROWS
    given = {"rows": rows} if rows else {}
    proj = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.Linear(32, 8))
    seen: list[int] = []
    proj.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[1]))
    x = torch.randn(1, 3 * block + 5, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = _in_blocks(proj, x, **given)
        shorter = _in_blocks(proj, x[:, :block + 9], **given)
    assert set(seen) == {block} and len(seen) == 4 + 2
    assert whole.shape == (1, x.shape[1], 8)
    assert torch.equal(shorter, whole[:, :block + 9])
    torch.testing.assert_close(whole, proj(x))


def test_a_prompt_over_the_held_bytes_is_not_held(engine, decoder, monkeypatch):
    """Holding keeps a prompt's embeddings and recorded states alive between requests: never more than
    HELD_MAX_BYTES of them (outside the plan, inside its runtime margin)."""
    from orin import decode

    one, two = _turns(engine, 150, 90)
    row = one[0].element_size() * one[0].shape[-1] * 3  # the embeddings and the two recorded states
    monkeypatch.setattr(decode, "HELD_MAX_BYTES", 150 * row - 1)
    _prefill(decoder, one, continues=True)
    _prefill(decoder, two, continues=True)
    assert not decoder.last_prefill.startswith("reused")
    monkeypatch.setattr(decode, "HELD_MAX_BYTES", 150 * row)
    _prefill(decoder, one, continues=True)
    _prefill(decoder, two, continues=True)
    assert decoder.last_prefill.startswith("reused")


@pytest.mark.parametrize("holds", [True, False])
def test_a_long_prompt_overwrites_its_embeddings_only_where_none_are_held(engine, decoder, monkeypatch, holds):
    """A long prompt's prefill (one layer at a time) overwrites its input embeddings in place, no whole-prompt
    copy, where nothing reads them after: not recorded, and not held for a next turn; a prompt small enough to
    hold keeps them. The results are those of the copying prefill."""
    import orin.components as components
    import orin.decode as D

    monkeypatch.setattr(components, "LONG_PREFILL_TOKENS", 100)
    if not holds:
        monkeypatch.setattr(D, "HELD_MAX_BYTES", 0)
    one, two = _turns(engine, 150, 90, seed=5)
    embeds = one[0].clone()
    got = decoder.prefill(embeds, one[1], 200, record=(2,), continues=True)
    assert decoder.last_prefill == "long"
    assert torch.equal(embeds, one[0]) == holds and (decoder._held is not None) == holds
    decoder.release()
    want = decoder.prefill(one[0].clone(), one[1], 200, record=(0, 2))  # recorded: never overwritten
    torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.states[2], want.states[2], atol=1e-4, rtol=1e-4)
