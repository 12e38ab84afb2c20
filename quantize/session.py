"""A quantize run's session: the model's skeleton and what of it is loaded, the calibration samples and what the
BF16 passes recorded over them (run now, or read back from OUT/.partial); then, per segment, GPTQ of its stacks,
its measures against BF16 on the held-out conversations, and its shard written. Also the run's memory plan and the
key a saved partial state must match."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from orin import __version__
from orin import components as C
from orin.checkpoint.manifest import Manifest, SegmentEntry, read_manifest, utc_now, write_segment_entry
from orin.errors import InputError, ModelError

from .progress import Progress
from .settings import QuantConfig, calibration_source, quantization_record
from .skips import Skips


@dataclass
class Session:
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
              memory, meter) -> Session:
        import torch

        from orin.checkpoint.targets import find_targets

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
        from orin.checkpoint.files import read_header
        from orin.checkpoint.reader import int4_module_of

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
                raise InputError(f"{calibration_source(cfg)}: no calibration input reached the "
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
    """The BF16 passes over the calibration set (quantize/capture.py, quantize/speech_capture.py)."""
    from . import adapters as A
    from .capture import capture_thinker_pass
    from .partial import PassState
    from .skips import PassRunner
    from .speech_capture import SpeechSettings, SpeechStreaming, capture_speech_pass

    calibration = _calib_info(cfg, samples)
    log.log(f"calibration: {calibration['conversations']} conversations, {calibration['heldout']} held out for "
            f"the report; device {plan['device']}")
    runner = PassRunner(calibration_source(cfg), skips, log)
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


def _calib_info(cfg: QuantConfig, samples: list) -> dict:
    """The planned split, with how many calibration (not held-out) conversations feed each modality; report.json
    adds what each pass used and what was skipped."""
    from .calibration import MODALITIES

    heldout = [s.name for s in samples if s.heldout]
    modalities = {m: sum(m in s.modalities for s in samples if not s.heldout) for m in MODALITIES}
    return {"source": cfg.calib or "built-in synthetic set", "conversations": len(samples) - len(heldout),
            "heldout": len(heldout), "heldout_names": heldout, "modalities": modalities}


def memory_plan(cfg: QuantConfig, plan: dict, samples: list, comps: set[str]):
    """Where the run keeps what (quantize/memory.py), measured on these samples for these components, within
    --max-gpu-memory and --max-host-memory."""
    from orin.checkpoint.targets import find_targets

    from . import adapters as A
    from .memory import make_plan, measure
    from .meter import host_rss_now
    from .speech_capture import SpeechSettings

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
        "quantization": quantization_record(cfg), "split": {k: list(v) for k, v in plan["split"].items()},
        "calibration": inputs_digest(samples),
        "settings": {k: getattr(cfg, k) for k in ("samples", "min_expert_tokens", "starved_experts", "seed",
                                                  "reply_tokens", "speech_frames", "min_speech_frames",
                                                  "speech_samples", "calib")},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, **PINNED},
        "device": [device.type, torch.cuda.get_device_name(device) if device.type == "cuda" else ""],
    })


def _metrics(model, residency, samples, comps: tuple[str, ...], thinker_refs: dict, talker_refs: dict,
             progress) -> dict:
    """The segment's end-to-end measures on the held-out conversations, the model as quantized so far in this
    run (quantize.weights.QuantizedStore) against the BF16 references."""
    from .activations import materialize, tree_to
    from .capture import THINKER_SHELL, ThinkerOutputs, thinker_logits, thinker_prefix
    from .report import LogitsAgreement, codec_metrics, encoder_metric
    from .speech_capture import talker_codes

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


def _write(out: Path, name: str, comps: tuple[str, ...], session: Session, targets: list, gptq_files: list,
           started: str, extra: dict, planned: list) -> SegmentEntry:
    """Write the segment's shard; `targets` are the INT4 modules quantized in it (model order), which must be
    the ones config.json's quantization_config promised (`planned`, the whole split's)."""
    from orin.checkpoint.files import segment_shards

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
