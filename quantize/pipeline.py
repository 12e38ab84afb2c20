"""`orin-omni quantize`: GPTQ INT4 of Qwen3-Omni in bounded memory, one segment (one shard of a standard GPTQ
directory, see orin.checkpoint_layout) at a time, resumable at layer granularity.

Order of work: validate everything that can be validated cheaply (the model dir and its weights' names and shapes,
the split, bits and group size against the model's dims, the output dir, every calibration entry and its media),
encode the calibration set, then plan the run's memory (quantize/memory.py) before loading any weight, refusing
limits it cannot keep. The model is never loaded whole: quantize/weights.py fills a meta-device skeleton one module
at a time from the checkpoint's safetensors files. The BF16 passes run once over the calibration set (the thinker
pass and, when a speech-side stack is needed, the speech pass: quantize/capture.py), their results saved to
OUT/.partial (quantize/partial.py); then, per unfinished segment in split order: GPTQ its stacks layer by layer
(quantize/sequential.py), each layer checkpointed as it finishes, measure it against BF16 on held-out
conversations, write its shard tensor by tensor and only then add its manifest entry and its report. A
conversation the processor cannot encode or the model fails on in a pass is skipped with a warning and listed in
the report (quantize/calibration.py says when too few are left).
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
from orin.errors import BudgetError, InputError, ModelError, UsageError
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

from .memory import DEFAULT_MAX_GPU_MEMORY, DEFAULT_MAX_HOST_MEMORY
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
    max_gpu_memory: int = DEFAULT_MAX_GPU_MEMORY  # bytes; the memory plan keeps the run under both
    max_host_memory: int = DEFAULT_MAX_HOST_MEMORY
    activations: str | None = None  # "device", "host" or "disk": where calibration activations live; None: planned
    solver: str = "auto"  # GPTQ solver: "gptqmodel", "own" (quantize/gptq_solve.py) or "auto" (GPTQModel if it imports)

    @property
    def spec(self) -> QuantSpec:
        return QuantSpec(bits=self.bits, group_size=self.group_size,
                         quantize_audio_encoder=self.quantize_audio_encoder,
                         quantize_code_predictor=self.quantize_code_predictor,
                         quantize_code2wav=self.quantize_code2wav, quantize_lm_head=self.quantize_lm_head,
                         sym=self.sym, quantize_vision=self.quantize_vision)


def quantizer_name(cfg: QuantConfig) -> str:
    """The GPTQ solver the run uses, by name and version (the manifest's, the report's and the resume key's)."""
    from .gptq import resolve_solver, solver_name

    return solver_name(resolve_solver(cfg.solver))


@dataclass(frozen=True)
class QuantizeRun:
    manifest: Manifest
    figures: dict  # the run's memory plan, wall time per stage and memory peaks (empty when nothing was to do)


def run_quantize(cfg: QuantConfig) -> Manifest:
    """Quantize the unfinished (or, with force, all) requested segments of cfg.model into cfg.out."""
    return quantize_run(cfg).manifest


def quantize_run(cfg: QuantConfig) -> QuantizeRun:
    """run_quantize, with the run's figures (`orin-omni quantize --json` prints them)."""
    from .meter import RunMeter

    log = Progress(cfg.progress)
    plan = _validate(cfg)
    meter = RunMeter(plan["device"])
    from orin.attention_kernels import without_cudnn_attention

    with _exclusive(plan["out"]), without_cudnn_attention():
        manifest, memory = _run(cfg, plan, log, meter)
    figures = {} if memory is None else {"memory_plan": memory.to_json(), **meter.figures()}
    if figures:
        from .report import update_run

        update_run(cfg.out, figures)
    return QuantizeRun(manifest, figures)


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


def _run(cfg: QuantConfig, plan: dict, log: Progress, meter) -> tuple[Manifest, object]:
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
        return manifest, None
    # Every calibration entry and its media are checked, and every conversation encoded, before anything in OUT
    # changes.
    convs = _calibration(cfg, log)
    comps = {c for n in todo for c in split[n]}
    _check_modalities(cfg, convs, comps)
    skips = Skips(log.log)
    samples = _encode(cfg, plan, convs, skips)
    _check_modalities(cfg, samples, comps, skipped=len(skips.items))
    memory = _memory_plan(cfg, plan, samples, comps)
    log.log(memory.describe())
    if manifest is None:
        manifest = _create_out(cfg, plan, wipe)
    from .memory import enforce_gpu_limit, release_gpu_limit

    enforce_gpu_limit(plan["device"], cfg.max_gpu_memory)
    try:
        session = _Session.start(cfg, plan, comps, samples, skips, log, memory, meter)
        for name in todo:
            if name in manifest.segments:
                manifest = remove_segment_entry(out, name)
            manifest = session.quantize_segment(name, split[name])
        if manifest.complete:  # else the passes (and layers of a segment not asked for now) serve a later run
            session.partial.clear()
    except _oom_errors() as exc:
        raise _over_limit(cfg, plan, exc) from exc
    finally:
        release_gpu_limit(plan["device"])
    return manifest, memory


def _oom_errors() -> tuple[type[BaseException], ...]:
    import torch

    return (torch.OutOfMemoryError,)


def _over_limit(cfg: QuantConfig, plan: dict, exc: BaseException) -> BudgetError:
    from orin.units import format_bytes

    return BudgetError(f"the run went past --max-gpu-memory {format_bytes(cfg.max_gpu_memory)} on {plan['device']} "
                       f"(the memory plan underestimated it: {str(exc).splitlines()[0][:200]}); raise "
                       "--max-gpu-memory, or rerun the same command: it resumes at the layer it was in")


@dataclass
class _Session:
    """The model's skeleton, what of it is loaded, the calibration samples and everything the BF16 passes
    recorded."""

    cfg: QuantConfig
    plan: dict
    log: Progress
    meter: object
    memory: object
    partial: object
    calibration: dict  # the split into calibration and held-out conversations, the passes and the skips
    model: object
    residency: object
    samples: list
    targets: list
    by_stack: dict
    tail: list
    stacks: set  # the stacks (components) to quantize in this run
    data: dict  # stack -> StackData
    thinker_refs: dict
    talker_refs: dict

    @classmethod
    def start(cls, cfg: QuantConfig, plan: dict, comps: set[str], samples: list, skips: Skips, log: Progress,
              memory, meter) -> _Session:
        import torch

        from orin.layout import find_targets

        from . import adapters as A
        from .activations import Placement
        from .partial import PartialState
        from .weights import Residency

        torch.manual_seed(cfg.seed)
        device = plan["device"]
        model = plan["skeleton_hf"]
        targets = find_targets(model, cfg.spec)
        by_stack, tail = A.group_targets(targets)
        stacks = {s for s in by_stack if s in comps} | ({"thinker_text"} & comps if tail else set())
        residency = Residency(model, plan["source"], device, targets, meter)
        partial = PartialState(plan["out"], _run_key(cfg, plan, samples), Placement(memory.activations, device),
                               log.log)
        thinker_side = bool(comps & {"thinker_text", "vision_encoder", "audio_encoder"})
        speech = bool(stacks & set(A.SPEECH_PASS)) or "talker" in comps
        wanted = (stacks & set(A.THINKER_PASS)) | (stacks & set(A.SPEECH_PASS))
        state = partial.load_passes(wanted, thinker_side, "talker" in comps)
        if state is not None:
            log.log(f"resuming: the BF16 passes' results are read back from {partial.root}")
        else:
            state = _passes(cfg, plan, model, residency, partial, samples, skips, log, memory, meter, stacks,
                            thinker_side, speech, "talker" in comps)
            partial.save_passes(state, thinker_side, "talker" in comps)
        kept = set(state.samples)
        samples = [s for s in samples if s.name in kept]
        return cls(cfg, plan, log, meter, memory, partial, state.calibration, model, residency, samples, targets,
                   by_stack, tail, stacks, state.data, state.thinker_refs, state.talker_refs)

    def quantize_segment(self, name: str, comps: tuple[str, ...]) -> Manifest:
        """GPTQ the segment's stacks in pipeline order, measure it, write its shard, then add its entry."""
        from orin.checkpoint import int4_module_of
        from orin.checkpoint_layout import read_header

        from . import adapters as A
        from .gptq import GPTQSolver, resolve_solver
        from .report import segment_report, update_report
        from .sequential import StackOptions, StackQuantizer

        cfg = self.cfg
        started = utc_now()
        self.log.log(f"segment {name}: {' + '.join(comps)}")
        solver = GPTQSolver(cfg.bits, cfg.group_size, cfg.damp, self.plan["device"], cfg.sym,
                            resolve_solver(cfg.solver))
        opts = StackOptions(cfg.bits, cfg.group_size, cfg.min_expert_tokens, cfg.starved_experts, cfg.sym)
        checkpoints = self.partial.checkpoints(name)
        types, starved, quantized = {}, [], []
        done = [c for c in C.PIPELINE if c in comps and c in self.stacks]
        for comp in done:
            stack_data = self.data.get(comp)
            if stack_data is None or not len(stack_data.calib):
                raise InputError(f"{_source(cfg)}: no calibration input reached the "
                                 f"{C.BY_NAME[comp].title}; add conversations that use it")
            result = StackQuantizer(self.model, A.STACK_OF[comp], solver, opts, self.log, self.residency,
                                    checkpoints, self.meter).run(
                self.by_stack.get(comp, {}), self.tail if comp == "thinker_text" else [], stack_data,
                f"GPTQ {name}/{comp}")
            types.update(result.types)
            starved += result.starved
            quantized += result.quantized
            for file in checkpoints.gptq_files(comp):  # what the model runs with from now on in this run
                for module in {int4_module_of(key) for key in read_header(file)} - {None}:
                    self.residency.quantized.add(module, file)
        with self.meter.stage("metrics"):
            metrics = _metrics(self.model, self.residency, self.samples,
                               tuple(c for c in comps if c in self.stacks), self.thinker_refs, self.talker_refs,
                               self.log)
        calibration = self.calibration
        finished = set(quantized)
        with self.meter.stage("writing"):
            entry = _write(Path(cfg.out), name, comps, self, [t for t in self.targets if t.path in finished],
                           [f for c in done for f in checkpoints.gptq_files(c)], started,
                           {"calibration": calibration}, self.plan["targets"])
            manifest = write_segment_entry(cfg.out, entry)
            update_report(cfg.out, name, segment_report(types, starved, metrics, calibration),
                          {"model": str(self.plan["model_dir"]), "quantization": cfg.spec.describe(),
                           "tool_version": __version__})
        shard = Path(cfg.out) / entry.files[0].path
        for path in list(self.residency.quantized.targets):  # the layer checkpoints go: read the shard instead
            if C.component_of(path) in comps:
                self.residency.quantized.add(path, shard, hub=True)
        self.partial.drop_segment(name)
        self.log.log(f"segment {name} written: {entry.total_bytes / 2**20:.1f} MiB ({len(quantized)} INT4 modules, "
                     f"{len(starved)} starved experts)")
        return manifest


def _passes(cfg: QuantConfig, plan: dict, model, residency, partial, samples: list, skips: Skips, log: Progress,
            memory, meter, stacks: set, thinker_side: bool, speech: bool, talker_reference: bool):
    """The BF16 passes over the calibration set (see quantize/capture.py)."""
    from . import adapters as A
    from .capture import SpeechSettings, SpeechStreaming, capture_speech_pass, capture_thinker_pass
    from .partial import PassState
    from .skips import PassRunner

    calibration = _calib_info(cfg, samples)
    log.log(f"calibration: {calibration['conversations']} conversations, {calibration['heldout']} held out for "
            f"the report; device {plan['device']}")
    runner = PassRunner(_source(cfg), skips, log)
    passes: dict = {}
    with meter.stage("calibration_forward"):
        data, thinker_refs, thinker_pass = capture_thinker_pass(model, residency, samples,
                                                                stacks & set(A.THINKER_PASS), thinker_side, runner,
                                                                partial.new_data, partial.keep_logits)
        if thinker_pass is not None:
            passes["thinker"] = thinker_pass.to_json()
            samples = [s for s in samples if s not in thinker_pass.skipped]  # a broken conversation stays out
        talker_refs: dict = {}
        if speech:
            if not getattr(model, "has_talker", False):
                raise ModelError(f"{plan['model_dir']}: the config has enable_audio_output false (no talker); "
                                 "leave the speech components out of --segments")
            log.log("speech pass: generating replies and speech with the BF16 model to calibrate the talker side")
            settings = SpeechSettings(cfg.reply_tokens, cfg.speech_frames, cfg.min_speech_frames,
                                      cfg.speech_samples)
            speech_data, talker_refs, speech_pass = capture_speech_pass(
                model, residency, samples, stacks & set(A.SPEECH_PASS), settings, talker_reference, runner,
                partial.new_data, SpeechStreaming(memory.speech_wave, memory.keep_layers))
            passes["speech"] = speech_pass.to_json()
            data.update(speech_data)
    if skips.items:
        log.log(f"{len(skips.items)} calibration conversation(s) skipped; report.json lists them with the reasons")
    calibration.update(passes=passes, **skips.to_json())
    return PassState(data, thinker_refs, talker_refs, calibration, [s.name for s in samples])


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
    from orin.layout import find_targets
    from orin.model_config import load_omni_config
    from orin.plan import meta_model

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


def _quantization(cfg: QuantConfig) -> dict:
    return {**cfg.spec.describe(), "spec": asdict(cfg.spec), "method": "gptq", "quantizer": quantizer_name(cfg),
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
    qconfig = model_quantization_config(plan["skeleton"], cfg.spec, plan["targets"], cfg.damp, quantizer_name(cfg))
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
    """The conversations as model inputs (in host memory), the held-out ones marked; those the processor cannot
    encode are skipped. Conversations with videos go through orin.inputs' processor (transformers' video processor
    needs torchvision), the others through transformers'."""
    import torch

    from orin.processor import build_processor

    from .calibration import hold_out, to_samples

    video_processor = None
    if any(c.videos for c in convs):
        from orin.inputs.processor import Processor

        video_processor = Processor.from_dir(plan["model_dir"])
    # in host memory: each conversation's inputs go to the device when it runs (a video's pixels are 0.1 GiB)
    samples = to_samples(build_processor(plan["model_dir"]), convs, torch.device("cpu"), skips, video_processor)
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


# ---------------------------------------------------------------------- memory and resuming


def _memory_plan(cfg: QuantConfig, plan: dict, samples: list, comps: set[str]):
    from orin.layout import find_targets

    from . import adapters as A
    from .capture import SpeechSettings
    from .memory import make_plan, measure
    from .meter import host_rss_now

    model = plan["skeleton_hf"]
    targets = find_targets(model, cfg.spec)
    by_stack, tail = A.group_targets(targets)
    stacks = {s for s in by_stack if s in comps} | ({"thinker_text"} & comps if tail else set())
    settings = SpeechSettings(cfg.reply_tokens, cfg.speech_frames, cfg.min_speech_frames, cfg.speech_samples)
    sizes = measure(model, plan["config"], samples, stacks, comps, targets, settings)
    thinker_side = bool(comps & {"thinker_text", "vision_encoder", "audio_encoder"})
    speech = bool(stacks & set(A.SPEECH_PASS)) or "talker" in comps
    max_gpu = cfg.max_gpu_memory
    if plan["device"].type == "cuda":  # a limit above the card is the card
        import torch

        max_gpu = min(max_gpu, torch.cuda.get_device_properties(plan["device"]).total_memory)
    return make_plan(sizes, plan["device"].type, max_gpu, cfg.max_host_memory, host_rss_now(), stacks,
                     thinker_side, speech, cfg.activations)


def _run_key(cfg: QuantConfig, plan: dict, samples: list) -> str:
    """What a partial state must have been computed from to be used: the weights, config and calibration data,
    every setting that changes a number, the code's and libraries' versions and the device."""
    import torch
    import transformers

    from .adapters import PINNED
    from .partial import inputs_digest, run_key
    from .weights import source_files

    device = plan["device"]
    files = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in source_files(plan["model_dir"])]
    return run_key({
        "tool": __version__, "config_sha256": plan["config_sha"], "weights": files,
        "quantization": _quantization(cfg), "split": {k: list(v) for k, v in plan["split"].items()},
        "calibration": inputs_digest(samples),
        "settings": {k: getattr(cfg, k) for k in ("samples", "min_expert_tokens", "starved_experts", "seed",
                                                  "reply_tokens", "speech_frames", "min_speech_frames",
                                                  "speech_samples", "calib")},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, **PINNED},
        "device": [device.type, torch.cuda.get_device_name(device) if device.type == "cuda" else ""],
    })


# ---------------------------------------------------------------------- measuring


def _metrics(model, residency, samples, comps: tuple[str, ...], thinker_refs: dict, talker_refs: dict,
             progress) -> dict:
    """The segment's end-to-end measures on the held-out conversations, the model as quantized so far in this
    run (quantize.weights.QuantizedStore) against the BF16 references."""
    from .activations import materialize, tree_to
    from .capture import THINKER_SHELL, ThinkerOutputs, talker_codes, thinker_logits, thinker_prefix
    from .report import LogitsAgreement, codec_metrics, encoder_metric

    metrics: dict = {}
    thinker_side = {"thinker_text", "vision_encoder", "audio_encoder"} & set(comps)
    if thinker_side and thinker_refs:
        by_name = {s.name: s for s in samples}
        held = [by_name[name] for name in thinker_refs if name in by_name]  # the references' order
        with residency.loaded(*THINKER_SHELL, quantized=True):
            prefixes = [thinker_prefix(model, tree_to(s.inputs, residency.device), {}) for s in held]
        now = {s.name: ThinkerOutputs(None, enc.get("vision"), enc.get("audio"))
               for s, (_calls, _text, enc) in zip(held, prefixes, strict=True)}
        if "thinker_text" in comps:
            agreement = LogitsAgreement()
            logits = thinker_logits(model, residency, [text for _calls, text, _enc in prefixes], True, progress,
                                    "measuring: held-out logits")
            for s, lg in zip(held, logits, strict=True):
                agreement.add(materialize(thinker_refs[s.name].logits), lg)
            metrics.update(agreement.to_json())
        if "vision_encoder" in comps:
            metrics.update(encoder_metric(thinker_refs, now, "vision"))
        if "audio_encoder" in comps:
            metrics.update(encoder_metric(thinker_refs, now, "audio"))
    if "talker" in comps and talker_refs:
        with residency.loaded("talker.model", "talker.codec_head", quantized=True):
            now_codes = {name: talker_codes(model, seq)[0] for name, (seq, _codes) in talker_refs.items()}
        metrics.update(codec_metrics({n: c for n, (_s, c) in talker_refs.items()}, now_codes))
    return metrics


def _write(out: Path, name: str, comps: tuple[str, ...], session: _Session, targets: list, gptq_files: list,
           started: str, extra: dict, planned: list) -> SegmentEntry:
    """Write the segment's shard; `targets` are the INT4 modules quantized in it (model order), which must be
    the ones config.json's quantization_config promised (`planned`, the whole split's)."""
    from orin.checkpoint_layout import segment_shards

    from .writer import shard_plan, write_shard

    promised = {t.path for t in planned if t.component in comps}
    if {t.path for t in targets} != promised:
        missing = sorted(promised - {t.path for t in targets})
        raise ModelError(f"segment {name}: {len(missing)} INT4 module(s) the checkpoint's quantization_config lists "
                         f"were not quantized (e.g. {missing[:1]}); re-run with --force")
    manifest = read_manifest(out)
    shards = segment_shards(manifest.split)
    finished = [shards[n] for n in manifest.finished if n != name]
    tensors = shard_plan(session.model, session.residency.source, comps, targets, gptq_files)
    file, payload = write_shard(out, shards[name], tensors, finished)
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
