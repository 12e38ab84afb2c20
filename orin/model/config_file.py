"""Reading a Qwen3-Omni config.json: the file itself, validated with clear errors, for both sides. The device
reads the dict into orin.model.config; the workstation side builds transformers' config object from it
(quantize.hf_config)."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ModelError

MODEL_TYPE = "qwen3_omni_moe"


def config_path(model: str | Path) -> Path:
    """MODEL is a checkpoint directory or a config.json; return the config file, or say what is wrong."""
    path = Path(model)
    if not path.exists():
        raise ModelError(f"{path}: no such file or directory; give a checkpoint directory or its config.json")
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise ModelError(f"{path.parent}: no config.json in this directory; is it a Qwen3-Omni checkpoint?")
    return path


def read_config_dict(model: str | Path) -> dict:
    path = config_path(model)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"{path}: not readable JSON ({exc})") from exc
    if not isinstance(data, dict) or data.get("model_type") != MODEL_TYPE:
        found = data.get("model_type") if isinstance(data, dict) else type(data).__name__
        raise ModelError(f"{path}: model_type is {found!r}, not {MODEL_TYPE!r}; orin-omni serves Qwen3-Omni only")
    for key in ("thinker_config",):
        if not isinstance(data.get(key), dict):
            raise ModelError(f"{path}: {key} is missing; this is not a complete Qwen3-Omni config")
    return data
