"""What a request needs beside the weights: its tokens, KV caches and working memory per stage, from the
model's dimensions and the device profile's tuning numbers (the chunks, blocks and buckets the runtime uses)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .. import components as C
from ..audio_format import conv_batch
from ..contract import frame_cap
from ..device.profile import DeviceProfile, MoeTuning

PROMPT_TEXT_TOKENS = 28  # chat template plus a short question around the media placeholders
AUDIO_FRAMES_PER_SECOND = 100  # Whisper features: 10 ms hop at 16 kHz


@dataclass(frozen=True)
class Request:
    audio_seconds: float = 0.0
    images: int = 0
    image_size: int = 224
    video_seconds: float = 0.0
    video_fps: float = 2.0  # orin.inputs.video's sampling: frames per second, within its frame bounds
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


def video_passes(grids, patches: int) -> list[tuple[int, int, int]]:
    """The vision-encoder passes over the videos of (t, h, w) `grids`: (video, first temporal grid, last + 1),
    at most `patches` patches each (the profile's prefill.video_encode_patches; one grid at least)."""
    out = []
    for v, (t, h, w) in enumerate(grids):
        step = max(1, patches // (h * w))
        out += [(v, first, min(t, first + step)) for first in range(0, t, step)]
    return out


def video_chunks(grids, patches: int) -> list[tuple[int, int, int]]:
    """The (t, h, w) grid of each of video_passes(grids, patches)."""
    grids = list(grids)
    return [(last - first, grids[v][1], grids[v][2]) for v, first, last in video_passes(grids, patches)]


def vision_sizes(image_grids, video_grids, patches: int) -> dict:
    """What sizes the vision encoder's working memory: the most patches one pass takes (the images go through
    together, a video in chunks) and the largest frame's patches (attention stays within a frame)."""
    images = sum(t * h * w for t, h, w in image_grids)
    return {"vision_patches": max([images] + [t * h * w for t, h, w in video_chunks(video_grids, patches)]),
            "vision_frame_patches": max((h * w for _, h, w in tuple(image_grids) + tuple(video_grids)), default=0)}


def video_grid(req: Request, dims: dict) -> tuple[int, int, int] | None:
    """The (t, h, w) patch grid orin.inputs.video and the processor make of `req.video_seconds` of square video."""
    from ..inputs.video import FRAME_FACTOR, TEMPORAL_PATCH, VideoOptions, sampled_frames

    if req.video_seconds <= 0:
        return None
    frames = sampled_frames(req.video_seconds, VideoOptions(fps=req.video_fps))
    side = max(FRAME_FACTOR, int(math.isqrt(req.video_frame_pixels)) // FRAME_FACTOR * FRAME_FACTOR)
    return frames // TEMPORAL_PATCH, side // dims["vision"]["patch"], side // dims["vision"]["patch"]


def request_tokens(req: Request, dims: dict, profile: DeviceProfile) -> dict:
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
            "total": prompt + req.text_tokens, "talker_frames": frames_out,
            **vision_sizes(images, videos, profile.prefill.video_encode_patches)}


def kv_bytes(tokens: dict, dims: dict, dtype_bytes: int, profile: DeviceProfile) -> dict:
    t, k = dims["thinker"], dims["talker"]
    positions = profile.memory.cache_positions
    thinker = t["layers"] * 2 * t["kv_heads"] * t["head_dim"] * dtype_bytes * positions(tokens["total"])
    talker_len = positions(tokens["prompt"] + 9 + tokens["talker_frames"]) if tokens["talker_frames"] else 0
    talker = k["layers"] * 2 * k["kv_heads"] * k["head_dim"] * dtype_bytes * talker_len
    cp = dims["code_predictor"]
    predictor = cp["layers"] * 2 * cp["kv_heads"] * cp["head_dim"] * dtype_bytes * (cp["groups"] + 1)
    return {"thinker_text": thinker, "talker": talker, "code_predictor": predictor if talker_len else 0}


def _every_expert_bytes(d: dict, b: int) -> int:
    """A MoE's experts dequantized, every one of them (gate, up and down)."""
    return 3 * d["moe_intermediate"] * d["hidden"] * b * d["experts"]


def _whole_experts(d: dict, b: int, moe: MoeTuning) -> bool:
    """Whether a long prompt's MoE dequantizes every expert at once (its backend's long-prompt method)."""
    return _every_expert_bytes(d, b) <= moe.long_whole_experts_bytes


def _dequant_bytes(d: dict, b: int, moe: MoeTuning, long: bool = False) -> int:
    """The prefill's dequantized experts: whole experts, at most moe.prefill_dequant_chunk bytes (for a `long`
    prompt moe.long_dequant_chunk, or all of them where they fit in moe.long_whole_experts_bytes) at once."""
    if long and _whole_experts(d, b, moe):
        return _every_expert_bytes(d, b)
    one = 2 * d["moe_intermediate"] * d["hidden"] * b  # the larger projection: fused gate/up
    return one * max(1, min(d["experts"], (moe.long_dequant_chunk if long else moe.prefill_dequant_chunk) // one))


def _prefill_bytes(T: int, d: dict, b: int, profile: DeviceProfile, widen: int = 1) -> int:
    """A decoder's (thinker's or talker's) prefill working memory for T tokens, as orin.runtime.decode runs it: up to
    prefill.long_prefill_tokens in one pass (its attention's scores, where SDPA's math path materialises them); a longer
    prompt one layer at a time, its attention in chunks over the cache (one KV group's keys expanded at a time
    where flash does not run) or, on Hopper, whole on cuDNN (every head's queries and output for every row,
    padded: orin.runtime.layer.attention_block_long; the larger of the two is counted), its MoE over every row
    in blocks of prefill.long_moe_block_rows (half that where every expert is dequantized at once; a block's gathered
    rows beside gate/up, its largest pair of intermediates), the router's scores and two hidden states
    whole-prompt (the layer's input, overwritten by its output, and the MLP's normed input), and the attention's
    projections dequantized. A long prompt's chunks and blocks are `widen` times the thinker's rows
    (orin.components.long_prefill_widen)."""
    tune = profile.prefill
    long = T > tune.long_prefill_tokens
    Tc = min(T, tune.long_prefill_tokens * widen) if long else T
    rep = d["heads"] // d["kv_heads"]
    bucket = profile.attention.whole_prompt_bucket
    whole = 2 * d["heads"] * -(-T // bucket) * bucket * d["head_dim"]
    attn = (max(2 * rep * T * d["head_dim"], whole) if long else d["heads"] * Tc * Tc) * b
    proj = Tc * (4 * d["hidden"] + (d["heads"] + 2 * d["kv_heads"]) * d["head_dim"]) * b + 2 * T * d["hidden"] * b
    shared = Tc * 3 * d.get("shared_intermediate", 0) * b
    if not long:
        moe = Tc * d["top_k"] * (3 * d["moe_intermediate"] + 2 * d["hidden"]) * b
    else:
        rows = tune.long_moe_block_rows * widen // (2 if _whole_experts(d, b, profile.moe) else 1)
        moe = rows * (d["hidden"] + 2 * d["moe_intermediate"]) * b
        proj += T * d["experts"] * 4
        # the attention's projections dequantized once a layer (q, k, v, o)
        proj += 2 * (d["heads"] + d["kv_heads"]) * d["head_dim"] * d["hidden"] * b
    return attn + proj + moe + shared


def activation_bytes(tokens: dict, dims: dict, dtype_bytes: int, profile: DeviceProfile) -> dict:
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
    long_from = profile.prefill.long_prefill_tokens
    out["thinker_text"] = (_prefill_bytes(T, t, b, profile) + visual + t["vocab"] * 4 * 2
                           + _dequant_bytes(t, b, profile.moe, T > long_from))
    if tokens["talker_frames"]:
        widen = C.long_prefill_widen(t["hidden"], k["hidden"])
        out["talker"] = (_prefill_bytes(T + 9, k, b, profile, widen) + k["vocab"] * 4
                         + _dequant_bytes(k, b, profile.moe, T + 9 > long_from))
        c = dims["code2wav"]
        speech = profile.speech
        length = (speech.code2wav_chunk + speech.code2wav_left_context) * math.prod(c["upsampling_ratios"])
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
