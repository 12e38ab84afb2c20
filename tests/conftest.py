"""Shared fixtures: the tiny Qwen3-Omni (written once per session) and, where needed, its quantized form."""

from __future__ import annotations

import os
import warnings

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", message=".*rope_parameters.*")

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
    from orin.tiny import TinyModelConfig, write_tiny_model

    out = tmp_path_factory.mktemp("tiny") / "model"
    write_tiny_model(TinyModelConfig(out=str(out), seed=0))
    return str(out)
