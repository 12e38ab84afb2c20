"""The machine's own storage -> device bandwidth, measured in the benchmark's run beside the loader's swap-ins: a
checkpoint file read in large blocks into a pinned buffer and copied to the device, with the page cache dropped
for that file first (cold: the disk) and then again warm (the page cache). The loader's swap-in throughput is
compared with these, so "at storage speed" is a fraction of a figure from the same host and run. Both ways of
reading are timed (one read at a time, and several pieces in flight as the loader reads): the swap-in is compared
with the faster."""

from __future__ import annotations

import os
import time
from pathlib import Path

BLOCK = 64 << 20
# The cold reads read this much of the file (each after dropping it from the page cache): enough to time the disk,
# where the whole thinker shard twice over would take 20 s of a 10-minute run.
COLD_BYTES = 4 << 30


def _drop_cache(path: Path) -> bool:
    """Ask the kernel to drop the file's clean pages (no root needed); False where it cannot."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _read_to_device(path: Path, device, size: int, parallel: bool) -> float:
    """Seconds to bring the file's first `size` bytes into device memory, BLOCK bytes at a time through one
    pinned buffer: each block read with one read call, or (`parallel`) in pieces on several threads at once as
    the loader reads (orin.memory.block_reader.read_span)."""
    import torch

    from orin.memory.block_reader import read_span

    pinned = torch.empty(BLOCK, dtype=torch.uint8, pin_memory=device.type == "cuda")
    target = torch.empty(size, dtype=torch.uint8, device=device)
    view = memoryview(pinned.numpy())
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < size:
            n = min(BLOCK, size - done)
            if parallel:
                read_span(f.fileno(), view[:n], done, str(path))
            elif f.readinto(view[:n]) != n:
                break
            target[done:done + n].copy_(pinned[:n], non_blocking=False)
            done += n
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    del target, pinned, view
    if device.type == "cuda":
        # the file-sized block goes back to the driver: left in the allocator's cache, the next engine's loader
        # counted it as the process's own from before (orin.memory.loader: the cap), and the first time-sliced run
        # after it held gigabytes over its budget
        torch.cuda.empty_cache()
    return seconds


def storage_bandwidth(path: str, device, cold_bytes: int = COLD_BYTES) -> dict:
    """{"file", "bytes", "cold_gb_s", "warm_gb_s": the storage read as the loader reads it (several reads in
    flight); "cold_single_gb_s", "warm_single_gb_s": one read at a time}. Cold figures (None where the page cache
    could not be dropped) read the file's first `cold_bytes`, dropped before each; warm ones the whole file."""
    import torch

    device = torch.device(device)
    p = Path(path)
    size = p.stat().st_size
    head = min(size, cold_bytes)
    out = {"file": p.name, "bytes": size, "cold_bytes": head, "block_bytes": BLOCK}
    for parallel, suffix in ((False, "_single"), (True, "")):
        dropped = _drop_cache(p)
        cold = _read_to_device(p, device, head, parallel)
        out[f"cold{suffix}_gb_s"] = head / cold / 1e9 if dropped else None
    for parallel, suffix in ((False, "_single"), (True, "")):
        _read_to_device(p, device, size, parallel)  # the whole file into the page cache, where it fits
        out[f"warm{suffix}_gb_s"] = size / _read_to_device(p, device, size, parallel) / 1e9
    return out


__all__ = ["storage_bandwidth"]
