"""The quantize tests' oracle: GPTQ of the tiny model the in-memory way, as `orin-omni quantize` ran before it
streamed (issue 18). The whole BF16 model is loaded with transformers' from_pretrained; the thinker pass runs the
thinker's own forward over every held-out conversation, the speech pass transformers' own
generate(return_audio=True), the report's measures the whole quantized model; GPTQ (quantize.sequential, the
math both share) runs on the loaded model, and the shards' tensors are read off it.

`quantize_in_memory` returns, per segment, the shard's tensors under hub names and the report's figures, for a
test to compare with what the streamed pipeline wrote."""

from __future__ import annotations

import io
from pathlib import Path

import torch

from orin import components as C
from orin.checkpoint.files import hub_state
from orin.checkpoint.targets import find_targets
from orin.components import component_of
from quantize import adapters as A
from quantize.activations import Placement, StackData
from quantize.capture import (
    _THINKER_FIRST_LAYER,
    _THINKER_NEEDS,
    ThinkerOutputs,
    _first_layer_calls,
    encoder_outputs,
    record_first_calls,
    record_kwargs,
)
from quantize.gptq import GPTQSolver, resolve_solver
from quantize.progress import Progress
from quantize.report import codec_metrics, encoder_metric, logits_metrics
from quantize.sequential import StackOptions, StackQuantizer
from quantize.skips import PassRunner, Skips
from quantize.speech_capture import SpeechSettings, generate_speech, speech_commit, talker_codes


def run_thinker(model, inputs: dict) -> ThinkerOutputs:
    """The thinker's own forward over one whole conversation, with the encoders' outputs."""
    with encoder_outputs(model) as seen:
        out = model.thinker(**inputs, use_cache=False)
    return ThinkerOutputs(out.logits[0].detach().to(torch.bfloat16).cpu(), seen.get("vision"), seen.get("audio"))


def _thinker_pass(model, samples, stacks, reference, runner, new_data):
    wanted = {s: model.get_submodule(p) for s, p in _THINKER_FIRST_LAYER.items() if s in stacks}
    data = {s: new_data() for s in wanted}
    refs = {}
    language_model = model.get_submodule(A.STACK_OF["thinker_text"].layers.rsplit(".", 1)[0])
    decoder_start = model.get_submodule(_THINKER_FIRST_LAYER["thinker_text"])

    def work(sample, heldout):
        keep = reference and heldout
        with record_first_calls(wanted) as calls, \
                record_kwargs(language_model, ("visual_pos_masks", "deepstack_visual_embeds")) as deepstack:
            if keep:
                outputs = run_thinker(model, sample.inputs)
            else:
                _first_layer_calls(decoder_start, lambda: model.thinker(**sample.inputs, use_cache=False))

        def commit():
            if keep:
                refs[sample.name] = outputs
            for stack, stack_calls in calls.items():
                for call in stack_calls:
                    if stack == "thinker_text" and deepstack and deepstack[0]["deepstack_visual_embeds"] is not None:
                        call.extra.update(deepstack[0])
                    data[stack].add(call, heldout)
        return commit

    result = runner.run("thinker", samples, work, None if wanted else 0,
                        {C.BY_NAME[s].title: _THINKER_NEEDS[s] for s in wanted})
    return data, refs, result


def _speech_pass(model, samples, stacks, settings, reference, runner, new_data):
    data = {s: new_data() for s in A.SPEECH_PASS if s in stacks}
    refs = {}
    talker_layer0 = model.get_submodule(f"{A.STACK_OF['talker'].layers}.0")

    def work(sample, heldout):
        speech = generate_speech(model, sample, settings, "code2wav" in data)
        return speech_commit(model, data, refs, sample.name, speech, talker_layer0, reference, heldout)

    heldout = sum(s.heldout for s in samples)
    result = runner.run("speech", samples, work, max(1, settings.max_conversations - heldout),
                        {C.BY_NAME[s].title: "text" for s in data})
    return data, refs, result


def _metrics(model, samples, comps, thinker_refs, talker_refs) -> dict:
    metrics: dict = {}
    if {"thinker_text", "vision_encoder", "audio_encoder"} & set(comps) and thinker_refs:
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


def _segment_state(model, components, targets, gptq_tensors) -> dict:
    replaced = set()
    for t in targets:
        replaced.update((f"{t.path}.weight", f"{t.path}.bias") if t.kind == "linear"
                        else (f"{t.path}.gate_up_proj", f"{t.path}.down_proj"))
    state = {name: tensor.detach().to(torch.bfloat16).cpu().contiguous()
             for name, tensor in model.named_parameters() if component_of(name) in components and name not in replaced}
    state.update({k: t.contiguous() for k, t in gptq_tensors.items() if component_of(k) in components})
    return hub_state(state)


@torch.no_grad()
def quantize_in_memory(model_dir: str, cfg) -> dict:
    """{segment: {"tensors": {hub name: tensor}, "layer_types": ..., "metrics": ..., "starved_experts": ...}} of
    the whole split of `cfg` (a quantize.pipeline.QuantConfig on the built-in calibration set)."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from orin.inputs.processor import Processor
    from quantize.calibration import builtin_conversations, hold_out, to_samples
    from quantize.hf_config import load_config
    from quantize.hf_processor import build_processor

    device = torch.device(cfg.device)
    log = Progress(False, stream=io.StringIO())
    skips = Skips(lambda _m: None)
    convs = builtin_conversations(cfg.samples, cfg.seed)
    samples = to_samples(build_processor(Path(model_dir)), convs, device, skips, Processor.from_dir(Path(model_dir)))
    hold_out("builtin", convs, samples, skips)
    torch.manual_seed(cfg.seed)
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        model_dir, config=load_config(Path(model_dir)), dtype=torch.bfloat16).eval().to(device)
    split = C.parse_segments(cfg.split)
    comps = {c for names in split.values() for c in names}
    targets = find_targets(model, cfg.spec)
    by_stack, tail = A.group_targets(targets)
    stacks = {s for s in by_stack if s in comps} | ({"thinker_text"} & comps if tail else set())
    runner = PassRunner("builtin", skips, log)

    def new_data():
        return StackData(Placement("device", device))

    data, thinker_refs, thinker_pass = _thinker_pass(model, samples, stacks & set(A.THINKER_PASS), True, runner,
                                                     new_data)
    samples = [s for s in samples if s not in thinker_pass.skipped]
    settings = SpeechSettings(cfg.reply_tokens, cfg.speech_frames, cfg.min_speech_frames, cfg.speech_samples)
    speech, talker_refs, _ = _speech_pass(model, samples, stacks & set(A.SPEECH_PASS), settings, "talker" in comps,
                                          runner, new_data)
    data.update(speech)
    solver = GPTQSolver(cfg.bits, cfg.group_size, cfg.damp, device, cfg.sym, resolve_solver(cfg.solver))
    opts = StackOptions(cfg.bits, cfg.group_size, cfg.min_expert_tokens, cfg.starved_experts, cfg.sym)
    out = {}
    for name, seg_comps in split.items():
        tensors, types, starved, quantized = {}, {}, [], []
        for comp in (c for c in C.PIPELINE if c in seg_comps and c in stacks):
            result = StackQuantizer(model, A.STACK_OF[comp], solver, opts, log).run(
                by_stack.get(comp, {}), tail if comp == "thinker_text" else [], data[comp], comp)
            tensors.update(result.tensors)
            types.update(result.types)
            starved += result.starved
            quantized += result.quantized
        metrics = _metrics(model, samples, tuple(c for c in seg_comps if c in stacks), thinker_refs, talker_refs)
        done = [t for t in targets if t.path in set(quantized)]
        out[name] = {"tensors": _segment_state(model, seg_comps, done, tensors),
                     "layer_types": {k: v.to_json() for k, v in sorted(types.items())}, "metrics": metrics,
                     "starved_experts": starved}
    return out
