"""Qwen3-Omni's transformers 5.23 module layout, as the GPTQ pass needs it. Every assumption quantize makes about
the model's structure lives here, and tests/test_quantize_adapters.py fails loudly if a pinned library moves.

Why not GPTQModel's own model definition: its ``qwen3_omni_moe`` definition targets the transformers 4.x layout
(per-expert ``nn.Linear`` modules, ``thinker.model.layers``) and fails on 5.23, where a layer's experts are one
module holding 3-D ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] tensors and the thinker text decoder
sits at ``thinker.model.language_model``. Its whole-model pipeline also calibrates on text only and cannot feed
the talker the thinker hidden states it really sees. So quantize uses GPTQModel's GPTQ solver per weight matrix
(quantize/gptq.py) and describes the layout itself here: where each decoder stack's layers are, the order in
which a layer's quantized modules see their inputs (stages), how an expert's weights are sliced out of the
fused tensors, and what happens between two layers (the thinker's DeepStack visual injection).
"""

from __future__ import annotations

from dataclasses import dataclass

from orin.checkpoint.targets import KERNEL_GROUP_SIZES, Target
from orin.errors import OrinError, UsageError

PINNED = {"gptqmodel": "7.6.0", "transformers": "5.23.0"}
EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")

_ATTN_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
_ATTN_O = ("self_attn.o_proj",)


@dataclass(frozen=True)
class StackSpec:
    """One decoder stack: its layers' ModuleList and the stages of one layer in forward order. A stage's members
    see inputs computed from the (already quantized) output of the previous stages. An experts member is
    ``<path>.gate_up`` (gate_proj and up_proj of every expert, same input) or ``<path>.down``."""

    component: str
    label: str  # prefix of the report's layer types, e.g. "thinker" -> "thinker.attn.q_proj"
    layers: str
    stages: tuple[tuple[str, ...], ...]
    deepstack: bool = False  # DeepStack visual features are added to the hidden states after the first layers
    final_norm: str | None = None  # the norm in front of lm_head (only the thinker's lm_head can be a target)


STACKS: tuple[StackSpec, ...] = (
    StackSpec("audio_encoder", "audio", "thinker.model.audio_tower.layers",
              (_ATTN_QKV, ("self_attn.out_proj",), ("fc1",), ("fc2",))),
    StackSpec("vision_encoder", "vision", "thinker.model.visual.blocks",
              (("attn.qkv",), ("attn.proj",), ("mlp.linear_fc1",), ("mlp.linear_fc2",))),
    StackSpec("thinker_text", "thinker", "thinker.model.language_model.layers",
              (_ATTN_QKV, _ATTN_O, ("mlp.experts.gate_up", "mlp.gate_proj", "mlp.up_proj"),
               ("mlp.experts.down", "mlp.down_proj")),
              deepstack=True, final_norm="thinker.model.language_model.norm"),
    StackSpec("talker", "talker", "talker.model.layers",
              (_ATTN_QKV, _ATTN_O,
               ("mlp.experts.gate_up", "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
               ("mlp.experts.down", "mlp.shared_expert.down_proj"))),
    StackSpec("code_predictor", "code_predictor", "talker.code_predictor.model.layers",
              (_ATTN_QKV, _ATTN_O, ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))),
    StackSpec("code2wav", "code2wav", "code2wav.pre_transformer.layers",
              (_ATTN_QKV, _ATTN_O, ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))),
)
STACK_OF = {s.component: s for s in STACKS}
LM_HEAD = "thinker.lm_head"

# Where each stack's first-layer inputs come from when the BF16 model runs: the thinker's own forward pass for
# the encoders and the text decoder; generate(return_audio=True) for the speech side.
THINKER_PASS = ("audio_encoder", "vision_encoder", "thinker_text")
SPEECH_PASS = ("talker", "code_predictor", "code2wav")


class LayoutError(OrinError):
    """The model's module layout is not the one these adapters were written for."""


def layout_error(what: str) -> LayoutError:
    return LayoutError(f"{what}; quantize's adapters were written for transformers {PINNED['transformers']} "
                       f"and gptqmodel {PINNED['gptqmodel']}: install those versions (pip install 'orin-omni[quantize]')")


@dataclass(frozen=True)
class Member:
    """One quantized unit of a stage: a Linear, or one half of a fused experts module."""

    name: str  # relative to the layer: "self_attn.q_proj", "mlp.experts"
    kind: str  # "linear", "experts_gate_up", "experts_down"
    target: Target

    @property
    def path(self) -> str:
        return self.target.path


def layer_type(label: str, member_name: str, proj: str | None = None) -> str:
    """The report's layer type: thinker.attn.q_proj, thinker.experts.gate_proj, vision.mlp.linear_fc2 ..."""
    name = member_name.replace("self_attn.", "attn.")
    if name.endswith("experts"):
        return f"{label}.experts.{proj}"
    if name.startswith("mlp.shared_expert."):
        name = name[len("mlp."):]
    return f"{label}.{name}"


def group_targets(targets: list[Target]) -> tuple[dict[str, dict[int, list[Target]]], list[Target]]:
    """Targets by stack component and layer index, plus the tail targets (lm_head). A target that fits no
    known stack means the layout changed under us: refuse loudly rather than skip it."""
    by_stack: dict[str, dict[int, list[Target]]] = {}
    tail: list[Target] = []
    for t in targets:
        if t.path == LM_HEAD:
            tail.append(t)
            continue
        stack = STACK_OF.get(t.component)
        prefix = stack.layers + "." if stack else None
        if stack is None or not t.path.startswith(prefix):
            raise layout_error(f"quantize target {t.path} is outside every known decoder stack")
        index, _, _rest = t.path[len(prefix):].partition(".")
        if not index.isdigit():
            raise layout_error(f"quantize target {t.path} does not sit in a numbered layer of {stack.layers}")
        by_stack.setdefault(t.component, {}).setdefault(int(index), []).append(t)
    return by_stack, tail


def layer_stages(stack: StackSpec, index: int, targets: list[Target]) -> list[list[Member]]:
    """The stages of layer `index` restricted to its targets, in forward order."""
    prefix = f"{stack.layers}.{index}."
    by_name = {t.path[len(prefix):]: t for t in targets}
    used: set[str] = set()
    stages: list[list[Member]] = []
    for stage in stack.stages:
        members = []
        for entry in stage:
            if entry.endswith((".gate_up", ".down")):
                name, _, part = entry.rpartition(".")
                t = by_name.get(name)
                if t is not None and t.kind == "experts":
                    members.append(Member(name, f"experts_{part}", t))
                    used.add(name)
            else:
                t = by_name.get(entry)
                if t is not None and t.kind == "linear":
                    members.append(Member(entry, "linear", t))
                    used.add(entry)
        if members:
            stages.append(members)
    unknown = sorted(set(by_name) - used)
    if unknown:
        raise layout_error(f"layer {prefix[:-1]} has quantize targets {', '.join(unknown)} that no stage of the "
                           f"{stack.component} adapter covers")
    return stages


def check_group_size(targets: list[Target], group_size: int, bits: int) -> None:
    """Refuse parameters the INT4 kernels cannot run: bits other than 4, group sizes they cannot tile, and a
    group size that does not divide the in_features of every quantized layer (vLLM's GPTQ kernels refuse such a
    layer, and the device would pad it at every load; the vision MLP's 4304-wide linear_fc2, which no group size
    divides, stays BF16 for that reason)."""
    if bits != 4:
        raise UsageError(f"--bits {bits} is not supported: the checkpoint format and the device kernels are 4-bit "
                         "(use --bits 4)")
    if group_size not in KERNEL_GROUP_SIZES:  # the device's INT4 kernels' group sizes
        raise UsageError(f"--group-size {group_size} is not supported: use 32, 64, 128 or 256 (the group sizes "
                         "the device's INT4 kernels take)")
    bad: dict[int, list[str]] = {}
    for t in targets:
        for suffix, k, _n, _b in t.linears()[:3]:  # an experts target's linears repeat per expert
            if k % group_size:
                bad.setdefault(k, []).append(t.path + suffix)
    if bad:
        k, paths = min(bad.items())
        more = f" (and {sum(map(len, bad.values())) - 1} more)" if sum(map(len, bad.values())) > 1 else ""
        fits = [g for g in KERNEL_GROUP_SIZES if all(kk % g == 0 for kk in bad)]
        hint = f"use --group-size {max(fits)}" if fits else "no supported group size divides them"
        raise UsageError(f"--group-size {group_size} does not divide in_features {k} of {paths[0]}{more}; {hint}")


# ---------------------------------------------------------------------- fused experts


def check_experts(module, path: str) -> None:
    """The fused experts layout transformers 5.23 uses: concatenated [gate; up], not transposed, no bias."""
    gu = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    if gu is None or down is None or gu.dim() != 3 or down.dim() != 3:
        raise layout_error(f"{path} is not a fused experts module with 3-D gate_up_proj/down_proj")
    for attr, want in (("is_transposed", False), ("is_concatenated", True), ("has_bias", False), ("has_gate", True)):
        if getattr(module, attr, want) != want:
            raise layout_error(f"{path}.{attr} is {getattr(module, attr)!r}, expected {want!r}")
    e, two_i, h = gu.shape
    if tuple(down.shape) != (e, h, two_i // 2):
        raise layout_error(f"{path}: gate_up_proj {tuple(gu.shape)} and down_proj {tuple(down.shape)} disagree")


def expert_weight(module, e: int, proj: str):
    """The [out, in] weight of one expert's projection, a view into the fused tensor."""
    if proj == "down_proj":
        return module.down_proj[e]
    inter = module.gate_up_proj.shape[1] // 2
    return module.gate_up_proj[e, :inter] if proj == "gate_proj" else module.gate_up_proj[e, inter:]


def set_expert_weight(module, e: int, proj: str, weight) -> None:
    with _no_grad():
        expert_weight(module, e, proj).copy_(weight.to(module.gate_up_proj.dtype))


def experts_call_inputs(args: tuple, kwargs: dict):
    """(hidden_states [T, H], top_k_index [T, k]) of one call of a fused experts module's forward."""
    hidden = args[0] if args else kwargs["hidden_states"]
    index = args[1] if len(args) > 1 else kwargs["top_k_index"]
    return hidden, index


def expert_intermediate(module, x, gate_w, up_w):
    """The input of an expert's down_proj for tokens x, from its (possibly quantized) gate and up weights."""
    import torch.nn.functional as F

    return module.act_fn(F.linear(x, gate_w)) * F.linear(x, up_w)


# ---------------------------------------------------------------------- between layers


def layer_output(out):
    """Decoder layers return a tensor (text, talker) or a 1-tuple (audio encoder)."""
    return out[0] if isinstance(out, tuple) else out


def after_layer(model, stack: StackSpec, index: int, hidden, extra: dict):
    """What the stack's forward does between layer `index` and the next: the thinker adds DeepStack visual
    features to the visual positions after its first len(deepstack_visual_embeds) layers."""
    if not stack.deepstack:
        return hidden
    embeds = extra.get("deepstack_visual_embeds")
    if embeds is None or index >= len(embeds):
        return hidden
    language_model = model.get_submodule(stack.layers.rsplit(".", 1)[0])
    return language_model._deepstack_process(hidden, extra["visual_pos_masks"], embeds[index])


def _no_grad():
    import torch

    return torch.no_grad()
