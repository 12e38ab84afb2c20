"""`orin-omni doctor` on the quantized tiny model, with /sys (a fake INA3221 tree), /proc (a fake meminfo) and the
unit directory's root in tmp_path: every check's pass/fail/skip in a good setup and in broken ones."""

from __future__ import annotations

import json
import os
import pwd
import shlex
import shutil
import stat
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_power import AGX_ORIN, make_hwmon_tree

from orin.checks.doctor import DoctorConfig, render_table, run_doctor
from orin.checks.doctor_checks import FAIL, PASS, SKIP, TORCH_INSTALL, check_python, torch_install_hint
from orin.checks.smoke import Check as SmokeCheck
from orin.checks.smoke import SmokeResult
from orin.checks.smoke import render_table as render_smoke
from orin.cli import cli
from orin.errors import UsageError
from orin.service.install import InstallConfig, install_service
from orin.units import parse_bytes

GiB = 1 << 30
ME = pwd.getpwuid(os.getuid()).pw_name


@pytest.fixture(autouse=True)
def _any_free_disk_will_do(monkeypatch):
    """The disk check reads the real filesystem of tmp_path, whose free space is the test machine's: the checks
    below judge the rest; test_a_full_disk_fails_the_disk_check judges this one."""
    from orin.checks import doctor_checks

    monkeypatch.setattr(doctor_checks, "DISK_MIN_FREE", 0)


def write_meminfo(proc: Path, total: int, available: int) -> Path:
    proc.mkdir(parents=True, exist_ok=True)
    (proc / "meminfo").write_text(f"MemTotal:       {total // 1024} kB\nMemFree:        {available // 2048} kB\n"
                                  f"MemAvailable:   {available // 1024} kB\nBuffers:          1024 kB\n")
    return proc


def board(tmp_path: Path, *, ina3221: bool = True, available: int = 60 * GiB) -> dict:
    """The roots of a fake board: sysfs (with or without the AGX Orin's INA3221 monitors), proc, the unit root."""
    sysfs = tmp_path / "sys"
    if ina3221:
        make_hwmon_tree(sysfs, AGX_ORIN)
    else:
        sysfs.mkdir()
    proc = write_meminfo(tmp_path / "proc", 64 * GiB, available)
    root = tmp_path / "root"
    root.mkdir()
    return {"sysfs_root": str(sysfs), "proc_root": str(proc), "root": str(root),
            "jtop_socket": str(tmp_path / "no-jtop.sock")}


def install(model_dir: str, root: str, enable: bool = True) -> None:
    """install-service into the staging root, and the symlink `systemctl enable` makes there."""
    install_service(InstallConfig(model_dir=model_dir, root=root, user=ME))
    if enable:
        wants = Path(root) / "etc/systemd/system/multi-user.target.wants"
        wants.mkdir(parents=True)
        (wants / "qwen3-omni.service").symlink_to("/etc/systemd/system/qwen3-omni.service")


def statuses(result) -> dict[str, str]:
    return {c.name: c.status for c in result.checks}


def corrupt_copy(quantized_dir: str, dest: Path) -> str:
    """A copy of the checkpoint with one byte of the thinker's shard changed (same size); its path."""
    from orin.checkpoint.manifest import read_manifest

    shutil.copytree(quantized_dir, dest)
    shard = read_manifest(dest).segments["thinker"].files[0].path
    victim = dest / shard
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    return shard


GOOD = {
    "python": PASS, "torch": PASS, "cuda": SKIP, "int4 kernel": PASS, "triton": SKIP, "cuda graph": SKIP,
    "nvpmodel": SKIP, "power: jtop": SKIP, "power: ina3221": PASS, "power": PASS,
    "model dir": PASS, "checksums": PASS, "memory": PASS, "disk": PASS, "model access": PASS,
    "service unit": PASS, "service enabled": PASS, "service active": SKIP,
}


def test_good_setup_passes_and_reads_the_installed_unit(quantized_dir, tmp_path):
    roots = board(tmp_path)
    install(quantized_dir, roots["root"])
    # No --model-dir, --user or --budget: the installed unit's are used.
    result = run_doctor(DoctorConfig(device="cpu", **roots))
    got = statuses(result)
    nvml = got.pop("power: nvml")
    assert got == GOOD, render_table(result)
    assert nvml in (PASS, SKIP)  # PASS only where an NVIDIA driver is present
    assert result.ok
    assert result.model_dir == str(Path(quantized_dir).resolve()) and result.user == ME and result.budget == 24 * GiB
    assert "from qwen3-omni.env" in result.check("model dir").detail
    assert "_weight_int4pack_mm_for_cpu" in result.check("int4 kernel").detail
    assert "VDD_GPU_SOC" in result.check("power: ina3221").detail
    assert "ina3221" in result.check("power").detail
    assert "all-resident" in result.check("memory").detail
    assert "as install-service wrote it" in result.check("service unit").detail
    assert "--device cpu" in result.check("cuda").detail
    # The rendered table has a line per check and the total.
    table = render_table(result)
    assert table.splitlines()[-1].startswith("OK: ") and "fix:" not in table


def test_broken_setup_fails_with_the_fixes(quantized_dir, tmp_path):
    roots = board(tmp_path, ina3221=False, available=4 << 20)  # under the tiny request's CPU peak (~14 MiB)
    model = tmp_path / "model"
    bad_file = corrupt_copy(quantized_dir, model)
    result = run_doctor(DoctorConfig(model_dir=str(model), user=ME, device="cpu", **roots))
    got = statuses(result)
    assert not result.ok, render_table(result)
    assert got["checksums"] == FAIL and bad_file in result.check("checksums").detail
    assert "1 of" in result.check("checksums").detail and "rsync" in result.check("checksums").fix
    # No INA3221 tree and not a Jetson (no /etc/nv_tegra_release under the root): energy is skipped, not failed.
    assert got["power: ina3221"] == SKIP and "no INA3221 power monitor" in result.check("power: ina3221").detail
    assert got["power"] == SKIP
    assert got["memory"] == FAIL and "available now" in result.check("memory").detail
    # Nothing installed yet: the unit checks say so and how, without failing.
    unit = result.check("service unit")
    assert unit.status == SKIP
    assert unit.fix == f"orin-omni install-service --model-dir {model} --user {ME} --root {roots['root']}"
    assert f"no unit installed yet ({roots['root']}/etc/systemd/system/qwen3-omni.service): run `{unit.fix}`" \
        in render_table(result)
    assert got["service enabled"] == got["service active"] == SKIP
    # What does not depend on the setup still passes.
    assert got["int4 kernel"] == PASS and got["model dir"] == PASS and got["model access"] == PASS


def test_a_budget_the_request_cannot_fit_fails_the_memory_check(quantized_dir, tmp_path):
    roots = board(tmp_path)
    result = run_doctor(DoctorConfig(model_dir=quantized_dir, user=ME, device="cpu", budget=1 << 20, **roots))
    memory = result.check("memory")
    assert memory.status == FAIL and "does not fit" in memory.detail and "raise --budget to at least" in memory.fix
    # The plan command the fix names sizes what doctor sized: the same verdict, word for word.
    command = memory.fix.split("`")[1]
    assert command == f"orin-omni plan {quantized_dir} --budget 1MiB --device-profile cpu"
    shown = CliRunner().invoke(cli, shlex.split(command)[1:])
    assert shown.exit_code == 0, shown.output
    assert memory.detail.split(": ", 1)[1] in shown.output
    # ... and the budget it says to raise to is enough.
    least = memory.fix.split("at least ")[1].split(" ")[0]
    result = run_doctor(DoctorConfig(model_dir=quantized_dir, user=ME, device="cpu", budget=parse_bytes(least),
                                     **roots))
    assert result.check("memory").status == PASS, render_table(result)


def test_enabled_comes_from_the_wants_symlink_off_the_live_system(quantized_dir, tmp_path):
    roots = board(tmp_path)
    install(quantized_dir, roots["root"], enable=False)
    result = run_doctor(DoctorConfig(device="cpu", **roots))
    enabled = result.check("service enabled")
    # A staged unit is not enabled (install-service enables only where systemd runs), and that is no fault.
    assert enabled.status == SKIP and "install-service did not enable it" in enabled.detail
    assert "--root is" in enabled.detail and "--root is" in result.check("service active").detail
    assert result.ok, render_table(result)


def test_model_access_for_a_missing_and_a_shut_out_user(quantized_dir, tmp_path):
    roots = board(tmp_path)
    result = run_doctor(DoctorConfig(model_dir=quantized_dir, user="no-such-user-x", device="cpu", **roots))
    access = result.check("model access")
    assert access.status == SKIP and "install-service creates it" in access.detail
    assert [c.name for c in result.checks if c.status == FAIL] == []  # nothing installed here is no failure

    try:
        pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody' here")
    if ME == "nobody":
        pytest.skip("running as nobody")
    model = tmp_path / "closed"
    shutil.copytree(quantized_dir, model)
    os.chmod(model, 0o700)
    result = run_doctor(DoctorConfig(model_dir=str(model), user="nobody", device="cpu", **roots))
    access = result.check("model access")
    assert access.status == FAIL and "user nobody" in access.detail
    assert access.fix.startswith("sudo chmod ") and not result.ok


def test_an_unusable_model_dir_skips_the_checks_that_need_it(tmp_path):
    roots = board(tmp_path)
    result = run_doctor(DoctorConfig(model_dir=str(tmp_path / "absent"), user=ME, device="cpu", **roots))
    got = statuses(result)
    assert got["model dir"] == FAIL and "not a directory" in result.check("model dir").detail
    assert got["checksums"] == got["disk"] == got["model access"] == got["memory"] == SKIP
    assert "64.00 GiB" in result.check("memory").detail
    # Nothing installed and no --model-dir: the model checks are skipped with the reason.
    result = run_doctor(DoctorConfig(device="cpu", **roots))
    assert result.check("model dir").status == SKIP and "no --model-dir" in result.check("model dir").detail


def test_a_full_disk_fails_the_disk_check(quantized_dir, tmp_path, monkeypatch):
    from orin.checks import doctor_checks

    monkeypatch.setattr(doctor_checks, "DISK_MIN_FREE", shutil.disk_usage(quantized_dir).total)
    result = run_doctor(DoctorConfig(device="cpu", model_dir=quantized_dir, **board(tmp_path)))
    disk = result.check("disk")
    assert disk.status == FAIL and "free of" in disk.detail and "journalctl" in disk.fix, render_table(result)
    assert not result.ok


def test_a_jetson_without_power_backends_fails_and_reads_nvpmodel(quantized_dir, tmp_path):
    roots = board(tmp_path, ina3221=False)
    root = Path(roots["root"])
    (root / "etc").mkdir()
    (root / "etc/nv_tegra_release").write_text("# R36 (release), REVISION: 4.3, GCID: 0, BOARD: generic\n")
    result = run_doctor(DoctorConfig(model_dir=quantized_dir, user=ME, device="cpu", **roots))
    assert result.check("power").status == FAIL and "systemctl start jtop" in result.check("power").fix
    assert result.check("nvpmodel").status == FAIL and "nvidia-l4t-tools" in result.check("nvpmodel").fix

    # nvpmodel as L4T installs it; its `-q` output is two lines, the mode's name and its number.
    tool = root / "usr/sbin/nvpmodel"
    tool.parent.mkdir(parents=True)
    tool.write_text("#!/bin/sh\n[ \"$1\" = -q ] || exit 2\necho 'NV Power Mode: 30W'\necho 2\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    result = run_doctor(DoctorConfig(model_dir=quantized_dir, user=ME, device="cpu", **roots))
    nvpmodel = result.check("nvpmodel")
    assert nvpmodel.status == PASS and nvpmodel.detail.startswith("30W (mode 2): not MAXN")


def test_versions_and_install_hints():
    assert check_python((3, 10, 12)).status == PASS and check_python((3, 13, 0)).status == PASS
    for old_or_new in ((3, 9, 18), (3, 14, 0)):
        check = check_python(old_or_new)
        assert check.status == FAIL and "3.10 to 3.13" in check.detail
    assert torch_install_hint("R36") == TORCH_INSTALL["jetpack6"] and "jetson-ai-lab" in torch_install_hint("R36")
    assert torch_install_hint("R38") == TORCH_INSTALL["jetpack7"]
    assert TORCH_INSTALL["jetpack6"] in torch_install_hint(None) and TORCH_INSTALL["jetpack7"] in torch_install_hint(None)
    with pytest.raises(UsageError, match="--device"):
        DoctorConfig(device="gpu")


def test_cuda_asked_for_on_a_machine_without_it_fails(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    roots = board(tmp_path)
    result = run_doctor(DoctorConfig(device="cuda", **roots))
    got = statuses(result)
    assert got["cuda"] == FAIL and "--device cuda" in result.check("cuda").detail
    assert got["int4 kernel"] == got["cuda graph"] == SKIP
    # auto: the GPU checks are skipped, the INT4 kernel runs on the CPU.
    result = run_doctor(DoctorConfig(device="auto", **roots))
    assert result.check("cuda").status == SKIP and result.check("int4 kernel").status == PASS


def test_cli_exit_code_and_json(quantized_dir, tmp_path):
    roots = board(tmp_path)
    args = ["doctor", "--device", "cpu", "--sysfs-root", roots["sysfs_root"], "--proc-root", roots["proc_root"],
            "--root", roots["root"], "--user", ME]
    # Not installed: the unit check is skipped with the command that installs it; a budget too small fails, exit 1.
    fresh = CliRunner().invoke(cli, [*args, "--model-dir", quantized_dir])
    assert fresh.exit_code == 0, fresh.output
    assert "no unit installed yet" in fresh.output and "run `orin-omni install-service" in fresh.output
    bad = CliRunner().invoke(cli, [*args, "--model-dir", quantized_dir, "--budget", "1MiB"])
    assert bad.exit_code == 1 and "fix: raise --budget" in bad.output, bad.output
    data = json.loads(CliRunner().invoke(cli, [*args, "--model-dir", quantized_dir, "--json"]).output)
    assert data["ok"] is True and data["model_dir"] == quantized_dir
    assert {c["name"]: c["status"] for c in data["checks"]}["service unit"] == SKIP
    assert all(set(c) == {"name", "status", "detail", "fix"} for c in data["checks"])

    install(quantized_dir, roots["root"])
    good = CliRunner().invoke(cli, [*args, "--budget", "2GiB"])
    assert good.exit_code == 0, good.output
    assert "budget 2.00 GiB" in good.output and good.output.splitlines()[-1].startswith("OK:")
    usage = CliRunner().invoke(cli, [*args, "--budget", "2GB"])
    assert usage.exit_code == 2 and "2GB" in usage.output


def test_a_failed_smoke_test_points_to_doctor():
    failed = (SmokeCheck("text: answer", FAIL, "empty text"),)
    by_url = render_smoke(SmokeResult(target="http://127.0.0.1:8000", checks=failed))
    assert by_url.splitlines()[-1] == "run `orin-omni doctor` to check the board"
    in_process = render_smoke(SmokeResult(target="/opt/models/q", checks=failed))
    assert in_process.splitlines()[-1] == "run `orin-omni doctor --model-dir /opt/models/q` to check the board"
    passed = render_smoke(SmokeResult(target="/opt/models/q", checks=(SmokeCheck("text: answer", PASS, "ok"),)))
    assert "doctor" not in passed


def _parse(command: str):
    """The orin-omni command in a printed fix, parsed as the CLI would (unknown options and bad values raise)."""
    argv = shlex.split(command)
    if argv[0] == "sudo":
        argv = argv[1:]
        assert Path(argv[0]).name == "orin-omni" and (argv[0] == "orin-omni" or Path(argv[0]).is_file()), argv[0]
    else:
        assert argv[0] == "orin-omni"
    return cli.commands[argv[1]].make_context(argv[1], argv[2:])


def test_the_printed_install_command_works(quantized_dir, tmp_path):
    roots = board(tmp_path)
    result = run_doctor(DoctorConfig(model_dir=quantized_dir, user=ME, budget=2 * GiB, device="cpu", **roots))
    command = result.check("service unit").fix
    ctx = _parse(command)
    assert (ctx.params["model_dir"], ctx.params["user"], ctx.params["budget"], ctx.params["root"]) == (
        quantized_dir, ME, 2 * GiB, roots["root"])
    # Off the live system it needs no privileges: run it (dry), and doctor then finds what it would install.
    dry = CliRunner().invoke(cli, [*shlex.split(command)[1:], "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert CliRunner().invoke(cli, shlex.split(command)[1:], catch_exceptions=False).exit_code == 0
    assert run_doctor(DoctorConfig(device="cpu", **roots)).check("service unit").status == PASS

    # At /: sudo, with the program by its path (sudo's PATH leaves a venv out), and no --root.
    live = run_doctor(DoctorConfig(model_dir=quantized_dir, name="orin-omni-doctor-test-none", device="cpu",
                                   **{**roots, "root": "/"}))
    unit = live.check("service unit")
    assert unit.status == SKIP and unit.fix.startswith("sudo ") and f"run `{unit.fix}`" in unit.detail
    ctx = _parse(unit.fix)
    assert ctx.params["name"] == "orin-omni-doctor-test-none" and ctx.params["root"] == "/"


def test_a_model_under_tmp_gets_the_same_status_however_doctor_is_run(quantized_dir, tmp_path):
    """Under /tmp a model serves by hand but not as the service: a warning, the same with --model-dir on the live
    system and with a staging --root."""
    import tempfile

    roots = board(tmp_path)
    with tempfile.TemporaryDirectory(dir="/tmp") as scratch:
        model = Path(scratch) / "model"
        shutil.copytree(quantized_dir, model)
        live = run_doctor(DoctorConfig(model_dir=str(model), name="orin-omni-doctor-test-none", device="cpu",
                                       **{**roots, "root": "/"})).check("model dir")
        staged = run_doctor(DoctorConfig(model_dir=str(model), device="cpu", **roots)).check("model dir")
    assert live.status == staged.status == PASS
    real = os.path.realpath(model)
    for check in (live, staged):
        assert f"warning: {real} is under /tmp" in check.detail
        assert f"sudo mkdir -p /opt/models && sudo mv {real} /opt/models/" in check.detail
