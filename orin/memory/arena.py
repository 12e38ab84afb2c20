"""Device memory for swapped weights that is freed when they go and comes back at the same addresses.

A unit (orin.components) that the time-sliced loader swaps out must give its memory back to the device: on the
Orin that memory is what the robot's other processes run in. It should also come back at the addresses it had,
so the CUDA graphs captured over it replay instead of being captured again (0.3-0.5 s of a first audio packet).
torch's caching allocator cannot do both: a block freed into the common pool is soon taken by activations, and a
pool of the weights' own (torch.cuda.MemPool) keeps every block it ever held until the pool itself goes. With
weights in their own pool, the bench's 18 GiB engine held 22.4 GiB from the driver (a 4.4 GiB excess).

So each unit gets ranges of virtual addresses of its own, reserved once, and physical memory is mapped into them
while the unit is loaded and unmapped (returned to the driver) when it is evicted, through CUDA's virtual memory
management (orin.memory.vmm_driver). The tensors handed out are bumped from the first range's start in the order
they are asked for, never across two ranges: a unit loaded the same way lands where it was. This is the scheme
vLLM's sleep mode uses, without a compiled extension.

Tegra grants less than a discrete GPU's driver (docs/architecture.md, the profile's ORIN_NOTES), so the device
profile's MemoryTuning bounds what is asked for: each reservation (`max_reservation_bytes`: a larger unit gets
several ranges), all of them together (the budget plus `reserve_headroom_bytes`: past it the addresses of units
not loaded are given back first, then a reservation only as large as the unit) and each piece of physical memory
(`max_allocation_bytes`: one cuMemCreate a piece). Where a call fails or would pass a bound, at a unit's first
load, a later one or while it grows, that unit's weights come from the allocator (torch.empty on the device) for
the rest of the process, with one warning: a driver that refused once (Tegra's NvMap fragmentation lasts until a
reboot) is not asked again at every swap, and the unit's memory is then the allocator's, counted by it and given
back by the loader's trims. Tensors handed out before the failure stay where they are until the unit goes.

Where the driver lacks virtual memory management altogether (`driver_for` returns None) the loader has no arenas
and uses a memory pool of the weights' own instead (orin.memory.loader.Loader.weights_memory).
"""

from __future__ import annotations

import gc
import logging
import threading
import weakref
from collections.abc import Callable

import torch

from ..device.profile import MemoryTuning
from .vmm_driver import DriverError, VmmDriver

log = logging.getLogger("orin.memory.arena")
# Tensors start on this boundary (the caching allocator's own): vectorised kernels read 16 bytes at a time.
ALIGN = 512
# Where a load outgrows what was mapped for it, the next this many bytes are mapped at once.
GROW = 8 << 20


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _detached(exc: BaseException) -> BaseException:
    """`exc` (and the errors it was raised from or while handling) without its traceback. A traceback holds the
    frames the error passed through and, through each frame's caller, the whole stack of the load that was under
    way, with every local as it was when that frame returned: kept as a unit's `fallback` for the rest of the
    process, it kept those locals alive too. Where the error came from a `take` under an `adopt`, one was the
    very tensor the unit kept (an INT4 module's buffer: still referenced when the unit was evicted); from one
    under a block read, the block every tensor of the batch is a view of (allocator memory never freed)."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        e.__traceback__ = None
        todo += [e.__cause__, e.__context__]
    return exc


class _Generation:
    """What one load of a unit handed out: every tensor of it keeps this alive (through the driver's tensor's
    owner), so a weak reference to it says whether anything still reads the memory."""


class _Range:
    """One reservation of a unit's addresses: physical memory mapped from its start (`chunks`), and the bytes the
    load under way has handed out from it (`used`)."""

    def __init__(self, base: int, size: int):
        self.base = base
        self.size = size
        self.chunks: list[tuple[int, int, int]] = []  # (address, bytes, handle), in address order
        self.used = 0

    @property
    def mapped(self) -> int:
        return sum(size for _, size, _ in self.chunks)


class UnitArena:
    """One unit's ranges of addresses; physical memory mapped into them while the unit is loaded. `fallback`: the
    failure that put the unit's weights in the allocator for good (None while they have an arena)."""

    def __init__(self, arenas: Arenas, name: str):
        self._arenas = arenas
        self._driver = arenas.driver
        self.name = name
        self._ranges: list[_Range] = []
        self._at = 0  # the range the load under way hands out from
        self._last: list[int] = []  # bytes each range handed out in the last load: what the next one maps at once
        self._gen: _Generation | None = None
        self.fallback: DriverError | None = None
        self.loaded_at = 0  # the Arenas' count of loads when this one last began: the least recent gives way first

    @property
    def mapped(self) -> int:
        return sum(r.mapped for r in self._ranges)

    @property
    def ranges(self) -> tuple[tuple[int, int], ...]:
        """(address, bytes) of each range reserved."""
        return tuple((r.base, r.size) for r in self._ranges)

    def begin(self, estimate: int) -> None:
        """Start a load: what the last load took (else `estimate` bytes) is mapped at once, exactly; more as
        asked for, GROW bytes at a time."""
        with self._arenas._lock:  # marked loading before anything, so no other load reclaims its addresses
            if self._gen is not None:
                raise RuntimeError(f"{self.name}: loaded again before it was released")
            self._gen = _Generation()
            self._arenas._loads += 1
            self.loaded_at = self._arenas._loads
        self._at = 0
        for r in self._ranges:
            r.used = 0
        if self.fallback is not None:
            return
        granularity = self._driver.granularity
        try:
            if not self._ranges:  # the first load, or its addresses were given back for other units'
                need = _round_up(max(sum(self._last) or estimate, 1), granularity)
                self._ranges = self._arenas._reserve(need, self._arenas.reservation(need), self)
            plan = list(self._last)  # the same ranges (or alike) are filled the same way
            if not plan:  # the estimate, range after range
                left = _round_up(max(estimate, 1), granularity)
                for r in self._ranges:
                    plan.append(min(left, r.size))
                    left -= plan[-1]
            for r, upto in zip(self._ranges, plan, strict=False):
                self._grow(r, upto, step=0)
        except DriverError as exc:
            self._fall_back(exc)

    def _grow(self, r: _Range, upto: int, step: int = GROW) -> None:
        """Map `r` up to `upto` bytes from its start (at least `step` more), in pieces of at most the profile's
        max_allocation_bytes."""
        mapped = r.mapped
        if upto <= mapped:
            return
        size = min(_round_up(max(upto - mapped, step), self._driver.granularity), r.size - mapped)
        piece = self._arenas.piece or size
        while size > 0:
            n = min(piece, size)
            ptr = r.base + mapped
            handle = self._driver.map(ptr, n)
            r.chunks.append((ptr, n, handle))
            self._arenas._count(n)
            mapped += n
            size -= n

    def take(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of the unit's memory, as a uint8 tensor (the next ones in its ranges; on the fallback, the
        allocator's)."""
        if self._gen is None:
            raise RuntimeError(f"{self.name}: memory asked for outside a load")
        if self.fallback is None:
            n = max(nbytes, 1)
            try:
                r = self._room(n)
                start = _round_up(r.used, ALIGN)
                self._grow(r, start + n)
            except DriverError as exc:
                self._fall_back(exc)
            else:
                r.used = start + n
                return self._driver.tensor(r.base + start, nbytes, self._gen)
        return torch.empty(nbytes, dtype=torch.uint8, device=self._driver.device)

    def _room(self, n: int) -> _Range:
        """The range the next `n` bytes go in: the current one, a later one, or one reserved now (the estimate was
        low). A tensor never straddles two ranges: their addresses need not be adjacent."""
        while self._at < len(self._ranges):
            r = self._ranges[self._at]
            if _round_up(r.used, ALIGN) + n <= r.size:
                return r
            self._at += 1
        need = _round_up(n, self._driver.granularity)
        if self._arenas.max_reservation is not None and need > self._arenas.max_reservation:
            raise DriverError("cuMemAddressReserve", need, "not made: one tensor of the unit is larger than the "
                              f"profile's max_reservation_bytes ({self._arenas.max_reservation})")
        self._ranges += self._arenas._reserve(need, self._arenas.reservation(need), self)
        return self._ranges[self._at]

    def _fall_back(self, exc: DriverError) -> None:
        """A call failed or was refused: the unit's weights come from the allocator from now on. What this load
        mapped but handed nothing out of is unmapped now, the rest (under live tensors) when the unit goes; a
        range with nothing mapped is given back now, the others then. The error is kept without the frames it
        was raised through (_detached): they are the load's, and their locals are tensors of the unit."""
        self.fallback = _detached(exc)
        log.warning("%s: %s; its weights come from the allocator from now on (not at fixed addresses: graphs over "
                    "them are captured again after each swap)", self.name, exc)
        for r in self._ranges:
            kept = [c for c in r.chunks if c[0] < r.base + r.used]
            for ptr, size, handle in r.chunks[len(kept):]:
                self._driver.unmap(ptr, size, handle)
                self._arenas._count(-size)
            r.chunks = kept
        self._arenas._free(self, [r for r in self._ranges if not r.chunks])
        if self._arenas.on_fallback is not None:
            self._arenas.on_fallback(self.name)

    def holds(self, tensor: torch.Tensor) -> bool:
        ptr = tensor.data_ptr()
        return self._gen is not None and any(r.base <= ptr < r.base + r.used for r in self._ranges)

    def adopt(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` in the unit's memory: itself where it is there already, else a copy (the original is the
        caller's to drop)."""
        if tensor.device.type == "meta" or self.holds(tensor):
            return tensor
        if self.fallback is not None:  # the allocator's already: as it is, but not as a view keeping more alive
            return tensor.clone() if tensor._base is not None else tensor
        src = tensor.contiguous()
        out = self.take(src.numel() * src.element_size()).view(src.dtype).view(src.shape)
        out.copy_(src)
        return out

    def release(self, synced: bool = False) -> None:
        """Unmap the unit's memory (the caller has dropped every tensor of it, and `synced` the device since);
        its addresses stay reserved, but for a unit on the fallback, whose addresses are given back."""
        if self._gen is None:
            return
        gen = weakref.ref(self._gen)
        self._gen = None
        if gen() is not None:
            gc.collect()
        if gen() is not None:
            self._gen = gen()
            raise RuntimeError(f"{self.name}: a tensor of it is still referenced, so its memory cannot be freed")
        self._last = [r.used for r in self._ranges]
        if not synced and self.mapped:
            self._driver.synchronize()  # kernels queued may still read it
        for r in self._ranges:
            for ptr, size, handle in r.chunks:
                self._driver.unmap(ptr, size, handle)
                self._arenas._count(-size)
            r.chunks = []
            r.used = 0
        if self.fallback is not None:
            self._arenas._free(self, list(self._ranges))

    def close(self) -> None:
        self.release()
        self._arenas._free(self, list(self._ranges))


class Arenas:
    """Every unit's arena on one device, within the profile's bounds (`memory`; `budget`: the loader's, which
    with memory.reserve_headroom_bytes caps the addresses reserved), and the bytes mapped across them (now, the
    peak since reset_peak, and the peak since they were made) and reserved. `on_fallback(unit)` is told when a
    unit's weights move to the allocator."""

    def __init__(self, driver: VmmDriver, memory: MemoryTuning, budget: int | None = None,
                 on_fallback: Callable[[str], None] | None = None):
        self.driver = driver
        self.memory = memory
        granularity = driver.granularity
        self.max_reservation = (None if memory.max_reservation_bytes is None
                                else max(memory.max_reservation_bytes // granularity * granularity, granularity))
        self.piece = (None if memory.max_allocation_bytes is None
                      else max(memory.max_allocation_bytes // granularity * granularity, granularity))
        self.limit = (None if budget is None or memory.reserve_headroom_bytes is None
                      else budget + memory.reserve_headroom_bytes)
        self.on_fallback = on_fallback
        self._by_unit: dict[str, UnitArena] = {}
        # guards the counts and every range reserved or given back (a prefetch thread loads beside the main one)
        self._lock = threading.RLock()
        self._loads = 0
        self.mapped = 0
        self.peak = 0  # since reset_peak
        self.peak_ever = 0
        self.reserved = 0

    def reservation(self, need: int) -> int:
        """The addresses a unit that needs `need` bytes is given: room to load a little larger and keep them."""
        return _round_up(int(need * self.memory.reserve_factor) + self.memory.reserve_slack, self.driver.granularity)

    def _count(self, delta: int) -> None:
        with self._lock:
            self.mapped += delta
            self.peak = max(self.peak, self.mapped)
            self.peak_ever = max(self.peak_ever, self.mapped)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.mapped

    def _reserve(self, need: int, want: int, arena: UnitArena) -> list[_Range]:
        """Ranges of `want` bytes in all (each at most max_reservation) for `arena`; where that would pass the
        limit once the units not loaded have given their addresses back, ranges of `need` bytes (room for no
        growth, but the unit still at fixed addresses); else a DriverError for the fallback."""
        with self._lock:
            size = want
            if self.limit is not None:
                idle = sorted((a for a in self._by_unit.values()
                               if a is not arena and a._gen is None and a._ranges and not a.mapped),
                              key=lambda a: a.loaded_at)
                floor = self.reserved - sum(s for a in idle for _, s in a.ranges)
                size = want if floor + want <= self.limit else need
                if floor + size > self.limit:
                    raise DriverError("cuMemAddressReserve", need, f"not made: with {floor} bytes reserved for "
                                      f"other units, it would pass the limit of {self.limit} (the budget plus "
                                      "the profile's reserve_headroom_bytes)")
                for other in idle:  # least recently loaded first: its graphs are the least likely to replay
                    if self.reserved + size <= self.limit:
                        break
                    log.info("%s: its addresses (%d bytes) given back for %s's, under the limit of %d",
                             other.name, sum(s for _, s in other.ranges), arena.name, self.limit)
                    self._free(other, list(other._ranges))
            step = self.max_reservation or size
            got: list[_Range] = []
            try:
                for start in range(0, size, step):
                    n = min(step, size - start)
                    got.append(_Range(self.driver.reserve(n), n))
                    self.reserved += n
            except DriverError:  # none of it: the unit goes to the allocator whole
                for r in got:
                    self.driver.free_addresses(r.base, r.size)
                    self.reserved -= r.size
                raise
            return got

    def _free(self, arena: UnitArena, ranges: list[_Range]) -> None:
        """Give back those of these ranges (nothing mapped in them) that `arena` still holds: another unit's load
        may have taken them meanwhile."""
        with self._lock:
            for r in ranges:
                if r in arena._ranges:
                    arena._ranges.remove(r)
                    self.driver.free_addresses(r.base, r.size)
                    self.reserved -= r.size

    def of(self, unit: str) -> UnitArena:
        with self._lock:
            if unit not in self._by_unit:
                self._by_unit[unit] = UnitArena(self, unit)
            return self._by_unit[unit]

    def on_the_fallback(self) -> tuple[str, ...]:
        """The units whose weights come from the allocator (a call failed or was refused for each)."""
        with self._lock:
            return tuple(u for u, a in self._by_unit.items() if a.fallback is not None)

    def adopt(self, unit: str, tensor: torch.Tensor) -> torch.Tensor:
        return self.of(unit).adopt(tensor)

    def release(self, units) -> None:
        """Unmap these units' memory, after one wait for the kernels queued (which may still read it)."""
        arenas = [self._by_unit[u] for u in units if u in self._by_unit]
        if any(a.mapped for a in arenas):
            self.driver.synchronize()
        for arena in arenas:
            arena.release(synced=True)

    def close(self) -> None:
        for arena in self._by_unit.values():
            arena.close()
        self._by_unit.clear()
