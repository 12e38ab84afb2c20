"""What a request needs beside the weights: its tokens, KV caches and working memory per stage, from the
model's dimensions and the device profile's tuning numbers (the chunks, blocks and buckets the runtime uses)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .. import components as C
from ..audio_format import conv_batch, conv_length
from ..contract import frame_cap
from ..device.profile import DeviceProfile, MemoryTuning, MoeTuning

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
    together, a video in chunks) and the largest frame's patches (attention stays within a frame); apart, for its
    single allocations, the images' pass and the largest video pass, and the images' patches where their sizes
    differ (attention then takes a block-diagonal mask over all of them, orin.model.vision_encoder)."""
    images = sum(t * h * w for t, h, w in image_grids)
    video = max((t * h * w for t, h, w in video_chunks(video_grids, patches)), default=0)
    return {"vision_patches": max(images, video),
            "vision_frame_patches": max((h * w for _, h, w in tuple(image_grids) + tuple(video_grids)), default=0),
            "image_patches": images, "video_pass_patches": video,
            "vision_mask_patches": images if len({h * w for _, h, w in image_grids}) > 1 else 0}


def audio_sizes(feature_lengths, n_window: int) -> dict:
    """The most chunks (2 * n_window feature frames each: a second of audio) one audio clip of the prompt holds:
    each clip goes through the audio encoder's convolutions on its own (orin.runtime.thinker.encode_audio)."""
    chunk = 2 * n_window
    return {"audio_clip_chunks": max((-(-int(n) // chunk) for n in feature_lengths), default=0)}


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
    clips = [s for s in (req.audio_seconds, req.video_seconds if videos and req.video_audio else 0) if s > 0]
    return {"audio": aud, "image": img, "video": vid, "prompt": prompt, "generated": req.text_tokens,
            "total": prompt + req.text_tokens, "talker_frames": frames_out,
            **vision_sizes(images, videos, profile.prefill.video_encode_patches),
            **audio_sizes([int(round(s * AUDIO_FRAMES_PER_SECOND)) for s in clips], n_window)}


def prompt_tokens(prompt, generated: int, talker_frames: int, dims: dict, profile: DeviceProfile) -> dict:
    """request_tokens' dict for a prepared prompt (orin.inputs.prompt.Prompt: its token counts, grids and audio
    lengths), as the engine plans it: `generated` tokens at most, `talker_frames` codec frames (0: no speech)."""
    n = prompt.length
    return {"audio": prompt.n_audio_tokens, "image": prompt.n_image_tokens, "video": prompt.n_video_tokens,
            "prompt": n, "generated": generated, "total": n + generated, "talker_frames": talker_frames,
            **vision_sizes(prompt.image_grids, prompt.video_grids, profile.prefill.video_encode_patches),
            **audio_sizes(prompt.audio_lengths, dims["audio"]["n_window"])}


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


# ---------------------------------------------------------------- pinned host memory

# The threads that load weights, each with its own staging (orin.memory.block_reader._Lane): the request's, whose
# stages load in the foreground, and the loader's one prefetch thread. A request's thread that ends leaves its
# buffers to torch's pinned-memory cache, which gives them to the next request's.
LOADING_THREADS = 2


def pinned_host_bytes(memory: MemoryTuning) -> int:
    """Pinned host memory the loader keeps for good: two staging buffers of memory.stage_bytes per loading thread
    (orin.memory.block_reader). The long prompt's MoE pins a few KB of block ends a layer (orin.int4.moe), which the
    runtime margin covers."""
    return LOADING_THREADS * 2 * memory.stage_bytes


def stage_margin(profile: DeviceProfile) -> int:
    """What every stage holds beside its weights, KV caches and activations: the runtime margin, and on a unified-memory
    device (the Orin, where pinned host memory is the same DRAM as the device's) the pinned staging buffers. On a
    discrete GPU those are host memory, outside the device budget."""
    margin = profile.memory.runtime_margin
    return margin + pinned_host_bytes(profile.memory) if profile.capabilities.unified_memory else margin


# ---------------------------------------------------------------- single allocations

PROMPT = "send a shorter prompt (less audio or video, a lower video fps, fewer or smaller images)"
CONTEXT = "send a shorter prompt or ask for fewer tokens (max_tokens; plan: --text-tokens)"


@dataclass(frozen=True)
class Allocation:
    """One allocation the runtime makes whole: one tensor (one block of torch's caching allocator, which asks the
    driver for a large block's own size rounded up to 2 MiB; Tegra refuses expandable segments,
    orin.device.allocator_conf) or one pinned staging buffer. `what` it holds, the component whose stage makes it,
    its bytes, and `advice`: what makes it smaller, as a sentence. `pieces`: the runtime makes it in pieces of a
    profile number's size (the advice names it), `bytes` being one piece. `own`: the request's own (False: the
    loader's staging, a weight, a continued turn's bound)."""

    what: str
    component: str
    bytes: int
    advice: str
    pieces: bool = False
    own: bool = True

    def to_json(self) -> dict:
        return asdict(self)


def _graph_rows(T: int) -> int:
    """The most rows a prefill of T rows takes: padded to its graph's bucket (orin.runtime.prefill_route.
    prefill_bucket: 64 rows up to 512, then at most a quarter more)."""
    return -(-T // 64) * 64 if T <= 512 else T + T // 4


def _decoder_allocations(name: str, comp: str, T: int, positions: int, d: dict, b: int, profile: DeviceProfile,
                         widen: int = 1) -> list[Allocation]:
    """A decoder's largest allocations for a prompt of T rows and a cache of `positions`, as orin.runtime.decode,
    attention and layer make them."""
    caps, tune, moe = profile.capabilities, profile.prefill, profile.moe
    H, E, k, hd = d["hidden"], d["experts"], d["top_k"], d["head_dim"]
    one = 2 * d["moe_intermediate"] * H * b  # an expert's fused gate/up dequantized (its down is half that)
    out = [Allocation(f"{name} KV cache, one layer's keys (its values alike)", comp,
                      d["kv_heads"] * positions * hd * b, CONTEXT),
           Allocation(f"{name} prompt's hidden states [{T}, {H}]", comp, T * H * b, PROMPT),
           Allocation(f"{name} router's probabilities [{T}, {E}] in float32", comp, T * E * 4, PROMPT)]
    if T <= tune.long_prefill_tokens:
        rows = _graph_rows(T) * k
        per = max(1, min(E, moe.prefill_dequant_chunk // one))
        out += [Allocation(f"{name} prefill's token-expert rows [{rows}, {H}]", comp, rows * H * b, PROMPT),
                Allocation(f"{name} prefill's queries [{_graph_rows(T)}, {d['heads'] * hd}]", comp,
                           _graph_rows(T) * d["heads"] * hd * b, PROMPT),
                Allocation(f"{name} prefill's experts dequantized, {per} at a time", comp, per * one,
                           "lower the profile's moe.prefill_dequant_chunk", pieces=True)]
        if not caps.cuda:  # SDPA's math path materialises the scores; CUDA's fused kernels make none
            out.append(Allocation(f"{name} prefill's attention scores (off CUDA)", comp, d["heads"] * T * T * b, PROMPT))
        return out
    chunk = tune.long_prefill_tokens * widen
    whole = _whole_experts(d, b, moe)
    rows = tune.long_moe_block_rows * widen // (2 if whole else 1)
    per = E if whole else max(1, min(E, moe.long_dequant_chunk // (3 * d["moe_intermediate"] * H * b)))
    out += [Allocation(f"{name} long prompt's MoE block, its rows gathered [{rows}, {H}]", comp, rows * H * b,
                       "lower the profile's prefill.long_moe_block_rows", pieces=True),
            Allocation(f"{name} long prompt's experts dequantized, {per} at a time", comp, per * one,
                       "lower the profile's moe.long_whole_experts_bytes" if whole else "lower the profile's moe.long_dequant_chunk",
                       pieces=True),
            Allocation(f"{name} long prompt's token-expert order [{T * k}] (int64)", comp, T * k * 8, PROMPT)]
    if caps.cudnn_whole_prompt:  # every head's queries for every row, and the attention's output
        bucket = profile.attention.whole_prompt_bucket
        out.append(Allocation(f"{name} long prompt's queries, every head (cuDNN)", comp,
                              d["heads"] * -(-T // bucket) * bucket * hd * b, PROMPT))
    elif caps.cuda:
        out.append(Allocation(f"{name} long prompt's attention chunk, its queries [{chunk}, {d['heads']}, {hd}]",
                              comp, chunk * d["heads"] * hd * b, "lower the profile's prefill.long_prefill_tokens", pieces=True))
    else:  # one KV group's scores over the whole cache at a time, materialised off CUDA
        rep = d["heads"] // d["kv_heads"]
        out.append(Allocation(f"{name} long prompt's attention scores, one KV group (off CUDA)", comp,
                              rep * min(T, chunk) * T * b, "lower the profile's prefill.long_prefill_tokens", pieces=True))
    return out


def _vision_allocations(tokens: dict, dims: dict, b: int, profile: DeviceProfile) -> list[Allocation]:
    """The vision encoder's largest allocations: per pass (the images together, a video a pass at a time) its
    position table (four taps in float32), its MLP, its pixel values, and the mask over images of different sizes."""
    v, t = dims["vision"], dims["thinker"]
    patch_dim = v.get("in_channels", 3) * v.get("temporal_patch", 2) * v["patch"] ** 2
    passes = [("images", tokens.get("image_patches", tokens["vision_patches"] if tokens["image"] else 0), 4,
               "send fewer or smaller images (they go through the vision encoder together)", False),
              ("video pass", tokens.get("video_pass_patches", tokens["vision_patches"] if tokens["video"] else 0), b,
               "send smaller video frames (plan: --video-frame-pixels) or lower the profile's prefill.video_encode_patches", True)]
    out = []
    for what, P, pixel_bytes, advice, pieces in passes:
        if not P:
            continue
        out += [Allocation(f"vision encoder's position table, {what} ({P} patches x 4 taps, float32)",
                           "vision_encoder", P * 4 * v["hidden"] * 4, advice, pieces),
                Allocation(f"vision encoder's MLP, {what} [{P}, {v['intermediate']}]", "vision_encoder",
                           P * v["intermediate"] * b, advice, pieces),
                Allocation(f"vision encoder's pixel values, {what} [{P}, {patch_dim}]", "vision_encoder",
                           P * patch_dim * pixel_bytes, advice, pieces)]
        if not profile.capabilities.cuda:
            out.append(Allocation(f"vision encoder's attention scores, {what} (off CUDA)", "vision_encoder",
                                  v["heads"] * P * tokens["vision_frame_patches"] * b, advice, pieces))
    mask = tokens.get("vision_mask_patches", 0)
    if mask:
        out.append(Allocation(f"vision encoder's mask over images of different sizes [{mask}, {mask}]",
                              "vision_encoder", mask * mask * b, "send fewer images, or images of one size"))
    visual = tokens["image"] + tokens["video"]
    out.append(Allocation(f"visual features, each deepstack level [{visual}, {t['hidden']}]", "vision_encoder",
                          visual * t["hidden"] * b, "send fewer or smaller images, or a shorter video or a lower video fps"))
    return out


def max_clip_seconds(dims: dict, b: int, ceiling: int | None) -> float | None:
    """The longest audio clip whose convolutions stay under `ceiling` bytes (None: no limit)."""
    a = dims["audio"]
    batch = a["conv_chunksize"]
    if ceiling is None or batch * _conv_chunk_bytes(a, b) <= ceiling:
        return None
    fits = ceiling // _conv_chunk_bytes(a, b)
    chunks = 1 << max(0, fits.bit_length() - 1) if fits else 0  # the batches are powers of two (conv_batch)
    return chunks * 2 * a["n_window"] / AUDIO_FRAMES_PER_SECOND


def _conv_chunk_bytes(a: dict, b: int) -> int:
    """One chunk's output of the audio encoder's first convolution (stride 2 over mel bins and frames)."""
    return a["conv_channels"] * ((a["mel_bins"] - 1) // 2 + 1) * a["n_window"] * b


def _audio_allocations(tokens: dict, dims: dict, b: int, profile: DeviceProfile) -> list[Allocation]:
    """The audio encoder's largest allocations for its longest clip: the first convolution's output over the clip's
    one-second chunks (at most the config's conv_chunksize at once, a power of two of them: conv_batch), and the
    layers' MLP."""
    a = dims["audio"]
    per_chunk = conv_length(2 * a["n_window"])
    chunks = tokens.get("audio_clip_chunks") or -(-tokens["audio"] // per_chunk)
    batch = conv_batch(min(chunks, a["conv_chunksize"]), a["conv_chunksize"])
    longest = max_clip_seconds(dims, b, profile.memory.max_allocation_bytes)
    advice = (f"send audio clips of at most {longest:g} s each (longer audio as several clips: each is encoded on its "
              "own)" if longest is not None else "send shorter audio clips")
    return [Allocation(f"audio encoder's convolution over {batch} one-second chunks", "audio_encoder",
                       batch * _conv_chunk_bytes(a, b), advice),
            Allocation(f"audio encoder's MLP [{chunks * per_chunk}, {a['ffn']}]", "audio_encoder",
                       chunks * per_chunk * a["ffn"] * b, advice)]


def _code2wav_allocation(dims: dict, b: int, profile: DeviceProfile) -> Allocation:
    """code2wav's largest intermediate for one chunk with its left context, as activation_bytes walks its stages."""
    c, speech = dims["code2wav"], profile.speech
    length = (speech.code2wav_chunk + speech.code2wav_left_context) * math.prod(c["upsampling_ratios"])
    peak, ch = length * c["hidden"] * 4, c["decoder_dim"]
    for rate in c["upsample_rates"]:
        length *= rate
        ch //= 2
        peak = max(peak, length * ch)
    return Allocation("code2wav's largest intermediate, one chunk", "code2wav", peak * b,
                      "lower the profile's speech.code2wav_chunk", pieces=True)


def allocations(tokens: dict, dims: dict, dtype_bytes: int, profile: DeviceProfile,
                weights=None) -> list[Allocation]:
    """Every large single allocation a request makes (request_tokens' `tokens`), from the model's dimensions and
    the profile, largest first: its KV caches' layers, the prefills' working tensors, the encoders' passes,
    code2wav's chunks, the loader's staging buffer, a continued turn's graph mask and, with `weights` (the
    orin.memory.model_sizes.ModelSizes), the loads' device blocks where a unit has no weight arena: a batch of its
    tensors (a staging buffer's bytes at most) or its largest tensor alone."""
    b, t, k = dtype_bytes, dims["thinker"], dims["talker"]
    positions = profile.memory.cache_positions
    T = tokens["prompt"]
    out = _decoder_allocations("thinker", "thinker_text", T, positions(tokens["total"]), t, b, profile)
    out.append(Allocation("thinker's logits, the last row (float32 to sample)", "thinker_text", t["vocab"] * 4,
                          "nothing to change: it is one row"))
    if tokens["talker_frames"]:
        widen = C.long_prefill_widen(t["hidden"], k["hidden"])
        out += _decoder_allocations("talker", "talker", T + 9, positions(T + 9 + tokens["talker_frames"]), k, b,
                                    profile, widen)
        out.append(_code2wav_allocation(dims, b, profile))
    if tokens["vision_patches"]:
        out += _vision_allocations(tokens, dims, b, profile)
    if tokens["audio"]:
        out += _audio_allocations(tokens, dims, b, profile)
    out += [Allocation("a loading thread's pinned staging buffer", "loader", profile.memory.stage_bytes,
                       "lower the profile's memory.stage_bytes", pieces=True, own=False),
            # a next turn's rows over this cache: a graph's mask only up to capture.after_mask_max elements
            Allocation("a continued turn's prefill mask, as SDPA's bias", "thinker_text",
                       min(profile.capture.after_mask_max, t["heads"] // t["kv_heads"] * positions(tokens["total"])
                           * _graph_rows(min(T, profile.prefill.long_prefill_tokens))) * b,
                       "lower the profile's capture.after_mask_max", pieces=True, own=False)]
    if weights is not None and weights.largest_tensor is not None:
        unit = max(((u, n) for c in weights.components.values() for u, n in c.units.items()), key=lambda u: u[1])
        out.append(Allocation("a batch of a unit's weights read in one block, where it has no weight arena",
                              "loader", min(unit[1], profile.memory.stage_bytes),
                              "lower the profile's memory.stage_bytes", pieces=True, own=False))
        comp, name, nbytes = weights.largest_tensor
        out.append(Allocation(f"weight {name}, loaded whole where its unit has no weight arena", comp, nbytes,
                              "no request changes it: serve with a --budget, under which each unit's weights are mapped in pieces under the "
                              "ceiling (orin.memory.arena)", own=False))
    return sorted(out, key=lambda a: -a.bytes)


def over_ceiling(allocs: list[Allocation], profile: DeviceProfile) -> Allocation | None:
    """The largest of `allocs` where it exceeds the profile's memory.max_allocation_bytes, else None."""
    ceiling = profile.memory.max_allocation_bytes
    largest = max(allocs, key=lambda a: a.bytes, default=None)
    return largest if ceiling is not None and largest is not None and largest.bytes > ceiling else None
