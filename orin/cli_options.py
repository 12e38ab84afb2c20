"""The option types and options several `orin-omni` commands share (orin.cli, orin.cli_dev): byte sizes, the power
backends, the packed-cache directory. Click only: importing this stays instant."""

from __future__ import annotations

import click

from .errors import UsageError

POWER_BACKENDS = ["auto", "jtop", "ina3221", "nvml", "none"]


class Size(click.ParamType):
    """A byte size such as 24GiB; bad input is a usage error (exit 2) naming the value."""

    name = "size"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        from .units import parse_bytes

        try:
            return parse_bytes(value)
        except UsageError as exc:
            self.fail(str(exc), param, ctx)


SIZE = Size()


def packed_cache_option(fn):
    """--packed-cache, also read from ORIN_OMNI_PACKED_CACHE (the environment is read here, at the CLI's edge)."""
    return click.option(
        "--packed-cache", default="auto", show_default=True, envvar="ORIN_OMNI_PACKED_CACHE",
        help="Directory where INT4 layers are kept in the GPU's layout after their first load, so later loads "
             "(every swap under a budget) read instead of converting; 'auto': packed-cache/ in the model "
             "directory; 'off': convert on every load (env ORIN_OMNI_PACKED_CACHE).")(fn)
