"""The time-sliced loader: components swapped in and out of device memory under a budget.

The model skeleton (orin.memory.skeleton) is built once with every parameter on the meta device. A component is loaded
by reading its units' tensors into it (orin.memory.unit_reader: straight from safetensors onto the target device, INT4
modules converted one module at a time or read from their packed copies). Swapping out replaces the tensors with
meta tensors, frees them and empties the allocator cache: the Orin's memory is unified, so "offloading to CPU"
would free nothing, and swapping in is a read from storage.

What moves is units (orin.components: a decoder's layers one by one, the rest of a component whole): a stage
gets its components whole, and what gives way for it is decided by orin.memory.residency, unit by unit. This module keeps
the books: what is resident, what is arriving, the request's memory and the budget.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from .. import components as C
from ..checkpoint.reader import Checkpoint
from ..contract import Swap
from ..device.gate import GATE
from ..device.profile import DeviceProfile
from ..errors import BudgetError
from . import residency
from .arena import Arenas
from .packed_cache import PackedCache
from .request_sizes import pinned_host_bytes
from .skeleton import Skeleton
from .unit_reader import UnitReader
from .vmm_driver import VmmDriver, driver_for

log = logging.getLogger("orin.memory.loader")


@dataclass
class MemoryTracker:
    """Peak memory of a request. On CUDA it is the allocator's own measurement (weights, KV cache and
    activations) plus the weights mapped outside it (orin.memory.arena; their peak and the allocator's are added,
    which can only overstate). On CPU torch keeps no allocator statistics, so it is the exact byte count of the
    tensors the engine holds: resident weights plus the KV cache."""

    device: torch.device
    resident: dict[str, int] = field(default_factory=dict)
    dynamic: int = 0
    peak: int = 0
    arenas: Arenas | None = None
    # Pinned host memory the loader keeps (its staging buffers), where that is the device's own DRAM (Tegra's
    # unified memory: the plan counts it against the budget, request_sizes.stage_margin); 0 on a discrete GPU.
    host: int = 0

    def current(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device) + self._mapped() + self.host
        return sum(self.resident.values()) + self.dynamic

    def _mapped(self, peak: bool = False) -> int:
        if self.arenas is None:
            return 0
        return self.arenas.peak if peak else self.arenas.mapped

    def reserved(self) -> int:
        """What the process holds from the driver for the engine: the allocator's segments and the mapped weights."""
        if self.device.type != "cuda":
            return self.current()
        return torch.cuda.memory_reserved(self.device) + self._mapped() + self.host

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.arenas is not None:
            self.arenas.reset_peak()
        self.peak = self.current()

    def observe(self) -> int:
        now = self.current()
        if self.device.type == "cuda":
            now = max(now, torch.cuda.max_memory_allocated(self.device) + self._mapped(peak=True) + self.host)
        self.peak = max(self.peak, now)
        return now


class Loader:
    """Owns the skeleton, which components are resident, the request's memory accounting and the budget: every
    decision that compares bytes with the budget is made here. Not thread-safe beyond its own prefetch thread:
    the engine serialises requests."""

    def __init__(self, checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype,
                 budget: int | None = None, *, estimates: dict[str, int] | None = None,
                 on_swap: Callable[[Swap], None] | None = None, packed: PackedCache | None = None,
                 profile: DeviceProfile | None = None,
                 arena_driver: Callable[[torch.device], VmmDriver | None] | None = None):
        """`estimates`: the bytes each unit will take once loaded (the planner's), used until it has been.
        `packed`: where INT4 units are kept in the device's layout (orin.memory.packed_cache), or None to convert them
        on every load. `profile`: the device profile (orin.device.profile) the reads, the INT4 loads and the weight
        arenas are tuned by; the engine passes its own, else it is detected here. `arena_driver(device)`: the
        virtual memory management the weight arenas map with, or None for none (by default the device's own,
        orin.memory.vmm_driver.driver_for; tests pass a stand-in over the host's memory, or one that fails)."""
        if profile is None:
            from ..device.capabilities import detect

            profile = detect(device, dtype)
        self.ckpt = checkpoint
        self.packed = packed
        self.device = device
        self.dtype = dtype
        self.budget = budget
        self.profile = profile
        self.skeleton = Skeleton(checkpoint, device)
        self.model = self.skeleton.model
        self.shells = self.skeleton.shells
        self._units = self.skeleton.units
        # Time-sliced, each unit's weights are mapped at addresses of their own and unmapped when it goes
        # (orin.memory.arena), within the profile's bounds; a unit whose mapping fails is on the allocator from
        # then on. Without the driver's virtual memory management, a memory pool (weights_memory).
        driver = (arena_driver or driver_for)(device) if budget is not None else None
        # a unit gone to the allocator mid-load: the cap had left its bytes to be mapped, so it is set again
        self._arenas = (Arenas(driver, profile.memory, budget, on_fallback=lambda unit: self._cap())
                        if driver is not None else None)
        if self._arenas is not None and device.type == "cuda":
            # the allocator's cap needs the device by its index: a bare "cuda" is refused
            self._device_index = device.index if device.index is not None else torch.cuda.current_device()
            self._device_total = torch.cuda.get_device_properties(self._device_index).total_memory
            # what the process's allocator holds for tensors still alive (another engine, in a test or a bench):
            # not this budget's. Its cached free blocks go back first: counted as held before, they would raise
            # the cap by their size (an engine opened after a large read then held gigabytes over its budget).
            torch.cuda.empty_cache()
            self._held_before = torch.cuda.memory_reserved(device)
        unified = profile.capabilities.unified_memory and device.type == "cuda"
        self._memory = MemoryTracker(device, arenas=self._arenas,  # its `resident`: bytes per resident unit
                                     host=pinned_host_bytes(profile.memory) if unified else 0)
        if estimates is None:  # the planner's, as the engine passes them
            from .model_sizes import size_model

            sized = size_model(checkpoint.config, checkpoint.spec, checkpoint.split, dtype_bytes=dtype.itemsize)
            estimates = {u: b for s in sized.components.values() for u, b in s.units.items()}
        self._estimates = dict(estimates)
        self._measured: dict[str, int] = {}
        self._on_swap = on_swap
        self._swaps: list[Swap] = []
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orin-prefetch")
        self._pending: dict[str, Future] = {}
        self._mem_pool = None  # the device memory pool weights are allocated from (weights_memory)
        self._reader = UnitReader(self.skeleton, checkpoint, device, dtype, self._arenas, profile)

    # ------------------------------------------------------------------ state

    def resident(self) -> tuple[str, ...]:
        """The components wholly resident."""
        return tuple(c for c in C.NAMES if self.is_resident(c))

    def resident_units(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(sorted(self._memory.resident, key=C.unit_sort_key))

    def resident_bytes(self) -> int:
        return sum(self._memory.resident.values())

    def is_resident(self, component: str) -> bool:
        units = self._units[component]
        return bool(units) and all(u in self._memory.resident for u in units)

    def units(self, component: str) -> tuple[str, ...]:
        return tuple(self._units[component])

    def unit_sizes(self) -> dict[str, int]:
        """Bytes each unit takes on the device: measured where it has been loaded, else the estimate."""
        with self._lock:
            return {**self._estimates, **self._measured}

    def sizes(self) -> dict[str, int]:
        """Bytes each component takes on the device (its units' sizes), where every unit's is known."""
        known = self.unit_sizes()
        return {c: sum(known[u] for u in units) for c, units in self._units.items()
                if units and all(u in known for u in units)}

    # ------------------------------------------------------------------ the request's memory

    def begin_request(self) -> None:
        """Start the request's peak from what is allocated now. Its swaps are those since the last request's
        `take_swaps` (a prefetch started after that request, for this one, counts here)."""
        self._memory.reset_peak()

    def take_swaps(self) -> tuple[Swap, ...]:
        """The swaps since the last call (the request's, for its report), forgotten here."""
        with self._lock:  # a prefetch thread may be recording one
            swaps = tuple(self._swaps)
            self._swaps.clear()
        return swaps

    def set_cache_bytes(self, nbytes: int) -> None:
        """The KV caches the running stage holds (counted on CPU, where torch keeps no allocator statistics)."""
        self._memory.dynamic = nbytes
        self._memory.observe()

    def observe(self) -> int:
        return self._memory.observe()

    def allocated_bytes(self) -> int:
        return self._memory.current()

    def peak_bytes(self) -> int:
        return self._memory.peak

    def mapped_bytes(self, peak_ever: bool = False) -> int | None:
        """The weights mapped outside the allocator (orin.memory.arena) now, or at most since the loader was made;
        None where the weights live in the allocator (all-resident, no virtual memory management, off CUDA)."""
        if self._arenas is None:
            return None
        return self._arenas.peak_ever if peak_ever else self._arenas.mapped

    def swaps(self) -> tuple[Swap, ...]:
        """The swaps since the last take_swaps()."""
        with self._lock:
            return tuple(self._swaps)

    def _record(self, swap: Swap) -> None:
        with self._lock:
            self._swaps.append(swap)
        if self._on_swap is not None:
            self._on_swap(swap)

    # ------------------------------------------------------------------ loading

    def _load_units(self, component: str, units: set[str]) -> tuple[dict[str, int], int, int]:
        """Load these units of `component` (orin.memory.unit_reader): (the bytes each now holds, how many came from their
        packed copies, how many packed copies were written)."""
        return self._reader.read(component, units, self.packed)

    def _missing(self, component: str) -> list[str]:
        return [u for u in self._units[component] if u not in self._memory.resident]

    def weights_memory(self):
        """A context in which the calling thread's device allocations come from the weights' own memory pool
        (CUDA, where torch has MemPool and the weights have no arenas; elsewhere nothing changes). Kept apart
        from the activations and caches, a pool that only ever holds weights gives a component swapped out and
        in again the blocks it had: a stream of requests moves the same units in the same order, so they land at
        the same addresses and the CUDA graphs captured over them stay valid. In the common pool the decode's and
        prefill's allocations, made meanwhile on the other thread, took those blocks, and re-capturing the
        talker's and the code predictor's steps cost 0.3-0.5 s of a first audio packet.
        The pool never gives a block back while it lives, though: the arenas (orin.memory.arena) do both."""
        if self.device.type != "cuda" or self._arenas is not None or not hasattr(torch.cuda, "use_mem_pool"):
            return contextlib.nullcontext()
        with self._lock:
            if self._mem_pool is None:
                self._mem_pool = torch.cuda.MemPool()
        # the device by its index: use_mem_pool refuses a bare "cuda"
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return torch.cuda.use_mem_pool(self._mem_pool, index)

    def _load_timed(self, component: str, background: bool) -> None:
        start = time.perf_counter()
        units = self._missing(component)
        if self._arenas is not None:
            sizes = self.unit_sizes()
            # what is about to be mapped (a unit on the fallback comes from the allocator, under its cap)
            incoming = sum(sizes.get(unit, 0) for unit in units if self._arenas.of(unit).fallback is None)
            self._trim(incoming)  # the allocator's cache gives way to what is about to be mapped
            for unit in units:
                self._arenas.of(unit).begin(sizes.get(unit, 0))
        try:
            with self.weights_memory():
                got, packed, written = self._load_units(component, set(units))
        except BaseException:
            self._abandon(set(units))
            raise
        with self._lock:
            self._memory.resident.update(got)
            self._measured.update(got)
        if self.budget is not None:
            self._trim()  # what a load's blocks could not reuse of the cache
        nbytes = sum(got.values())
        self._record(Swap(component, "in", nbytes, time.perf_counter() - start, background, len(units),
                          len(self._units[component]), packed, written))
        self._memory.observe()
        log.info("swap in  %-15s %10d bytes %.3f s%s (%d of %d units; %d from packed copies, %d written)",
                 component, nbytes, time.perf_counter() - start, " (prefetch)" if background else "", len(units),
                 len(self._units[component]), packed, written)

    def ensure(self, component: str) -> None:
        """Make `component` wholly resident (waiting for a prefetch of it, if one is running)."""
        pending = self._pending.pop(component, None)
        if pending is not None:
            pending.result()
        if not self.is_resident(component):
            self._load_timed(component, background=False)

    def arrived(self, comps: tuple[str, ...]) -> bool:
        """Whether staging `comps` now would not wait for a background load still under way (one that has not
        started is loaded by the staging itself: waiting would not bring it)."""
        return all(self._pending[c].done() for c in comps if c in self._pending)

    def prefetch(self, component: str) -> None:
        """Start loading what `component` lacks in the background; the caller has checked the budget allows it."""
        if self.is_resident(component) or component in self._pending:
            return
        self._pending[component] = self._pool.submit(self._load_timed, component, True)

    def evict(self, component: str) -> None:
        """Swap out every unit of `component` that is resident."""
        pending = self._pending.pop(component, None)
        if pending is not None:
            pending.result()
        self.evict_units([u for u in self._units[component] if u in self._memory.resident])

    def evict_units(self, units: list[str]) -> None:
        """Swap these units out (waiting first for a prefetch that is loading them), freeing their memory."""
        for comp in dict.fromkeys(C.unit_component(u) for u in units):
            pending = self._pending.pop(comp, None)
            if pending is not None:
                pending.result()
        gone = {u for u in units if u in self._memory.resident}
        if not gone:
            return
        start = time.perf_counter()
        # Weak references to every tensor given up: once they are all dead, the memory is the allocator's again.
        # (Comparing memory_allocated before and after cannot tell: a prefetch thread may be loading the next
        # component meanwhile, which made a clean eviction look half-done.)
        released = self.skeleton.release(gone)
        if any(ref() is not None for refs in released.values() for ref in refs):
            gc.collect()  # only where a reference cycle may hold one: a full collection costs tens of ms
        for comp, refs in released.items():
            alive = sum(ref() is not None for ref in refs)
            if alive:
                raise RuntimeError(f"evicting {comp}: {alive} of its {len(refs)} tensors are still referenced "
                                   "elsewhere, so their memory is not freed")
        if self._arenas is not None:
            self._arenas.release(gone)
        self._trim()
        seconds = time.perf_counter() - start
        freed: dict[str, list[int]] = {}
        with self._lock:
            for unit in sorted(gone, key=C.unit_sort_key):
                freed.setdefault(C.unit_component(unit), []).append(self._memory.resident.pop(unit))
        for comp, sizes in freed.items():
            self._record(Swap(comp, "out", sum(sizes), seconds, units=len(sizes), of_units=len(self._units[comp])))
            log.info("swap out %-15s %10d bytes %.3f s (%d of %d units)", comp, sum(sizes), seconds, len(sizes),
                     len(self._units[comp]))

    def _trim(self, incoming: int = 0) -> None:
        """Cap the allocator at what the budget leaves (_cap), then give its cached blocks back where the process
        holds more than its budget (with `incoming` bytes about to be mapped beside it), or always, without one.
        Kept otherwise, for the next load: returning them (cudaFree, each synchronising the device) took 0.3-0.4 s
        an eviction on an H200."""
        self._cap(incoming)
        if self.device.type == "cuda" and (self.budget is None or self._memory.reserved() + incoming > self.budget):
            with GATE:  # never during another thread's capture
                torch.cuda.empty_cache()

    def _cap(self, incoming: int = 0) -> None:
        """Where the weights are mapped outside the allocator (arenas), cap the allocator at what the budget
        leaves beside them (and `incoming` bytes about to be mapped): at the cap it frees its cached blocks
        before it takes more from the driver, so the process holds no more than the budget, KV caches,
        activations and graphs included. Trimmed only between stages, its cache grew 0.1-0.2 GiB past the budget.
        The plan keeps what is allocated under the budget; the cap is on the cache."""
        if self._arenas is None or self.budget is None or self.device.type != "cuda":
            return
        room = self._held_before + max(self.budget - self._arenas.mapped - self._memory.host - incoming, 0)
        torch.cuda.set_per_process_memory_fraction(min(room / self._device_total, 1.0), self._device_index)

    def _held(self) -> dict[str, int]:
        """Bytes per unit resident or arriving by a prefetch already started, one consistent snapshot: a prefetch
        landing between two separate reads would be counted twice."""
        sizes = self.unit_sizes()
        with self._lock:
            held = dict(self._memory.resident)
        for comp in self._pending:
            for unit in self._units[comp]:
                held.setdefault(unit, sizes[unit])
        return held

    def _incoming(self, held: dict[str, int], comps: tuple[str, ...]) -> int:
        sizes = self.unit_sizes()
        return sum(sizes[u] for c in comps for u in self._units[c] if u not in held)

    def stage(self, call: residency.StageCall) -> None:
        """Make `call.comps` wholly resident with `call.working` bytes (KV caches, activations, margin) beside
        them, evicting what orin.memory.residency says gives way where the budget needs room; then start loading
        `call.next_comps` in the background where they fit once what the request needs no more gives way.
        `call.wait=False` makes the room and starts loading `call.comps` in the background instead."""
        comps, working = call.comps, call.working
        if self.budget is not None:
            held = self._held()
            order = residency.eviction_order(held, comps, call.later)
            gone = residency.to_evict(held, self._incoming(held, comps), working, self.budget, order)
            if gone:
                self.evict_units(gone)
            held = self._held()
            incoming = self._incoming(held, comps)
            if sum(held.values()) + incoming + working > self.budget:
                raise BudgetError(f"cannot fit {', '.join(comps)} in the budget: resident or arriving "
                                  f"{sum(held.values())} + loading {incoming} + working {working} bytes")
        if not call.wait:  # between requests: the next one's first stage, loaded in the background
            for c in comps:
                self.prefetch(c)
            return
        for c in comps:
            self.ensure(c)
        self._memory.observe()
        for c in call.next_comps:
            if self.is_resident(c) or c in self._pending:
                continue
            if self.budget is not None:
                held = self._held()
                gone = residency.prefetch_room(held, self._incoming(held, (c,)), call, self.budget)
                if gone is None:
                    continue
                self.evict_units(gone)
            self.prefetch(c)

    def settle(self) -> None:
        """Wait for the background loads under way (each then resident, or its error raised here)."""
        for comp in list(self._pending):
            self._pending.pop(comp).result()

    def close(self) -> None:
        """Stop the loading thread; then, where the weights have arenas or a pool of their own, give their memory
        back now: the pool keeps its blocks while it lives, so an engine closed but not yet collected (a reference
        cycle) held gigabytes of reserved memory into the next engine's run."""
        self._pool.shutdown(wait=True)
        if self._mem_pool is None and self._arenas is None:
            return
        with self._lock:
            units = set(self._memory.resident)
            self._memory.resident.clear()
        self.skeleton.release(units)
        self._mem_pool = None
        gc.collect()
        if self._arenas is not None:
            self._arenas.close()
            if self.device.type == "cuda":
                torch.cuda.set_per_process_memory_fraction(1.0, self._device_index)  # the process's next engine starts uncapped
        torch.cuda.empty_cache()

    def _abandon(self, units: set[str]) -> None:
        """After a failed load: give up what it assigned, so a later load of the units starts clean."""
        self.skeleton.release(units)
        if self._arenas is not None:
            try:
                self._arenas.release(units)
            except RuntimeError as exc:  # the failure's traceback may still hold a tensor: kept mapped
                log.warning("after a failed load: %s", exc)

