"""The driver calls the weight arenas (orin.memory.arena) make: CUDA's virtual memory management, reached through
ctypes (cuMemAddressReserve, cuMemCreate, cuMemMap, cuMemSetAccess and their inverses), with the memory wrapped as
tensors through __cuda_array_interface__.

`VmmDriver` is the seam: the arenas call only its methods. Its `map` and `unmap` are built here from the five
memory calls, so that a chunk is mapped whole or not at all (a handle created whose map or set-access then fails
is given back at once); `CudaVmm` makes those calls on the device, and the tests' stand-ins make them over the
host's own address space, refusing or failing them on purpose.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache

import torch

from ..device import cuda_abi as abi

log = logging.getLogger("orin.memory.arena")



class DriverError(RuntimeError):
    """A call of virtual memory management that failed, or that the arenas refused to make (past the profile's
    bounds): `call` is the driver function's name, `size` the bytes it was for, `code` the driver's result
    (CUDA_ERROR_OUT_OF_MEMORY is 2), None where the driver was not asked."""

    def __init__(self, call: str, size: int, why: str, code: int | None = None):
        super().__init__(f"{call} of {size} bytes {why}")
        self.call = call
        self.size = size
        self.code = code


class VmmDriver:
    """A device's virtual memory management as the arenas use it. Subclasses set `granularity` (what sizes and
    addresses are multiples of) and `device` (where the fallback's tensors go), and make the calls below; each
    raises DriverError where the driver refuses."""

    granularity: int
    device: torch.device

    def reserve(self, size: int) -> int:
        """`size` bytes of addresses (cuMemAddressReserve): the first."""
        raise NotImplementedError

    def free_addresses(self, ptr: int, size: int) -> None:
        raise NotImplementedError

    def mem_create(self, size: int) -> int:
        """Physical memory of `size` bytes (cuMemCreate): its handle."""
        raise NotImplementedError

    def mem_map(self, ptr: int, size: int, handle: int) -> None:
        raise NotImplementedError

    def mem_set_access(self, ptr: int, size: int) -> None:
        raise NotImplementedError

    def mem_unmap(self, ptr: int, size: int) -> None:
        raise NotImplementedError

    def mem_release(self, handle: int) -> None:
        raise NotImplementedError

    def tensor(self, ptr: int, nbytes: int, owner: object) -> torch.Tensor:
        """A uint8 tensor over `nbytes` at `ptr`, keeping `owner` alive while it (or a view of it) lives."""
        raise NotImplementedError

    def synchronize(self) -> None:
        raise NotImplementedError

    def map(self, ptr: int, size: int) -> int:
        """Physical memory of `size` bytes mapped at `ptr`, readable and writable by the device: its handle. All
        or nothing: where a step fails, what the earlier ones made is undone before the error is raised."""
        handle = self.mem_create(size)
        try:
            self.mem_map(ptr, size, handle)
        except DriverError:
            self.mem_release(handle)
            raise
        try:
            self.mem_set_access(ptr, size)
        except DriverError:
            self.unmap(ptr, size, handle)
            raise
        return handle

    def unmap(self, ptr: int, size: int, handle: int) -> None:
        self.mem_unmap(ptr, size)
        self.mem_release(handle)


class CudaVmm(VmmDriver):
    """The CUDA driver's calls of virtual memory management, for one device."""

    def __init__(self, lib: ctypes.CDLL, index: int):
        self._lib = lib
        self.index = index
        self._prop = abi.device_memory(index)
        self._access = abi.read_write(index)
        granularity = ctypes.c_size_t()
        self._call("cuMemGetAllocationGranularity", 0, ctypes.byref(granularity), ctypes.byref(self._prop),
                   ctypes.c_int(abi.GRANULARITY_MINIMUM))
        self.granularity = granularity.value
        self.device = torch.device("cuda", index)

    def _call(self, name: str, size: int, *args) -> None:
        code = getattr(self._lib, name)(*args)
        if code != 0:
            raise DriverError(name, size, f"failed with CUDA driver error {code}", code)

    def reserve(self, size: int) -> int:
        ptr = ctypes.c_uint64()
        self._call("cuMemAddressReserve", size, ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0),
                   ctypes.c_uint64(0), ctypes.c_ulonglong(0))
        return ptr.value

    def free_addresses(self, ptr: int, size: int) -> None:
        self._call("cuMemAddressFree", size, ctypes.c_uint64(ptr), ctypes.c_size_t(size))

    def mem_create(self, size: int) -> int:
        handle = ctypes.c_uint64()
        self._call("cuMemCreate", size, ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(self._prop),
                   ctypes.c_ulonglong(0))
        return handle.value

    def mem_map(self, ptr: int, size: int, handle: int) -> None:
        self._call("cuMemMap", size, ctypes.c_uint64(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0),
                   ctypes.c_uint64(handle), ctypes.c_ulonglong(0))

    def mem_set_access(self, ptr: int, size: int) -> None:
        self._call("cuMemSetAccess", size, ctypes.c_uint64(ptr), ctypes.c_size_t(size), ctypes.byref(self._access),
                   ctypes.c_size_t(1))

    def mem_unmap(self, ptr: int, size: int) -> None:
        self._call("cuMemUnmap", size, ctypes.c_uint64(ptr), ctypes.c_size_t(size))

    def mem_release(self, handle: int) -> None:
        self._call("cuMemRelease", 0, ctypes.c_uint64(handle))

    def tensor(self, ptr: int, nbytes: int, owner: object) -> torch.Tensor:
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
                                        abi.ATTR_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device) != 0
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
