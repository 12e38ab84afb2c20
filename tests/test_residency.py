"""orin.memory.residency, the policy the loader follows and `plan` prints: what gives way for a stage, and what a stream
of requests moves in its steady state, on the real model's sizes (issue 15's budgets)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from orin.cli import cli
from orin.memory.plan import PlanConfig, make_plan
from orin.memory.residency import StageCall, eviction_order, prefetch_room, simulate, to_evict

GiB = 2**30
UNITS = ["audio_encoder", "thinker_text", "thinker_text/0", "thinker_text/1", "thinker_text/10", "talker",
         "talker/0", "code2wav"]


def test_what_gives_way_first_is_what_the_request_needs_no_more_then_what_it_needs_furthest_ahead():
    # a think stage: the encoders are done; the speech side comes later; a decoder's last layers go first
    order = eviction_order(UNITS, ("vision_encoder",), later=("thinker_text", "talker", "code2wav"))
    assert order == ["audio_encoder", "code2wav", "talker/0", "talker", "thinker_text/10", "thinker_text/1",
                     "thinker_text/0", "thinker_text"]
    # the stage's own components never give way
    assert not any(u.startswith("thinker_text") for u in eviction_order(UNITS, ("thinker_text",), later=()))


def test_to_evict_takes_the_fewest_units_in_order_or_refuses():
    held = {"a": 5, "thinker_text/1": 3, "thinker_text/0": 3}
    order = ["thinker_text/1", "thinker_text/0", "a"]
    assert to_evict(held, incoming=2, working=1, budget=14, order=order) == []
    assert to_evict(held, incoming=2, working=1, budget=13, order=order) == ["thinker_text/1"]
    assert to_evict(held, incoming=2, working=1, budget=8, order=order) == ["thinker_text/1", "thinker_text/0"]
    assert to_evict(held, incoming=2, working=1, budget=2, order=order) is None


def test_a_background_load_only_displaces_what_the_request_needs_no_more():
    held = {"audio_encoder": 4, "thinker_text": 10, "code2wav": 2}
    call = StageCall(("thinker_text",), working=1, next_comps=("talker",), later=("talker", "code2wav"))
    assert prefetch_room(held, incoming=3, call=call, budget=16) == ["audio_encoder"]
    assert prefetch_room(held, incoming=8, call=call, budget=16) is None  # code2wav is still needed


def _steady(real_config, budget):
    result = make_plan(PlanConfig(model=real_config, budget=budget, device_profile="orin"))
    first, steady = result.stream[0], result.stream[-1]
    moved = {}
    for m in steady:
        for kind in ("in", "ahead"):
            for comp, units in m.units[kind].items():
                moved[comp] = moved.get(comp, 0) + units
    return result, sum(m.loaded() for m in first), sum(m.loaded() for m in steady), moved


def test_at_20_gib_the_thinker_stays_put(real_config):
    result, first, steady, moved = _steady(real_config, 20 * GiB)
    assert "thinker_text" not in moved
    assert steady < first / 5


def test_at_18_gib_the_thinker_gives_the_speech_side_only_some_layers(real_config):
    result, first, steady, moved = _steady(real_config, 18 * GiB)
    thinker_units = len(result.sizes.components["thinker_text"].units)
    assert 0 < moved["thinker_text"] < thinker_units // 4
    assert steady < first / 3
    # the steady state repeats: a fourth request moves what the third did
    calls = [m.call for m in result.stream[-1]]
    units = {u: b for c in result.sizes.components.values() for u, b in c.units.items()}
    four = simulate(calls, units, 18 * GiB, requests=4)
    assert [m.to_json() for m in four[-1]] == [m.to_json() for m in four[-2]]


def test_all_resident_moves_nothing_after_the_first_request(real_config):
    result, first, steady, moved = _steady(real_config, 24 * GiB)
    assert result.verdict.all_resident and steady == 0 and moved == {}
    assert first == sum(c.runtime_int4_bytes for c in result.sizes.components.values())


@pytest.mark.parametrize("budget", ["18GiB", "20GiB"])
def test_cli_plan_prints_the_steady_state(real_config, budget):
    res = CliRunner().invoke(cli, ["plan", real_config, "--device-profile", "orin", "--budget", budget])
    assert res.exit_code == 0, res.output
    assert "a stream of such requests loads" in res.output and "per request in the steady state" in res.output
    data = CliRunner().invoke(cli, ["plan", real_config, "--device-profile", "orin", "--budget", budget, "--json"])
    stream = json.loads(data.output)["stream"]
    assert len(stream) == 3 and stream[-1]["bytes_loaded"] < stream[0]["bytes_loaded"]
