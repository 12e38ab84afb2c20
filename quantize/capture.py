"""Running the model to collect calibration inputs: no quantization math here.

The model is quantize.weights' skeleton: modules hold weights only while a pass needs them, and the thinker's text
decoder (57 GiB in BF16) streams through one layer at a time. Two BF16 passes happen before any weight changes:

- the thinker pass (here): ``model.thinker(**inputs)`` over each whole calibration conversation with the encoders
  and the embeddings loaded, stopped at the text decoder's first layer; hooks record the first-layer inputs
  (hidden states plus the keyword arguments the stack passes every layer: rotary embeddings, masks, cu_seqlens)
  of the thinker text decoder, the vision encoder and the audio encoder, and the DeepStack visual features the
  text decoder adds after its first layers. The held-out conversations' BF16 logits (the report's reference)
  come from one sweep of their first-layer calls over the decoder layers (:func:`thinker_logits`);
- the speech pass (quantize/speech_capture.py): ``model.generate(return_audio=True)`` as a request is served,
  recording what the talker decoder, the code predictor and code2wav's pre-transformer are fed.

Then, per layer, :func:`capture_stage` re-runs one layer over the recorded calls with hooks on the modules of
one stage (quantize/sequential.py then produces the next layer's inputs from the partly quantized layer).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from . import adapters as A
from .activations import Call, StackData, tree_to

if TYPE_CHECKING:
    from .skips import PassResult


class StopForward(Exception):
    """Raised by a hook once everything needed from a forward pass has been recorded."""


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

# What the thinker runs before its text decoder's first layer (the encoders and the embeddings), and what comes
# after its last layer: both stay loaded for a whole pass, the decoder layers stream through.
THINKER_SHELL = ("thinker.model.audio_tower", "thinker.model.visual", "thinker.model.language_model.embed_tokens")
THINKER_HEAD = ("thinker.model.language_model.norm", "thinker.lm_head")


@dataclass
class ThinkerOutputs:
    logits: torch.Tensor | None  # [T, vocab] bf16 on CPU
    vision: torch.Tensor | None  # merged vision features [P, D]
    audio: torch.Tensor | None  # audio encoder output [A, D]


@contextlib.contextmanager
def encoder_outputs(model) -> Iterator[dict[str, torch.Tensor]]:
    """The merged vision features and the audio encoder output of the forward passes run inside (float32 on CPU;
    the vision encoder runs once for the images and once for the videos: concatenated)."""
    seen: dict[str, torch.Tensor] = {}
    thinker = model.thinker

    def keep(name, attr):
        def hook(_mod, _args, output):
            now = getattr(output, attr).detach().float().cpu()
            seen[name] = torch.cat([seen[name], now]) if name in seen else now
        return hook

    handles = [thinker.model.visual.register_forward_hook(keep("vision", "pooler_output")),
               thinker.model.audio_tower.register_forward_hook(keep("audio", "last_hidden_state"))]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


_THINKER_FIRST_LAYER = {
    "thinker_text": "thinker.model.language_model.layers.0",
    "vision_encoder": "thinker.model.visual.blocks.0",
    "audio_encoder": "thinker.model.audio_tower.layers.0",
}


_THINKER_NEEDS = {"thinker_text": "text", "vision_encoder": ("image", "video"), "audio_encoder": "audio"}


@torch.no_grad()
def thinker_prefix(model, inputs: dict, wanted: dict[str, torch.nn.Module]) -> tuple[dict, Call, dict]:
    """Run the thinker on one conversation up to its text decoder's first layer: the first-layer calls of the
    `wanted` stacks' first layers, the text decoder's first-layer call (with the DeepStack features it adds after
    its first layers in `extra`), and the encoders' outputs."""
    language_model = model.get_submodule(A.STACK_OF["thinker_text"].layers.rsplit(".", 1)[0])
    decoder_start = model.get_submodule(_THINKER_FIRST_LAYER["thinker_text"])
    with record_first_calls(wanted) as calls, encoder_outputs(model) as encoders, \
            record_kwargs(language_model, ("visual_pos_masks", "deepstack_visual_embeds")) as deepstack:
        text = _first_layer_calls(decoder_start, lambda: model.thinker(**inputs, use_cache=False))
    extra = deepstack[0] if deepstack and deepstack[0]["deepstack_visual_embeds"] is not None else {}
    for call in calls.get("thinker_text", []) + text:
        call.extra.update(extra)
    return calls, text[0], encoders


@torch.no_grad()
def sweep(model, residency, stack: A.StackSpec, calls: list[Call], quantized: bool, progress=None,
          desc: str = "") -> list[torch.Tensor]:
    """The last layer's outputs of `stack` for each call, the layers loaded one at a time (BF16, or with this
    run's GPTQ weights where quantized): what the stack's own forward computes, between-layer steps included."""
    layers = model.get_submodule(stack.layers)
    hidden = [c.hidden for c in calls]
    bar = progress.bar(len(layers), desc, unit="layer") if progress is not None and desc else contextlib.nullcontext()
    with bar as b:
        for i, layer in enumerate(layers):
            with residency.loaded(f"{stack.layers}.{i}", quantized=quantized):
                for n, call in enumerate(calls):
                    out = A.layer_output(layer(hidden[n], *call.args[1:], **call.kwargs)).detach()
                    hidden[n] = A.after_layer(model, stack, i, out, call.extra)
            if b is not None:
                b.update(1)
    return hidden


@torch.no_grad()
def thinker_logits(model, residency, calls: list[Call], quantized: bool, progress=None, desc: str = ""
                   ) -> Iterator[torch.Tensor]:
    """The thinker's logits ([T, vocab] bf16 on CPU) for text decoder first-layer calls, one conversation at a
    time (a long one's are gigabytes): the layers streamed, then the final norm and lm_head, as the thinker's
    forward computes them."""
    if not calls:
        return
    hidden = sweep(model, residency, A.STACK_OF["thinker_text"], calls, quantized, progress, desc)
    norm = model.get_submodule(A.STACK_OF["thinker_text"].final_norm)
    with residency.loaded(*THINKER_HEAD, quantized=quantized):
        for n in range(len(hidden)):
            h, hidden[n] = hidden[n], None
            yield model.thinker.lm_head(norm(h))[0].detach().to(torch.bfloat16).cpu()


@torch.no_grad()
def capture_thinker_pass(model, residency, samples, stacks: set[str], reference: bool, runner, new_data,
                         keep_logits=lambda _name, logits: logits
                         ) -> tuple[dict[str, StackData], dict[str, ThinkerOutputs], PassResult | None]:
    """First-layer calls of the thinker-side stacks in `stacks` (into `new_data(stack)`: a StackData where the
    memory plan keeps activations), and (reference=True) the BF16 outputs of the held-out samples, by sample
    name, through `runner` (a skips.PassRunner: conversations the model fails on are skipped). The encoders run
    whole; each conversation stops at the text decoder's first layer, and the held-out ones' logits come from
    one sweep over the decoder layers afterwards, each kept as `keep_logits(name, logits)` returns it (in
    memory, or spilled to disk). No pass (None) when nothing is wanted from it."""
    from orin.components import BY_NAME

    wanted = {s: model.get_submodule(p) for s, p in _THINKER_FIRST_LAYER.items() if s in stacks}
    data = {s: new_data(s) for s in wanted}
    refs: dict[str, ThinkerOutputs] = {}
    if not wanted and not reference:
        return data, refs, None
    held: dict[str, tuple[Call, dict]] = {}

    def work(sample, heldout: bool):
        calls, text, encoders = thinker_prefix(model, tree_to(sample.inputs, residency.device), wanted)

        def commit():
            if reference and heldout:
                held[sample.name] = (text, encoders)
            for stack, stack_calls in calls.items():
                for call in stack_calls:
                    data[stack].add(call, heldout)
        return commit

    with residency.loaded(*THINKER_SHELL):
        result = runner.run("thinker", samples, work, None if wanted else 0,
                            {BY_NAME[s].title: _THINKER_NEEDS[s] for s in wanted})
        logits = thinker_logits(model, residency, [text for text, _ in held.values()], False, runner.progress,
                                "thinker pass: held-out logits")
        for (name, (_text, encoders)), lg in zip(held.items(), logits, strict=True):
            refs[name] = ThinkerOutputs(keep_logits(name, lg), encoders.get("vision"), encoders.get("audio"))
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
def capture_stage(layer: torch.nn.Module, calls, members: list[A.Member], into: torch.device | None = None
                  ) -> StageInputs:
    """Run `layer` over `calls` with hooks on one stage's members; each forward stops once all were seen. The
    inputs are kept on `into` (default: where they were computed) as each call is seen."""
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
                seen[_name].append((_kept(hidden.detach(), into), _kept(index.detach(), into)))
            else:
                x = args[0] if args else kwargs["input"]
                source.setdefault(_name, (x.data_ptr(), tuple(x.shape), x.stride()))
                seen[_name].append(_kept(x.detach().reshape(-1, x.shape[-1]), into))
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


def _kept(x: torch.Tensor, into: torch.device | None) -> torch.Tensor:
    return x if into is None else x.to(into)
