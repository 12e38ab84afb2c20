"""What the engine takes and gives, without torch or numpy: the request, the events its stream yields, the
per-request report (its schedule's stages and its energy included), and the events an observer of residency sees.
The server, the CLI, smoke and the benchmark read these types and nothing inside the engine. A leaf: it imports
nothing of orin, so every layer may read it (orin.memory.plan and orin.power.energy build its Stage and EnergyReport)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the samples' type only: consumers without numpy import this module too
    import numpy as np


def frame_cap(text_tokens: int, max_frames: int | None = None) -> int:
    """Most codec frames the talker may produce for `text_tokens` of text (it normally stops at its own EOS
    first): 8 a token is 0.64 s of speech per token, far above real speech, plus slack for short answers.
    The engine stops the talker here, and the planner sizes the talker's KV cache from it."""
    return max_frames or text_tokens * 8 + 32


@dataclass(frozen=True)
class GenerationRequest:
    messages: tuple
    max_new_tokens: int = 256
    speech: bool = True
    voice: str = "ethan"  # a speaker name of the talker config
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    max_audio_frames: int | None = None
    talker_temperature: float = 0.0  # 0 = greedy; the HF reference samples at 0.9 with top_k 50
    stream_speech: bool = True  # False: speak after the whole text, as the HF reference does
    ignore_eos: bool = False  # fixed lengths, for benchmarks
    # A conversation's next turn (the Realtime API's): its prompt starts with the last request's, whose keys and
    # values the caches may still hold; where the weights stay put, that prefix is read, not computed again.
    continues: bool = False

    @property
    def frame_cap(self) -> int:
        """Most codec frames the talker may produce: the planner's cap, so its KV cache is what was budgeted."""
        return frame_cap(self.max_new_tokens, self.max_audio_frames)


@dataclass(frozen=True)
class TextDelta:
    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class AudioChunk:
    """Samples at orin.audio_format.OUTPUT_SAMPLE_RATE, and the codec frames first vocoded in this chunk (each a tuple of one code
    per code group): concatenated over a request's chunks, the frames of its speech."""

    samples: np.ndarray
    index: int
    frames: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class Swap:
    """A component moved in or out of device memory: all of it, or `units` of its `of_units` (a decoder's
    layers each are one; orin.components)."""

    component: str
    direction: str  # "in" or "out"
    bytes: int
    seconds: float
    background: bool = False
    units: int = 1
    of_units: int = 1
    packed: int = 0  # of the units swapped in, those read from their packed copies (orin.memory.packed_cache)
    written: int = 0  # packed copies this swap-in wrote (the first load of a unit with a cache)

    def to_json(self) -> dict:
        return {"component": self.component, "direction": self.direction, "bytes": self.bytes,
                "seconds": round(self.seconds, 6), "background": self.background, "units": self.units,
                "of_units": self.of_units, "packed": self.packed, "written": self.written}


@dataclass(frozen=True)
class Staged:
    """An observer event: the components of a pipeline stage are resident (after any swaps), with the allocator's
    bytes at that moment and its peak so far in the request."""

    components: tuple[str, ...]
    resident: tuple[str, ...]
    allocated_bytes: int
    peak_bytes: int

    def to_json(self) -> dict:
        return {"stage": list(self.components), "resident": list(self.resident),
                "allocated": self.allocated_bytes, "peak_so_far": self.peak_bytes}


# An observer is called with each Staged and Swap event as it happens, on the engine's thread.
Observer = Callable[[object], None]


@dataclass
class Stage:
    """One stage of a request's residency schedule (orin.memory.plan): the components resident together and their bytes."""

    name: str
    resident: tuple[str, ...]
    bytes: int

    def to_json(self) -> dict:
        return {"name": self.name, "resident": list(self.resident), "bytes": self.bytes}


@dataclass(frozen=True)
class Energy:
    """Energy over one window (or several, summed). `joules` is None when no reading covers the window: that
    is "not measured", never zero. `covered_seconds` < `seconds` means readings cover only part of it."""

    joules: float | None
    mean_w: float | None
    peak_w: float | None
    seconds: float
    covered_seconds: float = 0.0
    samples: int = 0
    count: int = 1

    @property
    def available(self) -> bool:
        return self.joules is not None

    @property
    def complete(self) -> bool:
        return self.available and self.covered_seconds >= self.seconds - 1e-9 * max(1.0, self.seconds)

    def to_json(self) -> dict:
        return {
            "joules": self.joules, "mean_w": self.mean_w, "peak_w": self.peak_w, "seconds": self.seconds,
            "covered_seconds": self.covered_seconds, "samples": self.samples, "count": self.count,
            "complete": self.complete,
        }


@dataclass(frozen=True)
class EnergyReport:
    """Energy of one request (or any measured window): the board total, each rail, and each pipeline stage
    that ran inside it (a stage that ran several times is summed; nested stages are each counted in full).
    orin.power.energy integrates it from the power samples."""

    name: str
    backend: str
    backends: tuple[str, ...]
    total: Energy
    rails: Mapping[str, Energy] = field(default_factory=dict)
    by_stage: Mapping[str, Energy] = field(default_factory=dict)

    @property
    def joules(self) -> float | None:
        return self.total.joules

    @property
    def mean_w(self) -> float | None:
        return self.total.mean_w

    @property
    def peak_w(self) -> float | None:
        return self.total.peak_w

    @property
    def seconds(self) -> float:
        return self.total.seconds

    @property
    def available(self) -> bool:
        return self.total.available

    @property
    def complete(self) -> bool:
        return self.total.complete

    @property
    def note(self) -> str | None:
        if not self.total.available:
            return "power not measured: no power backend was reading during this window"
        if not self.total.complete:
            return (f"power readings cover {self.total.covered_seconds:.3f} s of {self.total.seconds:.3f} s; "
                    "joules are for the covered part only")
        return None

    def to_json(self) -> dict:
        out = {
            "name": self.name, "backend": self.backend, "backends": list(self.backends),
            "available": self.available, "complete": self.complete,
            "joules": self.joules, "mean_w": self.mean_w, "peak_w": self.peak_w, "seconds": self.seconds,
            "covered_seconds": self.total.covered_seconds, "samples": self.total.samples,
            "rails": {name: e.to_json() for name, e in self.rails.items()},
            "by_stage": {name: e.to_json() for name, e in self.by_stage.items()},
        }
        if self.note:
            out["note"] = self.note
        return out


@dataclass(frozen=True)
class Report:
    """One request's outcome and figures."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    token_ids: tuple[int, ...]
    ttft_s: float | None
    first_audio_s: float | None
    tokens_per_s: float | None
    total_s: float
    talker_frames: int
    talker_s: float
    audio_seconds: float
    peak_bytes: int
    budget_bytes: int | None
    device: str
    schedule: tuple[Stage, ...]
    streaming_speech: bool
    swaps: tuple[Swap, ...]
    resident_after: tuple[str, ...]
    energy: EnergyReport
    cancelled: bool
    finish_reason: str  # "stop" (end of turn), "length" (max_new_tokens) or "cancelled"
    timeline_s: Mapping[str, float] = field(default_factory=dict)  # seconds from the start to each first output
    # The named routes this request took through the hot path, each chosen once: the device profile, the MoE
    # backend, how the thinker's and the talker's prefills ran (orin.runtime.prefill_route.PrefillRoute's values).
    routes: Mapping[str, str] = field(default_factory=dict)
    # Of the prompt, the leading tokens read from the thinker's KV cache instead of prefilled again (a
    # conversation's next turn: the rows it shares with the last prompt).
    cached_tokens: int = 0

    def to_json(self) -> dict:
        return {
            "text": self.text, "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "token_ids": list(self.token_ids), "ttft_s": self.ttft_s, "first_audio_s": self.first_audio_s,
            "timeline_s": dict(self.timeline_s), "tokens_per_s": self.tokens_per_s, "total_s": self.total_s,
            "talker_frames": self.talker_frames, "talker_s": self.talker_s, "audio_seconds": self.audio_seconds,
            "peak_bytes": self.peak_bytes, "budget_bytes": self.budget_bytes, "device": self.device,
            "schedule": [s.to_json() for s in self.schedule], "streaming_speech": self.streaming_speech,
            "swaps": [s.to_json() for s in self.swaps], "resident_after": list(self.resident_after),
            "energy": self.energy.to_json(), "cancelled": self.cancelled, "finish_reason": self.finish_reason,
            "routes": dict(self.routes), "cached_tokens": self.cached_tokens,
        }


@dataclass(frozen=True)
class Done:
    report: Report
