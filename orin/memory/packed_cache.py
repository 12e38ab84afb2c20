"""The packed copy: INT4 modules kept in the device's kernel layout beside the checkpoint, so that loading them
again is a read and a copy, not a conversion.

A unit's INT4 modules (orin.components: one decoder layer, or the rest of a component) arrive in GPTQ's layout and
are converted to torch's int4pack layout on every load (orin.int4.pack.to_kernel): on an H200 that held the swap-in
of the thinker to 51-63 % of what the storage delivers, and the talker's small experts to 11-34 %. The first load
of a unit writes what the conversion produced to one file per unit under the cache directory; later loads read
that file straight into the modules' buffers (orin.memory.loader).

A file is valid only for what made its bytes, and says so in its own header (`key`): the format, torch's version,
the device type and its CUDA version and compute capability (or the CPU's instruction set: the CPU layout depends on
it), the compute dtype, the source of the code that converts (orin.int4.pack and its helpers), the unit, and the
identity of every checkpoint file of its component (the manifest's sha256, or size and modification time for a
checkpoint of another tool). Any difference, and the unit is converted and its file written anew.

Files are safetensors (each tensor 64-byte aligned by pad entries, so device views of a block need no copy) with a
sha256 of their data in the header. They are written to a temporary file and renamed into place, and checked
against that sha256 the first time a process uses them: a torn or corrupted file is deleted and rebuilt, never
loaded. A directory that cannot be written (or a disk without room) only costs the speed-up: loads convert, as
without a cache, after one warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from ..device.gate import GATE
from ..fsutil import atomic_path, sha256_file

log = logging.getLogger("orin.memory.packed_cache")

FORMAT = 1
ALIGN = 64
META = "orin_packed"
# Device bytes copied to the host at a time when writing (the host memory a write holds).
WRITE_CHUNK = 64 << 20
# Left free on the cache's disk after a write: a cache never fills the disk the system runs from.
DISK_MARGIN = 2 << 30
_DTYPE_NAMES = {"torch.bfloat16": "BF16", "torch.float16": "F16", "torch.float32": "F32", "torch.int32": "I32",
                "torch.uint8": "U8", "torch.int64": "I64"}
# The code whose output the files hold: a change to any of it (a fix in the conversion) rebuilds them.
_CONVERTERS = ("int4/pack.py", "int4/experts.py", "int4/linear.py", "checkpoint/gptq_format.py", "checkpoint/targets.py")
# Files (path, size, mtime) whose sha256 this process has checked or written: each is hashed once per process,
# not on every load (a rewritten file has another size or mtime, and is checked again).
_VERIFIED: set[tuple[str, int, int]] = set()
_LOCK = threading.Lock()


def resolve_dir(value: str | None, model_dir: str | None) -> str | None:
    """The cache directory a --packed-cache value names: "off" none, "auto" (or nothing) `packed-cache` inside
    the checkpoint's directory, anything else itself."""
    if value == "off" or model_dir is None:
        return None
    if value in (None, "", "auto"):
        return str(Path(model_dir) / "packed-cache")
    return value


def _code_digest() -> str:
    here = Path(__file__).parent.parent  # orin/
    digest = hashlib.sha256()
    for name in _CONVERTERS:
        digest.update((here / name).read_bytes())
    return digest.hexdigest()


def layout_key(device, dtype) -> dict:
    """Everything about this process that the kernel layout depends on."""
    import torch

    key = {"format": FORMAT, "torch": torch.__version__, "device": device.type, "dtype": str(dtype),
           "code": _code_digest()}
    if device.type == "cuda":
        key["cuda"] = torch.version.cuda
        key["capability"] = "{}.{}".format(*torch.cuda.get_device_capability(device))
    else:
        key["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    return key


def file_identities(ckpt) -> dict[str, str]:
    """{path of each checkpoint file: what identifies its content}: the manifest's sha256 where it has one (the
    checkpoint was verified against it), else size and modification time."""
    recorded = {}
    manifest = ckpt.manifest
    if not ckpt.foreign:
        for entry in manifest.shared_files:
            recorded[str(ckpt.root / entry.path)] = entry.sha256
        for name in manifest.finished:
            for entry in manifest.segment(name).files:
                recorded[str(ckpt.root / entry.path)] = entry.sha256
    out = {}
    for sources in ckpt.by_component.values():
        for source in sources:
            path = str(source.path)
            if path not in recorded:
                st = os.stat(path)
                recorded[path] = f"{st.st_size}:{st.st_mtime_ns}"
            out[path] = recorded[path]
    return out


@dataclass(frozen=True)
class PackedUnit:
    """A unit's valid packed copy: its file, each module's buffer tensors in file order ({module: {buffer:
    tensor name}}), each module's `load_packed_` metadata, and every tensor name of the file (pads included) in
    file order, for reading it in one span."""

    path: Path
    buffers: dict[str, dict[str, str]]
    meta: dict[str, dict]
    names: tuple[str, ...]


class PackedCache:
    """The packed copies of one checkpoint on one device: `find(unit, files)` a valid one, `store(unit, files,
    modules)` write one."""

    def __init__(self, root: str | os.PathLike, key: dict, identities: dict[str, str]):
        self.root = Path(root)
        self.key = key
        self.identities = identities
        self._writable = True

    @classmethod
    def open(cls, root: str | os.PathLike, ckpt, device, dtype) -> PackedCache:
        return cls(root, layout_key(device, dtype), file_identities(ckpt))

    def path(self, unit: str) -> Path:
        return self.root / (unit.replace("/", ".") + ".safetensors")

    def unit_key(self, unit: str, files) -> dict:
        """The key plus the unit and its component's checkpoint files, by name and content (not by directory: a
        checkpoint moved or copied keeps its packed copies)."""
        return {**self.key, "unit": unit, "files": {Path(f).name: self.identities.get(str(f), "?") for f in files}}

    # ------------------------------------------------------------------ reading

    def find(self, unit: str, files) -> PackedUnit | None:
        """The unit's packed copy if there is one made for exactly this key and intact; a stale one is left for
        `store` to replace, a damaged one deleted."""
        path = self.path(unit)
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("%s: cannot read the packed copy (%s); converting from the checkpoint", path, exc)
            return None
        try:
            header, data_start = _read_header(path)
            record = json.loads(header["__metadata__"][META])
            if record["key"] != self.unit_key(unit, files):
                return None  # made for another torch, device, code or checkpoint: `store` replaces it
            modules = dict(record["modules"])
            tensors = sorted(((n, info) for n, info in header.items() if n != "__metadata__"),
                             key=lambda item: item[1]["data_offsets"][0])
            end = tensors[-1][1]["data_offsets"][1] if tensors else 0
        except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error) as exc:
            return self._discard(path, f"its header is unreadable ({type(exc).__name__}: {exc})")
        if st.st_size != data_start + end:
            return self._discard(path, f"it is {st.st_size} bytes where its header says {data_start + end}")
        stamp = (str(path), st.st_size, st.st_mtime_ns)
        with _LOCK:
            known = stamp in _VERIFIED
        if not known:
            digest = sha256_file(path, 8 << 20, start=data_start)
            if digest != record.get("sha256"):
                return self._discard(path, "its sha256 does not match the one recorded when it was written")
            with _LOCK:
                _VERIFIED.add(stamp)
        buffers: dict[str, dict[str, str]] = {}
        for name, _ in tensors:
            module, _, buffer = name.rpartition(".")
            if module in modules:
                buffers.setdefault(module, {})[buffer] = name
        if set(buffers) != set(modules):
            return self._discard(path, "it lacks the buffers of a module it lists")
        return PackedUnit(path, buffers, modules, tuple(n for n, _ in tensors))

    def _discard(self, path: Path, why: str) -> None:
        log.warning("%s: the packed copy is damaged (%s); deleting it and converting from the checkpoint", path, why)
        try:
            path.unlink()
        except OSError as exc:
            log.warning("%s: cannot delete it (%s)", path, exc)
        return None

    # ------------------------------------------------------------------ writing

    def store(self, unit: str, files, modules: dict) -> int:
        """Write the unit's packed copy from its loaded INT4 modules ({path: module}); the bytes written (0 where
        the directory cannot take it: then, once, a warning, and no more attempts in this process)."""
        import torch

        if not self._writable or not modules:
            return 0
        entries, metas = [], {}
        for path, module in modules.items():
            tensors, meta = module.packed_state()
            metas[path] = meta
            entries += [(f"{path}.{b}", t.contiguous()) for b, t in tensors.items()]
        header, order, size = _layout(entries, {"key": self.unit_key(unit, files), "modules": metas,
                                                "sha256": "0" * 64})
        target = self.path(unit)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(self.root).free
            if free < size + DISK_MARGIN:
                raise OSError(f"{free >> 20} MiB free, {(size + DISK_MARGIN) >> 20} MiB needed")
            with atomic_path(target) as tmp, open(tmp, "wb") as fh:
                fh.write(header)
                digest = hashlib.sha256()
                for item in order:
                    if isinstance(item, int):  # a pad
                        chunk = bytes(item)
                        fh.write(chunk)
                        digest.update(chunk)
                        continue
                    flat = item.reshape(-1).view(torch.uint8)
                    for lo in range(0, flat.numel(), WRITE_CHUNK):
                        with GATE:  # a device-to-host copy: never during another thread's graph capture
                            host = flat[lo:lo + WRITE_CHUNK].cpu()
                        view = memoryview(host.numpy())
                        fh.write(view)
                        digest.update(view)
                fh.seek(0)
                fh.write(_with_digest(header, digest.hexdigest()))
            st = target.stat()
        except OSError as exc:
            self._writable = False
            log.warning("%s: cannot write packed copies there (%s); INT4 modules are converted on every load, "
                        "which is slower (give --packed-cache a writable directory)", self.root, exc)
            return 0
        with _LOCK:  # hashed as it was written: no need to read it back in this process
            _VERIFIED.add((str(target), st.st_size, st.st_mtime_ns))
        return size


def _layout(entries, record: dict) -> tuple[bytes, list, int]:
    """(the header, the data in order: tensors and pad sizes, the file's size) for `entries` [(name, tensor)]."""
    tensors, order, at = {}, [], 0
    for i, (name, t) in enumerate(entries):
        if at % ALIGN:
            pad = ALIGN - at % ALIGN
            tensors[f"__pad__.{i}"] = {"dtype": "U8", "shape": [pad], "data_offsets": [at, at + pad]}
            order.append(pad)
            at += pad
        nbytes = t.numel() * t.element_size()
        tensors[name] = {"dtype": _DTYPE_NAMES[str(t.dtype)], "shape": list(t.shape), "data_offsets": [at, at + nbytes]}
        order.append(t)
        at += nbytes
    header = json.dumps({"__metadata__": {META: json.dumps(record, sort_keys=True)}, **tensors}).encode()
    header += b" " * (-(8 + len(header)) % ALIGN)  # the data starts aligned too
    blob = struct.pack("<Q", len(header)) + header
    return blob, order, len(blob) + at


def _with_digest(header: bytes, digest: str) -> bytes:
    """The header with the placeholder sha256 replaced (same length: the data does not move)."""
    placeholder = b'\\"sha256\\": \\"' + b"0" * 64 + b'\\"'
    out = header.replace(placeholder, b'\\"sha256\\": \\"' + digest.encode() + b'\\"', 1)
    if len(out) != len(header) or out == header:
        raise RuntimeError("the packed copy's header has no sha256 placeholder")
    return out


def _read_header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        if length > 1 << 26:
            raise ValueError(f"a header of {length} bytes")
        return json.loads(fh.read(length)), 8 + length


__all__ = ["PackedCache", "PackedUnit", "file_identities", "layout_key", "resolve_dir"]
