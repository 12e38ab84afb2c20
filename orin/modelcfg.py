"""Reading a Qwen3-Omni config.json: the file itself, validated with clear errors (both sides), and, for the
workstation side only (quantize, the benchmark's HF reference, the tests' oracle), transformers 5.23's config
object with the fix-ups it needs. The device side reads the same dict into orin.model_config."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import ModelError

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


def fix_config(config):
    """transformers 5.23 traps, fixed in one place: with audio input and return_audio=True the talker
    computes rope positions from `talker_config.audio_config`, which config.json does not carry."""
    talker = getattr(config, "talker_config", None)
    if talker is not None and not hasattr(getattr(talker, "audio_config", None), "n_window"):
        talker.audio_config = config.thinker_config.audio_config
    return config


def new_config(data: dict):
    """Qwen3OmniMoeConfig(**data), without transformers 5.23's false warning: its thinker text config declares
    the M-RoPE keys (mrope_section, interleaved, mrope_interleaved) as known, its talker text config, whose
    rope_parameters carry the same keys in the real checkpoint, forgets to, so every config load warned
    "Unrecognized keys in `rope_parameters`". Declaring them on the talker's class fixes the check itself."""
    from transformers import Qwen3OmniMoeConfig
    from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as cfg_mod

    talker_text = cfg_mod.Qwen3OmniMoeTalkerTextConfig
    known = getattr(cfg_mod.Qwen3OmniMoeTextConfig, "ignore_keys_at_rope_validation", None) or set()
    talker_text.ignore_keys_at_rope_validation = set(getattr(talker_text, "ignore_keys_at_rope_validation", None)
                                                     or ()) | set(known)
    return Qwen3OmniMoeConfig(**data)


def load_config(model: str | Path):
    """A Qwen3OmniMoeConfig from a checkpoint dir or config.json, validated and fixed up."""
    data = read_config_dict(model)
    try:
        config = new_config(data)
    except (TypeError, ValueError) as exc:
        raise ModelError(f"{config_path(model)}: not a valid Qwen3-Omni config ({exc})") from exc
    return fix_config(config)
