"""Reading many tensors of a safetensors file at once: the byte span that holds them read in one piece into a
pinned staging buffer, copied to the device in one transfer, and cut into the tensors there.

The loader's INT4 experts are ~55,000 small tensors for the real thinker (a few hundred KB each); read one at a
time (safetensors' get_tensor: a pageable copy and its synchronisation each) they held the swap-in to ~2 GB/s
where the same host moves a file to the GPU at 5+ GB/s. A batch of experts is stored contiguously (quantize and
the synthetic writer write them in order), so its span is read with one `read_span` (a few pieces in parallel)
and one host-to-device copy. The tensors returned are views of the device block: a consumer that keeps one past
the load must copy it (the INT4 modules keep only what they convert).

Each loading thread stages through two pinned buffers of the profile's `memory.stage_bytes`, allocated once and
used in turn: while one buffer's copy runs (on a stream of its own, so a background load and the decode do not
queue behind each other) the next span is read into the other. A span larger than a buffer goes through them piece
by piece. The staging size, the read pieces and threads and the largest gap read through are the device profile's
(orin.device.profile.MemoryTuning), given to each reader when it is made.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import torch

from ..device.profile import MemoryTuning
from ..errors import ModelError

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I32": torch.int32,
           "I64": torch.int64, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "BOOL": torch.bool,
           "F64": torch.float64}


def tensor_index(path: str) -> tuple[int, dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]]:
    """(offset of the data section, {name: (dtype, shape, start, end)}) from the file's header; parsed once per
    version of the file (its size and modification time key the cache: a rewritten file is read anew)."""
    try:
        st = Path(path).stat()
    except OSError as exc:
        raise ModelError(f"{path}: cannot read ({exc}); restore it from the checkpoint") from exc
    return _tensor_index(path, st.st_size, st.st_mtime_ns)


# One entry per file a load reads: a checkpoint segment and a packed copy per INT4 unit, ~120 at the real
# dimensions. With 16, the talker's 21 files read in turn evicted each other, and every swap-in parsed the
# segment's header again (two fifths of a talker load).
@lru_cache(maxsize=1024)
def _tensor_index(path: str, _size: int, _mtime_ns: int):
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (OSError, struct.error, ValueError) as exc:
        raise ModelError(f"{path}: not a readable safetensors file ({exc}); restore it from the checkpoint") from exc
    index = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ModelError(f"{path}: tensor {name} has dtype {info['dtype']}, which orin-omni does not read")
        start, end = info["data_offsets"]
        index[name] = (_DTYPES[info["dtype"]], tuple(info["shape"]), start, end)
    return 8 + length, index


class _Lane:
    """One loading thread's staging: two host buffers (pinned on CUDA) filled in turn, each with the event of the
    device copy that last read it, and the stream those copies run on. On its own stream a copy neither waits
    for the kernels queued after it nor holds them up: a background load no longer stalls the decode. The buffers
    are allocated once per thread (pinning them anew for every unit cost more than reading a thinker layer)."""

    def __init__(self, device: torch.device, stage: int):
        cuda = device.type == "cuda"
        self.buffers = [torch.empty(stage, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
        self.events: list = [None, None]
        self.stream = torch.cuda.Stream(device) if cuda else None
        self._turn = 0

    def take(self) -> int:
        """The buffer to fill next, once the copy that last read it has landed."""
        i, self._turn = self._turn, self._turn ^ 1
        if self.events[i] is not None:
            self.events[i].synchronize()  # releases the GIL
            self.events[i] = None
        return i

    def new_block(self, size: int, device: torch.device, alloc=None) -> torch.Tensor:
        """Device memory for a span (from `alloc(size)` where given): allocated on the compute stream (its memory
        may have been freed there by kernels still queued, so the copies wait for those first)."""
        block = alloc(size) if alloc is not None else torch.empty(size, dtype=torch.uint8, device=device)
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(device))
        return block

    def copy(self, i: int, host: torch.Tensor, target: torch.Tensor) -> None:
        """Copy `host` (a slice of buffer i) into `target`: on CUDA asynchronously, on the lane's stream."""
        if self.stream is None:
            target.copy_(host)
            return
        with torch.cuda.stream(self.stream):
            target.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.events[i] = event

    def settle(self) -> None:
        """Wait for every copy issued (the blocks are whole; the buffers free)."""
        for i, event in enumerate(self.events):
            if event is not None:
                event.synchronize()
                self.events[i] = None


_LANES = threading.local()


def _lane(device: torch.device, stage: int) -> _Lane:
    """The calling thread's staging for `device` with buffers of `stage` bytes (one size a process, but in tests)."""
    lanes = getattr(_LANES, "by_device", None)
    if lanes is None:
        lanes = _LANES.by_device = {}
    if (device, stage) not in lanes:
        lanes[device, stage] = _Lane(device, stage)
    return lanes[device, stage]


class BlockReader:
    """`read(names)` -> {name: tensor on `device`} for tensors of one file, each run of them that lies together
    read in one go. `read_ahead(names)` starts the disk part of a later `read` of the same names on a background
    thread (file reads release the GIL), so reading the next batch overlaps converting this one; `read(names,
    then=next_names)` starts it before waiting for this read's copy to the device, so the disk and the copy
    overlap too. `memory`: the device profile's staging and read tuning (default: the profiles' common numbers)."""

    def __init__(self, path: Path, device: torch.device, memory: MemoryTuning | None = None):
        self.path = str(path)
        self.device = device
        self.memory = memory or MemoryTuning()
        # the most one read-ahead holds, and the piece a longer span is streamed in
        self.stage = self.memory.stage_bytes
        self.base, self.index = tensor_index(self.path)
        self._ahead: tuple | None = None

    def _runs(self, names, max_gap: int) -> list[list]:
        try:
            entries = sorted(((n, self.index[n]) for n in set(names)), key=lambda item: item[1][2])
        except KeyError as exc:
            raise ModelError(f"{self.path}: has no tensor {exc}; the checkpoint is incomplete") from exc
        runs: list[list] = []
        for item in entries:
            if runs and item[1][2] - runs[-1][-1][1][3] <= max_gap:
                runs[-1].append(item)
            else:
                runs.append([item])
        return runs

    @staticmethod
    def _span(run: list) -> tuple[int, int]:
        return run[0][1][2], max(e[3] for _, e in run)

    def _read_host(self, runs: list[list], buffer: torch.Tensor) -> list[tuple[list, torch.Tensor]]:
        """The runs' bytes from the file into `buffer` (a staging buffer): (run, its bytes) each. Runs on the
        reading thread for a read-ahead: no CUDA call here."""
        out, at = [], 0
        with open(self.path, "rb", buffering=0) as f:
            for run in runs:
                lo, hi = self._span(run)
                host = buffer[at:at + hi - lo]
                read_span(f.fileno(), memoryview(host.numpy()), self.base + lo, self.path, self.memory)
                out.append((run, host))
                at += hi - lo
        return out

    def read_ahead(self, names, max_gap: int | None = None) -> None:
        """Start reading `names` from disk in the background (at most one such read: a second is ignored; one
        larger than a staging buffer is read when asked for)."""
        max_gap = self.memory.max_read_gap if max_gap is None else max_gap
        runs = self._runs(names, max_gap)
        size = sum(hi - lo for lo, hi in map(self._span, runs))
        if self._ahead is None and size <= self.stage:
            # made here, on the loading thread: the reading thread makes no CUDA call
            lane = _lane(self.device, self.stage)
            i = lane.take()
            self._ahead = (frozenset(names), max_gap, i, _reader_thread().submit(self._read_host, runs,
                                                                                  lane.buffers[i]))

    def drop_ahead(self) -> None:
        """Forget a read-ahead that no read will take (its load failed or was given up): once it has finished,
        so that its staging buffer is not filled while a later read uses it."""
        if self._ahead is not None:
            futures.wait([self._ahead[3]])
            self._ahead = None

    def read(self, names, max_gap: int | None = None, then=None, alloc=None,
             then_in: BlockReader | None = None) -> dict[str, torch.Tensor]:
        """The named tensors on the device (views of one block per run: see the module doc). `max_gap`: the
        most bytes between two tensors read as one run (0 where views must not keep other bytes alive; by default
        the profile's `max_read_gap`). `then`:
        names to read ahead (with the same `max_gap`) while this read's copy runs, from this file or from
        `then_in`'s (the next unit's first batch: without it each unit's first read waited on the disk alone).
        `alloc(nbytes)`: where the blocks' device memory comes from (by default torch's allocator)."""
        max_gap = self.memory.max_read_gap if max_gap is None else max_gap
        lane = _lane(self.device, self.stage)
        key = frozenset(names)
        staged = None
        if self._ahead is not None:
            ahead, gap, i, future = self._ahead
            self._ahead = None
            host_runs = future.result()  # the buffer is free again only once it has landed
            if ahead == key and gap == max_gap:
                staged = (i, host_runs)
        landing: list[tuple[list, torch.Tensor]] = []  # (run, its device block), cut once the copies have landed
        if staged is None:
            runs = self._runs(names, max_gap)
            if sum(hi - lo for lo, hi in map(self._span, runs)) <= self.stage:
                i = lane.take()
                staged = (i, self._read_host(runs, lane.buffers[i]))
            else:  # larger than a staging buffer: piece by piece, each piece's copy overlapping the next read
                landing = [(run, self._read_streamed(run, lane, alloc)) for run in runs]
        if staged is not None:
            i, host_runs = staged
            for run, host in host_runs:
                block = lane.new_block(host.numel(), self.device, alloc)
                lane.copy(i, host, block)
                landing.append((run, block))
        if then:
            (then_in or self).read_ahead(then, max_gap)
        lane.settle()
        out: dict[str, torch.Tensor] = {}
        for run, block in landing:
            out.update(_cut(run, block))
        return out

    def _read_streamed(self, run: list, lane: _Lane, alloc=None) -> torch.Tensor:
        """A run larger than a staging buffer into its device block, a buffer's bytes at a time (the copies may
        still be running when this returns)."""
        lo, hi = self._span(run)
        block = lane.new_block(hi - lo, self.device, alloc)
        with open(self.path, "rb", buffering=0) as f:
            done = 0
            while done < hi - lo:
                n = min(self.stage, hi - lo - done)
                i = lane.take()
                host = lane.buffers[i][:n]
                read_span(f.fileno(), memoryview(host.numpy()), self.base + lo + done, self.path, self.memory)
                lane.copy(i, host, block[done:done + n])
                done += n
        return block


def _cut(run: list, block: torch.Tensor) -> dict[str, torch.Tensor]:
    """The run's tensors as views of its device block (a misaligned one copied: a view needs its dtype's
    alignment)."""
    lo = run[0][1][2]
    out = {}
    for name, (dtype, shape, start, end) in run:
        raw = block[start - lo:end - lo]
        if (start - lo) % dtype.itemsize:
            raw = raw.clone()
        out[name] = raw.view(dtype).view(shape)
    return out


def read_span(fd: int, view: memoryview, offset: int, path: str = "", memory: MemoryTuning | None = None) -> None:
    """Fill `view` with the file's bytes from `offset`, `memory.read_piece` bytes at a time on `read_threads`
    threads at once (at most one a core): one thread copying out of the page cache (or waiting on one NVMe request
    at a time) moved a thinker layer at about the speed of its copy to the device; several reads in flight are what
    the storage delivers."""
    memory = memory or MemoryTuning()
    size = memory.read_piece
    pieces = [(at, min(size, len(view) - at)) for at in range(0, len(view), size)]

    def piece(at: int, n: int) -> None:
        while n:
            got = os.preadv(fd, [view[at:at + n]], offset + at)
            if got <= 0:
                raise ModelError(f"{path}: ends early (nothing at byte {offset + at} of the {offset + len(view)} "
                                 "needed); the file is truncated")
            at, n = at + got, n - got

    if len(pieces) < 2:
        for at, n in pieces:
            piece(at, n)
        return
    pool = _piece_pool(max(1, min(memory.read_threads, os.cpu_count() or 1)))
    for future in [pool.submit(piece, at, n) for at, n in pieces]:
        future.result()


@lru_cache(maxsize=4)
def _piece_pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="orin-pread")


_THREAD: list[ThreadPoolExecutor] = []


def _reader_thread() -> ThreadPoolExecutor:
    """One background thread for every reader's read-ahead (a daemon pool: it never holds up the exit)."""
    if not _THREAD:
        _THREAD.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="orin-read"))
    return _THREAD[0]


__all__ = ["BlockReader", "read_span", "tensor_index"]
