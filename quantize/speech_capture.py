"""The speech pass over the calibration set: ``model.generate(return_audio=True)`` with greedy thinker and talker,
exactly as a request is served. The thinker's replies for a wave of conversations are generated with its layers
streamed (quantize.gate; a prefill's logits computed at its last position only, the one generate() reads), then
generate() goes on with each reply and the talker loaded whole; hooks record what the talker decoder, the code
predictor and code2wav's pre-transformer are fed at every step (the talker's prompt is built by generate() from
the thinker's embeddings and its ``accept_hidden_layer`` hidden states of the prompt and the generated reply). The
steps are concatenated into whole sequences and run once more, teacher-forced, to record those stacks' first-layer
inputs; causal attention makes that equal to the step-by-step run. The hooks are quantize/capture.py's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import adapters as A
from .activations import Call, StackData, tree_to
from .capture import (
    THINKER_HEAD,
    THINKER_SHELL,
    StopForward,
    _first_layer_calls,
    quiet_generation,
    record_first_calls,
    record_kwargs,
)

if TYPE_CHECKING:
    from .skips import PassResult


@dataclass(frozen=True)
class SpeechSettings:
    reply_tokens: int = 64
    speech_frames: int = 128
    min_speech_frames: int = 0
    max_conversations: int = 32  # held-out ones always run; generate() is the slow part of calibration


@dataclass
class TalkerSequence:
    """What the talker decoder was fed over one generate() call, concatenated: replaying it teacher-forced
    reproduces the step-by-step run."""

    inputs_embeds: torch.Tensor  # [1, T, H]
    position_ids: torch.Tensor  # [4, 1, T]
    prompt_len: int  # the prefill's length; predictions from position prompt_len - 1 on are generated codes


def codec_suppressed(config) -> list[int]:
    """The codec ids generate() never lets the talker emit (the 1024 top ids but EOS)."""
    tk = config.talker_config
    vocab = tk.text_config.vocab_size
    return [i for i in range(vocab - 1024, vocab) if i != tk.codec_eos_token_id]


@contextlib.contextmanager
def _stop_at(module: torch.nn.Module | None) -> Iterator[None]:
    """End the forward pass (and generate()) when `module` is about to run: what comes after is not needed."""
    if module is None:
        yield
        return

    def hook(_mod, _args):
        raise StopForward

    handle = module.register_forward_pre_hook(hook)
    try:
        with contextlib.suppress(StopForward):
            yield
    finally:
        handle.remove()


@contextlib.contextmanager
def keep_results(module: torch.nn.Module, into: list) -> Iterator[None]:
    """Keep what module.generate() returns: generate(return_audio=True) hands the thinker's and the talker's
    results only to its own code, and they tell an empty reply from a real one."""
    original = module.generate
    shadowed = module.__dict__.get("generate")

    def generate(*args, **kwargs):
        result = original(*args, **kwargs)
        into.append(result)
        return result

    module.generate = generate  # an instance attribute: the model's generate() calls it instead of the method
    try:
        yield
    finally:
        if shadowed is None:
            del module.generate
        else:
            module.generate = shadowed


def _empty_reply(model, sample, thinker_results: list, talker_results: list) -> str | None:
    """Why the reply has nothing to calibrate the speech stacks on, or None."""
    if thinker_results:
        reply = thinker_results[-1].sequences[0, sample.prompt_inputs["input_ids"].shape[1]:]
        if not len(reply) or int(reply[0]) == model.config.im_end_token_id:
            return "the thinker's reply is empty (it ended at once)"
    if talker_results:
        codes = talker_results[-1].sequences[0]
        if not len(codes) or int(codes[0]) == model.config.talker_config.codec_eos_token_id:
            return "the talker spoke no frame (its codec EOS came first)"
    return None


def _speaker(model, sample) -> str:
    speakers = sorted(model.config.talker_config.speaker_id)
    return speakers[sample.index % len(speakers)] if speakers else "ethan"


def _generate(model, sample, settings: SpeechSettings, device=None):
    """generate(return_audio=True) for one sample, greedy, as the speech pass runs it (its inputs moved to
    `device` first, when given)."""
    inputs = sample.prompt_inputs if device is None else tree_to(sample.prompt_inputs, device)
    return model.generate(
        **inputs, speaker=_speaker(model, sample), return_audio=True,
        thinker_max_new_tokens=settings.reply_tokens, thinker_do_sample=False,
        thinker_eos_token_id=model.config.im_end_token_id,
        talker_max_new_tokens=settings.speech_frames,
        talker_min_new_tokens=settings.min_speech_frames, talker_do_sample=False,
    )


@contextlib.contextmanager
def _thinker_generate(model, replacement) -> Iterator[None]:
    """model.thinker.generate replaced by `replacement` (an instance attribute) while inside."""
    model.thinker.generate = replacement
    try:
        yield
    finally:
        del model.thinker.generate


@torch.no_grad()
def thinker_call(model, sample, settings: SpeechSettings, device=None) -> tuple[tuple, dict]:
    """The arguments generate(return_audio=True) calls the thinker's generate() with for `sample` (taken from
    the call itself, so the replies computed apart are exactly the ones it would compute)."""
    seen: list = []

    def capture(*args, **kwargs):
        seen.append((args, kwargs))
        raise StopForward

    with quiet_generation(), _thinker_generate(model, capture), contextlib.suppress(StopForward):
        _generate(model, sample, settings, device)
    if not seen:
        raise RuntimeError("generate(return_audio=True) never called the thinker's generate()")
    return seen[0]


@torch.no_grad()
def generate_speech(model, sample, settings: SpeechSettings, decode_audio: bool = True, reply=None, device=None):
    """Greedy generate(return_audio=True) for one sample, recording the speech stacks' inputs. Returns the talker
    sequence, the code predictor's sequences (each [1, L, H]) and code2wav pre-transformer chunks (none when
    decode_audio is False: generate() then stops once the talker is done). UnusableConversation when the thinker
    or the talker replies with nothing (transformers' generate() itself fails on a talker that speaks no frame:
    RuntimeError "stack expects a non-empty TensorList"). `reply`: the thinker's generate() result computed apart
    (result, error) (see capture_speech_pass), used in place of running the thinker."""
    from .skips import UnusableConversation

    talker_model = model.talker.model
    predictor_model = model.talker.code_predictor.model
    pre_transformer = model.code2wav.pre_transformer
    thinker_results: list = []
    talker_results: list = []

    def computed(*_args, **_kwargs):
        result, error = reply
        if error is not None:
            raise error
        return result

    try:
        with quiet_generation(), record_kwargs(talker_model, ("inputs_embeds", "position_ids")) as talker_calls, \
                record_kwargs(predictor_model, ("inputs_embeds",)) as predictor_calls, \
                record_kwargs(pre_transformer, ("inputs_embeds",)) as code2wav_calls, \
                _thinker_generate(model, computed) if reply is not None else contextlib.nullcontext(), \
                keep_results(model.thinker, thinker_results), keep_results(model.talker, talker_results), \
                _stop_at(None if decode_audio else model.code2wav):
            _generate(model, sample, settings, device)
    except (RuntimeError, ValueError, IndexError) as exc:
        empty = _empty_reply(model, sample, thinker_results, talker_results)
        if empty is not None:
            raise UnusableConversation(empty) from exc
        raise
    empty = _empty_reply(model, sample, thinker_results, talker_results)
    if empty is not None:
        raise UnusableConversation(empty)
    if not talker_calls:
        raise RuntimeError("generate(return_audio=True) never ran the talker")
    talker = TalkerSequence(
        torch.cat([c["inputs_embeds"] for c in talker_calls], dim=1),
        torch.cat([c["position_ids"] for c in talker_calls], dim=-1),
        talker_calls[0]["inputs_embeds"].shape[1],
    )
    predictor: list[list[torch.Tensor]] = []
    for c in predictor_calls:
        if c["inputs_embeds"].shape[1] > 1 or not predictor:  # a prefill starts a new code-predictor sequence
            predictor.append([])
        predictor[-1].append(c["inputs_embeds"])
    predictor_seqs = [torch.cat(parts, dim=1) for parts in predictor]
    code2wav = [c["inputs_embeds"] for c in code2wav_calls]
    return talker, predictor_seqs, code2wav


@torch.no_grad()
def talker_codes(model, seq: TalkerSequence, layer0: torch.nn.Module | None = None
                 ) -> tuple[torch.Tensor, list[Call]]:
    """Teacher-forced greedy codec tokens of a talker sequence (suppressed ids masked as generate() does) at the
    positions that predict generated codes; with `layer0`, also the talker's first-layer call."""
    with record_first_calls({"talker": layer0} if layer0 is not None else {}) as calls:
        out = model.talker.model(inputs_embeds=seq.inputs_embeds, position_ids=seq.position_ids, use_cache=False)
    logits = model.talker.codec_head(out.last_hidden_state)[0, seq.prompt_len - 1:].float()
    logits[:, codec_suppressed(model.config)] = float("-inf")
    return logits.argmax(-1).cpu(), calls.get("talker", [])


def decode_switches(module: torch.nn.Module) -> list[tuple[object, str]]:
    """The (config, attribute) pairs of `module`'s models whose experts implementation transformers' generate()
    switches for its decoding steps on a GPU (GenerationMixin._optimize_model_for_decode: grouped_mm to
    batched_mm, then back): per-conversation state when several generate() calls share the model."""
    configs = {id(m.config): m.config for m in module.modules()
               if hasattr(getattr(m, "config", None), "_experts_implementation_internal")}
    return [(config, "_experts_implementation_internal") for config in configs.values()]


@contextlib.contextmanager
def last_position_logits(lm_head: torch.nn.Module) -> Iterator[None]:
    """lm_head applied to the last position only of a multi-position input, while inside: generate() reads a
    prefill's logits there alone, and the whole [positions, vocab] tensor is 0.3 MB per prompt token at the real
    widths. (The last row is the full product's up to the matmul's rounding; on the tiny model, bit for bit.)"""
    def hook(_mod, args):
        if args and args[0].dim() == 3 and args[0].shape[1] > 1:
            return (args[0][:, -1:], *args[1:])
        return None

    handle = lm_head.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def release_thread_workspaces(device: torch.device) -> None:
    """Free the cuBLAS workspaces of finished threads: torch keeps one per handle and stream (32 MiB on Hopper) in
    the caching allocator for the life of the process, and the layer gate ran one thread per conversation."""
    if device.type == "cuda" and hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
        torch._C._cuda_clearCublasWorkspaces()


@dataclass(frozen=True)
class SpeechStreaming:
    """How the speech pass streams the thinker: replies of up to `wave` conversations are generated together (one
    sweep over the decoder layers per token), and its first `keep_layers` layers stay loaded for the whole pass."""

    wave: int = 8
    keep_layers: int = 0


@torch.no_grad()
def speech_commit(model, data: dict, refs: dict, name: str, speech, talker_layer0, reference: bool,
                  heldout: bool):
    """One conversation's speech-side layer inputs, from its generated speech (talker sequence, code predictor
    inputs, code2wav chunks): the first layer's calls of each stack in `data`, and the talker's codes where the
    report needs them. Returns the function that adds them to `data` (and the codes to `refs`)."""
    talker, predictor_seqs, code2wav = speech
    talker_calls, codes = [], None
    if "talker" in data or (reference and heldout):
        codes, talker_calls = talker_codes(model, talker, talker_layer0 if "talker" in data else None)
    predictor_calls = []
    if "code_predictor" in data:
        layer0 = model.get_submodule(f"{A.STACK_OF['code_predictor'].layers}.0")
        by_len: dict[int, list[torch.Tensor]] = {}
        for s in predictor_seqs:
            by_len.setdefault(s.shape[1], []).append(s)
        for group in by_len.values():
            batch = torch.cat(group, dim=0)
            predictor_calls += _first_layer_calls(layer0, lambda b=batch: model.talker.code_predictor.model(
                inputs_embeds=b, use_cache=False))
    code2wav_calls = []
    if "code2wav" in data:
        layer0 = model.get_submodule(f"{A.STACK_OF['code2wav'].layers}.0")
        for chunk in code2wav:
            code2wav_calls += _first_layer_calls(layer0, lambda c=chunk: model.code2wav.pre_transformer(
                inputs_embeds=c, use_cache=False))

    def commit():
        for stack, calls in (("talker", talker_calls), ("code_predictor", predictor_calls),
                             ("code2wav", code2wav_calls)):
            for call in calls:
                data[stack].add(call, heldout)
        if reference and heldout:
            refs[name] = (talker, codes)
    return commit


def capture_speech_pass(model, residency, samples, stacks: set[str], settings: SpeechSettings, reference: bool,
                        runner, new_data, streaming: SpeechStreaming = SpeechStreaming()
                        ) -> tuple[dict[str, StackData], dict[str, tuple[TalkerSequence, torch.Tensor]], PassResult]:
    """First-layer calls of the speech stacks in `stacks` (into `new_data(stack)`) and (reference=True) each
    held-out sample's talker sequence with its BF16 teacher-forced codec tokens, through `runner` (see
    capture_thinker_pass): every held-out sample and up to settings.max_conversations in all.

    Each conversation is generate(return_audio=True) as served, in two parts: the thinker's reply (its generate()
    with the hidden states the talker reads) for a wave of conversations at once, the decoder layers streamed
    through quantize.gate.LayerGate; then, one conversation at a time, the rest of generate() with that reply,
    the talker and code2wav loaded whole (they are small: 6.6 GB in BF16 at the real model's size)."""
    from orin.components import BY_NAME

    from .gate import LayerGate

    data = {s: new_data(s) for s in A.SPEECH_PASS if s in stacks}
    refs: dict[str, tuple[TalkerSequence, torch.Tensor]] = {}
    talker_layer0 = model.get_submodule(f"{A.STACK_OF['talker'].layers}.0")
    layers = A.STACK_OF["thinker_text"].layers
    gate = LayerGate(model.get_submodule(layers), lambda i: residency.load(f"{layers}.{i}"),
                     lambda i: residency.release(f"{layers}.{i}"), keep=streaming.keep_layers,
                     swapped=[(model.thinker.model, "rope_deltas"), *decode_switches(model.thinker)],
                     device=residency.device)
    # generate(return_audio=True) reads only these hidden states of the thinker's; the others are never kept.
    read = sorted({0, model.config.talker_config.accept_hidden_layer})
    replies: dict[str, tuple] = {}

    def prepare(batch) -> None:
        jobs = []
        for sample in batch:
            args, kwargs = thinker_call(model, sample, settings, residency.device)
            jobs.append(lambda a=args, k={**kwargs, "output_hidden_states": read}: model.thinker.generate(*a, **k))
        desc = f"speech pass: {len(batch)} replies, the thinker's layers streamed"
        with quiet_generation(), last_position_logits(model.thinker.lm_head), \
                runner.progress.bar(settings.reply_tokens, desc, unit="token") as bar:
            gate.on_sweep = lambda: bar.update(1)  # a sweep is a token of every reply (the first: the prompt)
            for sample, (result, error) in zip(batch, gate.run(jobs), strict=True):
                if result is not None:
                    result.past_key_values = None  # generate(return_audio=True) reads no cache of the thinker's
                replies[sample.name] = (result, error)
        release_thread_workspaces(residency.device)

    def work(sample, heldout: bool):
        reply = replies.pop(sample.name)
        talker, predictor_seqs, code2wav = generate_speech(model, sample, settings, "code2wav" in data, reply,
                                                           residency.device)
        return speech_commit(model, data, refs, sample.name, (talker, predictor_seqs, code2wav), talker_layer0,
                             reference, heldout)

    heldout = sum(s.heldout for s in samples)
    resident = (*THINKER_SHELL, *THINKER_HEAD, "talker", *(("code2wav",) if "code2wav" in data else ()))
    with residency.loaded(*resident):
        result = runner.run("speech", samples, work, max(1, settings.max_conversations - heldout),
                            {BY_NAME[s].title: "text" for s in data}, prepare=prepare, batch=streaming.wave)
    return data, refs, result
