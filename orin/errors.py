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
    """A request cannot fit the memory budget: raised by the planner before anything is loaded, or, as
    OutOfMemoryError, by an allocation that failed while it ran."""


class OutOfMemoryError(BudgetError):
    """An allocation failed while a request ran (torch's allocator, the CUDA driver, an NVML assert or NvMap said
    so: orin.memory.oom decides), or a request as large as one that just failed is refused until more memory is
    free (`tried` False: nothing ran). The request's memory has been released and the process goes on.

    `asked`: the request's planned working bytes beside the weights (KV caches, activations, margin);
    `allocation`: the bytes of the allocation that failed, where known; `memory`: what the board had free
    afterwards (an orin.memory.oom.MemoryReading), or None."""

    def __init__(self, message: str, *, asked: int | None = None, allocation: int | None = None, memory=None,
                 tried: bool = True):
        super().__init__(message)
        self.asked = asked
        self.allocation = allocation
        self.memory = memory
        self.tried = tried


class PowerError(OrinError):
    """A power backend cannot be opened or read."""


class ServiceError(OrinError):
    """Installing, rendering or talking to the systemd service failed."""
