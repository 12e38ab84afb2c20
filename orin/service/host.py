"""The machine install-service and uninstall-service change: whether --root is the running system, whether systemd
runs there, its users, and the commands and file writes that change it."""

from __future__ import annotations

import os
import pwd
import subprocess
from pathlib import Path

from ..errors import ServiceError
from ..fsutil import atomic_path


def is_root_fs(root: str | os.PathLike) -> bool:
    """Whether `root` is this system's / (else a staging root: files only, no users, no systemctl)."""
    return Path(root).resolve() == Path("/")


def systemd_running() -> bool:
    """The check sd_booted(3) does."""
    return Path("/run/systemd/system").is_dir()


def user_exists(user: str) -> bool:
    try:
        pwd.getpwnam(user)
    except KeyError:
        return False
    return True


def useradd_argv(user: str, name: str, groups: tuple[str, ...]) -> tuple[str, ...]:
    """The system user the service runs as: its own group, no home, no login shell, in the device `groups`."""
    argv = [
        "useradd",
        "--system",
        "--user-group",
        "--no-create-home",
        "--home-dir",
        f"/var/lib/{name}",
        "--shell",
        "/usr/sbin/nologin",
    ]
    if groups:
        argv += ["--groups", ",".join(groups)]
    return (*argv, user)


def run_command(argv: tuple[str, ...]) -> None:
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True)
    except OSError as exc:
        raise ServiceError(f"cannot run {argv[0]}: {exc}") from exc
    if proc.returncode != 0:
        raise ServiceError(
            f"`{' '.join(argv)}` failed (exit {proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}"
        )


def write_file(path: Path, content: str, mode: int) -> None:
    with atomic_path(path, mode=mode) as tmp:
        tmp.write_text(content, encoding="utf-8")


def quiet(_line: str) -> None:
    """The default log of install and uninstall: print nothing."""
