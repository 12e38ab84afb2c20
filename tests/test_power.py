"""Power backends, the sampler's fallback chain and energy integration, on fake sysfs trees and fake clocks."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from click.testing import CliRunner

from orin.cli import cli
from orin.errors import PowerError, UsageError
from orin.power.meter import (
    Energy,
    Ina3221Backend,
    JtopBackend,
    NullBackend,
    NvmlBackend,
    PowerConfig,
    PowerMeter,
    PowerProbeConfig,
    PowerReading,
    PowerSample,
    backend_chain,
    combine,
    find_ina3221_rails,
    integrate,
    open_backend,
    probe_power,
    render_report,
)

# ------------------------------------------------------------------------------------------- fake sysfs trees

# AGX Orin: two INA3221, rails summed for the total. Values (mV, mA).
AGX_ORIN = {
    "1-0040": {1: ("VDD_GPU_SOC", 5000, 1200), 2: ("VDD_CPU_CV", 5000, 400), 3: ("VIN_SYS_5V0", 5000, 900)},
    "1-0041": {1: ("VDDQ_VDD2_1V8AO", 5000, 150), 2: ("NC", 0, 0), 3: ("NC", 0, 0)},
}
# Orin NX: VDD_IN is the board input, so it is the total and not a rail.
ORIN_NX = {"1-0040": {1: ("VDD_IN", 5000, 1400), 2: ("VDD_CPU_GPU_CV", 5000, 500), 3: ("VDD_SOC", 5000, 300)}}


def write(path: Path, text) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{text}\n")


def make_hwmon_tree(root: Path, boards: dict) -> Path:
    """A JetPack 5 sysfs layout. Devices are symlinks into /sys/devices as on a real board; channel 7 carries the
    'sum of shunt voltages' and unlabelled shunt channels exist, both of which must be ignored."""
    devices = root / "bus" / "i2c" / "devices"
    devices.mkdir(parents=True)
    write(root / "devices" / "platform" / "i2c-1" / "1-0050" / "name", "24c02")  # an EEPROM: not a power monitor
    os.symlink(root / "devices" / "platform" / "i2c-1" / "1-0050", devices / "1-0050")
    for n, (dev, channels) in enumerate(boards.items(), start=1):
        real = root / "devices" / "platform" / "i2c-1" / dev
        write(real / "name", "ina3221")
        hwmon = real / "hwmon" / f"hwmon{n}"
        write(hwmon / "name", "ina3221")
        for ch, (label, mv, ma) in channels.items():
            write(hwmon / f"in{ch}_label", label)
            write(hwmon / f"in{ch}_input", mv)
            write(hwmon / f"curr{ch}_input", ma)
            write(hwmon / f"curr{ch}_max", 32760)
            write(hwmon / f"curr{ch}_crit", 40000)
            write(hwmon / f"in{ch + 3}_input", 12)  # shunt voltage, no label
        write(hwmon / "in7_label", "sum of shunt voltages")
        write(hwmon / "in7_input", 80)
        os.symlink(real, devices / dev)
    return root


def make_iio_tree(root: Path) -> Path:
    """A JetPack 4 layout (Xavier): iio:device with rail_name_N and in_powerN_input in mW."""
    dev = root / "bus" / "i2c" / "devices" / "1-0040"
    write(dev / "name", "ina3221x")
    iio = dev / "iio:device0"
    for ch, (name, mv, ma, mw) in enumerate([("GPU", 19000, 100, 1900), ("CPU", 19000, 50, 950), ("SOC", 19000, 80, 1520)]):
        write(iio / f"rail_name_{ch}", name)
        write(iio / f"in_voltage{ch}_input", mv)
        write(iio / f"in_current{ch}_input", ma)
        write(iio / f"in_power{ch}_input", mw)
    return root


def set_rail(root: Path, dev: str, ch: int, mv: int, ma: int) -> None:
    hwmon = next((root / "bus" / "i2c" / "devices" / dev / "hwmon").iterdir())
    (hwmon / f"in{ch}_input").write_text(f"{mv}\n")
    (hwmon / f"curr{ch}_input").write_text(f"{ma}\n")


def expected(boards: dict) -> dict[str, float]:
    return {label: mv * ma / 1e6 for chans in boards.values() for label, mv, ma in chans.values() if label != "NC"}


# ------------------------------------------------------------------------------------------- ina3221


def test_ina3221_reads_each_rail_in_watts_and_sums_the_total(tmp_path):
    root = make_hwmon_tree(tmp_path, AGX_ORIN)
    backend = Ina3221Backend(sysfs_root=root)
    backend.open()
    assert backend.rail_names == ("VDDQ_VDD2_1V8AO", "VDD_CPU_CV", "VDD_GPU_SOC", "VIN_SYS_5V0")
    reading = backend.read()
    assert reading.rails == pytest.approx(expected(AGX_ORIN))
    assert reading.total_w == pytest.approx(6.0 + 2.0 + 4.5 + 0.75)

    # Each tick re-reads the files found at open.
    set_rail(root, "1-0040", 1, 5100, 3000)
    reading = backend.read()
    assert reading.rails["VDD_GPU_SOC"] == pytest.approx(5.1 * 3.0)
    assert reading.total_w == pytest.approx(15.3 + 2.0 + 4.5 + 0.75)
    backend.close()


def test_ina3221_uses_the_board_input_rail_as_total(tmp_path):
    backend = Ina3221Backend(make_hwmon_tree(tmp_path, ORIN_NX))
    backend.open()
    reading = backend.read()
    assert set(reading.rails) == {"VDD_CPU_GPU_CV", "VDD_SOC"}
    assert reading.total_w == pytest.approx(7.0)


def test_ina3221_reads_the_jetpack4_iio_layout(tmp_path):
    backend = Ina3221Backend(make_iio_tree(tmp_path))
    backend.open()
    reading = backend.read()
    assert reading.rails == pytest.approx({"GPU": 1.9, "CPU": 0.95, "SOC": 1.52})
    assert reading.total_w == pytest.approx(4.37)


def test_ina3221_missing_tree_is_a_power_error_naming_the_path(tmp_path):
    with pytest.raises(PowerError, match=r"no INA3221 power monitor under .*bus/i2c/devices"):
        Ina3221Backend(tmp_path).open()


def test_ina3221_unreadable_rail_is_a_power_error_naming_the_rail(tmp_path):
    root = make_hwmon_tree(tmp_path, ORIN_NX)
    backend = Ina3221Backend(root)
    backend.open()
    hwmon = next((root / "bus/i2c/devices/1-0040/hwmon").iterdir())
    (hwmon / "curr3_input").unlink()
    with pytest.raises(PowerError, match="VDD_SOC"):
        backend.read()


def _jtop_view(i2c_path: str) -> tuple[dict[str, float], float]:
    """What jtop's PowerService.get_status reports for this tree, in watts, using jtop's own functions."""
    jpower = pytest.importorskip("jtop.core.power")
    rails = {}
    for name, sensor in jpower.find_all_i2c_power_monitor(i2c_path).items():
        values = jpower.read_power_status(sensor)
        if "power" not in values:
            values["power"] = int(values["volt"] * (float(values["curr"]) / 1000))
        values["avg"] = values["power"]
        rails[name] = values
    total, rails = jpower.total_power(rails)
    return {name: v["power"] / 1000 for name, v in rails.items()}, total["power"] / 1000


@pytest.mark.filterwarnings("ignore:The 'warn' method is deprecated:DeprecationWarning")
@pytest.mark.parametrize("layout", ["agx_orin", "orin_nx", "iio"])
def test_rail_names_and_total_match_jtop(tmp_path, layout):
    root = {"agx_orin": lambda: make_hwmon_tree(tmp_path, AGX_ORIN), "orin_nx": lambda: make_hwmon_tree(tmp_path, ORIN_NX),
            "iio": lambda: make_iio_tree(tmp_path)}[layout]()
    jtop_rails, jtop_total = _jtop_view(str(root / "bus" / "i2c" / "devices"))
    backend = Ina3221Backend(root)
    backend.open()
    reading = backend.read()
    assert set(reading.rails) == set(jtop_rails)
    assert set(find_ina3221_rails(root)) == set(jtop_rails) | ({"VDD_IN"} if layout == "orin_nx" else set())
    # jtop truncates each rail to whole milliwatts.
    assert reading.rails == pytest.approx(jtop_rails, abs=1e-3)
    assert reading.total_w == pytest.approx(jtop_total, abs=1e-3 * len(jtop_rails))


# ------------------------------------------------------------------------------------------- jtop / nvml / none


def fake_jtop_module(power=None, start_error=None, ok=True):
    module = types.ModuleType("jtop")

    class JtopException(Exception):
        pass

    class jtop:  # noqa: N801 - mirrors jetson-stats' class name
        def __init__(self, interval=1.0):
            self.interval = interval
            self.closed = False

        def start(self):
            if start_error:
                raise JtopException(start_error)

        def ok(self, spin=False):
            return ok

        @property
        def power(self):
            return power

        def close(self):
            self.closed = True

    module.jtop, module.JtopException = jtop, JtopException
    return module


JTOP_POWER = {
    "rail": {"VDD_GPU_SOC": {"power": 6000, "online": True}, "VDD_CPU_CV": {"power": 2000, "online": True},
             "VIN_SYS_5V0": {"power": 4500, "online": True}, "VDDQ_VDD2_1V8AO": {"power": 750, "online": True}},
    "tot": {"power": 13250, "avg": 13000},
}


def test_jtop_backend_reads_rails_and_total(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "jtop", fake_jtop_module(power=JTOP_POWER))
    sock = tmp_path / "jtop.sock"
    sock.touch()
    backend = JtopBackend(socket=str(sock))
    backend.open()
    reading = backend.read()
    assert reading.rails == {"VDD_GPU_SOC": 6.0, "VDD_CPU_CV": 2.0, "VIN_SYS_5V0": 4.5, "VDDQ_VDD2_1V8AO": 0.75}
    assert reading.total_w == 13.25
    backend.close()


def test_jtop_without_its_service_says_how_to_start_it(tmp_path, monkeypatch):
    with pytest.raises(PowerError, match="sudo systemctl start jtop"):
        open_backend("jtop", jtop_socket=str(tmp_path / "jtop.sock"))
    # The socket exists but the service refuses: jtop's own message is kept, with the fix.
    monkeypatch.setitem(sys.modules, "jtop", fake_jtop_module(start_error="The jtop.service is not active."))
    (tmp_path / "jtop.sock").touch()
    with pytest.raises(PowerError, match=r"jtop: The jtop.service is not active\.; run: sudo systemctl start jtop"):
        open_backend("jtop", jtop_socket=str(tmp_path / "jtop.sock"))


def test_jtop_lost_connection_is_a_read_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "jtop", fake_jtop_module(power=JTOP_POWER, ok=False))
    (tmp_path / "jtop.sock").touch()
    backend = JtopBackend(socket=str(tmp_path / "jtop.sock"))
    with pytest.raises(PowerError, match="lost the connection"):
        backend.open()


def fake_pynvml(power_mw=123456, energy_mj=5_000_000, init_error=False, energy_supported=True):
    module = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    state = {"energy": energy_mj, "shutdown": 0}

    def nvmlInit():
        if init_error:
            raise NVMLError("Driver Not Loaded")

    def nvmlDeviceGetTotalEnergyConsumption(handle):
        if not energy_supported:
            raise NVMLError("Not Supported")
        return state["energy"]

    def nvmlShutdown():
        state["shutdown"] += 1

    module.NVMLError = NVMLError
    module.nvmlInit = nvmlInit
    module.nvmlShutdown = nvmlShutdown
    module.nvmlDeviceGetHandleByIndex = lambda i: ("gpu", i)
    module.nvmlDeviceGetPowerUsage = lambda handle: power_mw
    module.nvmlDeviceGetTotalEnergyConsumption = nvmlDeviceGetTotalEnergyConsumption
    module.state = state
    return module


def test_nvml_backend_reads_watts_and_the_energy_counter(monkeypatch):
    nvml = fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    backend = NvmlBackend(index=1)
    backend.open()
    reading = backend.read()
    assert reading.rails == {"GPU1": 123.456}
    assert reading.total_w == 123.456
    assert reading.energy_j == 5000.0 and reading.rail_energy_j == {"GPU1": 5000.0}
    backend.close()
    assert nvml.state["shutdown"] == 1

    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(energy_supported=False))
    backend = NvmlBackend()
    backend.open()
    assert backend.read().energy_j is None


def test_nvml_unavailable_says_what_to_do(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error=True))
    with pytest.raises(PowerError, match="NVML is not available .*Driver Not Loaded"):
        open_backend("nvml")
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    with pytest.raises(PowerError, match="pip install nvidia-ml-py"):
        open_backend("nvml")


def test_null_backend_measures_nothing_and_says_so():
    backend = open_backend("none")
    assert isinstance(backend, NullBackend) and backend.name == "none"
    with pytest.raises(PowerError):
        backend.read()
    meter = PowerMeter([NullBackend()]).start()
    with meter.measure() as m:
        pass
    meter.stop()
    report = m.report
    assert report.backend == "none" and not report.available
    assert report.joules is None and report.mean_w is None and report.peak_w is None
    data = json.loads(json.dumps(report.to_json()))
    assert data["available"] is False and data["joules"] is None and "not measured" in data["note"]


def test_auto_detection_order(tmp_path, monkeypatch):
    no_sock = str(tmp_path / "none.sock")
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    # No jtop socket, INA3221 present -> ina3221 (before nvml).
    tree = make_hwmon_tree(tmp_path / "orin", AGX_ORIN)
    assert open_backend("auto", tree, jtop_socket=no_sock).name == "ina3221"
    # No INA3221 either -> nvml.
    assert open_backend("auto", tmp_path / "empty", jtop_socket=no_sock).name == "nvml"
    # Nothing -> none.
    monkeypatch.setitem(sys.modules, "pynvml", None)
    assert open_backend("auto", tmp_path / "empty", jtop_socket=no_sock).name == "none"
    # The jtop service wins over everything.
    monkeypatch.setitem(sys.modules, "jtop", fake_jtop_module(power=JTOP_POWER))
    sock = tmp_path / "jtop.sock"
    sock.touch()
    assert open_backend("auto", tree, jtop_socket=str(sock)).name == "jtop"


def test_explicit_backend_that_cannot_open_stops_the_meter_at_start(tmp_path):
    meter = PowerMeter.from_config(PowerConfig(backend="ina3221", sysfs_root=str(tmp_path)))
    with pytest.raises(PowerError, match="no INA3221"):
        meter.start()
    # auto mode never raises: it ends at none.
    meter = PowerMeter.from_config(PowerConfig(sysfs_root=str(tmp_path), jtop_socket=str(tmp_path / "x.sock")))
    assert meter.open().backend in ("nvml", "none")


def test_chain_after_an_explicit_choice_follows_the_auto_order():
    assert [b.name for b in backend_chain(PowerConfig(backend="jtop"))] == ["jtop", "ina3221", "nvml", "none"]
    assert [b.name for b in backend_chain(PowerConfig(backend="nvml"))] == ["nvml", "none"]


@pytest.mark.parametrize("kwargs, match", [({"backend": "tegrastats"}, "unknown power backend 'tegrastats'"),
                                           ({"hz": 0}, "out of range"), ({"hz": 5000}, "out of range")])
def test_power_config_rejects_bad_values(kwargs, match):
    with pytest.raises(UsageError, match=match):
        PowerConfig(**kwargs)


# ------------------------------------------------------------------------------------------- meter


class FakeClock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class FakeBackend:
    """Power as a function of the fake clock; fails every read after `fail_after` good ones."""

    def __init__(self, name, clock, watts=lambda t: 10.0, fail_after=None, open_error=None, close_error=False):
        self.name, self.clock, self.watts = name, clock, watts
        self.fail_after, self.open_error, self.close_error = fail_after, open_error, close_error
        self.reads = 0
        self.opened = self.closed = False

    def open(self):
        if self.open_error:
            raise PowerError(self.open_error)
        self.opened = True

    def read(self):
        self.reads += 1
        if self.fail_after is not None and self.reads > self.fail_after:
            raise OSError(f"{self.name} sensor vanished")
        w = self.watts(self.clock())
        return PowerReading(rails={f"{self.name}_rail": w}, total_w=w)

    def close(self):
        self.closed = True
        if self.close_error:
            raise RuntimeError("close failed too")


def run_until(meter, clock, end, step=0.1):
    while clock.t < end - 1e-12:
        clock.t = min(end, round(clock.t + step, 9))
        meter.sample_now()


def test_failing_backend_degrades_to_the_next_and_sampling_goes_on():
    clock = FakeClock()
    a = FakeBackend("a", clock, fail_after=5, close_error=True)
    broken = FakeBackend("b", clock, open_error="b is not here")
    c = FakeBackend("c", clock, watts=lambda t: 20.0)
    meter = PowerMeter([a, broken, c], clock=clock, max_failures=2).open()
    with meter.measure() as m:
        run_until(meter, clock, 2.0)
    assert meter.backend == "c" and meter.backends_used == ("a", "c")
    assert a.closed and not broken.opened
    assert any("a failed" in e and "switched to c" in e for e in meter.events)
    report = m.report
    assert report.backends == ("a", "c") and report.backend == "c"
    assert report.available and report.complete
    # Samples from both backends; the failing ticks leave a short gap that is interpolated.
    backends = [s.backend for s in meter.samples()]
    assert backends[-1] == "c"
    assert report.rails["a_rail"].joules == pytest.approx(10.0 * 0.4)  # a read at t=0.0..0.4
    assert report.rails["c_rail"].joules == pytest.approx(20.0 * (2.0 - 0.6))  # c from t=0.6 on
    assert report.joules == pytest.approx(10 * 0.4 + 15 * 0.2 + 20 * 1.4)


def test_transient_failures_below_the_limit_keep_the_backend():
    clock = FakeClock()
    flaky = FakeBackend("flaky", clock)
    reads = []
    real_read = flaky.read

    def sometimes():
        reads.append(1)
        if len(reads) % 3 == 0:
            raise OSError("i2c busy")
        return real_read()

    flaky.read = sometimes
    meter = PowerMeter([flaky, NullBackend()], clock=clock, max_failures=2).open()
    run_until(meter, clock, 1.0)
    assert meter.backend == "flaky" and meter.events == ()


def test_degrading_to_none_reports_the_covered_part_only():
    clock = FakeClock()
    meter = PowerMeter([FakeBackend("a", clock, fail_after=3)], clock=clock, max_failures=1).open()
    with meter.measure() as m:
        run_until(meter, clock, 1.0)
    assert meter.backend == "none" and not meter.measuring
    report = m.report
    assert report.backends == ("a", "none")
    assert report.available and not report.complete
    assert report.total.covered_seconds == pytest.approx(0.2)
    assert report.joules == pytest.approx(2.0)
    assert "cover 0.200 s of 1.000 s" in report.note


def test_request_and_stage_energy_against_hand_computation():
    clock = FakeClock()
    # A ramp: P(t) = 10 + 5 t watts.
    meter = PowerMeter([FakeBackend("ramp", clock, watts=lambda t: 10 + 5 * t)], clock=clock).open()

    def energy(a, b):
        return 10 * (b - a) + 2.5 * (b * b - a * a)

    with meter.stage("outside") as outside:  # no request open: not kept for any report
        clock.t = 0.05
    run_until(meter, clock, 0.1)
    with meter.measure("req") as m:
        run_until(meter, clock, 0.5)
        with meter.stage("thinker_prefill") as prefill:
            clock.t = 0.53  # shorter than one tick: only the edge reads
            with meter.stage("vision") as nested:
                clock.t = 0.54
        run_until(meter, clock, 1.0)
        for start in (1.2, 1.6):
            clock.t = start
            with meter.stage("talker_decode"):
                run_until(meter, clock, start + 0.3)
        run_until(meter, clock, 2.0)
    report = m.report
    assert report.seconds == pytest.approx(1.9)
    assert report.joules == pytest.approx(energy(0.1, 2.0))
    assert report.mean_w == pytest.approx(energy(0.1, 2.0) / 1.9)
    assert report.peak_w == pytest.approx(20.0)
    assert report.rails["ramp_rail"].joules == pytest.approx(energy(0.1, 2.0))
    assert set(report.by_stage) == {"thinker_prefill", "vision", "talker_decode"}
    assert prefill.energy.joules == pytest.approx(energy(0.5, 0.54))
    assert report.by_stage["thinker_prefill"].joules == pytest.approx(energy(0.5, 0.54))
    assert nested.energy.joules == pytest.approx(energy(0.53, 0.54))
    decode = report.by_stage["talker_decode"]
    assert decode.count == 2 and decode.seconds == pytest.approx(0.6)
    assert decode.joules == pytest.approx(energy(1.2, 1.5) + energy(1.6, 1.9))
    assert decode.peak_w == pytest.approx(10 + 5 * 1.9)
    assert outside.energy.joules == pytest.approx(energy(0.0, 0.05))
    json.dumps(report.to_json())
    # Nothing is held once no window is open: one sample for the next window's interpolation.
    assert len(meter.samples()) == 1


def test_history_is_kept_only_for_open_windows():
    clock = FakeClock()
    meter = PowerMeter([FakeBackend("a", clock)], clock=clock, max_samples=50).open()
    run_until(meter, clock, 10.0)
    assert len(meter.samples()) == 50  # bounded even when nothing is measured and nothing prunes
    with meter.measure():
        clock.t += 0.1
    assert len(meter.samples()) == 1
    with meter.measure() as m:
        run_until(meter, clock, clock.t + 1.0)
        assert len(meter.samples()) >= 11
    assert m.report.complete


def test_sampler_thread_degrades_without_stopping(monkeypatch):
    a = FakeBackend("a", time.monotonic, fail_after=4)
    b = FakeBackend("b", time.monotonic, watts=lambda t: 30.0)
    with PowerMeter([a, b], hz=200, max_failures=1) as meter:
        deadline = time.monotonic() + 2.0
        while b.reads < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        thread = meter._thread
        assert thread is not None and thread.is_alive()
    assert not thread.is_alive()
    assert meter.backends_used == ("a", "b")
    assert {s.backend for s in meter.samples()} <= {"a", "b"} and b.reads >= 5


def test_meter_never_imports_torch():
    code = ("import sys; import orin.power.meter, orin.power.energy, orin.power.backends; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parents[1]).returncode == 0


# ------------------------------------------------------------------------------------------- integration


def samples_of(f, times, backend="x", energy=None, rail_energy=None):
    return [PowerSample(t=t, backend=backend, rails={"r": f(t)}, total_w=f(t),
                        energy_j=None if energy is None else energy(t),
                        rail_energy_j={} if rail_energy is None else {"r": rail_energy(t)}) for t in times]


TICKS = [i / 10 for i in range(11)]


def test_integrate_constant_and_ramp_exactly():
    total, rails = integrate(samples_of(lambda t: 10.0, TICKS), 0.25, 0.75)
    assert (total.joules, total.mean_w, total.peak_w) == pytest.approx((5.0, 10.0, 10.0))
    assert total.complete and total.samples == 5 and rails["r"].joules == pytest.approx(5.0)
    total, _ = integrate(samples_of(lambda t: 100 * t, TICKS), 0.05, 0.95)
    assert total.joules == pytest.approx(50 * (0.95**2 - 0.05**2))
    assert total.peak_w == pytest.approx(95.0)


def test_integrate_a_curve_within_tolerance():
    ticks = [i / 100 for i in range(101)]
    total, _ = integrate(samples_of(lambda t: 1 + math.sin(math.pi * t), ticks), 0.0, 1.0)
    assert total.joules == pytest.approx(1 + 2 / math.pi, rel=1e-4)


def test_integrate_a_window_between_two_samples_interpolates():
    total, _ = integrate(samples_of(lambda t: 100 * t, TICKS), 0.31, 0.32)
    assert total.samples == 0
    assert total.joules == pytest.approx(100 * 0.315 * 0.01)
    assert total.mean_w == pytest.approx(31.5) and total.peak_w == pytest.approx(32.0)
    point, _ = integrate(samples_of(lambda t: 100 * t, TICKS), 0.42, 0.42)
    assert point.joules == 0.0 and point.mean_w == pytest.approx(42.0)


def test_integrate_outside_or_partly_outside_the_samples():
    outside, rails = integrate(samples_of(lambda t: 10.0, TICKS), 2.0, 3.0)
    assert outside.joules is None and not outside.available and rails == {}
    assert integrate([], 0.0, 1.0)[0].joules is None
    partial, _ = integrate(samples_of(lambda t: 10.0, TICKS), 0.5, 1.5)
    assert partial.joules == pytest.approx(5.0) and partial.covered_seconds == pytest.approx(0.5)
    assert partial.seconds == pytest.approx(1.0) and not partial.complete
    with pytest.raises(ValueError):
        integrate(samples_of(lambda t: 10.0, TICKS), 1.0, 0.5)


def test_integrate_prefers_an_energy_counter():
    # The counter says 3 J per 0.1 s (30 W average) while the instantaneous samples read 10 W.
    samples = samples_of(lambda t: 10.0, TICKS, backend="nvml", energy=lambda t: 30 * t)
    total, rails = integrate(samples, 0.0, 0.55)
    assert total.joules == pytest.approx(16.5) and total.peak_w == 10.0
    assert rails["r"].joules == pytest.approx(5.5)  # this rail has no counter
    samples = samples_of(lambda t: 10.0, TICKS, backend="nvml", energy=lambda t: 30 * t, rail_energy=lambda t: 20 * t)
    assert integrate(samples, 0.0, 0.55)[1]["r"].joules == pytest.approx(11.0)
    # A counter that went backwards (driver reload) is not trusted: the trapezoid is used for that segment.
    reset = samples_of(lambda t: 10.0, TICKS, backend="nvml", energy=lambda t: 30 * t if t < 0.25 else 30 * (t - 0.3))
    assert integrate(reset, 0.0, 1.0)[0].joules == pytest.approx(3 + 3 + 1.0 + 7 * 3)


def test_integrate_rails_only_where_present():
    samples = [PowerSample(0.0, "a", {"x": 1.0}, 1.0), PowerSample(1.0, "a", {"x": 1.0, "y": 2.0}, 3.0),
               PowerSample(2.0, "a", {"x": 1.0, "y": 2.0}, 3.0)]
    total, rails = integrate(samples, 0.0, 2.0)
    assert total.joules == pytest.approx(2.0 + 3.0)
    assert rails["x"].joules == pytest.approx(2.0) and rails["x"].complete
    assert rails["y"].joules == pytest.approx(2.0) and rails["y"].covered_seconds == pytest.approx(1.0)


def test_combine_sums_energy_and_time():
    parts = [Energy(2.0, 10.0, 12.0, 0.2, 0.2, 3), Energy(6.0, 20.0, 25.0, 0.3, 0.3, 4),
             Energy(None, None, None, 0.1)]
    e = combine(parts)
    assert (e.joules, e.seconds, e.covered_seconds, e.peak_w, e.samples, e.count) == pytest.approx(
        (8.0, 0.6, 0.5, 25.0, 7, 3))
    assert e.mean_w == pytest.approx(16.0) and not e.complete
    assert combine([Energy(None, None, None, 1.0)]).joules is None


# ------------------------------------------------------------------------------------------- probe and CLI


def test_probe_power_on_a_fake_board(tmp_path):
    root = make_hwmon_tree(tmp_path, AGX_ORIN)
    cfg = PowerProbeConfig(backend="ina3221", hz=50, seconds=0.05, sysfs_root=str(root))
    report = probe_power(cfg)
    assert report.backend == "ina3221" and report.complete
    assert report.mean_w == pytest.approx(13.25) and report.total.samples >= 2
    text = render_report(report)
    assert "VDD_GPU_SOC" in text and "total" in text and "13.250" in text and "NC" not in text.split()


def test_probe_config_rejects_bad_values():
    with pytest.raises(UsageError, match="--seconds"):
        PowerProbeConfig(seconds=0)
    with pytest.raises(UsageError, match="unknown power backend"):
        PowerProbeConfig(backend="bogus")


def test_cli_power_prints_rails(tmp_path):
    root = make_hwmon_tree(tmp_path, AGX_ORIN)
    args = ["power", "--backend", "ina3221", "--sysfs-root", str(root), "--seconds", "0.1", "--hz", "50"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "power backend: ina3221" in result.output
    for rail in expected(AGX_ORIN):
        assert rail in result.output

    result = CliRunner().invoke(cli, [*args, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["backend"] == "ina3221" and data["available"] is True
    assert {name: r["mean_w"] for name, r in data["rails"].items()} == pytest.approx(expected(AGX_ORIN))
    assert data["mean_w"] == pytest.approx(13.25) and data["peak_w"] == pytest.approx(13.25)


def test_cli_power_errors(tmp_path):
    result = CliRunner().invoke(cli, ["power", "--backend", "ina3221", "--sysfs-root", str(tmp_path), "--seconds", "0.1"])
    assert result.exit_code == 1 and "no INA3221 power monitor" in result.output
    result = CliRunner().invoke(cli, ["power", "--backend", "tegrastats"])
    assert result.exit_code == 2
    result = CliRunner().invoke(cli, ["power", "--hz", "0"])
    assert result.exit_code == 2


def test_stage_without_edge_reads_is_interpolated_from_the_sampler():
    """Per-token stages skip the backend read at their edges; the request report still integrates them from
    the sampler's readings (same value for a linear ramp), and no extra samples are taken."""
    clock = FakeClock()
    meter = PowerMeter([FakeBackend("ramp", clock, watts=lambda t: 10 + 5 * t)], clock=clock).open()

    def energy(a, b):
        return 10 * (b - a) + 2.5 * (b * b - a * a)

    with meter.measure("req") as m:
        run_until(meter, clock, 0.5)
        before = len(meter.samples())
        for start in (0.52, 0.56, 0.61):
            clock.t = start
            with meter.stage("thinker_decode", edge_reads=False):
                clock.t = start + 0.02
        assert len(meter.samples()) == before  # no reads at the edges
        run_until(meter, clock, 1.0)
    decode = m.report.by_stage["thinker_decode"]
    assert decode.count == 3 and decode.seconds == pytest.approx(0.06)
    assert decode.joules == pytest.approx(sum(energy(s, s + 0.02) for s in (0.52, 0.56, 0.61)))
