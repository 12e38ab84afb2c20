"""PyTorch's caching-allocator configuration, as torch reads it from the environment, and the one rule orin-omni
holds it to: no `expandable_segments:True` on a Tegra device.

torch reads `PYTORCH_ALLOC_CONF` (its newer name, torch >= 2.9) or `PYTORCH_CUDA_ALLOC_CONF`, which one first
depending on the release, once, when CUDA's allocator first needs it. Expandable segments map the allocator's
memory through CUDA's virtual memory management in growing segments; on Tegra that fails with "CUDA driver error:
out of memory" at ~1 MiB allocations with tens of GB free (unsloth turns it off there, unsloth-zoo PR 1235).
orin-omni never sets it; where the environment does, the engine refuses to start on a Tegra device with a message
naming the variable, its value and the fix (`check_allocator`, called by orin.device.capabilities.detect).

Refusing, rather than dropping the option from the process's environment: torch parses the variable once, on the
first CUDA call that needs the allocator, and the profile is detected after CUDA is up (the device's capability is
a CUDA call), so an edit there comes too late to count; editing it earlier, before torch is imported, would
silently override a setting the user (or the unit's environment file) chose, and change it for every child
process too. A clear error says where the setting is and what to do.

The environment is read in one place, `process_allocator_conf` (the edge); everything else takes an AllocatorConf,
which tests build from a dict.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import UsageError

# The variables torch reads the configuration from (PYTORCH_ALLOC_CONF is the newer name).
VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
EXPANDABLE = "expandable_segments"
WHY_NOT_ON_TEGRA = ("expandable segments fail on Tegra's unified memory ('CUDA driver error: out of memory' at "
                    "~1 MiB allocations with tens of GB free)")


def _split_options(value: str) -> list[str]:
    """'a:1,b:[64:8,>:1],c:x' -> ['a:1', 'b:[64:8,>:1]', 'c:x']: commas inside brackets belong to their option,
    and spaces are dropped, as torch's own parser does."""
    options, depth, current = [], 0, []
    for ch in value.replace(" ", ""):
        if ch == "," and depth == 0:
            options.append("".join(current))
            current = []
            continue
        depth += (ch == "[") - (ch == "]")
        current.append(ch)
    options.append("".join(current))
    return [o for o in options if o]


@dataclass(frozen=True)
class AllocatorSetting:
    """One variable's value and its options, in order: (key, value) pairs (value '' where there is none)."""

    variable: str
    value: str
    options: tuple[tuple[str, str], ...]

    @classmethod
    def parse(cls, variable: str, value: str) -> AllocatorSetting:
        pairs = []
        for option in _split_options(value):
            key, _, setting = option.partition(":")
            pairs.append((key, setting))
        return cls(variable=variable, value=value, options=tuple(pairs))

    @property
    def expandable_segments(self) -> bool:
        """Whether it turns expandable segments on (the last mention counts, as in torch; torch accepts only
        'True' or 'False', but any spelling of true is caught here)."""
        on = False
        for key, setting in self.options:
            if key == EXPANDABLE:
                on = setting.lower() == "true"
        return on

    def without_expandable(self) -> str:
        """The value with the expandable_segments option dropped ('' where nothing else is left)."""
        return ",".join(f"{k}:{v}" if v else k for k, v in self.options if k != EXPANDABLE)

    def fix(self) -> str:
        """The shell line that fixes it: unset the variable, or set it to the rest of its options."""
        rest = self.without_expandable()
        return f"unset {self.variable}" if not rest else f"export {self.variable}='{rest}'"

    def shown(self) -> str:
        return f"{self.variable}={self.value!r}"


@dataclass(frozen=True)
class AllocatorConf:
    """What the environment sets of the allocator's configuration: one setting per variable set (in VARIABLES'
    order); empty where none is."""

    settings: tuple[AllocatorSetting, ...] = ()

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> AllocatorConf:
        return cls(tuple(AllocatorSetting.parse(name, environ[name]) for name in VARIABLES if environ.get(name)))

    @property
    def expandable(self) -> tuple[AllocatorSetting, ...]:
        """The settings that turn expandable segments on (torch reads one of the two variables, which one depends
        on its release, so each is reported)."""
        return tuple(s for s in self.settings if s.expandable_segments)

    def describe(self) -> str:
        return ", ".join(s.shown() for s in self.settings) or f"{' and '.join(VARIABLES)} unset"


def process_allocator_conf() -> AllocatorConf:
    """The allocator configuration of this process's environment: the one place orin-omni reads it (the engine's
    start-up check and the doctor both come here unless handed one)."""
    return AllocatorConf.from_environ(os.environ)


def unified_memory_problem(conf: AllocatorConf) -> str | None:
    """Why `conf` cannot run on Tegra, with the fix; None where it can."""
    bad = conf.expandable
    if not bad:
        return None
    shown = " and ".join(s.shown() for s in bad)
    fixes = "; ".join(s.fix() for s in bad)
    return (f"{shown} turns on the CUDA caching allocator's {EXPANDABLE}, and {WHY_NOT_ON_TEGRA}. Unset it or "
            f"drop that option before starting orin-omni: {fixes}. For the service, remove it from "
            "/etc/orin-omni/NAME.env or the unit's drop-ins (`systemctl cat NAME` shows where it is set)")


def check_allocator(conf: AllocatorConf, unified_memory: bool) -> None:
    """Refuse a configuration the device cannot run (a UsageError naming the variable, its value and the fix).
    Only unified-memory (Tegra) devices refuse expandable segments; a discrete GPU runs them."""
    if not unified_memory:
        return
    problem = unified_memory_problem(conf)
    if problem:
        raise UsageError(problem)
