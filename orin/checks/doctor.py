"""`orin-omni doctor`: the first command on a new board. One pass/warn/fail/skip line per check (the checks live in
orin.checks.doctor_checks, the memory probes in orin.checks.doctor_memory), each failure and warning with its fix;
`ok` is false when any check failed (a warning or a skip is no failure).

It reads what install-service left behind (the unit, its environment file and install record under `root`), so
on an installed board `orin-omni doctor` alone checks the model directory, user and budget the service uses.
Roots (/sys, /proc, the unit directory's /) are parameters, and the CUDA driver the memory probes ask comes from an
opener, so the tests run every check on tmp trees and stand-in drivers.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..device.allocator_conf import AllocatorConf, process_allocator_conf
from ..device.profile import CPU, ORIN, DeviceProfile
from ..errors import OrinError, UsageError
from ..power.backends import JTOP_SOCKET
from ..service.unit import (
    CONFIG_DIR,
    DEFAULT_BUDGET,
    NAME_PATTERN,
    UNIT_DIR,
    detect_platform,
    find_tool,
    size_text,
    under_root,
)
from .cuda_driver import CudaDriver, open_driver
from .doctor_checks import (
    FAIL,
    PASS,
    SKIP,
    WARN,
    Check,
    Runner,
    check_access,
    check_checksums,
    check_cuda,
    check_cuda_graph,
    check_disk,
    check_int4_kernel,
    check_memory,
    check_model_dir,
    check_nvpmodel,
    check_power_backends,
    check_python,
    check_torch,
    check_triton,
    read_meminfo,
)
from .doctor_memory import check_allocator_conf, check_l4t_release, driver_checks, environment_fix, service_env_fix

__all__ = ["FAIL", "PASS", "SKIP", "WARN", "Check", "DoctorConfig", "DoctorResult", "render_table", "run_doctor"]

DEFAULT_NAME = "qwen3-omni"
DEFAULT_USER = "orin-omni"
DEVICES = ("auto", "cuda", "cpu")


@dataclass(frozen=True)
class DoctorConfig:
    """What `orin-omni doctor` checks. None means: what the installed unit uses, else the install defaults."""

    model_dir: str | None = None
    user: str | None = None
    budget: int | None = None
    name: str = DEFAULT_NAME
    device: str = "auto"
    root: str = "/"
    sysfs_root: str = "/sys"
    proc_root: str = "/proc"
    jtop_socket: str = JTOP_SOCKET
    # The allocator configuration of the shell doctor runs in; None: this process's environment's, read at the one
    # place orin-omni reads it (orin.device.allocator_conf.process_allocator_conf).
    allocator: AllocatorConf | None = None

    def __post_init__(self):
        if self.device not in DEVICES:
            raise UsageError(f"--device {self.device!r}: use one of {', '.join(DEVICES)}")
        if not NAME_PATTERN.match(self.name):
            raise UsageError(f"invalid service name {self.name!r}: use letters, digits, '.', '_' or '-'")


@dataclass(frozen=True)
class DoctorResult:
    checks: tuple[Check, ...]
    model_dir: str | None = None
    user: str = DEFAULT_USER
    budget: int = DEFAULT_BUDGET
    notes: tuple[str, ...] = field(default_factory=tuple)
    profile: DeviceProfile | None = None  # the device profile the engine would use here (orin.device.profile)

    @property
    def ok(self) -> bool:
        return all(c.status != FAIL for c in self.checks)

    def check(self, name: str) -> Check:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(f"no check named {name!r}")

    def to_json(self) -> dict:
        return {"ok": self.ok, "model_dir": self.model_dir, "user": self.user, "budget_bytes": self.budget,
                "checks": [asdict(c) for c in self.checks],  # every check with its `fix`, empty or not
                "device_profile": self.profile.as_dict() if self.profile else None}


# ------------------------------------------------------------------ what install-service left behind


@dataclass(frozen=True)
class Installed:
    unit: Path
    unit_text: str | None
    env: dict[str, str]
    record: dict | None

    def unit_value(self, key: str) -> str | None:
        for line in (self.unit_text or "").splitlines():
            if line.startswith(f"{key}="):
                return line.partition("=")[2].strip()
        return None


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def read_installed(root: str, name: str) -> Installed:
    from ..service.record import record_path

    env = {}
    for line in (_read_text(under_root(root, f"{CONFIG_DIR}/{name}.env")) or "").splitlines():
        key, sep, value = line.partition("=")
        if sep and not key.startswith("#"):
            value = value.strip()
            env[key.strip()] = value[1:-1] if len(value) >= 2 and value[0] == value[-1] == '"' else value
    record_text = _read_text(under_root(root, record_path(name)))
    try:
        record = json.loads(record_text) if record_text else None
    except ValueError:
        record = None
    unit = under_root(root, f"{UNIT_DIR}/{name}.service")
    return Installed(unit=unit, unit_text=_read_text(unit), env=env, record=record if isinstance(record, dict) else None)


def _assignments(line_value: str) -> dict[str, str]:
    """The VAR=value pairs of one Environment= line (quoted as systemd quotes them; shell rules are close enough)."""
    try:
        words = shlex.split(line_value)
    except ValueError:
        return {}
    return dict(w.split("=", 1) for w in words if "=" in w)


def service_environment(installed: Installed, root: str, name: str) -> dict[str, str]:
    """What the service's process is given: the unit's Environment= lines, its drop-ins' (in name order), then
    the EnvironmentFile= (whose settings override Environment=, as in systemd)."""
    env: dict[str, str] = {}
    texts = [installed.unit_text or ""]
    drop_ins = under_root(root, f"{UNIT_DIR}/{name}.service.d")
    texts += [_read_text(p) or "" for p in sorted(drop_ins.glob("*.conf"))] if drop_ins.is_dir() else []
    for text in texts:
        for line in text.splitlines():
            if line.startswith("Environment="):
                env.update(_assignments(line.partition("=")[2]))
    env.update(installed.env)
    return env


def allocator_sources(cfg: DoctorConfig, installed: Installed) -> list[tuple[str, AllocatorConf, str]]:
    """Where the allocator's configuration comes from: this shell (what a command run by hand gets), and the
    installed service's environment; each with how to fix it there."""
    shell = cfg.allocator if cfg.allocator is not None else process_allocator_conf()
    sources = [("this shell", shell, environment_fix(shell))]
    if installed.unit_text is not None:
        service = AllocatorConf.from_environ(service_environment(installed, cfg.root, cfg.name))
        env_file = f"{CONFIG_DIR}/{cfg.name}.env"
        sources.append((f"the {cfg.name} service", service,
                        service_env_fix((s.variable for s in service.expandable), env_file, cfg.name)))
    return sources


def _interpreter(installed: Installed) -> str:
    """The program the unit starts (ExecStart's first word, unescaped), else this interpreter."""
    exec_start = installed.unit_value("ExecStart")
    if exec_start:
        try:
            return shlex.split(exec_start)[0].replace("%%", "%").replace("$$", "$")
        except (ValueError, IndexError):
            pass
    return sys.executable


def _is_root_fs(root: str) -> bool:
    return Path(root).resolve() == Path("/")


def systemd_is_pid1(proc_root: str) -> bool:
    return (_read_text(Path(proc_root) / "1" / "comm") or "").strip() == "systemd"


def l4t_release(root: str) -> str | None:
    """'R36' from /etc/nv_tegra_release ('# R36 (release), REVISION: 4.3, ...'); None when not a Jetson."""
    match = re.search(r"\bR(\d+)\b", _read_text(under_root(root, "/etc/nv_tegra_release")) or "")
    return f"R{match.group(1)}" if match else None


# ------------------------------------------------------------------ the service


def orin_omni_program() -> str:
    """The orin-omni to name in a command run with sudo: the console script beside this interpreter (sudo's
    secure_path leaves a venv's bin out), else the bare name."""
    beside = Path(sys.executable).parent / "orin-omni"
    return str(beside) if beside.is_file() else "orin-omni"


def install_command(cfg: DoctorConfig, model_dir: str | None, user: str) -> str:
    """The install-service command for what doctor checked: sudo and the full program path at /, the staging
    --root elsewhere (no privileges needed there)."""
    at_root = _is_root_fs(cfg.root)
    argv = ["sudo", orin_omni_program()] if at_root else ["orin-omni"]
    argv += ["install-service", "--model-dir", model_dir or "DIR"]
    if cfg.name != DEFAULT_NAME:
        argv += ["--name", cfg.name]
    if user != DEFAULT_USER:
        argv += ["--user", user]
    if cfg.budget is not None:
        argv += ["--budget", size_text(cfg.budget)]
    if not at_root:
        argv += ["--root", cfg.root]
    return shlex.join(argv)


def _systemctl(run: Runner, verb: str, unit: str) -> str:
    try:
        proc = run(["systemctl", verb, unit], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run systemctl: {exc}"
    return (proc.stdout.strip() or proc.stderr.strip() or f"exit {proc.returncode}").splitlines()[0]


def _unit_origin(installed: Installed, unit_text: str) -> str:
    entries = (installed.record or {}).get("files") or []
    wanted = next((e for e in entries if isinstance(e, dict) and e.get("path", "").endswith(".service")), None)
    if wanted is None:
        return "not written by install-service (no install record)"
    if hashlib.sha256(unit_text.encode("utf-8")).hexdigest() != wanted.get("sha256"):
        return "edited since install-service wrote it"
    return "as install-service wrote it"


def check_unit(cfg: DoctorConfig, installed: Installed, model_dir: str | None, user: str,
               run: Runner = subprocess.run) -> list[Check]:
    """Installed, enabled and active: systemctl is asked only on the live system with systemd as PID 1;
    elsewhere the files say whether it is enabled, and whether it is active cannot be known."""
    unit_name = f"{cfg.name}.service"
    if installed.unit_text is None:  # nothing to check yet: not a failure of a setup that has not installed one
        command = install_command(cfg, model_dir, user)
        why = f"no unit installed yet ({installed.unit}): run `{command}`"
        return [Check("service unit", SKIP, why, command),
                Check("service enabled", SKIP, "no unit installed yet"),
                Check("service active", SKIP, "no unit installed yet")]
    serves = installed.env.get("ORIN_OMNI_MODEL_DIR")
    detail = f"{installed.unit}, {_unit_origin(installed, installed.unit_text)}"
    if serves:
        detail += f"; serves {serves}" + (f", not {model_dir}" if model_dir and serves != model_dir else "")
    checks = [Check("service unit", PASS, detail)]
    live = _is_root_fs(cfg.root) and systemd_is_pid1(cfg.proc_root)
    if live:
        state = _systemctl(run, "is-enabled", unit_name)
        checks.append(Check("service enabled", PASS, state) if state in ("enabled", "enabled-runtime") else
                      Check("service enabled", FAIL, f"systemctl is-enabled: {state}",
                            f"sudo systemctl enable {unit_name}"))
        state = _systemctl(run, "is-active", unit_name)
        if state == "active":
            checks.append(Check("service active", PASS, state))
        elif state in ("activating", "reloading"):
            checks.append(Check("service active", SKIP, f"{state}: the warm-up request runs before it reports "
                                "ready; run doctor again in a minute"))
        else:
            checks.append(Check("service active", FAIL, f"systemctl is-active: {state}",
                                f"sudo systemctl start {unit_name}; journalctl -u {cfg.name} -e shows why it stopped"))
        return checks
    why = f"--root is {cfg.root}, not /" if not _is_root_fs(cfg.root) else "systemd is not PID 1 here"
    wants = under_root(cfg.root, f"{UNIT_DIR}/multi-user.target.wants/{unit_name}")
    if wants.exists() or wants.is_symlink():
        checks.append(Check("service enabled", PASS, f"{wants} exists"))
    else:  # install-service enables only where systemd runs: a staged unit is not enabled, and not broken
        checks.append(Check("service enabled", SKIP, f"{wants} missing: {why}, so install-service did not enable "
                            f"it; on the board it runs `systemctl enable {unit_name}` itself"))
    checks.append(Check("service active", SKIP, f"{why}: cannot ask systemctl"))
    return checks


# ------------------------------------------------------------------ run


def _import_torch():
    try:
        import torch
    except ImportError as exc:
        return None, str(exc)
    return torch, None


def _profile(torch, cuda_ok: bool, jetson: bool, allocator: AllocatorConf) -> DeviceProfile:
    """The profile the engine would run with: probed where CUDA works, else the board's kind assumed (an Orin
    whose CUDA is broken is still planned as an Orin) or the CPU's."""
    from ..device.capabilities import detect

    if torch is not None and cuda_ok:
        try:
            return detect(torch.device("cuda"), allocator=allocator)
        except UsageError:  # an allocator setting the engine refuses here: the allocator check reports it
            return ORIN
    return ORIN if jetson else CPU


def _plan(model_dir: str, manifest, budget: int, profile: DeviceProfile):
    """The planner's verdict for the standard request on this checkpoint (its own group size and split)."""
    from ..memory.plan import PlanConfig, make_plan

    spec = manifest.quant_spec()
    segments = ";".join(f"{name}={'+'.join(comps)}" for name, comps in manifest.segment_split().items())
    return make_plan(PlanConfig(
        model=model_dir, budget=budget, group_size=spec.group_size, segments=segments,
        quantize_audio_encoder=spec.quantize_audio_encoder, quantize_code_predictor=spec.quantize_code_predictor,
        quantize_code2wav=spec.quantize_code2wav, quantize_vision=spec.quantize_vision, device_profile=profile.name,
    ))


def _budget(cfg: DoctorConfig, installed: Installed) -> tuple[int, str | None]:
    if cfg.budget is not None:
        return cfg.budget, None
    text = installed.env.get("ORIN_OMNI_BUDGET")
    if text:
        from ..units import parse_bytes

        try:
            return parse_bytes(text), None
        except UsageError:
            return DEFAULT_BUDGET, f"ignored ORIN_OMNI_BUDGET={text!r} in the unit's environment file"
    return DEFAULT_BUDGET, None


def _model_checks(cfg: DoctorConfig, model_dir: str | None, source: str, user: str, budget: int, torch,
                  interpreter: str, profile: DeviceProfile) -> tuple[list[Check], object]:
    """The model's checks, and the plan of the standard request (None where there is none)."""
    model_check, manifest = check_model_dir(model_dir, source)
    checks = [model_check]
    meminfo = read_meminfo(cfg.proc_root)
    plan = None
    if manifest is None:
        checks.append(check_memory(meminfo, None, budget, None, None))
        why = "no usable model directory (see model dir)"
        return checks + [Check(name, SKIP, why) for name in ("checksums", "disk", "model access")], None
    checks.append(check_checksums(model_dir, manifest))
    if torch is None:
        checks.append(Check("memory", SKIP, "the planner needs torch (see torch)"))
    else:
        try:
            plan, plan_error = _plan(model_dir, manifest, budget, profile), None
        except OrinError as exc:
            plan, plan_error = None, str(exc)
        checks.append(check_memory(meminfo, plan, budget, plan_error, model_dir, profile.name))
    checks.append(check_disk(model_dir))
    checks.append(check_access(model_dir, user, interpreter))
    return checks, plan


def _largest_allocation(plan) -> tuple[int, str] | None:
    """(bytes, what) of the largest single allocation the plan's request makes (orin.memory.plan's verdict), or
    None without a plan."""
    largest = plan.verdict.largest if plan is not None else None
    return (largest.bytes, largest.what) if largest is not None else None


def run_doctor(cfg: DoctorConfig, *, run: Runner = subprocess.run,
               cuda_driver: Callable[[], CudaDriver] = open_driver) -> DoctorResult:
    """Run every check; never raises for what it finds (only for a bad configuration). `cuda_driver` opens the
    driver the memory probes ask (orin.checks.cuda_driver; tests pass a stand-in)."""
    installed = read_installed(cfg.root, cfg.name)
    if cfg.model_dir is not None:
        model_dir, source = str(Path(cfg.model_dir).expanduser()), "--model-dir"
    else:
        model_dir, source = installed.env.get("ORIN_OMNI_MODEL_DIR"), f"from {cfg.name}.env"
    user = cfg.user or installed.unit_value("User") or DEFAULT_USER
    budget, budget_note = _budget(cfg, installed)
    release = l4t_release(cfg.root)
    jetson = detect_platform(cfg.root) == "jetson"

    checks = [check_python()]
    torch, torch_error = _import_torch()
    checks.append(check_torch(torch, torch_error, release))
    cuda, cuda_ok = check_cuda(torch, cfg.device, release)
    checks.append(cuda)
    cuda_why = "no usable CUDA device (see cuda)" if cfg.device != "cpu" else "--device cpu"
    if torch is None:
        checks.append(Check("int4 kernel", SKIP, "torch is not installed"))
    elif cuda_ok or cfg.device != "cuda":
        checks.append(check_int4_kernel(torch, "cuda" if cuda_ok else "cpu"))
    else:
        checks.append(Check("int4 kernel", SKIP, "--device cuda, but CUDA is unusable (see cuda)"))
    checks.append(check_triton(torch, cuda_ok, cuda_why, cfg.name))
    checks.append(check_cuda_graph(torch, cuda_ok, cuda_why))

    nvpmodel = find_tool("nvpmodel", cfg.root)
    checks.append(check_nvpmodel(str(under_root(cfg.root, nvpmodel)) if nvpmodel else None, jetson, run))
    checks += check_power_backends(cfg.sysfs_root, cfg.jtop_socket, jetson)

    sources = allocator_sources(cfg, installed)
    profile = _profile(torch, cuda_ok, jetson, sources[0][1])
    model_checks, plan = _model_checks(cfg, model_dir, source, user, budget, torch, _interpreter(installed), profile)
    checks += model_checks
    checks.append(check_allocator_conf(sources, jetson or profile.capabilities.unified_memory))
    checks.append(check_l4t_release(under_root(cfg.root, "/etc/nv_tegra_release"),
                                    profile.memory.max_allocation_bytes))
    checks += driver_checks(cuda_driver, cfg.device, profile.memory, budget, _largest_allocation(plan), model_dir)
    checks += check_unit(cfg, installed, model_dir, user, run)
    return DoctorResult(checks=tuple(checks), model_dir=model_dir, user=user, budget=budget,
                        notes=(budget_note,) if budget_note else (), profile=profile)


def render_table(result: DoctorResult) -> str:
    rows = [("check", "result", "detail")] + [(c.name, c.status.upper(), c.detail) for c in result.checks]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = ["orin-omni doctor" + (f": {result.model_dir}" if result.model_dir else "")]
    for check, (a, b, c) in zip((None, *result.checks), rows, strict=True):
        lines.append(f"{a:<{w0}}  {b:<{w1}}  {c}")
        if check is not None and check.status in (FAIL, WARN) and check.fix:
            lines += [f"{'':<{w0}}  {'':<{w1}}  fix: {fix}" for fix in check.fix.splitlines()]
    lines += [f"note: {note}" for note in result.notes]
    if result.profile is not None:
        lines += result.profile.render().splitlines()
    count = {status: sum(c.status == status for c in result.checks) for status in (PASS, WARN, FAIL, SKIP)}
    warned = f", {count[WARN]} warned" if count[WARN] else ""
    lines.append(f"{'OK' if result.ok else 'FAILED'}: {count[PASS]} passed{warned}, {count[FAIL]} failed, "
                 f"{count[SKIP]} skipped")
    return "\n".join(lines)
