"""`orin-omni plan` and the runtime agree: on the quantized tiny model, at budgets from below the least a request
runs in, through time-sliced, to all-resident, the planner's verdict for a request (the CPU profile, as
`plan`'s auto picks on this machine) is the engine's own for the same request, and the engine refuses exactly
where the planner says it does not fit. On a unified-memory profile the pinned staging buffers count in every
stage, and a request whose largest single allocation is over the profile's ceiling is refused whatever the
budget: by the plan and by the engine alike."""

from __future__ import annotations

from dataclasses import replace

import pytest

from orin.contract import GenerationRequest
from orin.device.profile import CPU
from orin.errors import BudgetError
from orin.memory.plan import PlanConfig, make_plan, plan_request
from orin.memory.request_sizes import Request, pinned_host_bytes

TEXT_TOKENS = 8


def _request() -> GenerationRequest:
    """One small image, a question, speech out: the encode, think and speak stages all take part."""
    from orin.inputs.media import synth_image

    parts = [{"type": "image", "image": synth_image(224)}, {"type": "text", "text": "What is in it?"}]
    return GenerationRequest(messages=({"role": "user", "content": parts},), max_new_tokens=TEXT_TOKENS,
                             max_audio_frames=4, ignore_eos=True)


def _plan(model: str, budget: int):
    """The planner's verdict for the same request: one 224-pixel image, no audio, TEXT_TOKENS, speech."""
    return make_plan(PlanConfig(model=model, budget=budget, audio_seconds=0, images=1, image_size=224,
                                text_tokens=TEXT_TOKENS, speech=True, device_profile="cpu")).verdict


def _engine(model: str, budget: int):
    from orin.runtime.engine import Engine, EngineConfig

    return Engine(EngineConfig(model_dir=model, device="cpu", power_backend="none", budget=budget))


def _kind(verdict) -> str:
    return "all-resident" if verdict.all_resident else "time-sliced" if verdict.time_sliced else "does not fit"


@pytest.fixture(scope="module")
def budgets(quantized_dir) -> dict[str, int]:
    """Budgets around the planner's thresholds for the request: the least it runs in, and all-resident."""
    v = _plan(quantized_dir, 1 << 40)
    assert v.min_budget < v.all_resident_bytes  # time-slicing saves something here, or the test proves little
    return {"below the least": v.min_budget - 1, "the least": v.min_budget,
            "between": (v.min_budget + v.all_resident_bytes) // 2, "just short of all-resident":
            v.all_resident_bytes - 1, "all-resident": v.all_resident_bytes, "plenty": 4 * v.all_resident_bytes}


WANT = {"below the least": "does not fit", "the least": "time-sliced", "between": "time-sliced",
        "just short of all-resident": "time-sliced", "all-resident": "all-resident", "plenty": "all-resident"}


@pytest.mark.parametrize("where", list(WANT))
def test_plan_and_engine_give_the_same_verdict(quantized_dir, budgets, where):
    budget = budgets[where]
    planned = _plan(quantized_dir, budget)
    assert _kind(planned) == WANT[where], planned.reason
    engine = _engine(quantized_dir, budget)
    try:
        if not planned.time_sliced:
            with pytest.raises(BudgetError, match="does not fit"):
                engine.plan(_request())
            return
        got = engine.plan(_request()).verdict
    finally:
        engine.close()
    assert _kind(got) == _kind(planned), (got.reason, planned.reason)
    assert [s.resident for s in got.schedule] == [s.resident for s in planned.schedule]
    assert (got.peak_bytes, got.min_budget, got.all_resident_bytes) == (
        planned.peak_bytes, planned.min_budget, planned.all_resident_bytes)


@pytest.mark.parametrize("where", ["the least", "all-resident"])
def test_the_engine_runs_where_the_plan_says_it_fits(quantized_dir, budgets, where):
    """Not only the engine's verdict: the request runs, within the budget the planner said it fits."""
    budget = budgets[where]
    engine = _engine(quantized_dir, budget)
    try:
        _, audio, report = engine.generate(_request())
    finally:
        engine.close()
    assert audio is not None and len(audio) > 0
    assert 0 < report.peak_bytes <= budget


# ---------------------------------------------------------------- unified memory and the allocation ceiling

# A CPU profile that plans as the Orin does: pinned staging counted against the budget (unified memory), with
# 1 MiB staging buffers (the tiny model's budgets are tens of MB), and a ceiling on one allocation.
UNIFIED = replace(CPU, capabilities=replace(CPU.capabilities, unified_memory=True),
                  memory=replace(CPU.memory, stage_bytes=1 << 20))


def _plan_for(model: str, budget: int, profile):
    sizes = make_plan(PlanConfig(model=model, device_profile="cpu")).sizes
    req = Request(audio_seconds=0, images=1, image_size=224, text_tokens=TEXT_TOKENS, speech=True)
    return plan_request(sizes, req, budget, profile, 4)[3]


def _engine_with(model: str, budget: int, profile):
    from orin.runtime.engine import Engine, EngineConfig

    return Engine(EngineConfig(model_dir=model, device="cpu", power_backend="none", budget=budget, profile=profile))


def test_unified_memory_plans_the_pinned_staging_in_every_stage(quantized_dir):
    discrete, unified = _plan_for(quantized_dir, 1 << 40, CPU), _plan_for(quantized_dir, 1 << 40, UNIFIED)
    pinned = pinned_host_bytes(UNIFIED.memory)
    assert pinned == 4 << 20
    assert unified.all_resident_bytes == discrete.all_resident_bytes + pinned
    assert unified.min_budget == discrete.min_budget + pinned
    # at the discrete plan's least budget the unified one does not fit
    assert not _plan_for(quantized_dir, discrete.min_budget, UNIFIED).time_sliced


def test_the_engine_counts_the_pinned_staging_as_the_plan_does(quantized_dir):
    least = _plan_for(quantized_dir, 1 << 40, UNIFIED).min_budget
    planned = _plan_for(quantized_dir, least, UNIFIED)
    assert planned.time_sliced and not _plan_for(quantized_dir, least - 1, UNIFIED).time_sliced
    for budget in (least, least - 1):
        engine = _engine_with(quantized_dir, budget, UNIFIED)
        try:
            if budget < least:
                with pytest.raises(BudgetError, match="does not fit"):
                    engine.plan(_request())
                continue
            got = engine.plan(_request()).verdict
        finally:
            engine.close()
        assert (got.peak_bytes, got.min_budget, got.all_resident_bytes) == (
            planned.peak_bytes, planned.min_budget, planned.all_resident_bytes)


def test_the_engine_refuses_an_allocation_over_the_ceiling_as_the_plan_does(quantized_dir):
    largest = _plan_for(quantized_dir, 1 << 40, UNIFIED).largest
    assert largest.own  # the request's own, with 1 MiB staging buffers
    ceiling = replace(UNIFIED, memory=replace(UNIFIED.memory, max_allocation_bytes=largest.bytes - 1))
    planned = _plan_for(quantized_dir, 1 << 40, ceiling)
    assert planned.over_ceiling
    engine = _engine_with(quantized_dir, None, ceiling)
    try:
        with pytest.raises(BudgetError, match="cannot run on this device"):
            engine.plan(_request())
    finally:
        engine.close()
