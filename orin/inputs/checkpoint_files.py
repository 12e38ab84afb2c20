"""Which of a checkpoint's files the input processing reads, in which order, and what stands in for a file the
checkpoint does not carry.

- The chat template: chat_template.jinja, else chat_template.json's "chat_template", else tokenizer_config.json's
  "chat_template" (a string, or a list of named templates of which "default" is taken). Required.
- The tokenizer: tokenizer.json (required), tokenizer_config.json and the legacy special_tokens_map.json (optional).
- The feature extractor's and image processor's values: processor_config.json's "feature_extractor" and
  "image_processor" sections (what transformers 5's `save_pretrained` writes, as the tiny checkpoint has), else
  the flat preprocessor_config.json the released Qwen3-Omni checkpoints ship, else QWEN3_OMNI_PREPROCESSOR.
- config.json (optional): the audio encoder's `n_window`, which fixes how many tokens an audio becomes, and the
  thinker's `position_id_per_seconds`, which fixes how a video's audio interleaves with its frames.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelError

# The values of the preprocessor_config.json that Qwen/Qwen3-Omni-30B-A3B-Instruct (and its -Thinking and
# -Captioner siblings, same file) publish on the Hugging Face hub. They stand in for a checkpoint that carries no
# processor file (the synthetic benchmark checkpoint) and for keys a file leaves out: the transformers classes'
# own defaults (80 mel bins, patch 14, CLIP mean/std, at most 1003520 pixels) do not fit this model.
QWEN3_OMNI_PREPROCESSOR = {
    "feature_size": 128, "sampling_rate": 16000, "hop_length": 160, "n_fft": 400, "chunk_length": 300,
    "padding_value": 0.0, "dither": 0.0,
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "min_pixels": 56 * 56, "max_pixels": 12845056,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 3, "rescale_factor": 1 / 255,
    "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True,
}
# The audio encoder's window when config.json does not say (Qwen3-Omni's own value, and the HF processor's).
DEFAULT_N_WINDOW = 50
# Position ids per second of audio-in-video, when config.json does not say (Qwen3-Omni's, and the HF processor's).
DEFAULT_POSITION_ID_PER_SECONDS = 13


@dataclass(frozen=True)
class PreprocessorValues:
    audio: dict  # the feature extractor's keys as the file has them (QWEN3_OMNI_PREPROCESSOR completes them)
    image: dict  # the image processor's keys, likewise
    source: str  # the file they came from, or "defaults" (QWEN3_OMNI_PREPROCESSOR)


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"cannot read {path}: {exc}; restore the file from the model's release") from exc
    if not isinstance(data, dict):
        raise ModelError(f"{path} is not a JSON object; restore the file from the model's release")
    return data


def optional_json(model_dir: Path, name: str) -> dict:
    path = model_dir / name
    return read_json(path) if path.is_file() else {}


def require_file(model_dir: Path, name: str) -> Path:
    path = model_dir / name
    if not path.is_file():
        raise ModelError(f"{model_dir} has no {name}; copy the model's {name} beside its config.json")
    return path


def chat_template_text(model_dir: Path) -> str:
    """The checkpoint's chat template, from the first of its three homes that has one."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    for name in ("chat_template.json", "tokenizer_config.json"):
        template = _pick_template(optional_json(model_dir, name).get("chat_template"), model_dir / name)
        if template:
            return template
    raise ModelError(f"{model_dir} has no chat template (chat_template.jinja, chat_template.json or "
                     "tokenizer_config.json's chat_template); copy the model's chat_template.jinja beside its "
                     "config.json")


def _pick_template(value, path: Path) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if "default" in named:
            return named["default"]
        raise ModelError(f"{path} has chat templates {sorted(map(str, named))} but none named 'default'; "
                         "add chat_template.jinja with the one to use")
    raise ModelError(f"{path}: chat_template is a {type(value).__name__}, not a string or a list of templates")


def preprocessor_values(model_dir: Path) -> PreprocessorValues:
    """The feature extractor's and image processor's settings as the checkpoint's file gives them."""
    nested = optional_json(model_dir, "processor_config.json")
    if isinstance(nested.get("feature_extractor"), dict) or isinstance(nested.get("image_processor"), dict):
        audio, image = nested.get("feature_extractor") or {}, nested.get("image_processor") or {}
        source = "processor_config.json"
    elif (model_dir / "preprocessor_config.json").is_file():
        audio = image = read_json(model_dir / "preprocessor_config.json")
        source = "preprocessor_config.json"
    else:
        audio = image = {}
        source = "defaults"
    return PreprocessorValues(dict(audio), dict(image), source)


def audio_window(model_dir: Path) -> int:
    """The audio encoder's n_window from config.json (thinker_config.audio_config), else DEFAULT_N_WINDOW."""
    config = optional_json(model_dir, "config.json")
    audio = (config.get("thinker_config") or {}).get("audio_config") or {}
    value = audio.get("n_window", DEFAULT_N_WINDOW)
    if not isinstance(value, int) or value <= 0:
        raise ModelError(f"{model_dir / 'config.json'}: thinker_config.audio_config.n_window is {value!r}, "
                         "not a positive integer")
    return value


def position_id_per_seconds(model_dir: Path) -> float:
    """config.json's thinker_config.position_id_per_seconds (how audio tokens and video grids interleave), else
    DEFAULT_POSITION_ID_PER_SECONDS."""
    config = optional_json(model_dir, "config.json")
    value = (config.get("thinker_config") or {}).get("position_id_per_seconds", DEFAULT_POSITION_ID_PER_SECONDS)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ModelError(f"{model_dir / 'config.json'}: thinker_config.position_id_per_seconds is {value!r}, "
                         "not a positive number")
    return value
