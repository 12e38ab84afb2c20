"""`orin-omni quantize`: GPTQ INT4 of Qwen3-Omni, one segment (one shard of a standard GPTQ directory, see
orin.checkpoint_layout) at a time, resumable.

Order of work: validate everything that can be validated cheaply (the model dir, the split, bits and group
size against the model's dims, the output dir, every calibration entry and its media) before loading weights;
run the BF16 model once over the calibration set (the thinker pass and, when a speech-side stack is needed, the
speech pass: see quantize/capture.py); then, per unfinished segment in split order: GPTQ its stacks layer by
layer (quantize/sequential.py), measure it against BF16 on held-out conversations, write its shard atomically
and only then add its manifest entry and its report. A conversation the processor cannot encode or
the model fails on in a pass is skipped with a warning and listed in the report (quantize/calibration.py says
when too few are left).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from orin import __version__
from orin import components as C
from orin.device import pick_device
from orin.errors import InputError, ModelError, UsageError
from orin.layout import QuantSpec
from orin.manifest import (
    SCHEMA_VERSION,
    Manifest,
    SegmentEntry,
    check_served_name,
    default_served_name,
    read_manifest,
    remove_segment_entry,
    utc_now,
    verify_files,
    write_manifest,
    write_segment_entry,
)

from .progress import Progress
from .skips import BUILTIN_SOURCE, Skips

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
    reply_tokens: int = 64  # speech pass: reply tokens the thinker generates per conversation
    speech_frames: int = 128  # speech pass: codec frames the talker generates at most (~10 s of speech)
    min_speech_frames: int = 0
    speech_samples: int = 32  # speech pass: conversations run through generate() (plus the held-out ones)
    force: bool = False
    quantize_vision: bool = True  # False: the vision encoder stays BF16 (vLLM-Omni 0.30 needs that)
    sym: bool = True  # symmetric 4-bit: what vLLM's GPTQ kernels take; --asym measures lower error on some layers
    served_model_name: str | None = None  # the model id `serve` answers to; None: qwen3-omni-int<bits>
    progress: bool | None = None  # None: bars when stderr is a terminal

    @property
    def spec(self) -> QuantSpec:
        return QuantSpec(bits=self.bits, group_size=self.group_size,
                         quantize_audio_encoder=self.quantize_audio_encoder,
                         quantize_code_predictor=self.quantize_code_predictor,
                         quantize_code2wav=self.quantize_code2wav, quantize_lm_head=self.quantize_lm_head,
                         sym=self.sym, quantize_vision=self.quantize_vision)


def quantizer_name() -> str:
    from .adapters import PINNED

    return f"gptqmodel {PINNED['gptqmodel']}"


def run_quantize(cfg: QuantConfig) -> Manifest:
    """Quantize the unfinished (or, with force, all) requested segments of cfg.model into cfg.out."""
    log = Progress(cfg.progress)
    plan = _validate(cfg)
    with _exclusive(plan["out"]):
        return _run(cfg, plan, log)


@contextlib.contextmanager
def _exclusive(out: Path):
    """One quantize run per OUT at a time: a second one would interleave segment writes and manifest updates.
    The lock file is hidden inside OUT and stays (removing it would race with a starting run)."""
    import fcntl

    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; give a directory")
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".quantize.lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise UsageError(f"another orin-omni quantize is writing {out}; wait for it to finish") from exc
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _run(cfg: QuantConfig, plan: dict, log: Progress) -> Manifest:
    out, split = plan["out"], plan["split"]
    manifest, wipe = _resume_state(cfg, out, plan["config_sha"], split)
    if manifest is not None and cfg.served_model_name not in (None, manifest.served_model_name):
        # The name is the checkpoint's label, not a quantization setting: renaming never redoes a segment.
        manifest = dataclasses.replace(manifest, served_model_name=cfg.served_model_name)
        write_manifest(out, manifest)
    finished = manifest.segments if manifest is not None else {}
    todo = [n for n in plan["names"] if cfg.force or n not in finished]
    done = [n for n in plan["names"] if n not in todo]
    if done:
        verify_files(out, manifest, done)
        log.log(f"skipping finished segment(s) {', '.join(done)} (checksums verified; --force redoes them)")
    if not todo:
        return manifest
    # Every calibration entry and its media are checked, and every conversation encoded, before anything in OUT
    # changes.
    convs = _calibration(cfg, log)
    comps = {c for n in todo for c in split[n]}
    _check_modalities(cfg, convs, comps)
    skips = Skips(log.log)
    samples = _encode(cfg, plan, convs, skips)
    _check_modalities(cfg, samples, comps, skipped=len(skips.items))
    if manifest is None:
        manifest = _create_out(cfg, plan, wipe)
    session = _Session.start(cfg, plan, comps, samples, skips, log)
    for name in todo:
        if name in manifest.segments:
            manifest = remove_segment_entry(out, name)
        manifest = session.quantize_segment(name, split[name])
    return manifest


@dataclass
class _Session:
    """The loaded BF16 model, the calibration samples and everything the BF16 passes recorded."""

    cfg: QuantConfig
    plan: dict
    log: Progress
    calibration: dict  # the split into calibration and held-out conversations, the passes and the skips
    model: object
    samples: list
    targets: list
    by_stack: dict
    tail: list
    stacks: set  # the stacks (components) to quantize in this run
    data: dict  # stack -> StackData
    thinker_refs: dict
    talker_refs: dict

    @classmethod
    def start(cls, cfg: QuantConfig, plan: dict, comps: set[str], samples: list, skips: Skips, log: Progress
              ) -> _Session:
        import torch

        from orin.layout import find_targets

        from . import adapters as A
        from .capture import SpeechSettings, capture_speech_pass, capture_thinker_pass
        from .skips import PassRunner

        calibration = _calib_info(cfg, samples)
        torch.manual_seed(cfg.seed)
        device = plan["device"]
        model = _load_model(plan["model_dir"], plan["config"], device)
        targets = find_targets(model, cfg.spec)
        by_stack, tail = A.group_targets(targets)
        stacks = {s for s in by_stack if s in comps} | ({"thinker_text"} & comps if tail else set())
        log.log(f"calibration: {calibration['conversations']} conversations, {calibration['heldout']} held out for "
                f"the report; device {device}")
        runner = PassRunner(_source(cfg), skips, log)
        passes: dict = {}
        thinker_side = bool(comps & {"thinker_text", "vision_encoder", "audio_encoder"})
        data, thinker_refs, thinker_pass = capture_thinker_pass(model, samples, stacks & set(A.THINKER_PASS),
                                                                thinker_side, runner)
        if thinker_pass is not None:
            passes["thinker"] = thinker_pass.to_json()
            samples = [s for s in samples if s not in thinker_pass.skipped]  # a broken conversation stays out
        talker_refs: dict = {}
        if stacks & set(A.SPEECH_PASS) or "talker" in comps:
            if not getattr(model, "has_talker", False):
                raise ModelError(f"{plan['model_dir']}: the config has enable_audio_output false (no talker); "
                                 "leave the speech components out of --segments")
            log.log("speech pass: generating replies and speech with the BF16 model to calibrate the talker side")
            settings = SpeechSettings(cfg.reply_tokens, cfg.speech_frames, cfg.min_speech_frames,
                                      cfg.speech_samples)
            speech, talker_refs, speech_pass = capture_speech_pass(model, samples, stacks & set(A.SPEECH_PASS),
                                                                   settings, "talker" in comps, runner)
            passes["speech"] = speech_pass.to_json()
            data.update(speech)
        if skips.items:
            log.log(f"{len(skips.items)} calibration conversation(s) skipped; report.json lists them with the reasons")
        calibration.update(passes=passes, **skips.to_json())
        return cls(cfg, plan, log, calibration, model, samples, targets, by_stack, tail, stacks, data,
                   thinker_refs, talker_refs)

    def quantize_segment(self, name: str, comps: tuple[str, ...]) -> Manifest:
        """GPTQ the segment's stacks in pipeline order, measure it, write its shard, then add its entry."""
        from . import adapters as A
        from .gptq import GPTQSolver
        from .report import segment_report, update_report
        from .sequential import StackOptions, StackQuantizer

        cfg = self.cfg
        started = utc_now()
        self.log.log(f"segment {name}: {' + '.join(comps)}")
        solver = GPTQSolver(cfg.bits, cfg.group_size, cfg.damp, next(self.model.parameters()).device, cfg.sym)
        opts = StackOptions(cfg.bits, cfg.group_size, cfg.min_expert_tokens, cfg.starved_experts, cfg.sym)
        tensors, types, starved, quantized = {}, {}, [], []
        for comp in (c for c in C.PIPELINE if c in comps and c in self.stacks):
            stack_data = self.data.get(comp)
            if stack_data is None or not stack_data.calib:
                raise InputError(f"{_source(cfg)}: no calibration input reached the "
                                 f"{C.BY_NAME[comp].title}; add conversations that use it")
            result = StackQuantizer(self.model, A.STACK_OF[comp], solver, opts, self.log).run(
                self.by_stack.get(comp, {}), self.tail if comp == "thinker_text" else [], stack_data,
                f"GPTQ {name}/{comp}")
            tensors.update(result.tensors)
            types.update(result.types)
            starved += result.starved
            quantized += result.quantized
        metrics = _metrics(self.model, self.samples, tuple(c for c in comps if c in self.stacks), self.thinker_refs,
                           self.talker_refs)
        calibration = self.calibration
        done = set(quantized)
        entry = _write(Path(cfg.out), name, comps, self.model, [t for t in self.targets if t.path in done], tensors,
                       cfg, started, {"calibration": calibration}, self.plan["targets"])
        manifest = write_segment_entry(cfg.out, entry)
        update_report(cfg.out, name, segment_report(types, starved, metrics, calibration),
                      {"model": str(self.plan["model_dir"]), "quantization": cfg.spec.describe(),
                       "tool_version": __version__})
        self.log.log(f"segment {name} written: {entry.total_bytes / 2**20:.1f} MiB ({len(quantized)} INT4 modules, "
                     f"{len(starved)} starved experts)")
        return manifest


# ---------------------------------------------------------------------- validation and OUT


def _validate(cfg: QuantConfig) -> dict:
    from orin.modelcfg import config_path, load_config

    from .adapters import check_group_size
    from .sequential import STARVED_POLICIES

    if cfg.served_model_name is not None:
        check_served_name(cfg.served_model_name)
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
    from .writer import shared_file_names

    shared_file_names(model_dir)
    from orin.layout import find_targets
    from orin.model_config import load_omni_config
    from orin.plan import meta_model

    skeleton = meta_model(load_omni_config(model_dir))
    targets = find_targets(skeleton, cfg.spec)
    check_group_size(targets, cfg.group_size, cfg.bits)
    device = pick_device(cfg.device)
    config_sha = hashlib.sha256(config_path(model_dir).read_bytes()).hexdigest()
    out = Path(cfg.out)
    if out.resolve() == model_dir.resolve():
        raise UsageError("--out must not be the model directory")
    return {"split": split, "names": names, "model_dir": model_dir, "config": config, "config_sha": config_sha,
            "out": out, "device": device, "skeleton": skeleton, "targets": targets}


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


def _resume_state(cfg: QuantConfig, out: Path, config_sha: str, split: dict) -> tuple[Manifest | None, bool]:
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


def _create_out(cfg: QuantConfig, plan: dict, wipe: bool) -> Manifest:
    """A fresh manifest with no finished segment, the shared files copied and config.json written beside it.
    config.json's quantization_config names every INT4 module of the whole split, decided here before any GPTQ:
    each segment writes exactly its share of them (checked in _write)."""
    from orin.checkpoint_layout import INDEX_NAME, model_quantization_config

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
    qconfig = model_quantization_config(plan["skeleton"], cfg.spec, plan["targets"], cfg.damp, quantizer_name())
    manifest = Manifest(
        tool_version=__version__, created_at=utc_now(),
        source={"model_dir": str(model_dir.resolve()), "config_sha256": plan["config_sha"]},
        quantization=_quantization(cfg), split={k: tuple(v) for k, v in split.items()},
        shared_files=tuple(copy_shared_files(model_dir, out, qconfig)), segments={},
        served_model_name=cfg.served_model_name or default_served_name(cfg.bits),
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


def _check_modalities(cfg: QuantConfig, convs: list, comps: set[str], skipped: int = 0) -> None:
    """`convs`: conversations or the samples encoded from them, once `skipped` ones were skipped."""
    have = set().union(*(c.modalities for c in convs))
    left = f" left once {skipped} that cannot be encoded were skipped" if skipped else ""
    if "vision_encoder" in comps and cfg.quantize_vision and not have & {"image", "video"}:
        raise InputError(f"{_source(cfg)}: no conversation{left} has an image or a video, so the vision encoder "
                         "cannot be calibrated; add image or video entries (or leave its segment out of --segments)")
    if "audio_encoder" in comps and cfg.quantize_audio_encoder and "audio" not in have:
        raise InputError(f"{_source(cfg)}: no conversation{left} has audio, so the audio encoder cannot be "
                         "calibrated; add audio entries or drop --quantize-audio-encoder")


def _source(cfg: QuantConfig) -> str:
    return cfg.calib or BUILTIN_SOURCE


def _encode(cfg: QuantConfig, plan: dict, convs: list, skips: Skips) -> list:
    """The conversations as model inputs on the device, the held-out ones marked; those the processor cannot
    encode are skipped. Conversations with videos go through orin.inputs' processor (transformers' video processor
    needs torchvision), the others through transformers'."""
    from orin.processor import build_processor

    from .calibration import hold_out, to_samples

    video_processor = None
    if any(c.videos for c in convs):
        from orin.inputs.processor import Processor

        video_processor = Processor.from_dir(plan["model_dir"])
    samples = to_samples(build_processor(plan["model_dir"]), convs, plan["device"], skips, video_processor)
    hold_out(_source(cfg), convs, samples, skips)
    return samples


def _calib_info(cfg: QuantConfig, samples: list) -> dict:
    """The planned split, with how many calibration (not held-out) conversations feed each modality; report.json
    adds what each pass used and what was skipped."""
    from .calibration import MODALITIES

    heldout = [s.name for s in samples if s.heldout]
    modalities = {m: sum(m in s.modalities for s in samples if not s.heldout) for m in MODALITIES}
    return {"source": cfg.calib or "built-in synthetic set", "conversations": len(samples) - len(heldout),
            "heldout": len(heldout), "heldout_names": heldout, "modalities": modalities}


# ---------------------------------------------------------------------- model


def _load_model(model_dir: Path, config, device):
    """The BF16 model on `device`. The capture passes run the whole model, so it must fit there (about 70 GB
    for Qwen3-Omni-30B-A3B)."""
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration

    placement = {"device_map": {"": str(device)}} if device.type == "cuda" else {}
    try:
        model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(model_dir), config=config,
                                                                      dtype=torch.bfloat16, **placement)
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


def _write(out: Path, name: str, comps: tuple[str, ...], model, targets: list, tensors: dict, cfg: QuantConfig,
           started: str, extra: dict, planned: list) -> SegmentEntry:
    """Write the segment's shard; `targets` are the INT4 modules quantized in it (model order), which must be
    the ones config.json's quantization_config promised (`planned`, the whole split's)."""
    from orin.checkpoint_layout import segment_shards

    from .writer import segment_state, write_shard

    promised = {t.path for t in planned if t.component in comps}
    if {t.path for t in targets} != promised:
        missing = sorted(promised - {t.path for t in targets})
        raise ModelError(f"segment {name}: {len(missing)} INT4 module(s) the checkpoint's quantization_config lists "
                         f"were not quantized (e.g. {missing[:1]}); re-run with --force")
    manifest = read_manifest(out)
    shards = segment_shards(manifest.split)
    finished = [shards[n] for n in manifest.finished if n != name]
    state = segment_state(model, comps, targets, tensors)
    file, payload = write_shard(out, shards[name], state, finished)
    return SegmentEntry(name=name, components=tuple(comps), files=(file,),
                        total_bytes=file.bytes, int4_bytes=payload,
                        quantized_modules=tuple(t.path for t in targets), started_at=started, finished_at=utc_now(),
                        extra=extra)


def render_result(out: str, manifest: Manifest) -> str:
    """The quality table and where things are, for the terminal."""
    from .report import REPORT_NAME, load_report, render_report

    report = load_report(out)
    lines = [render_report(report), ""] if report else []
    sizes = ", ".join(f"{n} {manifest.segments[n].total_bytes / 2**20:.1f} MiB" for n in manifest.finished)
    lines.append(f"checkpoint {out}: {sizes}")
    pending = [n for n in manifest.split if n not in manifest.segments]
    if pending:
        lines.append(f"not yet quantized: {', '.join(pending)} (run again with --segments {','.join(pending)})")
    if report:
        lines.append(f"report: {Path(out) / REPORT_NAME}")
    return "\n".join(lines)
