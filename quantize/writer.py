"""Writing the quantized checkpoint: the shared files copied once into OUT, and one directory per segment
(OUT/<segment>/model.safetensors, config.json, quantize_config.json) built in OUT/.<segment>.tmp and renamed
into place. The manifest entry that marks the segment finished is added afterwards by the caller."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from orin import __version__
from orin.components import component_of
from orin.errors import ModelError
from orin.fsutil import atomic_dir, atomic_path, atomic_write_json
from orin.layout import Target, padded
from orin.manifest import FileEntry, file_entry

# Copied into OUT as they are, when present: what the loader needs to rebuild the processor and the config.
SHARED_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja",
                "chat_template.json", "preprocessor_config.json", "processor_config.json",
                "video_preprocessor_config.json", "orin_tiny.json")
SEGMENT_FILES = ("model.safetensors", "config.json", "quantize_config.json")


def shared_file_names(model_dir: Path) -> list[str]:
    """The SHARED_FILES present in model_dir; a checkpoint without its tokenizer is refused."""
    names = [n for n in SHARED_FILES if (model_dir / n).is_file()]
    if not any(n in names for n in ("tokenizer.json", "vocab.json")):
        raise ModelError(f"{model_dir}: no tokenizer (tokenizer.json or vocab.json); copy the checkpoint's "
                         "tokenizer files next to its config.json")
    return names


def copy_shared_files(model_dir: Path, out: Path) -> list[FileEntry]:
    names = shared_file_names(model_dir)
    for name in names:
        with atomic_path(out / name) as tmp:
            shutil.copyfile(model_dir / name, tmp)
    return [file_entry(out, name) for name in names]


def segment_state(model, components: tuple[str, ...], targets: list[Target], gptq_tensors: dict) -> dict:
    """Every tensor of the segment's components under its transformers 5.23 name: GPTQ v1 tensors for the
    quantized modules (their weight and bias replaced), BF16 for the rest. Tied aliases are written once."""
    replaced = set()
    for t in targets:
        if t.kind == "linear":
            replaced.update((f"{t.path}.weight", f"{t.path}.bias"))
        else:
            replaced.update((f"{t.path}.gate_up_proj", f"{t.path}.down_proj"))
    state: dict[str, torch.Tensor] = {}
    persistent = set(model.state_dict().keys())
    tensors = list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if n in persistent]
    for name, tensor in tensors:
        if component_of(name) in components and name not in replaced:
            t = tensor.detach()
            state[name] = (t.to(torch.bfloat16) if t.is_floating_point() else t).cpu().contiguous()
    for key, tensor in gptq_tensors.items():
        if component_of(key) in components:
            state[key] = tensor.contiguous()
    return state


def quantize_config(segment: str, components: tuple[str, ...], targets: list[Target], group_size: int, bits: int,
                    damp: float, quantizer: str) -> dict:
    linears = [t.path + suffix for t in targets for suffix, *_ in t.linears()]
    pads = [{"module": t.path, "in_features": t.in_features, "stored_in_features": padded(t.in_features, group_size)}
            for t in targets if t.kind == "linear" and t.in_features % group_size]
    return {
        "bits": bits, "group_size": group_size, "desc_act": False, "sym": False, "static_groups": False,
        "true_sequential": True, "damp_percent": damp, "quant_method": "gptq", "checkpoint_format": "gptq",
        "pack_dtype": "int32", "quantizer": quantizer, "tool": f"orin-omni {__version__}",
        "segment": segment, "components": list(components),
        "modules": [t.path for t in targets], "linears": linears, "padded": pads,
    }


def write_segment(out: Path, name: str, state: dict, config_file: Path, qconfig: dict) -> tuple[list[FileEntry], int]:
    """Write OUT/<name>/ through OUT/.<name>.tmp; return its file entries and the tensor payload bytes."""
    from safetensors.torch import save_file

    with atomic_dir(out / name) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt", "orin_segment": name})
        shutil.copyfile(config_file, tmp / "config.json")
        atomic_write_json(tmp / "quantize_config.json", qconfig)
    payload = sum(t.numel() * t.element_size() for t in state.values())
    return [file_entry(out, f"{name}/{f}") for f in SEGMENT_FILES], payload


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
