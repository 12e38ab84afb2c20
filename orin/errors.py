"""The one error family. The CLI turns these into Click errors in one place (orin.cli.main)."""


class OrinError(Exception):
    """Base of every error a user can cause or fix. The message says what to do."""

    exit_code = 1


class UsageError(OrinError):
    """Bad command-line input (a budget such as '24GB', an unknown segment name): exit 2 like Click's own."""

    exit_code = 2


class ModelError(OrinError):
    """The model directory or config is missing, unreadable or not Qwen3-Omni."""


class InputError(OrinError):
    """A request input (image, audio, calibration entry) is missing, unreadable or unsupported."""


class ChecksumError(OrinError):
    """A file does not match the sha256 recorded in the manifest."""


class BudgetError(OrinError):
    """A request cannot fit the memory budget; raised by the planner before anything is loaded."""


class PowerError(OrinError):
    """A power backend cannot be opened or read."""


class ServiceError(OrinError):
    """Installing, rendering or talking to the systemd service failed."""
