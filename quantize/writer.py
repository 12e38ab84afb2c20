"""Writing the quantized checkpoint in the standard layout of orin.checkpoint_layout: the source's tokenizer and
processor files copied once, config.json with the quantization_config, then one shard per segment (written to a
temporary file and renamed into place) and the index over the finished shards. The manifest entry that marks
the segment finished is added afterwards by the caller."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from orin.checkpoint_layout import hub_state, write_config_files, write_index
from orin.components import component_of
from orin.errors import ModelError
from orin.fsutil import atomic_path
from orin.layout import Target
from orin.manifest import FileEntry, file_entry

# Copied into OUT as they are, when present: what the loader needs to rebuild the processor. config.json is
# written (the source's plus quantization_config), not copied.
SHARED_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja",
                "chat_template.json", "preprocessor_config.json", "processor_config.json",
                "video_preprocessor_config.json", "orin_tiny.json")


def shared_file_names(model_dir: Path) -> list[str]:
    """The SHARED_FILES present in model_dir; a checkpoint without its tokenizer is refused."""
    names = [n for n in SHARED_FILES if (model_dir / n).is_file()]
    if not any(n in names for n in ("tokenizer.json", "vocab.json")):
        raise ModelError(f"{model_dir}: no tokenizer (tokenizer.json or vocab.json); copy the checkpoint's "
                         "tokenizer files next to its config.json")
    return names


def copy_shared_files(model_dir: Path, out: Path, qconfig: dict) -> list[FileEntry]:
    """The tokenizer and processor files copied, config.json and quantize_config.json written."""
    names = shared_file_names(model_dir)
    for name in names:
        with atomic_path(out / name) as tmp:
            shutil.copyfile(model_dir / name, tmp)
    source = json.loads((model_dir / "config.json").read_text())
    source.pop("quantization_config", None)
    names += write_config_files(out, source, qconfig)
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


def write_shard(out: Path, shard: str, state: dict, finished_shards: list[str]) -> tuple[FileEntry, int]:
    """Write one segment's shard under hub names through a temporary file, then the index over it and the
    shards already finished; return the shard's file entry and its tensor payload bytes."""
    from safetensors.torch import save_file

    tensors = hub_state(state)
    with atomic_path(out / shard) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    write_index(out, list(dict.fromkeys([*finished_shards, shard])))
    return file_entry(out, shard), sum(t.numel() * t.element_size() for t in tensors.values())


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
