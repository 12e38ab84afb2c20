"""`orin-omni plan`: sizes per component and segment, request memory, and the residency verdict.

The same functions size a request for the loader at run time (manifest -> plan -> loader): the loader refuses a
request the planner says cannot fit before anything is loaded, and follows the planner's residency schedule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from . import components as C
from .audio_format import conv_batch
from .errors import BudgetError
from .layout import (
    QuantSpec,
    find_targets,
    padded,
    target_file_bytes,
    target_param_count,
    target_runtime_bytes,
)
from .units import format_bytes

PROMPT_TEXT_TOKENS = 28  # chat template plus a short question around the media placeholders


def frame_cap(text_tokens: int, max_frames: int | None = None) -> int:
    """Most codec frames the talker may produce for `text_tokens` of text (it normally stops at its own EOS
    first): 8 a token is 0.64 s of speech per token, far above real speech, plus slack for short answers.
    The engine stops the talker here, and the planner sizes the talker's KV cache from it."""
    return max_frames or text_tokens * 8 + 32
AUDIO_FRAMES_PER_SECOND = 100  # Whisper features: 10 ms hop at 16 kHz
# Device memory a request needs beyond weights, KV cache and the largest live activations: the decoders'
# CUDA-graph pools and static-cache bookkeeping, the prefill hidden states kept for the talker, cuBLAS
# workspaces and allocator slack. Measured ~0.5 GiB above the estimate at real dimensions on an H200
# (BENCHMARKS.md); the margin keeps the budget a hard cap. The CPU engine counts tensors exactly and uses 0.
RUNTIME_MARGIN = 768 << 20
# Most bytes of INT4 expert weights the prefill holds dequantized at once where it cannot run the Triton grouped
# GEMM (orin.int4: dequantized chunks of experts and torch._grouped_mm); reserved either way.
PREFILL_DEQUANT_CHUNK = 64 << 20
# The same for a long prompt's MoE (orin.int4_experts.Int4Experts.add_long, whose row blocks are as large:
# orin.components.LONG_MOE_BLOCK_ROWS): each piece of experts costs launches the host makes after the layer's one
# sync, with the GPU idle until they come. Twice the bytes, half the pieces: with the larger blocks, a 25k-token
# video's thinker prefill went from 1.33 to 1.25 s (BENCHMARKS.md, run 59). The extra bytes sit in the MLP's half
# of a layer, under the attention's peak.
LONG_DEQUANT_CHUNK = 128 << 20
# A long prompt's MoE whose experts all dequantized fit in this many bytes takes them at once: its row blocks then
# need no per-expert row counts on the host, so its layers have no host sync and the host queues the whole prefill
# ahead of the GPU. The talker's 128 experts are 288 MiB at real dimensions, the thinker's 1,152 MiB (pieces, a
# sync a layer). The talker's extra 160 MiB sit in its MoE half, under the thinker's attention peak.
LONG_WHOLE_EXPERTS_BYTES = 320 << 20


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


@dataclass(frozen=True)
class Request:
    audio_seconds: float = 0.0
    images: int = 0
    image_size: int = 224
    video_seconds: float = 0.0
    video_fps: float = 2.0  # orin.video's sampling: frames per second, within its frame bounds
    video_frame_pixels: int = 448 * 448  # a sampled frame's area cap (square frames assumed)
    video_audio: bool = True  # the clip's soundtrack interleaved with its frames
    text_tokens: int = 256
    speech: bool = True
    prompt_text_tokens: int = PROMPT_TEXT_TOKENS

    def needed(self) -> tuple[str, ...]:
        """Components this request needs, in pipeline order: text-only loads no encoder, no speech no talker."""
        need = {"thinker_text"}
        if self.audio_seconds > 0:
            need.add("audio_encoder")
        if self.images > 0 or self.video_seconds > 0:
            need.add("vision_encoder")
        if self.speech:
            need.update(C.SPEECH_COMPONENTS)
        return tuple(c for c in C.PIPELINE if c in need)


@dataclass
class ComponentSize:
    name: str
    params: int
    bf16_bytes: int
    int4_bytes: int  # on disk, in the layout quantize writes
    quantized_params: int
    runtime_int4_bytes: int  # resident after conversion to torch's int4pack layout (bf16 elsewhere)
    targets: int
    units: dict[str, int] = field(default_factory=dict)  # runtime bytes per unit (orin.components.unit_of)

    def to_json(self) -> dict:
        return {
            "params": self.params, "bf16_bytes": self.bf16_bytes, "int4_bytes": self.int4_bytes,
            "quantized_params": self.quantized_params, "runtime_bytes": self.runtime_int4_bytes,
            "int4_targets": self.targets,
        }


@dataclass
class ModelSizes:
    components: dict[str, ComponentSize]
    segments: dict[str, tuple[str, ...]]
    spec: QuantSpec
    dims: dict
    padded_layers: list[dict] = field(default_factory=list)

    @property
    def total_params(self) -> int:
        return sum(c.params for c in self.components.values())

    def segment(self, name: str) -> dict:
        comps = [self.components[c] for c in self.segments[name]]
        return {
            "components": list(self.segments[name]),
            "params": sum(c.params for c in comps),
            "bf16_bytes": sum(c.bf16_bytes for c in comps),
            "int4_bytes": sum(c.int4_bytes for c in comps),
        }


def model_dims(config) -> dict:
    th = config.thinker_config
    tt, au, vi = th.text_config, th.audio_config, th.vision_config
    tk = config.talker_config
    ktt, cp, c2w = tk.text_config, tk.code_predictor_config, config.code2wav_config
    return {
        "thinker": {"layers": tt.num_hidden_layers, "hidden": tt.hidden_size, "heads": tt.num_attention_heads,
                    "kv_heads": tt.num_key_value_heads, "head_dim": tt.head_dim, "experts": tt.num_experts,
                    "top_k": tt.num_experts_per_tok, "moe_intermediate": tt.moe_intermediate_size,
                    "vocab": tt.vocab_size, "deepstack": len(vi.deepstack_visual_indexes)},
        "audio": {"d_model": au.d_model, "ffn": au.encoder_ffn_dim, "layers": au.encoder_layers,
                  "n_window": au.n_window, "mel_bins": au.num_mel_bins, "conv_channels": au.downsample_hidden_size,
                  "conv_chunksize": au.conv_chunksize},
        "vision": {"hidden": vi.hidden_size, "intermediate": vi.intermediate_size, "heads": vi.num_heads,
                   "patch": vi.patch_size, "merge": vi.spatial_merge_size, "depth": vi.depth},
        "talker": {"layers": ktt.num_hidden_layers, "hidden": ktt.hidden_size, "heads": ktt.num_attention_heads,
                   "kv_heads": ktt.num_key_value_heads, "head_dim": ktt.head_dim, "experts": ktt.num_experts,
                   "top_k": ktt.num_experts_per_tok, "moe_intermediate": ktt.moe_intermediate_size,
                   "shared_intermediate": ktt.shared_expert_intermediate_size, "vocab": ktt.vocab_size},
        "code_predictor": {"layers": cp.num_hidden_layers, "hidden": cp.hidden_size, "kv_heads": cp.num_key_value_heads,
                           "head_dim": cp.head_dim, "groups": tk.num_code_groups},
        "code2wav": {"hidden": c2w.hidden_size, "decoder_dim": c2w.decoder_dim,
                     "upsample_rates": list(c2w.upsample_rates), "upsampling_ratios": list(c2w.upsampling_ratios)},
    }


def meta_model(config):
    """The model tree (orin.model, from an orin.model_config.OmniConfig) on the meta device: shapes without a
    byte of weights."""
    import torch

    from .model import OmniModel

    with torch.device("meta"):
        return OmniModel(config)


def size_model(config, spec: QuantSpec, segments: dict[str, tuple[str, ...]], dtype_bytes: int = 2) -> ModelSizes:
    model = meta_model(config)
    params = {c: 0 for c in C.NAMES}
    unit_params: dict[str, int] = {}
    for name, p in model.named_parameters():
        unit = C.unit_of(name)
        if unit is not None:
            params[C.unit_component(unit)] += p.numel()
            unit_params[unit] = unit_params.get(unit, 0) + p.numel()
    targets = find_targets(model, spec)
    g = spec.group_size
    q_params = {c: 0 for c in C.NAMES}
    q_file = {c: 0 for c in C.NAMES}
    q_run = {c: 0 for c in C.NAMES}
    n_targets = {c: 0 for c in C.NAMES}
    unit_q: dict[str, tuple[int, int]] = {}  # unit -> (quantized params, their runtime bytes)
    padded_layers: dict[tuple[int, int], int] = {}
    for t in targets:
        n, run = target_param_count(t), target_runtime_bytes(t, g, scale_bytes=dtype_bytes)  # scales: compute dtype
        q_params[t.component] += n
        q_file[t.component] += target_file_bytes(t, g)
        q_run[t.component] += run
        n_targets[t.component] += 1
        unit = C.unit_of(t.path + ".")
        old = unit_q.get(unit, (0, 0))
        unit_q[unit] = (old[0] + n, old[1] + run)
        for _, k, _n, _b in t.linears():
            if k % g:
                padded_layers[(k, padded(k, g))] = padded_layers.get((k, padded(k, g)), 0) + 1
    units = {u: (n - unit_q.get(u, (0, 0))[0]) * dtype_bytes + unit_q.get(u, (0, 0))[1] for u, n in unit_params.items()}
    comps = {}
    for c in C.NAMES:
        rest = params[c] - q_params[c]
        comps[c] = ComponentSize(
            name=c, params=params[c], bf16_bytes=params[c] * 2, int4_bytes=rest * 2 + q_file[c],
            quantized_params=q_params[c], runtime_int4_bytes=rest * dtype_bytes + q_run[c], targets=n_targets[c],
            units={u: b for u, b in sorted(units.items(), key=lambda kv: C.unit_sort_key(kv[0]))
                   if C.unit_component(u) == c},
        )
    pads = [{"in_features": k, "padded_in_features": kp, "layers": n} for (k, kp), n in sorted(padded_layers.items())]
    return ModelSizes(comps, segments, spec, model_dims(config), pads)


# ---------------------------------------------------------------- request sizing


def audio_tokens(seconds: float, n_window: int) -> int:
    frames = int(round(seconds * AUDIO_FRAMES_PER_SECOND))
    if frames <= 0:
        return 0
    chunk = n_window * 2
    leave = frames % chunk
    feat = (leave - 1) // 2 + 1
    return ((feat - 1) // 2 + 1 - 1) // 2 + 1 + (frames // chunk) * 13


def image_grid(size: int, patch: int, merge: int) -> int:
    """Patches of one square image after the processor rounds its side to a multiple of patch*merge."""
    unit = patch * merge
    side = max(unit, int(round(size / unit)) * unit)
    return (side // patch) ** 2


def video_passes(grids) -> list[tuple[int, int, int]]:
    """The vision-encoder passes over the videos of (t, h, w) `grids`: (video, first temporal grid, last + 1),
    at most C.VIDEO_ENCODE_PATCHES patches each (one grid at least)."""
    out = []
    for v, (t, h, w) in enumerate(grids):
        step = max(1, C.VIDEO_ENCODE_PATCHES // (h * w))
        out += [(v, first, min(t, first + step)) for first in range(0, t, step)]
    return out


def video_chunks(grids) -> list[tuple[int, int, int]]:
    """The (t, h, w) grid of each of video_passes(grids)."""
    grids = list(grids)
    return [(last - first, grids[v][1], grids[v][2]) for v, first, last in video_passes(grids)]


def vision_sizes(image_grids, video_grids) -> dict:
    """What sizes the vision encoder's working memory: the most patches one pass takes (the images go through
    together, a video in chunks) and the largest frame's patches (attention stays within a frame)."""
    images = sum(t * h * w for t, h, w in image_grids)
    return {"vision_patches": max([images] + [t * h * w for t, h, w in video_chunks(video_grids)]),
            "vision_frame_patches": max((h * w for _, h, w in tuple(image_grids) + tuple(video_grids)), default=0)}


def video_grid(req: Request, dims: dict) -> tuple[int, int, int] | None:
    """The (t, h, w) patch grid orin.video and the processor make of `req.video_seconds` of square video."""
    from .video import FRAME_FACTOR, TEMPORAL_PATCH, VideoOptions, sampled_frames

    if req.video_seconds <= 0:
        return None
    frames = sampled_frames(req.video_seconds, VideoOptions(fps=req.video_fps))
    side = max(FRAME_FACTOR, int(math.isqrt(req.video_frame_pixels)) // FRAME_FACTOR * FRAME_FACTOR)
    return frames // TEMPORAL_PATCH, side // dims["vision"]["patch"], side // dims["vision"]["patch"]


def request_tokens(req: Request, dims: dict) -> dict:
    v = dims["vision"]
    m2 = v["merge"] ** 2
    side = image_grid(req.image_size, v["patch"], v["merge"])
    images = [(1, math.isqrt(side), math.isqrt(side))] * req.images
    videos = [g for g in (video_grid(req, dims),) if g is not None]
    img = req.images * side // m2
    vid = sum(t * h * w // m2 for t, h, w in videos)
    n_window = dims["audio"]["n_window"]
    aud = audio_tokens(req.audio_seconds, n_window)
    if videos and req.video_audio:
        aud += audio_tokens(req.video_seconds, n_window)
    # a video with its audio is framed by <|audio_start|> and <|audio_end|> inside its vision markers
    prompt = aud + img + vid + req.prompt_text_tokens + (2 if videos and req.video_audio else 0)
    frames_out = frame_cap(req.text_tokens) if req.speech else 0
    return {"audio": aud, "image": img, "video": vid, "prompt": prompt, "generated": req.text_tokens,
            "total": prompt + req.text_tokens, "talker_frames": frames_out, **vision_sizes(images, videos)}


def kv_bytes(tokens: dict, dims: dict, dtype_bytes: int) -> dict:
    t, k = dims["thinker"], dims["talker"]
    thinker = t["layers"] * 2 * t["kv_heads"] * t["head_dim"] * dtype_bytes * C.cache_positions(tokens["total"])
    talker_len = C.cache_positions(tokens["prompt"] + 9 + tokens["talker_frames"]) if tokens["talker_frames"] else 0
    talker = k["layers"] * 2 * k["kv_heads"] * k["head_dim"] * dtype_bytes * talker_len
    cp = dims["code_predictor"]
    predictor = cp["layers"] * 2 * cp["kv_heads"] * cp["head_dim"] * dtype_bytes * (cp["groups"] + 1)
    return {"thinker_text": thinker, "talker": talker, "code_predictor": predictor if talker_len else 0}


def _every_expert_bytes(d: dict, b: int) -> int:
    """A MoE's experts dequantized, every one of them (gate, up and down)."""
    return 3 * d["moe_intermediate"] * d["hidden"] * b * d["experts"]


def _whole_experts(d: dict, b: int) -> bool:
    """Whether a long prompt's MoE dequantizes every expert at once (orin.int4_experts.Int4Experts.add_long)."""
    return _every_expert_bytes(d, b) <= LONG_WHOLE_EXPERTS_BYTES


def _dequant_bytes(d: dict, b: int, long: bool = False) -> int:
    """The prefill's dequantized experts: whole experts, at most PREFILL_DEQUANT_CHUNK bytes (for a `long`
    prompt LONG_DEQUANT_CHUNK, or all of them where they fit in LONG_WHOLE_EXPERTS_BYTES) at once."""
    if long and _whole_experts(d, b):
        return _every_expert_bytes(d, b)
    one = 2 * d["moe_intermediate"] * d["hidden"] * b  # the larger projection: fused gate/up
    return one * max(1, min(d["experts"], (LONG_DEQUANT_CHUNK if long else PREFILL_DEQUANT_CHUNK) // one))


def _prefill_bytes(T: int, d: dict, b: int, widen: int = 1) -> int:
    """A decoder's (thinker's or talker's) prefill working memory for T tokens, as orin.decode runs it: up to
    C.LONG_PREFILL_TOKENS in one pass (its attention's scores, where SDPA's math path materialises them); a longer
    prompt one layer at a time, its attention in chunks over the cache (one KV group's keys expanded at a time
    where flash does not run) or, on Hopper, whole on cuDNN (every head's queries and output for every row,
    padded: orin.decoder_layer.attention_block_long; the larger of the two is counted), its MoE over every row
    in blocks of C.LONG_MOE_BLOCK_ROWS (half that where every expert is dequantized at once; a block's gathered
    rows beside gate/up, its largest pair of intermediates), the router's scores and two hidden states
    whole-prompt (the layer's input, overwritten by its output, and the MLP's normed input), and the attention's
    projections dequantized. A long prompt's chunks and blocks are `widen` times the thinker's rows
    (orin.components.long_prefill_widen)."""
    long = T > C.LONG_PREFILL_TOKENS
    Tc = min(T, C.LONG_PREFILL_TOKENS * widen) if long else T
    rep = d["heads"] // d["kv_heads"]
    whole = 2 * d["heads"] * -(-T // C.WHOLE_PROMPT_BUCKET) * C.WHOLE_PROMPT_BUCKET * d["head_dim"]
    attn = (max(2 * rep * T * d["head_dim"], whole) if long else d["heads"] * Tc * Tc) * b
    proj = Tc * (4 * d["hidden"] + (d["heads"] + 2 * d["kv_heads"]) * d["head_dim"]) * b + 2 * T * d["hidden"] * b
    shared = Tc * 3 * d.get("shared_intermediate", 0) * b
    if not long:
        moe = Tc * d["top_k"] * (3 * d["moe_intermediate"] + 2 * d["hidden"]) * b
    else:
        rows = C.LONG_MOE_BLOCK_ROWS * widen // (2 if _whole_experts(d, b) else 1)
        moe = rows * (d["hidden"] + 2 * d["moe_intermediate"]) * b
        proj += T * d["experts"] * 4
        # the attention's projections dequantized once a layer (q, k, v, o)
        proj += 2 * (d["heads"] + d["kv_heads"]) * d["head_dim"] * d["hidden"] * b
    return attn + proj + moe + shared


def activation_bytes(tokens: dict, dims: dict, dtype_bytes: int) -> dict:
    """Transient working memory per stage (bytes), upper estimates of the largest live intermediates."""
    b = dtype_bytes
    t, a, v, k = dims["thinker"], dims["audio"], dims["vision"], dims["talker"]
    T = tokens["prompt"]
    out = {}
    if tokens["audio"]:
        frames = tokens["audio"]  # tokens is enough to size the transformer part
        chunks = max(1, math.ceil(tokens["audio"] / 13))
        conv = conv_batch(min(chunks, a["conv_chunksize"]), a["conv_chunksize"]) * a["conv_channels"] * (a["mel_bins"] // 2) * 50 * b * 2
        body = frames * a["d_model"] * (6 + a["ffn"] // a["d_model"]) * b
        out["audio_encoder"] = conv + body
    if tokens["vision_patches"]:
        # attention within each frame: a pass's frames' scores, even where SDPA's math path materialises them
        P, frame = tokens["vision_patches"], tokens["vision_frame_patches"]
        # plus the features of every pass so far (the video's whole output, deepstack levels too, by the last)
        done = (tokens["image"] + tokens["video"]) * t["hidden"] * b * (1 + t.get("deepstack", 3))
        out["vision_encoder"] = P * (6 * v["hidden"] + v["intermediate"]) * b + v["heads"] * P * frame * b + done
    visual = (tokens["image"] + tokens["video"]) * t["hidden"] * b * t.get("deepstack", 3)
    long = T > C.LONG_PREFILL_TOKENS
    out["thinker_text"] = _prefill_bytes(T, t, b) + visual + t["vocab"] * 4 * 2 + _dequant_bytes(t, b, long)
    if tokens["talker_frames"]:
        widen = C.long_prefill_widen(t["hidden"], k["hidden"])
        out["talker"] = (_prefill_bytes(T + 9, k, b, widen) + k["vocab"] * 4
                         + _dequant_bytes(k, b, T + 9 > C.LONG_PREFILL_TOKENS))
        c = dims["code2wav"]
        length = (C.CODE2WAV_CHUNK + C.CODE2WAV_LEFT_CONTEXT) * math.prod(c["upsampling_ratios"])
        peak = length * c["hidden"] * 4 * b
        ch = c["decoder_dim"]
        for rate in c["upsample_rates"]:
            length *= rate
            ch //= 2
            peak = max(peak, length * ch * 3 * b)
        out["code2wav"] = peak
        out["code_predictor"] = 0
    return out


def working_bytes(comps: tuple[str, ...], kv: dict, act: dict, margin: int) -> int:
    """What a stage holding `comps` needs beside their weights: their KV caches, the largest of their
    activations, and the runtime margin."""
    return max([act.get(c, 0) for c in comps] or [0]) + sum(kv.get(c, 0) for c in comps) + margin


# ---------------------------------------------------------------- residency


@dataclass
class Stage:
    name: str
    resident: tuple[str, ...]
    bytes: int

    def to_json(self) -> dict:
        return {"name": self.name, "resident": list(self.resident), "bytes": self.bytes}


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
           budget: int, margin: int = 0) -> Verdict:
    """The verdict for one request: `resident` holds each component's resident bytes; `margin` is added to
    every stage (see RUNTIME_MARGIN)."""

    def stage_bytes(comps: tuple[str, ...]) -> int:
        return sum(resident[c] for c in comps) + working_bytes(comps, kv, act, margin)

    all_bytes = stage_bytes(needed)
    largest = max(needed, key=lambda c: resident[c] + act.get(c, 0) + kv.get(c, 0))
    options = []
    for label, plan in schedules(needed):
        stages = []
        for name, comps in plan:
            stages.append(Stage(name, comps, stage_bytes(comps)))  # an encode stage holds no KV cache
        options.append((label, stages, max(s.bytes for s in stages)))
    least = min(peak for _, _, peak in options)
    for label, stages, peak in options:
        if peak <= budget:
            streaming = "streaming" in label or "speak" not in " ".join(s.name for s in stages)
            if all_bytes <= budget:
                return Verdict(needed, all_bytes, True, True, stages, streaming, all_bytes,
                               f"fits all-resident ({format_bytes(all_bytes)} of {format_bytes(budget)})", least)
            return Verdict(needed, all_bytes, False, True, stages, "streaming" in label, peak,
                           f"fits only time-sliced ({label}): peak {format_bytes(peak)} of {format_bytes(budget)}",
                           least)
    worst = resident[largest] + act.get(largest, 0) + kv.get(largest, 0) + margin
    return Verdict(needed, all_bytes, False, False, [], False, worst,
                   f"does not fit: {largest} alone needs {format_bytes(worst)} (weights, KV cache and working "
                   f"memory) but the budget is {format_bytes(budget)}; the least it runs in is "
                   f"{format_bytes(least)}", least)


# ---------------------------------------------------------------- the command


def steady_state(sizes: ModelSizes, kv: dict, act: dict, verdict: Verdict, budget: int,
                 margin: int = RUNTIME_MARGIN, requests: int = 3) -> list[list]:
    """The loader's moves (orin.residency.Moves per staging) over `requests` consecutive requests like this
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
    """The loader's stagings for a request with this verdict (orin.residency.StagePlan), each with the working
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
    quantized: bool = True
    stream: list = field(default_factory=list)  # steady_state(): moves per staging of consecutive requests

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
                "runtime_margin_bytes": RUNTIME_MARGIN,
                "needed": list(v.needed),
            },
            "fits": {"all_resident": v.all_resident, "time_sliced": v.time_sliced, "streaming": v.streaming},
            "schedule": [st.to_json() for st in v.schedule],
            "stream": [{"bytes_loaded": sum(m.loaded() for m in r), "stagings": [m.to_json() for m in r],
                        "graphs": list(stationary(r))} for r in self.stream],
            "all_resident_bytes": v.all_resident_bytes,
            "min_budget_bytes": v.min_budget,
            "peak_bytes": v.peak_bytes,
            "verdict": v.reason,
        }


def request_from(cfg: PlanConfig) -> Request:
    return Request(audio_seconds=cfg.audio_seconds, images=cfg.images, image_size=cfg.image_size,
                   video_seconds=cfg.video_seconds, video_fps=cfg.video_fps, video_frame_pixels=cfg.video_frame_pixels,
                   video_audio=cfg.video_audio, text_tokens=cfg.text_tokens, speech=cfg.speech)


def plan_request(sizes: ModelSizes, req: Request, budget: int, dtype_bytes: int = 2,
                 resident: dict[str, int] | None = None,
                 margin: int = RUNTIME_MARGIN) -> tuple[dict, dict, dict, Verdict]:
    tokens = request_tokens(req, sizes.dims)
    kv = kv_bytes(tokens, sizes.dims, dtype_bytes)
    act = activation_bytes(tokens, sizes.dims, dtype_bytes)
    if resident is None:
        resident = {n: c.runtime_int4_bytes for n, c in sizes.components.items()}
    return tokens, kv, act, decide(resident, kv, act, req.needed(), budget, margin)


def make_plan(cfg: PlanConfig) -> PlanResult:
    from .errors import UsageError
    from .model_config import load_omni_config

    if cfg.group_size not in (32, 64, 128, 256):
        raise UsageError(f"group size {cfg.group_size} is not supported: use 32, 64, 128 or 256 "
                         "(the sizes torch's INT4 kernels take)")
    segments = C.parse_segments(cfg.segments)
    config = load_omni_config(cfg.model)
    spec = QuantSpec(group_size=cfg.group_size, quantize_audio_encoder=cfg.quantize_audio_encoder,
                     quantize_code_predictor=cfg.quantize_code_predictor, quantize_code2wav=cfg.quantize_code2wav,
                     quantize_vision=cfg.quantize_vision)
    sizes = size_model(config, spec, segments)
    req = request_from(cfg)
    tokens, kv, act, verdict = plan_request(sizes, req, cfg.budget)
    stream = steady_state(sizes, kv, act, verdict, cfg.budget)
    return PlanResult(cfg, sizes, req, tokens, kv, act, verdict, stream=stream)


def require_fit(verdict: Verdict) -> None:
    if not verdict.time_sliced:
        raise BudgetError(f"request refused before loading anything: {verdict.reason}; raise --budget, "
                          "or ask for less (--no-speech, fewer images, shorter audio, fewer tokens)")


def render_plan(result: PlanResult) -> str:
    j = result.to_json()
    lines = [f"model: {result.cfg.model}   total parameters: {j['total_params']:,}", ""]
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
              f"+ {format_bytes(RUNTIME_MARGIN)} runtime margin, "
              f"needs: {', '.join(r['needed'])}"]
    lines += ["", f"budget {format_bytes(result.cfg.budget)}: {j['verdict']}",
              f"all-resident from {format_bytes(j['all_resident_bytes'])}; the least budget this request runs in: "
              f"{format_bytes(j['min_budget_bytes'])}"]
    for st in result.verdict.schedule:
        lines.append(f"  stage {st.name:<12} {format_bytes(st.bytes):>12}  resident: {', '.join(st.resident)}")
    if result.stream:
        lines += _render_stream(result)
    return "\n".join(lines)


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
