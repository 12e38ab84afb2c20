"""The systemd unit for `orin-omni serve`: what it holds (`UnitConfig`), how it is rendered from the Jinja
templates in systemd/ (`render_unit`, `render_env`, both pure), and the probes that fill a UnitConfig in from the
machine or from a staging root (platform, interpreter, device nodes, groups, tools). Putting the files on disk is
orin.service.install's job."""

from __future__ import annotations

import ipaddress
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.manifest import check_served_name
from ..errors import ServiceError, UsageError

MiB = 1 << 20
GiB = 1 << 30
DEFAULT_BUDGET = 24 * GiB

# nvpmodel mode IDs of the Jetson AGX Orin 64GB (L4T r35/r36 nvpmodel_p3701_0005.conf; NVIDIA Jetson Linux
# Developer Guide, "Supported Modes and Power Efficiency"). Other modules number their modes differently
# (the AGX Orin 32GB has no 50W mode): check `nvpmodel -q --verbose` before using this on another board.
POWER_MODES = {"MAXN": 0, "15W": 1, "30W": 2, "50W": 3}

UNIT_DIR = "/etc/systemd/system"
CONFIG_DIR = "/etc/orin-omni"
TOOL_DIRS = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")
# Where L4T puts them; used when staging under a --root that has no L4T to look in.
NVPMODEL = "/usr/sbin/nvpmodel"
JETSON_CLOCKS = "/usr/bin/jetson_clocks"

PLATFORMS = ("jetson", "discrete")
# video/render own the Tegra GPU nodes, jtop owns /run/jtop.sock; only groups that exist are used, because
# SupplementaryGroups= naming a missing group fails the start.
JETSON_GROUPS = ("video", "render", "jtop")
# DeviceAllow= takes globs only for /proc/devices group names: `char-nvidia*` covers nvidia (nvidia-frontend on
# older drivers: /dev/nvidia0, /dev/nvidiactl), nvidia-uvm and nvidia-caps. The nodes are 0666 by default, so no
# group is needed.
DISCRETE_DEVICES = ("char-nvidia*",)
# The Tegra nodes are registered under names that vary across L4T releases, so they are listed by path: the ones
# found under the root's /dev at install time, else this list (Orin, L4T r35/r36) for a staging root.
JETSON_DEVICE_GLOBS = ("nvmap", "nvhost-*", "nvgpu/*/*", "host1x-fence", "dri/renderD*")
JETSON_DEVICES = (
    "/dev/nvmap",
    "/dev/nvhost-ctrl",
    "/dev/nvhost-ctrl-gpu",
    "/dev/nvhost-gpu",
    "/dev/nvhost-as-gpu",
    "/dev/nvhost-tsg-gpu",
    "/dev/nvhost-sched-gpu",
    "/dev/nvhost-prof-gpu",
    "/dev/nvhost-dbg-gpu",
    "/dev/nvhost-ctxsw-gpu",
    "/dev/nvhost-power-gpu",
    "/dev/nvgpu/igpu0/as",
    "/dev/nvgpu/igpu0/channel",
    "/dev/nvgpu/igpu0/ctrl",
    "/dev/nvgpu/igpu0/tsg",
    "/dev/nvgpu/igpu0/sched",
    "/dev/nvgpu/igpu0/power",
    "/dev/host1x-fence",
    "/dev/dri/renderD128",
)
# ProtectHome= hides these; PrivateTmp= replaces these.
HOME_ROOTS = ("/home", "/root", "/run/user")
TMP_ROOTS = ("/tmp", "/var/tmp")

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_USER = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
_CPU_QUOTA = re.compile(r"^[1-9][0-9]*%$")
# Characters that no quoting keeps intact through both the unit and EnvironmentFile= parsers.
_BAD_PATH_CHARS = re.compile(r"[\x00-\x1f\x7f\"'\\$`]")
_PLAIN_ENV = re.compile(r"^[A-Za-z0-9_./:@+,=-]+$")


@dataclass(frozen=True)
class UnitConfig:
    """Everything the templates need, already resolved: rendering it touches nothing."""

    model_dir: str
    exec_start: tuple[str, ...]
    platform: str = "jetson"
    name: str = "qwen3-omni"
    user: str = "orin-omni"
    host: str = "127.0.0.1"
    port: int = 8000
    budget: int = DEFAULT_BUDGET
    power_mode: str | None = None
    jetson_clocks: bool = False
    nvpmodel: str = NVPMODEL
    jetson_clocks_bin: str = JETSON_CLOCKS
    cpu_quota: str = "600%"
    watchdog_sec: int = 60
    api_key_file: str | None = None
    max_queue: int | None = None
    # The `model` clients name in the OpenAI API; None leaves it to serve (the name in the checkpoint's manifest).
    served_model_name: str | None = None
    groups: tuple[str, ...] = ()
    # DeviceAllow= entries (rw); empty means the platform's default list.
    devices: tuple[str, ...] = ()
    # Directories the interpreter needs (prefixes, PYTHONPATH); bound read-only when a home directory holds them.
    runtime_paths: tuple[str, ...] = ()
    pythonpath: str | None = None

    @property
    def unit_path(self) -> str:
        return f"{UNIT_DIR}/{self.name}.service"

    @property
    def env_path(self) -> str:
        return f"{CONFIG_DIR}/{self.name}.env"


# --- rendering (pure) ---------------------------------------------------------------------------------------


def template_dir() -> Path:
    """systemd/ ships inside the wheel as orin/systemd_templates; a checkout has it beside orin/."""
    package = Path(__file__).resolve().parents[1]  # orin/
    for candidate in (package / "systemd_templates", package.parent / "systemd"):
        if (candidate / "orin-omni.service.j2").is_file():
            return candidate
    raise ServiceError(
        f"unit templates not found in {package / 'systemd_templates'} or {package.parent / 'systemd'}: "
        "reinstall orin-omni (the wheel ships them as orin/systemd_templates)"
    )


def memory_max(budget: int) -> int:
    """Budget plus headroom for what lives outside it: the CUDA context, Python and torch, a segment staged on the
    CPU side while the previous one is evicted. A quarter of the budget, at least 4 GiB."""
    return budget + max(4 * GiB, budget // 4)


def size_text(n: int) -> str:
    """Exact binary-unit text that parse_bytes reads back to the same integer (24GiB, 1536MiB, 1000)."""
    for unit, factor in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if n % factor == 0:
            return f"{n // factor}{unit}"
    return str(n)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r + "/") for r in roots)


def _check_path(what: str, path: str) -> None:
    if not path.startswith("/"):
        raise UsageError(f"{what} {path!r} must be an absolute path")
    bad = _BAD_PATH_CHARS.search(path)
    if bad:
        raise UsageError(
            f"{what} {path!r} contains {bad.group()!r}, which cannot be written safely into a systemd unit: "
            "rename the directory or point at it through a symlink without it"
        )


def validate_unit(cfg: UnitConfig) -> None:
    """Refuse values that would render a unit systemd misreads or that cannot work under its sandbox."""
    if not NAME_PATTERN.match(cfg.name):
        raise UsageError(f"invalid service name {cfg.name!r}: use letters, digits, '.', '_' or '-' (e.g. qwen3-omni)")
    if not _USER.match(cfg.user):
        raise UsageError(f"invalid user name {cfg.user!r}: use lowercase letters, digits, '_' or '-' (e.g. orin-omni)")
    if cfg.platform not in PLATFORMS:
        raise UsageError(f"invalid platform {cfg.platform!r}: use jetson or discrete")
    if not 1024 <= cfg.port <= 65535:
        raise UsageError(
            f"invalid port {cfg.port}: the unit drops every capability, so it cannot bind below 1024; "
            "use 1024-65535 and put a reverse proxy in front for port 80/443"
        )
    if not cfg.host or re.search(r"[\s\"'\\$%]", cfg.host):
        raise UsageError(f"invalid host {cfg.host!r}: give an address or hostname such as 127.0.0.1 or 0.0.0.0")
    if cfg.budget <= 0:
        raise UsageError(f"invalid budget {cfg.budget}: must be greater than zero")
    if not _CPU_QUOTA.match(cfg.cpu_quota):
        raise UsageError(f"invalid CPU quota {cfg.cpu_quota!r}: write a percentage of one core, e.g. 600%")
    if cfg.watchdog_sec < 1:
        raise UsageError(f"invalid watchdog interval {cfg.watchdog_sec}: must be at least 1 second")
    if cfg.max_queue is not None and cfg.max_queue < 1:
        raise UsageError(f"invalid max queue {cfg.max_queue}: must be at least 1")
    if cfg.served_model_name is not None:
        check_served_name(cfg.served_model_name)
    if cfg.power_mode is not None and cfg.power_mode not in POWER_MODES:
        raise UsageError(f"invalid power mode {cfg.power_mode!r}: use one of {', '.join(POWER_MODES)}")
    if cfg.platform != "jetson" and (cfg.power_mode or cfg.jetson_clocks):
        raise UsageError(
            f"--power-mode and --jetson-clocks only apply to a Jetson, and the platform is {cfg.platform}: "
            "drop them, or pass --platform jetson if the detection is wrong"
        )
    if not cfg.exec_start:
        raise UsageError("exec_start is empty: it must name the orin-omni console script or a Python interpreter")
    for what, path in (
        ("model directory", cfg.model_dir),
        ("API key file", cfg.api_key_file),
        ("ExecStart program", cfg.exec_start[0]),
        ("nvpmodel", cfg.nvpmodel),
        ("jetson_clocks", cfg.jetson_clocks_bin),
        ("PYTHONPATH", cfg.pythonpath),
        *(("runtime path", p) for p in cfg.runtime_paths),
    ):
        if path is not None:
            _check_path(what, path)
    for arg in cfg.exec_start[1:]:
        if _BAD_PATH_CHARS.search(arg):
            raise UsageError(f"ExecStart argument {arg!r} contains a character systemd would misread")
    for dev in cfg.devices:
        if not (dev.startswith("/dev/") or dev.startswith("char-") or dev.startswith("block-")) or re.search(
            r"\s", dev
        ):
            raise UsageError(f"invalid device {dev!r}: use a /dev path or a char-/block- group name")


def _sd_word(text: str) -> str:
    """One word of a unit file: % is a specifier, whitespace and ':' (BindPaths= separator) need quotes."""
    text = text.replace("%", "%%")
    return f'"{text}"' if re.search(r"[\s:]", text) else text


def _sd_exec(argv: tuple[str, ...] | list[str]) -> str:
    """A command line for ExecStart=: besides % also $ is special ($$ is a literal dollar)."""
    return " ".join(_sd_word(arg.replace("$", "$$")) for arg in argv)


def _sd_env(value: str, key: str) -> str:
    assignment = f"{key}={value}".replace("%", "%%")
    return f'"{assignment}"' if re.search(r"\s", assignment) else assignment


def _env_value(value: str) -> str:
    """A value for EnvironmentFile=: plain when it can be, else double-quoted (paths with spaces)."""
    value = str(value)
    return value if _PLAIN_ENV.match(value) else f'"{value}"'


def _environment():
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(template_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters.update(sd_path=_sd_word, sd_exec=_sd_exec, sd_env=_sd_env, env_value=_env_value)
    return env


def _outermost(paths: list[str]) -> list[str]:
    """Drop paths inside another listed path and duplicates, keeping order: one bind mount covers both."""
    unique = list(dict.fromkeys(paths))
    return [p for p in unique if not any(p != q and is_under(p, (q,)) for q in unique)]


def _context(cfg: UnitConfig) -> dict:
    serve_args = [
        "serve",
        "--model-dir", "${ORIN_OMNI_MODEL_DIR}",
        "--host", "${ORIN_OMNI_HOST}",
        "--port", "${ORIN_OMNI_PORT}",
        "--budget", "${ORIN_OMNI_BUDGET}",
        # the model directory is read-only to the service: INT4 layers are kept in the GPU's layout here
        "--packed-cache", f"/var/cache/{cfg.name}/packed",
    ]  # fmt: skip
    if cfg.api_key_file:
        serve_args += ["--api-key-file", "${ORIN_OMNI_API_KEY_FILE}"]
    if cfg.max_queue:
        serve_args += ["--max-queue", "${ORIN_OMNI_MAX_QUEUE}"]
    if cfg.served_model_name:
        serve_args += ["--served-model-name", "${ORIN_OMNI_SERVED_MODEL_NAME}"]
    pre_commands = []
    if cfg.power_mode:
        pre_commands.append((cfg.nvpmodel, "-m", str(POWER_MODES[cfg.power_mode])))
    if cfg.jetson_clocks:
        # After nvpmodel: changing the mode resets the clocks.
        pre_commands.append((cfg.jetson_clocks_bin,))
    data_paths = [p for p in (cfg.model_dir, cfg.api_key_file) if p]
    home_binds = _outermost([p for p in (*data_paths, *cfg.runtime_paths) if is_under(p, HOME_ROOTS)])
    devices = cfg.devices or (JETSON_DEVICES if cfg.platform == "jetson" else DISCRETE_DEVICES)
    return {
        "name": cfg.name,
        "user": cfg.user,
        "platform": cfg.platform,
        "groups": cfg.groups,
        "env_file": cfg.env_path,
        "pre_commands": pre_commands,
        "exec_start": cfg.exec_start,
        "serve_args": serve_args,
        "state_dir": f"/var/lib/{cfg.name}",
        "cache_dir": f"/var/cache/{cfg.name}",
        "pythonpath": cfg.pythonpath,
        "memory_max": f"{-(-memory_max(cfg.budget) // MiB)}M",
        "cpu_quota": cfg.cpu_quota,
        "watchdog_sec": cfg.watchdog_sec,
        "home_binds": home_binds,
        "read_only_paths": [p for p in data_paths if not is_under(p, HOME_ROOTS)],
        "device_allow": devices,
        "loopback": is_loopback(cfg.host),
        "model_dir": cfg.model_dir,
        "host": cfg.host,
        "port": cfg.port,
        "budget_text": size_text(cfg.budget),
        "api_key_file": cfg.api_key_file,
        "max_queue": cfg.max_queue,
        "served_model_name": cfg.served_model_name,
    }


def render_unit(cfg: UnitConfig) -> str:
    """The .service file for `cfg`."""
    validate_unit(cfg)
    return _environment().get_template("orin-omni.service.j2").render(_context(cfg))


def render_env(cfg: UnitConfig) -> str:
    """The EnvironmentFile= holding the serve options for `cfg`."""
    validate_unit(cfg)
    return _environment().get_template("orin-omni.env.j2").render(_context(cfg))


# --- looking at the machine ---------------------------------------------------------------------------------


def under_root(root: str | os.PathLike, path: str) -> Path:
    return Path(root) / path.lstrip("/")


def detect_platform(root: str | os.PathLike = "/") -> str:
    """jetson when the root has an L4T release file or the Tegra nvmap node, else discrete."""
    if under_root(root, "/etc/nv_tegra_release").exists() or under_root(root, "/dev/nvmap").exists():
        return "jetson"
    return "discrete"


def existing_groups(names: tuple[str, ...], root: str | os.PathLike = "/") -> tuple[str, ...]:
    """The subset of `names` that the root's /etc/group defines, in the order given."""
    try:
        lines = under_root(root, "/etc/group").read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return ()
    defined = {line.split(":", 1)[0] for line in lines if line and not line.startswith("#")}
    return tuple(n for n in names if n in defined)


def gpu_devices(platform: str, root: str | os.PathLike = "/") -> tuple[str, ...]:
    """DeviceAllow= entries for the GPU: the Tegra nodes present under the root's /dev, else the defaults."""
    if platform != "jetson":
        return DISCRETE_DEVICES
    dev = under_root(root, "/dev")
    found = sorted(
        {"/dev/" + p.relative_to(dev).as_posix() for g in JETSON_DEVICE_GLOBS for p in dev.glob(g) if not p.is_dir()}
    )
    return tuple(found) or JETSON_DEVICES


def find_tool(name: str, root: str | os.PathLike = "/") -> str | None:
    """Absolute path (as seen inside the root) of an executable in the usual system directories."""
    for directory in TOOL_DIRS:
        candidate = under_root(root, f"{directory}/{name}")
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return f"{directory}/{name}"
    return None


def resolve_exec_start(python: str | None = None) -> tuple[str, ...]:
    """This installation's entry point: the orin-omni console script beside the interpreter (same venv), else
    the interpreter itself running the CLI module. Never a guessed path such as /usr/local/bin/orin-omni."""
    exe = python or sys.executable
    if not exe:
        raise ServiceError(
            "cannot tell which Python runs orin-omni (sys.executable is empty); run it from a normal interpreter"
        )
    script = Path(exe).parent / "orin-omni"
    if script.is_file() and os.access(script, os.X_OK):
        return (str(script),)
    return (exe, "-m", "orin.cli")


def resolve_pythonpath(python: str | None = None) -> str | None:
    """None when the interpreter imports this very orin package on its own (-I: no PYTHONPATH, no user site,
    no current directory), else the directory that must go on PYTHONPATH (a checkout, a user site)."""
    exe = python or sys.executable
    package = Path(__file__).resolve().parents[1]  # orin/
    probe = "import os, orin; print(os.path.realpath(os.path.dirname(orin.__file__)))"
    try:
        proc = subprocess.run([exe, "-I", "-c", probe], cwd="/", capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ServiceError(f"cannot run {exe} to check how it imports orin: {exc}") from exc
    if proc.returncode == 0 and proc.stdout.strip() == str(package):
        return None
    return str(package.parent)
