"""Running the model to collect calibration inputs: no quantization math here.

Two BF16 passes happen before any weight changes:

- the thinker pass: ``model.thinker(**inputs)`` teacher-forced over each whole calibration conversation; hooks
  record the first-layer inputs (hidden states plus the keyword arguments the stack passes every layer:
  rotary embeddings, masks, cu_seqlens) of the thinker text decoder, the vision encoder and the audio encoder,
  and the DeepStack visual features the text decoder adds after its first layers;
- the speech pass: ``model.generate(return_audio=True)`` with greedy thinker and talker, exactly as a request is
  served: hooks record what the talker decoder, the code predictor and code2wav's pre-transformer are fed at
  every step (the talker's prompt is built by generate() from the thinker's embeddings and its
  ``accept_hidden_layer`` hidden states of the prompt and the generated reply). The steps are concatenated
  into whole sequences and run once more, teacher-forced, to record those stacks' first-layer inputs; causal
  attention makes that equal to the step-by-step run.

Then, per layer, :func:`capture_stage` re-runs one layer over the recorded calls with hooks on the modules of
one stage, and :func:`forward_layer` produces the next layer's inputs from the (partly quantized) layer.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from . import adapters as A

if TYPE_CHECKING:
    from .skips import PassResult


class StopForward(Exception):
    """Raised by a hook once everything needed from a forward pass has been recorded."""


@dataclass
class Call:
    """One call of a layer: positional args (hidden states first) and keyword args, plus stack-level extras
    (DeepStack features) that apply between layers."""

    args: tuple
    kwargs: dict
    extra: dict = field(default_factory=dict)

    @property
    def hidden(self) -> torch.Tensor:
        return self.args[0]

    def with_hidden(self, hidden: torch.Tensor) -> Call:
        return Call((hidden,) + tuple(self.args[1:]), self.kwargs, self.extra)


@dataclass
class StackData:
    """First-layer calls of one stack: calibration calls feed the Hessians, held-out calls only the report."""

    calib: list[Call] = field(default_factory=list)
    heldout: list[Call] = field(default_factory=list)

    def add(self, call: Call, heldout: bool) -> None:
        (self.heldout if heldout else self.calib).append(call)

    @property
    def calib_rows(self) -> int:
        return sum(c.hidden.numel() // c.hidden.shape[-1] for c in self.calib)


def _detach(value):
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple):
        return tuple(_detach(v) for v in value)
    if isinstance(value, list):
        return [_detach(v) for v in value]
    return value


@contextlib.contextmanager
def record_first_calls(modules: dict[str, torch.nn.Module], stop: bool = False) -> Iterator[dict[str, list[Call]]]:
    """Record every call of each module (a stack's first layer) as a Call; with stop=True, end the forward
    pass right there (nothing after the first layer is needed)."""
    calls: dict[str, list[Call]] = {name: [] for name in modules}
    handles = []
    for name, module in modules.items():
        def hook(_mod, args, kwargs, _name=name):
            calls[_name].append(Call(_detach(tuple(args)), {k: _detach(v) for k, v in kwargs.items()}))
            if stop:
                raise StopForward
        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield calls
    finally:
        for h in handles:
            h.remove()


def _first_layer_calls(module: torch.nn.Module, run) -> list[Call]:
    """The calls of `module` (a stack's first layer) while run() runs, ending each forward pass right there."""
    with record_first_calls({"x": module}, stop=True) as calls:
        with contextlib.suppress(StopForward):
            run()
    return calls["x"]


@contextlib.contextmanager
def record_kwargs(module: torch.nn.Module, keys: tuple[str, ...]) -> Iterator[list[dict]]:
    """Record the named keyword arguments of every call of `module`."""
    seen: list[dict] = []

    def hook(_mod, _args, kwargs):
        seen.append({k: _detach(kwargs.get(k)) for k in keys})

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


@contextlib.contextmanager
def quiet_generation() -> Iterator[None]:
    """generate() warns about sampling flags and repetition penalties on every call; the calibration run sets
    them on purpose."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


# ---------------------------------------------------------------------- the thinker pass


@dataclass
class ThinkerOutputs:
    logits: torch.Tensor  # [T, vocab] bf16 on CPU
    vision: torch.Tensor | None  # merged vision features [P, D]
    audio: torch.Tensor | None  # audio encoder output [A, D]


@torch.no_grad()
def run_thinker(model, inputs: dict) -> ThinkerOutputs:
    """Teacher-forced thinker forward of one conversation, with the encoders' outputs."""
    seen: dict[str, torch.Tensor] = {}
    thinker = model.thinker

    def keep(name, attr):
        def hook(_mod, _args, output):  # the vision encoder runs once for the images and once for the videos
            now = getattr(output, attr).detach().float().cpu()
            seen[name] = torch.cat([seen[name], now]) if name in seen else now
        return hook

    handles = [thinker.model.visual.register_forward_hook(keep("vision", "pooler_output")),
               thinker.model.audio_tower.register_forward_hook(keep("audio", "last_hidden_state"))]
    try:
        out = thinker(**inputs, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return ThinkerOutputs(out.logits[0].detach().to(torch.bfloat16).cpu(), seen.get("vision"), seen.get("audio"))


_THINKER_FIRST_LAYER = {
    "thinker_text": "thinker.model.language_model.layers.0",
    "vision_encoder": "thinker.model.visual.blocks.0",
    "audio_encoder": "thinker.model.audio_tower.layers.0",
}


_THINKER_NEEDS = {"thinker_text": "text", "vision_encoder": ("image", "video"), "audio_encoder": "audio"}


@torch.no_grad()
def capture_thinker_pass(model, samples, stacks: set[str], reference: bool, runner
                         ) -> tuple[dict[str, StackData], dict[str, ThinkerOutputs], PassResult | None]:
    """First-layer calls of the thinker-side stacks in `stacks`, and (reference=True) the BF16 outputs of the
    held-out samples, by sample name, through `runner` (a skips.PassRunner: conversations the model fails
    on are skipped). Calibration-only conversations stop at the text decoder's first layer: the encoders run
    before it, and nothing after it is needed. No pass (None) when nothing is wanted from it."""
    from orin.components import BY_NAME

    wanted = {s: model.get_submodule(p) for s, p in _THINKER_FIRST_LAYER.items() if s in stacks}
    data = {s: StackData() for s in wanted}
    refs: dict[str, ThinkerOutputs] = {}
    if not wanted and not reference:
        return data, refs, None
    language_model = model.get_submodule(A.STACK_OF["thinker_text"].layers.rsplit(".", 1)[0])
    decoder_start = model.get_submodule(_THINKER_FIRST_LAYER["thinker_text"])

    def work(sample, heldout: bool):
        keep_outputs = reference and heldout
        with record_first_calls(wanted) as calls, \
                record_kwargs(language_model, ("visual_pos_masks", "deepstack_visual_embeds")) as deepstack:
            if keep_outputs:
                outputs = run_thinker(model, sample.inputs)
            else:
                _first_layer_calls(decoder_start, lambda: model.thinker(**sample.inputs, use_cache=False))

        def commit():
            if keep_outputs:
                refs[sample.name] = outputs
            for stack, stack_calls in calls.items():
                for call in stack_calls:
                    if stack == "thinker_text" and deepstack and deepstack[0]["deepstack_visual_embeds"] is not None:
                        call.extra.update(deepstack[0])
                    data[stack].add(call, heldout)
        return commit

    result = runner.run("thinker", samples, work, None if wanted else 0,
                        {BY_NAME[s].title: _THINKER_NEEDS[s] for s in wanted})
    return data, refs, result


# ---------------------------------------------------------------------- the speech pass


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


@torch.no_grad()
def generate_speech(model, sample, settings: SpeechSettings, decode_audio: bool = True):
    """Greedy generate(return_audio=True) for one sample, recording the speech stacks' inputs. Returns the talker
    sequence, the code predictor's sequences (each [1, L, H]) and code2wav pre-transformer chunks (none when
    decode_audio is False: generate() then stops once the talker is done). UnusableConversation when the thinker
    or the talker replies with nothing (transformers' generate() itself fails on a talker that speaks no frame:
    RuntimeError "stack expects a non-empty TensorList")."""
    from .skips import UnusableConversation

    talker_model = model.talker.model
    predictor_model = model.talker.code_predictor.model
    pre_transformer = model.code2wav.pre_transformer
    speakers = sorted(model.config.talker_config.speaker_id)
    speaker = speakers[sample.index % len(speakers)] if speakers else "ethan"
    thinker_results: list = []
    talker_results: list = []
    try:
        with quiet_generation(), record_kwargs(talker_model, ("inputs_embeds", "position_ids")) as talker_calls, \
                record_kwargs(predictor_model, ("inputs_embeds",)) as predictor_calls, \
                record_kwargs(pre_transformer, ("inputs_embeds",)) as code2wav_calls, \
                keep_results(model.thinker, thinker_results), keep_results(model.talker, talker_results), \
                _stop_at(None if decode_audio else model.code2wav):
            model.generate(
                **sample.prompt_inputs, speaker=speaker, return_audio=True,
                thinker_max_new_tokens=settings.reply_tokens, thinker_do_sample=False,
                thinker_eos_token_id=model.config.im_end_token_id,
                talker_max_new_tokens=settings.speech_frames,
                talker_min_new_tokens=settings.min_speech_frames, talker_do_sample=False,
            )
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


@torch.no_grad()
def capture_speech_pass(model, samples, stacks: set[str], settings: SpeechSettings, reference: bool, runner
                        ) -> tuple[dict[str, StackData], dict[str, tuple[TalkerSequence, torch.Tensor]], PassResult]:
    """First-layer calls of the speech stacks in `stacks` and (reference=True) each held-out sample's talker
    sequence with its BF16 teacher-forced codec tokens, through `runner` (see capture_thinker_pass): every
    held-out sample and up to settings.max_conversations in all."""
    from orin.components import BY_NAME

    data = {s: StackData() for s in A.SPEECH_PASS if s in stacks}
    refs: dict[str, tuple[TalkerSequence, torch.Tensor]] = {}
    talker_layer0 = model.get_submodule(f"{A.STACK_OF['talker'].layers}.0")

    def work(sample, heldout: bool):
        talker, predictor_seqs, code2wav = generate_speech(model, sample, settings, "code2wav" in data)
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
                refs[sample.name] = (talker, codes)
        return commit

    heldout = sum(s.heldout for s in samples)
    result = runner.run("speech", samples, work, max(1, settings.max_conversations - heldout),
                        {BY_NAME[s].title: "text" for s in data})
    return data, refs, result


# ---------------------------------------------------------------------- per layer


@dataclass
class StageInputs:
    """What one stage's members were fed over a list of calls: for a Linear a [rows, K] tensor per call, for an
    experts member a (hidden [T, H], top_k_index [T, k]) pair per call. `source` identifies the tensor a member
    was fed in the first call, so members fed the very same tensor (q/k/v, gate/up) can share a Hessian."""

    inputs: dict[str, list]
    source: dict[str, tuple]


@torch.no_grad()
def capture_stage(layer: torch.nn.Module, calls: list[Call], members: list[A.Member]) -> StageInputs:
    """Run `layer` over `calls` with hooks on one stage's members; each forward stops once all were seen."""
    modules = {m.name: layer.get_submodule(m.name) for m in members}
    seen: dict[str, list] = {name: [] for name in modules}
    source: dict[str, tuple] = {}
    pending: set[str] = set()
    handles = []
    for name, module in modules.items():
        is_experts = any(m.name == name and m.kind != "linear" for m in members)

        def hook(mod, args, kwargs, _name=name, _experts=is_experts):
            if _experts:
                hidden, index = A.experts_call_inputs(args, kwargs)
                seen[_name].append((hidden.detach(), index.detach()))
            else:
                x = args[0] if args else kwargs["input"]
                source.setdefault(_name, (x.data_ptr(), tuple(x.shape), x.stride()))
                seen[_name].append(x.detach().reshape(-1, x.shape[-1]))
            pending.discard(_name)
            if not pending:
                raise StopForward
        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        for call in calls:
            pending.update(modules)
            with contextlib.suppress(StopForward):
                layer(*call.args, **call.kwargs)
            if pending:
                raise A.layout_error(f"{', '.join(sorted(pending))} never ran in a forward pass of its layer")
    finally:
        for h in handles:
            h.remove()
    return StageInputs(seen, source)


@torch.no_grad()
def forward_layer(layer: torch.nn.Module, calls: list[Call]) -> list[torch.Tensor]:
    return [A.layer_output(layer(*c.args, **c.kwargs)).detach() for c in calls]
