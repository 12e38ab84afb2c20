"""One lock between CUDA graph captures and the loader's background loads. While a stream captures, CUDA work
from another thread (the prefetch thread's allocations and copies) is illegal under the default capture mode: it
fails and invalidates the capture (seen on an H200 at a 19 GiB budget: "operation not permitted when stream is
capturing"). So a capture holds the lock, and a background load takes it around each batch or module it moves:
a capture waits for at most one module, a load for at most one capture. The prefill holds it too: its thousands
of eager launches need the GIL, which the loading thread's Python work would take from them every switch
interval (the 20 GiB prefill took 0.27 s beside the speech side's load, 0.05 s alone). Reentrant: a prefill may
capture."""

from __future__ import annotations

import threading

GATE = threading.RLock()

__all__ = ["GATE"]
