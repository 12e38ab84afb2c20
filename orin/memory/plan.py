"""`orin-omni plan`: sizes per component and segment, request memory, and the residency verdict.

The same functions size a request for the loader at run time (manifest -> plan -> loader): the loader refuses a
request the planner says cannot fit before anything is loaded, and follows the planner's residency schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import components as C
from ..checkpoint.targets import QuantSpec
from ..contract import Stage
from ..device.profile import CPU, ORIN, DeviceProfile, for_arch, named
from ..errors import BudgetError
from ..units import format_bytes
from .model_sizes import ModelSizes, size_model
from .request_sizes import (
    Allocation,
    Request,
    activation_bytes,
    allocations,
    kv_bytes,
    pinned_host_bytes,
    request_tokens,
    stage_margin,
    working_bytes,
)


@dataclass(frozen=True)
class PlanConfig:
    model: str
    budget: int = 24 << 30
    audio_seconds: float = 30.0
    images: int = 1
    image_size: int = 224
    video_seconds: float = 0.0
    video_fps: float = 2.0
    video_frame_pixels: int = 448 * 448
    video_audio: bool = True
    text_tokens: int = 256
    speech: bool = True
    group_size: int = 128
    segments: str | None = None
    quantize_audio_encoder: bool = False
    quantize_code_predictor: bool = False
    quantize_code2wav: bool = False
    quantize_vision: bool = True
    # The device the plan is for (orin.device.profile): its tuning numbers size the working memory and margin.
    # "auto": this machine's kind, as the engine here would run (machine_profile); "orin" plans for the board.
    device_profile: str = "auto"


@dataclass
class Verdict:
    needed: tuple[str, ...]
    all_resident_bytes: int
    all_resident: bool
    time_sliced: bool
    schedule: list[Stage]
    streaming: bool
    peak_bytes: int
    reason: str
    min_budget: int = 0  # the smallest budget that serves this request (its leanest schedule's peak)
    # the largest single allocation the request makes (request_sizes.allocations), where the caller sized them
    largest: Allocation | None = None
    # refused whatever the budget: `largest` is over the profile's memory.max_allocation_bytes
    over_ceiling: bool = False


def schedules(needed: tuple[str, ...]) -> list[tuple[str, list[tuple[str, tuple[str, ...]]]]]:
    """Residency schedules from most to least resident. Streaming speech needs the thinker and the talker
    side resident together; the sequential fallback speaks after the whole text."""
    enc = tuple(c for c in ("audio_encoder", "vision_encoder") if c in needed)
    speech = tuple(c for c in C.SPEECH_COMPONENTS if c in needed)
    first = [("encode", enc)] if enc else []
    apart = [(f"encode {c.split('_')[0]}", (c,)) for c in enc]
    if not speech:
        return [("time-sliced", first + [("think", ("thinker_text",))]),
                ("time-sliced, one component at a time", apart + [("think", ("thinker_text",))])]
    return [
        ("time-sliced, streaming speech", first + [("think+speak", ("thinker_text",) + speech)]),
        ("time-sliced, speech after text", first + [("think", ("thinker_text",)), ("speak", speech)]),
        ("time-sliced, one component at a time", apart + [("think", ("thinker_text",)),
                                                          ("talk", ("talker", "code_predictor")),
                                                          ("vocode", ("code2wav",))]),
    ]


def decide(resident: dict[str, int], kv: dict[str, int], act: dict[str, int], needed: tuple[str, ...],
           budget: int, margin: int = 0, largest: Allocation | None = None, ceiling: int | None = None) -> Verdict:
    """The verdict for one request: `resident` holds each component's resident bytes; `margin` is added to
    every stage (request_sizes.stage_margin: the profile's runtime margin, and on unified memory the pinned staging
    buffers). `largest`: the request's largest single allocation; over `ceiling` (the profile's
    memory.max_allocation_bytes) the request is refused whatever the budget."""

    def stage_bytes(comps: tuple[str, ...]) -> int:
        return sum(resident[c] for c in comps) + working_bytes(comps, kv, act, margin)

    all_bytes = stage_bytes(needed)
    options = []
    for label, plan in schedules(needed):
        stages = []
        for name, comps in plan:
            stages.append(Stage(name, comps, stage_bytes(comps)))  # an encode stage holds no KV cache
        options.append((label, stages, max(s.bytes for s in stages)))
    least = min(peak for _, _, peak in options)
    if largest is not None and ceiling is not None and largest.bytes > ceiling:
        return Verdict(needed, all_bytes, False, False, [], False, all_bytes,
                       f"cannot run on this device: the {largest.what} is one allocation of "
                       f"{format_bytes(largest.bytes)}, over the {format_bytes(ceiling)} this device allows one "
                       f"(memory.max_allocation_bytes), whatever the budget: {largest.advice}",
                       least, largest, True)
    for label, stages, peak in options:
        if peak <= budget:
            streaming = "streaming" in label or "speak" not in " ".join(s.name for s in stages)
            if all_bytes <= budget:
                return Verdict(needed, all_bytes, True, True, stages, streaming, all_bytes,
                               f"fits all-resident ({format_bytes(all_bytes)} of {format_bytes(budget)})", least,
                               largest)
            return Verdict(needed, all_bytes, False, True, stages, "streaming" in label, peak,
                           f"fits only time-sliced ({label}): peak {format_bytes(peak)} of {format_bytes(budget)}",
                           least, largest)
    big = max(needed, key=lambda c: resident[c] + act.get(c, 0) + kv.get(c, 0))
    worst = resident[big] + act.get(big, 0) + kv.get(big, 0) + margin
    return Verdict(needed, all_bytes, False, False, [], False, worst,
                   f"does not fit: {big} alone needs {format_bytes(worst)} (weights, KV cache and working "
                   f"memory) but the budget is {format_bytes(budget)}; the least it runs in is "
                   f"{format_bytes(least)}", least, largest)


# ---------------------------------------------------------------- the command


def steady_state(sizes: ModelSizes, kv: dict, act: dict, verdict: Verdict, budget: int, margin: int,
                 requests: int = 3) -> list[list]:
    """The loader's moves (orin.memory.residency.Moves per staging) over `requests` consecutive requests like this
    one, from nothing resident: the first request loads what it needs, the last is the steady state. Empty
    where the request does not fit."""
    from .residency import simulate

    if not verdict.time_sliced:
        return []
    stages = stagings(verdict, kv, act, margin, verdict.streaming,
                      speech=any(c in verdict.needed for c in C.SPEECH_COMPONENTS))
    units = {u: b for c in sizes.components.values() for u, b in c.units.items()}
    return simulate(stages.calls(), units, budget, requests)


def stagings(verdict: Verdict, kv: dict, act: dict, margin: int, streaming: bool, speech: bool,
             prefetch: bool = True):
    """The loader's stagings for a request with this verdict (orin.memory.residency.StagePlan), each with the working
    bytes the planner gives it."""
    from .residency import stage_plan

    return stage_plan([s.resident for s in verdict.schedule], verdict.needed,
                      lambda comps: working_bytes(comps, kv, act, margin), streaming, speech,
                      keeps_weights=verdict.all_resident, prefetch=prefetch)


@dataclass
class PlanResult:
    cfg: PlanConfig
    sizes: ModelSizes
    request: Request
    tokens: dict
    kv: dict
    act: dict
    verdict: Verdict
    profile: DeviceProfile
    quantized: bool = True
    stream: list = field(default_factory=list)  # steady_state(): moves per staging of consecutive requests
    allocations: list = field(default_factory=list)  # request_sizes.allocations, largest first

    def to_json(self) -> dict:
        from .residency import stationary

        s = self.sizes
        v = self.verdict
        return {
            "model": self.cfg.model,
            "budget_bytes": self.cfg.budget,
            "total_params": s.total_params,
            "quantization": s.spec.describe(),
            "padded_layers": s.padded_layers,
            "components": {n: c.to_json() for n, c in s.components.items()},
            "segments": {n: s.segment(n) for n in s.segments},
            "totals": {
                "params": s.total_params,
                "bf16_bytes": sum(c.bf16_bytes for c in s.components.values()),
                "int4_bytes": sum(c.int4_bytes for c in s.components.values()),
                "runtime_bytes": sum(c.runtime_int4_bytes for c in s.components.values()),
            },
            "request": {
                "tokens": self.tokens,
                "kv_bytes": sum(self.kv.values()),
                "kv_by_component": self.kv,
                "activation_bytes": max(self.act.values() or [0]),
                "activation_by_component": self.act,
                "runtime_margin_bytes": self.profile.memory.runtime_margin,
                "pinned_host_bytes": pinned_host_bytes(self.profile.memory),
                "pinned_host_in_budget": self.profile.capabilities.unified_memory,
                "needed": list(v.needed),
            },
            "largest_allocation": v.largest.to_json() if v.largest else None,
            "largest_request_allocation": next((a.to_json() for a in self.allocations if a.own), None),
            "max_allocation_bytes": self.profile.memory.max_allocation_bytes,
            "allocations": [a.to_json() for a in self.allocations],
            "fits": {"all_resident": v.all_resident, "time_sliced": v.time_sliced, "streaming": v.streaming},
            "schedule": [st.to_json() for st in v.schedule],
            "stream": [{"bytes_loaded": sum(m.loaded() for m in r), "stagings": [m.to_json() for m in r],
                        "graphs": list(stationary(r))} for r in self.stream],
            "all_resident_bytes": v.all_resident_bytes,
            "min_budget_bytes": v.min_budget,
            "peak_bytes": v.peak_bytes,
            "verdict": v.reason,
            "device_profile": self.profile.as_dict(),
        }


def request_from(cfg: PlanConfig) -> Request:
    return Request(audio_seconds=cfg.audio_seconds, images=cfg.images, image_size=cfg.image_size,
                   video_seconds=cfg.video_seconds, video_fps=cfg.video_fps, video_frame_pixels=cfg.video_frame_pixels,
                   video_audio=cfg.video_audio, text_tokens=cfg.text_tokens, speech=cfg.speech)


def plan_request(sizes: ModelSizes, req: Request, budget: int, profile: DeviceProfile, dtype_bytes: int = 2,
                 resident: dict[str, int] | None = None) -> tuple[dict, dict, dict, Verdict]:
    tokens = request_tokens(req, sizes.dims, profile)
    if resident is None:
        resident = {n: c.runtime_int4_bytes for n, c in sizes.components.items()}
    return (tokens, *plan_tokens(tokens, sizes, resident, req.needed(), budget, profile, dtype_bytes))


def plan_tokens(tokens: dict, sizes: ModelSizes, resident: dict[str, int], needed: tuple[str, ...], budget: int,
                profile: DeviceProfile, dtype_bytes: int) -> tuple[dict, dict, Verdict]:
    """(KV caches, activations, verdict) of a request's `tokens` (request_sizes' dict), the one arithmetic of
    `plan` (from an estimated Request) and the engine (from a prepared prompt): the stages' margin, and the
    largest single allocation against the profile's ceiling."""
    kv = kv_bytes(tokens, sizes.dims, dtype_bytes, profile)
    act = activation_bytes(tokens, sizes.dims, dtype_bytes, profile)
    largest = allocations(tokens, sizes.dims, dtype_bytes, profile, sizes)[0]
    return kv, act, decide(resident, kv, act, needed, budget, stage_margin(profile), largest,
                           profile.memory.max_allocation_bytes)


def machine_profile(tegra: bool | None = None) -> DeviceProfile:
    """This machine's base profile without probing: the GPU's kind where torch sees CUDA, the Orin's on a Jetson
    whose CUDA is unusable (it is still planned as the board it is), else the CPU's. `tegra`: None looks at /."""
    from ..device.capabilities import is_tegra

    tegra = is_tegra() if tegra is None else tegra
    try:
        import torch
    except ImportError:
        return ORIN if tegra else CPU
    if not torch.cuda.is_available():
        return ORIN if tegra else CPU
    return for_arch(cuda=True, capability=torch.cuda.get_device_capability(0), tegra=tegra)


def plan_profile(name: str) -> DeviceProfile:
    """The profile PlanConfig.device_profile names: "auto" is machine_profile()."""
    return machine_profile() if name == "auto" else named(name)


def make_plan(cfg: PlanConfig) -> PlanResult:
    from ..errors import UsageError
    from ..model.config import load_omni_config

    if cfg.group_size not in (32, 64, 128, 256):
        raise UsageError(f"group size {cfg.group_size} is not supported: use 32, 64, 128 or 256 "
                         "(the sizes torch's INT4 kernels take)")
    segments = C.parse_segments(cfg.segments)
    config = load_omni_config(cfg.model)
    spec = QuantSpec(group_size=cfg.group_size, quantize_audio_encoder=cfg.quantize_audio_encoder,
                     quantize_code_predictor=cfg.quantize_code_predictor, quantize_code2wav=cfg.quantize_code2wav,
                     quantize_vision=cfg.quantize_vision)
    profile = plan_profile(cfg.device_profile)
    dtype_bytes = profile.compute_dtype_bytes
    sizes = size_model(config, spec, segments, dtype_bytes=dtype_bytes)
    req = request_from(cfg)
    tokens, kv, act, verdict = plan_request(sizes, req, cfg.budget, profile, dtype_bytes)
    stream = steady_state(sizes, kv, act, verdict, cfg.budget, stage_margin(profile))
    return PlanResult(cfg, sizes, req, tokens, kv, act, verdict, profile, stream=stream,
                      allocations=allocations(tokens, sizes.dims, dtype_bytes, profile, sizes))


def require_fit(verdict: Verdict) -> None:
    if verdict.over_ceiling:  # no budget helps: the reason says what to ask for instead
        raise BudgetError(f"request refused before loading anything: {verdict.reason}")
    if not verdict.time_sliced:
        raise BudgetError(f"request refused before loading anything: {verdict.reason}; raise --budget, "
                          "or ask for less (--no-speech, fewer images, shorter audio, fewer tokens)")


def render_plan(result: PlanResult) -> str:
    j = result.to_json()
    lines = [f"model: {result.cfg.model}   total parameters: {j['total_params']:,}",
             f"planned for device profile {result.profile.name}{_profile_origin(result)}", ""]
    hdr = f"{'component':<22}{'params':>16}{'BF16':>12}{'INT4 file':>12}{'resident':>12}"
    lines += [hdr, "-" * len(hdr)]
    for name, c in result.sizes.components.items():
        title = C.BY_NAME[name].title
        lines.append(f"{title:<22}{c.params:>16,}{format_bytes(c.bf16_bytes):>12}{format_bytes(c.int4_bytes):>12}"
                     f"{format_bytes(c.runtime_int4_bytes):>12}")
    t = j["totals"]
    lines.append(f"{'total':<22}{t['params']:>16,}{format_bytes(t['bf16_bytes']):>12}{format_bytes(t['int4_bytes']):>12}"
                 f"{format_bytes(t['runtime_bytes']):>12}")
    lines += ["", f"{'segment':<22}{'params':>16}{'BF16':>12}{'INT4 file':>12}  components"]
    for name, s in j["segments"].items():
        lines.append(f"{name:<22}{s['params']:>16,}{format_bytes(s['bf16_bytes']):>12}{format_bytes(s['int4_bytes']):>12}"
                     f"  {' + '.join(s['components'])}")
    q = result.sizes.spec
    lines += ["", f"INT4 layout: GPTQ v1, {q.bits}-bit, group {q.group_size}, {'symmetric' if q.sym else 'asymmetric'}; "
                  + "; ".join(f"{k}: {v}" for k, v in q.describe()["quantized"].items()),
              f"stays BF16: {q.describe()['stays_bf16']}"]
    for p in result.sizes.padded_layers:
        lines.append(f"padded: {p['layers']} linear(s) with in_features {p['in_features']} stored as "
                     f"{p['padded_in_features']} (zero columns, exact output)")
    r = j["request"]
    tok = r["tokens"]
    lines += ["", f"request: {tok['prompt']} prompt tokens (audio {tok['audio']}, image {tok['image']}, video "
                  f"{tok['video']}, text {result.request.prompt_text_tokens}) + {tok['generated']} generated"
                  + (f", up to {tok['talker_frames']} speech frames" if tok["talker_frames"] else ", no speech"),
              f"KV cache {format_bytes(r['kv_bytes'])}, working memory {format_bytes(r['activation_bytes'])} "
              f"+ {format_bytes(result.profile.memory.runtime_margin)} runtime margin"
              + (f" + {format_bytes(r['pinned_host_bytes'])} pinned staging" if r["pinned_host_in_budget"] else "")
              + f", needs: {', '.join(r['needed'])}"]
    lines += _render_host_and_allocations(result)
    lines += ["", f"budget {format_bytes(result.cfg.budget)}: {j['verdict']}",
              f"all-resident from {format_bytes(j['all_resident_bytes'])}; the least budget this request runs in: "
              f"{format_bytes(j['min_budget_bytes'])}"]
    for st in result.verdict.schedule:
        lines.append(f"  stage {st.name:<12} {format_bytes(st.bytes):>12}  resident: {', '.join(st.resident)}")
    if result.stream:
        lines += _render_stream(result)
    lines += ["", result.profile.render()]
    return "\n".join(lines)


def _render_host_and_allocations(result: PlanResult) -> list[str]:
    """Where pinned host memory is counted, and the largest single allocation against the device's ceiling."""
    from .request_sizes import LOADING_THREADS

    memory = result.profile.memory
    pinned = (f"pinned host memory: {format_bytes(pinned_host_bytes(memory))} of staging buffers ({LOADING_THREADS} "
              f"loading threads x 2 x {format_bytes(memory.stage_bytes)}), ")
    pinned += ("counted in every stage against the budget (unified memory: the same DRAM as the device's)"
               if result.profile.capabilities.unified_memory else "host memory, outside the device budget")
    lines = [pinned]
    largest = result.verdict.largest
    if largest is not None:
        ceiling = memory.max_allocation_bytes
        limit = f"the ceiling {format_bytes(ceiling)}" if ceiling is not None else "no ceiling on this device"
        lines.append(f"largest single allocation: {format_bytes(largest.bytes)}, the {largest.what} ({limit})")
        own = next((a for a in result.allocations if a.own), None)
        if own is not None and own != largest:
            lines.append(f"  the request's own largest: {format_bytes(own.bytes)}, the {own.what}")
    return lines


def _profile_origin(result: PlanResult) -> str:
    """Why this profile: named, or this machine's (auto), and how to plan for the board instead."""
    if result.cfg.device_profile != "auto":
        return " (--device-profile)"
    if result.profile.name == "orin":
        return " (this machine's)"
    return " (this machine's; --device-profile orin plans for the board)"


def _render_stream(result: PlanResult) -> list[str]:
    first, steady = result.stream[0], result.stream[-1]
    units = {n: len(c.units) for n, c in result.sizes.components.items()}

    def moved(m, kind: str) -> str:
        counts = m.units[kind]
        return ", ".join(f"{c} {format_bytes(b)}" + (f" ({counts[c]} of {units[c]} units)" if counts[c] < units[c]
                                                      else "") for c, b in m.bytes[kind].items())

    total = sum(m.loaded() for m in steady)
    lines = ["", f"a stream of such requests loads {format_bytes(total)} per request in the steady state (the first "
                 f"request {format_bytes(sum(m.loaded() for m in first))}), staging by staging:"]
    names = {"in": "in", "ahead": "in the background", "out": "out"}
    for m in steady:
        what = "+".join(m.call.comps) + (" (next request)" if not m.call.wait else "")
        parts = [f"{names[k]}: {moved(m, k)}" for k in ("out", "in", "ahead") if m.bytes[k]]
        lines.append(f"  {what:<44} {'; '.join(parts) or 'nothing moves'}")
    from .residency import stationary

    still = stationary(steady)
    moving = [c for c in dict.fromkeys(c for m in steady for c in m.call.comps) if c not in still]
    lines.append("whole-input passes (encoders, prefills, code2wav) replayed from CUDA graphs where the weights stay "
                 f"put: {', '.join(still) or 'none'}; eager: {', '.join(moving) or 'none'}")
    return lines
