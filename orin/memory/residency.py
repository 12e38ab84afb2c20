"""Residency under a budget, as arithmetic over byte counts: the stages a request's schedule makes resident and
in what order, which units give way when a stage needs room, and what a stream of such requests moves in its
steady state. The loader follows these decisions with real tensors; `plan` runs them on the planner's sizes to
print the steady-state schedule. One policy for both, so what `plan` promises is what the loader does.

Units are orin.components' (a decoder's layers one by one, everything else whole): a stage needs its components
whole, but a component outside it may stay in part, so the thinker gives the speech side only the layers it needs
and gets only those back on the next request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from .. import components as C


@dataclass(frozen=True)
class StageCall:
    """One staging of a request: make `comps` resident beside `working` bytes; then, where it fits once what
    the request needs no more gives way, start loading `next_comps` in the background. `later`: what the request needs after
    this stage, in order of use (it decides what gives way). `wait=False`: load `comps` in the background
    (between requests, for the next one)."""

    comps: tuple[str, ...]
    working: int
    next_comps: tuple[str, ...] = ()
    later: tuple[str, ...] = ()
    wait: bool = True


@dataclass(frozen=True)
class StagePlan:
    """A request's stagings by role, in order: the encoder stages, the thinker's (before the prefill), the
    speech side joining the thinker (streaming speech: one staging per speech component in order of need, the
    talker's prefill starting while the code predictor and code2wav still load), the speech stages after the
    text (the first one starts the talker, a second one the vocoder), and the next request's first stage loaded
    in the background."""

    encode: tuple[StageCall, ...]
    think: StageCall
    join: tuple[StageCall, ...]
    speak: tuple[StageCall, ...]
    next: StageCall | None

    def calls(self) -> list[StageCall]:
        out = [*self.encode, self.think, *self.join, *self.speak]
        return out + ([self.next] if self.next else [])


def stage_plan(stages: Sequence[tuple[str, ...]], needed: Sequence[str], working: Callable[[tuple[str, ...]], int],
               streaming: bool, speech: bool, keeps_weights: bool, prefetch: bool = True) -> StagePlan:
    """The stagings the engine makes for a request whose schedule is `stages` (each stage's components, in
    order). `streaming`: the talker speaks while the thinker decodes; `keeps_weights`: all-resident."""

    def later(comps: tuple[str, ...]) -> tuple[str, ...]:
        here = next((i for i, s in enumerate(stages) if set(comps) <= set(s)), len(stages))
        return tuple(dict.fromkeys(c for s in stages[here + 1:] for c in s if c not in comps))

    def call(comps, next_comps=(), wait=True) -> StageCall:
        comps = tuple(comps)
        return StageCall(comps, working(comps), tuple(next_comps), later(comps), wait)

    think_comps = next(s for s in stages if "thinker_text" in s)
    speak_after = list(stages[stages.index(think_comps) + 1:])
    encoders = tuple(c for c in ("audio_encoder", "vision_encoder") if c in needed)
    enc_stages = [s for s in stages if s and set(s) <= set(encoders)]
    encode = tuple(call(comps, enc_stages[i + 1] if i + 1 < len(enc_stages) else think_comps)
                   for i, comps in enumerate(enc_stages))
    speech_here = tuple(c for c in think_comps if c != "thinker_text")
    if speech_here and not keeps_weights:
        # The prefill needs the thinker alone: the speech side loads in the background meanwhile.
        think = call(("thinker_text",), speech_here)
    else:
        think = call(think_comps, speak_after[0] if speak_after else ())
    join: tuple[StageCall, ...] = ()
    if speech and streaming:
        # One staging for the whole speech side made the talker's prefill wait for all of it (1.14 GB at 20 GiB),
        # code2wav included, which only the first audio chunk needs.
        parts = [c for c in C.SPEECH_COMPONENTS if c in think_comps]
        join = tuple(call(("thinker_text", *parts[:i + 1])) for i in range(len(parts) - 1)) + (call(think_comps),)
    speak: tuple[StageCall, ...] = ()
    if speech and not streaming:
        if len(speak_after) > 1:  # one component at a time: talk, then vocode
            speak = (call(("talker", "code_predictor"), ("code2wav",)), call(("code2wav",)))
        else:
            speak = (call(C.SPEECH_COMPONENTS),)
    first = stages[0] if stages else ()
    following = call(first, wait=False) if first and prefetch and not keeps_weights else None
    return StagePlan(encode, think, join, speak, following)


def eviction_order(units: Iterable[str], stage: Sequence[str], later: Sequence[str]) -> list[str]:
    """`units` (resident or arriving) in the order they give way for a stage holding `stage`: first those of
    components the request needs no more (in pipeline order), then of those it needs furthest ahead; within a
    component its last layers first and the rest (embeddings, norms, heads) last. The stage's own never."""
    ranked = [c for c in C.PIPELINE if c not in later] + list(reversed(later))
    rank = {c: i for i, c in enumerate(ranked)}
    out = [u for u in units if C.unit_component(u) not in stage]
    return sorted(out, key=lambda u: (rank[C.unit_component(u)], -C.unit_sort_key(u)[1]))


def to_evict(held: Mapping[str, int], incoming: int, working: int, budget: int,
             order: Sequence[str]) -> list[str] | None:
    """The fewest units, taken in `order`, whose eviction makes room for `incoming` bytes beside `working`;
    None where evicting all of `order` is not enough."""
    total = sum(held.values()) + incoming + working
    out = []
    for unit in order:
        if total <= budget:
            break
        out.append(unit)
        total -= held[unit]
    return out if total <= budget else None


def prefetch_room(held: Mapping[str, int], incoming: int, call: StageCall, budget: int) -> list[str] | None:
    """What gives way for a background load of `incoming` bytes after `call`'s stage: only what the request
    needs no more (the encoders, once encoded), never what it still needs; None where that is not enough."""
    order = [u for u in eviction_order(held, call.comps, call.later) if C.unit_component(u) not in call.later]
    return to_evict(held, incoming, call.working, budget, order)


@dataclass
class Moves:
    """What one staging moved, per component: bytes and units loaded while the request waits ("in"), loaded in
    the background ("ahead": the next stage's components, or the next request's first stage) and evicted
    ("out")."""

    call: StageCall
    bytes: dict[str, dict[str, int]] = field(default_factory=lambda: {"in": {}, "ahead": {}, "out": {}})
    units: dict[str, dict[str, int]] = field(default_factory=lambda: {"in": {}, "ahead": {}, "out": {}})

    def add(self, kind: str, unit: str, nbytes: int) -> None:
        comp = C.unit_component(unit)
        self.bytes[kind][comp] = self.bytes[kind].get(comp, 0) + nbytes
        self.units[kind][comp] = self.units[kind].get(comp, 0) + 1

    def loaded(self) -> int:
        return sum(self.bytes["in"].values()) + sum(self.bytes["ahead"].values())

    def to_json(self) -> dict:
        return {"comps": list(self.call.comps), "next_request": not self.call.wait, "bytes": self.bytes,
                "units": self.units}


def simulate(calls: Sequence[StageCall], unit_sizes: Mapping[str, int], budget: int, requests: int = 3,
             resident: Iterable[str] = ()) -> list[list[Moves]]:
    """The moves of `requests` consecutive requests that each make `calls`, starting from `resident` units.
    The last request's moves are the stream's steady state: a request after an identical one finds what it
    left behind."""
    return simulate_stream([calls] * requests, unit_sizes, budget, resident)


def simulate_stream(requests: Sequence[Sequence[StageCall]], unit_sizes: Mapping[str, int], budget: int,
                    resident: Iterable[str] = ()) -> list[list[Moves]]:
    """The moves of a stream of requests, each given by its stagings, as the loader makes them. Raises
    ValueError where a stage cannot fit (the planner refuses such a request first)."""
    by_comp: dict[str, list[str]] = {}
    for unit in sorted(unit_sizes, key=C.unit_sort_key):
        by_comp.setdefault(C.unit_component(unit), []).append(unit)
    held = {u: unit_sizes[u] for u in resident}
    out = []
    for calls in requests:
        moves = []
        for call in calls:
            m = Moves(call)
            missing = [u for c in call.comps for u in by_comp.get(c, ()) if u not in held]
            gone = to_evict(held, sum(unit_sizes[u] for u in missing), call.working, budget,
                            eviction_order(held, call.comps, call.later))
            if gone is None:
                raise ValueError(f"stage {'+'.join(call.comps)} does not fit in {budget} bytes")
            for u in gone:
                m.add("out", u, held.pop(u))
            for u in missing:
                held[u] = unit_sizes[u]
                m.add("in" if call.wait else "ahead", u, unit_sizes[u])
            if call.wait:
                for comp in call.next_comps:
                    absent = [u for u in by_comp.get(comp, ()) if u not in held]
                    gone = prefetch_room(held, sum(unit_sizes[u] for u in absent), call, budget) if absent else None
                    if gone is not None:
                        for u in gone:
                            m.add("out", u, held.pop(u))
                        for u in absent:
                            held[u] = unit_sizes[u]
                            m.add("ahead", u, unit_sizes[u])
            moves.append(m)
        out.append(moves)
    return out


def stationary(moves: Sequence[Moves]) -> tuple[str, ...]:
    """The components a request's stagings use whose units none of its `moves` (in the steady state) loads or
    evicts: their weights stay at the same device addresses from request to request, so a CUDA graph captured
    over them is replayed, not captured anew."""
    used = dict.fromkeys(c for m in moves for c in m.call.comps)
    moved = {c for m in moves for kind in m.bytes.values() for c in kind}
    return tuple(c for c in used if c not in moved)


__all__ = ["Moves", "StageCall", "StagePlan", "eviction_order", "prefetch_room", "simulate",
           "simulate_stream", "stage_plan", "stationary", "to_evict"]
