"""One request's state while it runs: what the stages have produced and when. Each request gets its own; nothing
of a request is kept on the engine."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from ..contract import EnergyReport, GenerationRequest, Report


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
