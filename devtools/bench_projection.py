"""The AGX Orin projection: what the measured run's figures would be on a Jetson AGX Orin 64 GB, from the bytes
each stage reads (`active_bytes`) and the FLOPs it does over the Orin's bandwidth and compute, and from the
stages measured on the benchmark's GPU scaled by assumed host and GPU slowdowns. A projection, not a
measurement.

The video cases (video_projection) are another regime: tens of thousands of prompt tokens make the encoders, the
thinker's prefill and the talker's prefill over the same prompt compute-bound, so each is projected twice and the
larger kept: its FLOPs over the Orin's tensor rate at the assumed efficiency, and the time measured here scaled by
the ratio of the measuring GPU's dense BF16 tensor rate to the Orin's (the same share of each one's peak;
W4A16 runs at the FP16/BF16 tensor rate on both, dequantization in registers). Decode is bandwidth-bound as
above, its KV reads at the long context included."""

from __future__ import annotations

from orin import components as C
from orin.device.profile import ORIN as ORIN_PROFILE

# Jetson AGX Orin 64 GB: LPDDR5 shared by CPU and GPU; dense FP16 tensor rate of the GPU (half its 170 sparse
# INT8 TOPS, halved again for FP16); the fraction of each a decode/prefill kernel mix reaches (assumed); and how
# much slower its Cortex-A78AE host issues the launch-bound eager work than this x86 host (assumed); and how
# much slower its GPU runs device-bound work that is neither at the bandwidth nor at the tensor roof, such as
# the graph-replayed INT4 prefill (dequantization in registers): SMs x clock, 16 x 1.3 GHz against an H200's
# 132 x 1.98 GHz (the measuring GPU's; assumed to scale alike).
ORIN = {"bandwidth": 204.8e9, "fp16_tensor_flops": 42.5e12, "efficiency_bw": 0.7, "efficiency_flops": 0.4,
        "host_slowdown": 2.5, "gpu_slowdown": (132 * 1.98) / (16 * 1.3)}


# Dense (non-sparse) BF16 tensor FLOP/s of the GPUs the benchmark is measured on, by name (NVIDIA's figures: the
# SXM parts, 989 TFLOP/s for H100 SXM and H200; H100 PCIe 756, H100 NVL 835). Unknown names fall back to the
# SMs-x-clock ratio (ORIN["gpu_slowdown"]).
GPU_BF16_DENSE_FLOPS = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H200", 989e12), ("H100", 989e12),
                        ("A100", 312e12))


def gpu_flops_ratio(gpu_name: str | None) -> tuple[float, str]:
    """How many times the measuring GPU's dense tensor rate is the Orin's, and how that was decided."""
    for key, flops in GPU_BF16_DENSE_FLOPS:
        if gpu_name and key.lower() in gpu_name.lower():
            return flops / ORIN["fp16_tensor_flops"], f"dense BF16 tensor rate of {key}: {flops / 1e12:.0f} TFLOP/s"
    return ORIN["gpu_slowdown"], "unknown GPU: SMs x clock ratio (gpu_slowdown)"


def active_bytes(config) -> dict:
    """Bytes read per step from resident weights, per stage, in the INT4 layout the runtime holds: every
    projection and norm of a layer, the router's top-k share of the experts, the head; one embedding row only.
    The code predictor runs its layers once per residual code group, each time with one of its heads."""
    from orin.checkpoint.targets import QuantSpec, find_targets, target_runtime_bytes
    from orin.memory.model_sizes import meta_model

    model = meta_model(config)
    targets = {t.path: t for t in find_targets(model, QuantSpec())}
    th, tk = config.thinker_config.text_config, config.talker_config.text_config
    share = {"thinker_text": th.num_experts_per_tok / th.num_experts, "talker": tk.num_experts_per_tok / tk.num_experts}
    out = {"thinker_text": 0, "talker": 0, "code_predictor_layers": 0, "code_predictor_head": 0}
    for t in targets.values():
        if t.component in share:
            out[t.component] += int(target_runtime_bytes(t, 128) * (share[t.component] if t.kind == "experts" else 1))
        elif t.component == "code_predictor":
            out["code_predictor_layers"] += target_runtime_bytes(t, 128)
    for name, p in model.named_parameters():
        if name.rsplit(".", 1)[0] in targets or "embed_tokens" in name or "codec_embedding" in name:
            continue
        comp = C.component_of(name)
        nbytes = p.numel() * 2
        if comp == "code_predictor":
            out["code_predictor_head" if ".lm_head." in name else "code_predictor_layers"] += nbytes
        elif comp in share and not name.startswith(("talker.text_projection", "talker.hidden_projection")):
            out[comp] += nbytes
    groups = config.talker_config.num_code_groups - 1
    out["code_predictor_per_frame"] = groups * (out["code_predictor_layers"] + out["code_predictor_head"] // groups)
    return out


def orin_projection(model_dir: str, prompt_tokens: int, text_tokens: int, audio_frames: int,
                    measured: dict) -> dict:
    """Decode and prefill on the AGX Orin from bytes moved and FLOPs per stage over its bandwidth and compute
    (ORIN), and from the stages measured here: the eager encoders scaled by the host slowdown, the
    graph-replayed prefill by the GPU slowdown. A projection, not a
    measurement: `measured` is the fastest all-resident run of this benchmark."""
    from orin.model.config import load_omni_config

    config = load_omni_config(model_dir)
    th = config.thinker_config.text_config
    act = active_bytes(config)
    ctx = prompt_tokens + text_tokens // 2
    kv_read = th.num_hidden_layers * 2 * th.num_key_value_heads * th.head_dim * 2 * ctx
    token_bytes = act["thinker_text"] + kv_read
    frame_bytes = act["talker"] + act["code_predictor_per_frame"]
    bw = ORIN["bandwidth"] * ORIN["efficiency_bw"]
    flops = ORIN["fp16_tensor_flops"] * ORIN["efficiency_flops"]
    # Prefill: 2 FLOPs per active weight per token; all experts are touched by a few hundred tokens.
    from orin.checkpoint.targets import QuantSpec
    from orin.memory.model_sizes import size_model

    sizes = size_model(config, QuantSpec(), dict(C.DEFAULT_SEGMENTS))
    enc = sizes.components["audio_encoder"].params + sizes.components["vision_encoder"].params
    active_params = (act["thinker_text"] - th.vocab_size * th.hidden_size * 2) * 2  # INT4: ~2 weights a byte
    prefill_flops = 2 * active_params * prompt_tokens + 2 * enc * prompt_tokens
    prefill_bytes = sum(sizes.components[c].runtime_int4_bytes for c in ("thinker_text", "audio_encoder",
                                                                         "vision_encoder"))
    prefill_floor = max(prefill_bytes / bw, prefill_flops / flops)
    stages = measured.get("stages_s") or {}
    # The encoders run eagerly, host-bound; the thinker prefill is replayed from a CUDA graph, device-bound.
    launch_bound = (stages.get("encode") or 0) * ORIN["host_slowdown"]
    prefill_scaled = (stages.get("thinker_prefill") or 0) * ORIN["gpu_slowdown"]
    token_s = token_bytes / bw
    frame_s = frame_bytes / bw
    first_chunk = ORIN_PROFILE.speech.code2wav_first_chunk
    ttft = max(prefill_floor, launch_bound + prefill_scaled)
    return {
        "assumptions": dict(ORIN),
        "active_bytes": act,
        "thinker_bytes_per_token": token_bytes,
        "talker_bytes_per_frame": frame_bytes,
        "thinker_tokens_per_s": 1 / token_s,
        "talker_frames_per_s": 1 / frame_s,
        "decode_request_s": text_tokens * token_s + audio_frames * frame_s,
        "prefill_flops": prefill_flops,
        "prefill_bytes": prefill_bytes,
        "prefill_floor_s": prefill_floor,
        "encode_launch_bound_s": launch_bound,
        "prefill_device_scaled_s": prefill_scaled,
        "ttft_s": ttft,
        "first_audio_s": ttft + (first_chunk + 1) * token_s + first_chunk * frame_s,
        "peak_bytes_allocator": measured.get("peak_bytes"),
    }


def _attention_flops(tokens: int, layers: int, width: int, causal: bool = True) -> float:
    """QK^T and PV over `tokens` (2 x 2 x n^2 x width a layer), halved when causal."""
    return 4.0 * layers * tokens * tokens * width / (2 if causal else 1)


def video_flops(config, counts: dict, sizes=None) -> dict:
    """FLOPs of a video request's compute-bound stages (`counts`: prompt_tokens, audio_tokens, image_tokens,
    video_grids as devtools.bench_engine.prompt_counts gives them). 2 FLOPs per weight per row: the vision
    encoder per patch (each temporal grid attends within itself; the image's patches counted too), the audio
    encoder per output frame (its conv front end and windowed attention left out: a few % of it), the thinker
    and the talker per prompt token over their active weights (8 of 128 experts; INT4 ~2 weights a byte), plus
    their causal attention over the whole prompt."""
    from orin.checkpoint.targets import QuantSpec
    from orin.memory.model_sizes import size_model

    sizes = sizes or size_model(config, QuantSpec(), dict(C.DEFAULT_SEGMENTS))
    th, tk = config.thinker_config.text_config, config.talker_config.text_config
    vc = config.thinker_config.vision_config
    merge = vc.spatial_merge_size ** 2
    grids = [tuple(g) for g in counts.get("video_grids") or ()]
    image_patches = (counts.get("image_tokens") or 0) * merge  # one grid per image (t = 1)
    patches = sum(t * h * w for t, h, w in grids) + image_patches
    vision = (2.0 * sizes.components["vision_encoder"].params * patches
              + 4.0 * vc.depth * vc.hidden_size * (sum(t * (h * w) ** 2 for t, h, w in grids) + image_patches ** 2))
    audio = 2.0 * sizes.components["audio_encoder"].params * (counts.get("audio_tokens") or 0)
    act = active_bytes(config)
    n = counts["prompt_tokens"]
    thinker_params = (act["thinker_text"] - th.vocab_size * th.hidden_size * 2) * 2
    talker_params = act["talker"] * 2
    thinker = 2.0 * thinker_params * n + _attention_flops(n, th.num_hidden_layers, th.num_attention_heads * th.head_dim)
    talker = 2.0 * talker_params * n + _attention_flops(n, tk.num_hidden_layers, tk.num_attention_heads * tk.head_dim)
    return {"vision_patches": patches, "vision": vision, "audio": audio, "encode": vision + audio,
            "thinker_prefill": thinker, "talker_prefill": talker}


def video_projection(model_dir: str, counts: dict, text_tokens: int, audio_frames: int, measured: dict,
                     gpu_name: str | None, decode_s_per_video_s: float | None = None,
                     video_seconds: float | None = None) -> dict:
    """One video case on the AGX Orin (see the module's doc): `counts` and `measured` are the case's all-resident
    orin-omni figures here (prompt counts, prepare_s, encode_s, prefill_s, talker_prefill_s, peak_bytes);
    `decode_s_per_video_s` the measured software decode of an encoded clip (PyAV) on this host, scaled by the host
    slowdown over `video_seconds` (the Orin's NVDEC would be faster: not used here). A projection, not a
    measurement."""
    from orin.checkpoint.targets import QuantSpec
    from orin.memory.model_sizes import size_model
    from orin.model.config import load_omni_config

    config = load_omni_config(model_dir)
    sizes = size_model(config, QuantSpec(), dict(C.DEFAULT_SEGMENTS))
    flops = video_flops(config, counts, sizes)
    rate = ORIN["fp16_tensor_flops"] * ORIN["efficiency_flops"]
    ratio, how = gpu_flops_ratio(gpu_name)

    def stage(flop_key: str, measured_key: str) -> dict:
        by_flops = flops[flop_key] / rate
        seen = measured.get(measured_key)
        scaled = seen * ratio if seen is not None else None
        return {"flops": flops[flop_key], "flops_s": by_flops, "measured_s": seen, "scaled_s": scaled,
                "s": max(by_flops, scaled or 0.0)}

    stages = {"encode": stage("encode", "encode_s"), "thinker_prefill": stage("thinker_prefill", "prefill_s"),
              "talker_prefill": stage("talker_prefill", "talker_prefill_s")}
    prepare = (measured.get("prepare_s") or 0.0) * ORIN["host_slowdown"]
    base = orin_projection(model_dir, counts["prompt_tokens"], text_tokens, audio_frames, measured)
    token_s = 1 / base["thinker_tokens_per_s"]
    frame_s = 1 / base["talker_frames_per_s"]
    ttft = prepare + stages["encode"]["s"] + stages["thinker_prefill"]["s"]
    first_chunk = ORIN_PROFILE.speech.code2wav_first_chunk
    first_audio = ttft + stages["talker_prefill"]["s"] + (first_chunk + 1) * token_s + first_chunk * frame_s
    th, tk = config.thinker_config.text_config, config.talker_config.text_config
    ctx = counts["prompt_tokens"] + text_tokens
    kv = ctx * 2 * 2 * (th.num_hidden_layers * th.num_key_value_heads * th.head_dim
                        + tk.num_hidden_layers * tk.num_key_value_heads * tk.head_dim)
    decode = (decode_s_per_video_s * ORIN["host_slowdown"] * video_seconds
              if decode_s_per_video_s is not None and video_seconds else None)
    return {
        "assumptions": {**ORIN, "gpu_name": gpu_name, "gpu_to_orin_flops_ratio": ratio, "ratio_from": how},
        "stages": stages,
        "prepare_s": prepare,
        "ttft_s": ttft,
        "first_audio_s": first_audio,
        "thinker_tokens_per_s": base["thinker_tokens_per_s"],
        "talker_frames_per_s": base["talker_frames_per_s"],
        "decode_request_s": base["decode_request_s"],
        "total_s": ttft + stages["talker_prefill"]["s"] + base["decode_request_s"],
        "kv_bytes": kv,
        "peak_bytes_allocator": measured.get("peak_bytes"),
        "video_decode_s": decode,
        "ttft_with_decode_s": (ttft + decode) if decode is not None else None,
    }


__all__ = ["GPU_BF16_DENSE_FLOPS", "ORIN", "active_bytes", "gpu_flops_ratio", "orin_projection", "video_flops",
           "video_projection"]
