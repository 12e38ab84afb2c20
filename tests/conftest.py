"""Shared fixtures: the tiny Qwen3-Omni (written once per run, or read from --fixtures-dir) and, where needed,
its quantized form."""

from __future__ import annotations

import fcntl
import importlib.util
import os
import traceback
from pathlib import Path

import pytest
from fixture_checkpoints import (
    QUANTIZED,
    SYNTHETIC,
    TINY,
    one_torch_thread,
    write_quantized,
    write_synthetic,
    write_tiny,
)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The CLI's --packed-cache defaults to packed-cache/ inside the model directory: commands the tests run on the
# session's shared checkpoints would leave it there for the next test to find. tests/test_packed_cache.py turns
# the copies on where it tests them.
os.environ["ORIN_OMNI_PACKED_CACHE"] = "off"

@pytest.fixture(autouse=True)
def _packed_copies_need_no_spare_disk(monkeypatch):
    """The packed cache leaves 2 GiB free on its disk; a test machine may have less (CI's /tmp had 1.6 GiB) while
    the tiny model's copies are a few MiB. test_packed_cache checks the margin itself."""
    from orin.memory import packed_cache

    monkeypatch.setattr(packed_cache, "DISK_MARGIN", 0)


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


def prebuilt(config: pytest.Config, name: str) -> str | None:
    """DIR/`name` when --fixtures-dir DIR is given (the compat environment cannot build checkpoints: that needs
    transformers and GPTQModel), else None."""
    root = config.getoption("--fixtures-dir")
    if not root:
        return None
    path = Path(root).resolve() / name
    if not (path / "config.json").is_file():
        pytest.fail(f"--fixtures-dir {root}: no {name!r} checkpoint there; write them with the main environment: "
                    f"python tests/fixture_checkpoints.py {root}", pytrace=False)
    return str(path)


def built_once(tmp_path_factory, name: str, leaf: str, write) -> str:
    """RUN/`name`/`leaf`, written by `write` once per run: pytest-xdist's workers (make test) share the run's
    directory, and the first to come writes the checkpoint while the others wait for it (a quantize run is ~30 s
    each). The writers rename a checkpoint into place only when it is complete."""
    run = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        run = run.parent  # a worker's basetemp is RUN/popen-gwN
    out = run / name / leaf
    out.parent.mkdir(mode=0o700, exist_ok=True)  # as tmp_path_factory.mktemp's
    with open(run / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the worker dies
        if not (out / "config.json").is_file():
            write(out)
    return str(out)


@pytest.fixture(scope="session")
def tiny_model_dir(pytestconfig, tmp_path_factory) -> str:
    return prebuilt(pytestconfig, TINY) or built_once(tmp_path_factory, "tiny", "model", write_tiny)


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
def quantized_dir(pytestconfig, tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model quantized (both segments, default settings, built-in calibration). Read-only: copy it
    before changing anything."""
    return prebuilt(pytestconfig, QUANTIZED) or built_once(
        tmp_path_factory, "quantized", "int4", lambda out: write_quantized(Path(tiny_model_dir), out))


@pytest.fixture(scope="session")
def engine(quantized_dir):
    """One CPU engine on the quantized tiny model, shared by the engine, server and smoke tests (requests are
    serialised by the engine itself). Tests that need other settings build their own."""
    from orin.runtime.engine import Engine, EngineConfig

    eng = Engine(EngineConfig(model_dir=quantized_dir, device="cpu", power_backend="none"))
    yield eng
    eng.close()


@pytest.fixture(scope="session")
def graph_engine(quantized_dir):
    """A CPU engine on the quantized tiny model whose prefills take the graph path as on CUDA (the profile's
    capture.cpu_graph_path: padded to buckets, one "graph" per key, run eagerly) with a server's deferred
    captures: the bookkeeping CUDA replays, checked on CPU."""
    from dataclasses import replace

    from orin.device.profile import CPU
    from orin.runtime.engine import Engine, EngineConfig

    profile = replace(CPU, capture=replace(CPU.capture, cpu_graph_path=True))
    eng = Engine(EngineConfig(model_dir=quantized_dir, device="cpu", power_backend="none", profile=profile))
    eng.defer_captures(True)
    yield eng
    eng.close()


@pytest.fixture()
def make_decoder(graph_engine):
    """`make_decoder(prefill=None, **capture)`: a fresh thinker decoder on the graph engine's weights, its
    deferral on (a server's), the graph engine's profile with these prefill and capture numbers."""
    from dataclasses import replace

    from orin.runtime.decode import StaticDecoder

    graph_engine.loader.ensure("thinker_text")
    thinker, base, made = graph_engine.model.thinker, graph_engine.profile, []

    def make(prefill: dict | None = None, **capture) -> StaticDecoder:
        profile = replace(base, capture=replace(base.capture, **capture),
                          prefill=replace(base.prefill, **(prefill or {})))
        dec = StaticDecoder(thinker.model.language_model, thinker.lm_head, graph_engine.device, profile)
        dec.policy.defer = True
        made.append(dec)
        return dec

    yield make
    for dec in made:
        dec.release()


@pytest.fixture()
def decoder(make_decoder):
    """A fresh thinker decoder taking the graph path with deferred captures (make_decoder's)."""
    return make_decoder()


# --------------------------------------------------------------------------- real hardware (`device` marker)


def pytest_addoption(parser):
    parser.getgroup("orin-omni checkpoints").addoption(
        "--fixtures-dir", default=os.environ.get("ORIN_OMNI_FIXTURES_DIR"),
        help="Read the tiny, quantized and synthetic checkpoints from DIR/tiny, DIR/quantized and DIR/synthetic "
             "instead of building them (tests/fixture_checkpoints.py writes them; env ORIN_OMNI_FIXTURES_DIR). "
             "The compat environment's run (make test-compat) needs it.")
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
def synthetic_dir(pytestconfig, tmp_path_factory) -> str:
    return prebuilt(pytestconfig, SYNTHETIC) or built_once(tmp_path_factory, "synthetic", "ckpt", write_synthetic)


@pytest.fixture(scope="module")
def server(engine, quantized_dir):
    """`orin-omni serve` on port 0 around the shared engine, with the real warm-up as under systemd; speech capped
    at server_kit.SPEECH_S (the tiny model's random talker never ends its speech on its own)."""
    from server_kit import SPEECH_S

    from orin.runtime.engine import EngineConfig
    from orin.serve.app import ServeConfig, Server

    srv = Server(ServeConfig(EngineConfig(model_dir=quantized_dir, device="cpu", power_backend="none"), port=0,
                             warmup=True, max_speech_seconds=SPEECH_S), engine=engine).start()
    yield srv
    srv.stop()


# --------------------------------------------------------------------------- compat environment (no transformers)
# The compat run (Python 3.10, the oldest torch, no transformers) proves the device runtime needs no transformers.
# A test that reaches transformers through its oracle (tests/, or a workstation-side helper that the test itself
# calls) is skipped there; one that reaches it through the runtime (an orin module the test did not call as its
# reference) fails, as it would on a JetPack 6 board.

ROOT = Path(__file__).resolve().parent.parent
# Workstation-side modules: transformers-backed by design (quantize, the HF reference, the tests' oracle).
WORKSTATION = ("devtools/", "quantize/")
NO_TRANSFORMERS = importlib.util.find_spec("transformers") is None


def oracle_import(exc: BaseException) -> str | None:
    """Where a test's oracle imported the missing transformers ("file:line"), or None when it is not that: another
    error, or the import came from the runtime (then the test must fail)."""
    if not (NO_TRANSFORMERS and isinstance(exc, ModuleNotFoundError)
            and (exc.name or "").split(".")[0] == "transformers"):
        return None
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = Path(frame.filename)
        if not path.is_relative_to(ROOT):
            continue  # importlib, site-packages
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("tests/"):
            return f"{rel}:{frame.lineno}"
        if not rel.startswith(WORKSTATION):
            return None
    return None


def _skip_oracle():
    try:
        return (yield)
    except ModuleNotFoundError as exc:
        where = oracle_import(exc)
        if where is None:
            raise
        pytest.skip(f"transformers not installed (compat env): the HF oracle at {where}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):  # fixtures that build the oracle
    return (yield from _skip_oracle())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _skip_oracle())
