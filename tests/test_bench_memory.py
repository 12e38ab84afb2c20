"""The bench's memory variants for the time-sliced sweep (devtools.bench_memory): the Orin profile's bounds on the
weight arenas, and every reservation refused so each unit takes the loader's fallback."""

from __future__ import annotations

import pytest
import torch

from devtools.bench_memory import RefusingVmm, engine_overrides
from orin.device.profile import ORIN
from orin.memory.vmm_driver import DriverError


def test_the_orin_variant_bounds_this_devices_profile_by_the_orins_memory_limits():
    profile = engine_overrides("orin", "cpu")["profile"]
    assert profile.name == "cpu"  # this device's profile, its tuning kept ...
    for key in ("reserve_factor", "reserve_slack", "max_reservation_bytes", "reserve_headroom_bytes",
                "max_allocation_bytes"):  # ... under the Orin's bounds
        assert getattr(profile.memory, key) == getattr(ORIN.memory, key) is not None, key
    assert engine_overrides("device", "cpu") == {}


def test_the_fallback_variant_refuses_every_reservation_and_passes_the_rest_through():
    class Driver:
        granularity = 4096

        def reserve(self, size):
            return 1 << 40

    refusing = RefusingVmm(Driver())
    with pytest.raises(DriverError, match="cuMemAddressReserve of 8192 bytes refused"):
        refusing.reserve(8192)
    assert refusing.granularity == 4096
    factory = engine_overrides("fallback", "cpu")["arena_driver"]
    assert factory(torch.device("cpu")) is None  # no arenas off CUDA: nothing to refuse
