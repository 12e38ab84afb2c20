"""The tests' checkpoints: the tiny Qwen3-Omni (BF16, HF layout), its quantized form and the synthetic INT4 one.

conftest.py's session fixtures build them in pytest's temporary directory. Building needs transformers and GPTQModel,
which the compat environment (Python 3.10, the oldest torch, no transformers) lacks on purpose, so `make test` has
the main environment write them once with this script:

    python tests/fixture_checkpoints.py build/compat-fixtures

and the compat run reads them with `pytest --fixtures-dir build/compat-fixtures` (conftest.py). What the build
prints (quantize's progress, the libraries' load-time notices) goes to DIR.log, shown only if the build fails."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import time
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


@contextlib.contextmanager
def output_to(log: Path):
    """stdout and stderr into `log`, at the file descriptors (torch's and torchao's native code write there
    directly); the log is printed when the block raises."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    ok = False
    try:
        yield
        ok = True
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in zip((1, 2), saved, strict=True):
            os.dup2(copy, fd)
            os.close(copy)
        if not ok:
            sys.stdout.write(log.read_text(errors="replace"))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/fixture_checkpoints.py DIR")
    root = Path(sys.argv[1])
    log = root.with_name(root.name + ".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    with output_to(log):
        write_all(root)
    print(f"fixture checkpoints: {TINY}, {QUANTIZED} and {SYNTHETIC} written to {root} in "
          f"{time.monotonic() - start:.0f} s (its output: {log})")
