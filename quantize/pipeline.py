"""`orin-omni quantize`: GPTQ INT4 of Qwen3-Omni, one segment directory at a time, resumable.

Order of work: validate everything that can be validated cheaply (the model dir, the split, bits and group
size against the model's dims, the output dir, every calibration entry and its media) before loading weights;
run the BF16 model once over the calibration set (the thinker pass and, when a speech-side stack is needed, the
speech pass: see quantize/capture.py); then, per unfinished segment in split order: GPTQ its stacks layer by
layer (quantize/sequential.py), measure it against BF16 on held-out conversations, write OUT/<segment>/
atomically and only then add its manifest entry and its report.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from orin import __version__
from orin import components as C
from orin.errors import InputError, ModelError, UsageError
from orin.layout import QuantSpec
from orin.manifest import (
    Manifest,
    SegmentEntry,
    read_manifest,
    remove_segment_entry,
    utc_now,
    verify_files,
    write_manifest,
    write_segment_entry,
)

from .progress import Progress

DEFAULT_SAMPLES = 128
DEFAULT_MIN_EXPERT_TOKENS = 64


@dataclass(frozen=True)
class QuantConfig:
    model: str
    out: str
    segments: tuple[str, ...] | None = None  # which segments to quantize (default: all of the split)
    split: str | None = None  # the segment split, e.g. "thinker=audio_encoder+thinker_text;talker_vision=..."
    bits: int = 4
    group_size: int = 128
    calib: str | None = None  # .jsonl file or directory; None = the built-in synthetic set
    samples: int = DEFAULT_SAMPLES
    device: str = "auto"  # auto, cpu, cuda, cuda:N
    quantize_audio_encoder: bool = False
    quantize_code_predictor: bool = False
    quantize_code2wav: bool = False
    quantize_lm_head: bool = False
    min_expert_tokens: int = DEFAULT_MIN_EXPERT_TOKENS
    starved_experts: str = "all-tokens"  # or "rtn"
    damp: float = 0.05
    seed: int = 0
    thinker_new_tokens: int = 64  # speech pass: reply tokens the thinker generates per conversation
    talker_new_tokens: int = 256  # speech pass: codec frames the talker generates at most
    talker_min_new_tokens: int = 0
    force: bool = False
    progress: bool | None = None  # None: bars when stderr is a terminal

    @property
    def spec(self) -> QuantSpec:
        return QuantSpec(bits=self.bits, group_size=self.group_size,
                         quantize_audio_encoder=self.quantize_audio_encoder,
                         quantize_code_predictor=self.quantize_code_predictor,
                         quantize_code2wav=self.quantize_code2wav, quantize_lm_head=self.quantize_lm_head)


def quantizer_name() -> str:
    from .adapters import PINNED

    return f"gptqmodel {PINNED['gptqmodel']}"


def run_quantize(cfg: QuantConfig) -> Manifest:
    log = Progress(cfg.progress)
    plan = _validate(cfg)
    out, model_dir, split, names = plan["out"], plan["model_dir"], plan["split"], plan["names"]
    manifest = _prepare_out(cfg, out, model_dir, plan["config_sha"], split)
    todo = [n for n in names if cfg.force or n not in manifest.segments]
    done = [n for n in names if n not in todo]
    if done:
        verify_files(out, manifest, done)
        log.log(f"skipping finished segment(s) {', '.join(done)} (checksums verified; --force redoes them)")
    if not todo:
        return manifest

    convs = _calibration(cfg, log)
    import torch

    from . import adapters as A
    from .calibration import holdout_count, split_heldout, to_samples
    from .capture import SpeechSettings, capture_speech_pass, capture_thinker_pass
    from .gptq import GPTQSolver
    from .sequential import StackOptions, StackQuantizer

    comps_todo = {c for n in todo for c in split[n]}
    _check_modalities(cfg, convs, comps_todo)
    heldout = split_heldout(convs, holdout_count(len(convs)))

    torch.manual_seed(cfg.seed)
    device = _device(cfg.device)
    model = _load_model(model_dir, plan["config"], device)
    from orin.layout import find_targets
    from orin.tiny import build_processor

    processor = build_processor(model_dir)
    samples = to_samples(processor, convs, heldout, device)
    spec = cfg.spec
    targets = find_targets(model, spec)
    by_stack, tail = A.group_targets(targets)
    stacks = {s for s in by_stack if s in comps_todo} | ({"thinker_text"} if tail and "thinker_text" in comps_todo
                                                         else set())
    log.log(f"calibration: {len(samples) - len(heldout)} conversations, {len(heldout)} held out for the report; "
            f"device {device}")

    thinker_side = comps_todo & {"thinker_text", "vision_encoder", "audio_encoder"}
    data, thinker_refs = capture_thinker_pass(model, samples, stacks & set(A.THINKER_PASS), bool(thinker_side))
    talker_refs = {}
    if stacks & set(A.SPEECH_PASS) or "talker" in comps_todo:
        if not getattr(model, "has_talker", False):
            raise ModelError(f"{model_dir}: the config has enable_audio_output false (no talker); quantize a "
                             "checkpoint with the talker, or leave the speech components out of --segments")
        settings = SpeechSettings(cfg.thinker_new_tokens, cfg.talker_new_tokens, cfg.talker_min_new_tokens)
        log.log("speech pass: generating replies and speech with the BF16 model to calibrate the talker side")
        speech_data, talker_refs = capture_speech_pass(model, samples, stacks & set(A.SPEECH_PASS), settings,
                                                       "talker" in comps_todo)
        data.update(speech_data)

    solver = GPTQSolver(cfg.bits, cfg.group_size, cfg.damp, device)
    opts = StackOptions(cfg.bits, cfg.group_size, cfg.min_expert_tokens, cfg.starved_experts)
    for name in todo:
        if name in manifest.segments:
            manifest = remove_segment_entry(out, name)
        started = utc_now()
        comps = split[name]
        log.log(f"segment {name}: {' + '.join(comps)}")
        tensors: dict = {}
        types: dict = {}
        starved: list = []
        quantized: list[str] = []
        for comp in C.PIPELINE:
            if comp not in comps or comp not in stacks:
                continue
            stack_data = data.get(comp)
            if stack_data is None or not stack_data.calib:
                raise InputError(f"no calibration input reached the {C.BY_NAME[comp].title}; add conversations "
                                 "that use it")
            quantizer = StackQuantizer(model, A.STACK_OF[comp], solver, opts, log)
            result = quantizer.run(by_stack.get(comp, {}), tail if comp == "thinker_text" else [], stack_data,
                                   f"{name}/{comp}")
            tensors.update(result.tensors)
            types.update(result.types)
            starved += result.starved
            quantized += result.quantized
        metrics = _metrics(model, samples, comps, thinker_refs, talker_refs)
        seg_targets = [t for t in targets if t.component in comps]
        entry = _write(out, name, comps, model, seg_targets, tensors, quantized, cfg, started,
                       {"calibration": _calib_info(cfg, convs, heldout)})
        manifest = write_segment_entry(out, entry)
        from .report import segment_report, update_report

        update_report(out, name, segment_report(types, starved, metrics, _calib_info(cfg, convs, heldout)),
                      {"model": str(model_dir), "quantization": spec.describe(), "tool_version": __version__})
        log.log(f"segment {name} written: {entry.total_bytes / 2**20:.1f} MiB "
                f"({len(quantized)} INT4 modules, {len(starved)} starved experts)")
    return manifest


# ---------------------------------------------------------------------- validation and OUT


def _validate(cfg: QuantConfig) -> dict:
    from orin.modelcfg import config_path, load_config

    from .adapters import check_group_size
    from .sequential import STARVED_POLICIES

    if cfg.samples < 2:
        raise UsageError(f"--samples {cfg.samples}: need at least 2 (one to calibrate, one held out for the report)")
    if cfg.starved_experts not in STARVED_POLICIES:
        raise UsageError(f"--starved-experts {cfg.starved_experts!r}: use {' or '.join(STARVED_POLICIES)}")
    split = C.parse_segments(cfg.split)
    names = C.select_segments(split, cfg.segments)
    model_dir = Path(cfg.model)
    if not model_dir.is_dir():
        raise ModelError(f"{model_dir}: not a directory; give the Qwen3-Omni checkpoint directory (config.json, "
                         "*.safetensors, tokenizer)")
    config = load_config(model_dir)
    if not any(model_dir.glob("*.safetensors")):
        raise ModelError(f"{model_dir}: no *.safetensors weights; download the full checkpoint")
    from orin.layout import find_targets
    from orin.plan import meta_model

    check_group_size(find_targets(meta_model(config), cfg.spec), cfg.group_size, cfg.bits)
    config_sha = hashlib.sha256(config_path(model_dir).read_bytes()).hexdigest()
    out = Path(cfg.out)
    if out.resolve() == model_dir.resolve():
        raise UsageError("--out must not be the model directory")
    return {"split": split, "names": names, "model_dir": model_dir, "config": config, "config_sha": config_sha,
            "out": out}


def _quantization(cfg: QuantConfig) -> dict:
    return {**cfg.spec.describe(), "spec": asdict(cfg.spec), "method": "gptq", "quantizer": quantizer_name(),
            "damp_percent": cfg.damp, "true_sequential": True}


def _same_settings(manifest: Manifest, cfg: QuantConfig, config_sha: str, split: dict) -> str | None:
    if manifest.source.get("config_sha256") != config_sha:
        return "it was quantized from a different model (config.json sha256 differs)"
    if manifest.quantization.get("spec") != asdict(cfg.spec):
        return f"its quantization settings differ ({json.dumps(manifest.quantization.get('spec'))})"
    if manifest.split != split:
        return "its segment split differs"
    return None


def _prepare_out(cfg: QuantConfig, out: Path, model_dir: Path, config_sha: str, split: dict) -> Manifest:
    from .report import drop_segments
    from .writer import copy_shared_files

    if (out / "manifest.json").is_file():
        manifest = read_manifest(out)
        differs = _same_settings(manifest, cfg, config_sha, split)
        if differs is None:
            return manifest
        if not cfg.force:
            raise UsageError(f"{out} holds a checkpoint that cannot be resumed with these options: {differs}; "
                             "pass --force to start it over, or choose another --out")
        for name in manifest.split:
            if (out / name).is_dir():
                shutil.rmtree(out / name)
        drop_segments(out, set())
    elif out.exists() and any(p for p in out.iterdir() if not p.name.startswith(".")):
        raise UsageError(f"{out} exists and is not an orin-omni checkpoint; choose an empty or new --out directory")
    out.mkdir(parents=True, exist_ok=True)
    manifest = Manifest(
        tool_version=__version__, created_at=utc_now(),
        source={"model_dir": str(model_dir.resolve()), "config_sha256": config_sha},
        quantization=_quantization(cfg), split={k: tuple(v) for k, v in split.items()},
        shared_files=tuple(copy_shared_files(model_dir, out)), segments={},
    )
    write_manifest(out, manifest)
    return manifest


# ---------------------------------------------------------------------- calibration


def _calibration(cfg: QuantConfig, log: Progress) -> list:
    from .calibration import builtin_conversations, load_calibration

    if cfg.calib is None:
        log.log(f"warning: no --calib given: calibrating on {cfg.samples} built-in synthetic conversations (tones, "
                "noise, drawn shapes); real conversations with real images and speech calibrate better")
        return builtin_conversations(cfg.samples, cfg.seed)
    convs = load_calibration(cfg.calib)
    if len(convs) < 2:
        raise InputError(f"{cfg.calib}: {len(convs)} conversation; need at least 2 (one is held out for the report)")
    if len(convs) < cfg.samples:
        log.log(f"note: {cfg.calib} has {len(convs)} conversations (--samples {cfg.samples}); using all of them")
    return convs[: cfg.samples]


def _check_modalities(cfg: QuantConfig, convs: list, comps: set[str]) -> None:
    have = set().union(*(c.modalities for c in convs))
    if "vision_encoder" in comps and "image" not in have:
        raise InputError(f"{cfg.calib}: no conversation has an image, so the vision encoder cannot be calibrated; "
                         "add image entries (or leave its segment out of --segments)")
    if "audio_encoder" in comps and cfg.quantize_audio_encoder and "audio" not in have:
        raise InputError(f"{cfg.calib}: no conversation has audio, so the audio encoder cannot be calibrated; "
                         "add audio entries or drop --quantize-audio-encoder")


def _calib_info(cfg: QuantConfig, convs: list, heldout: set[int]) -> dict:
    return {"source": cfg.calib or "built-in synthetic set", "conversations": len(convs) - len(heldout),
            "heldout": len(heldout), "heldout_names": [convs[i].name for i in sorted(heldout)]}


# ---------------------------------------------------------------------- model


def _device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise UsageError(f"--device {name!r}: not a device ({exc}); use cpu or cuda") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA GPU is available to this torch build; use --device cpu")
    return device


def _load_model(model_dir: Path, config, device):
    """The BF16 model on `device`. The capture passes run the whole model, so it must fit there (about 70 GB
    for Qwen3-Omni-30B-A3B)."""
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration

    try:
        model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(model_dir), config=config,
                                                                      dtype=torch.bfloat16)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise ModelError(f"{model_dir}: cannot load the weights ({exc})") from exc
    return model.eval().to(device)


def _metrics(model, samples, comps: tuple[str, ...], thinker_refs: dict, talker_refs: dict) -> dict:
    from .capture import run_thinker, talker_codes
    from .report import codec_metrics, encoder_metric, logits_metrics

    metrics: dict = {}
    thinker_side = {"thinker_text", "vision_encoder", "audio_encoder"} & set(comps)
    if thinker_side and thinker_refs:
        now = {s.name: run_thinker(model, s.inputs) for s in samples if s.name in thinker_refs}
        if "thinker_text" in comps:
            metrics.update(logits_metrics(thinker_refs, now))
        if "vision_encoder" in comps:
            metrics.update(encoder_metric(thinker_refs, now, "vision"))
        if "audio_encoder" in comps:
            metrics.update(encoder_metric(thinker_refs, now, "audio"))
    if "talker" in comps and talker_refs:
        now_codes = {name: talker_codes(model, seq)[0] for name, (seq, _codes) in talker_refs.items()}
        metrics.update(codec_metrics({n: c for n, (_s, c) in talker_refs.items()}, now_codes))
    return metrics


def _write(out: Path, name: str, comps: tuple[str, ...], model, targets, tensors: dict, quantized: list[str],
           cfg: QuantConfig, started: str, extra: dict) -> SegmentEntry:
    from .writer import quantize_config, segment_state, write_segment

    state = segment_state(model, comps, [t for t in targets if t.path in set(quantized)], tensors)
    qconfig = quantize_config(name, comps, [t for t in targets if t.path in set(quantized)], cfg.group_size,
                              cfg.bits, cfg.damp, quantizer_name())
    files, payload = write_segment(out, name, state, Path(cfg.model) / "config.json", qconfig)
    return SegmentEntry(name=name, components=tuple(comps), files=tuple(files),
                        total_bytes=sum(f.bytes for f in files), int4_bytes=payload,
                        quantized_modules=tuple(quantized), started_at=started, finished_at=utc_now(), extra=extra)
