"""Tensor names on disk (the Hugging Face hub's, which vLLM, transformers and GPTQ tools read) and in memory
(orin.model.omni's tree, whose names are transformers 5.23's). Pure string work: no torch.

The hub names Qwen3-Omni's thinker `thinker.model.layers.*`, `thinker.visual.*` and `thinker.audio_tower.*`;
transformers 5.23 renames them at load to `thinker.model.language_model.*`, `thinker.model.visual.*` and
`thinker.model.audio_tower.*` (its `conversion_mapping.py` for qwen3_omni_moe). The talker and code2wav keep
their names. Routed experts are stored one Linear per expert on the hub (`...mlp.experts.{e}.gate_proj.weight`)
and fused in memory (`...mlp.experts.gate_up_proj` [E, 2I, H] and `...mlp.experts.down_proj` [E, H, I]); GPTQ
checkpoints keep one quantized Linear per expert under the hub name.

Both directions are total and idempotent: a name already in the target form passes through, so checkpoints
written with runtime names (orin-omni 0.1) read the same way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# (runtime prefix, hub prefix); the first match wins, so the more specific thinker prefixes come first.
_PREFIXES = (
    ("thinker.model.language_model.", "thinker.model."),
    ("thinker.model.visual.", "thinker.visual."),
    ("thinker.model.audio_tower.", "thinker.audio_tower."),
)
_RUNTIME_THINKER_CHILDREN = ("language_model.", "visual.", "audio_tower.")
_EXPERT_WEIGHT = re.compile(r"^(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")


def to_hub(name: str) -> str:
    """Runtime (transformers 5.23) tensor or module name -> the hub's."""
    for runtime, hub in _PREFIXES:
        if name.startswith(runtime):
            return hub + name[len(runtime):]
    return name


def to_runtime(name: str) -> str:
    """Hub tensor or module name -> the runtime's (transformers 5.23)."""
    if name.startswith("thinker.visual."):
        return "thinker.model.visual." + name[len("thinker.visual."):]
    if name.startswith("thinker.audio_tower."):
        return "thinker.model.audio_tower." + name[len("thinker.audio_tower."):]
    if name.startswith("thinker.model.") and not name[len("thinker.model."):].startswith(_RUNTIME_THINKER_CHILDREN):
        return "thinker.model.language_model." + name[len("thinker.model."):]
    return name


@dataclass(frozen=True)
class ExpertPart:
    """One BF16 expert Linear on disk, as a slice of the runtime's fused expert tensor."""

    fused: str  # runtime name of the fused tensor, e.g. ...mlp.experts.gate_up_proj
    expert: int
    half: int  # gate_up_proj: 0 = gate rows, 1 = up rows; down_proj: always 0


def expert_part(runtime_name: str) -> ExpertPart | None:
    """Where a per-expert BF16 weight (runtime prefix already applied) goes in the fused tensors, or None."""
    m = _EXPERT_WEIGHT.match(runtime_name)
    if m is None:
        return None
    proj = m.group("proj")
    fused = f"{m.group('experts')}.{'down_proj' if proj == 'down' else 'gate_up_proj'}"
    return ExpertPart(fused, int(m.group("e")), 1 if proj == "up" else 0)


def unfused_names(fused_runtime_name: str, num_experts: int) -> list[str]:
    """Hub names of the per-expert weights one fused runtime tensor is stored as, in stacking order (for
    gate_up_proj: gate then up of expert 0, then expert 1, ...)."""
    experts, _, tensor = fused_runtime_name.rpartition(".")
    hub = to_hub(experts)
    if tensor == "gate_up_proj":
        return [f"{hub}.{e}.{p}_proj.weight" for e in range(num_experts) for p in ("gate", "up")]
    if tensor == "down_proj":
        return [f"{hub}.{e}.down_proj.weight" for e in range(num_experts)]
    raise ValueError(f"{fused_runtime_name} is not a fused experts tensor")


def is_fused_experts(runtime_name: str) -> bool:
    return runtime_name.endswith((".experts.gate_up_proj", ".experts.down_proj"))
