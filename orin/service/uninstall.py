"""Taking the service off disk: remove exactly what install-service recorded (orin.service.record), planned
first so that --dry-run prints what a real run does."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ServiceError, UsageError
from .host import is_root_fs, quiet, run_command, systemd_running
from .record import digest, read_record, record_path, trusted_entries
from .unit import NAME_PATTERN, UNIT_DIR, under_root


@dataclass(frozen=True)
class UninstallConfig:
    """What `orin-omni uninstall-service` was asked to do."""

    name: str = "qwen3-omni"
    root: str = "/"
    dry_run: bool = False


@dataclass(frozen=True)
class UninstallPlan:
    root: str
    name: str
    files: tuple[str, ...]
    dirs: tuple[str, ...]
    commands_before: tuple[tuple[str, ...], ...]
    commands_after: tuple[tuple[str, ...], ...]
    notes: tuple[str, ...] = ()


def plan_uninstall(cfg: UninstallConfig, *, systemd_up: bool) -> UninstallPlan:
    if not NAME_PATTERN.match(cfg.name):
        raise UsageError(f"invalid service name {cfg.name!r}: use letters, digits, '.', '_' or '-'")
    record = read_record(cfg.root, cfg.name)
    if record is None:
        raise ServiceError(
            f"no install record {under_root(cfg.root, record_path(cfg.name))}: {cfg.name} was not installed by "
            "install-service under this --root (check --name and --root)"
        )
    entries, dirs = trusted_entries(record, cfg.root, cfg.name)
    files, notes = [], []
    for entry in entries:
        path = entry["path"]
        on_disk = under_root(cfg.root, path)
        if not on_disk.exists() and not on_disk.is_symlink():
            notes.append(f"already gone: {on_disk}")
            continue
        try:
            modified = digest(on_disk.read_bytes()) != entry.get("sha256")
        except OSError:
            modified = True
        if modified:
            notes.append(f"{on_disk} changed since it was installed; removing it anyway")
        files.append(path)
    files.append(record_path(cfg.name))
    if record.get("user_created"):
        notes.append(
            f"kept user {record['user_created']} (created by install-service): `userdel {record['user_created']}` removes it"
        )
    at_root = is_root_fs(cfg.root)
    live = at_root and systemd_up
    if not live:
        why = f"--root is {cfg.root}, not /" if not at_root else "systemd is not running here"
        notes.append(f"skipped systemctl disable/daemon-reload: {why}")
    # systemctl cannot disable a unit whose file is already gone; there is nothing left to stop then either.
    unit_present = f"{UNIT_DIR}/{cfg.name}.service" in files
    return UninstallPlan(
        root=cfg.root,
        name=cfg.name,
        files=tuple(files),
        dirs=tuple(dirs),
        commands_before=((("systemctl", "disable", "--now", f"{cfg.name}.service"),) if live and unit_present else ()),
        commands_after=((("systemctl", "daemon-reload"),) if live else ()),
        notes=tuple(notes),
    )


def apply_uninstall(plan: UninstallPlan, *, dry_run: bool, log: Callable[[str], None] = quiet) -> None:
    would = "would " if dry_run else ""
    for note in plan.notes:
        log(note)
    for argv in plan.commands_before:
        log(f"{would}run {' '.join(argv)}")
        if not dry_run:
            run_command(argv)
    for path in plan.files:
        on_disk = under_root(plan.root, path)
        log(f"{would}remove {on_disk}")
        if not dry_run:
            on_disk.unlink()
    # Only directories install-service created, and only those left empty once its files are gone (deepest
    # first, so a created parent empties as its created children go).
    gone = {under_root(plan.root, p) for p in plan.files}
    for directory in plan.dirs:
        on_disk = under_root(plan.root, directory)
        if on_disk.is_dir() and all(child in gone for child in on_disk.iterdir()):
            log(f"{would}remove directory {on_disk}")
            gone.add(on_disk)
            if not dry_run:
                on_disk.rmdir()
    for argv in plan.commands_after:
        log(f"{would}run {' '.join(argv)}")
        if not dry_run:
            run_command(argv)


def uninstall_service(cfg: UninstallConfig, log: Callable[[str], None] = quiet) -> UninstallPlan:
    """Remove exactly the files (and now-empty directories) that install-service recorded for `cfg.name`."""
    if is_root_fs(cfg.root) and not cfg.dry_run and os.geteuid() != 0:
        raise ServiceError(
            "removing a service from / needs root: run it with sudo, or --dry-run to see what it would do"
        )
    plan = plan_uninstall(cfg, systemd_up=systemd_running())
    apply_uninstall(plan, dry_run=cfg.dry_run, log=log)
    return plan


__all__ = ["UninstallConfig", "UninstallPlan", "apply_uninstall", "plan_uninstall", "uninstall_service"]
