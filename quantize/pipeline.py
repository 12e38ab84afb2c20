"""`orin-omni quantize`: GPTQ INT4 of Qwen3-Omni in bounded memory, one segment (one shard of a standard GPTQ
directory, see orin.checkpoint.files) at a time, resumable at layer granularity.

Order of work: validate everything that can be validated cheaply (the model dir and its weights' names and shapes,
the split, bits and group size against the model's dims, the output dir: quantize/prepare.py; every calibration
entry and its media: here), encode the calibration set, then plan the run's memory (quantize/memory.py) before
loading any weight, refusing limits it cannot keep. The model is never loaded whole: quantize/weights.py fills a
meta-device skeleton one module at a time from the checkpoint's safetensors files. The BF16 passes run once over the
calibration set (the thinker pass and, when a speech-side stack is needed, the speech pass: quantize/capture.py,
quantize/speech_capture.py), their results saved to OUT/.partial (quantize/partial.py); then, per unfinished
segment in split order (quantize/session.py): GPTQ its stacks layer by layer (quantize/sequential.py), each layer
checkpointed as it finishes, measure it against BF16 on held-out conversations, write its shard tensor by tensor and
only then add its manifest entry and its report. A conversation the processor cannot encode or the model fails on
in a pass is skipped with a warning and listed in the report (quantize/calibration.py says when too few are left).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from orin.checkpoint.manifest import Manifest, remove_segment_entry, verify_files, write_manifest
from orin.errors import BudgetError, InputError, UsageError

from .prepare import create_out, resume_state, validate
from .progress import Progress
from .session import Session, memory_plan
from .settings import QuantConfig, calibration_source
from .skips import Skips

LOCK_NAME = ".quantize.lock"

__all__ = ["QuantConfig", "QuantizeRun", "quantize_run", "render_result", "run_quantize"]


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
    plan = validate(cfg)
    meter = RunMeter(plan["device"])
    from orin.runtime.attention import without_cudnn_attention

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
    The lock file is hidden inside OUT while the run lasts and removed when it ends, so a finished checkpoint
    holds only its own files (a killed run leaves it; the next run takes it over)."""
    import fcntl
    import os

    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; give a directory")
    out.mkdir(parents=True, exist_ok=True)
    lock = out / LOCK_NAME
    while True:
        fh = open(lock, "a")  # closed below, once the lock is released
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            fh.close()
            raise UsageError(f"another orin-omni quantize is writing {out}; wait for it to finish") from exc
        try:
            current = os.stat(lock)
        except FileNotFoundError:
            current = None
        if current is not None and os.path.samestat(current, os.fstat(fh.fileno())):
            break
        # The run before removed the file between this open and this lock: the lock is on a name no one sees.
        fh.close()
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)  # while still held: a run starting now finds it gone and takes a new one
        fcntl.flock(fh, fcntl.LOCK_UN)
        fh.close()


def _run(cfg: QuantConfig, plan: dict, log: Progress, meter) -> tuple[Manifest, object]:
    out, split = plan["out"], plan["split"]
    manifest, wipe = resume_state(cfg, out, plan["config_sha"], split)
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
    memory = memory_plan(cfg, plan, samples, comps)
    log.log(memory.describe())
    if manifest is None:
        manifest = create_out(cfg, plan, wipe)
    from .memory import enforce_gpu_limit, release_gpu_limit

    enforce_gpu_limit(plan["device"], cfg.max_gpu_memory)
    try:
        session = Session.start(cfg, plan, comps, samples, skips, log, memory, meter)
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
        raise InputError(f"{calibration_source(cfg)}: no conversation{left} has an image or a video, so the vision "
                         "encoder cannot be calibrated; add image or video entries (or leave its segment out of "
                         "--segments)")
    if "audio_encoder" in comps and cfg.quantize_audio_encoder and "audio" not in have:
        raise InputError(f"{calibration_source(cfg)}: no conversation{left} has audio, so the audio encoder cannot "
                         "be calibrated; add audio entries or drop --quantize-audio-encoder")


def _encode(cfg: QuantConfig, plan: dict, convs: list, skips: Skips) -> list:
    """The conversations as model inputs (in host memory), the held-out ones marked; those the processor cannot
    encode are skipped. Conversations with videos go through orin.inputs' processor (transformers' video processor
    needs torchvision), the others through transformers'."""
    import torch

    from .calibration import hold_out, to_samples
    from .hf_processor import build_processor

    video_processor = None
    if any(c.videos for c in convs):
        from orin.inputs.processor import Processor

        video_processor = Processor.from_dir(plan["model_dir"])
    # in host memory: each conversation's inputs go to the device when it runs (a video's pixels are 0.1 GiB)
    samples = to_samples(build_processor(plan["model_dir"]), convs, torch.device("cpu"), skips, video_processor)
    hold_out(calibration_source(cfg), convs, samples, skips)
    return samples


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
