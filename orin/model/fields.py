"""Reading a sub-model's section of config.json into orin-omni's own modules (audio and vision encoders,
code2wav): the config values a frozen dataclass declares, the rope settings, and the activations by name."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import fields

import torch
import torch.nn.functional as F

from ..errors import ModelError

ACTIVATIONS: dict[str, Callable] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def activation(name: str, where: str) -> Callable:
    """The activation config.json names (transformers' ACT2FN names), or a ModelError naming the section."""
    if name not in ACTIVATIONS:
        raise ModelError(f"{where}: activation {name!r} is not one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def declared_values(cls, data: Mapping, rope_default: str | None = None, where: str = "",
                    aliases: Mapping[str, str] | None = None) -> dict:
    """The values `data` gives for `cls`'s fields (absent or null ones keep the dataclass default; lists become
    tuples, for frozen dataclasses; `aliases` maps a field to the other key it may be stored under). With
    `rope_default`, `rope_theta` (and `mrope_section`, where `cls` has it) are read from `rope_parameters` (or
    the section itself) and any rope type other than that one is refused."""
    names = {f.name for f in fields(cls)}
    aliases = aliases or {}
    values = {}
    for name in names - {"rope_theta", "mrope_section"}:
        key = name if name in data else aliases.get(name, name)
        if data.get(key) is not None:
            values[name] = tuple(data[key]) if isinstance(data[key], list) else data[key]
    if rope_default is not None:
        rope = data.get("rope_parameters") or {}
        if not isinstance(rope, Mapping):
            raise ModelError(f"{where}.rope_parameters must be an object, got {type(rope).__name__}")
        if rope.get("mrope_section") is not None and "mrope_section" in names:
            values["mrope_section"] = tuple(int(v) for v in rope["mrope_section"])
        rope_type = rope.get("rope_type", rope.get("type", rope_default))
        if rope_type != rope_default:
            raise ModelError(f"{where}: rope_type {rope_type!r} is not supported (only {rope_default!r}); "
                             "is this a Qwen3-Omni checkpoint?")
        theta = rope.get("rope_theta", data.get("rope_theta"))
        if theta is not None:
            values["rope_theta"] = float(theta)
    elif "rope_theta" in names and data.get("rope_theta") is not None:
        values["rope_theta"] = data["rope_theta"]
    return values
