"""Out of memory as an answer: which exceptions are allocation failures, what the board has free, and the errors
(orin.errors.OutOfMemoryError) that say both.

An allocation fails in several words, depending on where it was made:

- torch's caching allocator raises torch.OutOfMemoryError ("Tried to allocate 2.00 GiB");
- on Tegra a failed cudaMalloc can trip an NVML assert in PyTorch instead (a RuntimeError "NVML_SUCCESS == r
  INTERNAL ASSERT FAILED", pytorch issue 185240): the allocator asks NVML for its report and NVML has none there;
- kernels, cuBLAS and the driver: "CUDA error: out of memory", "CUDA driver error: out of memory",
  CUBLAS_STATUS_ALLOC_FAILED;
- NvMap (L4T 36.4.7 on): "NvMapMemAllocInternalTagged ... error 12";
- the weight arenas' driver calls (orin.memory.vmm_driver.DriverError) with CUDA_ERROR_OUT_OF_MEMORY (2);
- the CPU allocator, whose memory on a Jetson is the GPU's: "DefaultCPUAllocator: can't allocate memory".

The readings: the device's free memory (torch.cuda.mem_get_info), /proc/meminfo's MemAvailable and, on L4T
kernels, its NvMapMemUsed / NvMapMemFree lines (world-readable; NvMap's debugfs under /sys/kernel/debug needs
root, so it is not read). Each is None where it cannot be read.
"""

from __future__ import annotations

import logging
import re
import sys
from dataclasses import dataclass

from ..device.cuda_abi import CUDA_ERROR_OUT_OF_MEMORY
from ..errors import OutOfMemoryError
from ..units import format_bytes

log = logging.getLogger("orin.memory.oom")

# The words of an allocation failure in a RuntimeError's message (see the module's docstring).
_TEXTS = re.compile(r"out of memory|NVML_SUCCESS == r|INTERNAL ASSERT FAILED.*CUDACachingAllocator|"
                    r"cudaErrorMemoryAllocation|CUBLAS_STATUS_ALLOC_FAILED|NvMapMemAllocInternalTagged|"
                    r"can't allocate memory", re.IGNORECASE)
_DRIVER_OOM = re.compile(rf"CUDA driver error {CUDA_ERROR_OUT_OF_MEMORY}\b")
_TRIED = re.compile(r"[Tt]ried to allocate ([0-9.]+) ?(bytes|B|KiB|MiB|GiB|TiB)\b")
_UNITS = {"bytes": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


@dataclass(frozen=True)
class AllocationFailure:
    """What an allocation failure said: its type and first line, and the bytes it was for where it says."""

    cause: str
    allocation: int | None


def _is_failure(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    torch = sys.modules.get("torch")  # not imported: no torch error can have been raised
    if torch is not None:
        oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
        if isinstance(exc, oom):
            return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    if type(exc).__name__ == "DriverError":  # orin.memory.vmm_driver's: a driver call's result code
        return getattr(exc, "code", None) == CUDA_ERROR_OUT_OF_MEMORY or bool(_DRIVER_OOM.search(text))
    return bool(_TEXTS.search(text))


def allocation_failure(exc: BaseException) -> AllocationFailure | None:
    """`exc` as an allocation failure, or None where it is something else. An error raised `from` one (a wrapper
    that names what was being loaded) counts as one."""
    seen = 0
    link: BaseException | None = exc
    while link is not None and seen < 5:
        if _is_failure(link):
            first = (str(link).strip().splitlines() or [""])[0]
            cause = f"{type(link).__name__}: {first[:300]}" if first else type(link).__name__
            return AllocationFailure(cause, allocation_size(link))
        link, seen = link.__cause__, seen + 1
    return None


def allocation_size(exc: BaseException) -> int | None:
    """The bytes the failed allocation was for, where the error says: torch's "Tried to allocate 2.00 GiB", the
    CPU allocator's "tried to allocate N bytes", a DriverError's `size`."""
    size = getattr(exc, "size", None)
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = _TRIED.search(str(exc))
    if match is None:
        return None
    return int(float(match.group(1)) * _UNITS[match.group(2)])


# ---------------------------------------------------------------------------------------------------- readings


@dataclass(frozen=True)
class MemoryReading:
    """What the board had free, each figure None where it could not be read."""

    device_free: int | None = None  # torch.cuda.mem_get_info (CUDA devices)
    device_total: int | None = None
    mem_available: int | None = None  # /proc/meminfo MemAvailable: the kernel's estimate of what can be had
    nvmap_used: int | None = None  # /proc/meminfo NvMapMemUsed (L4T kernels): what NvMap has handed out
    nvmap_free: int | None = None  # /proc/meminfo NvMapMemFree: NvMap's page pool, not all that is free

    @property
    def free(self) -> int | None:
        """The least of the device's free memory and MemAvailable (on a Jetson both draw on the same DRAM), or
        None where neither was read."""
        known = [v for v in (self.device_free, self.mem_available) if v is not None]
        return min(known) if known else None

    def describe(self) -> str:
        parts = [f"MemAvailable {_size(self.mem_available)}"]
        if self.device_free is not None:
            total = f" of {format_bytes(self.device_total)}" if self.device_total is not None else ""
            parts.append(f"CUDA free {format_bytes(self.device_free)}{total}")
        if self.nvmap_used is None:
            parts.append("NvMap not readable")
        else:
            parts.append(f"NvMap used {format_bytes(self.nvmap_used)}, its pool free {_size(self.nvmap_free)}")
        return ", ".join(parts)

    def to_json(self) -> dict:
        return {"free_bytes": self.free, "device_free_bytes": self.device_free,
                "device_total_bytes": self.device_total, "mem_available_bytes": self.mem_available,
                "nvmap_used_bytes": self.nvmap_used, "nvmap_free_bytes": self.nvmap_free}


def _size(n: int | None) -> str:
    return "not readable" if n is None else format_bytes(n)


def read_meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo's fields in bytes; {} where it cannot be read (not Linux)."""
    try:
        with open(path, encoding="ascii", errors="replace") as fh:
            text = fh.read()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            out[key.strip()] = int(fields[0]) * (1024 if fields[1:2] == ["kB"] else 1)
    return out


def read_memory(device=None, meminfo_path: str = "/proc/meminfo") -> MemoryReading:
    """What the board has free now: `device`'s (a torch.device; its free memory where it is CUDA), MemAvailable
    and NvMap's lines from `meminfo_path`."""
    device_free = device_total = None
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        try:
            device_free, device_total = torch.cuda.mem_get_info(device)
        except RuntimeError as exc:  # the driver may refuse even this after a failure: the rest still tells
            log.warning("cannot read the device's free memory: %s", exc)
    info = read_meminfo(meminfo_path)
    return MemoryReading(device_free, device_total, info.get("MemAvailable"), info.get("NvMapMemUsed"),
                         info.get("NvMapMemFree"))


# ---------------------------------------------------------------------------------------------------- errors

_FOR_LESS = "ask for less (fewer max_tokens, shorter audio or video, no speech)"


def out_of_memory(failure: AllocationFailure, asked: int, memory: MemoryReading) -> OutOfMemoryError:
    """The error answering a request whose allocation failed: what it asked, what failed, what is free now that
    its memory has been given back, and what to do."""
    what = f"an allocation of {format_bytes(failure.allocation)}" if failure.allocation else "an allocation"
    return OutOfMemoryError(
        f"out of memory: {what} failed while the request ran ({failure.cause}). The request was planned at "
        f"{format_bytes(asked)} beside the weights; the board has {_size(memory.free)} free now "
        f"({memory.describe()}). Its memory was released and the server goes on: retry once more memory is "
        f"free, {_FOR_LESS}, or leave the board more room (stop other processes using the GPU, or serve with a "
        "smaller --budget)", asked=asked, allocation=failure.allocation, memory=memory)


def refused(asked: int, failed_asked: int, failed_free: int | None, seconds_ago: float,
            memory: MemoryReading) -> OutOfMemoryError:
    """The error refusing, without running it, a request at least as large as one that ran out of memory while
    no more memory is free than then (orin.serve.admission.MemoryPolicy)."""
    then = f" with {format_bytes(failed_free)} free" if failed_free is not None else ""
    return OutOfMemoryError(
        f"out of memory: a request planned at {format_bytes(failed_asked)} ran out of memory {seconds_ago:.0f} s "
        f"ago{then}; this one is planned at {format_bytes(asked)} and the board has {_size(memory.free)} free now "
        f"({memory.describe()}), so it was not tried. A request this large runs again once more memory is free "
        f"than then: retry later, or {_FOR_LESS}", asked=asked, memory=memory, tried=False)


__all__ = ["AllocationFailure", "MemoryReading", "allocation_failure", "allocation_size", "out_of_memory",
           "read_meminfo", "read_memory", "refused"]
