"""`orin-omni doctor` on the quantized tiny model, with /sys (a fake INA3221 tree), /proc (a fake meminfo) and the
unit directory's root in tmp_path: every check's pass/fail/skip in a good setup and in broken ones."""

from __future__ import annotations

import ctypes
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

from orin.checks.cuda_driver import CudaCallError, CudaDriver, DriverUnavailable, open_driver
from orin.checks.doctor import DoctorConfig, render_table, run_doctor
from orin.checks.doctor_checks import FAIL, PASS, SKIP, TORCH_INSTALL, WARN, check_python, torch_install_hint
from orin.checks.doctor_memory import (
    check_host_register,
    check_l4t_release,
    check_largest_allocation,
    check_reservation,
)
from orin.checks.smoke import Check as SmokeCheck
from orin.checks.smoke import SmokeResult
from orin.checks.smoke import render_table as render_smoke
from orin.cli import cli
from orin.device.allocator_conf import AllocatorConf
from orin.device.profile import HOPPER, ORIN
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
    "allocator config": SKIP, "l4t release": SKIP, "vmm reservation": SKIP, "largest allocation": SKIP,
    "host register": SKIP, "service unit": PASS, "service enabled": PASS, "service active": SKIP,
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


# ------------------------------------------------------------------ the memory probes (issue 37)

MiB = 1 << 20
NO_ALLOCATOR = AllocatorConf()


class BoardDriver(CudaDriver):
    """A board's CUDA driver, as the probes see it: grants or refuses as it is told (a reservation or allocation
    over a limit fails with CUDA_ERROR_OUT_OF_MEMORY, as Tegra's does), and remembers what is still held."""

    name = "Orin (stand-in)"

    def __init__(self, *, vmm=True, host_register=True, register_error=False, max_reservation=None,
                 max_allocation=None, reservations=None, granularity=2 * MiB):
        self.vmm, self.host_register_ok, self.register_error = vmm, host_register, register_error
        self.reservations = reservations  # how many reservations it grants at once (None: any)
        self.max_reservation, self.max_allocation, self.gran = max_reservation, max_allocation, granularity
        self.reserved, self.created, self.allocated, self.registered = {}, set(), {}, {}
        self.calls, self.closed, self._next = [], False, 1 << 40
        self.registered_bytes = b""

    def _oom(self, call, size, limit):
        self.calls.append((call, size))
        if limit is not None and size > limit:
            raise CudaCallError(call, 2, "CUDA_ERROR_OUT_OF_MEMORY")
        self._next += size
        return self._next

    def attribute(self, attribute):
        return {99: int(self.host_register_ok), 102: int(self.vmm)}[attribute]

    def granularity(self):
        return self.gran

    def reserve(self, size):
        if size % self.gran:
            raise CudaCallError("cuMemAddressReserve", 1, "CUDA_ERROR_INVALID_VALUE")
        if self.reservations is not None and len(self.reserved) >= self.reservations:
            raise CudaCallError("cuMemAddressReserve", 2, "CUDA_ERROR_OUT_OF_MEMORY")
        ptr = self._oom("cuMemAddressReserve", size, self.max_reservation)
        self.reserved[ptr] = size
        return ptr

    def free_addresses(self, ptr, size):
        assert self.reserved.pop(ptr) == size

    def create(self, size):
        handle = self._oom("cuMemCreate", size, self.max_allocation)
        self.created.add(handle)
        return handle

    def release(self, handle):
        self.created.remove(handle)

    def alloc(self, size):
        ptr = self._oom("cuMemAlloc", size, self.max_allocation)
        self.allocated[ptr] = size
        return ptr

    def free(self, ptr):
        del self.allocated[ptr]

    def host_register(self, ptr, size):
        self.registered_bytes = ctypes.string_at(ptr, 8)  # what the device would see: the file's own bytes
        if self.register_error:
            raise CudaCallError("cuMemHostRegister_v2", 801, "CUDA_ERROR_NOT_SUPPORTED")
        self.registered[ptr] = size

    def host_unregister(self, ptr):
        del self.registered[ptr]

    def close(self):
        self.closed = True

    def holds_nothing(self) -> bool:
        return not (self.reserved or self.created or self.allocated or self.registered)


def jetson_board(tmp_path: Path, release: str = "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, "
                 "EABI: aarch64, DATE: Wed Jan  8 01:49:37 UTC 2025") -> dict:
    roots = board(tmp_path)
    (Path(roots["root"]) / "etc").mkdir()
    (Path(roots["root"]) / "etc/nv_tegra_release").write_text(release + "\n")
    return roots


def test_memory_probes_pass_on_a_board_that_grants_them(quantized_dir, tmp_path):
    driver = BoardDriver()
    result = run_doctor(DoctorConfig(model_dir=quantized_dir, user=ME, allocator=NO_ALLOCATOR, **jetson_board(tmp_path)),
                        cuda_driver=lambda: driver)
    got = statuses(result)
    assert [got[n] for n in ("allocator config", "l4t release", "vmm reservation", "largest allocation",
                             "host register")] == [PASS] * 5, render_table(result)
    assert result.profile is ORIN  # a Jetson whose torch sees no GPU is still planned as an Orin
    # 24 GiB budget + the Orin's 4 GiB headroom, in pieces of at most its 4 GiB, all held at once, then freed.
    assert [c for c in driver.calls if c[0] == "cuMemAddressReserve"] == [("cuMemAddressReserve", 4 << 30)] * 7
    assert "reserved 28.00 GiB" in result.check("vmm reservation").detail
    assert ("cuMemCreate", 1 << 30) in driver.calls and ("cuMemAlloc", 1 << 30) in driver.calls
    assert "max_allocation_bytes" in result.check("largest allocation").detail
    shard = sorted(Path(quantized_dir).rglob("*.safetensors"))[0]
    assert str(shard) in result.check("host register").detail
    assert driver.registered_bytes == shard.read_bytes()[:8]  # the mapping is the file's
    assert driver.holds_nothing() and driver.closed and "R36.4.3" in result.check("l4t release").detail


def test_a_board_that_refuses_large_pieces_warns_and_fails_with_the_fixes(quantized_dir, tmp_path):
    driver = BoardDriver(max_reservation=2 << 30, max_allocation=512 * MiB)
    result = run_doctor(DoctorConfig(model_dir=quantized_dir, user=ME, allocator=NO_ALLOCATOR,
                                     **jetson_board(tmp_path, "# R36 (release), REVISION: 4.7, GCID: 1")),
                        cuda_driver=lambda: driver)
    reservation, largest = result.check("vmm reservation"), result.check("largest allocation")
    assert reservation.status == WARN and "piece 1 failed after 0 B" in reservation.detail
    assert "CUDA_ERROR_OUT_OF_MEMORY" in reservation.detail and "reboot" in reservation.fix
    assert largest.status == FAIL and "1.00 GiB" in largest.detail and "reboot the board" in largest.fix
    release = result.check("l4t release")
    assert release.status == WARN and "CVE-2025-33177" in release.detail and "1.00 GiB" in release.fix
    assert not result.ok and driver.holds_nothing()
    table = render_table(result)
    assert f"fix: {reservation.fix}" in table and f"fix: {release.fix}" in table  # warnings print their fix too
    assert "warned" in table.splitlines()[-1]


def test_each_driver_probe_alone():
    memory = ORIN.memory
    # A reservation that fails part way gives back what it got.
    driver = BoardDriver(reservations=3)
    check = check_reservation(driver, memory, 24 << 30)
    assert check.status == WARN and "piece 4 failed after 12.00 GiB" in check.detail and driver.holds_nothing()
    # No virtual memory management: a warning; the largest allocation is then tried as cudaMalloc alone.
    driver = BoardDriver(vmm=False)
    assert check_reservation(driver, memory, 24 << 30).status == WARN
    check = check_largest_allocation(driver, memory, None)
    assert check.status == PASS and [c[0] for c in driver.calls] == ["cuMemAlloc"]
    # Hopper: no headroom, no piece size: one reservation of budget x 2 + 256 MiB; the plan's largest is the size.
    driver = BoardDriver()
    assert check_reservation(driver, HOPPER.memory, 8 << 30).status == PASS
    assert driver.calls == [("cuMemAddressReserve", (16 << 30) + 256 * MiB)]
    assert check_largest_allocation(BoardDriver(), HOPPER.memory, None).status == SKIP
    check = check_largest_allocation(driver, HOPPER.memory, (3 * MiB, "thinker's KV cache"))
    assert check.status == PASS and "the plan's largest single allocation, the thinker's KV cache" in check.detail
    assert ("cuMemCreate", 4 * MiB) in driver.calls and ("cuMemAlloc", 3 * MiB) in driver.calls


def test_host_registration_probe(tmp_path):
    scratch = str(tmp_path)
    driver = BoardDriver()
    check = check_host_register(driver, None, scratch)  # no checkpoint: a temporary file, removed after
    assert check.status == PASS and "a temporary file" in check.detail and not list(tmp_path.iterdir())
    assert driver.registered_bytes == bytes(8) and driver.holds_nothing()
    check = check_host_register(BoardDriver(host_register=False), None, scratch)
    assert check.status == WARN and "cudaDevAttrHostRegisterSupported is 0" in check.detail and check.fix
    check = check_host_register(BoardDriver(register_error=True), None, scratch)
    assert check.status == WARN and "CUDA_ERROR_NOT_SUPPORTED" in check.detail


def test_without_a_driver_the_probes_say_why(quantized_dir, tmp_path):
    def no_driver():
        raise DriverUnavailable("no CUDA driver library (libcuda.so.1: not found)")

    roots = board(tmp_path)
    result = run_doctor(DoctorConfig(model_dir=quantized_dir, user=ME, allocator=NO_ALLOCATOR, **roots),
                        cuda_driver=no_driver)
    for name in ("vmm reservation", "largest allocation", "host register"):
        assert result.check(name).status == SKIP and "libcuda.so.1" in result.check(name).detail
    assert result.check("l4t release").status == SKIP and "not a Jetson" in result.check("l4t release").detail
    assert result.ok
    # This machine's own driver: there or not, opening it never raises anything else.
    try:
        open_driver().close()
    except DriverUnavailable as exc:
        assert "CUDA" in str(exc)


@pytest.mark.parametrize("text, status, shown", [
    ("# R36 (release), REVISION: 4.3, GCID: 1, BOARD: generic, EABI: aarch64", PASS, "R36.4.3"),
    ("# R35 (release), REVISION: 6.0, GCID: 1", PASS, "R35.6.0"),
    ("# R36 (release), REVISION: 4.7, GCID: 42, BOARD: generic, EABI: aarch64, DATE: x", WARN, "R36.4.7"),
    ("# R36 (release), REVISION: 5.0, GCID: 1", WARN, "R36.5.0"),
    ("# R38 (release), REVISION: 2.1, GCID: 1", WARN, "R38.2.1"),
    ("# R39 (release), REVISION: 2, GCID: 1", WARN, "R39.2.0"),
    ("garbage", WARN, "names no release"),
])
def test_the_l4t_release_against_the_nvmap_change(tmp_path, text, status, shown):
    path = tmp_path / "nv_tegra_release"
    path.write_text(text + "\n")
    check = check_l4t_release(path, 1 << 30)
    assert check.status == status and shown in check.detail, check
    if status == WARN and "R3" in shown:
        assert "NvMapMemAllocInternalTagged" in check.detail and "reboot" in check.fix
    assert check_l4t_release(tmp_path / "absent", None).status == SKIP


def test_expandable_segments_fail_on_a_jetson_wherever_they_are_set(quantized_dir, tmp_path):
    roots = jetson_board(tmp_path)
    install(quantized_dir, roots["root"])
    expandable = AllocatorConf.from_environ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    result = run_doctor(DoctorConfig(allocator=expandable, **roots), cuda_driver=BoardDriver)
    check = result.check("allocator config")
    assert check.status == FAIL and "this shell: PYTORCH_CUDA_ALLOC_CONF='expandable_segments:True'" in check.detail
    assert check.fix == "unset PYTORCH_CUDA_ALLOC_CONF" and not result.ok
    # The service's environment: the environment file (or a drop-in) counts, and the fix names where to look.
    env_file = Path(roots["root"]) / "etc/orin-omni/qwen3-omni.env"
    env_file.write_text(env_file.read_text() + "PYTORCH_ALLOC_CONF=max_split_size_mb:64,expandable_segments:True\n")
    check = run_doctor(DoctorConfig(allocator=NO_ALLOCATOR, **roots), cuda_driver=BoardDriver).check("allocator config")
    assert check.status == FAIL and check.detail.startswith("the qwen3-omni service: PYTORCH_ALLOC_CONF=")
    assert "/etc/orin-omni/qwen3-omni.env" in check.fix and "systemctl restart qwen3-omni" in check.fix
    env_file.write_text(env_file.read_text().replace("expandable_segments:True", "expandable_segments:False"))
    drop_in = Path(roots["root"]) / "etc/systemd/system/qwen3-omni.service.d/alloc.conf"
    drop_in.parent.mkdir()
    drop_in.write_text('[Service]\nEnvironment="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"\n')
    assert run_doctor(DoctorConfig(allocator=NO_ALLOCATOR, **roots),
                      cuda_driver=BoardDriver).check("allocator config").status == FAIL
    drop_in.unlink()
    assert run_doctor(DoctorConfig(allocator=NO_ALLOCATOR, **roots),
                      cuda_driver=BoardDriver).check("allocator config").status == PASS
    # Not a Jetson: a discrete GPU runs expandable segments, so nothing to check.
    (tmp_path / "x").mkdir()
    other = run_doctor(DoctorConfig(allocator=expandable, device="cpu", **board(tmp_path / "x")))
    assert other.check("allocator config").status == SKIP and "not a Tegra device" in other.check("allocator config").detail


class FakeLibCuda:
    """libcuda.so.1's functions by their exported names, over ctypes arguments as LibCuda passes them: outputs
    written through byref, calls recorded, and one call made to fail with CUDA_ERROR_OUT_OF_MEMORY."""

    def __init__(self, fail: str = ""):
        self.calls, self.fail, self.context = [], fail, 0

    def __getattr__(self, name):
        outputs = {"cuDeviceGet": 0, "cuDevicePrimaryCtxRetain": 0xC0, "cuDeviceGetAttribute": 1,
                   "cuMemGetAllocationGranularity": 2 * MiB, "cuMemAddressReserve": 1 << 40, "cuMemCreate": 7,
                   "cuMemAlloc_v2": 1 << 41}
        names = {*outputs, "cuInit", "cuDeviceGetName", "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2",
                 "cuDevicePrimaryCtxRelease_v2", "cuMemAddressFree", "cuMemRelease", "cuMemFree_v2",
                 "cuMemHostRegister_v2", "cuMemHostUnregister", "cuGetErrorName"}
        if name not in names:
            raise AttributeError(name)

        def call(*args):
            self.calls.append((name, [getattr(a, "value", a) for a in args]))
            if name == "cuGetErrorName":
                args[1]._obj.value = b"CUDA_ERROR_OUT_OF_MEMORY"
                return 0
            if name == self.fail:
                return 2
            if name in outputs:
                args[0]._obj.value = outputs[name]
            if name == "cuDeviceGetName":
                ctypes.memmove(args[0], b"Orin\0", 5)
            return 0

        return call


def test_the_ctypes_driver_calls_libcuda_by_its_exported_names():
    from orin.checks.cuda_driver import LibCuda

    lib = FakeLibCuda()
    driver = LibCuda(lib)
    assert driver.name == "Orin" and driver.attribute(102) == 1 and driver.granularity() == 2 * MiB
    ptr = driver.reserve(4 << 30)
    driver.free_addresses(ptr, 4 << 30)
    driver.release(driver.create(1 << 30))
    driver.free(driver.alloc(1 << 30))
    driver.host_register(0x1000, 4096)
    driver.host_unregister(0x1000)
    driver.close()
    called = [name for name, _ in lib.calls]
    assert called[:5] == ["cuInit", "cuDeviceGet", "cuDeviceGetName", "cuDevicePrimaryCtxRetain",
                          "cuCtxPushCurrent_v2"]
    assert called[-2:] == ["cuCtxPopCurrent_v2", "cuDevicePrimaryCtxRelease_v2"]
    assert dict(lib.calls)["cuMemAddressReserve"][1] == 4 << 30 and dict(lib.calls)["cuMemRelease"] == [7]
    assert dict(lib.calls)["cuMemHostRegister_v2"][:2] == [0x1000, 4096]
    # A refusal comes back as CudaCallError with the driver's name for it; the probe reports it.
    driver = LibCuda(FakeLibCuda(fail="cuMemAddressReserve"))
    with pytest.raises(CudaCallError, match="cuMemAddressReserve failed: CUDA_ERROR_OUT_OF_MEMORY"):
        driver.reserve(4 << 30)
    assert check_reservation(driver, ORIN.memory, 8 << 30).status == WARN
