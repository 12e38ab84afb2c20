"""Byte-size parsing and formatting shared by every command that takes a budget."""

from __future__ import annotations

import re

from .errors import UsageError

_UNITS = {
    "": 1,
    "B": 1,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
}
_PATTERN = re.compile(r"^(\d+(?:\.\d+)?)([A-Za-z]*)$")


def parse_bytes(text: str) -> int:
    """Parse '24GiB', '512MiB' or a plain byte count. Decimal units ('24GB') are refused on purpose:
    memory is sized in binary units and a silent 7 % difference is how budgets get blown."""
    raw = str(text).strip()
    match = _PATTERN.match(raw)
    if not match:
        raise UsageError(f"invalid size {text!r}: write it as a number and a binary unit, e.g. 24GiB or 512MiB")
    number, unit = match.groups()
    factor = _UNITS.get(unit.upper())
    if factor is None:
        hint = f" (did you mean {number}{unit[0].upper()}iB?)" if unit.upper() in {"KB", "MB", "GB", "TB"} else ""
        raise UsageError(f"invalid size {text!r}: unknown unit {unit!r}{hint}; use B, KiB, MiB, GiB or TiB")
    value = float(number) * factor
    if value <= 0:
        raise UsageError(f"invalid size {text!r}: must be greater than zero")
    return int(value)


def format_bytes(n: float) -> str:
    """Human-readable binary size, e.g. 15.73 GiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} GiB"
