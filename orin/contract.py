"""What the engine takes and gives, without torch or numpy: the request, the events its stream yields, the
per-request report, and the events an observer of residency sees. The server, the CLI, smoke and the benchmark
read these types and nothing inside the engine."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .plan import Stage, frame_cap
from .power.energy import EnergyReport

if TYPE_CHECKING:  # the samples' type only: consumers without numpy import this module too
    import numpy as np


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
    packed: int = 0  # of the units swapped in, those read from their packed copies (orin.packed_cache)
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
        }


@dataclass(frozen=True)
class Done:
    report: Report
