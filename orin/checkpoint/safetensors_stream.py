"""Writing a safetensors file one tensor at a time: the header is laid out from a plan first, then each tensor is
written (and hashed) as it is produced, so a checkpoint larger than host memory never sits in memory whole, and
its sha256 needs no second pass. Used by the synthetic benchmark checkpoint and by `orin-omni convert`."""

from __future__ import annotations

import hashlib
import json
import queue
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelError

_ST_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "int32": "I32", "int64": "I64",
              "uint8": "U8", "int8": "I8", "bool": "BOOL", "float64": "F64", "int16": "I16"}


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: object  # torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def _header(plan: list[PlannedTensor], metadata: dict[str, str]) -> bytes:
    header: dict = {"__metadata__": metadata}
    offset = 0
    for p in plan:
        dtype = _ST_DTYPES.get(str(p.dtype).removeprefix("torch."))
        if dtype is None:
            raise ValueError(f"{p.name}: dtype {p.dtype} has no safetensors name")
        header[p.name] = {"dtype": dtype, "shape": list(p.shape), "data_offsets": [offset, offset + p.nbytes]}
        offset += p.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # the tensor data starts 8-aligned
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors_stream(path: Path, plan: list[PlannedTensor], tensors: Iterator[tuple[str, object]],
                             metadata: dict[str, str]) -> tuple[int, str]:
    """Write a safetensors file from tensors yielded in `plan` order (any device), one at a time; a writer
    thread writes and hashes while the next tensor is drawn. Returns (file bytes, sha256)."""
    import torch

    digest = hashlib.sha256()
    chunks: queue.Queue = queue.Queue(maxsize=64)
    failure: list[BaseException] = []

    def drain(fh) -> None:
        while True:
            item = chunks.get()
            if item is None:
                return
            if failure:
                continue
            try:
                fh.write(item)
                digest.update(item)
            except OSError as exc:
                failure.append(exc)

    with open(path, "wb") as fh:
        head = _header(plan, metadata)
        fh.write(head)
        digest.update(head)
        worker = threading.Thread(target=drain, args=(fh,), name="orin-synthetic-writer", daemon=True)
        worker.start()
        try:
            count = 0
            for (name, tensor), want in zip(tensors, plan, strict=True):
                if name != want.name or tensor.dtype != want.dtype or tuple(tensor.shape) != want.shape:
                    raise RuntimeError(f"synthetic tensor {name} {tensor.dtype} {tuple(tensor.shape)} does not "
                                       f"match the planned {want.name} {want.dtype} {want.shape}")
                host = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
                chunks.put(memoryview(host))
                count += 1
                if failure:
                    break
        finally:
            chunks.put(None)
            worker.join()
        if failure:
            raise ModelError(f"{path}: write failed ({failure[0]})")
        if count != len(plan):
            raise RuntimeError(f"{path}: {count} tensors written, {len(plan)} planned")
        fh.flush()
        size = fh.tell()
    return size, digest.hexdigest()
