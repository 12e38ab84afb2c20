"""The tests' checkpoints: the tiny Qwen3-Omni (BF16, HF layout), its quantized form and the synthetic INT4 one.

conftest.py's session fixtures build them in pytest's temporary directory. Building needs transformers and GPTQModel,
which the compat environment (Python 3.10, the oldest torch, no transformers) lacks on purpose, so `make test` has
the main environment write them once with this script:

    python tests/fixture_checkpoints.py build/compat-fixtures

and the compat run reads them with `pytest --fixtures-dir build/compat-fixtures` (conftest.py)."""

from __future__ import annotations

import contextlib
import shutil
import sys
from pathlib import Path

# DIR/<name> for each fixture that --fixtures-dir serves.
TINY, QUANTIZED, SYNTHETIC = "tiny", "quantized", "synthetic"

# Few conversations and short speech keep the tiny model's GPTQ run at seconds; 24 conversations is what GPTQ
# needs on the tiny model to beat round-to-nearest on held-out inputs for every layer type.
TINY_QUANTIZE = {"samples": 24, "reply_tokens": 6, "speech_frames": 8, "min_speech_frames": 8,
                 "device": "cpu", "progress": False}


@contextlib.contextmanager
def one_torch_thread():
    """The tiny model's ops are microseconds long: on the 2-core machine, with other processes busy, two OpenMP
    threads spin-wait on each other and a quantize run gets ~10x slower. One thread is faster there."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def write_tiny(out: Path) -> None:
    from devtools.tiny import TinyModelConfig, write_tiny_model

    write_tiny_model(TinyModelConfig(out=str(out), seed=0))


def write_quantized(model_dir: Path, out: Path) -> None:
    """The tiny model quantized (both segments, default settings, built-in calibration)."""
    from quantize.pipeline import QuantConfig, run_quantize

    with one_torch_thread():
        run_quantize(QuantConfig(model=str(model_dir), out=str(out), **TINY_QUANTIZE))


def write_synthetic(out: Path) -> None:
    from devtools.synthetic import SyntheticConfig, write_synthetic_checkpoint

    write_synthetic_checkpoint(SyntheticConfig(config="tiny", out=str(out), device="cpu", seed=3))


def write_all(root: Path) -> None:
    """All three afresh under `root` (what was there is removed: a checkpoint left by older code would be read as
    current). Each writer renames its directory into place only when complete."""
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    write_tiny(root / TINY)
    write_quantized(root / TINY, root / QUANTIZED)
    write_synthetic(root / SYNTHETIC)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/fixture_checkpoints.py DIR")
    write_all(Path(sys.argv[1]))
