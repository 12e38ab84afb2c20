"""One request's state while it runs: what the stages have produced and when. Each request gets its own; nothing
of a request is kept on the engine. Also its plan (plan_prompt: the planner's verdict and schedule for its
prompt), and what is given back when an allocation fails while it runs (release_failed)."""

from __future__ import annotations

import gc
import logging
import threading
import time
from dataclasses import dataclass, field

from ..contract import EnergyReport, GenerationRequest, Report
from ..errors import InputError

log = logging.getLogger("orin.runtime.engine")


class Cancelled(Exception):
    """The client went away; the request stops at the next step."""


@dataclass
class RequestState:
    req: GenerationRequest
    cancel: threading.Event | None
    t0: float = field(default_factory=time.perf_counter)
    ttft: float | None = None
    first_audio: float | None = None
    decode_start: float | None = None
    decode_end: float | None = None
    tokens: list[int] = field(default_factory=list)
    frames: list = field(default_factory=list)  # codec frames, one tensor [groups] each
    audio_samples: int = 0
    talker_seconds: float = 0.0
    timeline: dict[str, float] = field(default_factory=dict)  # seconds from t0 at each step to the first outputs
    routes: dict[str, str] = field(default_factory=dict)  # how its prefills ran (Report.routes)
    cached_tokens: int = 0  # the prompt's leading tokens the thinker read from its cache (Report.cached_tokens)

    def mark(self, name: str) -> None:
        self.timeline.setdefault(name, time.perf_counter() - self.t0)

    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def stop_if_cancelled(self) -> None:
        if self.cancelled():
            raise Cancelled()


@dataclass(frozen=True)
class RequestPlan:
    """The planner's numbers for one request: its schedule and the bytes each stage needs beside the weights."""

    verdict: object  # orin.memory.plan.Verdict
    kv: dict
    act: dict
    margin: int
    keeps_weights: bool  # all-resident: every weight stays put
    stages: object  # orin.memory.residency.StagePlan: the loader's stagings for this request, in order
    streaming: bool  # the talker speaks while the thinker decodes
    # The components whose whole-input work (an encoder's pass, a decoder's prefill, code2wav's chunks) replays
    # CUDA graphs: those whose weights stay put over a stream of such requests (all of them all-resident; time-
    # sliced, those orin.memory.residency's steady state never moves). A component that moves would capture anew at
    # every request (four passes' work for one replay); the graphs' pools sit in the runtime margin, as
    # all-resident. The decode steps replay graphs everywhere (re-captured where their weights moved).
    graphs: tuple[str, ...] = ()

    @property
    def asked(self) -> int:
        """The request's working bytes beside the weights, all its stages' together: the KV caches, the largest
        activations and the margin (what an out-of-memory answer says it asked)."""
        from ..memory.request_sizes import working_bytes

        return working_bytes(tuple(self.verdict.needed), self.kv, self.act, self.margin)


def plan_prompt(req: GenerationRequest, prompt, *, sizes, profile, loader, dtype_bytes: int, budget: int | None,
                prefetch: bool) -> RequestPlan:
    """The planner's verdict and schedule for `req`'s prepared `prompt` (a BudgetError where it cannot run), on the
    model's `sizes` (orin.memory.model_sizes), the device `profile` and what the `loader` holds."""
    from ..memory.plan import plan_tokens, require_fit, stagings
    from ..memory.request_sizes import AUDIO_FRAMES_PER_SECOND, Request, prompt_tokens, stage_margin

    tokens = prompt_tokens(prompt, req.max_new_tokens, req.frame_cap if req.speech else 0, sizes.dims, profile)
    budget = budget if budget is not None else 1 << 62
    # the components it needs: the planner's Request of the media this prompt holds (one definition)
    video_s = sum(grid[0] * s for grid, s in zip(prompt.video_grids, prompt.video_seconds, strict=True))
    needed = Request(audio_seconds=sum(prompt.audio_lengths) / AUDIO_FRAMES_PER_SECOND,
                     images=len(prompt.image_grids), video_seconds=video_s, speech=req.speech).needed()
    kv, act, verdict = plan_tokens(tokens, sizes, loader.sizes(), needed, budget, profile, dtype_bytes)
    require_fit(verdict)
    margin = stage_margin(profile)  # the runtime margin, and on unified memory the pinned staging buffers
    streaming = req.speech and req.stream_speech and verdict.streaming
    stages = stagings(verdict, kv, act, margin, streaming, req.speech, prefetch=prefetch)
    graphs = verdict.needed if verdict.all_resident else _stationary(stages, loader, budget)
    return RequestPlan(verdict, kv, act, margin, verdict.all_resident, stages, streaming, graphs)


def _stationary(stages, loader, budget: int) -> tuple[str, ...]:
    """The components a stream of requests like this one never moves in its steady state (orin.memory.residency,
    on the loader's sizes and what it holds now)."""
    from ..memory.residency import simulate, stationary

    try:
        moves = simulate(stages.calls(), loader.unit_sizes(), budget, resident=loader.resident_units())
    except ValueError:  # the sizes measured since the plan's estimate say otherwise: no graph is safe to keep
        return ()
    return stationary(moves[-1])


def validate(req: GenerationRequest, voices: tuple[str, ...]) -> None:
    """An InputError where `req` cannot be run whatever the memory: no tokens asked, no message, an unknown voice."""
    if req.max_new_tokens < 1:
        raise InputError("max_new_tokens must be at least 1")
    if req.speech and req.voice.lower() not in voices:
        raise InputError(f"unknown voice {req.voice!r}; voices: {', '.join(voices)}")
    if not req.messages:
        raise InputError("messages is empty: give at least one user message")


def release_failed(loader, decoders, device, failure, tokens: int) -> None:
    """After an allocation failed while a request ran, once its frames are gone: what it held goes back, so that
    the next request starts from the weights alone. Background loads are settled (one that failed too has given
    up its units: orin.memory.loader's _abandon), the thinker's and talker's KV caches and graphs are dropped (the
    next request allocates and captures what it needs; a held conversation prefix goes with them), reference
    cycles holding tensors are collected, and on CUDA the allocator's cached blocks return to the driver, where
    the board's other users (and NvMap) can have them. `failure`: the orin.memory.oom.AllocationFailure, logged
    with the `tokens` generated before it."""
    log.warning("out of memory after %d tokens: %s; releasing the request's memory", tokens, failure.cause)
    for _ in range(8):  # settle() raises the first load that failed and leaves the rest: again until none is left
        try:
            loader.settle()
            break
        except Exception as exc:  # noqa: BLE001 - what a background load raised changes nothing of the answer
            log.warning("a background load failed too: %s", exc)
    for kind in decoders.stats():  # the decoders made so far (asking for one would make it)
        if kind in ("thinker", "talker"):
            getattr(decoders, kind).release()
    loader.set_cache_bytes(0)
    gc.collect()
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()


def build_report(state: RequestState, prompt, plan: RequestPlan, energy: EnergyReport, routes: dict[str, str], *,
                 text: str, loader, budget: int | None, device: str) -> Report:
    """The request's Report from its state, its plan and what the loader saw."""
    from ..audio_format import OUTPUT_SAMPLE_RATE

    decode_tokens = max(0, len(state.tokens) - 1)
    decode_s = (state.decode_end or time.perf_counter()) - (state.decode_start or state.t0)
    req = state.req
    if state.cancelled():
        finish = "cancelled"
    else:
        finish = "length" if len(state.tokens) >= req.max_new_tokens else "stop"
    return Report(
        text=text,
        prompt_tokens=prompt.length,
        cached_tokens=state.cached_tokens,
        completion_tokens=len(state.tokens),
        token_ids=tuple(state.tokens),
        ttft_s=state.ttft,
        first_audio_s=state.first_audio,
        timeline_s=dict(state.timeline),
        tokens_per_s=(decode_tokens / decode_s) if decode_tokens and decode_s > 0 else None,
        total_s=time.perf_counter() - state.t0,
        talker_frames=len(state.frames),
        talker_s=state.talker_seconds,
        audio_seconds=state.audio_samples / OUTPUT_SAMPLE_RATE,
        peak_bytes=loader.peak_bytes(),
        budget_bytes=budget,
        device=device,
        schedule=tuple(plan.verdict.schedule),
        streaming_speech=plan.streaming,
        swaps=loader.take_swaps(),
        resident_after=loader.resident(),
        energy=energy,
        cancelled=state.cancelled(),
        finish_reason=finish,
        routes=routes,
    )
