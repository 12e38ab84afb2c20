"""Before any weight is read: a quantize run's inputs validated (the model directory, its weights' names and
shapes, the split, bits and group size against the model's dims, the limits), and OUT resumed where its
checkpoint was made with the same settings, or created afresh (the shared files copied, config.json written)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from dataclasses import asdict
from pathlib import Path

from orin import __version__
from orin import components as C
from orin.checkpoint.manifest import (
    SCHEMA_VERSION,
    Manifest,
    check_served_name,
    default_served_name,
    read_manifest,
    utc_now,
    write_manifest,
)
from orin.device.select import pick_device
from orin.errors import ModelError, UsageError

from .settings import QuantConfig, quantization_record, quantizer_name


def validate(cfg: QuantConfig) -> dict:
    """Everything about the run that can be checked cheaply, and what the run needs of it (the plan dict)."""
    from orin.model.config_file import config_path

    from .adapters import check_group_size
    from .hf_config import load_config
    from .sequential import STARVED_POLICIES

    if cfg.served_model_name is not None:
        check_served_name(cfg.served_model_name)
    if cfg.samples < 2:
        raise UsageError(f"--samples {cfg.samples}: need at least 2 (one to calibrate, one held out for the report)")
    if cfg.starved_experts not in STARVED_POLICIES:
        raise UsageError(f"--starved-experts {cfg.starved_experts!r}: use {' or '.join(STARVED_POLICIES)}")
    quantizer_name(cfg)  # an unknown --solver, or gptqmodel asked for where it does not import, fails here
    split = C.parse_segments(cfg.split)
    names = C.select_segments(split, cfg.segments)
    model_dir = Path(cfg.model)
    if not model_dir.is_dir():
        raise ModelError(f"{model_dir}: not a directory; give the Qwen3-Omni checkpoint directory (config.json, "
                         "*.safetensors, tokenizer)")
    config = load_config(model_dir)
    if not any(model_dir.glob("*.safetensors")):
        raise ModelError(f"{model_dir}: no *.safetensors weights; download the full checkpoint")
    from .writer import shared_file_names

    shared_file_names(model_dir)
    from orin.checkpoint.targets import find_targets
    from orin.memory.model_sizes import meta_model
    from orin.model.config import load_omni_config

    skeleton = meta_model(load_omni_config(model_dir))
    targets = find_targets(skeleton, cfg.spec)
    check_group_size(targets, cfg.group_size, cfg.bits)
    device = pick_device(cfg.device)
    for flag, value in (("--max-gpu-memory", cfg.max_gpu_memory), ("--max-host-memory", cfg.max_host_memory)):
        if value <= 0:
            raise UsageError(f"{flag} must be a positive size, e.g. 16GiB")
    from .activations import PLACEMENTS

    if cfg.activations not in (None, *PLACEMENTS):
        raise UsageError(f"--activations {cfg.activations!r}: use auto, {', '.join(PLACEMENTS)}")
    from .weights import SourceWeights, build_skeleton

    skeleton_hf = build_skeleton(config)
    source = SourceWeights(model_dir)
    source.check_covers(skeleton_hf)
    config_sha = hashlib.sha256(config_path(model_dir).read_bytes()).hexdigest()
    out = Path(cfg.out)
    if out.resolve() == model_dir.resolve():
        raise UsageError("--out must not be the model directory")
    return {"split": split, "names": names, "model_dir": model_dir, "config": config, "config_sha": config_sha,
            "out": out, "device": device, "skeleton": skeleton, "targets": targets, "skeleton_hf": skeleton_hf,
            "source": source}


def _same_settings(manifest: Manifest, cfg: QuantConfig, config_sha: str, split: dict) -> str | None:
    if manifest.source.get("config_sha256") != config_sha:
        return "it was quantized from a different model (config.json sha256 differs)"
    if manifest.quantization.get("spec") != asdict(cfg.spec):
        return f"its quantization settings differ ({json.dumps(manifest.quantization.get('spec'))})"
    if manifest.split != split:
        return "its segment split differs"
    return None


def resume_state(cfg: QuantConfig, out: Path, config_sha: str, split: dict) -> tuple[Manifest | None, bool]:
    """The manifest to resume from (None for a fresh start) and whether OUT's old segments must be wiped first
    (--force with other settings). Writes nothing."""
    if (out / "manifest.json").is_file():
        manifest = read_manifest(out)
        if manifest.schema_version != SCHEMA_VERSION:
            if not cfg.force:
                raise UsageError(f"{out} holds an orin-omni 0.1 checkpoint (per-segment directories); quantize writes "
                                 f"the standard layout and cannot resume it: convert it without re-quantizing "
                                 f"(orin-omni convert {out} --out NEW), or pass --force to start over")
            return None, True
        differs = _same_settings(manifest, cfg, config_sha, split)
        if differs is None:
            return manifest, False
        if not cfg.force:
            raise UsageError(f"{out} holds a checkpoint that cannot be resumed with these options: {differs}; "
                             "pass --force to start it over, or choose another --out")
        return None, True
    if out.exists() and any(not p.name.startswith(".") for p in out.iterdir()):
        raise UsageError(f"{out} exists and is not an orin-omni checkpoint; choose an empty or new --out directory")
    return None, False


def create_out(cfg: QuantConfig, plan: dict, wipe: bool) -> Manifest:
    """A fresh manifest with no finished segment, the shared files copied and config.json written beside it.
    config.json's quantization_config names every INT4 module of the whole split, decided here before any GPTQ:
    each segment writes exactly its share of them (checked in _write)."""
    from orin.checkpoint.files import INDEX_NAME, model_quantization_config

    from .report import drop_segments
    from .writer import copy_shared_files

    out, model_dir, split = plan["out"], plan["model_dir"], plan["split"]
    if wipe:
        old = read_manifest(out)
        write_manifest(out, dataclasses.replace(old, segments={}))  # first unmark every segment, then delete
        for name in old.split:
            if (out / name).is_dir():  # an orin-omni 0.1 segment directory
                shutil.rmtree(out / name)
        for shard in [*out.glob("model-*-of-*.safetensors"), out / INDEX_NAME]:
            shard.unlink(missing_ok=True)
        drop_segments(out, set())
    qconfig = model_quantization_config(plan["skeleton"], cfg.spec, plan["targets"], cfg.damp, quantizer_name(cfg))
    manifest = Manifest(
        tool_version=__version__, created_at=utc_now(),
        source={"model_dir": str(model_dir.resolve()), "config_sha256": plan["config_sha"]},
        quantization=quantization_record(cfg), split={k: tuple(v) for k, v in split.items()},
        shared_files=tuple(copy_shared_files(model_dir, out, qconfig)), segments={},
        served_model_name=cfg.served_model_name or default_served_name(cfg.bits),
    )
    write_manifest(out, manifest)
    return manifest
