"""Power backends: where watts come from. jtop (Jetson, through its service), the INA3221 monitors in sysfs
(Jetson without the service), NVML (discrete NVIDIA GPUs), or none. Each opens once and then reads one
`PowerReading` per tick; rail names and the board total follow jtop/tegrastats. Optional packages (jetson-stats,
nvidia-ml-py) are imported only when their backend opens. Never imports torch.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ..errors import PowerError

JTOP_SOCKET = "/run/jtop.sock"

# jtop treats one of these rails as the whole-board input: it becomes the total and leaves the rail list.
# Without one (AGX Orin) the total is the sum of the rails.
_TOTAL_RAILS = ("VIN", "POM_5V_IN", "VDD_IN")
# INA3221 channel 7 is the "sum of shunt voltages", not a rail.
_SHUNT_SUM_CHANNEL = 7


@dataclass(frozen=True)
class PowerReading:
    """What a backend measured: watts per rail and for the board, and cumulative energy counters in joules
    (board and per rail) where the hardware keeps them (NVML): a counter sees every joule between two reads,
    where integrating the readings sees only the reads."""

    rails: Mapping[str, float]
    total_w: float
    energy_j: float | None = None
    rail_energy_j: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class PowerSample:
    """A reading stamped with the meter's clock (monotonic seconds) and the backend that produced it."""

    t: float
    backend: str
    rails: Mapping[str, float]
    total_w: float
    energy_j: float | None = None
    rail_energy_j: Mapping[str, float] = field(default_factory=dict)


class PowerBackend(Protocol):
    name: str

    def open(self) -> None: ...

    def read(self) -> PowerReading: ...

    def close(self) -> None: ...


def split_total(rails: Mapping[str, float]) -> tuple[dict[str, float], float]:
    """jtop's rule: a whole-board input rail (VIN, POM_5V_IN, VDD_IN) is the total and is not listed as a rail;
    otherwise the total is the sum of all rails."""
    rails = dict(rails)
    for name in _TOTAL_RAILS:
        if name in rails:
            return rails, rails.pop(name)
    return rails, float(sum(rails.values()))


class NullBackend:
    """No power source: the meter records nothing and reports energy as unavailable."""

    name = "none"

    def open(self) -> None:
        pass

    def read(self) -> PowerReading:
        raise PowerError("no power backend is open; energy is not measured")

    def close(self) -> None:
        pass


class JtopBackend:
    """Reads `jetson.power` from the jtop service (jetson-stats). Imported lazily: jetson-stats is an optional
    extra (`orin-omni[jetson]`) and only exists on a Jetson."""

    name = "jtop"

    def __init__(self, socket: str = JTOP_SOCKET, interval: float = 0.1):
        self.socket = socket
        self.interval = interval
        self._jetson = None

    def open(self) -> None:
        if not os.path.exists(self.socket):
            raise PowerError(
                f"jtop service is not running ({self.socket} missing): run: sudo systemctl start jtop "
                "(install it with: sudo pip3 install jetson-stats==7.2.2, the version of the jetson extra), "
                "or choose --backend ina3221"
            )
        try:
            from jtop import JtopException, jtop
        except ImportError as exc:
            raise PowerError(f"jetson-stats is not installed ({exc}): pip install 'orin-omni[jetson]'") from exc
        jetson = jtop(interval=self.interval)
        try:
            jetson.start()
        except (JtopException, OSError) as exc:
            jetson.close()
            message = " ".join(str(exc.args[0] if exc.args else exc).split())
            raise PowerError(f"jtop: {message}; run: sudo systemctl start jtop") from exc
        self._jetson = jetson
        try:
            self.read()
        except PowerError:
            self.close()
            raise

    def read(self) -> PowerReading:
        if self._jetson is None:
            raise PowerError("jtop backend is not open")
        # spin=True: never block the sampler; it re-raises an error the jtop client thread hit.
        if not self._jetson.ok(spin=True):
            raise PowerError("lost the connection to the jtop service; run: sudo systemctl restart jtop")
        power = self._jetson.power
        rails = {
            name: float(values["power"]) / 1000.0
            for name, values in power.get("rail", {}).items()
            if values.get("online", True) and "power" in values
        }
        total = power.get("tot", {})
        if not rails and "power" not in total:
            raise PowerError("jtop reports no power rails on this board; choose --backend ina3221 or none")
        total_w = float(total["power"]) / 1000.0 if "power" in total else float(sum(rails.values()))
        return PowerReading(rails=rails, total_w=total_w)

    def close(self) -> None:
        if self._jetson is not None:
            jetson, self._jetson = self._jetson, None
            jetson.close()


@dataclass(frozen=True)
class Ina3221Rail:
    """Files of one rail, found once at open. Values: mV, mA, and power in `power_scale` watts per unit."""

    name: str
    volt: Path | None = None
    curr: Path | None = None
    power: Path | None = None
    power_scale: float = 1e-3


def _read_first_line(path: Path) -> str:
    with open(path) as fh:
        return fh.readline().rstrip("\x00").strip()


def _read_int(path: Path) -> int:
    # Some drivers append a unit ("32760 ma").
    return int(_read_first_line(path).split(" ")[0])


def _hwmon_rails(folder: Path) -> list[Ina3221Rail]:
    """JetPack 5+: hwmon files inN_label / inN_input (mV) / currN_input (mA)."""
    rails = []
    for label in sorted(folder.glob("in*_label")):
        name = _read_first_line(label)
        channel = label.name[2 : -len("_label")]
        if not channel.isdigit() or int(channel) == _SHUNT_SUM_CHANNEL:
            continue
        # Orin marks unconnected channels "NC"; jtop drops any label containing it, so do we.
        if "NC" in name:
            continue
        volt, curr = folder / f"in{channel}_input", folder / f"curr{channel}_input"
        if volt.is_file() and curr.is_file():
            rails.append(Ina3221Rail(name=name, volt=volt, curr=curr))
    return rails


def _iio_rails(folder: Path) -> list[Ina3221Rail]:
    """JetPack 4 and older: iio files rail_name_N / in_voltageN_input / in_currentN_input / in_powerN_input (mW)."""
    rails = []
    for label in sorted(folder.glob("rail_name_*")):
        channel = label.name[len("rail_name_") :]
        if not channel.isdigit():
            continue
        name = _read_first_line(label)
        volt = folder / f"in_voltage{channel}_input"
        curr = folder / f"in_current{channel}_input"
        power = folder / f"in_power{channel}_input"
        if power.is_file():
            rails.append(Ina3221Rail(name=name, power=power, power_scale=1e-3))
        elif volt.is_file() and curr.is_file():
            rails.append(Ina3221Rail(name=name, volt=volt, curr=curr))
    return rails


def _ina238_rails(folder: Path) -> list[Ina3221Rail]:
    """Thor carrier boards: one INA238 on the system input, which jtop names VIN (power1_input in uW)."""
    power, volt, curr = folder / "power1_input", folder / "in1_input", folder / "curr1_input"
    if power.is_file():
        return [Ina3221Rail(name="VIN", power=power, power_scale=1e-6)]
    if volt.is_file() and curr.is_file():
        return [Ina3221Rail(name="VIN", volt=volt, curr=curr)]
    return []


def find_ina3221_rails(sysfs_root: str | os.PathLike = "/sys") -> dict[str, Ina3221Rail]:
    """Every power rail under <sysfs_root>/bus/i2c/devices, named as jtop names it, sorted by name."""
    devices = Path(sysfs_root) / "bus" / "i2c" / "devices"
    if not devices.is_dir():
        return {}
    found: dict[str, Ina3221Rail] = {}
    for device in sorted(devices.iterdir()):
        name_file = device / "name"
        if not name_file.is_file():
            continue
        try:
            driver = _read_first_line(name_file).lower()
        except OSError:
            continue
        if "ina3221" not in driver and "ina238" not in driver:
            continue
        folders: list[Path] = []
        for child in sorted(device.iterdir()):
            if not child.is_dir():
                continue
            if child.name.startswith("hwmon"):
                folders += [sub for sub in sorted(child.iterdir()) if sub.is_dir() and sub.name.startswith("hwmon")]
            elif child.name.startswith("iio:device"):
                folders.append(child)
        for folder in folders:
            if "ina238" in driver:
                rails = _ina238_rails(folder)
            else:
                rails = _hwmon_rails(folder) + _iio_rails(folder)
            found.update((rail.name, rail) for rail in rails)
    return dict(sorted(found.items()))


def read_rail_watts(rail: Ina3221Rail) -> float:
    if rail.power is not None:
        return _read_int(rail.power) * rail.power_scale
    return _read_int(rail.volt) * _read_int(rail.curr) / 1e6


class Ina3221Backend:
    """Reads the INA3221 (and Thor's INA238) monitors straight from sysfs. Files are found once at open; each
    tick only reads them. `sysfs_root` is a parameter so tests run on a fake tree."""

    name = "ina3221"

    def __init__(self, sysfs_root: str | os.PathLike = "/sys"):
        self.sysfs_root = Path(sysfs_root)
        self._rails: dict[str, Ina3221Rail] = {}

    def open(self) -> None:
        rails = find_ina3221_rails(self.sysfs_root)
        if not rails:
            raise PowerError(
                f"no INA3221 power monitor under {self.sysfs_root / 'bus/i2c/devices'} (not a Jetson?); "
                "choose --backend nvml on a discrete GPU, or none"
            )
        self._rails = rails
        try:
            self.read()
        except PowerError:
            self._rails = {}
            raise

    @property
    def rail_names(self) -> tuple[str, ...]:
        return tuple(self._rails)

    def read(self) -> PowerReading:
        if not self._rails:
            raise PowerError("ina3221 backend is not open")
        watts = {}
        for name, rail in self._rails.items():
            try:
                watts[name] = read_rail_watts(rail)
            except (OSError, ValueError) as exc:
                raise PowerError(f"cannot read power rail {name} ({exc}); check permissions under {self.sysfs_root}") from exc
        rails, total = split_total(watts)
        return PowerReading(rails=rails, total_w=total)

    def close(self) -> None:
        self._rails = {}


class NvmlBackend:
    """One discrete NVIDIA GPU through NVML (nvidia-ml-py), imported lazily. Uses the driver's energy counter
    where the GPU has one (Volta and newer), so energy does not depend on the sampling rate."""

    def __init__(self, index: int = 0):
        self.index = index
        self.name = "nvml"
        self._nvml = None
        self._handle = None
        self._has_energy = False

    @property
    def rail(self) -> str:
        return f"GPU{self.index}"

    def open(self) -> None:
        try:
            import pynvml
        except ImportError as exc:
            raise PowerError(f"NVML bindings are not installed ({exc}): pip install nvidia-ml-py") from exc
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise PowerError(f"NVML is not available ({exc}): no NVIDIA driver here; choose --backend none") from exc
        try:
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
            pynvml.nvmlDeviceGetPowerUsage(self._handle)
        except pynvml.NVMLError as exc:
            pynvml.nvmlShutdown()
            self._handle = None
            raise PowerError(f"NVML cannot read the power of GPU {self.index} ({exc}); choose another backend") from exc
        try:
            pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
            self._has_energy = True
        except pynvml.NVMLError:
            self._has_energy = False
        self._nvml = pynvml

    def read(self) -> PowerReading:
        if self._nvml is None:
            raise PowerError("nvml backend is not open")
        nvml = self._nvml
        try:
            watts = nvml.nvmlDeviceGetPowerUsage(self._handle) / 1000.0
            energy = nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) / 1000.0 if self._has_energy else None
        except nvml.NVMLError as exc:
            raise PowerError(f"NVML read of GPU {self.index} failed ({exc})") from exc
        return PowerReading(rails={self.rail: watts}, total_w=watts, energy_j=energy,
                            rail_energy_j={} if energy is None else {self.rail: energy})

    def close(self) -> None:
        if self._nvml is not None:
            nvml, self._nvml, self._handle = self._nvml, None, None
            nvml.nvmlShutdown()
