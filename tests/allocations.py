"""Allocations: the bytes of the tensors torch ops create, counted per storage while a dispatch mode is on; the
quantize memory tests compare them with what the plan counts."""

from __future__ import annotations

import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class Allocations:
    """Bytes of the tensors ops create while one of its modes is on (in any thread: a dispatch mode is per
    thread), each storage counted once and until its last tensor dies; the peak since `mark()`."""

    def __init__(self):
        self.live: dict[int, list] = {}
        self.bytes = 0
        self.peak = 0
        self.lock = threading.Lock()

    def mark(self) -> int:
        self.peak = self.bytes
        return self.bytes

    def _drop(self, key: int) -> None:
        with self.lock:
            entry = self.live.get(key)
            if entry is not None:
                entry[1] -= 1
                if not entry[1]:
                    self.bytes -= entry[0]
                    del self.live[key]

    def mode(self, on_tensor=None) -> TorchDispatchMode:
        outer = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                          if isinstance(t, torch.Tensor)}
                for t in tree_flatten(out)[0]:
                    if not isinstance(t, torch.Tensor):
                        continue
                    storage = t.untyped_storage()
                    key = storage.data_ptr()
                    with outer.lock:
                        if key in inputs and key not in outer.live:
                            continue  # a view of a tensor made elsewhere (a weight)
                        if key in outer.live:
                            outer.live[key][1] += 1
                        else:
                            outer.live[key] = [storage.nbytes(), 1]
                            outer.bytes += storage.nbytes()
                            outer.peak = max(outer.peak, outer.bytes)
                    weakref.finalize(t, outer._drop, key)
                    if on_tensor is not None:
                        on_tensor(t)
                return out

        return Mode()


__all__ = ["Allocations"]
