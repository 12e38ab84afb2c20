"""Shared fixtures: the tiny Qwen3-Omni (written once per session) and, where needed, its quantized form."""

from __future__ import annotations

import contextlib
import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REAL_CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "reference",
                           "qwen3-omni-30b-a3b-instruct.config.json")


def real_config_path() -> str:
    """The real model's config: ../shared/reference in a checkout; tests/data as a fallback copy."""
    if os.path.exists(REAL_CONFIG):
        return REAL_CONFIG
    return os.path.join(os.path.dirname(__file__), "data", "qwen3-omni-30b-a3b-instruct.config.json")


@pytest.fixture(scope="session")
def real_config() -> str:
    return real_config_path()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from orin.devtools.tiny import TinyModelConfig, write_tiny_model

    out = tmp_path_factory.mktemp("tiny") / "model"
    write_tiny_model(TinyModelConfig(out=str(out), seed=0))
    return str(out)


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


@pytest.fixture
def searchable_tmp():
    """A directory whose every ancestor everyone may search (pytest's tmp_path is under a 0700 one), so a test of
    file access decides every mode on the way to what it checks."""
    import shutil
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp(prefix="orin-test-", dir="/tmp"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path)


@pytest.fixture
def single_torch_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="session")
def quantized_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model quantized (both segments, default settings, built-in calibration). Read-only: copy it
    before changing anything."""
    from quantize.pipeline import QuantConfig, run_quantize

    out = tmp_path_factory.mktemp("quantized") / "int4"
    with one_torch_thread():
        run_quantize(QuantConfig(model=tiny_model_dir, out=str(out), **TINY_QUANTIZE))
    return str(out)


@pytest.fixture(scope="session")
def engine(quantized_dir):
    """One CPU engine on the quantized tiny model, shared by the engine, server and smoke tests (requests are
    serialised by the engine itself). Tests that need other settings build their own."""
    from orin.engine import Engine, EngineConfig

    eng = Engine(EngineConfig(model_dir=quantized_dir, device="cpu", power_backend="none"))
    yield eng
    eng.close()


# --------------------------------------------------------------------------- real hardware (`device` marker)


def pytest_addoption(parser):
    group = parser.getgroup("orin-omni device tests")
    group.addoption("--device-url", default=os.environ.get("ORIN_OMNI_DEVICE_URL"),
                    help="Run the `device` tests against this server (env ORIN_OMNI_DEVICE_URL).")
    group.addoption("--device-model-dir", default=os.environ.get("ORIN_OMNI_DEVICE_MODEL_DIR"),
                    help="Run the `device` tests in-process on this checkpoint (env ORIN_OMNI_DEVICE_MODEL_DIR).")
    group.addoption("--device-gpu", action="store_true", default=bool(os.environ.get("ORIN_OMNI_DEVICE_GPU")),
                    help="Run the `device` tests that need only a CUDA GPU (the decode path's kernels on the tiny "
                         "synthetic checkpoint; env ORIN_OMNI_DEVICE_GPU=1).")
    group.addoption("--device-api-key-file", default=os.environ.get("ORIN_OMNI_DEVICE_API_KEY_FILE"),
                    help="API key file for --device-url (env ORIN_OMNI_DEVICE_API_KEY_FILE).")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--device-url") or config.getoption("--device-model-dir") or config.getoption("--device-gpu"):
        return
    skip = pytest.mark.skip(reason="real-hardware test: give --device-url URL, --device-model-dir DIR or --device-gpu")
    for item in items:
        if "device" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device_target(pytestconfig) -> dict:
    """Where the `device` tests run: {"url": ...} or {"model_dir": ...}, plus "api_key_file" when given."""
    url, model_dir = pytestconfig.getoption("--device-url"), pytestconfig.getoption("--device-model-dir")
    if not (url or model_dir):
        pytest.skip("needs the service or a checkpoint: give --device-url URL or --device-model-dir DIR")
    target = {"url": url} if url else {"model_dir": model_dir}
    key = pytestconfig.getoption("--device-api-key-file")
    if key:
        target["api_key_file"] = key
    return target


@pytest.fixture(scope="session")
def synthetic_dir(tmp_path_factory) -> str:
    from orin.devtools.synthetic import SyntheticConfig, write_synthetic_checkpoint

    out = tmp_path_factory.mktemp("synthetic") / "ckpt"
    write_synthetic_checkpoint(SyntheticConfig(config="tiny", out=str(out), device="cpu", seed=3))
    return str(out)


@pytest.fixture(scope="module")
def server(engine, quantized_dir):
    """`orin-omni serve` on port 0 around the shared engine, with the real warm-up as under systemd; speech capped
    at server_kit.SPEECH_S (the tiny model's random talker never ends its speech on its own)."""
    from server_kit import SPEECH_S

    from orin.serve.app import ServeConfig, Server

    srv = Server(ServeConfig(model_dir=quantized_dir, port=0, device="cpu", power_backend="none", warmup=True,
                             max_speech_seconds=SPEECH_S), engine=engine).start()
    yield srv
    srv.stop()
