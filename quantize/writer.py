"""Writing the quantized checkpoint in the standard layout of orin.checkpoint.files: the source's tokenizer and
processor files copied once, config.json with the quantization_config, then one shard per segment (written tensor
by tensor to a temporary file, hashed on the way, and renamed into place: the segment never sits in memory whole)
and the index over the finished shards. The manifest entry that marks the segment finished is added afterwards by
the caller."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from orin.checkpoint.files import write_config_files, write_index
from orin.checkpoint.hub_names import to_hub, unfused_names
from orin.checkpoint.manifest import FileEntry, file_entry
from orin.checkpoint.targets import Target
from orin.components import component_of
from orin.errors import ModelError
from orin.fsutil import atomic_path

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



# safetensors' save_file lays tensors out by dtype (this order) and then by name; the streamed shard does the same,
# so it holds the bytes save_file would write, and each module's tensors lie together as the loader reads them.
_DTYPE_ORDER = ("I64", "F64", "F32", "I32", "BF16", "F16", "I16", "I8", "U8", "BOOL")
_ST_NAMES = {torch.int64: "I64", torch.float64: "F64", torch.float32: "F32", torch.int32: "I32",
             torch.bfloat16: "BF16", torch.float16: "F16", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}


def _replaced(targets: list[Target]) -> set[str]:
    out = set()
    for t in targets:
        if t.kind == "linear":
            out.update((f"{t.path}.weight", f"{t.path}.bias"))
        else:
            out.update((f"{t.path}.gate_up_proj", f"{t.path}.down_proj"))
    return out


def shard_plan(skeleton, source, components: tuple[str, ...], targets: list[Target], gptq_files: list[Path]
               ) -> list[tuple[str, torch.dtype, tuple[int, ...], Callable[[], torch.Tensor]]]:
    """Every tensor of the segment's shard, in file order: (hub name, dtype, shape, a function that reads it).
    GPTQ v1 tensors of the quantized modules come from this run's layer checkpoints (`gptq_files`); the
    segment's other parameters are copied from the source checkpoint in BF16 (fused experts that stay BF16 as
    one weight per expert, as the hub stores them); persistent buffers from the model."""
    from safetensors import safe_open

    from orin.checkpoint.files import read_header
    from orin.checkpoint.hub_names import is_fused_experts

    entries = []
    replaced = _replaced(targets)
    for name, param in skeleton.named_parameters():
        if component_of(name) not in components or name in replaced:
            continue
        dtype = torch.bfloat16 if param.is_floating_point() else param.dtype
        parts = source.parts[name]
        if is_fused_experts(name):
            shape = tuple(param.shape[1:])
            if name.endswith("gate_up_proj"):
                shape = (shape[0] // 2, shape[1])
            for hub, part in zip(unfused_names(name, param.shape[0]), parts, strict=True):
                entries.append((hub, dtype, shape, lambda p=part, d=dtype: source.read_part(p, d)))
        else:
            entries.append((to_hub(name), dtype, tuple(param.shape),
                            lambda p=parts[0], d=dtype: source.read_part(p, d)))
    persistent = set(skeleton.state_dict().keys())
    for name, buffer in skeleton.named_buffers():
        if name in persistent and component_of(name) in components:
            entries.append((to_hub(name), buffer.dtype, tuple(buffer.shape), lambda b=buffer: b.detach().cpu()))
    dtypes = {v: k for k, v in _ST_NAMES.items()}
    readers: dict[str, object] = {}

    def gptq(file: str, key: str) -> torch.Tensor:
        if file not in readers:
            readers[file] = safe_open(file, framework="pt")
        return readers[file].get_tensor(key)

    for file in gptq_files:
        for key, info in read_header(file).items():
            if component_of(key) in components:
                entries.append((to_hub(key), dtypes[info["dtype"]], tuple(info["shape"]),
                                lambda f=str(file), k=key: gptq(f, k)))
    rank = {name: i for i, name in enumerate(_DTYPE_ORDER)}
    return sorted(entries, key=lambda e: (rank[_ST_NAMES[e[1]]], e[0]))


def write_shard(out: Path, shard: str, plan: list, finished_shards: list[str]) -> tuple[FileEntry, int]:
    """Write one segment's shard from its plan (shard_plan) tensor by tensor through a temporary file, then the
    index over it and the shards already finished; return the shard's file entry and its tensor payload bytes."""
    from orin.checkpoint.safetensors_stream import PlannedTensor, write_safetensors_stream

    planned = [PlannedTensor(name, dtype, shape) for name, dtype, shape, _ in plan]
    with atomic_path(out / shard) as tmp:
        size, sha = write_safetensors_stream(tmp, planned, ((name, read()) for name, _d, _s, read in plan),
                                             {"format": "pt"})
    write_index(out, list(dict.fromkeys([*finished_shards, shard])))
    return FileEntry(shard, size, sha), sum(p.nbytes for p in planned)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
