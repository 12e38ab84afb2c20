"""The time-sliced loader: components swapped in and out of device memory under a budget.

The model skeleton is built once with every parameter on the meta device (buffers, a few MiB of rotary tables
and offsets, are real). A component is loaded by reading its tensors straight from safetensors onto the target
device and assigning them into the skeleton; INT4 modules are converted from their GPTQ tensors one module (one
batch of experts) at a time, so no component is ever held twice. Swapping out replaces the tensors with meta tensors, frees them and
empties the allocator cache: the Orin's memory is unified, so "offloading to CPU" would free nothing, and
swapping in is a read from storage.
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
from .block_reader import BlockReader
from .checkpoint import Checkpoint
from .contract import Swap
from .errors import BudgetError, ModelError
from .hub_names import expert_part, to_runtime

log = logging.getLogger("orin.loader")


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
    activations). On CPU torch keeps no allocator statistics, so it is the exact byte count of the tensors the
    engine holds: resident weights plus the KV cache."""

    device: torch.device
    resident: dict[str, int] = field(default_factory=dict)
    dynamic: int = 0
    peak: int = 0

    def current(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return sum(self.resident.values()) + self.dynamic

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.peak = self.current()

    def observe(self) -> int:
        now = self.current()
        if self.device.type == "cuda":
            now = max(now, torch.cuda.max_memory_allocated(self.device))
        self.peak = max(self.peak, now)
        return now


class Loader:
    """Owns the skeleton, which components are resident, the request's memory accounting and the budget: every
    decision that compares bytes with the budget is made here. Not thread-safe beyond its own prefetch thread:
    the engine serialises requests."""

    def __init__(self, checkpoint: Checkpoint, device: torch.device, dtype: torch.dtype,
                 budget: int | None = None, estimates: dict[str, int] | None = None,
                 on_swap: Callable[[Swap], None] | None = None):
        from .int4 import convert_for_runtime
        from .model import OmniModel

        self.ckpt = checkpoint
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
        self._memory = MemoryTracker(device)
        # bytes a component will take once loaded: the planner's figures until it has been loaded once
        self._estimates = dict(estimates or {})
        self._on_swap = on_swap
        self._swaps: list[Swap] = []
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orin-prefetch")
        self._pending: dict[str, Future] = {}

    # ------------------------------------------------------------------ state

    def resident(self) -> tuple[str, ...]:
        return tuple(c for c in C.NAMES if c in self._memory.resident)

    def resident_bytes(self) -> int:
        return sum(self._memory.resident.values())

    def is_resident(self, component: str) -> bool:
        return component in self._memory.resident

    def sizes(self) -> dict[str, int]:
        """Bytes each component takes on the device: measured where it has been loaded, else the estimate."""
        return {**self._estimates, **self._memory.resident}

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

    def _assign(self, key: str, tensor: torch.Tensor) -> int:
        module_path, _, name = key.rpartition(".")
        module = self.model.get_submodule(module_path)
        if name in module._parameters:
            old = module._parameters[name]
            if tuple(old.shape) != tuple(tensor.shape):
                raise ModelError(f"{key}: checkpoint shape {tuple(tensor.shape)} does not match the model's "
                                 f"{tuple(old.shape)}; the checkpoint is for another model")
            if tensor.is_floating_point():
                tensor = tensor.to(self.dtype)
            module._parameters[name] = nn.Parameter(tensor, requires_grad=False)
        elif name in module._buffers:
            buf = module._buffers[name]
            module._buffers[name] = tensor.to(buf.dtype) if buf is not None and buf.is_floating_point() else tensor
        else:
            raise ModelError(f"{key}: the model has no such tensor; the checkpoint is for another model")
        return tensor.numel() * tensor.element_size()

    def _load_now(self, component: str) -> int:
        from .int4 import Int4Linear, load_int4_module

        total = 0
        shells = {p: m for p, m in self.shells.items() if C.component_of(p + ".") == component}
        for source in self.ckpt.sources(component):
            blocks = BlockReader(source.path, self.device)
            with source.open(self.device) as reader:
                for key, file_keys in source.plain.items():
                    total += self._assign(key, _read_plain(reader, key, file_keys))
                modules = list(source.int4_modules.items())
                for i, (path, int4) in enumerate(modules):
                    shell = shells[path]
                    # the next module's first read starts once this one has read all it needs (a Linear: at
                    # once; experts: with their last batch), so reading overlaps converting across modules too
                    then = _first_read(shells, modules[i + 1]) if i + 1 < len(modules) else []
                    tensors = _Relative(reader, int4.file_prefix, int4.keys, blocks, then)
                    if isinstance(shell, Int4Linear):
                        tensors.read_block(list(tensors))  # a Linear's tensors in one read
                        tensors.read_ahead([])
                    load_int4_module(shell, tensors, self.device, self.dtype, name=path)
                    total += _module_bytes(shell)
        missing = [n for n, p in self.model.named_parameters()
                   if C.component_of(n) == component and p.device.type == "meta"]
        if missing:
            raise ModelError(f"the checkpoint lacks {len(missing)} tensor(s) of {component}, e.g. {missing[0]}; "
                             "re-run orin-omni quantize")
        return total

    def _load_timed(self, component: str, background: bool) -> None:
        start = time.perf_counter()
        nbytes = self._load_now(component)
        with self._lock:
            self._memory.resident[component] = nbytes
        self._record(Swap(component, "in", nbytes, time.perf_counter() - start, background))
        self._memory.observe()
        log.info("swap in  %-15s %10d bytes %.3f s%s", component, nbytes, time.perf_counter() - start,
                 " (prefetch)" if background else "")

    def ensure(self, component: str) -> None:
        """Make `component` resident (waiting for a prefetch of it, if one is running)."""
        pending = self._pending.pop(component, None)
        if pending is not None:
            pending.result()
        if not self.is_resident(component):
            self._load_timed(component, background=False)

    def prefetch(self, component: str) -> None:
        """Start loading `component` in the background; the caller has checked the budget allows it."""
        if self.is_resident(component) or component in self._pending:
            return
        self._pending[component] = self._pool.submit(self._load_timed, component, True)

    def evict(self, component: str) -> None:
        from .int4 import unload_int4_module

        pending = self._pending.pop(component, None)
        if pending is not None:
            pending.result()
        if not self.is_resident(component):
            return
        start = time.perf_counter()
        # Weak references to every tensor given up: once they are all dead, the memory is the allocator's again.
        # (Comparing memory_allocated before and after cannot tell: a prefetch thread may be loading the next
        # component meanwhile, which made a clean eviction look half-done.)
        released = self._release_parameters(component)
        for path, shell in self.shells.items():
            if C.component_of(path + ".") == component:
                released.extend(weakref.ref(b) for b in shell.buffers() if b is not None)
                unload_int4_module(shell)
        gc.collect()
        alive = sum(ref() is not None for ref in released)
        if alive:
            raise RuntimeError(f"evicting {component}: {alive} of its {len(released)} tensors are still referenced "
                               "elsewhere, so their memory is not freed")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        with self._lock:
            nbytes = self._memory.resident.pop(component)
        self._record(Swap(component, "out", nbytes, time.perf_counter() - start))
        log.info("swap out %-15s %10d bytes %.3f s", component, nbytes, time.perf_counter() - start)

    def _committed(self, comps: tuple[str, ...]) -> tuple[int, int]:
        """(bytes resident or arriving by a prefetch already started, bytes `comps` still need loaded), one
        consistent snapshot: a prefetch landing between two separate reads would be counted twice."""
        with self._lock:
            resident = dict(self._memory.resident)
        sizes = {**self._estimates, **resident}
        arriving = [c for c in self._pending if c not in resident]
        held = sum(resident.values()) + sum(sizes[c] for c in arriving)
        return held, sum(sizes[c] for c in comps if c not in resident and c not in arriving)

    def _release_parameters(self, component: str) -> list[weakref.ref]:
        """Replace the component's parameters with meta ones; weak references to the ones given up."""
        released = []
        for name, param in list(self.model.named_parameters()):
            if C.component_of(name) == component and param.device.type != "meta":
                module_path, _, attr = name.rpartition(".")
                released.append(weakref.ref(param))
                self.model.get_submodule(module_path)._parameters[attr] = nn.Parameter(
                    torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=False)
        return released

    def stage(self, comps: tuple[str, ...], working: int, next_comps: tuple[str, ...] = (),
              prefetch: bool = True, later: tuple[str, ...] = (), wait: bool = True) -> None:
        """Make `comps` resident with `working` bytes (KV caches, activations, margin) beside them, evicting other
        components where the budget needs it; then start loading `next_comps` in the background where they fit
        beside all that. `later`: the components the request still needs after this stage, in order of use.
        Evicted first is what the request needs no more, then what it needs furthest ahead (so the thinker,
        needed next, stays beside the encoders while the speech components make room, where that is enough).
        `wait=False` makes the room and starts loading `comps` in the background instead."""
        order = [c for c in C.PIPELINE if c not in later] + [c for c in reversed(later) if c in C.BY_NAME]
        if self.budget is not None:
            for comp in order:
                held, incoming = self._committed(comps)
                if held + incoming + working <= self.budget:
                    break
                if (self.is_resident(comp) or comp in self._pending) and comp not in comps:
                    self.evict(comp)
            held, incoming = self._committed(comps)
            if held + incoming + working > self.budget:
                raise BudgetError(f"cannot fit {', '.join(comps)} in the budget: resident or arriving {held} + "
                                  f"loading {incoming} + working {working} bytes")
        if not wait:  # between requests: the next one's first stage, loaded in the background
            for c in comps:
                self.prefetch(c)
            return
        for c in comps:
            self.ensure(c)
        self._memory.observe()
        if not prefetch:
            return
        for c in next_comps:
            if self.is_resident(c) or c in self._pending:
                continue
            if self.budget is None or sum(self._committed((c,))) + working <= self.budget:
                self.prefetch(c)

    def settle(self) -> None:
        """Wait for the background loads under way (each then resident, or its error raised here)."""
        for comp in list(self._pending):
            self._pending.pop(comp).result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _read_plain(reader, key: str, file_keys: list[str]) -> torch.Tensor:
    """One runtime parameter from its file tensors: the tensor itself, or a fused experts tensor stacked from
    one weight per expert as the hub stores them (gate_up_proj [E, 2I, H]: each expert's gate rows, then up)."""
    if len(file_keys) == 1 and expert_part(to_runtime(file_keys[0])) is None:
        return reader.get_tensor(file_keys[0])
    parts = [reader.get_tensor(k) for k in file_keys]
    if key.endswith(".gate_up_proj"):
        if len(parts) % 2:
            raise ModelError(f"{key}: the checkpoint has an expert's gate_proj without its up_proj")
        return torch.stack([torch.cat(parts[i:i + 2], dim=0) for i in range(0, len(parts), 2)])
    return torch.stack(parts)


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
