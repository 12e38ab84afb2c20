"""Atomic writes: nothing already written is lost or half-written when a run is killed."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def current_umask() -> int:
    """The process umask, read without changing it where the kernel reports it (os.umask can only set it, and
    setting it briefly would race with other threads creating files)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _published_mode(path: Path, umask: int) -> int | None:
    """The mode a plain open()/mkdir() would have given `path` under `umask` (executables keep their x bits);
    None for a symlink, whose own mode means nothing on Linux."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return None
    full = 0o777 if stat.S_ISDIR(st.st_mode) or st.st_mode & 0o111 else 0o666
    return full & ~umask


@contextmanager
def atomic_path(path: str | os.PathLike, mode: int | None = None) -> Iterator[Path]:
    """Yield a temporary path beside `path`; rename it into place only if the block succeeds. The result gets
    `mode`, or else what a plain open() would give under the umask (0644 under umask 022)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        # After the block, not before: mkstemp creates 0600, and writers such as safetensors' save_file replace
        # the file with a new 0600 one whatever the umask, which leaves the service user unable to read it.
        os.chmod(tmp_path, mode if mode is not None else _published_mode(tmp_path, current_umask()))
        with open(tmp_path, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp_path, target)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


@contextmanager
def atomic_dir(path: str | os.PathLike, tag: str = "tmp") -> Iterator[Path]:
    """Yield an empty directory beside `path` to fill; when the block succeeds its files are synced and it
    replaces `path` by a rename, so readers see the old directory or the whole new one, never half of it.
    Everything in it gets the modes a plain open()/mkdir() would give under the umask (0644 files and 0755
    directories under umask 022), whatever the writers inside used: safetensors' save_file makes 0600 files."""
    target = Path(path)
    tmp = target.parent / f".{target.name}.{tag}"
    if tmp.exists():
        shutil.rmtree(tmp)  # left by a killed run
    tmp.mkdir(parents=True)
    try:
        yield tmp
        publish_dir(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def publish_dir(tmp: Path, target: Path) -> None:
    """Give `tmp`'s entries the modes the umask gives, sync its files, then rename it to `target` (replacing
    what was there): atomic_dir's last step, for a directory filled elsewhere."""
    umask = current_umask()
    for entry in (tmp, *tmp.rglob("*")):
        mode = _published_mode(entry, umask)
        if mode is None:
            continue
        os.chmod(entry, mode)
        if entry.is_file():
            with open(entry, "rb") as fh:
                os.fsync(fh.fileno())
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20, start: int = 0) -> str:
    """The sha256 of the file's bytes from `start` on."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        fh.seek(start)
        for block in iter(lambda: fh.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()
