"""The model the time-sliced loader fills: built once with every parameter on the meta device (buffers, a few MiB
of rotary tables and offsets, are real) and its INT4 modules as empty shells, with what of it each unit
(orin.components: a decoder's layers one by one, the rest of a component whole) owns. A unit's tensors are
assigned into it when the unit is loaded (orin.memory.unit_reader) and given back, meta again, when it goes."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from .. import components as C


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


class Skeleton:
    """The model with no weights, its INT4 shells (`shells`: {module path: shell}), and per unit its parameters
    and shells, found once: walking the whole model's parameters and naming each one's unit took 20-40 ms of every
    swap."""

    def __init__(self, checkpoint, device: torch.device):
        from ..int4.linear import convert_for_runtime
        from ..model.omni import OmniModel

        with params_on_meta():
            model = OmniModel(checkpoint.config)
        model.eval()
        self.shells: dict[str, nn.Module] = convert_for_runtime(model, checkpoint.quantized_modules)
        for buf_owner in model.modules():
            for name, buf in list(buf_owner._buffers.items()):
                if buf is not None and buf.device.type != "meta":
                    buf_owner._buffers[name] = buf.to(device)
        self.model = model
        # the units of each component, in order
        self.units: dict[str, list[str]] = {c: [] for c in C.NAMES}
        # each unit's parameters: (owning module, attribute, full name)
        self.params: dict[str, list[tuple[nn.Module, str, str]]] = {}
        for name, _ in model.named_parameters():
            unit = C.unit_of(name)
            if unit is not None:
                module_path, _, attr = name.rpartition(".")
                self.params.setdefault(unit, []).append((model.get_submodule(module_path), attr, name))
        self.shell_unit: dict[str, str | None] = {p: C.unit_of(p + ".") for p in self.shells}
        for unit in [*self.params, *self.shell_unit.values()]:
            if unit is not None and unit not in self.units[C.unit_component(unit)]:
                self.units[C.unit_component(unit)].append(unit)
        for units in self.units.values():
            units.sort(key=C.unit_sort_key)

    def shells_of(self, units: Iterable[str]) -> dict[str, nn.Module]:
        """The INT4 shells of these units, by module path."""
        units = set(units)
        return {p: m for p, m in self.shells.items() if self.shell_unit[p] in units}

    def missing(self, units: Iterable[str]) -> list[str]:
        """The units' parameters still on the meta device (the checkpoint did not have them)."""
        return [name for unit in units for module, attr, name in self.params.get(unit, ())
                if module._parameters[attr].device.type == "meta"]

    def release(self, units: set[str]) -> dict[str, list[weakref.ref]]:
        """Give up the units' tensors: their parameters replaced with meta ones, their INT4 modules emptied. Weak
        references to what was given up, by component."""
        from ..int4.linear import unload_int4_module

        released: dict[str, list[weakref.ref]] = {}
        for unit in units:
            for module, attr, name in self.params.get(unit, ()):
                param = module._parameters[attr]
                if param.device.type != "meta":
                    released.setdefault(C.component_of(name), []).append(weakref.ref(param))
                    module._parameters[attr] = nn.Parameter(
                        torch.empty(param.shape, dtype=param.dtype, device="meta"), requires_grad=False)
        for path, shell in self.shells.items():
            if self.shell_unit[path] in units:
                released.setdefault(C.component_of(path + "."), []).extend(
                    weakref.ref(b) for b in shell.buffers() if b is not None)
                unload_int4_module(shell)
        return released
