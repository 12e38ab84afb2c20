"""The garbage collector in a long-lived engine. Compiling and capturing leave millions of long-lived objects
(dynamo's and inductor's graphs, guards and kernels, the graphs' bookkeeping); a full collection that walks them
all lands at a random point of a later request (a compiled engine's TTFT varied by 10-20 ms where a graph
engine's did not, and a server that captured more since its warm-up paid it again). So after any request or idle
capture that added captures, the heap is collected once and what survives moves to the permanent generation; on
close it becomes collectable again and is collected, so the next engine of the process starts from a clean heap.
See docs/architecture.md (the decode path)."""

from __future__ import annotations

import gc


class HeapSettler:
    """Freezes the heap whenever the count of captures it is told has grown since the last freeze."""

    def __init__(self) -> None:
        self.frozen_at: int | None = None  # the capture count at the last freeze; None: nothing frozen

    @property
    def frozen(self) -> bool:
        return self.frozen_at is not None

    def settle(self, captures: int) -> bool:
        """Collect and freeze if `captures` (the engine's captures so far) grew since the last freeze: True if it
        froze."""
        if captures <= (self.frozen_at or 0):
            return False
        gc.collect()
        gc.freeze()
        self.frozen_at = captures
        return True

    def release(self) -> None:
        """What was frozen is collectable again (the engine's own cycles included), and collected."""
        if self.frozen_at is not None:
            gc.unfreeze()
            self.frozen_at = None
            gc.collect()


__all__ = ["HeapSettler"]
