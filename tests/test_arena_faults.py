"""The weight arenas (orin.memory.arena) where the driver refuses, as Tegra's does (docs/architecture.md): a
reservation above some size, a large allocation, a map at any point (the first load, a swap, a load that grows).
A stand-in driver over the host's memory (tests/test_weight_arena.HostVmm) refuses on purpose; the unit whose
call failed continues on the allocator with one warning, nothing stays half-mapped, the counts stay right, and
the time-sliced engine answers every request as all-resident within its budget. `pytest -k "reservation or
out_of_memory"` runs them."""

from __future__ import annotations

import dataclasses
import logging
import mmap
import weakref
from collections import Counter
from typing import NamedTuple

import pytest
import torch

from orin import components as C
from orin.device.profile import MemoryTuning
from orin.memory.arena import ALIGN, Arenas
from orin.memory.block_reader import BlockReader
from orin.memory.vmm_driver import CudaVmm, DriverError
from tests.test_time_sliced import KINDS, SEQUENCE, _assert_whole, _engine, _outcome
from tests.test_weight_arena import HostVmm

PAGE = mmap.PAGESIZE
MAP_CALLS = ("cuMemCreate", "cuMemMap", "cuMemSetAccess")


class FaultyVmm(HostVmm):
    """HostVmm refusing what Tegra's driver may refuse: a reservation above `reserve_above` bytes, a create above
    `create_above`, the n-th try of a call (`fail={"cuMemMap": 3}`: the third cuMemMap made; `arm(call)`: the
    next one), and the `growth_at`-th (by default the first) `fail_growth` call (cuMemMap or cuMemSetAccess) into
    a reservation that a tensor was handed out of since it was last unmapped (a load growing after it handed
    tensors out; `growths` counts such calls, failing or not). Each refusal is CUDA_ERROR_OUT_OF_MEMORY, recorded
    in `failures`."""

    def __init__(self, reserve_above: int | None = None, create_above: int | None = None,
                 fail: dict[str, int] | None = None, fail_growth: str | None = None, growth_at: int = 1):
        super().__init__()
        self.reserve_above = reserve_above
        self.create_above = create_above
        self.fail = dict(fail or {})
        self.fail_growth = fail_growth
        self.growth_at = growth_at
        self.tries: Counter[str] = Counter()
        self.growths: Counter[str] = Counter()
        self.failures: list[tuple[str, int]] = []
        self._handed: set[int] = set()  # reservations a tensor was handed out of

    def arm(self, call: str) -> None:
        self.fail[call] = self.tries[call] + 1

    def _try(self, call: str, size: int, above: int | None = None, ptr: int | None = None) -> None:
        self.tries[call] += 1
        growing = ptr is not None and self._reservation(ptr) in self._handed
        self.growths[call] += growing
        if (self.fail.get(call) == self.tries[call] or (above is not None and size > above)
                or (call == self.fail_growth and growing and self.growths[call] >= self.growth_at
                    and not self.failures)):
            self.failures.append((call, size))
            raise DriverError(call, size, "failed with CUDA driver error 2 (out of memory)", 2)

    def _reservation(self, ptr: int) -> int:
        return next(b for b, s in self.reserved.items() if b <= ptr < b + s)

    def tensor(self, ptr: int, nbytes: int, owner: object) -> torch.Tensor:
        self._handed.add(self._reservation(ptr))
        return super().tensor(ptr, nbytes, owner)

    def mem_unmap(self, ptr: int, size: int) -> None:
        self._handed.discard(self._reservation(ptr))
        super().mem_unmap(ptr, size)

    def free_addresses(self, ptr: int, size: int) -> None:
        self._handed.discard(ptr)  # the host may hand the same addresses out again
        super().free_addresses(ptr, size)

    def reserve(self, size: int) -> int:
        self._try("cuMemAddressReserve", size, self.reserve_above)
        return super().reserve(size)

    def mem_create(self, size: int) -> int:
        self._try("cuMemCreate", size, self.create_above)
        return super().mem_create(size)

    def mem_map(self, ptr: int, size: int, handle: int) -> None:
        self._try("cuMemMap", size, ptr=ptr)
        super().mem_map(ptr, size, handle)

    def mem_set_access(self, ptr: int, size: int) -> None:
        self._try("cuMemSetAccess", size, ptr=ptr)
        super().mem_set_access(ptr, size)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "orin.memory.arena" and r.levelno == logging.WARNING]


def _counts_agree(arenas: Arenas, vmm: HostVmm) -> None:
    assert arenas.mapped == vmm.mapped and arenas.reserved == sum(vmm.reserved.values())
    vmm.assert_whole()


# ---------------------------------------------------------------- the driver's own calls, all or nothing


class _FakeLibcuda:
    """libcuda's entry points as CudaVmm calls them, over nothing: each is recorded and returns 0, or
    CUDA_ERROR_OUT_OF_MEMORY (2) for the one named `failing`; `live` holds the handles created and not released."""

    def __init__(self, failing: str):
        self.failing = failing
        self.calls: list[str] = []
        self.live: set[int] = set()

    def _code(self, name: str) -> int:
        self.calls.append(name)
        return 2 if name == self.failing else 0

    def cuMemGetAllocationGranularity(self, out, prop, flags):  # noqa: N802 - the driver's names
        out._obj.value = 2 << 20
        return 0

    def cuMemCreate(self, out, size, prop, flags):  # noqa: N802
        code = self._code("cuMemCreate")
        if not code:
            out._obj.value = 7
            self.live.add(7)
        return code

    def cuMemMap(self, ptr, size, offset, handle, flags):  # noqa: N802
        return self._code("cuMemMap")

    def cuMemSetAccess(self, ptr, size, desc, count):  # noqa: N802
        return self._code("cuMemSetAccess")

    def cuMemUnmap(self, ptr, size):  # noqa: N802
        return self._code("cuMemUnmap")

    def cuMemRelease(self, handle):  # noqa: N802
        self.live.discard(handle.value)
        return self._code("cuMemRelease")


@pytest.mark.parametrize("failing, made", [
    ("cuMemCreate", ["cuMemCreate"]),
    ("cuMemMap", ["cuMemCreate", "cuMemMap", "cuMemRelease"]),
    ("cuMemSetAccess", ["cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease"]),
])
def test_out_of_memory_in_a_cuda_map_leaves_no_handle_behind(failing, made):
    """CudaVmm.map over a driver that refuses one of its three calls: the error names the call and the size,
    and whatever the calls before it made is undone (nothing half-mapped)."""
    lib = _FakeLibcuda(failing)
    vmm = CudaVmm(lib, 0)
    assert vmm.granularity == 2 << 20
    with pytest.raises(DriverError, match=f"{failing} of {4 << 20} bytes failed with CUDA driver error 2") as err:
        vmm.map(64 << 20, 4 << 20)
    assert (err.value.call, err.value.size, err.value.code) == (failing, 4 << 20, 2)
    assert lib.calls == made and lib.live == set()


# ---------------------------------------------------------------- one unit's arena


def test_a_reservation_refused_above_n_bytes_puts_only_that_unit_on_the_allocator(caplog):
    vmm = FaultyVmm(reserve_above=1 << 20)
    told: list[str] = []
    arenas = Arenas(vmm, MemoryTuning(reserve_factor=2.0, reserve_slack=0), on_fallback=told.append)
    small, large = arenas.of("code2wav"), arenas.of("thinker_text/0")
    small.begin(256 << 10)  # 512 KiB of addresses: granted
    large.begin(768 << 10)  # 1.5 MiB: refused
    assert vmm.failures == [("cuMemAddressReserve", 3 << 19)] and told == ["thinker_text/0"]
    s, t = small.take(1000), large.take(1000)
    assert small.holds(s) and not large.holds(t) and t.device == vmm.device
    x = torch.ones(8)
    assert large.adopt(x) is x  # the allocator's already: not copied
    assert arenas.on_the_fallback() == ("thinker_text/0",) and large.fallback.call == "cuMemAddressReserve"
    assert _warnings(caplog) == [f"thinker_text/0: cuMemAddressReserve of {3 << 19} bytes failed with CUDA driver "
                                 "error 2 (out of memory); its weights come from the allocator from now on (not at "
                                 "fixed addresses: graphs over them are captured again after each swap)"]
    _counts_agree(arenas, vmm)
    assert arenas.reserved == 512 << 10 and large.ranges == ()
    del s, t
    arenas.release(["code2wav", "thinker_text/0"])
    tries = dict(vmm.tries)
    large.begin(768 << 10)  # stays on the allocator: the driver is not asked again
    assert not large.holds(large.take(100)) and dict(vmm.tries) == tries and len(_warnings(caplog)) == 1
    large.release()
    arenas.close()
    vmm.assert_empty()
    assert arenas.mapped == arenas.reserved == 0


@pytest.mark.parametrize("call", MAP_CALLS)
@pytest.mark.parametrize("when", ("start", "growth", "swap"))
def test_out_of_memory_mapping_at_any_point_puts_the_unit_on_the_allocator_keeping_what_it_handed_out(
        call, when, caplog):
    """The first piece a call fails for, at the unit's first load (`start`), while a load grows past what was
    mapped at its start (`growth`: after a tensor was handed out) or at a later load (`swap`): the tensors
    handed out before stay mapped and keep their values until the unit goes; the rest of the load, and every
    later one, is the allocator's; one warning names the call and the piece's size; nothing is left half-mapped
    and, after the unit goes, nothing mapped or reserved for it."""
    piece = 256 << 10
    vmm = FaultyVmm()
    told: list[str] = []
    arenas = Arenas(vmm, MemoryTuning(reserve_factor=2.0, reserve_slack=0, max_allocation_bytes=piece),
                    on_fallback=told.append)
    arena = arenas.of("talker/3")
    if when == "start":
        vmm.arm(call)
    arena.begin(6 << 20)  # 12 MiB of addresses, 6 MiB mapped at once
    a = arena.take(4096)
    a.fill_(5)
    if when == "growth":
        vmm.arm(call)
    b = arena.take(10 << 20)  # past what was mapped: the range grows
    b.fill_(6)
    _counts_agree(arenas, vmm)
    assert all(size <= piece for name, size in vmm.calls if name == "cuMemCreate")
    if when == "swap":
        assert arena.holds(a) and arena.holds(b) and not told
        del a, b
        arena.release()
        vmm.arm(call)
        arena.begin(0)  # the last load's layout, mapped at once: its first piece fails
        a, b = arena.take(4096), arena.take(10 << 20)
        a.fill_(5)
        b.fill_(6)
    assert vmm.failures == [(call, piece)] and told == ["talker/3"] and arena.fallback.call == call
    assert _warnings(caplog) == [f"talker/3: {call} of {piece} bytes failed with CUDA driver error 2 (out of "
                                 "memory); its weights come from the allocator from now on (not at fixed addresses: "
                                 "graphs over them are captured again after each swap)"]
    _counts_agree(arenas, vmm)
    assert not arena.holds(b) and torch.equal(b, torch.full_like(b, 6))
    if when == "growth":  # `a` was handed out before: still mapped, its piece alone, at its address
        assert arena.holds(a) and arenas.mapped == piece and len(arena.ranges) == 1
    else:
        assert not arena.holds(a) and arenas.mapped == arenas.reserved == 0
    assert torch.equal(a, torch.full_like(a, 5))
    del a, b
    arena.release()
    assert arenas.mapped == arenas.reserved == 0 and vmm.reserved == {}  # on the allocator: addresses given back
    calls = len(vmm.calls)
    arena.begin(0)
    assert not arena.holds(arena.take(4096))
    arena.release()
    assert len(vmm.calls) == calls and len(_warnings(caplog)) == 1  # not asked again, not warned again
    arenas.close()
    vmm.assert_empty()


@pytest.mark.parametrize("under", ("adopt", "block"))
def test_out_of_memory_while_growing_keeps_nothing_the_load_handed_out_alive(under, tmp_path, caplog):
    """A growth that fails under `adopt` (a tensor moved into the arena: an INT4 module's buffer, as the reader's
    _keep_module moves it) or under a block read's `take` (the device block a batch of tensors is cut from): the
    error stays the unit's `fallback` for the rest of the process, but not the frames it was raised through,
    whose locals were the load's tensors. Once the caller drops what it was handed, nothing of it is alive,
    without a collection: the loader's eviction would find such a tensor still referenced."""
    vmm = FaultyVmm(fail_growth="cuMemMap")
    arenas = Arenas(vmm, MemoryTuning(reserve_factor=1.0, reserve_slack=16 * PAGE))
    arena = arenas.of("talker/0")
    arena.begin(PAGE)  # 17 pages of addresses, one mapped
    first = arena.take(PAGE)  # handed out: what the range maps next is growth, and fails
    values = torch.arange(2 * PAGE // 4, dtype=torch.float32)
    if under == "adopt":
        src = values.view(2, -1)
        kept = [arena.adopt(src)]
        given = [weakref.ref(src)]  # the caller's to drop, as _apply drops the module's old buffer
        del src
    else:
        path = tmp_path / "unit.safetensors"
        from safetensors.torch import save_file

        save_file({"a": values[:PAGE // 4].clone(), "b": values[PAGE // 4:].clone()}, str(path))
        got = BlockReader(path, vmm.device).read(["a", "b"], max_gap=0, alloc=arena.take)
        kept = [got["a"], got["b"]]
        given = [weakref.ref(kept[0]._base)]  # the block both are views of
        del got
    assert vmm.failures == [("cuMemMap", 16 * PAGE)] and arena.fallback.call == "cuMemMap"
    assert arena.holds(first) and not any(arena.holds(t) for t in kept)
    assert torch.equal(torch.cat([t.flatten() for t in kept]), values)
    refs = given + [weakref.ref(t) for t in kept]
    del kept
    assert [ref() for ref in refs] == [None] * len(refs)
    assert arena.fallback.__traceback__ is None and len(_warnings(caplog)) == 1
    del first
    arena.release()
    arenas.close()
    vmm.assert_empty()


def test_out_of_memory_for_a_create_above_x_bytes_is_avoided_by_pieces_under_max_allocation_bytes(caplog):
    """The profile's max_allocation_bytes keeps every cuMemCreate under what the driver refuses; without it the
    same load asks for more at once and its unit goes to the allocator."""
    for ceiling, falls in ((512 << 10, False), (None, True)):
        vmm = FaultyVmm(create_above=1 << 20)
        arenas = Arenas(vmm, MemoryTuning(reserve_factor=1.0, reserve_slack=0, max_allocation_bytes=ceiling))
        arena = arenas.of("vision_encoder")
        arena.begin(3 << 20)
        t = arena.take(3 << 20)
        assert arena.holds(t) != falls and (arena.fallback is not None) == falls
        if falls:
            assert vmm.failures == [("cuMemCreate", 3 << 20)]
        else:
            assert vmm.failures == [] and max(s for c, s in vmm.calls if c == "cuMemCreate") == 512 << 10
        _counts_agree(arenas, vmm)
        del t
        arenas.close()
        vmm.assert_empty()
    assert len(_warnings(caplog)) == 1


def test_a_unit_larger_than_max_reservation_bytes_gets_several_ranges_of_pieces_under_the_ceilings():
    vmm = HostVmm()
    arenas = Arenas(vmm, MemoryTuning(reserve_factor=1.0, reserve_slack=0, max_reservation_bytes=16 * PAGE,
                                      max_allocation_bytes=4 * PAGE))
    arena = arenas.of("vision_encoder")
    arena.begin(40 * PAGE)
    assert [size for _, size in arena.ranges] == [16 * PAGE, 16 * PAGE, 8 * PAGE]
    tensors = [arena.take(5 * PAGE) for _ in range(8)]  # three a range, the eighth in a range reserved then
    for i, t in enumerate(tensors):
        t.fill_(i)
        assert arena.holds(t) and t.data_ptr() % ALIGN == 0
        assert sum(b <= t.data_ptr() and t.data_ptr() + 5 * PAGE <= b + s for b, s in arena.ranges) == 1
    assert all(torch.equal(t, torch.full_like(t, i)) for i, t in enumerate(tensors))
    assert len(arena.ranges) == 4
    assert all(size <= 16 * PAGE for c, size in vmm.calls if c == "cuMemAddressReserve")
    assert all(size <= 4 * PAGE for c, size in vmm.calls if c == "cuMemCreate")
    _counts_agree(arenas, vmm)
    where = [t.data_ptr() for t in tensors]
    del tensors, t
    arena.release()
    arena.begin(0)
    assert [arena.take(5 * PAGE).data_ptr() for _ in range(8)] == where  # the same ranges, the same places
    arena.release()
    arenas.close()
    vmm.assert_empty()


def test_a_tensor_larger_than_max_reservation_bytes_goes_to_the_allocator_with_its_unit(caplog):
    vmm = HostVmm()
    arenas = Arenas(vmm, MemoryTuning(reserve_factor=1.0, reserve_slack=0, max_reservation_bytes=16 * PAGE))
    arena = arenas.of("thinker_text")
    arena.begin(8 * PAGE)
    a = arena.take(PAGE)
    b = arena.take(17 * PAGE)
    assert arena.holds(a) and not arena.holds(b) and arena.fallback.call == "cuMemAddressReserve"
    assert "larger than the profile's max_reservation_bytes" in _warnings(caplog)[0]
    assert all(size <= 16 * PAGE for c, size in vmm.calls if c == "cuMemAddressReserve")
    del a, b
    arenas.close()
    vmm.assert_empty()


def test_reservations_past_the_budget_and_headroom_take_idle_units_addresses_then_fit_tightly(caplog):
    """All reservations together stay under budget + reserve_headroom_bytes: a unit not loaded gives its
    addresses back first; then a unit gets only the addresses it needs; past that, the allocator."""
    vmm = HostVmm()
    budget, headroom = 100 * PAGE, 20 * PAGE
    arenas = Arenas(vmm, MemoryTuning(reserve_factor=2.0, reserve_slack=0, reserve_headroom_bytes=headroom),
                    budget)
    assert arenas.limit == 120 * PAGE
    a, b, c, d, e = (arenas.of(u) for u in ("audio_encoder", "vision_encoder", "talker", "code_predictor",
                                             "code2wav"))
    a.begin(30 * PAGE)
    a.release()
    b.begin(30 * PAGE)
    assert arenas.reserved == 120 * PAGE
    c.begin(20 * PAGE)  # a, not loaded, gives its addresses back; b, loaded, keeps them
    assert a.ranges == () and [s for _, s in c.ranges] == [40 * PAGE] and arenas.reserved == 100 * PAGE
    d.begin(15 * PAGE)  # 30 pages would pass the limit: 15, what it needs
    assert [s for _, s in d.ranges] == [15 * PAGE] and arenas.reserved == 115 * PAGE
    e.begin(10 * PAGE)  # not even that: the allocator
    assert e.fallback.call == "cuMemAddressReserve" and arenas.on_the_fallback() == ("code2wav",)
    assert "would pass the limit of" in _warnings(caplog)[0] and len(_warnings(caplog)) == 1
    assert arenas.reserved <= arenas.limit
    _counts_agree(arenas, vmm)
    arenas.release(["vision_encoder", "talker", "code_predictor", "code2wav"])
    a.begin(30 * PAGE)  # reserved anew, from the units not loaded now
    assert a.fallback is None and a.ranges and arenas.reserved <= arenas.limit
    arenas.close()
    vmm.assert_empty()


# ---------------------------------------------------------------- the time-sliced engine over such a driver


@pytest.fixture(scope="module")
def reference(quantized_dir):
    """The all-resident outcomes, the budgets swept (the least the planner accepts, one between, all-resident)
    and the resident bytes of all the weights."""
    engine = _engine(quantized_dir)
    try:
        plans = {k: engine.plan(req).verdict for k, req in KINDS.items()}
        outcomes = {k: _outcome(engine, req)[1] for k, req in KINDS.items()}
        weights = sum(engine.loader.sizes()[c] for c in C.NAMES)
    finally:
        engine.close()
    least = max(v.min_budget for v in plans.values())
    top = max(v.all_resident_bytes for v in plans.values())
    return outcomes, [least, (least + top) // 2, top + 1], weights


class Swept(NamedTuple):
    vmm: HostVmm
    fallen: tuple[str, ...]  # the units on the allocator at the end
    maps: list[int]  # cuMemMap calls made by the end of each request
    ranges: dict[str, int]  # the most ranges each unit held


def _sweep(quantized_dir, outcomes, budgets, make_vmm, profile=None) -> dict[int, Swept]:
    """SEQUENCE at each budget over a fresh `make_vmm()`: every answer the all-resident one, the peak under the
    budget, no unit half-loaded, the arenas' counts the driver's, the mapped memory held by resident units alone
    and, once every kind of request has run (each unit then maps what its last load took), under the budget too;
    the addresses under their limit; nothing left after close."""
    seen = {}
    for budget in budgets:
        vmm = make_vmm()
        options = {"profile": profile} if profile is not None else {}
        engine = _engine(quantized_dir, budget, arena_driver=lambda device, vmm=vmm: vmm, **options)
        maps: list[int] = []
        ranges: Counter[str] = Counter()
        try:
            loader = engine.loader
            arenas = loader._arenas
            units = [u for c in C.NAMES for u in loader.units(c)]
            for i, kind in enumerate(SEQUENCE):
                report, outcome = _outcome(engine, KINDS[kind])
                assert outcome == outcomes[kind], f"{kind} at budget {budget} differs from all-resident"
                assert report.peak_bytes <= budget, (kind, budget, report.peak_bytes)
                _assert_whole(engine)
                _counts_agree(arenas, vmm)
                resident = set(loader.resident_units())
                assert all(arenas.of(u).mapped == 0 for u in units if u not in resident)
                if i >= len(KINDS):  # a unit's first load maps by its estimate, GROW at a time: more than here
                    assert arenas.peak <= budget, (kind, budget, arenas.peak)
                if arenas.limit is not None:
                    assert arenas.reserved <= arenas.limit
                maps.append(vmm.count("cuMemMap"))
                for u in units:
                    ranges[u] = max(ranges[u], len(arenas.of(u).ranges))
            seen[budget] = Swept(vmm, arenas.on_the_fallback(), maps, dict(ranges))
        finally:
            engine.close()
        vmm.assert_empty()
    return seen


def _orin_like(weights: int):
    """The CPU profile with the Orin's reservation and allocation bounds, scaled from the real model's 20.08 GiB
    of resident weights to the tiny model's (a page at least)."""
    from orin.device.capabilities import detect
    from orin.device.profile import ORIN

    scale = weights / (20.08 * (1 << 30))
    orin = ORIN.memory

    def scaled(n: int) -> int:
        return max(int(n * scale) // PAGE * PAGE, PAGE)

    # One allocation's ceiling, scaled, is under the tiny model's own working tensors and weights (their sizes do
    # not scale with the weights' total), which the planner would refuse: four times it keeps them under, and the
    # staging buffer (one allocation) is no larger than the ceiling, as the Orin's 64 MiB is under its 1 GiB.
    ceiling = 4 * scaled(orin.max_allocation_bytes)
    cpu = detect(torch.device("cpu"))
    return dataclasses.replace(cpu, memory=dataclasses.replace(
        cpu.memory, reserve_factor=orin.reserve_factor, reserve_slack=scaled(orin.reserve_slack),
        max_reservation_bytes=scaled(orin.max_reservation_bytes),
        reserve_headroom_bytes=scaled(orin.reserve_headroom_bytes),
        max_allocation_bytes=ceiling, stage_bytes=ceiling))


def test_time_sliced_sweep_within_orin_like_reservation_bounds_gives_the_same_outputs(quantized_dir, reference):
    """The Orin's bounds scaled to the tiny model: units spread over several ranges and pieces, every piece and
    reservation under its ceiling, the total under the budget plus headroom, and the all-resident answers."""
    outcomes, budgets, weights = reference
    profile = _orin_like(weights)
    memory = profile.memory
    seen = _sweep(quantized_dir, outcomes, budgets, HostVmm, profile)
    for budget, swept in seen.items():
        calls = swept.vmm.calls
        assert all(s <= memory.max_reservation_bytes for c, s in calls if c == "cuMemAddressReserve"), budget
        assert all(s <= memory.max_allocation_bytes for c, s in calls if c == "cuMemCreate"), budget
        assert not swept.fallen, (budget, swept.fallen)
    # the vision encoder (6.4 MB here), resident all along at the top budget, is larger than one range (2.6 MB)
    assert seen[budgets[-1]].ranges["vision_encoder"] >= 3, seen[budgets[-1]].ranges


def test_out_of_memory_on_every_reservation_sweeps_on_the_allocator(quantized_dir, reference, caplog):
    """A driver that refuses every reservation: each unit goes to the allocator at its first load, with one
    warning, and the sweep answers as all-resident within every budget."""
    outcomes, budgets, _ = reference
    with caplog.at_level(logging.WARNING, logger="orin.memory.arena"):
        seen = _sweep(quantized_dir, outcomes, budgets, lambda: FaultyVmm(reserve_above=0))
    for budget, swept in seen.items():
        vmm = swept.vmm
        assert swept.fallen and not vmm.count("cuMemCreate"), budget
        assert {c for c, _ in vmm.failures} == {"cuMemAddressReserve"}
        assert len(vmm.failures) == len(swept.fallen)  # each unit refused once, never asked again
    told = _warnings(caplog)
    assert len(told) == sum(len(swept.fallen) for swept in seen.values())
    assert all("cuMemAddressReserve of" in m for m in told)


def test_out_of_memory_on_the_kth_map_mid_sweep_keeps_every_answer(quantized_dir, reference, caplog):
    """The k-th cuMemMap fails at the least budget, k past the first two requests' maps (units are swapping by
    then): that unit goes to the allocator at a swap while the rest stay in their arenas; every answer is
    all-resident's, within the budget."""
    outcomes, budgets, _ = reference
    least = budgets[0]
    probe = _sweep(quantized_dir, outcomes, [least], HostVmm)[least]
    assert probe.maps[-1] > probe.maps[1] and not probe.fallen
    k = (probe.maps[1] + probe.maps[-1]) // 2 + 1
    with caplog.at_level(logging.WARNING, logger="orin.memory.arena"):
        swept = _sweep(quantized_dir, outcomes, [least], lambda: FaultyVmm(fail={"cuMemMap": k}))[least]
    assert [c for c, _ in swept.vmm.failures] == ["cuMemMap"] and len(swept.fallen) == 1
    assert swept.maps[1] == probe.maps[1]  # the same first two requests: the failure came at a later swap
    assert len(_warnings(caplog)) == 1 and _warnings(caplog)[0].startswith(swept.fallen[0] + ": cuMemMap of")
    assert swept.maps[-1] > k  # the other units went on mapping


@pytest.mark.parametrize("call", ("cuMemMap", "cuMemSetAccess"))
def test_out_of_memory_while_a_load_grows_mid_sweep_keeps_every_answer(quantized_dir, reference, call, caplog):
    """Under the Orin-like bounds at the least budget, a load growing into a range it already handed tensors out
    of fails: those tensors stay in the arena, the rest of the unit's tensors come from the allocator (the
    reader's blocks and the converted INT4 buffers alike), and every answer is all-resident's."""
    outcomes, budgets, weights = reference
    with caplog.at_level(logging.WARNING, logger="orin.memory.arena"):
        swept = _sweep(quantized_dir, outcomes, budgets[:1], lambda: FaultyVmm(fail_growth=call),
                       _orin_like(weights))[budgets[0]]
    assert [c for c, _ in swept.vmm.failures] == [call] and len(swept.fallen) == 1
    assert len(_warnings(caplog)) == 1 and _warnings(caplog)[0].startswith(f"{swept.fallen[0]}: {call} of")


@pytest.mark.parametrize("where", ("growth", "map"))
def test_out_of_memory_at_every_kth_map_of_an_orin_like_sweep_leaves_no_tensor_referenced(
        quantized_dir, reference, where, caplog):
    """Under the Orin-like bounds at the least budget, which loads outgrow what they mapped at their start, and
    so what a load is doing when a map fails (a block of plain tensors read, an INT4 module's buffers moved, a
    packed copy read), follows from the profile's reserve_factor and reserve_slack: a failure at one point alone
    missed a traceback that kept a tensor of the unit referenced. So a sweep per point: the n-th map into a range
    already handed out of (`growth`, every one the sweep makes) or the k-th map of all (`map`, every k-th, about
    six points over the sweep) fails. Each time one unit goes to the allocator with one warning, every
    eviction finds its tensors unreferenced (the loader raises otherwise), and every answer is all-resident's."""
    outcomes, budgets, weights = reference
    profile = _orin_like(weights)
    least = budgets[0]
    probe = _sweep(quantized_dir, outcomes, [least], FaultyVmm, profile)[least]
    assert not probe.fallen and not probe.vmm.failures
    if where == "growth":
        points = range(1, probe.vmm.growths["cuMemMap"] + 1)
        assert len(points) >= 2, probe.vmm.growths

        def make(n):
            return FaultyVmm(fail_growth="cuMemMap", growth_at=n)
    else:
        points = range(1, probe.maps[-1] + 1, max(probe.maps[-1] // 6, 1))

        def make(k):
            return FaultyVmm(fail={"cuMemMap": k})
    for point in points:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="orin.memory.arena"):
            swept = _sweep(quantized_dir, outcomes, [least], lambda point=point: make(point), profile)[least]
        assert [c for c, _ in swept.vmm.failures] == ["cuMemMap"] and len(swept.fallen) == 1, (where, point)
        told = _warnings(caplog)
        assert len(told) == 1 and told[0].startswith(f"{swept.fallen[0]}: cuMemMap of"), (where, point, told)
