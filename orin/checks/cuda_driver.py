"""The CUDA driver calls the doctor's memory probes make (orin.checks.doctor_memory), through ctypes on
libcuda.so.1: device attributes, reserving and freeing addresses, creating and releasing physical memory, a plain
allocation, and registering host memory. No torch: the doctor reports on a board whose torch is missing or broken.

`CudaDriver` is the seam: the probes call only its methods, `LibCuda` makes the calls on the device, and the tests
hand the probes a stand-in that answers or refuses as a board would. Host registration goes through the driver
(cuMemHostRegister, what the runtime's cudaHostRegister calls) so that the doctor needs one library, not also a
libcudart of the right version.
"""

from __future__ import annotations

import ctypes

from ..device import cuda_abi as abi


class CudaCallError(RuntimeError):
    """A driver call that returned an error: `call` is the function, `code` its CUresult, `error` its name."""

    def __init__(self, call: str, code: int, error: str = ""):
        self.call = call
        self.code = code
        self.error = error or f"CUDA error {code}"
        super().__init__(f"{call} failed: {self.error} ({code})")


class DriverUnavailable(RuntimeError):
    """No CUDA driver to probe with here: the message says why (no libcuda, no device, --device cpu)."""


class CudaDriver:
    """One device, as the probes use it. Each call raises CudaCallError where the driver refuses."""

    name: str = "CUDA device"

    def attribute(self, attribute: int) -> int:
        raise NotImplementedError

    def granularity(self) -> int:
        """The size and alignment physical memory and reservations come in (cuMemGetAllocationGranularity)."""
        raise NotImplementedError

    def reserve(self, size: int) -> int:
        raise NotImplementedError

    def free_addresses(self, ptr: int, size: int) -> None:
        raise NotImplementedError

    def create(self, size: int) -> int:
        """Physical memory of `size` bytes on the device (cuMemCreate): its handle."""
        raise NotImplementedError

    def release(self, handle: int) -> None:
        raise NotImplementedError

    def alloc(self, size: int) -> int:
        """`size` bytes of device memory in one piece (cuMemAlloc, what cudaMalloc does): its address."""
        raise NotImplementedError

    def free(self, ptr: int) -> None:
        raise NotImplementedError

    def host_register(self, ptr: int, size: int) -> None:
        raise NotImplementedError

    def host_unregister(self, ptr: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class LibCuda(CudaDriver):
    """The driver's calls for device `index`, its primary context current while it is open (the allocation and
    registration calls need one; where torch made it already, this shares it)."""

    def __init__(self, lib, index: int = 0):
        self._lib = lib
        self._device = ctypes.c_int()
        self._context = ctypes.c_void_p()
        self._call("cuInit", ctypes.c_uint(0))
        self._call("cuDeviceGet", ctypes.byref(self._device), ctypes.c_int(index))
        name = ctypes.create_string_buffer(256)
        self._call("cuDeviceGetName", name, ctypes.c_int(len(name)), self._device)
        self.name = name.value.decode(errors="replace") or f"CUDA device {index}"
        self._call("cuDevicePrimaryCtxRetain", ctypes.byref(self._context), self._device)
        try:
            self._call("cuCtxPushCurrent_v2", self._context)
        except CudaCallError:
            self._call("cuDevicePrimaryCtxRelease_v2", self._device)
            raise
        self._prop = abi.device_memory(index)

    def _error_name(self, code: int) -> str:
        text = ctypes.c_char_p()
        get_name = getattr(self._lib, "cuGetErrorName", None)
        if get_name is not None and get_name(ctypes.c_int(code), ctypes.byref(text)) == 0 and text.value:
            return text.value.decode(errors="replace")
        return ""

    def _call(self, name: str, *args) -> None:
        function = getattr(self._lib, name, None)
        if function is None:  # a driver older than the call
            raise CudaCallError(name, -1, "not in this driver")
        code = function(*args)
        if code != 0:
            raise CudaCallError(name, code, self._error_name(code))

    def attribute(self, attribute: int) -> int:
        value = ctypes.c_int()
        self._call("cuDeviceGetAttribute", ctypes.byref(value), ctypes.c_int(attribute), self._device)
        return value.value

    def granularity(self) -> int:
        value = ctypes.c_size_t()
        self._call("cuMemGetAllocationGranularity", ctypes.byref(value), ctypes.byref(self._prop),
                   ctypes.c_int(abi.GRANULARITY_MINIMUM))
        return value.value

    def reserve(self, size: int) -> int:
        ptr = ctypes.c_uint64()
        self._call("cuMemAddressReserve", ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0),
                   ctypes.c_uint64(0), ctypes.c_ulonglong(0))
        return ptr.value

    def free_addresses(self, ptr: int, size: int) -> None:
        self._call("cuMemAddressFree", ctypes.c_uint64(ptr), ctypes.c_size_t(size))

    def create(self, size: int) -> int:
        handle = ctypes.c_uint64()
        self._call("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(size), ctypes.byref(self._prop),
                   ctypes.c_ulonglong(0))
        return handle.value

    def release(self, handle: int) -> None:
        self._call("cuMemRelease", ctypes.c_uint64(handle))

    def alloc(self, size: int) -> int:
        ptr = ctypes.c_uint64()
        self._call("cuMemAlloc_v2", ctypes.byref(ptr), ctypes.c_size_t(size))
        return ptr.value

    def free(self, ptr: int) -> None:
        self._call("cuMemFree_v2", ctypes.c_uint64(ptr))

    def host_register(self, ptr: int, size: int) -> None:
        self._call("cuMemHostRegister_v2", ctypes.c_void_p(ptr), ctypes.c_size_t(size), ctypes.c_uint(0))

    def host_unregister(self, ptr: int) -> None:
        self._call("cuMemHostUnregister", ctypes.c_void_p(ptr))

    def close(self) -> None:
        if self._context:
            popped = ctypes.c_void_p()
            self._lib.cuCtxPopCurrent_v2(ctypes.byref(popped))
            self._lib.cuDevicePrimaryCtxRelease_v2(self._device)
            self._context = ctypes.c_void_p()


def open_driver(index: int = 0) -> CudaDriver:
    """The driver for device `index`, or DriverUnavailable saying why there is none here."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise DriverUnavailable(f"no CUDA driver library (libcuda.so.1: {exc})") from None
    try:
        return LibCuda(lib, index)
    except CudaCallError as exc:
        raise DriverUnavailable(f"the CUDA driver has no usable device: {exc}") from None
