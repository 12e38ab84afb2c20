"""The CUDA driver's ABI as orin-omni calls it through ctypes (cuda.h): the result codes, device attributes and
structures of virtual memory management. Imports nothing: the weight arenas' driver (orin.memory.vmm_driver), the
doctor's probes (orin.checks.cuda_driver) and the allocation-failure classifier (orin.memory.oom) share it."""

from __future__ import annotations

import ctypes

CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NO_DEVICE = 100
# CUdevice_attribute; the runtime's cudaDevAttr* numbers are the same.
ATTR_HOST_REGISTER_SUPPORTED = 99
ATTR_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
ALLOCATION_TYPE_PINNED = 1
LOCATION_TYPE_DEVICE = 1
ACCESS_FLAGS_PROT_READWRITE = 3
GRANULARITY_MINIMUM = 0


class Location(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", AllocFlags)]


class AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


def device_memory(index: int) -> AllocationProp:
    """Pinned physical memory on device `index`: what the arenas map and the doctor's probe creates."""
    return AllocationProp(type=ALLOCATION_TYPE_PINNED, location=Location(LOCATION_TYPE_DEVICE, index))


def read_write(index: int) -> AccessDesc:
    """Read and write access for device `index` (cuMemSetAccess)."""
    return AccessDesc(location=Location(LOCATION_TYPE_DEVICE, index), flags=ACCESS_FLAGS_PROT_READWRITE)
