"""Weights at addresses of their own (orin.memory.arena): mapped while a unit is loaded, unmapped when it goes,
the same addresses when it comes back. The CUDA driver's calls are stood in for by the host's own virtual memory
(mmap with no access reserves addresses; mprotect maps and unmaps them): the arena's bookkeeping, and the time-
sliced loader's use of it, run as they do on a GPU; an access to memory the arena unmapped crashes the test, as it
would fault on the device. On a GPU, tests/test_device_kernels.py runs them over the real driver; what happens
when the driver refuses is tests/test_arena_faults.py's."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap

import pytest
import torch

from orin import components as C
from orin.device.profile import MemoryTuning
from orin.memory.arena import ALIGN, Arenas
from orin.memory.vmm_driver import VmmDriver

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_PROT_NONE = 0
_MAP_NORESERVE = 0x4000
_MADV_DONTNEED = 4


class HostVmm(VmmDriver):
    """CudaVmm's calls over the host's address space, checking what the driver would refuse, with a record of
    every call made (`calls`: (name, bytes), in order). Mapped memory becomes accessible only once its access is
    set, as on the device; `map` and `unmap` are VmmDriver's own, as CudaVmm's are."""

    granularity = mmap.PAGESIZE
    device = torch.device("cpu")

    def __init__(self):
        self.reserved: dict[int, int] = {}  # address -> bytes reserved there
        self.handles: dict[int, int] = {}  # physical memory created and not released: handle -> bytes
        self.maps: dict[int, tuple[int, int]] = {}  # address -> (bytes, handle) mapped there
        self.accessible: set[int] = set()  # addresses of the maps whose access is set
        self.calls: list[tuple[str, int]] = []
        self._handle = 0

    def count(self, call: str) -> int:
        return sum(name == call for name, _ in self.calls)

    def reserve(self, size: int) -> int:
        assert size > 0 and size % self.granularity == 0
        ptr = _libc.mmap(None, size, _PROT_NONE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        assert ptr not in (None, ctypes.c_void_p(-1).value)
        self.reserved[ptr] = size
        self.calls.append(("cuMemAddressReserve", size))
        return ptr

    def free_addresses(self, ptr: int, size: int) -> None:
        assert self.reserved.pop(ptr) == size
        assert not any(ptr <= m < ptr + size for m in self.maps), "addresses freed while mapped"
        _libc.munmap(ptr, size)
        self.calls.append(("cuMemAddressFree", size))

    def mem_create(self, size: int) -> int:
        assert size > 0 and size % self.granularity == 0
        self._handle += 1
        self.handles[self._handle] = size
        self.calls.append(("cuMemCreate", size))
        return self._handle

    def mem_map(self, ptr: int, size: int, handle: int) -> None:
        assert size % self.granularity == 0 and ptr % self.granularity == 0 and self.handles[handle] == size
        assert any(b <= ptr and ptr + size <= b + s for b, s in self.reserved.items()), "outside a reservation"
        assert not any(m < ptr + size and ptr < m + s for m, (s, _) in self.maps.items()), "mapped twice"
        assert all(h != handle for _, h in self.maps.values()), "a handle mapped twice"
        self.maps[ptr] = (size, handle)
        self.calls.append(("cuMemMap", size))

    def mem_set_access(self, ptr: int, size: int) -> None:
        assert self.maps[ptr][0] == size
        assert _libc.mprotect(ptr, size, mmap.PROT_READ | mmap.PROT_WRITE) == 0
        self.accessible.add(ptr)
        self.calls.append(("cuMemSetAccess", size))

    def mem_unmap(self, ptr: int, size: int) -> None:
        assert self.maps.pop(ptr)[0] == size
        _libc.madvise(ptr, size, _MADV_DONTNEED)  # the contents go, as the device's would
        assert _libc.mprotect(ptr, size, _PROT_NONE) == 0
        self.accessible.discard(ptr)
        self.calls.append(("cuMemUnmap", size))

    def mem_release(self, handle: int) -> None:
        assert all(h != handle for _, h in self.maps.values()), "released while mapped"
        self.calls.append(("cuMemRelease", self.handles.pop(handle)))

    def tensor(self, ptr: int, nbytes: int, owner: object) -> torch.Tensor:
        at = ptr  # the bytes are mapped and accessible, piece after piece
        for m in sorted(self.maps):
            if m <= at < m + self.maps[m][0] and m in self.accessible:
                at = m + self.maps[m][0]
        assert at >= ptr + nbytes, "a tensor over memory not mapped"
        buf = (ctypes.c_uint8 * nbytes).from_address(ptr)
        buf.owner = owner  # the tensor keeps the buffer, the buffer the owner
        return torch.frombuffer(buf, dtype=torch.uint8)

    def synchronize(self) -> None:
        pass

    @property
    def mapped(self) -> int:
        return sum(size for size, _ in self.maps.values())

    def assert_whole(self) -> None:
        """Nothing half-mapped: every handle created and not released is mapped, and every map accessible."""
        assert sorted(self.handles) == sorted(h for _, h in self.maps.values()), (self.handles, self.maps)
        assert set(self.maps) == self.accessible

    def assert_empty(self) -> None:
        assert self.reserved == {} and self.maps == {} and self.handles == {}


def _arenas(vmm, **memory) -> Arenas:
    """Arenas over `vmm` with the default profile's bounds (none), or those given."""
    return Arenas(vmm, MemoryTuning(**memory))


def test_a_unit_loaded_again_lands_where_it_was_and_its_memory_goes_when_it_does():
    vmm = HostVmm()
    arenas = _arenas(vmm)
    arena = arenas.of("thinker.layers.0")
    arena.begin(300 << 10)
    a = arena.take(1000)
    b = arena.adopt(torch.arange(50_000, dtype=torch.float32))
    assert a.data_ptr() % ALIGN == 0 and b.data_ptr() % ALIGN == 0 and b.data_ptr() >= a.data_ptr() + 1000
    assert torch.equal(b, torch.arange(50_000, dtype=torch.float32)) and arena.holds(b)
    assert arena.adopt(b) is b  # already there: not copied again
    where = (a.data_ptr(), b.data_ptr())
    assert vmm.mapped == arenas.mapped == arenas.peak >= 201_000
    assert arenas.reserved == sum(vmm.reserved.values()) > 0
    del a, b
    arena.release()
    assert vmm.mapped == arenas.mapped == 0 and arenas.peak > 0
    arena.begin(0)  # the last load's size is mapped at once
    maps = vmm.count("cuMemMap")
    again = (arena.take(1000), arena.adopt(torch.zeros(50_000)))
    assert (again[0].data_ptr(), again[1].data_ptr()) == where and vmm.count("cuMemMap") == maps
    assert vmm.count("cuMemAddressReserve") == 1
    vmm.assert_whole()
    del again
    arenas.close()
    vmm.assert_empty()
    assert arenas.reserved == arenas.mapped == 0


def test_memory_a_tensor_still_reads_is_not_unmapped():
    arenas = _arenas(HostVmm())
    arena = arenas.of("code2wav")
    arena.begin(1 << 20)
    kept = arena.take(4096)[:16]  # a view keeps the whole load mapped
    with pytest.raises(RuntimeError, match="code2wav: a tensor of it is still referenced"):
        arena.release()
    kept.fill_(1)  # still mapped: readable and writable
    assert arenas.mapped > 0
    del kept
    arena.release()
    assert arenas.mapped == 0


def test_a_load_past_its_reservation_gets_another_range_and_keeps_it():
    """An estimate far under what comes: what does not fit the addresses reserved goes to a range reserved then
    (no tensor straddling two), and the next load, asking in the same order, lands where this one did."""
    vmm = HostVmm()
    arenas = _arenas(vmm, reserve_factor=1.0, reserve_slack=0)
    arena = arenas.of("talker.rest")
    arena.begin(64 << 10)  # an estimate far under what comes
    (first_base, first_size), = arena.ranges
    small = arena.take(16 << 10)
    big = arena.take(3 << 20)
    big.fill_(7)
    assert len(arena.ranges) == 2 and vmm.count("cuMemAddressReserve") == 2
    assert first_base <= small.data_ptr() and small.data_ptr() + (16 << 10) <= first_base + first_size
    base, size = arena.ranges[1]
    assert base <= big.data_ptr() and big.data_ptr() + (3 << 20) <= base + size  # wholly in the new range
    assert arena.holds(small) and arena.holds(big) and arena.fallback is None
    with pytest.raises(RuntimeError, match="loaded again before it was released"):
        arena.begin(1)
    where = (small.data_ptr(), big.data_ptr())
    del small, big
    arena.release()
    arena.begin(0)
    again = (arena.take(16 << 10), arena.take(3 << 20))
    assert tuple(t.data_ptr() for t in again) == where and vmm.count("cuMemAddressReserve") == 2
    del again
    arenas.close()
    vmm.assert_empty()


def test_memory_asked_for_outside_a_load_is_refused():
    arena = _arenas(HostVmm()).of("vision_encoder")
    with pytest.raises(RuntimeError, match="outside a load"):
        arena.take(10)


@pytest.fixture()
def host_arenas():
    return HostVmm()


def test_time_sliced_weights_live_in_their_arenas_and_come_back_at_their_addresses(quantized_dir, host_arenas):
    """The loader's production path over arenas: every request answers as all-resident; each resident unit's
    tensors lie in its own arena and only resident units hold mapped memory; a unit swapped out and in again
    (after its first reload, which reads the packed copy its conversion wrote) lands at the same addresses."""
    from tests.test_time_sliced import KINDS, _engine, _outcome

    reference = _engine(quantized_dir)
    try:
        want = {k: _outcome(reference, req)[1] for k, req in KINDS.items()}
        plans = {k: reference.plan(req).verdict for k, req in KINDS.items()}
    finally:
        reference.close()
    budget = max(v.min_budget for v in plans.values())
    engine = _engine(quantized_dir, budget, arena_driver=lambda device: host_arenas)
    try:
        loader = engine.loader
        units = [u for c in C.NAMES for u in loader.units(c)]
        places: dict[str, list[tuple[int, ...]]] = {}
        loads = dict.fromkeys(units, 0)
        before: set[str] = set()
        for kind in ("av", "speech", "text", "av", "speech", "av", "speech"):
            assert _outcome(engine, KINDS[kind])[1] == want[kind], kind
            loader.settle()
            resident = set(loader.resident_units())
            for unit in units:
                arena = loader._arenas.of(unit)
                if unit not in resident:
                    assert arena.mapped == 0, unit
                    continue
                tensors = _unit_tensors(loader, unit)
                assert tensors and all(arena.holds(t) for t in tensors), unit
                loads[unit] += unit not in before
                where = tuple(t.data_ptr() for t in tensors)
                del tensors  # held here, they would keep the unit from being evicted
                if where not in places.setdefault(unit, []):
                    places[unit].append(where)
            before = resident
            assert host_arenas.mapped == loader._arenas.mapped
            assert loader._arenas.mapped >= sum(loader.unit_sizes()[u] for u in resident)
            host_arenas.assert_whole()
        assert loader._arenas.on_the_fallback() == ()
        # Units loaded three times or more: after the first reload (converted the first time, read from the
        # packed copy since) they always land at the same addresses.
        again = [u for u in units if loads[u] >= 3]
        assert again, "the budget moved nothing back twice"
        for unit in again:
            assert len(places[unit]) <= 2, (unit, len(places[unit]))
    finally:
        engine.close()
    host_arenas.assert_empty()


def _unit_tensors(loader, unit):
    out = [p for name, p in loader.model.named_parameters() if C.unit_of(name) == unit and p.device.type != "meta"]
    for path, shell in loader.shells.items():
        if C.unit_of(path + ".") == unit:
            out += [b for b in shell.buffers() if b is not None]
    return out
