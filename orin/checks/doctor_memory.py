"""The doctor's probes of the Orin's memory as it really behaves: what owners report of Tegra's memory
system (docs/architecture.md; the profile's ORIN_NOTES), tried on this board before the service meets it.

- allocator config: no `expandable_segments:True` in PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF, in this shell
  or the service's environment, on a Tegra device (orin.device.allocator_conf; the engine refuses to start);
- l4t release: /etc/nv_tegra_release against the NvMap change of L4T 36.4.7 (CVE-2025-33177), after which large
  single allocations can fail and NvMap's fragmentation lasts until a reboot;
- vmm reservation: the driver's virtual memory management, and addresses for the planned total reserved in the
  planned pieces, as the weight arenas (orin.memory.arena) will ask for them;
- largest allocation: the largest single allocation the runtime makes, created and released once, as the weight
  arenas map memory (cuMemCreate) and as torch's allocator asks for it (cuMemAlloc);
- host register: whether a private mmap of a checkpoint file can be registered with the device (the base of a later
  zero-copy load from the page cache).

Each returns a Check; a probe that does not apply here (no CUDA driver, not a Jetson) is skipped with the reason.
The driver comes from an opener (orin.checks.cuda_driver.open_driver on a board; a stand-in in the tests).
"""

from __future__ import annotations

import mmap
import re
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from ..device.allocator_conf import WHY_NOT_ON_TEGRA, AllocatorConf
from ..device.cuda_abi import ATTR_HOST_REGISTER_SUPPORTED, ATTR_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
from ..device.profile import MemoryTuning
from ..units import format_bytes
from .check import FAIL, PASS, SKIP, Check
from .cuda_driver import CudaCallError, CudaDriver, DriverUnavailable
from .doctor_checks import WARN

DRIVER_PROBES = ("vmm reservation", "largest allocation", "host register")
# The first release with the NvMap fix for CVE-2025-33177 (llama.cpp PR 23732; audio.cpp issue 12).
NVMAP_CHANGE = (36, 4, 7)
# The bytes of a file the host-register probe maps (a checkpoint shard is far larger; a smaller file is replaced by
# a temporary one): enough pages to be a real registration, little enough to pin for a moment.
HOST_REGISTER_BYTES = 4 << 20
REBOOT_FIX = ("reboot the board (Tegra's NvMap fragmentation lasts until a reboot), then run orin-omni doctor "
              "again")


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _error(exc: CudaCallError) -> str:
    return f"{exc.call} returned {exc.error}"


# ------------------------------------------------------------------ the environment and the release


def check_allocator_conf(sources: Iterable[tuple[str, AllocatorConf, str]], tegra: bool) -> Check:
    """`sources`: (where, the configuration there, how to fix it there) for this shell and the service. Only a
    Tegra device refuses expandable segments (the engine stops there at start-up)."""
    sources = list(sources)
    shown = "; ".join(f"{where}: {conf.describe()}" for where, conf, _ in sources)
    if not tegra:
        return Check("allocator config", SKIP, f"not a Tegra device, where expandable segments run ({shown})")
    bad = [(where, conf, fix) for where, conf, fix in sources if conf.expandable]
    if not bad:
        return Check("allocator config", PASS, f"no expandable_segments ({shown})")
    detail = "; ".join(f"{where}: {', '.join(s.shown() for s in conf.expandable)}" for where, conf, _ in bad)
    return Check("allocator config", FAIL, f"{detail}: {WHY_NOT_ON_TEGRA}, and orin-omni refuses to start with it",
                 "\n".join(fix for _, _, fix in bad))


@dataclass(frozen=True)
class L4tRelease:
    major: int
    minor: int
    patch: int

    @property
    def version(self) -> tuple[int, int, int]:
        return (self.major, self.minor, self.patch)

    def __str__(self) -> str:
        return f"R{self.major}.{self.minor}.{self.patch}"


_RELEASE = re.compile(r"#\s*R(\d+)\b.*?REVISION:\s*(\d+)(?:\.(\d+))?", re.IGNORECASE)


def parse_l4t_release(text: str) -> L4tRelease | None:
    """'# R36 (release), REVISION: 4.7, GCID: ..., BOARD: generic, ...' -> R36.4.7; None where it says no such
    thing."""
    match = _RELEASE.search(text)
    if not match:
        return None
    return L4tRelease(int(match.group(1)), int(match.group(2)), int(match.group(3) or 0))


def check_l4t_release(path: Path, max_allocation_bytes: int | None) -> Check:
    """The board's L4T release against the NvMap change (CVE-2025-33177)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return Check("l4t release", SKIP, f"not a Jetson (no {path})")
    except OSError as exc:
        return Check("l4t release", WARN, f"cannot read {path}: {exc}", f"sudo cat {path}")
    release = parse_l4t_release(text)
    if release is None:
        first = text.strip().splitlines()[0] if text.strip() else "empty"
        return Check("l4t release", WARN, f"{path} names no release orin-omni can read ({first!r})",
                     f"check the JetPack install: `cat {path}` should read '# R36 (release), REVISION: 4.7, ...'")
    if release.version < NVMAP_CHANGE:
        return Check("l4t release", PASS, f"L4T {release}: before the NvMap change of R36.4.7")
    cap = (f"the profile's max_allocation_bytes ({format_bytes(max_allocation_bytes)})" if max_allocation_bytes
           else "the profile's max_allocation_bytes")
    return Check("l4t release", WARN,
                 f"L4T {release} includes the NvMap change of R36.4.7 on (CVE-2025-33177): large single allocations may "
                 "fail ('NvMapMemAllocInternalTagged ... error 12'), and NvMap's fragmentation lasts until a reboot",
                 f"nothing to change now: orin-omni keeps single allocations under {cap}; if allocations fail after "
                 "long uptime, reboot the board")


# ------------------------------------------------------------------ the driver's probes


def reservation_plan(memory: MemoryTuning, budget: int, granularity: int) -> tuple[int, int, str]:
    """(total, piece, why): the addresses the weight arenas may reserve at most for `budget`, and the largest
    piece one reservation asks for. With the profile's headroom the total is its limit (the budget plus
    reserve_headroom_bytes); without, what reserve_factor and reserve_slack give the budget."""
    if memory.reserve_headroom_bytes is not None:
        total = budget + memory.reserve_headroom_bytes
        why = (f"the budget {format_bytes(budget)} plus the profile's reserve_headroom_bytes "
               f"{format_bytes(memory.reserve_headroom_bytes)}")
    else:
        total = int(budget * memory.reserve_factor) + memory.reserve_slack
        why = (f"the budget {format_bytes(budget)} times the profile's reserve_factor {memory.reserve_factor} plus "
               f"reserve_slack {format_bytes(memory.reserve_slack)}")
    total = _round_up(total, granularity)
    if memory.max_reservation_bytes is None:
        return total, total, why
    return total, max(memory.max_reservation_bytes // granularity * granularity, granularity), why


def check_reservation(driver: CudaDriver, memory: MemoryTuning, budget: int) -> Check:
    """Virtual memory management, then the planned total reserved in the planned pieces at once (as the arenas
    hold them) and freed."""
    name = "vmm reservation"
    try:
        if not driver.attribute(ATTR_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED):
            return Check(name, WARN, f"{driver.name}: no virtual memory management (the driver says so): the "
                         "weights use a memory pool of their own, so a unit swapped back in lands at new addresses "
                         "and its CUDA graphs are captured again",
                         "orin-omni runs without it, slower to swap; update JetPack (the NVIDIA driver) for it")
        granularity = driver.granularity()
    except CudaCallError as exc:
        return Check(name, WARN, f"{driver.name}: cannot ask the driver about virtual memory management: "
                     f"{_error(exc)}", "update JetPack (the NVIDIA driver); orin-omni runs without it")
    total, piece, why = reservation_plan(memory, budget, granularity)
    sizes = [min(piece, total - start) for start in range(0, total, piece)]
    held: list[tuple[int, int]] = []
    failed = None
    for size in sizes:  # all held at once, as the arenas hold them
        try:
            held.append((driver.reserve(size), size))
        except CudaCallError as exc:
            failed = exc
            break
    got = sum(s for _, s in held)
    freed = _free_addresses(driver, held)
    if failed is not None:
        return Check(name, WARN,
                     f"reserving {format_bytes(total)} ({why}) in {len(sizes)} piece(s) of at most "
                     f"{format_bytes(piece)}: piece {len(held) + 1} failed after {format_bytes(got)}: "
                     f"{_error(failed)}{freed}; the weights of a unit whose reservation fails come from torch's "
                     "allocator (graphs over them are captured again after each swap)",
                     f"{REBOOT_FIX}; or a smaller --budget (the arenas reserve the budget plus "
                     "reserve_headroom_bytes)")
    return Check(name, PASS, f"{driver.name}: reserved {format_bytes(total)} ({why}) in {len(sizes)} piece(s) of at "
                 f"most {format_bytes(piece)}, and freed them{freed}")


def _free_addresses(driver: CudaDriver, held: list[tuple[int, int]]) -> str:
    """Give every reservation back; '' where all went, else what the driver said (the doctor's process ends soon
    and takes its addresses with it, so this is a note, not a finding)."""
    errors = []
    for ptr, size in held:
        try:
            driver.free_addresses(ptr, size)
        except CudaCallError as exc:
            errors.append(_error(exc))
    return f" (giving them back: {errors[0]})" if errors else ""


def allocation_size(memory: MemoryTuning, plan_largest: tuple[int, str] | None) -> tuple[int | None, str]:
    """(bytes, where the number comes from) of the largest single allocation the runtime makes: the plan's
    largest ((bytes, what) where a plan sized the standard request), never less than a piece of weights (the
    profile's max_allocation_bytes)."""
    sizes = []
    if plan_largest:
        sizes.append((plan_largest[0], f"the plan's largest single allocation, the {plan_largest[1]}"))
    if memory.max_allocation_bytes:
        sizes.append((memory.max_allocation_bytes, "the profile's max_allocation_bytes"))
    if not sizes:
        return None, "the profile sets no max_allocation_bytes and no plan sized a request"
    return max(sizes)


def check_largest_allocation(driver: CudaDriver, memory: MemoryTuning,
                             plan_largest: tuple[int, str] | None) -> Check:
    """The largest single allocation, made once and given back: physical memory as the weight arenas map it
    (cuMemCreate, where the driver has virtual memory management) and device memory in one piece as torch's
    allocator asks for it (cuMemAlloc, what cudaMalloc does)."""
    name = "largest allocation"
    size, source = allocation_size(memory, plan_largest)
    if size is None:
        return Check(name, SKIP, f"no size to try: {source}")
    fix = (f"{REBOOT_FIX}; if it still fails on a fresh boot, stop other programs using the GPU and report it "
           "with `orin-omni doctor --json`")
    made = []
    try:
        vmm = bool(driver.attribute(ATTR_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED))
        if vmm:
            granularity = driver.granularity()
            created = _round_up(size, granularity)
            driver.release(driver.create(created))
            made.append(f"cuMemCreate of {format_bytes(created)}")
        driver.free(driver.alloc(size))
        made.append(f"cuMemAlloc of {format_bytes(size)}")
    except CudaCallError as exc:
        done = f" ({', '.join(made)} worked)" if made else ""
        return Check(name, FAIL, f"{format_bytes(size)} ({source}) in one piece: {_error(exc)}{done}", fix)
    return Check(name, PASS, f"{format_bytes(size)} ({source}): {' and '.join(made)}, each released")


def first_safetensors(model_dir: str | None) -> Path | None:
    """The checkpoint's first safetensors file (by path), or None."""
    if not model_dir or not Path(model_dir).is_dir():
        return None
    return next(iter(sorted(Path(model_dir).rglob("*.safetensors"))), None)


def _register_mapping(driver: CudaDriver, path: Path, length: int) -> None:
    """Map `length` bytes of `path` privately (copy-on-write: registering asks for write access, which a shared
    read-only mapping of a read-only file refuses), register them with the device and unregister them."""
    import ctypes

    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), length, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        view = (ctypes.c_char * length).from_buffer(mapping)
        try:
            address = ctypes.addressof(view)
            driver.host_register(address, length)
            driver.host_unregister(address)
        finally:
            del view  # the buffer export ends here, or the mapping cannot close
    finally:
        mapping.close()


def check_host_register(driver: CudaDriver, path: Path | None, scratch: str | None = None) -> Check:
    """Whether the device can register a private mmap of a file (`path`, else a temporary file in `scratch`):
    cudaDevAttrHostRegisterSupported, then a registration of its first pages. Nothing in orin-omni needs it yet
    (weights are read into device memory), so what fails here is a warning."""
    name = "host register"
    future = "a zero-copy load of the weights from the page cache cannot work on this board"
    try:
        supported = driver.attribute(ATTR_HOST_REGISTER_SUPPORTED)
    except CudaCallError as exc:
        return Check(name, WARN, f"cannot ask the driver: {_error(exc)}: {future}", "none needed today")
    if not supported:
        return Check(name, WARN, f"{driver.name} cannot register host memory "
                     f"(cudaDevAttrHostRegisterSupported is 0): {future}",
                     "none needed today: orin-omni reads the weights into device memory")
    page = mmap.PAGESIZE
    temporary = None
    try:
        if path is None or path.stat().st_size < page:
            temporary = tempfile.NamedTemporaryFile(dir=scratch, prefix="orin-omni-doctor-", suffix=".bin")
            temporary.write(b"\0" * HOST_REGISTER_BYTES)
            temporary.flush()
            target, what = Path(temporary.name), "a temporary file"
        else:
            target, what = path, str(path)
        length = min(HOST_REGISTER_BYTES, target.stat().st_size) // page * page
        _register_mapping(driver, target, length)
    except CudaCallError as exc:
        return Check(name, WARN, f"the driver says it can, but registering {format_bytes(length)} of a private mmap "
                     f"of {what} failed: {_error(exc)}: {future}", "none needed today; update JetPack for it")
    except OSError as exc:
        return Check(name, WARN, f"cannot map a file to try it with: {exc}",
                     "run doctor where it can read the model directory and write a temporary file")
    finally:
        if temporary is not None:
            temporary.close()
    return Check(name, PASS, f"{format_bytes(length)} of a private mmap of {what} registered with {driver.name} and "
                 "unregistered")


# ------------------------------------------------------------------ all of them


def driver_checks(opener: Callable[[], CudaDriver], device: str, memory: MemoryTuning, budget: int,
                  plan_largest: tuple[int, str] | None, model_dir: str | None) -> list[Check]:
    """The three driver probes, each skipped with the reason where there is no driver to ask."""
    if device == "cpu":
        return [Check(name, SKIP, "--device cpu") for name in DRIVER_PROBES]
    try:
        driver = opener()
    except DriverUnavailable as exc:
        return [Check(name, SKIP, f"{exc}: not a CUDA machine") for name in DRIVER_PROBES]
    try:
        return [check_reservation(driver, memory, budget),
                check_largest_allocation(driver, memory, plan_largest),
                check_host_register(driver, first_safetensors(model_dir))]
    finally:
        driver.close()


def service_env_fix(variables: Iterable[str], env_file: str, name: str) -> str:
    """The fix for an allocator setting in the service's environment."""
    where = ", ".join(variables)
    return (f"remove expandable_segments from {where} (in {env_file}, or the unit's Environment= / drop-ins: "
            f"`systemctl cat {name}`), then `sudo systemctl restart {name}`")


def environment_fix(conf: AllocatorConf) -> str:
    """The fix for an allocator setting in this shell: a shell line per variable."""
    return "; ".join(s.fix() for s in conf.expandable)

