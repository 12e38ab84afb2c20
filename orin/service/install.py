"""Putting the service on disk: plan every change first (so --dry-run prints exactly what a real run does and
a refusal writes nothing), then apply it. A record of what was written (orin.service.record) lets
uninstall-service (orin.service.uninstall) remove exactly that."""

from __future__ import annotations

import difflib
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError, ModelError, ServiceError
from .access import (
    NEW_SYSTEM_USER,
    AccessProblem,
    access_fix_commands,
    access_problems,
    fix_access,
    identity_of,
)
from .host import is_root_fs, quiet, run_command, systemd_running, user_exists, useradd_argv, write_file
from .record import read_record, record_path, record_text
from .unit import (
    DEFAULT_BUDGET,
    JETSON_CLOCKS,
    JETSON_GROUPS,
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


def choose_platform(cfg: InstallConfig, notes: list[str]) -> str:
    """--platform, else what --root shows. A staging root (an image being prepared on a workstation) often has no
    L4T files to detect from; there --power-mode/--jetson-clocks say the target is a Jetson, so render for one
    and say why. On the running system the detection stands: a wrong one is refused by validate_unit."""
    if cfg.platform != "auto":
        return cfg.platform
    detected = detect_platform(cfg.root)
    asked = (("--power-mode", cfg.power_mode), ("--jetson-clocks", cfg.jetson_clocks))
    jetson_only = [option for option, given in asked if given]
    if detected == "jetson" or not jetson_only or is_root_fs(cfg.root):
        return detected
    notes.append(
        f"note: rendering for a Jetson because of {' and '.join(jetson_only)}: {cfg.root} has no "
        "/etc/nv_tegra_release or /dev/nvmap to detect the platform from (pass --platform jetson to say so)"
    )
    return "jetson"


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
    platform = choose_platform(cfg, notes)
    at_root = is_root_fs(cfg.root)
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
    new_user = not user_exists(unit.user)
    who = NEW_SYSTEM_USER if new_user else identity_of(unit.user)
    problems = tuple(access_problems(unit.model_dir, who, sys.executable))
    return AccessCheck(
        user=unit.user,
        problems=problems,
        fixes=tuple(access_fix_commands(unit.model_dir, unit.user, problems)),
        new_user=new_user,
        enforced=is_root_fs(cfg.root) or not new_user,
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


def _file_status(root: str, target: str, content: str) -> str:
    path = under_root(root, target)
    if not path.exists() and not path.is_symlink():
        return "new"
    try:
        same = path.read_bytes() == content.encode("utf-8")
    except OSError:
        same = False
    return "unchanged" if same else "replace"


def _changed_lines(root: str, action: FileAction, limit: int = 6) -> list[str]:
    """The lines that differ between the file on disk and the one rendered, as -old/+new."""
    try:
        old = under_root(root, action.path).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    new = action.content.splitlines()
    # [2:] drops the ---/+++ file header; what is left is @@ hunk headers and the -/+ lines.
    diff = [line for line in list(difflib.unified_diff(old, new, lineterm="", n=0))[2:] if line[:1] in "-+"]
    return diff[:limit] + ([f"  ... {len(diff) - limit} more"] if len(diff) > limit else [])


def _overwrite_refusal(root: str, unit: UnitConfig, conflicts: list[FileAction]) -> str:
    """Why a rerun stops, and what --force would and would not touch, so rerunning with it is an informed choice."""
    paths = [str(under_root(root, f.path)) for f in conflicts]
    changes = [f"  {line}" for f in conflicts for line in _changed_lines(root, f)]
    return "\n".join([
        f"refusing to overwrite {', '.join(paths)}: {'it differs' if len(paths) == 1 else 'they differ'} from what "
        "install-service renders (edited by hand, or installed with other options):",
        *changes,
        f"--force rewrites only the files install-service records ({unit.unit_path} and {unit.env_path}, "
        "and its install record), keeping each replaced file as .bak;",
        f"it leaves the service user {unit.user}, /var/lib/{unit.name}, /var/cache/{unit.name}, drop-ins in "
        f"{unit.unit_path}.d/ and a running service as they are (systemctl restart {unit.name} applies the change).",
        "Rerun with --force, or with --dry-run --force to see the new files first.",
    ])


def plan_install(cfg: InstallConfig, unit: UnitConfig, *, systemd_up: bool, notes: tuple[str, ...] = ()) -> InstallPlan:
    """Decide every change without making one. Raises ServiceError on an existing file that differs unless
    `cfg.force`, and on paths a real install would hide from the service."""
    root = cfg.root
    at_root = is_root_fs(root)
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
    for target, content in ((unit.env_path, render_env(unit)), (unit.unit_path, render_unit(unit))):
        files.append(FileAction(target, content, 0o644, _file_status(root, target, content)))
    conflicts = [f for f in files if f.status == "replace"]
    if conflicts and not cfg.force:
        raise ServiceError(_overwrite_refusal(root, unit, conflicts))

    previous = read_record(root, unit.name) or {}
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
        if not user_exists(unit.user):
            useradd = useradd_argv(unit.user, unit.name, unit.groups)
            user_created = unit.user
    else:
        notes_out.append(
            f"skipped creating user {unit.user}: --root is {root}, not /; on the target run: {' '.join(useradd_argv(unit.user, unit.name, unit.groups))}"
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

    text = record_text(unit.name, ((f.path, f.content) for f in files), created_dirs, user_created)
    record_action = FileAction(record_path(unit.name), text, 0o644, _file_status(root, record_path(unit.name), text))
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


def apply_install(plan: InstallPlan, *, dry_run: bool, log: Callable[[str], None] = quiet) -> None:
    """Carry out (or on dry_run only print) the plan: user, files (with .bak for replaced ones), record, systemctl."""
    would = "would " if dry_run else ""
    for note in plan.notes:
        log(note)
    if plan.useradd:
        log(f"{would}create user {plan.unit.user}: {' '.join(plan.useradd)}")
        if not dry_run:
            run_command(plan.useradd)
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
            write_file(path, action.content, action.mode)
    for argv in plan.commands:
        log(f"{would}run {' '.join(argv)}")
        if not dry_run:
            run_command(argv)
    if dry_run:
        for action in plan.files:
            log(f"--- {under_root(plan.root, action.path)} ---")
            log(action.content.rstrip("\n"))
    elif not plan.changed:
        log(f"{plan.unit.name}: unchanged")
    elif is_root_fs(plan.root):
        log(f"start it with: systemctl restart {plan.unit.name}")


def install_service(cfg: InstallConfig, log: Callable[[str], None] = quiet) -> InstallPlan:
    """Render, plan and install (or print, on dry_run) the service described by `cfg`."""
    if is_root_fs(cfg.root) and not cfg.dry_run and os.geteuid() != 0:
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


__all__ = ["AccessCheck", "FileAction", "InstallConfig", "InstallPlan", "apply_install", "check_access",
           "choose_platform", "install_service", "plan_install", "resolve_unit"]
