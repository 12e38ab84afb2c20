"""The memory variants a bench's time-sliced runs can take (`orin-omni bench --memory`): the device profile's own
weight arenas (`device`), the Orin profile's bounds on them (`orin`: reservations of at most 4 GiB and the total near
the budget, physical pieces of at most 1 GiB; orin.device.profile.ORIN_NOTES says where each number comes from), or
every reservation refused (`fallback`), so that every unit takes the loader's fallback: what a board whose driver
refuses the arenas' calls runs. On a GPU without such bounds, these show what the bounds and the fallback cost."""

from __future__ import annotations

from dataclasses import replace

MEMORY_VARIANTS = ("device", "orin", "fallback")


class RefusingVmm:
    """A device's virtual memory management whose every reservation is refused; its other calls are the real
    driver's (none is reached: a unit whose reservation fails takes the fallback)."""

    def __init__(self, driver):
        self._driver = driver

    def reserve(self, size: int) -> int:
        from orin.memory.vmm_driver import DriverError

        raise DriverError("cuMemAddressReserve", size, "refused by the bench (--memory fallback)")

    def __getattr__(self, name: str):
        return getattr(self._driver, name)


def _refusing(device):
    from orin.memory.vmm_driver import driver_for

    driver = driver_for(device)
    return RefusingVmm(driver) if driver is not None else None


def engine_overrides(variant: str, device: str) -> dict:
    """The EngineConfig fields a time-sliced engine on `device` (EngineConfig.device: "auto", "cuda", ...) takes
    for `variant`."""
    if variant == "device":
        return {}
    if variant == "fallback":
        return {"arena_driver": _refusing}
    from orin.device.capabilities import detect
    from orin.device.profile import ORIN
    from orin.device.select import pick_device

    profile = detect(pick_device(device))
    bounds = {k: getattr(ORIN.memory, k) for k in ("reserve_factor", "reserve_slack", "max_reservation_bytes",
                                                    "reserve_headroom_bytes", "max_allocation_bytes")}
    return {"profile": replace(profile, memory=replace(profile.memory, **bounds))}


__all__ = ["MEMORY_VARIANTS", "RefusingVmm", "engine_overrides"]
