"""The AGX Orin projection: what the measured run's figures would be on a Jetson AGX Orin 64 GB, from the bytes
each stage reads (`active_bytes`) and the FLOPs it does over the Orin's bandwidth and compute, and from the
stages measured on the benchmark's GPU scaled by assumed host and GPU slowdowns. A projection, not a
measurement."""

from __future__ import annotations

from .. import components as C

# Jetson AGX Orin 64 GB: LPDDR5 shared by CPU and GPU; dense FP16 tensor rate of the GPU (half its 170 sparse
# INT8 TOPS, halved again for FP16); the fraction of each a decode/prefill kernel mix reaches (assumed); and how
# much slower its Cortex-A78AE host issues the launch-bound eager work than this x86 host (assumed); and how
# much slower its GPU runs device-bound work that is neither at the bandwidth nor at the tensor roof, such as
# the graph-replayed INT4 prefill (dequantization in registers): SMs x clock, 16 x 1.3 GHz against an H200's
# 132 x 1.98 GHz (the measuring GPU's; assumed to scale alike).
ORIN = {"bandwidth": 204.8e9, "fp16_tensor_flops": 42.5e12, "efficiency_bw": 0.7, "efficiency_flops": 0.4,
        "host_slowdown": 2.5, "gpu_slowdown": (132 * 1.98) / (16 * 1.3)}


def active_bytes(config) -> dict:
    """Bytes read per step from resident weights, per stage, in the INT4 layout the runtime holds: every
    projection and norm of a layer, the router's top-k share of the experts, the head; one embedding row only.
    The code predictor runs its layers once per residual code group, each time with one of its heads."""
    from ..layout import QuantSpec, find_targets, target_runtime_bytes
    from ..plan import meta_model

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
    from ..model_config import load_omni_config

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
    from ..layout import QuantSpec
    from ..plan import size_model

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
    first_chunk = C.CODE2WAV_FIRST_CHUNK
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


__all__ = ["ORIN", "active_bytes", "orin_projection"]
