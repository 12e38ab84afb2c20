"""Putting the service on disk: plan every change first (so --dry-run prints exactly what a real run does and
a refusal writes nothing), then apply it. A record of what was written lets uninstall remove exactly that."""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .access import (
    NEW_SYSTEM_USER,
    AccessProblem,
    access_fix_commands,
    access_problems,
    fix_access,
    identity_of,
)
from .errors import InputError, ModelError, ServiceError, UsageError
from .fsutil import atomic_path
from .service import (
    CONFIG_DIR,
    DEFAULT_BUDGET,
    JETSON_CLOCKS,
    JETSON_GROUPS,
    NAME_PATTERN,
    NVPMODEL,
    TMP_ROOTS,
    TOOL_DIRS,
    UNIT_DIR,
    UnitConfig,
    detect_platform,
    existing_groups,
    find_tool,
    gpu_devices,
    is_under,
    render_env,
    render_unit,
    resolve_exec_start,
    resolve_pythonpath,
    under_root,
    validate_unit,
)


@dataclass(frozen=True)
class InstallConfig:
    """What `orin-omni install-service` was asked to do."""

    model_dir: str
    name: str = "qwen3-omni"
    user: str = "orin-omni"
    host: str = "127.0.0.1"
    port: int = 8000
    budget: int = DEFAULT_BUDGET
    power_mode: str | None = None
    jetson_clocks: bool = False
    platform: str = "auto"
    cpu_quota: str = "600%"
    api_key_file: str | None = None
    max_queue: int | None = None
    served_model_name: str | None = None
    root: str = "/"
    dry_run: bool = False
    force: bool = False
    enable: bool = True
    fix_permissions: bool = False


@dataclass(frozen=True)
class UninstallConfig:
    """What `orin-omni uninstall-service` was asked to do."""

    name: str = "qwen3-omni"
    root: str = "/"
    dry_run: bool = False


@dataclass(frozen=True)
class FileAction:
    """One file to write: `path` is where it lives on the installed system, `status` new/unchanged/replace."""

    path: str
    content: str
    mode: int
    status: str


@dataclass(frozen=True)
class InstallPlan:
    root: str
    unit: UnitConfig
    files: tuple[FileAction, ...]
    record: FileAction
    created_dirs: tuple[str, ...]
    useradd: tuple[str, ...] | None
    commands: tuple[tuple[str, ...], ...]
    notes: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return any(f.status != "unchanged" for f in (*self.files, self.record))


@dataclass(frozen=True)
class UninstallPlan:
    root: str
    name: str
    files: tuple[str, ...]
    dirs: tuple[str, ...]
    commands_before: tuple[tuple[str, ...], ...]
    commands_after: tuple[tuple[str, ...], ...]
    notes: tuple[str, ...] = ()


def resolve_unit(cfg: InstallConfig) -> tuple[UnitConfig, tuple[str, ...]]:
    """Turn the command-line request into a UnitConfig by looking at the machine (or the staging root).
    Returns the config and notes worth printing."""
    notes: list[str] = []
    model = Path(cfg.model_dir).expanduser()
    if not model.is_dir():
        raise ModelError(
            f"model directory {cfg.model_dir} does not exist: pass --model-dir pointing at the quantized checkpoint"
        )
    if not (model / "config.json").is_file():
        raise ModelError(f"{cfg.model_dir} has no config.json: --model-dir must be a checkpoint directory")
    api_key_file = None
    if cfg.api_key_file:
        key = Path(cfg.api_key_file).expanduser()
        if not key.is_file():
            raise InputError(f"API key file {cfg.api_key_file} does not exist: create it or drop --api-key-file")
        api_key_file = str(key.resolve())
        if key.stat().st_mode & 0o004:
            notes.append(
                f"warning: {api_key_file} is readable by every user: chmod o-r it (the service user only needs group read)"
            )
    platform = detect_platform(cfg.root) if cfg.platform == "auto" else cfg.platform
    at_root = _is_root_fs(cfg.root)
    tools = {}
    for wanted, tool, default in (
        (cfg.power_mode, "nvpmodel", NVPMODEL),
        (cfg.jetson_clocks, "jetson_clocks", JETSON_CLOCKS),
    ):
        path = find_tool(tool, cfg.root)
        if path is None and wanted and platform == "jetson":
            if at_root:
                raise ServiceError(
                    f"{tool} not found in {':'.join(TOOL_DIRS)}: install L4T's nvidia-l4t-tools, or drop the option that needs it"
                )
            notes.append(f"{tool} not found under {cfg.root}; assuming L4T's {default}")
        tools[tool] = path or default
    exec_start = resolve_exec_start()
    pythonpath = resolve_pythonpath()
    runtime = [str(Path(exec_start[0]).parent), sys.prefix, sys.base_prefix, *([pythonpath] if pythonpath else [])]
    runtime_paths = tuple(dict.fromkeys(p for path in runtime for p in (path, os.path.realpath(path))))
    unit = UnitConfig(
        model_dir=str(model.resolve()),
        exec_start=exec_start,
        platform=platform,
        name=cfg.name,
        user=cfg.user,
        host=cfg.host,
        port=cfg.port,
        budget=cfg.budget,
        power_mode=cfg.power_mode,
        jetson_clocks=cfg.jetson_clocks,
        nvpmodel=tools["nvpmodel"],
        jetson_clocks_bin=tools["jetson_clocks"],
        cpu_quota=cfg.cpu_quota,
        api_key_file=api_key_file,
        max_queue=cfg.max_queue,
        served_model_name=cfg.served_model_name,
        groups=existing_groups(JETSON_GROUPS, cfg.root) if platform == "jetson" else (),
        devices=gpu_devices(platform, cfg.root),
        runtime_paths=runtime_paths,
        pythonpath=pythonpath,
    )
    validate_unit(unit)
    return unit, tuple(notes)


def _is_root_fs(root: str | os.PathLike) -> bool:
    return Path(root).resolve() == Path("/")


def systemd_running() -> bool:
    """The check sd_booted(3) does."""
    return Path("/run/systemd/system").is_dir()


# --- can the service user read the model? ---------------------------------------------------------------


@dataclass(frozen=True)
class AccessCheck:
    """What keeps the service user from reading the model or running the interpreter, and the fix."""

    user: str
    problems: tuple[AccessProblem, ...]
    fixes: tuple[str, ...]
    # The user does not exist here yet: checked as the system user useradd will create.
    new_user: bool
    # Refuse to install over problems: always at --root /; under another --root only for a user that exists
    # here, since a missing one is created on the target, not by this run.
    enforced: bool

    def message(self) -> str:
        who = f"user {self.user}"
        if self.new_user:
            who += " (to be created as a system user with its own group, so only the 'other' permission bits count)"
        return "\n".join([
            f"the service runs as {who}, which could not read the model or run the interpreter:",
            *(f"  {p.describe()}" for p in self.problems),
            "fix it (as root) with:",
            *(f"  {c}" for c in self.fixes),
            "or rerun with --fix-permissions",
        ])


def check_access(cfg: InstallConfig, unit: UnitConfig) -> AccessCheck:
    """Check the unit's user against the model directory (the real path: --root stages the unit files only) and
    the interpreter that runs orin-omni."""
    new_user = not _user_exists(unit.user)
    who = NEW_SYSTEM_USER if new_user else identity_of(unit.user)
    problems = tuple(access_problems(unit.model_dir, who, sys.executable))
    return AccessCheck(
        user=unit.user,
        problems=problems,
        fixes=tuple(access_fix_commands(unit.model_dir, unit.user, problems)),
        new_user=new_user,
        enforced=_is_root_fs(cfg.root) or not new_user,
    )


def _settle_access(check: AccessCheck, cfg: InstallConfig, unit: UnitConfig, log: Callable[[str], None]) -> None:
    """Apply the fixes (--fix-permissions), or warn about problems a staging root does not refuse."""
    if not check.problems:
        return
    if cfg.fix_permissions:
        would = "would " if cfg.dry_run else ""
        for problem in check.problems:
            log(f"{unit.user} cannot reach {problem.describe()}")
        for command in check.fixes:
            log(f"{would}fix permissions: {command}")
        if not cfg.dry_run:
            fix_access(unit.model_dir, unit.user, check.problems)
    elif not check.enforced:
        log(f"warning: on the target, {check.message()}")


# --- install ------------------------------------------------------------------------------------------------


def record_path(name: str) -> str:
    return f"{CONFIG_DIR}/{name}.installed.json"


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _read_record(root: str, name: str) -> dict | None:
    path = under_root(root, record_path(name))
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ServiceError(f"install record {path} is unreadable ({exc}): fix or delete it, then rerun") from exc


def _file_status(root: str, target: str, content: str) -> str:
    path = under_root(root, target)
    if not path.exists() and not path.is_symlink():
        return "new"
    try:
        same = path.read_bytes() == content.encode("utf-8")
    except OSError:
        same = False
    return "unchanged" if same else "replace"


def _useradd(user: str, name: str, groups: tuple[str, ...]) -> tuple[str, ...]:
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


def _user_exists(user: str) -> bool:
    try:
        pwd.getpwnam(user)
    except KeyError:
        return False
    return True


def plan_install(cfg: InstallConfig, unit: UnitConfig, *, systemd_up: bool, notes: tuple[str, ...] = ()) -> InstallPlan:
    """Decide every change without making one. Raises ServiceError on an existing file that differs unless
    `cfg.force`, and on paths a real install would hide from the service."""
    root = cfg.root
    at_root = _is_root_fs(root)
    notes_out = list(notes)
    hidden = [
        p
        for p in (unit.model_dir, unit.api_key_file, unit.exec_start[0], *unit.runtime_paths)
        if p and is_under(p, TMP_ROOTS)
    ]
    if hidden:
        message = (
            f"{hidden[0]} is under /tmp or /var/tmp, which the unit replaces with a private one (PrivateTmp=yes); "
            "move it, e.g. to /opt or /srv, and rerun"
        )
        if at_root:
            raise ServiceError(message)
        notes_out.append(f"warning: on a real install {message}")

    files = []
    conflicts = []
    for target, content in ((unit.env_path, render_env(unit)), (unit.unit_path, render_unit(unit))):
        status = _file_status(root, target, content)
        if status == "replace" and not cfg.force:
            conflicts.append(str(under_root(root, target)))
        files.append(FileAction(target, content, 0o644, status))
    if conflicts:
        raise ServiceError(
            f"refusing to overwrite {', '.join(conflicts)}: {'it differs' if len(conflicts) == 1 else 'they differ'} "
            "from what install-service renders "
            "(edited by hand, or installed with other options); pass --force to replace it (the old file is kept as .bak)"
        )

    previous = _read_record(root, unit.name) or {}
    created = []
    for target in (unit.env_path, unit.unit_path, record_path(unit.name)):
        parent = Path(target).parent
        while parent != Path("/") and not under_root(root, str(parent)).exists():
            created.append(str(parent))
            parent = parent.parent
    created_dirs = tuple(sorted(set(created) | set(previous.get("created_dirs", [])), key=lambda p: (-p.count("/"), p)))

    useradd = None
    user_created = previous.get("user_created")
    if at_root:
        if not _user_exists(unit.user):
            useradd = _useradd(unit.user, unit.name, unit.groups)
            user_created = unit.user
    else:
        notes_out.append(
            f"skipped creating user {unit.user}: --root is {root}, not /; on the target run: {' '.join(_useradd(unit.user, unit.name, unit.groups))}"
        )

    commands: list[tuple[str, ...]] = []
    if at_root and systemd_up:
        if any(f.status != "unchanged" for f in files):
            commands.append(("systemctl", "daemon-reload"))
        if cfg.enable:
            commands.append(("systemctl", "enable", f"{unit.name}.service"))
    elif at_root:
        notes_out.append("skipped systemctl daemon-reload/enable: systemd is not running here (no /run/systemd/system)")
    else:
        notes_out.append(f"skipped systemctl daemon-reload/enable: --root is {root}, not /")

    record = {
        "name": unit.name,
        "files": [{"path": f.path, "sha256": _sha256(f.content)} for f in files],
        "created_dirs": list(created_dirs),
        "user_created": user_created,
    }
    record_text = json.dumps(record, indent=2) + "\n"
    record_action = FileAction(
        record_path(unit.name), record_text, 0o644, _file_status(root, record_path(unit.name), record_text)
    )
    return InstallPlan(
        root=root,
        unit=unit,
        files=tuple(files),
        record=record_action,
        created_dirs=created_dirs,
        useradd=useradd,
        commands=tuple(commands),
        notes=tuple(notes_out),
    )


def _write(path: Path, content: str, mode: int) -> None:
    with atomic_path(path, mode=mode) as tmp:
        tmp.write_text(content, encoding="utf-8")


def _run(argv: tuple[str, ...]) -> None:
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True)
    except OSError as exc:
        raise ServiceError(f"cannot run {argv[0]}: {exc}") from exc
    if proc.returncode != 0:
        raise ServiceError(
            f"`{' '.join(argv)}` failed (exit {proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}"
        )


def _quiet(_line: str) -> None:
    pass


def apply_install(plan: InstallPlan, *, dry_run: bool, log: Callable[[str], None] = _quiet) -> None:
    """Carry out (or on dry_run only print) the plan: user, files (with .bak for replaced ones), record, systemctl."""
    would = "would " if dry_run else ""
    for note in plan.notes:
        log(note)
    if plan.useradd:
        log(f"{would}create user {plan.unit.user}: {' '.join(plan.useradd)}")
        if not dry_run:
            _run(plan.useradd)
    for action in (*plan.files, plan.record):
        path = under_root(plan.root, action.path)
        if action.status == "unchanged":
            log(f"unchanged {path}")
            continue
        if action.status == "replace" and action is not plan.record:
            log(f"{would}replace {path} (old one kept as {path}.bak)")
            if not dry_run:
                shutil.copy2(path, f"{path}.bak", follow_symlinks=False)
        else:
            log(f"{would}write {path}")
        if not dry_run:
            _write(path, action.content, action.mode)
    for argv in plan.commands:
        log(f"{would}run {' '.join(argv)}")
        if not dry_run:
            _run(argv)
    if dry_run:
        for action in plan.files:
            log(f"--- {under_root(plan.root, action.path)} ---")
            log(action.content.rstrip("\n"))
    elif not plan.changed:
        log(f"{plan.unit.name}: unchanged")
    elif _is_root_fs(plan.root):
        log(f"start it with: systemctl restart {plan.unit.name}")


def install_service(cfg: InstallConfig, log: Callable[[str], None] = _quiet) -> InstallPlan:
    """Render, plan and install (or print, on dry_run) the service described by `cfg`."""
    if _is_root_fs(cfg.root) and not cfg.dry_run and os.geteuid() != 0:
        raise ServiceError(
            f"installing into / writes {UNIT_DIR} and creates a system user: run it as root (sudo), "
            "or pass --root DIR to stage the files, or --dry-run to see what it would do"
        )
    unit, notes = resolve_unit(cfg)
    access = check_access(cfg, unit)
    refused = bool(access.problems) and access.enforced and not cfg.fix_permissions
    if refused and not cfg.dry_run:
        raise ServiceError(access.message())
    plan = plan_install(cfg, unit, systemd_up=systemd_running(), notes=notes)
    _settle_access(access, cfg, unit, log)
    apply_install(plan, dry_run=cfg.dry_run, log=log)
    if refused:
        # A dry run shows the whole plan, then fails the way the real run would.
        raise ServiceError(access.message())
    return plan


# --- uninstall ----------------------------------------------------------------------------------------------


def plan_uninstall(cfg: UninstallConfig, *, systemd_up: bool) -> UninstallPlan:
    if not NAME_PATTERN.match(cfg.name):
        raise UsageError(f"invalid service name {cfg.name!r}: use letters, digits, '.', '_' or '-'")
    record = _read_record(cfg.root, cfg.name)
    if record is None:
        raise ServiceError(
            f"no install record {under_root(cfg.root, record_path(cfg.name))}: {cfg.name} was not installed by "
            "install-service under this --root (check --name and --root)"
        )
    # A record is only trusted to name what install-service writes for this name: an edited record must not turn
    # uninstall into `rm` of arbitrary paths.
    ours = {f"{UNIT_DIR}/{cfg.name}.service", f"{CONFIG_DIR}/{cfg.name}.env"}
    ancestors = {str(parent) for path in (*ours, record_path(cfg.name)) for parent in Path(path).parents} - {"/"}
    entries = record.get("files", []) if isinstance(record, dict) else None
    dirs = record.get("created_dirs", []) if isinstance(record, dict) else None
    if (
        not isinstance(entries, list)
        or not isinstance(dirs, list)
        or not all(isinstance(e, dict) and e.get("path") in ours for e in entries)
        or not set(dirs) <= ancestors
    ):
        raise ServiceError(
            f"install record {under_root(cfg.root, record_path(cfg.name))} lists paths install-service never writes: "
            "it was edited; remove the service's files by hand"
        )
    files, notes = [], []
    for entry in entries:
        path = entry["path"]
        on_disk = under_root(cfg.root, path)
        if not on_disk.exists() and not on_disk.is_symlink():
            notes.append(f"already gone: {on_disk}")
            continue
        try:
            modified = hashlib.sha256(on_disk.read_bytes()).hexdigest() != entry.get("sha256")
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
    at_root = _is_root_fs(cfg.root)
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


def apply_uninstall(plan: UninstallPlan, *, dry_run: bool, log: Callable[[str], None] = _quiet) -> None:
    would = "would " if dry_run else ""
    for note in plan.notes:
        log(note)
    for argv in plan.commands_before:
        log(f"{would}run {' '.join(argv)}")
        if not dry_run:
            _run(argv)
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
            _run(argv)


def uninstall_service(cfg: UninstallConfig, log: Callable[[str], None] = _quiet) -> UninstallPlan:
    """Remove exactly the files (and now-empty directories) that install-service recorded for `cfg.name`."""
    if _is_root_fs(cfg.root) and not cfg.dry_run and os.geteuid() != 0:
        raise ServiceError(
            "removing a service from / needs root: run it with sudo, or --dry-run to see what it would do"
        )
    plan = plan_uninstall(cfg, systemd_up=systemd_running())
    apply_uninstall(plan, dry_run=cfg.dry_run, log=log)
    return plan
