"""Device memory for swapped weights that is freed when they go and comes back at the same addresses.

A unit (orin.components) that the time-sliced loader swaps out must give its memory back to the device: on the
Orin that memory is what the robot's other processes run in. It should also come back at the addresses it had,
so the CUDA graphs captured over it replay instead of being captured again (0.3-0.5 s of a first audio packet).
torch's caching allocator cannot do both: a block freed into the common pool is soon taken by activations, and a
pool of the weights' own (torch.cuda.MemPool) keeps every block it ever held until the pool itself goes. With
weights in their own pool, the bench's 18 GiB engine held 22.4 GiB from the driver (a 4.4 GiB excess).

So each unit gets a range of virtual addresses of its own, reserved once, and physical memory is mapped into it
while the unit is loaded and unmapped (returned to the driver) when it is evicted, through CUDA's virtual memory
management (cuMemAddressReserve, cuMemCreate, cuMemMap). The tensors handed out are bumped from the range's
start in the order they are asked for: a unit loaded the same way lands where it was. This is the scheme vLLM's
sleep mode uses, without a compiled extension: the driver is reached through ctypes and the memory wrapped as
tensors through __cuda_array_interface__.

Where the driver lacks virtual memory management (`driver_for` returns None) the loader falls back to a memory
pool of the weights' own (orin.memory.loader.Loader.weights_memory).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import weakref
from functools import cache

import torch

log = logging.getLogger("orin.memory.arena")
# Tensors start on this boundary (the caching allocator's own): vectorised kernels read 16 bytes at a time.
ALIGN = 512
# A unit's range of addresses: its expected bytes times this, plus SLACK (addresses cost nothing; a unit that
# outgrows its range is given a new one, and its graphs are captured again).
RESERVE_FACTOR = 2
SLACK = 256 << 20
# Where a load outgrows what was mapped for it, the next this many bytes are mapped at once.
GROW = 8 << 20

_CU_MEM_ALLOCATION_TYPE_PINNED = 1
_CU_MEM_LOCATION_TYPE_DEVICE = 1
_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
_CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class DriverError(RuntimeError):
    """A CUDA driver call failed (its name and error code in the message)."""


class CudaVmm:
    """The few CUDA driver calls of virtual memory management, for one device."""

    def __init__(self, lib: ctypes.CDLL, index: int):
        self._lib = lib
        self.index = index
        self._prop = _AllocationProp(type=_CU_MEM_ALLOCATION_TYPE_PINNED,
                                     location=_Location(_CU_MEM_LOCATION_TYPE_DEVICE, index))
        self._access = _AccessDesc(location=_Location(_CU_MEM_LOCATION_TYPE_DEVICE, index),
                                   flags=_CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        granularity = ctypes.c_size_t()
        self._call("cuMemGetAllocationGranularity", ctypes.byref(granularity), ctypes.byref(self._prop),
                   ctypes.c_int(0))
        self.granularity = granularity.value
        self.device = torch.device("cuda", index)

    def _call(self, name: str, *args) -> None:
        code = getattr(self._lib, name)(*args)
        if code != 0:
            raise DriverError(f"{name} failed with CUDA driver error {code}")

    def reserve(self, size: int) -> int:
        ptr = ctypes.c_uint64()
        self._call("cuMemAddressReserve", ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0),
                   ctypes.c_uint64(0), ctypes.c_ulonglong(0))
        return ptr.value

    def free_addresses(self, ptr: int, size: int) -> None:
        self._call("cuMemAddressFree", ctypes.c_uint64(ptr), ctypes.c_size_t(size))

    def map(self, ptr: int, size: int) -> int:
        """Physical memory of `size` bytes mapped at `ptr`, readable and writable by the device: its handle."""
        handle = ctypes.c_uint64()
        self._call("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(self._prop),
                   ctypes.c_ulonglong(0))
        try:
            self._call("cuMemMap", ctypes.c_uint64(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0), handle,
                       ctypes.c_ulonglong(0))
        except DriverError:
            self._call("cuMemRelease", handle)
            raise
        try:
            self._call("cuMemSetAccess", ctypes.c_uint64(ptr), ctypes.c_size_t(size), ctypes.byref(self._access),
                       ctypes.c_size_t(1))
        except DriverError:
            self.unmap(ptr, size, handle.value)
            raise
        return handle.value

    def unmap(self, ptr: int, size: int, handle: int) -> None:
        self._call("cuMemUnmap", ctypes.c_uint64(ptr), ctypes.c_size_t(size))
        self._call("cuMemRelease", ctypes.c_uint64(handle))

    def tensor(self, ptr: int, nbytes: int, owner: object) -> torch.Tensor:
        """A uint8 tensor over `nbytes` at `ptr`, keeping `owner` alive while it (or a view of it) lives."""
        return torch.as_tensor(_Interface(ptr, nbytes, owner), device=self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.index)


class _Interface:
    """__cuda_array_interface__ over device memory torch did not allocate; torch keeps the object (and through
    it the owner) alive as long as the tensor made from it."""

    def __init__(self, ptr: int, nbytes: int, owner: object):
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


@cache
def _vmm(index: int) -> CudaVmm | None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        log.info("no CUDA driver library to map weights with (%s); weights use a memory pool", exc)
        return None
    supported = ctypes.c_int()
    device = ctypes.c_int()
    if (lib.cuDeviceGet(ctypes.byref(device), ctypes.c_int(index)) != 0
            or lib.cuDeviceGetAttribute(ctypes.byref(supported),
                                        _CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device) != 0
            or not supported.value):
        log.info("CUDA device %d has no virtual memory management; weights use a memory pool", index)
        return None
    try:
        return CudaVmm(lib, index)
    except (DriverError, AttributeError) as exc:
        log.info("CUDA virtual memory management unusable on device %d (%s); weights use a memory pool", index, exc)
        return None


def driver_for(device: torch.device) -> CudaVmm | None:
    """The device's virtual memory management, or None (not CUDA, or a driver without it)."""
    if device.type != "cuda":
        return None
    torch.cuda.init()  # the driver calls need the primary context torch makes current
    return _vmm(device.index if device.index is not None else torch.cuda.current_device())


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


class _Generation:
    """What one load of a unit handed out: every tensor of it keeps this alive (through _Interface.owner), so a
    weak reference to it says whether anything still reads the memory."""


class UnitArena:
    """One unit's range of addresses; physical memory mapped into it while the unit is loaded."""

    def __init__(self, driver, arenas: Arenas, name: str):
        self._driver = driver
        self._arenas = arenas
        self.name = name
        self.base = 0
        self.size = 0  # addresses reserved
        self._chunks: list[tuple[int, int, int]] = []  # (address, bytes, handle), in address order
        self._offset = 0
        self._last = 0  # bytes the last load took: what the next one maps at once
        self._spilt = 0  # where the last load would have ended, had its addresses sufficed
        self._gen: _Generation | None = None

    @property
    def mapped(self) -> int:
        return sum(size for _, size, _ in self._chunks)

    def begin(self, estimate: int) -> None:
        """Start a load: what the last load took (else `estimate` bytes) is mapped at once, more as asked for."""
        if self._gen is not None:
            raise RuntimeError(f"{self.name}: loaded again before it was released")
        need = _round_up(max(self._last or estimate, 1), self._driver.granularity)
        if max(need, self._spilt) > self.size:
            self._reserve(max(need, self._spilt))
        self._offset = self._spilt = 0
        self._gen = _Generation()
        self._grow(need)

    def _reserve(self, need: int) -> None:
        if self.size:
            self._driver.free_addresses(self.base, self.size)
            self.base = self.size = 0
        size = _round_up(need * RESERVE_FACTOR + SLACK, self._driver.granularity)
        self.base = self._driver.reserve(size)
        self.size = size

    def _grow(self, upto: int) -> None:
        mapped = self.mapped
        if upto <= mapped:
            return
        size = min(_round_up(max(upto - mapped, GROW), self._driver.granularity), self.size - mapped)
        handle = self._driver.map(self.base + mapped, size)
        self._chunks.append((self.base + mapped, size, handle))
        self._arenas._count(size)

    def take(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of the unit's memory, as a uint8 tensor (the next ones in the range)."""
        if self._gen is None:
            raise RuntimeError(f"{self.name}: memory asked for outside a load")
        start = _round_up(self._offset, ALIGN)
        end = start + max(nbytes, 1)
        if end > self.size or self._spilt:
            return self._spill(end, nbytes)
        self._grow(end)
        self._offset = end
        return self._driver.tensor(self.base + start, nbytes, self._gen)

    def _spill(self, end: int, nbytes: int) -> torch.Tensor:
        """Past the reserved addresses (the estimate was far off): the allocator's memory this time (freed when
        the unit goes, but not at a fixed address), and enough addresses from the next load on."""
        if not self._spilt:
            log.warning("%s: its weights outgrow the %d bytes of addresses reserved for them; the rest of this load "
                        "comes from the allocator", self.name, self.size)
        self._spilt = max(self._spilt, end)
        self._offset = end
        return torch.empty(nbytes, dtype=torch.uint8, device=self._driver.device)

    def holds(self, tensor: torch.Tensor) -> bool:
        ptr = tensor.data_ptr()
        return self._gen is not None and self.base <= ptr < self.base + min(self._offset, self.size)

    def adopt(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` in the unit's memory: itself where it is there already, else a copy (the original is the
        caller's to drop)."""
        if tensor.device.type == "meta" or self.holds(tensor):
            return tensor
        if self._spilt:  # no room left: as it is, but not as a view keeping a larger block alive
            return tensor.clone() if tensor._base is not None else tensor
        src = tensor.contiguous()
        out = self.take(src.numel() * src.element_size()).view(src.dtype).view(src.shape)
        out.copy_(src)
        return out

    def release(self, synced: bool = False) -> None:
        """Unmap the unit's memory (the caller has dropped every tensor of it, and `synced` the device since);
        its addresses stay reserved."""
        if self._gen is None:
            return
        gen = weakref.ref(self._gen)
        self._gen = None
        if gen() is not None:
            import gc

            gc.collect()
        if gen() is not None:
            self._gen = gen()
            raise RuntimeError(f"{self.name}: a tensor of it is still referenced, so its memory cannot be freed")
        if not synced:
            self._driver.synchronize()  # kernels queued may still read it
        for ptr, size, handle in self._chunks:
            self._driver.unmap(ptr, size, handle)
            self._arenas._count(-size)
        self._chunks.clear()
        self._last, self._offset = self._offset, 0

    def close(self) -> None:
        self.release()
        if self.size:
            self._driver.free_addresses(self.base, self.size)
            self.base = self.size = 0


class Arenas:
    """Every unit's arena on one device, and the bytes mapped across them (now, the peak since reset_peak, and
    the peak since they were made)."""

    def __init__(self, driver):
        self._driver = driver
        self._by_unit: dict[str, UnitArena] = {}
        self._lock = threading.Lock()
        self.mapped = 0
        self.peak = 0  # since reset_peak
        self.peak_ever = 0

    def _count(self, delta: int) -> None:
        with self._lock:
            self.mapped += delta
            self.peak = max(self.peak, self.mapped)
            self.peak_ever = max(self.peak_ever, self.mapped)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.mapped

    def of(self, unit: str) -> UnitArena:
        with self._lock:
            if unit not in self._by_unit:
                self._by_unit[unit] = UnitArena(self._driver, self, unit)
            return self._by_unit[unit]

    def adopt(self, unit: str, tensor: torch.Tensor) -> torch.Tensor:
        return self.of(unit).adopt(tensor)

    def release(self, units) -> None:
        """Unmap these units' memory, after one wait for the kernels queued (which may still read it)."""
        arenas = [self._by_unit[u] for u in units if u in self._by_unit]
        if arenas:
            self._driver.synchronize()
        for arena in arenas:
            arena.release(synced=True)

    def close(self) -> None:
        for arena in self._by_unit.values():
            arena.close()
        self._by_unit.clear()
