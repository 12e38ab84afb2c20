"""Which torch device a command runs on: one rule for the engine, quantize and the developer tools."""

from __future__ import annotations

from ..errors import UsageError


def pick_device(name: str):
    """"auto" (CUDA where torch sees a GPU, else the CPU), "cpu", "cuda" or "cuda:N"."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise UsageError(f"--device {name!r}: not a device ({exc}); use cpu, cuda or auto") from exc
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {name!r}: use cpu, cuda or auto")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA GPU is visible to torch; use --device cpu")
    return device
