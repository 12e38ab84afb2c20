"""The systemd unit: rendering (every variant through systemd-analyze verify and security), installing into a
staging root, refusing and forcing overwrites, uninstalling exactly what was installed, the CLI, and template
lookup from an installed wheel."""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from orin.cli import cli
from orin.errors import ModelError, ServiceError, UsageError
from orin.service.access import NEW_SYSTEM_USER, AccessProblem, access_problems, model_access_problems
from orin.service.install import InstallConfig, check_access, choose_platform, install_service, plan_install
from orin.service.record import record_path
from orin.service.uninstall import UninstallConfig, plan_uninstall, uninstall_service
from orin.service.unit import (
    DISCRETE_DEVICES,
    JETSON_DEVICES,
    POWER_MODES,
    UnitConfig,
    detect_platform,
    existing_groups,
    gpu_devices,
    memory_max,
    render_env,
    render_unit,
    resolve_exec_start,
    size_text,
    template_dir,
)
from orin.units import parse_bytes

GiB = 1 << 30
REPO = Path(__file__).resolve().parent.parent
SCRIPT = "/opt/orin omni/bin/orin-omni"  # a space on purpose: ExecStart must quote it
VENV_PYTHON = "/opt/venv/bin/python"
EXPOSURE_LIMIT = 4.0


def unit_config(**overrides) -> UnitConfig:
    base = UnitConfig(model_dir="/srv/models/qwen3-omni-int4", exec_start=(SCRIPT,))
    return replace(base, **overrides)


def directives(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


# ----------------------------------------------------------------------------- systemd-analyze on a fake root


@pytest.fixture(scope="module")
def analyze_root(tmp_path_factory) -> Path:
    """A root for `systemd-analyze --root`: the system's own units (sysinit.target and friends, which verify
    loads) and stand-in executables at every path a rendered unit runs, because verify checks them."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze not installed (Debian/Ubuntu package: systemd)")
    system_units = next(
        (Path(p) for p in ("/usr/lib/systemd/system", "/lib/systemd/system") if Path(p, "sysinit.target").exists()),
        None,
    )
    if system_units is None:
        pytest.skip("no systemd unit directory with sysinit.target to verify against")
    root = tmp_path_factory.mktemp("analyze-root")
    shutil.copytree(system_units, root / "usr/lib/systemd/system", symlinks=True)
    for exe in ("/usr/sbin/nvpmodel", "/usr/bin/jetson_clocks", SCRIPT, VENV_PYTHON, sys.executable):
        path = root / exe.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
    return root


def analyze(root: Path, unit_text: str, name: str) -> float:
    """Verify the unit (any output at all is a failure: verify exits 0 on warnings) and return its exposure."""
    target = f"/etc/systemd/system/{name}.service"
    path = root / target.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(unit_text)
    verify = subprocess.run(
        ["systemd-analyze", "verify", f"--root={root}", target], capture_output=True, text=True, timeout=60
    )
    assert verify.returncode == 0 and verify.stdout + verify.stderr == "", (
        f"{name}: systemd-analyze verify said:\n{verify.stdout}{verify.stderr}"
    )
    security = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", f"--root={root}", "--no-pager", target],
        capture_output=True,
        text=True,
        timeout=60,
    )
    match = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", security.stdout)
    assert match, f"{name}: no exposure level in:\n{security.stdout}{security.stderr}"
    return float(match.group(1))


VARIANTS = {
    "jetson-plain": unit_config(),
    "jetson-maxn-clocks-key": unit_config(
        power_mode="MAXN", jetson_clocks=True, api_key_file="/etc/orin-omni/api-keys", max_queue=4
    ),
    "jetson-50w-groups": unit_config(power_mode="50W", groups=("video", "render", "jtop")),
    "jetson-30w-clocks-public": unit_config(power_mode="30W", jetson_clocks=True, host="0.0.0.0"),
    "jetson-15w-big-budget": unit_config(power_mode="15W", budget=48 * GiB, cpu_quota="1200%"),
    "jetson-clocks-only-found-devices": unit_config(jetson_clocks=True, devices=("/dev/nvmap", "/dev/nvhost-gpu")),
    "discrete-plain": unit_config(platform="discrete"),
    "discrete-key-ipv6-small-budget": unit_config(
        platform="discrete", api_key_file="/etc/orin-omni/keys", host="::1", budget=8 * GiB, max_queue=16
    ),
    "discrete-python-m": unit_config(platform="discrete", exec_start=(VENV_PYTHON, "-m", "orin.cli")),
    "discrete-home-install": unit_config(
        platform="discrete",
        model_dir="/home/ai/models/qwen3 omni",
        runtime_paths=("/home/ai/venv", "/home/ai/venv/bin", "/usr"),
        pythonpath="/home/ai/src",
    ),
    "jetson-odd-paths": unit_config(model_dir="/srv/models/100%: int4", api_key_file="/srv/keys/k 1"),
    "discrete-served-name": unit_config(platform="discrete", served_model_name="Qwen/Qwen3-Omni-30B-A3B-Instruct"),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_variant_verifies_cleanly_and_scores_at_most_4(analyze_root, variant):
    text = render_unit(VARIANTS[variant])
    assert analyze(analyze_root, text, variant) <= EXPOSURE_LIMIT


def test_verify_check_catches_a_broken_unit(analyze_root):
    """The check above can fail: an unknown key and a bad value are warnings with exit 0, still caught."""
    text = render_unit(unit_config()).replace("[Install]", "Bogus=1\n[Install]").replace("600%", "lots")
    with pytest.raises(AssertionError, match="Bogus"):
        analyze(analyze_root, text, "broken")


def test_security_check_catches_an_unhardened_unit(analyze_root):
    bare = f'[Service]\nType=notify\nExecStart="{SCRIPT}" serve\n\n[Install]\nWantedBy=multi-user.target\n'
    assert analyze(analyze_root, bare, "bare") > EXPOSURE_LIMIT


def test_installed_files_verify_cleanly(analyze_root, tmp_path, model_dir):
    """What install-service writes (real interpreter, real probes) passes verify too."""
    stage = tmp_path / "stage"
    plan = install_service(
        InstallConfig(model_dir=str(model_dir), root=str(stage), platform="jetson", power_mode="MAXN")
    )
    unit_text = (stage / plan.unit.unit_path.lstrip("/")).read_text()
    exe = analyze_root / plan.unit.exec_start[0].lstrip("/")
    exe.parent.mkdir(parents=True, exist_ok=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert analyze(analyze_root, unit_text, "installed") <= EXPOSURE_LIMIT


def _doc_block(containing: str) -> str:
    blocks = re.findall(r"```sh\n(.*?)```", (REPO / "docs/service.md").read_text(), re.S)
    return next(b for b in blocks if containing in b)


def _host_units() -> Path:
    path = Path("/usr/lib/systemd/system")
    if shutil.which("systemd-analyze") is None or not (path / "sysinit.target").exists():
        pytest.skip("systemd-analyze or /usr/lib/systemd/system/sysinit.target missing")
    return path


def _staged_board_image(tmp_path: Path, model_dir: Path, *options: str) -> Path:
    """The staging example of docs/service.md: jetson options, a bare --root, no --platform."""
    result = CliRunner().invoke(
        cli, ["install-service", "--root", str(tmp_path / "board-rootfs"), "--model-dir", str(model_dir), *options]
    )
    assert result.exit_code == 0, result.output
    return tmp_path / "board-rootfs/etc/systemd/system/qwen3-omni.service"


@pytest.mark.parametrize(
    ("options", "missing"),
    [
        (("--power-mode", "MAXN", "--jetson-clocks"), "/usr/sbin/nvpmodel"),
        (("--jetson-clocks",), "/usr/bin/jetson_clocks"),
    ],
)
def test_off_the_board_verify_says_only_what_docs_say(tmp_path, model_dir, options, missing):
    """docs/service.md: off the board, verify names the missing L4T tool and nothing else."""
    _host_units()
    if Path(missing).exists():
        pytest.skip(f"{missing} exists here: this is not 'off the board'")
    unit = _staged_board_image(tmp_path, model_dir, *options)
    verify = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert verify.returncode == 1
    assert (verify.stdout + verify.stderr).strip() == (
        f"qwen3-omni.service: Command {missing} is not executable: No such file or directory"
    )


def test_the_docs_stubbed_verify_of_a_staged_image_prints_nothing(tmp_path, model_dir):
    """The scratch-root recipe of docs/service.md, run as written, on the docs' staging example."""
    _host_units()
    script = resolve_exec_start()
    if len(script) != 1:
        pytest.skip("no orin-omni console script beside this interpreter")
    unit = _staged_board_image(tmp_path, model_dir, "--budget", "24GiB", "--power-mode", "MAXN", "--jetson-clocks")
    assert "ExecStartPre=+/usr/bin/jetson_clocks" in unit.read_text()
    env = {**os.environ, "PATH": f"{Path(script[0]).parent}:{os.environ['PATH']}"}
    run = subprocess.run(
        ["bash", "-c", _doc_block("systemd-analyze verify --root")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0 and run.stdout + run.stderr == "", run.stdout + run.stderr
    # ...and it can fail: without the nvpmodel stand-in the same recipe complains.
    broken = _doc_block("systemd-analyze verify --root").replace("/usr/sbin/nvpmodel ", "")
    run = subprocess.run(["bash", "-c", broken], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert "/usr/sbin/nvpmodel is not executable" in run.stdout + run.stderr


# ----------------------------------------------------------------------------------------------- rendering


def test_unit_has_the_required_directives():
    lines = directives(render_unit(unit_config()))
    for expected in (
        "Type=notify",
        "WatchdogSec=60",
        "Restart=on-failure",
        "TimeoutStartSec=15min",
        "Environment=CUDA_MODULE_LOADING=LAZY",
        "CPUQuota=600%",
        f"MemoryMax={memory_max(24 * GiB) // (1 << 20)}M",
        "User=orin-omni",
        "ProtectSystem=strict",
        "ProtectHome=yes",
        "PrivateTmp=yes",
        "NoNewPrivileges=yes",
        "CapabilityBoundingSet=",
        "DevicePolicy=closed",
        "ReadOnlyPaths=/srv/models/qwen3-omni-int4",
        "EnvironmentFile=/etc/orin-omni/qwen3-omni.env",
        "StateDirectory=qwen3-omni",
        "CacheDirectory=qwen3-omni",
        "Environment=TRITON_CACHE_DIR=/var/cache/qwen3-omni/triton",
        "Environment=HF_HOME=/var/cache/qwen3-omni/huggingface",
        "Environment=XDG_CACHE_HOME=/var/cache/qwen3-omni",
        "IPAddressDeny=any",
        "IPAddressAllow=localhost",
        "WantedBy=multi-user.target",
    ):
        assert expected in lines, expected
    # CUDA and Triton JIT need W+X mappings: the directive is only mentioned in a comment.
    assert not any(line.startswith("MemoryDenyWriteExecute") for line in lines)
    assert not any(line.startswith("ExecStartPre") for line in lines)


def test_execstart_runs_serve_with_options_from_the_environment_file():
    lines = directives(render_unit(unit_config(api_key_file="/etc/orin-omni/keys", max_queue=8)))
    exec_start = next(line for line in lines if line.startswith("ExecStart="))
    assert exec_start == (
        f'ExecStart="{SCRIPT}" serve --model-dir ${{ORIN_OMNI_MODEL_DIR}} --host ${{ORIN_OMNI_HOST}} '
        "--port ${ORIN_OMNI_PORT} --budget ${ORIN_OMNI_BUDGET} --packed-cache /var/cache/qwen3-omni/packed "
        "--api-key-file ${ORIN_OMNI_API_KEY_FILE} --max-queue ${ORIN_OMNI_MAX_QUEUE}"
    )
    plain = next(line for line in directives(render_unit(unit_config())) if line.startswith("ExecStart="))
    assert "--api-key-file" not in plain and "--max-queue" not in plain


def test_environment_file_round_trips_through_a_shell(tmp_path):
    """EnvironmentFile= quoting is a subset of shell quoting: sourcing it gives back the exact values."""
    cfg = unit_config(
        model_dir="/srv/my models/q%1", api_key_file="/etc/orin-omni/keys", max_queue=3, budget=1536 << 20
    )
    env_file = tmp_path / "env"
    env_file.write_text(render_env(cfg))
    out = subprocess.run(
        ["sh", "-c", '. "$1"; printf "%s\\n" "$ORIN_OMNI_MODEL_DIR" "$ORIN_OMNI_HOST" "$ORIN_OMNI_PORT" '
         '"$ORIN_OMNI_BUDGET" "$ORIN_OMNI_API_KEY_FILE" "$ORIN_OMNI_MAX_QUEUE"', "sh", str(env_file)],
        capture_output=True, text=True, check=True,
    ).stdout.splitlines()  # fmt: skip
    assert out == ["/srv/my models/q%1", "127.0.0.1", "8000", "1536MiB", "/etc/orin-omni/keys", "3"]
    assert parse_bytes(out[3]) == 1536 << 20


def test_served_model_name_goes_through_the_environment_file(tmp_path):
    cfg = unit_config(served_model_name="Qwen/Qwen3-Omni-30B-A3B-Instruct")
    exec_start = next(line for line in directives(render_unit(cfg)) if line.startswith("ExecStart="))
    assert exec_start.endswith(" --served-model-name ${ORIN_OMNI_SERVED_MODEL_NAME}")
    env_file = tmp_path / "env"
    env_file.write_text(render_env(cfg))
    out = subprocess.run(["sh", "-c", '. "$1"; printf "%s" "$ORIN_OMNI_SERVED_MODEL_NAME"', "sh", str(env_file)],
                         capture_output=True, text=True, check=True).stdout
    assert out == "Qwen/Qwen3-Omni-30B-A3B-Instruct"
    # Not given: serve names the model itself (from the checkpoint's manifest).
    assert "served-model-name" not in render_unit(unit_config()).lower()
    assert "SERVED_MODEL_NAME" not in render_env(unit_config())


@pytest.mark.parametrize("mode", sorted(POWER_MODES))
def test_power_mode_runs_nvpmodel_with_full_privileges(mode):
    lines = directives(render_unit(unit_config(power_mode=mode)))
    assert f"ExecStartPre=+/usr/sbin/nvpmodel -m {POWER_MODES[mode]}" in lines


def test_power_mode_ids_for_agx_orin_64gb():
    assert POWER_MODES == {"MAXN": 0, "15W": 1, "30W": 2, "50W": 3}


def test_jetson_clocks_runs_after_nvpmodel():
    lines = directives(render_unit(unit_config(power_mode="30W", jetson_clocks=True, jetson_clocks_bin="/opt/jc")))
    pre = [line for line in lines if line.startswith("ExecStartPre=")]
    assert pre == ["ExecStartPre=+/usr/sbin/nvpmodel -m 2", "ExecStartPre=+/opt/jc"]


def test_device_access_per_platform():
    jetson = directives(render_unit(unit_config()))
    assert [line for line in jetson if line.startswith("DeviceAllow=")] == [
        f"DeviceAllow={d} rw" for d in JETSON_DEVICES
    ]
    assert "After=nvpmodel.service jtop.service" in jetson
    discrete = directives(render_unit(unit_config(platform="discrete")))
    assert [line for line in discrete if line.startswith("DeviceAllow=")] == [
        f"DeviceAllow={d} rw" for d in DISCRETE_DEVICES
    ]
    assert not any("nvmap" in line or "jtop" in line for line in discrete)
    # the JetPack's ptxas for the Jetson AI Lab's Triton; a discrete GPU's Triton brings its own
    assert "Environment=TRITON_PTXAS_PATH=/usr/local/cuda/bin/ptxas" in jetson
    assert not any("TRITON_PTXAS_PATH" in line for line in discrete)


def test_supplementary_groups_only_when_given():
    assert "SupplementaryGroups=video jtop" in directives(render_unit(unit_config(groups=("video", "jtop"))))
    assert not any(line.startswith("SupplementaryGroups") for line in directives(render_unit(unit_config())))


@pytest.mark.parametrize(
    ("host", "fenced"), [("127.0.0.1", True), ("::1", True), ("localhost", True), ("0.0.0.0", False)]
)
def test_ip_fence_only_for_loopback(host, fenced):
    lines = directives(render_unit(unit_config(host=host)))
    assert ("IPAddressDeny=any" in lines) is fenced


def test_memory_max_is_budget_plus_headroom():
    assert memory_max(24 * GiB) == 30 * GiB
    assert memory_max(8 * GiB) == 12 * GiB  # at least 4 GiB of headroom
    assert "MemoryMax=61440M" in directives(render_unit(unit_config(budget=48 * GiB)))


@pytest.mark.parametrize("n", [24 * GiB, 1536 << 20, 1000, 3 << 10, 1 << 40])
def test_size_text_round_trips(n):
    assert parse_bytes(size_text(n)) == n


def test_paths_with_spaces_and_percent_are_quoted_and_escaped():
    lines = directives(render_unit(unit_config(model_dir="/srv/my models/100%", exec_start=(SCRIPT,))))
    assert 'ReadOnlyPaths="/srv/my models/100%%"' in lines
    assert any(line.startswith(f'ExecStart="{SCRIPT}" serve') for line in lines)


def test_home_directory_install_binds_only_what_it_needs():
    cfg = unit_config(
        model_dir="/home/ai/models/q",
        runtime_paths=("/home/ai/venv", "/home/ai/venv/bin", "/usr"),
        pythonpath="/home/ai/src",
    )
    lines = directives(render_unit(cfg))
    assert "ProtectHome=tmpfs" in lines
    binds = [line for line in lines if line.startswith("BindReadOnlyPaths=")]
    assert binds == ["BindReadOnlyPaths=/home/ai/models/q", "BindReadOnlyPaths=/home/ai/venv"]
    assert "Environment=PYTHONPATH=/home/ai/src" in lines
    assert not any(line.startswith("ReadOnlyPaths=") for line in lines)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"platform": "discrete", "power_mode": "MAXN"}, "only apply to a Jetson"),
        ({"platform": "discrete", "jetson_clocks": True}, "only apply to a Jetson"),
        ({"power_mode": "40W"}, "invalid power mode"),
        ({"port": 80}, "cannot bind below 1024"),
        ({"name": "bad name"}, "invalid service name"),
        ({"user": "Root!"}, "invalid user name"),
        ({"cpu_quota": "6"}, "invalid CPU quota"),
        ({"model_dir": "relative/dir"}, "must be an absolute path"),
        ({"model_dir": "/srv/$HOME"}, "cannot be written safely"),
        ({"model_dir": '/srv/"q"'}, "cannot be written safely"),
        ({"host": "a b"}, "invalid host"),
        ({"devices": ("/sys/x",)}, "invalid device"),
        ({"served_model_name": "my model"}, "invalid served model name"),
        ({"served_model_name": "q$HOME"}, "invalid served model name"),
    ],
)
def test_bad_values_are_refused_with_a_reason(overrides, message):
    with pytest.raises(UsageError, match=message):
        render_unit(unit_config(**overrides))


def test_templates_found_in_the_checkout():
    assert template_dir() == REPO / "systemd"


# --------------------------------------------------------------------------------------------------- probes


def test_detect_platform_and_devices_under_a_root(tmp_path):
    assert detect_platform(tmp_path) == "discrete"
    assert gpu_devices("jetson", tmp_path) == JETSON_DEVICES  # nothing to look at: the L4T defaults
    (tmp_path / "dev/nvgpu/igpu0").mkdir(parents=True)
    for node in ("dev/nvmap", "dev/nvhost-gpu", "dev/nvgpu/igpu0/ctrl", "dev/null"):
        (tmp_path / node).touch()
    assert detect_platform(tmp_path) == "jetson"
    assert gpu_devices("jetson", tmp_path) == ("/dev/nvgpu/igpu0/ctrl", "/dev/nvhost-gpu", "/dev/nvmap")
    assert gpu_devices("discrete", tmp_path) == DISCRETE_DEVICES
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/nv_tegra_release").write_text("# R36 (release), REVISION: 4.3\n")
    assert detect_platform(tmp_path) == "jetson"


def test_existing_groups_reads_the_roots_group_file(tmp_path):
    assert existing_groups(("video", "jtop"), tmp_path) == ()
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/group").write_text("root:x:0:\nvideo:x:44:\njtop:x:999:ai\n")
    assert existing_groups(("video", "render", "jtop"), tmp_path) == ("video", "jtop")


def test_exec_start_prefers_the_console_script_beside_the_interpreter(tmp_path):
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.write_text("")
    assert resolve_exec_start(str(python)) == (str(python), "-m", "orin.cli")
    script = tmp_path / "bin" / "orin-omni"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    assert resolve_exec_start(str(python)) == (str(script),)


def test_python_m_orin_cli_is_a_working_entry_point():
    """The fallback ExecStart runs `python -m orin.cli`: it must reach the same CLI."""
    out = subprocess.run(
        [sys.executable, "-m", "orin.cli", "install-service", "--help"], capture_output=True, text=True, cwd=REPO
    )
    assert out.returncode == 0 and "--model-dir" in out.stdout


# ------------------------------------------------------------------------------------------------ installing


@pytest.fixture
def model_dir(tmp_path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text("{}\n")
    return path


def install(model_dir: Path, root: Path, lines: list | None = None, **overrides):
    cfg = InstallConfig(model_dir=str(model_dir), root=str(root), **overrides)
    return install_service(cfg, log=(lines.append if lines is not None else print))


def tree(root: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
    }  # fmt: skip


def test_install_writes_unit_env_and_record(tmp_path, model_dir):
    root = tmp_path / "root"
    lines: list[str] = []
    plan = install(model_dir, root, lines, platform="jetson", port=8123)
    unit = root / "etc/systemd/system/qwen3-omni.service"
    env = root / "etc/orin-omni/qwen3-omni.env"
    assert unit.read_text() == render_unit(plan.unit)
    assert env.read_text() == render_env(plan.unit)
    assert "ORIN_OMNI_PORT=8123" in env.read_text().splitlines()
    assert stat.S_IMODE(unit.stat().st_mode) == 0o644
    record = json.loads((root / record_path("qwen3-omni").lstrip("/")).read_text())
    assert [f["path"] for f in record["files"]] == [
        "/etc/orin-omni/qwen3-omni.env",
        "/etc/systemd/system/qwen3-omni.service",
    ]
    # Not root: no user, no systemctl, and it says so.
    assert plan.useradd is None and plan.commands == ()
    assert any(
        line.startswith("skipped creating user orin-omni: --root is") and "useradd --system" in line for line in lines
    )
    assert any(line.startswith("skipped systemctl daemon-reload/enable: --root is") for line in lines)
    # The unit runs this very installation.
    assert plan.unit.exec_start == resolve_exec_start()
    assert plan.unit.model_dir == str(model_dir.resolve())


def test_a_jetson_unit_never_sets_expandable_segments(tmp_path, model_dir):
    """The allocator's expandable segments fail on Tegra and the engine refuses them there (orin.device.
    allocator_conf): neither file of a Jetson's unit sets an allocator variable, and the environment systemd builds
    from them passes the engine's start-up check; one line added by hand would not."""
    from orin.checks.doctor import read_installed, service_environment
    from orin.device.allocator_conf import VARIABLES, AllocatorConf, check_allocator

    cfg = unit_config(platform="jetson", power_mode="MAXN", jetson_clocks=True)
    for text in (render_unit(cfg), render_env(cfg)):
        assert not [line for line in directives(text) if "expandable_segments" in line or "ALLOC_CONF" in line]
    root = tmp_path / "root"
    install(model_dir, root, [], platform="jetson")
    env = service_environment(read_installed(str(root), "qwen3-omni"), str(root), "qwen3-omni")
    assert env["TRITON_PTXAS_PATH"] == "/usr/local/cuda/bin/ptxas" and not set(VARIABLES) & set(env)
    check_allocator(AllocatorConf.from_environ(env), unified_memory=True)
    env_file = root / "etc/orin-omni/qwen3-omni.env"
    env_file.write_text(env_file.read_text() + "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True\n")
    env = service_environment(read_installed(str(root), "qwen3-omni"), str(root), "qwen3-omni")
    with pytest.raises(UsageError, match="unset PYTORCH_CUDA_ALLOC_CONF"):
        check_allocator(AllocatorConf.from_environ(env), unified_memory=True)


def test_rerun_is_unchanged_and_touches_nothing(tmp_path, model_dir):
    root = tmp_path / "root"
    install(model_dir, root)
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}
    lines: list[str] = []
    plan = install(model_dir, root, lines)
    assert not plan.changed
    assert lines[-1] == "qwen3-omni: unchanged"
    assert {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()} == before


def test_differing_unit_is_refused_without_force_and_kept_as_bak_with_it(tmp_path, model_dir):
    root = tmp_path / "root"
    install(model_dir, root)
    unit = root / "etc/systemd/system/qwen3-omni.service"
    edited = unit.read_text().replace("CPUQuota=600%", "CPUQuota=200%")
    unit.write_text(edited)
    with pytest.raises(ServiceError, match="(?s)refusing to overwrite .*qwen3-omni.service.*--force rewrites only"):
        install(model_dir, root)
    assert unit.read_text() == edited
    assert not Path(f"{unit}.bak").exists()

    plan = install(model_dir, root, force=True)
    assert Path(f"{unit}.bak").read_text() == edited
    assert unit.read_text() == render_unit(plan.unit)


def test_other_options_count_as_a_differing_unit(tmp_path, model_dir):
    root = tmp_path / "root"
    install(model_dir, root)
    with pytest.raises(ServiceError, match="they differ"):
        install(model_dir, root, budget=16 * GiB)  # env file and MemoryMax= both change


def test_dry_run_writes_nothing_and_prints_the_plan(tmp_path, model_dir):
    root = tmp_path / "root"
    lines: list[str] = []
    install(model_dir, root, lines, dry_run=True, power_mode="50W", platform="jetson")
    assert not root.exists()
    text = "\n".join(lines)
    assert f"would write {root}/etc/systemd/system/qwen3-omni.service" in text
    assert "ExecStartPre=+/usr/sbin/nvpmodel -m 3" in text
    assert "skipped creating user" in text


def test_uninstall_removes_exactly_what_was_installed(tmp_path, model_dir):
    root = tmp_path / "root"
    (root / "etc/systemd/system").mkdir(parents=True)
    (root / "etc/systemd/system/other.service").write_text("[Service]\nExecStart=/bin/true\n")
    before = tree(root)
    install(model_dir, root, force=True)
    # Something else moves in beside our files after the install.
    (root / "etc/orin-omni/notes.txt").write_text("keep me\n")
    lines: list[str] = []
    uninstall_service(UninstallConfig(root=str(root)), log=lines.append)
    assert tree(root) == {**before, "etc/orin-omni": None, "etc/orin-omni/notes.txt": b"keep me\n"}
    assert not any("remove directory" in line and "orin-omni" in line for line in lines)


def test_uninstall_of_a_fresh_staging_root_leaves_it_empty(tmp_path, model_dir):
    root = tmp_path / "root"
    install(model_dir, root)
    uninstall_service(UninstallConfig(root=str(root)))
    assert list(root.iterdir()) == []


def test_uninstall_keeps_the_bak_of_a_forced_install(tmp_path, model_dir):
    root = tmp_path / "root"
    unit = root / "etc/systemd/system/qwen3-omni.service"
    unit.parent.mkdir(parents=True)
    unit.write_text("[Service]\nExecStart=/bin/true\n")
    install(model_dir, root, force=True)
    uninstall_service(UninstallConfig(root=str(root)))
    assert not unit.exists()
    assert Path(f"{unit}.bak").read_text() == "[Service]\nExecStart=/bin/true\n"


def test_uninstall_dry_run_removes_nothing(tmp_path, model_dir):
    root = tmp_path / "root"
    install(model_dir, root)
    before = tree(root)
    lines: list[str] = []
    uninstall_service(UninstallConfig(root=str(root), dry_run=True), log=lines.append)
    assert tree(root) == before
    assert f"would remove {root}/etc/systemd/system/qwen3-omni.service" in lines


def test_uninstall_refuses_an_edited_record(tmp_path, model_dir):
    root = tmp_path / "root"
    install(model_dir, root)
    (root / "etc/passwd").write_text("root:x:0:0::/root:/bin/sh\n")
    record_file = root / record_path("qwen3-omni").lstrip("/")
    record = json.loads(record_file.read_text())
    record["files"].append({"path": "/etc/passwd", "sha256": ""})
    record_file.write_text(json.dumps(record))
    before = tree(root)
    with pytest.raises(ServiceError, match="lists paths install-service never writes"):
        uninstall_service(UninstallConfig(root=str(root)))
    assert tree(root) == before


def test_uninstall_without_a_record_says_so(tmp_path):
    with pytest.raises(ServiceError, match="no install record"):
        uninstall_service(UninstallConfig(name="nothing-here", root=str(tmp_path)))


def test_missing_model_dir_is_a_model_error(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        install(tmp_path / "nope", tmp_path / "root")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        install(tmp_path / "empty", tmp_path / "root")


def test_staged_jetson_install_uses_the_roots_groups_and_devices(tmp_path, model_dir):
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc/nv_tegra_release").write_text("# R36\n")
    (root / "etc/group").write_text("video:x:44:\nrender:x:105:\n")
    (root / "dev").mkdir()
    (root / "dev/nvmap").touch()
    plan = install(model_dir, root, jetson_clocks=True)
    assert plan.unit.platform == "jetson"
    assert plan.unit.groups == ("video", "render")
    assert plan.unit.devices == ("/dev/nvmap",)
    assert plan.unit.jetson_clocks_bin == "/usr/bin/jetson_clocks"


def test_bare_staging_root_with_jetson_options_renders_for_a_jetson_and_says_why(tmp_path, model_dir):
    lines: list[str] = []
    plan = install(model_dir, tmp_path / "bare", lines, power_mode="MAXN")
    assert plan.unit.platform == "jetson"
    assert plan.unit.devices == JETSON_DEVICES
    assert any(line.startswith("note: rendering for a Jetson because of --power-mode:") for line in lines)
    # Without a Jetson-only option the bare root stays discrete, silently.
    lines.clear()
    assert install(model_dir, tmp_path / "plain", lines).unit.platform == "discrete"
    assert not any("rendering for a Jetson" in line for line in lines)


def test_platform_choice_keeps_what_was_said_or_seen(monkeypatch):
    notes: list[str] = []
    # Asked for: kept (validate_unit then refuses discrete + --power-mode).
    said = InstallConfig(model_dir="/m", root="/stage", platform="discrete", power_mode="MAXN")
    assert choose_platform(said, notes) == "discrete"
    # The running system: its detection stands, even with --jetson-clocks.
    monkeypatch.setattr("orin.service.install.detect_platform", lambda _root: "discrete")
    assert choose_platform(InstallConfig(model_dir="/m", root="/", jetson_clocks=True), notes) == "discrete"
    assert notes == []


def test_cli_staging_example_needs_no_platform_option(tmp_path, model_dir):
    root = tmp_path / "board-rootfs"
    result = CliRunner().invoke(
        cli,
        ["install-service", "--root", str(root), "--model-dir", str(model_dir), "--budget", "24GiB",
         "--power-mode", "MAXN", "--jetson-clocks"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "rendering for a Jetson because of --power-mode and --jetson-clocks" in result.output
    unit = directives((root / "etc/systemd/system/qwen3-omni.service").read_text())
    assert [line for line in unit if line.startswith("ExecStartPre=")] == [
        "ExecStartPre=+/usr/sbin/nvpmodel -m 0",
        "ExecStartPre=+/usr/bin/jetson_clocks",
    ]


# --------------------------------------------------------------------------- the real-root plan (never applied)


def test_plan_for_the_real_root_creates_the_user_and_runs_systemctl():
    cfg = InstallConfig(model_dir="/srv/m", name="orin-omni-plan-test", user="orin-omni-no-such-user", root="/")
    unit = UnitConfig(
        model_dir="/srv/m",
        exec_start=("/usr/bin/orin-omni",),
        name=cfg.name,
        user=cfg.user,
        groups=("video", "jtop"),
    )
    plan = plan_install(cfg, unit, systemd_up=True)
    assert plan.useradd == (
        "useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/var/lib/orin-omni-plan-test",
        "--shell", "/usr/sbin/nologin", "--groups", "video,jtop", "orin-omni-no-such-user",
    )  # fmt: skip
    assert plan.commands == (("systemctl", "daemon-reload"), ("systemctl", "enable", "orin-omni-plan-test.service"))
    assert plan_install(replace(cfg, enable=False), unit, systemd_up=True).commands == (("systemctl", "daemon-reload"),)
    no_systemd = plan_install(cfg, unit, systemd_up=False)
    assert no_systemd.commands == ()
    assert any("systemd is not running" in note for note in no_systemd.notes)


def test_real_root_refuses_paths_that_private_tmp_hides():
    cfg = InstallConfig(model_dir="/tmp/m", name="orin-omni-plan-test", root="/")
    unit = UnitConfig(model_dir="/tmp/m", exec_start=("/usr/bin/orin-omni",), name=cfg.name)
    with pytest.raises(ServiceError, match="PrivateTmp"):
        plan_install(cfg, unit, systemd_up=True)


def test_real_root_needs_root_privileges(monkeypatch, model_dir):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(ServiceError, match="run it as root"):
        install_service(InstallConfig(model_dir=str(model_dir), root="/"))
    with pytest.raises(ServiceError, match="needs root"):
        uninstall_service(UninstallConfig(root="/"))


def test_uninstall_plan_for_the_real_root_disables_first(tmp_path, monkeypatch, model_dir):
    root = tmp_path / "root"
    install(model_dir, root)
    # The record decides what goes; pretend the staged root is / for the systemctl part only.
    monkeypatch.setattr("orin.service.uninstall.is_root_fs", lambda _root: True)
    plan = plan_uninstall(UninstallConfig(root=str(root)), systemd_up=True)
    assert plan.commands_before == (("systemctl", "disable", "--now", "qwen3-omni.service"),)
    assert plan.commands_after == (("systemctl", "daemon-reload"),)


# ------------------------------------------------------------------------------------------------------- CLI


def test_cli_install_and_uninstall(tmp_path, model_dir):
    root = tmp_path / "root"
    runner = CliRunner()
    args = ["install-service", "--model-dir", str(model_dir), "--root", str(root), "--platform", "jetson",
            "--power-mode", "50w", "--jetson-clocks", "--budget", "16GiB", "--max-queue", "2"]  # fmt: skip
    result = runner.invoke(cli, args)
    assert result.exit_code == 0, result.output
    unit = (root / "etc/systemd/system/qwen3-omni.service").read_text()
    assert "ExecStartPre=+/usr/sbin/nvpmodel -m 3" in unit
    assert "ORIN_OMNI_BUDGET=16GiB" in (root / "etc/orin-omni/qwen3-omni.env").read_text()
    assert "skipped creating user" in result.output
    again = runner.invoke(cli, args)
    assert again.exit_code == 0 and "qwen3-omni: unchanged" in again.output
    gone = runner.invoke(cli, ["uninstall-service", "--root", str(root)])
    assert gone.exit_code == 0, gone.output
    assert list(root.iterdir()) == []


def test_cli_bad_power_mode_is_a_usage_error(tmp_path, model_dir):
    result = CliRunner().invoke(
        cli, ["install-service", "--model-dir", str(model_dir), "--root", str(tmp_path), "--power-mode", "40W"]
    )
    assert result.exit_code == 2
    assert "--power-mode" in result.output


def test_cli_power_mode_on_discrete_is_a_usage_error(tmp_path, model_dir):
    result = CliRunner().invoke(
        cli,
        ["install-service", "--model-dir", str(model_dir), "--root", str(tmp_path), "--platform", "discrete",
         "--power-mode", "MAXN"],
    )  # fmt: skip
    assert result.exit_code == 2
    assert "only apply to a Jetson" in result.output
    # The usage shown is the subcommand's, not the group's.
    assert re.search(r"^Usage: \S+ install-service \[OPTIONS\]$", result.output, re.M), result.output
    assert "COMMAND [ARGS]" not in result.output
    assert re.search(r"Try '\S+ install-service (-h|--help)' for help", result.output), result.output


def test_cli_missing_model_dir_is_a_clear_error(tmp_path):
    result = CliRunner().invoke(
        cli, ["install-service", "--model-dir", str(tmp_path / "nope"), "--root", str(tmp_path)]
    )
    assert result.exit_code == 1
    assert f"model directory {tmp_path / 'nope'} does not exist" in result.output


def test_cli_refuses_a_differing_unit(tmp_path, model_dir):
    runner = CliRunner()
    base = ["install-service", "--model-dir", str(model_dir), "--root", str(tmp_path / "r")]
    assert runner.invoke(cli, base).exit_code == 0
    # What the user made beside the recorded files: --force must leave it.
    dropin = tmp_path / "r/etc/systemd/system/qwen3-omni.service.d/override.conf"
    dropin.parent.mkdir()
    dropin.write_text("[Service]\nCPUQuota=300%\n")
    env = tmp_path / "r/etc/orin-omni/qwen3-omni.env"
    before = env.read_text()
    result = runner.invoke(cli, [*base, "--port", "9001"])
    assert result.exit_code == 1
    out = result.output
    assert "  -ORIN_OMNI_PORT=8000\n  +ORIN_OMNI_PORT=9001\n" in out  # what differs
    assert "--force rewrites only the files install-service records" in out
    assert "it leaves the service user orin-omni, /var/lib/qwen3-omni, /var/cache/qwen3-omni, drop-ins in" in out
    assert "systemctl restart qwen3-omni applies the change" in out
    assert env.read_text() == before
    forced = runner.invoke(cli, [*base, "--port", "9001", "--force"])
    assert forced.exit_code == 0, forced.output
    assert Path(f"{env}.bak").read_text() == before and "ORIN_OMNI_PORT=9001" in env.read_text()
    assert dropin.read_text() == "[Service]\nCPUQuota=300%\n"


def test_cli_dry_run(tmp_path, model_dir):
    result = CliRunner().invoke(
        cli, ["install-service", "--model-dir", str(model_dir), "--root", str(tmp_path / "r"), "--dry-run"]
    )
    assert result.exit_code == 0, result.output
    assert "would write" in result.output and "Type=notify" in result.output
    assert not (tmp_path / "r").exists()


def test_cli_served_model_name(tmp_path, model_dir):
    root = tmp_path / "r"
    args = ["install-service", "--model-dir", str(model_dir), "--root", str(root), "--served-model-name", "qwen3-omni"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "ORIN_OMNI_SERVED_MODEL_NAME=qwen3-omni" in (root / "etc/orin-omni/qwen3-omni.env").read_text().splitlines()
    assert "--served-model-name ${ORIN_OMNI_SERVED_MODEL_NAME}" in (root / "etc/systemd/system/qwen3-omni.service").read_text()
    bad = CliRunner().invoke(cli, [*args[:-1], "two words", "--force"])
    assert bad.exit_code == 2 and "invalid served model name" in bad.output


# ---------------------------------------------------------------------------- can the service user read it?


@pytest.fixture
def open_base(searchable_tmp):
    return searchable_tmp


def closed_model(base: Path) -> tuple[Path, Path, Path]:
    """base/private (0700)/qwen3-omni-int4 holding a 0644 config.json and a 0600 model.safetensors, as a copy
    that kept the quantizer's modes leaves it. Returns (model dir, closed parent, unreadable file)."""
    parent = base / "private"
    model = parent / "qwen3-omni-int4"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}\n")
    weights = model / "model.safetensors"
    weights.write_bytes(b"w")
    weights.chmod(0o600)
    parent.chmod(0o700)
    return model, parent, weights


@pytest.fixture
def nobody():
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody' on this system")
    return "nobody"


@pytest.fixture
def reachable_python(monkeypatch, open_base, nobody) -> str:
    """Make the interpreter install-service puts in the unit one that `nobody` can run: this one when it can,
    else the system's (this one may live under /root, and the fix must not open that up)."""
    empty = open_base / "empty"
    empty.mkdir()
    for python in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(python, os.X_OK) and model_access_problems(empty, nobody, python) == []:
            monkeypatch.setattr(sys, "executable", python)
            empty.rmdir()
            return python
    pytest.skip("no Python interpreter that user nobody can run")


def test_cli_refuses_a_model_the_service_user_cannot_read(tmp_path, open_base, nobody, reachable_python):
    model, parent, weights = closed_model(open_base)
    root = tmp_path / "root"
    args = ["install-service", "--model-dir", str(model), "--root", str(root), "--user", nobody]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1
    assert f"{weights}: file not readable (needs o+r)" in result.output
    assert f"{parent}: directory not searchable (needs o+x)" in result.output
    assert f"chmod -R a+rX {model}" in result.output and f"chmod o+x {parent}" in result.output
    assert "--fix-permissions" in result.output
    assert not root.exists()  # refused before writing anything
    assert stat.S_IMODE(weights.stat().st_mode) == 0o600

    fixed = CliRunner().invoke(cli, [*args, "--fix-permissions"])
    assert fixed.exit_code == 0, fixed.output
    assert f"fix permissions: chmod -R a+rX {model}" in fixed.output
    assert model_access_problems(model, nobody, reachable_python) == []
    assert (root / "etc/systemd/system/qwen3-omni.service").is_file()
    assert CliRunner().invoke(cli, args).exit_code == 0  # nothing left to refuse


def test_cli_dry_run_shows_the_plan_then_fails_like_the_real_run(tmp_path, open_base, nobody, reachable_python):
    model, parent, weights = closed_model(open_base)
    root = tmp_path / "root"
    args = ["install-service", "--model-dir", str(model), "--root", str(root), "--user", nobody, "--dry-run"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1
    assert "would write" in result.output and f"chmod o+x {parent}" in result.output
    with_fix = CliRunner().invoke(cli, [*args, "--fix-permissions"])
    assert with_fix.exit_code == 0, with_fix.output
    assert f"would fix permissions: chmod o+x {parent}" in with_fix.output
    assert not root.exists()
    assert stat.S_IMODE(weights.stat().st_mode) == 0o600 and stat.S_IMODE(parent.stat().st_mode) == 0o700


def test_staging_for_a_user_that_does_not_exist_here_warns(tmp_path, open_base):
    """Under a --root other than / a missing user is created on the target, not by this run: its problems are a
    warning (checked as the system user useradd makes), not a refusal."""
    model, parent, _weights = closed_model(open_base)
    user = "orin-omni-absent"
    with pytest.raises(KeyError):
        pwd.getpwnam(user)
    lines: list[str] = []
    install(model, tmp_path / "root", lines, user=user)
    warning = next(line for line in lines if line.startswith("warning: on the target"))
    assert "only the 'other' permission bits count" in warning
    assert f"chmod o+x {parent}" in warning


def test_real_root_checks_a_missing_user_as_the_system_user_it_creates(open_base):
    """At --root / install-service creates the user (own group, no files): only the other bits count, and the
    problems refuse the install."""
    model, parent, weights = closed_model(open_base)
    cfg = InstallConfig(model_dir=str(model), user="orin-omni-absent", root="/")
    unit = UnitConfig(model_dir=str(model), exec_start=(sys.executable,), user=cfg.user)
    check = check_access(cfg, unit)
    assert check.enforced and check.new_user
    assert check.problems == tuple(access_problems(model, NEW_SYSTEM_USER, sys.executable))
    assert {AccessProblem(str(parent), "search", "o"), AccessProblem(str(weights), "read", "o")} <= set(check.problems)
    assert "or rerun with --fix-permissions" in check.message()


# ----------------------------------------------------------------------------------------------------- wheel


@pytest.mark.slow
def test_templates_ship_in_the_wheel(tmp_path):
    """Built and installed as a wheel, away from the checkout, orin finds its templates in orin/systemd_templates."""
    pytest.importorskip("hatchling", reason="building the wheel needs hatchling (the test extra)")
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for part in ("orin", "quantize", "systemd"):
        shutil.copytree(REPO / part, src / part, ignore=ignore)
    shutil.copy(REPO / "pyproject.toml", src)
    if (REPO / "README.md").exists():
        shutil.copy(REPO / "README.md", src)
    else:  # pyproject names a readme; until the checkout has one, the copy gets a placeholder
        (src / "README.md").write_text("orin-omni\n")
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(wheels), str(src)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    (wheel,) = wheels.glob("orin_omni-*.whl")
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target", str(target), str(wheel)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    probe = (
        "import orin, orin.service.unit as s; print(orin.__file__); print(s.template_dir()); "
        "print(s.render_unit(s.UnitConfig(model_dir='/srv/m', exec_start=('/usr/bin/orin-omni',))))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(target)}
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[0] == str(target / "orin" / "__init__.py")
    assert out[1] == str(target / "orin" / "systemd_templates")
    rendered = "\n".join(out[2:])
    assert (
        "Type=notify" in rendered
        and "ExecStart=/usr/bin/orin-omni serve --model-dir ${ORIN_OMNI_MODEL_DIR}" in rendered
    )
    assert rendered.rstrip("\n") == render_unit(
        UnitConfig(model_dir="/srv/m", exec_start=("/usr/bin/orin-omni",))
    ).rstrip("\n")
