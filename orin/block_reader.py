"""Reading many tensors of a safetensors file at once: the byte span that holds them read in one piece into a
pinned host buffer, copied to the device in one transfer, and cut into the tensors there.

The loader's INT4 experts are ~55,000 small tensors for the real thinker (a few hundred KB each); read one at a
time (safetensors' get_tensor: a pageable copy and its synchronisation each) they held the swap-in to ~2 GB/s
where the same host moves a file to the GPU at 5+ GB/s. A batch of experts is stored contiguously (quantize and
the synthetic writer write them in order), so its span is read with one `readinto` and one host-to-device copy.
The tensors returned are views of the device block: a consumer that keeps one past the load must copy it (the
INT4 modules keep only what they convert).
"""

from __future__ import annotations

import json
import struct
from concurrent.futures import Future, ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import torch

from .errors import ModelError

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I32": torch.int32,
           "I64": torch.int64, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "BOOL": torch.bool,
           "F64": torch.float64}
# A span larger than this is read in pieces (the pinned buffer's size): bounds the host memory a load pins.
MAX_BLOCK = 256 << 20
# Tensors closer than this in the file are read in one span (the bytes between them read and dropped).
MAX_GAP = 1 << 20


def tensor_index(path: str) -> tuple[int, dict[str, tuple[torch.dtype, tuple[int, ...], int, int]]]:
    """(offset of the data section, {name: (dtype, shape, start, end)}) from the file's header; parsed once per
    version of the file (its size and modification time key the cache: a rewritten file is read anew)."""
    try:
        st = Path(path).stat()
    except OSError as exc:
        raise ModelError(f"{path}: cannot read ({exc}); restore it from the checkpoint") from exc
    return _tensor_index(path, st.st_size, st.st_mtime_ns)


@lru_cache(maxsize=16)
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


class BlockReader:
    """`read(names)` -> {name: tensor on `device`} for tensors of one file, each run of them that lies together
    read in one go. `read_ahead(names)` starts the disk part of a later `read` of the same names on a background
    thread (file reads release the GIL), so reading the next batch overlaps converting this one."""

    def __init__(self, path: Path, device: torch.device):
        self.path = str(path)
        self.device = device
        self.base, self.index = tensor_index(self.path)
        self._pinned: torch.Tensor | None = None
        self._ahead: tuple[frozenset, Future] | None = None

    def _buffer(self, size: int) -> torch.Tensor:
        if self._pinned is None or self._pinned.numel() < size:
            self._pinned = None  # the old buffer goes before the larger one is pinned
            self._pinned = torch.empty(max(size, 1), dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        return self._pinned

    def _runs(self, names, max_gap: int = MAX_GAP) -> list[list]:
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

    def _read_host(self, runs: list[list]) -> list[tuple[list, torch.Tensor]]:
        """The runs' bytes from the file into the (one, reused) pinned buffer: (run, its bytes) each."""
        spans = [self._span(run) for run in runs]
        buffer = self._buffer(sum(hi - lo for lo, hi in spans))
        out, at = [], 0
        with open(self.path, "rb", buffering=0) as f:
            for run, (lo, hi) in zip(runs, spans, strict=True):
                host = buffer[at:at + hi - lo]
                f.seek(self.base + lo)
                got = f.readinto(memoryview(host.numpy()))
                if got != hi - lo:
                    raise ModelError(f"{self.path}: ends early (read {got} of {hi - lo} bytes); the file is truncated")
                out.append((run, host))
                at += hi - lo
        return out

    def read_ahead(self, names, max_gap: int = MAX_GAP) -> None:
        """Start reading `names` from disk in the background (at most one such read: a second is ignored)."""
        runs = self._runs(names, max_gap)
        size = sum(hi - lo for lo, hi in map(self._span, runs))
        if self._ahead is None and size <= MAX_BLOCK:
            # pinned here, on the loading thread: the reading thread then makes no CUDA call (orin.cuda_gate)
            self._buffer(size)
            self._ahead = (frozenset(names), max_gap, _reader_thread().submit(self._read_host, runs))

    def read(self, names, max_gap: int = MAX_GAP) -> dict[str, torch.Tensor]:
        """The named tensors on the device (views of one block per run: see the module doc). `max_gap`: the
        most bytes between two tensors read as one run (0 where views must not keep other bytes alive)."""
        key = frozenset(names)
        if self._ahead is not None:
            ahead, gap, future = self._ahead
            self._ahead = None
            host_runs = future.result()  # the buffer is free again only once it has landed
            if ahead == key and gap == max_gap:
                return self._to_device(host_runs)
        runs = self._runs(names, max_gap)
        if sum(hi - lo for lo, hi in map(self._span, runs)) <= MAX_BLOCK:
            return self._to_device(self._read_host(runs))
        out: dict[str, torch.Tensor] = {}
        for run in runs:  # larger than the pinned buffer may grow: piece by piece
            out.update(self._read_large(run))
        return out

    def _to_device(self, host_runs) -> dict[str, torch.Tensor]:
        out = {}
        for run, host in host_runs:
            block = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)
            block.copy_(host)  # synchronous: the pinned buffer is reused by the next read
            out.update(_cut(run, block))
        return out

    def _read_large(self, run: list) -> dict[str, torch.Tensor]:
        lo, hi = self._span(run)
        block = torch.empty(hi - lo, dtype=torch.uint8, device=self.device)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.base + lo)
            done = 0
            while done < hi - lo:
                n = min(MAX_BLOCK, hi - lo - done)
                host = self._buffer(n)[:n]
                got = f.readinto(memoryview(host.numpy()))
                if got != n:
                    raise ModelError(f"{self.path}: ends early (read {got} of {n} bytes); the file is truncated")
                block[done:done + n].copy_(host)
                done += n
        return _cut(run, block)


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


_THREAD: list[ThreadPoolExecutor] = []


def _reader_thread() -> ThreadPoolExecutor:
    """One background thread for every reader's read-ahead (a daemon pool: it never holds up the exit)."""
    if not _THREAD:
        _THREAD.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix="orin-read"))
    return _THREAD[0]


__all__ = ["BlockReader", "tensor_index"]
