"""transformers 5.23's Qwen3-Omni config object, for the workstation side (quantize, the benchmark's HF
reference, the tests' oracle), built from the config.json that orin.model.config_file reads and validates, with the
fix-ups it needs. The device never builds it: it reads the same dict into orin.model.config."""

from __future__ import annotations

from pathlib import Path

from orin.errors import ModelError
from orin.model.config_file import config_path, read_config_dict


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
