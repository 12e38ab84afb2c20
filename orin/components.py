"""The swappable components of Qwen3-Omni and how segments group them on disk. Pure data: no torch.

Module names are orin.model.omni's, which are transformers 5.23's (thinker.model.language_model, thinker.model.visual,
...), so quantize (on transformers' modules) and the runtime (on orin-omni's own) name the same tensors alike. A
component is what a stage of a request needs whole; a segment is a group of components quantized and stored
together (one directory each in the quantized checkpoint). The loader swaps units: a decoder's layers one by
one and the rest of it (embeddings, norms, heads) as one, so under a tight budget the thinker gives up a few
layers to the speech side instead of leaving whole and coming back whole for every request.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import UsageError


@dataclass(frozen=True)
class Component:
    name: str
    title: str
    prefixes: tuple[str, ...]  # parameter-name prefixes that belong to it
    excludes: tuple[str, ...] = ()  # sub-prefixes that belong to another component
    layers: str = ""  # the prefix of its decoder layers, each a unit of its own; "": the component is one unit


COMPONENTS: tuple[Component, ...] = (
    Component("thinker_text", "thinker text decoder", ("thinker.model.language_model.", "thinker.lm_head."),
              layers="thinker.model.language_model.layers."),
    Component("audio_encoder", "audio encoder", ("thinker.model.audio_tower.",)),
    Component("vision_encoder", "vision encoder", ("thinker.model.visual.",)),
    Component("talker", "talker", ("talker.",), excludes=("talker.code_predictor.",), layers="talker.model.layers."),
    Component("code_predictor", "code predictor", ("talker.code_predictor.",)),
    Component("code2wav", "code2wav", ("code2wav.",)),
)
BY_NAME = {c.name: c for c in COMPONENTS}
NAMES = tuple(c.name for c in COMPONENTS)

# The seed's split: what the thinker needs to read a prompt, and what speech and images need.
DEFAULT_SEGMENTS: dict[str, tuple[str, ...]] = {
    "thinker": ("audio_encoder", "thinker_text"),
    "talker_vision": ("vision_encoder", "talker", "code_predictor", "code2wav"),
}
DEFAULT_SEGMENTS_SPEC = ";".join(f"{k}={'+'.join(v)}" for k, v in DEFAULT_SEGMENTS.items())

# Pipeline order of a request; the loader and planner walk it in this order.
PIPELINE = ("audio_encoder", "vision_encoder", "thinker_text", "talker", "code_predictor", "code2wav")
SPEECH_COMPONENTS = ("talker", "code_predictor", "code2wav")


def long_prefill_widen(thinker_hidden: int, hidden: int) -> int:
    """How many times the thinker's rows (the profile's long_prefill_tokens a chunk, long_moe_block_rows a MoE
    block) a long prompt's chunks and blocks take in a decoder `hidden` wide: the talker, half the thinker's width
    in its hidden state, queries and experts, takes twice as many rows for the same bytes, and half the chunks and
    blocks and their launches (a long prompt's prefill is partly bound by the host's launches)."""
    return max(1, thinker_hidden // hidden)


def component_of(param_name: str) -> str | None:
    """The component a parameter (or buffer) belongs to, or None for names outside every component."""
    for comp in COMPONENTS:
        if param_name.startswith(comp.prefixes) and not param_name.startswith(comp.excludes or ("\0",)):
            return comp.name
    return None


def unit_of(param_name: str) -> str | None:
    """The unit a parameter (or buffer, or module path with a trailing dot) belongs to: "thinker_text/7" for
    the thinker's layer 7, "thinker_text" for the rest of it, a component's name where it is one unit."""
    comp = component_of(param_name)
    if comp is None:
        return None
    prefix = BY_NAME[comp].layers
    if prefix and param_name.startswith(prefix):
        index, _, _ = param_name[len(prefix):].partition(".")
        if index.isdigit():
            return f"{comp}/{index}"
    return comp


def unit_component(unit: str) -> str:
    return unit.partition("/")[0]


def unit_sort_key(unit: str) -> tuple[int, int]:
    """Pipeline order of components; within one, the rest first, then its layers in order."""
    comp, _, index = unit.partition("/")
    return PIPELINE.index(comp), int(index) + 1 if index else 0


def parse_segments(spec: str | None) -> dict[str, tuple[str, ...]]:
    """Parse 'seg=a+b;seg2=c+d+e+f'. Every component must appear exactly once."""
    if spec is None or not spec.strip():
        return dict(DEFAULT_SEGMENTS)
    segments: dict[str, tuple[str, ...]] = {}
    seen: dict[str, str] = {}
    for part in spec.split(";"):
        part = part.strip()
        if not part:
            continue
        name, sep, members = part.partition("=")
        name = name.strip()
        if not sep or not name or not name.replace("_", "").isalnum():
            raise UsageError(f"invalid segment {part!r}: write NAME=component+component (e.g. {DEFAULT_SEGMENTS_SPEC})")
        if name in segments:
            raise UsageError(f"segment {name!r} is named twice")
        comps = tuple(m.strip() for m in members.split("+") if m.strip())
        if not comps:
            raise UsageError(f"segment {name!r} has no components")
        for comp in comps:
            if comp not in BY_NAME:
                raise UsageError(f"segment {name!r} names unknown component {comp!r}; components are: {', '.join(NAMES)}")
            if comp in seen:
                raise UsageError(f"component {comp!r} is in both segment {seen[comp]!r} and {name!r}")
            seen[comp] = name
        segments[name] = comps
    missing = [c for c in NAMES if c not in seen]
    if missing:
        raise UsageError(f"segment split leaves out component(s) {', '.join(missing)}; every component needs a segment")
    return segments


def select_segments(all_segments: dict[str, tuple[str, ...]], names: tuple[str, ...] | None) -> tuple[str, ...]:
    """Validate a user's --segments list against the split."""
    if not names:
        return tuple(all_segments)
    for name in names:
        if name not in all_segments:
            raise UsageError(f"unknown segment {name!r}; segments are: {', '.join(all_segments)}")
    return tuple(dict.fromkeys(names))
