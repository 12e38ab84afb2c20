"""The SDPA kernels the engine's attention may use: flash, memory-efficient and math, never cuDNN's.

torch >= 2.10 prefers cuDNN's attention on sm90 and sm100 once its bundled cuDNN is new enough (torch 2.11 on the
H200 the benchmarks run on). cuDNN builds an execution plan for every input shape on its first sight, and the
engine's eager paths meet new shapes all the time: every Realtime turn's audio in the audio encoder, a prefill
bucket before its graph is captured, code2wav's last chunk. In run 20b a turn's eager audio-encoder pass took
75-84 ms where the same pass over a shape seen before took 9 ms. Flash and memory-efficient kernels build
nothing per shape. The Orin (sm87) never preferred cuDNN, so this makes the benchmark host run what the board runs.

The switch is torch's global one (not per thread): it is held for the engine's own work (a request, the deferred
captures) and given back after, so other code in the process (the benchmark's HF reference) keeps torch's choice."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def engine_attention() -> Iterator[None]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        yield
