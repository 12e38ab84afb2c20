"""The on-disk layout of a quantized checkpoint: an ordinary Hugging Face GPTQ model directory that vLLM,
transformers and GPTQ tools read, which is also orin-omni's unit of swapping and resuming.

    OUT/config.json                     the source config plus `quantization_config` (GPTQ, 4 bit, group, sym)
    OUT/quantize_config.json            the same `quantization_config` (GPTQ tools read this file)
    OUT/model-0000i-of-0000n.safetensors one shard per segment, in split order, hub tensor names
    OUT/model.safetensors.index.json    weight_map of the finished shards
    OUT/manifest.json                   orin-omni's: segment -> shard, sizes, sha256, provenance
    OUT/tokenizer.json, chat_template.jinja, preprocessor_config.json, ...   copied from the source

Written by `orin-omni quantize` and by the synthetic benchmark checkpoint, read by orin.checkpoint.reader. Metadata
travels in the files (manifest, quantization_config); the shard names are the hub's usual ones.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from .. import __version__
from ..errors import ModelError
from ..fsutil import atomic_write_json
from .hub_names import is_fused_experts, to_hub, unfused_names

INDEX_NAME = "model.safetensors.index.json"
QUANTIZE_CONFIG_NAME = "quantize_config.json"
# Components whose Linears vLLM and transformers must leave in BF16 even inside quantized blocks, as regexes over
# any naming (hub, transformers, vLLM): `-:` rules in GPTQ's `dynamic` mean "not quantized".
_BF16_COMPONENT_RULES = {
    "audio_encoder": r"-:.*audio_tower\..*",
    "vision_encoder": r"-:.*visual\..*",
    "code_predictor": r"-:.*code_predictor\..*",
    "code2wav": r"-:.*code2wav\..*",
}
# Inside the quantized vision blocks the MLP's fc2 (4304 inputs: no group size divides it) stays BF16.
VISION_FC2_RULE = r"-:.*visual\.blocks\.\d+\.mlp\.linear_fc2"


def shard_name(index: int, count: int) -> str:
    """The shard file of the index-th segment (0-based) of `count`: the hub's usual shard names."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def segment_shards(split: dict[str, tuple[str, ...]]) -> dict[str, str]:
    return {name: shard_name(i, len(split)) for i, name in enumerate(split)}


def quantization_config(*, bits: int, group_size: int, sym: bool, damp: float, quantized_linears: list[str],
                        all_experts_quantized: bool, bf16_components: list[str], quantizer: str) -> dict:
    """`quantization_config` for config.json, read by transformers (optimum's GPTQ path) and vLLM (auto_gptq).

    `quantized_linears` are the runtime (transformers 5.23) names of every quantized Linear, experts one per
    expert. The two readers select modules differently: transformers takes a module when its runtime name ends
    with an entry of `modules_in_block_to_quantize`; vLLM when an entry, renamed by its Qwen3-Omni weight mapper,
    is a substring of its module prefix (MoE layers consult only `dynamic`). Full runtime and hub names serve both
    without ambiguity; experts are listed by their `mlp.experts.{e}.{proj}` suffix when every MoE layer's
    experts are quantized, which keeps the list short and is exact then."""
    entries: list[str] = []
    for name in quantized_linears:
        if all_experts_quantized and ".mlp.experts." in name:
            entries.append("mlp.experts." + name.split(".mlp.experts.", 1)[1])
        else:
            entries.extend((name, to_hub(name)))
    dynamic = {rule: {} for comp, rule in _BF16_COMPONENT_RULES.items() if comp in bf16_components}
    if "vision_encoder" not in bf16_components:
        dynamic[VISION_FC2_RULE] = {}
    return {
        "quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": sym, "desc_act": False,
        "lm_head": False, "true_sequential": True, "damp_percent": damp, "format": "gptq",
        "checkpoint_format": "gptq", "pack_dtype": "int32",
        # optimum's block patterns do not know Qwen3-Omni: "" makes it search the whole model, and the list
        # below then says which Linears are quantized.
        "block_name_to_quantize": "",
        "modules_in_block_to_quantize": [list(dict.fromkeys(entries))],
        "dynamic": dynamic,
        "meta": {"quantizer": [quantizer], "tool": f"orin-omni {__version__}"},
    }


def fused_experts_modules(model) -> set[str]:
    """The names of a model's fused MoE experts modules (transformers 5.x: gate_up_proj and down_proj)."""
    return {n for n, m in model.named_modules() if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")}


def model_quantization_config(model, spec, targets: list, damp: float, quantizer: str) -> dict:
    """quantization_config for a model whose INT4 modules are `targets` (orin.checkpoint.targets.Target) under `spec`."""
    from .. import components as C
    from .targets import enabled_components

    return quantization_config(
        bits=spec.bits, group_size=spec.group_size, sym=spec.sym, damp=damp,
        quantized_linears=[t.path + suffix for t in targets for suffix, *_ in t.linears()],
        all_experts_quantized=fused_experts_modules(model) <= {t.path for t in targets if t.kind == "experts"},
        bf16_components=[c for c in C.NAMES if c not in enabled_components(spec)], quantizer=quantizer)


def write_config_files(out: Path, source_config: dict, qconfig: dict) -> list[str]:
    """config.json (the source's plus quantization_config) and quantize_config.json; returns their names."""
    atomic_write_json(out / "config.json", {**source_config, "quantization_config": qconfig})
    atomic_write_json(out / QUANTIZE_CONFIG_NAME, qconfig)
    return ["config.json", QUANTIZE_CONFIG_NAME]


def read_header(path: Path) -> dict:
    """A safetensors file's header (tensor name -> dtype, shape, offsets), read without torch."""
    try:
        with open(path, "rb") as fh:
            size = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(size))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelError(f"{path}: not a readable safetensors file ({exc})") from exc
    header.pop("__metadata__", None)
    return header


def write_index(out: Path, shards: list[str]) -> None:
    """model.safetensors.index.json over the given shard files (the finished segments'), atomically."""
    weight_map, total = {}, 0
    for shard in shards:
        for key, info in read_header(out / shard).items():
            weight_map[key] = shard
            begin, end = info["data_offsets"]
            total += end - begin
    atomic_write_json(out / INDEX_NAME, {"metadata": {"total_size": total, "format": "pt"},
                                         "weight_map": dict(sorted(weight_map.items()))})


def hub_state(state: dict) -> dict:
    """A state dict under runtime names -> the same tensors under hub names, fused BF16 experts split into one
    weight per expert (views: nothing is copied)."""
    out = {}
    for name, tensor in state.items():
        if is_fused_experts(name):
            if name.endswith("gate_up_proj"):
                parts = [half for e in tensor.unbind(0) for half in e.chunk(2, dim=0)]
            else:
                parts = list(tensor.unbind(0))
            for key, part in zip(unfused_names(name, tensor.shape[0]), parts, strict=True):
                out[key] = part.contiguous()
        else:
            out[to_hub(name)] = tensor
    return out
