"""SDPA restricted to flash, memory-efficient and math kernels, never cuDNN's: for the engine's work and for
quantize's BF16 passes.

torch >= 2.10 prefers cuDNN's attention on sm90 and sm100 once its bundled cuDNN is new enough (torch 2.11 on the
H200 the benchmarks run on). cuDNN builds an execution plan for every input shape on its first sight, and new
shapes come all the time:
- the engine's eager paths: every Realtime turn's audio in the audio encoder, a prefill bucket before its graph
  is captured, a continued turn's prefill. In run 20b a turn's eager audio-encoder pass took 75-84 ms where the
  same pass over a shape seen before took 9 ms;
- quantize's passes through transformers' generate(), whose cache grows by a row every token.
Flash and memory-efficient kernels build nothing per shape. The Orin (sm87) never preferred cuDNN, so on the
board nothing changes.

The switch is torch's global one (not per thread: the quantize gate's threads are covered too). It is held for
the work above and given back after, so other code in the process (the benchmark's HF reference) keeps torch's
choice."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def without_cudnn_attention() -> Iterator[None]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        yield
