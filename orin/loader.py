"""The time-sliced loader: components swapped in and out of device memory under a budget.

The model skeleton is built once with every parameter on the meta device (buffers, a few MiB of rotary tables
and offsets, are real). A component is loaded by reading its tensors straight from safetensors onto the target
device and assigning them into the skeleton; INT4 modules are converted from their GPTQ tensors one module (one
batch of experts) at a time, so no component is ever held twice, or, where the unit has a valid packed copy
(orin.packed_cache), read from it as they are; a unit converted is then written there for the next load. Swapping out replaces the tensors with meta
tensors, frees them and empties the allocator cache: the Orin's memory is unified, so "offloading to CPU" would
free nothing, and swapping in is a read from storage.

What moves is units (orin.components: a decoder's layers one by one, the rest of a component whole): a stage
gets its components whole, and what gives way for it is decided by orin.residency, unit by unit.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import nn

from . import components as C
from . import residency
from .block_reader import STAGE, BlockReader
from .checkpoint import Checkpoint
from .contract import Swap
from .cuda_gate import GATE
from .errors import BudgetError, ModelError
from .hub_names import expert_part, to_runtime
from .packed_cache import PackedCache
from .weight_arena import Arenas, driver_for

log = logging.getLogger("orin.loader")
# Plain (BF16) tensors are read this many bytes at a time (a staging buffer's worth): one read and one device copy
# per batch, the next batch read meanwhile; a batch is also the longest a capture or a prefill waits for the
# loading thread (orin.cuda_gate).
PLAIN_BATCH_BYTES = STAGE


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Build modules with parameters on the meta device and buffers real: parameters are what we load from
    storage; buffers (rotary inverse frequencies, codec offsets) are computed in __init__ and tiny."""
    original = nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


@dataclass
class MemoryTracker:
    """Peak memory of a request. On CUDA it is the allocator's own measurement (weights, KV cache and
    activations) plus the weights mapped outside it (orin.weight_arena; their peak and the allocator's are added,
    which can only overstate). On CPU torch keeps no allocator statistics, so it is the exact byte count of the
    tensors the engine holds: resident weights plus the KV cache."""

    device: torch.device
    resident: dict[str, int] = field(default_factory=dict)
    dynamic: int = 0
    peak: int = 0
    arenas: Arenas | None = None

    def current(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device) + self._mapped()
        return sum(self.resident.values()) + self.dynamic

    def _mapped(self, peak: bool = False) -> int:
        if self.arenas is None:
            return 0
        return self.arenas.peak if peak else self.arenas.mapped

    def reserved(self) -> int:
        """What the process holds from the driver for the engine: the allocator's segments and the mapped weights."""
        if self.device.type != "cuda":
            return self.current()
        return torch.cuda.memory_reserved(self.device) + self._mapped()

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            if self.arenas is not None:
                self.arenas.reset_peak()
        self.peak = self.current()

    def observe(self) -> int:
        now = self.current()
        if self.device.type == "cuda":
            now = max(now, torch.cuda.max_memory_allocated(self.device) + self._mapped(peak=True))
        self.peak = max(self.peak, now)
        return now


class Loader:
    """Owns the skeleton, which components are resident, the request's memory accounting and the budget: every
    decision that compares bytes with the budget is made here. Not thread-safe beyond its own prefetch thread:
    the engine serialises requests."""

    def __init__(self, checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype,
                 budget: int | None = None, estimates: dict[str, int] | None = None,
                 on_swap: Callable[[Swap], None] | None = None, packed: PackedCache | None = None):
        """`estimates`: the bytes each unit will take once loaded (the planner's), used until it has been.
        `packed`: where INT4 units are kept in the device's layout (orin.packed_cache), or None to convert them
        on every load."""
        from .int4 import convert_for_runtime
        from .model import OmniModel

        self.ckpt = checkpoint
        self.packed = packed
        self.device = device
        self.dtype = dtype
        self.budget = budget
        with params_on_meta():
            model = OmniModel(checkpoint.config)
        model.eval()
        self.shells = convert_for_runtime(model, checkpoint.quantized_modules)
        for buf_owner in model.modules():
            for name, buf in list(buf_owner._buffers.items()):
                if buf is not None and buf.device.type != "meta":
                    buf_owner._buffers[name] = buf.to(device)
        self.model = model
        self._units: dict[str, list[str]] = {c: [] for c in C.NAMES}
        # Each unit's parameters (owning module, attribute, name) and INT4 modules, found once: walking the whole
        # model's parameters and naming each one's unit took 20-40 ms of every swap.
        self._params: dict[str, list[tuple[nn.Module, str, str]]] = {}
        for name, _ in model.named_parameters():
            unit = C.unit_of(name)
            if unit is not None:
                module_path, _, attr = name.rpartition(".")
                self._params.setdefault(unit, []).append((model.get_submodule(module_path), attr, name))
        self._shell_unit = {p: C.unit_of(p + ".") for p in self.shells}
        for unit in [*self._params, *self._shell_unit.values()]:
            if unit is not None and unit not in self._units[C.unit_component(unit)]:
                self._units[C.unit_component(unit)].append(unit)
        for units in self._units.values():
            units.sort(key=C.unit_sort_key)
        # Time-sliced, each unit's weights are mapped at addresses of their own and unmapped when it goes
        # (orin.weight_arena); without the driver's virtual memory management, a memory pool (weights_memory).
        driver = driver_for(device) if budget is not None else None
        self._arenas = Arenas(driver) if driver is not None else None
        if self._arenas is not None and device.type == "cuda":
            # the allocator's cap needs the device by its index: a bare "cuda" is refused
            self._device_index = device.index if device.index is not None else torch.cuda.current_device()
            self._device_total = torch.cuda.get_device_properties(self._device_index).total_memory
            # what the process's allocator holds for tensors still alive (another engine, in a test or a bench):
            # not this budget's. Its cached free blocks go back first: counted as held before, they raised the
            # cap by their size, and an 18 GiB engine opened after a 17 GB read held 21.4 GiB (BENCHMARKS.md,
            # runs 44 and 46-47).
            torch.cuda.empty_cache()
            self._held_before = torch.cuda.memory_reserved(device)
        self._memory = MemoryTracker(device, arenas=self._arenas)  # its `resident`: bytes per resident unit
        if estimates is None:  # the planner's, as the engine passes them
            from .plan import size_model

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
        """The weights mapped outside the allocator (orin.weight_arena) now, or at most since the loader was made;
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

    def _keep(self, unit: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` where the unit's weights live: its arena (a copy, unless it was read there), or as it is."""
        return tensor if self._arenas is None else self._arenas.adopt(unit, tensor)

    def _keep_module(self, unit: str, module: nn.Module) -> None:
        """An INT4 module's buffers where the unit's weights live (through _apply, which also drops the views a
        module derived from its old buffers)."""
        if self._arenas is not None:
            module._apply(lambda t: self._arenas.adopt(unit, t), recurse=False)

    def _plain_alloc(self, blocks: BlockReader, batch: list[tuple[str, list[str]]]):
        """Where a batch of plain tensors is read to: straight into its unit's arena where each of them is kept as
        read (one unit's, each a whole runtime tensor, floats already in the runtime dtype); else (None) the
        allocator's memory, each tensor then copied to the arena by _keep."""
        if self._arenas is None:
            return None
        units = {C.unit_of(k) for k, _ in batch}
        if len(units) != 1 or any(len(fks) != 1 or expert_part(to_runtime(fks[0])) is not None for _, fks in batch):
            return None
        dtypes = {blocks.index[fks[0]][0] for _, fks in batch}
        if any(d.is_floating_point and d != self.dtype for d in dtypes):
            return None
        return self._arenas.of(units.pop()).take

    def _assign(self, key: str, tensor: torch.Tensor) -> int:
        module_path, _, name = key.rpartition(".")
        module = self.model.get_submodule(module_path)
        unit = C.unit_of(key)
        if name in module._parameters:
            old = module._parameters[name]
            if tuple(old.shape) != tuple(tensor.shape):
                raise ModelError(f"{key}: checkpoint shape {tuple(tensor.shape)} does not match the model's "
                                 f"{tuple(old.shape)}; the checkpoint is for another model")
            if tensor.is_floating_point():
                tensor = tensor.to(self.dtype)
            module._parameters[name] = nn.Parameter(self._keep(unit, tensor), requires_grad=False)
        elif name in module._buffers:
            buf = module._buffers[name]
            tensor = tensor.to(buf.dtype) if buf is not None and buf.is_floating_point() else tensor
            # a copy: a view would keep the whole block it was read in alive past the unit's eviction
            module._buffers[name] = tensor.clone() if self._arenas is None else self._keep(unit, tensor)
        else:
            raise ModelError(f"{key}: the model has no such tensor; the checkpoint is for another model")
        return tensor.numel() * tensor.element_size()

    def _load_units(self, component: str, units: set[str]) -> tuple[dict[str, int], int, int]:
        """Load these units of `component`: (the bytes each now holds, how many of them came from their packed
        copies, how many packed copies were written)."""
        from .int4 import Int4Linear, load_int4_module

        got = dict.fromkeys(units, 0)
        shells = {p: m for p, m in self.shells.items() if self._shell_unit[p] in units}
        files = [source.path for source in self.ckpt.sources(component)]
        packed = 0
        if self.packed is not None:  # INT4 units with a valid packed copy: read, not converted
            packed = self._load_all_packed(sorted({self._shell_unit[p] for p in shells}, key=C.unit_sort_key),
                                           files, shells, got)
        shells = {p: m for p, m in shells.items() if not m.is_loaded}
        for source in self.ckpt.sources(component):
            blocks = BlockReader(source.path, self.device)
            with _LazyReader(source, self.device) as reader:
                modules = [(p, m) for p, m in source.int4_modules.items() if p in shells]
                plain = [(k, fks) for k, fks in source.plain.items() if C.unit_of(k) in got]
                batches = _plain_batches(blocks, plain)
                for i, batch in enumerate(batches):
                    with GATE:  # a batch in one read (the next one read meanwhile), views of one device block
                        # no gaps: a view must not keep bytes of other tensors (or other units) alive
                        then = [k for _, fks in batches[i + 1] for k in fks] if i + 1 < len(batches) else None
                        tensors = blocks.read([k for _, fks in batch for k in fks], max_gap=0, then=then,
                                              alloc=self._plain_alloc(blocks, batch))
                        if then is None and modules:
                            blocks.read_ahead(_first_read(shells, modules[0]))
                        for key, file_keys in batch:
                            got[C.unit_of(key)] += self._assign(
                                key, _assemble(key, file_keys, [tensors.pop(k) for k in file_keys]))
                for i, (path, int4) in enumerate(modules):
                    shell = shells[path]
                    # the next module's first read starts once this one has read all it needs (a Linear: at
                    # once; experts: with their last batch), so reading overlaps converting across modules too
                    then = _first_read(shells, modules[i + 1]) if i + 1 < len(modules) else []
                    tensors = _Relative(reader, int4.file_prefix, int4.keys, blocks, then)
                    with GATE:
                        if isinstance(shell, Int4Linear):
                            tensors.read_block(list(tensors))  # a Linear's tensors in one read
                            tensors.read_ahead([])
                        load_int4_module(shell, tensors, self.device, self.dtype, name=path)
                        self._keep_module(self._shell_unit[path], shell)
                    got[C.unit_of(path + ".")] += _module_bytes(shell)
        missing = [name for unit in units for module, attr, name in self._params.get(unit, ())
                   if module._parameters[attr].device.type == "meta"]
        if missing:
            raise ModelError(f"the checkpoint lacks {len(missing)} tensor(s) of {component}, e.g. {missing[0]}; "
                             "re-run orin-omni quantize")
        written = 0
        if self.packed is not None:  # what was converted is kept, for the next load
            for unit in sorted({self._shell_unit[p] for p in shells}, key=C.unit_sort_key):
                modules = {p: m for p, m in shells.items() if self._shell_unit[p] == unit}
                written += bool(self.packed.store(unit, files, modules))
        return got, packed, written

    def _load_all_packed(self, units: list[str], files: list, shells: dict, got: dict[str, int]) -> int:
        """The units that have a valid packed copy, loaded from it one after the other, each unit's last read
        reading the next one's first batch ahead (a talker load is 20 units of ~80 MB: each first read waiting on
        the disk alone was 66 of its 162 ms, BENCHMARKS.md run 48). How many were loaded so."""
        found = [(unit, hit) for unit in units if (hit := self.packed.find(unit, files)) is not None]
        readers = [BlockReader(hit.path, self.device) for _, hit in found]
        batches = [_name_batches(blocks, hit.names) for blocks, (_, hit) in zip(readers, found, strict=True)]
        loaded = 0
        try:
            for i, (unit, hit) in enumerate(found):
                after = (readers[i + 1], batches[i + 1][0]) if i + 1 < len(found) and batches[i + 1] else None
                loaded += self._load_packed(unit, hit, shells, got, readers[i], batches[i], after)
        finally:
            for blocks in readers:  # a read ahead that no load took (a copy refused, or an error)
                blocks.drop_ahead()
        return loaded

    def _load_packed(self, unit: str, hit, shells: dict, got: dict[str, int], blocks: BlockReader,
                     batches: list[list[str]], after: tuple[BlockReader, list[str]] | None) -> bool:
        """Fill the unit's INT4 modules from their packed copy: its tensors read in batches (the next read
        meanwhile: this unit's next batch, or `after`'s names from its reader), taken as the modules' buffers
        without a copy. False where the copy does not fit the modules (then they stay empty, to be converted)."""
        mine = {p for p in shells if self._shell_unit[p] == unit}
        if set(hit.buffers) != mine:
            log.warning("%s: the packed copy holds other modules than %s has; converting it", hit.path, unit)
            blocks.drop_ahead()  # its first batch, read ahead into a staging buffer the next unit's reads take
            return False
        # read straight into the unit's arena (no copy), where it has one
        alloc = None if self._arenas is None else self._arenas.of(unit).take
        tensors: dict = {}
        for i, batch in enumerate(batches):
            if i + 1 < len(batches):
                then, then_in = batches[i + 1], None
            else:
                then_in, then = after or (None, None)
            with GATE:
                tensors.update(blocks.read(batch, max_gap=0, then=then, alloc=alloc, then_in=then_in))
        try:
            for path, names in hit.buffers.items():
                shells[path].load_packed_({b: tensors[n] for b, n in names.items()}, hit.meta[path], self.device,
                                          name=path)
                self._keep_module(unit, shells[path])  # a tensor the reader had to copy (misaligned)
        except (ModelError, KeyError) as exc:
            log.warning("%s: %s; converting %s from the checkpoint", hit.path, exc, unit)
            for path in mine:
                shells[path].unload_()
            return False
        got[unit] += sum(_module_bytes(shells[p]) for p in mine)
        return True

    def _missing(self, component: str) -> list[str]:
        return [u for u in self._units[component] if u not in self._memory.resident]

    def weights_memory(self):
        """A context in which the calling thread's device allocations come from the weights' own memory pool
        (CUDA, where torch has MemPool and the weights have no arenas; elsewhere nothing changes). Kept apart
        from the activations and caches, a pool that only ever holds weights gives a component swapped out and
        in again the blocks it had: a stream of requests moves the same units in the same order, so they land at
        the same addresses and the CUDA graphs captured over them stay valid. In the common pool the decode's and
        prefill's allocations, made meanwhile on the other thread, took those blocks, and re-capturing the
        talker's and the code predictor's steps cost 0.3-0.5 s of the 20 GiB first audio packet (BENCHMARKS.md).
        The pool never gives a block back while it lives, though: the arenas (orin.weight_arena) do both."""
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
            incoming = sum(sizes.get(unit, 0) for unit in units)
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
        released = self._release(gone)
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
        activations and graphs included. Trimmed only between stages, its cache had grown 0.1-0.2 GiB past it
        (BENCHMARKS.md, run 42). The plan keeps what is allocated under the budget; the cap is on the cache."""
        if self._arenas is None or self.budget is None or self.device.type != "cuda":
            return
        room = self._held_before + max(self.budget - self._arenas.mapped - incoming, 0)
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

    def _release(self, units: set[str]) -> dict[str, list[weakref.ref]]:
        """Give up the units' tensors: their parameters replaced with meta ones, their INT4 modules emptied. Weak
        references to what was given up, by component."""
        from .int4 import unload_int4_module

        released: dict[str, list[weakref.ref]] = {}
        for unit in units:
            for module, attr, name in self._params.get(unit, ()):
                param = module._parameters[attr]
                if param.device.type != "meta":
                    released.setdefault(C.component_of(name), []).append(weakref.ref(param))
                    module._parameters[attr] = nn.Parameter(
                        torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=False)
        for path, shell in self.shells.items():
            if self._shell_unit[path] in units:
                released.setdefault(C.component_of(path + "."), []).extend(
                    weakref.ref(b) for b in shell.buffers() if b is not None)
                unload_int4_module(shell)
        return released

    def stage(self, call: residency.StageCall) -> None:
        """Make `call.comps` wholly resident with `call.working` bytes (KV caches, activations, margin) beside
        them, evicting what orin.residency says gives way where the budget needs room; then start loading
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
        cycle) held 4 GiB of reserved memory into the next engine's run (BENCHMARKS.md, run 38)."""
        self._pool.shutdown(wait=True)
        if self._mem_pool is None and self._arenas is None:
            return
        with self._lock:
            units = set(self._memory.resident)
            self._memory.resident.clear()
        self._release(units)
        self._mem_pool = None
        gc.collect()
        if self._arenas is not None:
            self._arenas.close()
            if self.device.type == "cuda":
                torch.cuda.set_per_process_memory_fraction(1.0, self._device_index)  # the process's next engine starts uncapped
        torch.cuda.empty_cache()

    def _abandon(self, units: set[str]) -> None:
        """After a failed load: give up what it assigned, so a later load of the units starts clean."""
        self._release(units)
        if self._arenas is not None:
            try:
                self._arenas.release(units)
            except RuntimeError as exc:  # the failure's traceback may still hold a tensor: kept mapped
                log.warning("after a failed load: %s", exc)


def _assemble(key: str, file_keys: list[str], parts: list[torch.Tensor]) -> torch.Tensor:
    """One runtime parameter from its file tensors: the tensor itself, or a fused experts tensor stacked from
    one weight per expert as the hub stores them (gate_up_proj [E, 2I, H]: each expert's gate rows, then up)."""
    if len(parts) == 1 and expert_part(to_runtime(file_keys[0])) is None:
        return parts[0]
    if key.endswith(".gate_up_proj"):
        if len(parts) % 2:
            raise ModelError(f"{key}: the checkpoint has an expert's gate_proj without its up_proj")
        return torch.stack([torch.cat(parts[i:i + 2], dim=0) for i in range(0, len(parts), 2)])
    return torch.stack(parts)


def _plain_batches(blocks: BlockReader, plain: list[tuple[str, list[str]]],
                   limit: int = PLAIN_BATCH_BYTES) -> list[list[tuple[str, list[str]]]]:
    """The plain tensors unit by unit, in file order, in batches of about `limit` bytes (one read each). A batch
    never spans two units: its tensors are views of one device block, which lives until the last of them goes."""
    def order(item):
        return C.unit_sort_key(C.unit_of(item[0])), min(blocks.index[k][2] for k in item[1])

    def size(item):
        return sum(blocks.index[k][3] - blocks.index[k][2] for k in item[1])

    batches: list[list] = []
    held, unit = 0, None
    for item in sorted(plain, key=order):
        if not batches or held + size(item) > limit or C.unit_of(item[0]) != unit:
            batches.append([])
            held, unit = 0, C.unit_of(item[0])
        batches[-1].append(item)
        held += size(item)
    return batches


def _name_batches(blocks: BlockReader, names, limit: int = STAGE) -> list[list[str]]:
    """Consecutive tensors of one file (in file order) in batches of about `limit` bytes, a larger one alone."""
    batches: list[list[str]] = []
    held = 0
    for name in names:
        size = blocks.index[name][3] - blocks.index[name][2]
        if not batches or held + size > limit:
            batches.append([])
            held = 0
        batches[-1].append(name)
        held += size
    return batches


def _first_read(shells: dict, module) -> list[str]:
    """The file keys an INT4 module's load reads first: all of a Linear's, an experts module's first batch."""
    from .int4 import Int4Experts

    path, int4 = module
    shell = shells[path]
    if isinstance(shell, Int4Experts):
        return [f"{int4.file_prefix}.{k}" for k in shell.first_read_keys()]
    return list(int4.keys)


def _module_bytes(module: nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in module.buffers() if b is not None)


class _LazyReader:
    """A source's safetensors reader, opened on the first tensor asked for: opening one takes 60-140 ms on the
    real checkpoint (its header, every tensor of the file), and a load from packed copies or of plain tensors
    alone (read in blocks) asks for none."""

    def __init__(self, source, device: torch.device):
        self._source, self._device = source, device
        self._stack = contextlib.ExitStack()
        self._reader = None

    def get_tensor(self, key: str) -> torch.Tensor:
        if self._reader is None:
            self._reader = self._stack.enter_context(self._source.open(self._device))
        return self._reader.get_tensor(key)

    def __enter__(self) -> _LazyReader:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()


class _Relative(Mapping):
    """A lazy view of one INT4 module's checkpoint tensors, with keys relative to the module path; tensors are
    read from the open safetensors file only when the module asks for them, one at a time or, announced with
    `read_block`, many in one read (orin.block_reader)."""

    def __init__(self, reader, path: str, keys: list[str], blocks=None, then: list[str] = ()):
        self._reader = reader
        self._blocks = blocks
        self._then = then
        self._prefix = path + "."
        self._keys = dict.fromkeys(k[len(self._prefix):] for k in keys)  # ordered, and O(1) to look up
        self._ready: dict[str, torch.Tensor] = {}

    def read_block(self, keys) -> None:
        """Read these keys (those the module has) together; each is handed out once, then dropped here."""
        if self._blocks is not None:
            wanted = [self._prefix + k for k in keys if k in self._keys]
            n = len(self._prefix)
            self._ready.update((name[n:], t) for name, t in self._blocks.read(wanted).items())

    def read_ahead(self, keys) -> None:
        """Start reading these keys in the background; a later `read_block` of the same keys picks them up. With
        no keys (the module has read all it needs), the next module's first read (`then`, file keys) instead."""
        if self._blocks is not None:
            names = [self._prefix + k for k in keys if k in self._keys] if keys else list(self._then)
            if names:
                self._blocks.read_ahead(names)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys:
            raise KeyError(key)
        ready = self._ready.pop(key, None)
        return ready if ready is not None else self._reader.get_tensor(self._prefix + key)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)
