"""One request's state while it runs: what the stages have produced and when. Each request gets its own; nothing
of a request is kept on the engine."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from .contract import GenerationRequest


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

    def mark(self, name: str) -> None:
        self.timeline.setdefault(name, time.perf_counter() - self.t0)

    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def stop_if_cancelled(self) -> None:
        if self.cancelled():
            raise Cancelled()
