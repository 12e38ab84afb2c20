"""The machine's own storage -> device bandwidth, measured in the benchmark's run beside the loader's swap-ins: a
checkpoint file read in large blocks into a pinned buffer and copied to the device, with the page cache dropped
for that file first (cold: the disk) and then again warm (the page cache). The loader's swap-in throughput is
compared with these, so "at storage speed" is a fraction of a figure from the same host and run."""

from __future__ import annotations

import os
import time
from pathlib import Path

BLOCK = 64 << 20


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


def _read_to_device(path: Path, device) -> float:
    """Seconds to bring the whole file into device memory, BLOCK bytes at a time through one pinned buffer."""
    import torch

    size = path.stat().st_size
    pinned = torch.empty(BLOCK, dtype=torch.uint8, pin_memory=device.type == "cuda")
    target = torch.empty(size, dtype=torch.uint8, device=device)
    view = pinned.numpy()
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < size:
            n = f.readinto(memoryview(view)[:min(BLOCK, size - done)])
            if not n:
                break
            target[done:done + n].copy_(pinned[:n], non_blocking=False)
            done += n
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    del target
    return seconds


def storage_bandwidth(path: str, device) -> dict:
    """{"file", "bytes", "cold_gb_s" (None where the page cache could not be dropped), "warm_gb_s"}."""
    import torch

    device = torch.device(device)
    p = Path(path)
    size = p.stat().st_size
    dropped = _drop_cache(p)
    cold = _read_to_device(p, device)
    warm = _read_to_device(p, device)
    return {"file": p.name, "bytes": size, "cold_gb_s": size / cold / 1e9 if dropped else None,
            "warm_gb_s": size / warm / 1e9, "block_bytes": BLOCK}


__all__ = ["storage_bandwidth"]
