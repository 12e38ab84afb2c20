"""The quantized checkpoint's manifest: the contract between `orin-omni quantize` and the loader.

``OUT/manifest.json`` records where the checkpoint came from (source dir, sha256 of its config.json), the tool
version, the quantization parameters, the segment split, the shared files copied once into OUT (config,
tokenizer, processor, chat template) and, per finished segment, its components, files (path relative to OUT,
bytes, sha256), byte totals and quantized modules. A segment is finished exactly when its entry exists: the
quantizer writes the segment directory first (temp dir + rename), then adds the entry by rewriting the
manifest atomically, so a killed run never leaves an entry for a half-written segment.

Device side: no torch, no quantize imports.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

from ..errors import ChecksumError, ModelError, UsageError
from ..fsutil import atomic_write_json, sha256_file

MANIFEST_NAME = "manifest.json"
FORMAT = "orin-omni-checkpoint"
# 2: the standard GPTQ directory of orin.checkpoint.files (one shard per segment at the root, hub names).
# 1: orin-omni 0.1, one directory per segment with runtime names; still read, `orin-omni convert` rewrites it.
SCHEMA_VERSION = 2
READABLE_SCHEMAS = (1, 2)


def default_served_name(bits: int | None) -> str:
    """The model id a checkpoint is served under unless told otherwise: what the README's clients pass."""
    return f"qwen3-omni-int{bits or 4}"


# A model id clients can type (qwen3-omni-int4, Qwen/Qwen3-Omni-30B-A3B-Instruct) that the service's environment
# file carries without quoting: one rule for the manifest, serve and install-service.
_SERVED_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")


def check_served_name(name: str) -> str:
    if not _SERVED_NAME.match(name):
        raise UsageError(f"invalid served model name {name!r}: use letters, digits and . _ : / @ + - (at most "
                         "128 characters, e.g. qwen3-omni-int4)")
    return name


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to OUT, '/'-separated
    bytes: int
    sha256: str

    def to_json(self) -> dict:
        return {"path": self.path, "bytes": self.bytes, "sha256": self.sha256}


@dataclass(frozen=True)
class SegmentEntry:
    name: str
    components: tuple[str, ...]
    files: tuple[FileEntry, ...]
    total_bytes: int  # every file of the segment
    int4_bytes: int  # tensor payload of its safetensors (what `orin-omni plan` predicts as int4_bytes)
    quantized_modules: tuple[str, ...]  # INT4 target paths (a fused experts path stands for all its experts)
    started_at: str
    finished_at: str
    extra: dict = field(default_factory=dict)  # calibration source, sample counts: informational

    def to_json(self) -> dict:
        return {
            "components": list(self.components),
            "files": [f.to_json() for f in self.files],
            "total_bytes": self.total_bytes,
            "int4_bytes": self.int4_bytes,
            "quantized_modules": list(self.quantized_modules),
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            **({"extra": self.extra} if self.extra else {}),
        }


@dataclass(frozen=True)
class Manifest:
    tool_version: str
    created_at: str
    source: dict  # {"model_dir": str, "config_sha256": str}
    quantization: dict  # QuantSpec.describe() plus "spec" (the QuantSpec fields) and the quantizer used
    split: dict[str, tuple[str, ...]]
    shared_files: tuple[FileEntry, ...]
    segments: dict[str, SegmentEntry] = field(default_factory=dict)
    served_model_name: str = ""  # the model id clients use; empty in manifests written before it was recorded
    schema_version: int = SCHEMA_VERSION

    # ------------------------------------------------------------------ queries the loader uses

    @property
    def model_name(self) -> str:
        return self.served_model_name or default_served_name(self.quantization.get("bits"))

    def segment(self, name: str) -> SegmentEntry:
        if name not in self.split:
            raise ModelError(f"unknown segment {name!r}; this checkpoint's segments are: {', '.join(self.split)}")
        entry = self.segments.get(name)
        if entry is None:
            raise ModelError(f"segment {name!r} was never finished; run orin-omni quantize again on the same "
                             "--out to complete it")
        return entry

    def component_segment(self, component: str) -> str:
        for name, comps in self.split.items():
            if component in comps:
                return name
        split = "; ".join(k + "=" + "+".join(v) for k, v in self.split.items())
        raise ModelError(f"component {component!r} is in no segment of this checkpoint (split: {split})")

    @property
    def finished(self) -> tuple[str, ...]:
        return tuple(n for n in self.split if n in self.segments)

    @property
    def complete(self) -> bool:
        return all(n in self.segments for n in self.split)

    def segment_split(self) -> dict[str, tuple[str, ...]]:
        return dict(self.split)

    def quant_spec(self):
        from .targets import QuantSpec

        spec = self.quantization.get("spec")
        if not isinstance(spec, dict):
            raise ModelError("manifest.json: quantization.spec is missing; re-run orin-omni quantize")
        try:
            # A spec recorded before `sym` was one of its fields was asymmetric.
            return QuantSpec(**{"sym": False, **spec})
        except TypeError as exc:
            raise ModelError(f"manifest.json: quantization.spec is not understood by this version ({exc})") from exc

    def safetensors_files(self) -> list[str]:
        """Paths (relative to OUT) of every finished segment's safetensors files, in split order."""
        return [f.path for n in self.finished for f in self.segments[n].files if f.path.endswith(".safetensors")]

    def summary(self) -> dict:
        return {
            "tool_version": self.tool_version,
            "source": self.source,
            "bits": self.quantization.get("bits"),
            "group_size": self.quantization.get("group_size"),
            "split": {k: list(v) for k, v in self.split.items()},
            "finished": list(self.finished),
            "segments": {
                n: {"components": list(e.components), "total_bytes": e.total_bytes, "int4_bytes": e.int4_bytes,
                    "files": [f.path for f in e.files], "quantized_modules": len(e.quantized_modules),
                    "finished_at": e.finished_at}
                for n, e in self.segments.items()
            },
        }

    # ------------------------------------------------------------------ (de)serialisation

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "schema_version": self.schema_version,
            "tool_version": self.tool_version,
            **({"served_model_name": self.served_model_name} if self.served_model_name else {}),
            "created_at": self.created_at,
            "source": dict(self.source),
            "quantization": self.quantization,
            "split": {k: list(v) for k, v in self.split.items()},
            "shared_files": [f.to_json() for f in self.shared_files],
            "segments": {n: self.segments[n].to_json() for n in self.split if n in self.segments},
        }

    @classmethod
    def from_json(cls, data: dict, where: str = MANIFEST_NAME) -> Manifest:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ModelError(f"{where}: not an orin-omni checkpoint manifest")
        if data.get("schema_version") not in READABLE_SCHEMAS:
            raise ModelError(f"{where}: schema version {data.get('schema_version')!r} is not one this version of "
                             f"orin-omni reads ({', '.join(map(str, READABLE_SCHEMAS))}); upgrade orin-omni, or "
                             "re-quantize with this one")
        try:
            split = {str(k): tuple(str(c) for c in v) for k, v in _need(data, "split", dict, where).items()}
            segments = {}
            for name, seg in _need(data, "segments", dict, where).items():
                if name not in split:
                    raise ModelError(f"{where}: segment {name!r} is not in the split")
                segments[name] = SegmentEntry(
                    name=name,
                    components=tuple(_need(seg, "components", list, f"{where}: segments.{name}")),
                    files=tuple(_file(f, f"{where}: segments.{name}.files")
                                for f in _need(seg, "files", list, f"{where}: segments.{name}")),
                    total_bytes=int(_need(seg, "total_bytes", int, f"{where}: segments.{name}")),
                    int4_bytes=int(_need(seg, "int4_bytes", int, f"{where}: segments.{name}")),
                    quantized_modules=tuple(_need(seg, "quantized_modules", list, f"{where}: segments.{name}")),
                    started_at=str(seg.get("started_at", "")),
                    finished_at=str(seg.get("finished_at", "")),
                    extra=dict(seg.get("extra") or {}),
                )
            return cls(
                tool_version=str(_need(data, "tool_version", str, where)),
                created_at=str(data.get("created_at", "")),
                source=dict(_need(data, "source", dict, where)),
                quantization=dict(_need(data, "quantization", dict, where)),
                split=split,
                shared_files=tuple(_file(f, f"{where}: shared_files") for f in _need(data, "shared_files", list, where)),
                segments=segments,
                served_model_name=check_served_name(str(data["served_model_name"]))
                if "served_model_name" in data else "",
                schema_version=int(data["schema_version"]),
            )
        except UsageError as exc:
            raise ModelError(f"{where}: {exc}; fix served_model_name in the manifest") from exc
        except (TypeError, ValueError) as exc:
            raise ModelError(f"{where}: malformed manifest ({exc}); re-run orin-omni quantize --force") from exc


def _need(obj: dict, key: str, kind: type, where: str):
    value = obj.get(key) if isinstance(obj, dict) else None
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise ModelError(f"{where}: field {key!r} is missing or not a {kind.__name__}; the manifest is damaged")
    return value


def _file(obj: dict, where: str) -> FileEntry:
    path = _need(obj, "path", str, where)
    if Path(path).is_absolute() or ".." in Path(path).parts:
        raise ModelError(f"{where}: file path {path!r} must be relative to the checkpoint directory")
    return FileEntry(path=path, bytes=int(_need(obj, "bytes", int, where)), sha256=str(_need(obj, "sha256", str, where)))


# ---------------------------------------------------------------------- reading and verifying


def manifest_path(out_dir: str | os.PathLike) -> Path:
    return Path(out_dir) / MANIFEST_NAME


def read_manifest(out_dir: str | os.PathLike) -> Manifest:
    path = manifest_path(out_dir)
    if not path.is_file():
        raise ModelError(f"{path}: not found; {out_dir} is not an orin-omni checkpoint (run orin-omni quantize)")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"{path}: not readable JSON ({exc}); re-run orin-omni quantize --force") from exc
    return Manifest.from_json(data, str(path))


def verify_file(out_dir: str | os.PathLike, entry: FileEntry, check_hash: bool = True) -> None:
    """Raise ChecksumError naming the file when it is missing or its size or sha256 differ from the entry."""
    path = Path(out_dir) / entry.path
    if not path.is_file():
        raise ChecksumError(f"{path}: missing (the manifest lists it); re-run orin-omni quantize to rewrite it")
    size = path.stat().st_size
    if size != entry.bytes:
        raise ChecksumError(f"{path}: {size} bytes, the manifest says {entry.bytes}; the file is truncated or was "
                            "modified; re-run orin-omni quantize --force for its segment")
    if check_hash:
        digest = sha256_file(path)
        if digest != entry.sha256:
            raise ChecksumError(f"{path}: sha256 {digest[:16]}... does not match the manifest's {entry.sha256[:16]}...; "
                                "the file is corrupt or was modified; re-run orin-omni quantize --force for its segment")


def verify_files(out_dir: str | os.PathLike, manifest: Manifest, segments: tuple[str, ...] | list[str] | None = None,
                 check_hash: bool = True) -> None:
    """Check the shared files and the given finished segments' files (all finished ones when None)."""
    names = manifest.finished if segments is None else tuple(segments)
    for entry in manifest.shared_files:
        verify_file(out_dir, entry, check_hash)
    for name in names:
        for entry in manifest.segment(name).files:
            verify_file(out_dir, entry, check_hash)


# ---------------------------------------------------------------------- writing (used by quantize)


def file_entry(out_dir: str | os.PathLike, rel_path: str) -> FileEntry:
    path = Path(out_dir) / rel_path
    return FileEntry(path=Path(rel_path).as_posix(), bytes=path.stat().st_size, sha256=sha256_file(path))


def write_manifest(out_dir: str | os.PathLike, manifest: Manifest) -> None:
    atomic_write_json(manifest_path(out_dir), manifest.to_json())


def write_segment_entry(out_dir: str | os.PathLike, entry: SegmentEntry) -> Manifest:
    """Mark a segment finished: re-read the manifest, add (or replace) the entry, rewrite it atomically."""
    current = read_manifest(out_dir)
    if entry.name not in current.split:
        raise ModelError(f"segment {entry.name!r} is not in this checkpoint's split ({', '.join(current.split)})")
    segments = dict(current.segments)
    segments[entry.name] = entry
    updated = replace(current, segments=segments)
    write_manifest(out_dir, updated)
    return updated


def remove_segment_entry(out_dir: str | os.PathLike, name: str) -> Manifest:
    """Mark a segment unfinished (before redoing it), atomically."""
    current = read_manifest(out_dir)
    updated = replace(current, segments={k: v for k, v in current.segments.items() if k != name})
    write_manifest(out_dir, updated)
    return updated


__all__ = [
    "MANIFEST_NAME",
    "SCHEMA_VERSION",
    "FileEntry",
    "Manifest",
    "SegmentEntry",
    "check_served_name",
    "default_served_name",
    "file_entry",
    "read_manifest",
    "remove_segment_entry",
    "utc_now",
    "verify_file",
    "verify_files",
    "write_manifest",
    "write_segment_entry",
]
