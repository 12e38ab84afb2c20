"""`orin-omni bench`: the standard request through the orin-omni engine (all-resident and time-sliced) and
through HF transformers' BF16 `generate(return_audio=True)` in one process, side by side.

The standard request is one user turn with an image, an audio clip and a short instruction, answered with a
fixed number of text tokens and speech frames (EOS ignored on both sides, so both do the same work). Each
engine mode gets an unmeasured warm-up request first (kernels, the CUDA graph) that is cancelled after its
first audio packet; its load time is reported separately. The HF reference gets a short warm-up generate.

Figures per run: weight bytes, peak GPU memory (the allocator's peak during the request; weights included),
time to first text token and first audio packet (from the request's start, preprocessing included), thinker
decode tokens/s (the thinker's own step time) and the end-to-end decode rate, talker frames/s, energy per
request (NVML's energy counter on a GPU), and swap seconds. `--synthetic` writes a random checkpoint at the
config's dimensions first (orin.synthetic); the HF reference is built from the same config with random BF16
weights. On CUDA a torch.profiler pass over a short request records the top kernels.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import components as C
from .errors import UsageError
from .units import format_bytes

log = logging.getLogger("orin.bench")

GiB = 1 << 30
TARGETS = {
    "int4_weight_bytes": ("<=", 20.5 * GiB, "INT4 weights <= 20.5 GiB"),
    "peak_all_resident": ("<=", 22 * GiB, "peak all-resident <= 22 GiB"),
    "peak_time_sliced": ("<=", 18 * GiB, "peak time-sliced <= 18 GiB"),
    "decode_tokens_per_s": (">=", 150.0, "decode >= 150 tokens/s"),
    "decode_speedup_vs_hf": (">=", 12.0, "decode >= 12x HF BF16"),
    "ttft_vs_hf": ("<=", 1.0, "TTFT no worse than HF BF16 (median of 4 requests each)"),
    "first_audio_s": ("<=", 0.300, "first audio packet <= 300 ms"),
    "energy_vs_hf": ("<=", 0.5, "energy per request <= 50 % of HF BF16"),
}


@dataclass(frozen=True)
class BenchConfig:
    config: str | None = None  # config.json / checkpoint dir / "tiny"; with synthetic=True
    model_dir: str | None = None  # an existing quantized checkpoint instead
    synthetic: bool = False
    workdir: str = "build/bench"
    device: str = "auto"
    audio_seconds: float = 30.0
    images: int = 1
    image_size: int = 224
    text_tokens: int = 256
    audio_frames: int = 100
    prompt: str = "Describe it all."
    speaker: str = "ethan"
    budget_sliced: tuple[int, ...] = (18 * GiB,)  # one time-sliced run per budget
    skip_hf: bool = False
    skip_sliced: bool = False
    decode_modes: tuple[str, ...] = ("eager", "graph", "compiled")
    profile: bool = True
    power_backend: str = "auto"
    json_out: str | None = None
    seed: int = 0
    hf_repeats: int = 2


# ---------------------------------------------------------------------- inputs


@dataclass
class _Inputs:
    messages: tuple
    images: list
    audio: object


def make_inputs(cfg: BenchConfig) -> _Inputs:
    from .media import TARGET_SR, synth_image, synth_speechlike

    images = [synth_image(cfg.image_size, seed=cfg.seed + i) for i in range(cfg.images)]
    audio = synth_speechlike(cfg.audio_seconds, TARGET_SR, seed=cfg.seed) if cfg.audio_seconds > 0 else None
    parts = [{"type": "image", "image": im} for im in images]
    if audio is not None:
        parts.append({"type": "audio", "audio": audio})
    parts.append({"type": "text", "text": cfg.prompt})
    return _Inputs(({"role": "user", "content": parts},), images, audio)


def _request(cfg: BenchConfig, inputs: _Inputs, **overrides):
    from .engine import GenerationRequest

    args = dict(messages=inputs.messages, max_new_tokens=cfg.text_tokens, speech=cfg.audio_frames > 0,
                speaker=cfg.speaker, max_audio_frames=max(cfg.audio_frames, 1), ignore_eos=True)
    args.update(overrides)
    return GenerationRequest(**args)


# ---------------------------------------------------------------------- the orin-omni engine


def _sync(device) -> None:
    import torch

    if getattr(device, "type", device) == "cuda":
        torch.cuda.synchronize()


def _stream(engine, request, cancel_after_audio: bool = False) -> dict:
    """Run one request, collecting event times; a warm-up is cancelled once its first audio packet is out."""
    from .engine import AudioChunk, Done, TextDelta

    cancel = threading.Event()
    t0 = time.perf_counter()
    report, chunks, text_events = {}, 0, 0
    for event in engine.stream(request, cancel):
        if isinstance(event, TextDelta):
            text_events += 1
        elif isinstance(event, AudioChunk):
            chunks += 1
            if cancel_after_audio:
                cancel.set()
        elif isinstance(event, Done):
            report = event.report
    report["wall_s"] = time.perf_counter() - t0
    report["audio_chunks"] = chunks
    return report


def summarize_engine(report: dict, label: str) -> dict:
    """The table's figures from an engine report (see module doc for what each one means)."""
    stages = (report.get("energy") or {}).get("by_stage") or {}
    decode_tokens = max(0, int(report.get("completion_tokens") or 0) - 1)
    think_s = (stages.get("thinker_decode") or {}).get("seconds")
    swaps = report.get("swaps") or []
    energy = report.get("energy") or {}
    return {
        "label": label,
        "prompt_tokens": report.get("prompt_tokens"),
        "completion_tokens": report.get("completion_tokens"),
        "talker_frames": report.get("talker_frames"),
        "peak_bytes": report.get("peak_bytes"),
        "ttft_s": report.get("ttft_s"),
        "first_audio_s": report.get("first_audio_s"),
        "decode_tokens_per_s": (decode_tokens / think_s) if think_s else None,
        "decode_e2e_tokens_per_s": report.get("tokens_per_s"),
        "talker_frames_per_s": (report["talker_frames"] / report["talker_s"])
        if report.get("talker_s") else None,
        "energy_j": energy.get("joules"),
        "energy_mean_w": energy.get("mean_w"),
        "energy_backend": energy.get("backend"),
        "swap_s": sum(s["seconds"] for s in swaps if not s.get("background")),
        "swap_background_s": sum(s["seconds"] for s in swaps if s.get("background")),
        "swaps": len(swaps),
        "total_s": report.get("total_s"),
        "streaming_speech": report.get("streaming_speech"),
        "stages_s": {k: v.get("seconds") for k, v in stages.items()},
        "timeline_s": report.get("timeline_s"),
        "schedule": [s.get("name") for s in report.get("schedule") or []],
    }


def _engine(cfg: BenchConfig, model_dir: str, budget: int | None, decode: str, prefetch: bool = True):
    from .engine import Engine, EngineConfig

    # The synthetic checkpoint was hashed as it was written; verifying would re-read every byte.
    return Engine(EngineConfig(model_dir=model_dir, device=cfg.device, budget=budget,
                               power_backend=cfg.power_backend, verify_checksums=not cfg.synthetic,
                               decode=decode, prefetch=prefetch))


def _free(device) -> None:
    import torch

    gc.collect()
    if getattr(device, "type", device) == "cuda":
        torch.cuda.empty_cache()


def run_all_resident(cfg: BenchConfig, model_dir: str, inputs: _Inputs, log_fn, record) -> dict:
    """Every component loaded, then per decode mode a warm-up and the measured request; `record(key, value)` is
    called as each figure is ready (a mode that fails is recorded as an error and the next one still runs)."""
    import torch

    out: dict = {}
    engine = _engine(cfg, model_dir, None, cfg.decode_modes[0])
    try:
        device = engine.device
        t0 = time.perf_counter()
        with torch.inference_mode():  # as the engine loads them during a request: the same kind of tensors
            for comp in C.PIPELINE:
                engine.loader.ensure(comp)
        _sync(device)
        out["load_s"] = time.perf_counter() - t0
        out["resident_bytes"] = engine.loader.resident_bytes()
        out["resident_by_component"] = dict(engine.loader.memory.resident)
        if device.type == "cuda":
            out["allocated_after_load"] = torch.cuda.memory_allocated()
        record("all_resident", out)
        for mode in cfg.decode_modes:
            try:
                engine.decode = mode
                t0 = time.perf_counter()
                warm = _stream(engine, _request(cfg, inputs), cancel_after_audio=cfg.audio_frames > 0)
                warm_s = time.perf_counter() - t0
                log_fn(f"[{mode}] warm-up {warm_s:.1f} s (ttft {warm.get('ttft_s') or 0:.3f} s)")
                report = _stream(engine, _request(cfg, inputs))
            except Exception as exc:  # noqa: BLE001 - the other modes' figures still count
                log.exception("decode mode %s failed", mode)
                record(f"error:orin_{mode}", f"{type(exc).__name__}: {exc}"[:1000])
                continue
            summary = summarize_engine(report, f"orin-omni INT4 all-resident ({mode})")
            summary["weight_bytes"] = out["resident_bytes"]
            summary["warmup_s"] = warm_s
            summary["decoders"] = {f"{kind}{'+compile' if compiled else ''}": {
                "captures": dec.runner.captures, "compile_error": dec.runner.compile_error}
                for (kind, compiled), dec in engine._decoders.items()}
            # TTFT again on short requests (no speech): the measured request's value is one sample.
            ttfts = [_stream(engine, _request(cfg, inputs, max_new_tokens=2, speech=False))["ttft_s"]
                     for _ in range(3)]
            summary.update(_ttft_stats(summary["ttft_s"], ttfts))
            record(f"run:orin_{mode}", summary)
            log_fn(f"[{mode}] ttft {summary['ttft_s']:.3f} s, first audio {summary['first_audio_s'] or 0:.3f} s, "
                   f"thinker {summary['decode_tokens_per_s'] or 0:.1f} tok/s, talker "
                   f"{summary['talker_frames_per_s'] or 0:.1f} frames/s, peak {format_bytes(summary['peak_bytes'] or 0)}, "
                   f"{summary['energy_j'] or 0:.0f} J")
        if device.type == "cuda" and set(cfg.decode_modes) & {"graph", "compiled"}:
            try:
                record("verify", verify_fast_decode(engine, cfg.decode_modes))
            except Exception as exc:  # noqa: BLE001 - a failed check is a finding, not a reason to stop
                record("verify", {"error": f"{type(exc).__name__}: {exc}"[:1000]})
        if device.type == "cuda":
            try:
                prepared = engine._prepare(_request(cfg, inputs)).inputs
                record("verify_prefill", verify_prefill(engine, prompt_inputs=prepared))
            except Exception as exc:  # noqa: BLE001 - a failed check is a finding, not a reason to stop
                record("verify_prefill", {"error": f"{type(exc).__name__}: {exc}"[:1000]})
        if cfg.profile and device.type == "cuda":
            record("profile", profile_request(engine, cfg, inputs, modes=(cfg.decode_modes[-1],)))
    finally:
        engine.close()
        del engine
        _free(cfg.device)
    return out


def _trace_stages(engine) -> list:
    """Record, at each residency change of the engine, what is resident and the allocator's current and peak
    bytes so far: where in the pipeline the request's peak memory was reached."""
    import torch

    trace: list = []
    stage = engine._stage

    def traced(comps, next_comps=()):
        stage(comps, next_comps)
        if engine.device.type == "cuda":
            trace.append({"stage": list(comps), "resident": list(engine.loader.resident()),
                          "allocated": torch.cuda.memory_allocated(), "peak_so_far": torch.cuda.max_memory_allocated()})

    engine._stage = traced
    return trace


def run_time_sliced(cfg: BenchConfig, model_dir: str, inputs: _Inputs, log_fn, budget: int,
                    prefetch: bool = True) -> dict:
    mode = cfg.decode_modes[-1]
    engine = _engine(cfg, model_dir, budget, mode, prefetch=prefetch)
    try:
        trace = _trace_stages(engine)
        report = _stream(engine, _request(cfg, inputs))
        label = f"orin-omni INT4 time-sliced, budget {format_bytes(budget)} ({mode}{'' if prefetch else ', no prefetch'})"
        summary = summarize_engine(report, label)
        summary["stage_memory"] = trace
        summary["weight_bytes"] = sum(engine.sizes.components[c].runtime_int4_bytes for c in engine.sizes.components)
        summary["budget_bytes"] = budget
        summary["swap_detail"] = report.get("swaps")
        log_fn(f"[time-sliced{'' if prefetch else ', no prefetch'}] ttft {summary['ttft_s']:.3f} s, first audio {summary['first_audio_s'] or 0:.3f} s, "
               f"peak {format_bytes(summary['peak_bytes'] or 0)}, swaps {summary['swap_s']:.2f} s")
        return summary
    finally:
        engine.close()
        del engine
        _free(cfg.device)


# ---------------------------------------------------------------------- checks and profile (CUDA)


def _timed_ms(fn, n: int = 10):
    """(milliseconds per call of `fn` over `n` calls after one untimed call, the last result); the GPU is
    synchronised before and after, not between calls."""
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        y = fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3, y


def _rel(a, b) -> float:
    """Relative error of `a` against `b` (Frobenius norms, in float32)."""
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())


def verify_fast_decode(engine, modes: tuple[str, ...] = ("graph",), steps: int = 6, prefill_rows: int = 467) -> dict:
    """Check orin.fastdecode against the HF modules on the loaded model: (1) the concatenated-experts INT4 MoE
    against Int4Experts.forward on random hidden states; (2) per fast mode (static = no graph, graph, compiled),
    the prefill's last logits on a random prompt and the logits over `steps` forced tokens after it, against
    the HF prefill and step with a dynamic cache, and the prefill's milliseconds at `prefill_rows` tokens; (3) the code predictor's 15 codes and embedding sum against HF generate(), greedy."""
    import torch
    from transformers import DynamicCache

    from .fastdecode import CodePredictor, ThinkerDecoder, fused_moe_int4

    out = {}
    dev = engine.device
    model = engine.model
    with torch.inference_mode():
        lm = model.thinker.model.language_model
        mlp = next(layer.mlp for layer in lm.layers if hasattr(layer.mlp, "gate"))
        gen = torch.Generator(device=dev).manual_seed(1)
        errs = []
        for _ in range(4):
            h = torch.randn((1, lm.config.hidden_size), generator=gen, device=dev).to(torch.bfloat16)
            _, w, idx = mlp.gate(h)
            errs.append(_rel(fused_moe_int4(mlp.experts, h, idx, w), mlp.experts(h, idx, w)))
        out["fused_moe_rel_err"] = max(errs)
        # 61 tokens: the graph prefill pads them to its 64-row bucket
        ids = torch.randint(1000, lm.config.vocab_size - 1000, (1, 61), generator=gen, device=dev)
        forced = ids[0, :steps].tolist()
        ref_cache = DynamicCache(config=lm.config)
        model.thinker.model.rope_deltas = None
        ref = model.thinker.model(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=ref_cache,
                                  use_cache=True)
        ref_prefill = model.thinker.lm_head(ref.last_hidden_state[:, -1]).float()
        embeds, positions, _ = engine._thinker_inputs({"attention_mask": torch.ones_like(ids)}, ids, None, None)
        fast = {}
        for mode, graph, compiled in (("static", False, False), ("graph", True, False), ("compiled", True, True)):
            if mode == "compiled" and mode not in modes:
                continue
            dec = ThinkerDecoder(model, dev, graph=graph, compile=compiled)
            pre = dec.prefill(embeds[0], positions, ids.shape[1] + steps + 24)
            out[f"prefill_{mode}_rel_err"] = _rel(pre.logits.float(), ref_prefill)
            out[f"prefill_{mode}_argmax_agree"] = bool(pre.logits.argmax() == ref_prefill.argmax())
            fast[mode] = [dec.step(t).float().clone() for t in forced]
            if not compiled:  # the prefill at the standard request's length (its graph is never compiled)
                long_ids = torch.randint(1000, lm.config.vocab_size - 1000, (1, prefill_rows), generator=gen,
                                         device=dev)
                e, p, _ = engine._thinker_inputs({"attention_mask": torch.ones_like(long_ids)}, long_ids, None, None)
                out[f"prefill_{mode}_{prefill_rows}_ms"], _ = _timed_ms(
                    lambda d=dec, e=e, p=p: d.prefill(e[0], p, prefill_rows + 8), 3)
            if dec.runner.compile_error:
                out[f"{mode}_compile_error"] = dec.runner.compile_error
            if graph:
                out[f"thinker_{mode}_step"] = _profile_steps(lambda d=dec: d.step(forced[0]), 16)
            dec.release()
        refs = []
        for t in forced:
            o = model.thinker.model(inputs_embeds=lm.embed_tokens(torch.tensor([[t]], device=dev)),
                                    past_key_values=ref_cache, use_cache=True)
            refs.append(model.thinker.lm_head(o.last_hidden_state)[:, -1].float())
        for mode, logits in fast.items():
            out[f"thinker_{mode}_rel_err"] = max(_rel(a, b) for a, b in zip(logits, refs, strict=True))
            out[f"thinker_{mode}_argmax_agree"] = sum(int(a.argmax() == b.argmax()) for a, b in
                                                      zip(logits, refs, strict=True))
        out["thinker_steps"] = steps
        # the code predictor, greedy, on random talker states
        cp = model.talker.code_predictor
        H = model.config.talker_config.text_config.hidden_size
        past = torch.randn((1, 1, H), generator=gen, device=dev).to(torch.bfloat16)
        first = model.talker.get_input_embeddings()(torch.tensor([[5]], device=dev))
        pred = cp.generate(inputs_embeds=torch.cat((past, first), dim=1), max_new_tokens=len(cp.lm_head),
                           output_hidden_states=True, return_dict_in_generate=True, do_sample=False)
        mid = [h[0] for h in pred.hidden_states[1:]]
        last = cp.get_input_embeddings()[-1](pred.sequences[..., -1:])
        ref_sum = torch.cat([first] + mid + [last], dim=1).sum(1, keepdim=True)
        for mode, graph in (("static", False), ("graph", True)):
            predictor = CodePredictor(model, dev, graph=graph)
            codes, emb = predictor.run(past, first)
            out[f"code_predictor_{mode}_codes_agree"] = int((codes.view(-1) == pred.sequences.view(-1)).sum())
            out[f"code_predictor_{mode}_embed_rel_err"] = _rel(emb, ref_sum)
            if graph:
                out[f"code_predictor_{mode}_frame"] = _profile_steps(lambda p=predictor: p.run(past, first), 8)
        t0 = time.perf_counter()
        for _ in range(3):
            cp.generate(inputs_embeds=torch.cat((past, first), dim=1), max_new_tokens=len(cp.lm_head),
                        output_hidden_states=True, return_dict_in_generate=True, do_sample=False)
        torch.cuda.synchronize()
        out["code_predictor_hf_generate_ms"] = (time.perf_counter() - t0) / 3 * 1e3
        out["code_predictor_codes"] = int(pred.sequences.numel())
    return out


def verify_prefill(engine, rows: int = 467, prompt_inputs: dict | None = None) -> dict:
    """The prefill's INT4 paths on the loaded model (orin.int4): one thinker MoE layer's experts and its q_proj
    over `rows` random rows, the grouped (Triton) / dense path against tinygemm per expert (the decode path),
    relative error and milliseconds of each; with `prompt_inputs` (a prepared request's tensors), the audio
    and vision encoders' milliseconds."""
    import torch

    from . import int4

    out = {"rows": rows}
    dev = engine.device
    lm = engine.model.thinker.model.language_model
    layer = next(layer for layer in lm.layers if hasattr(layer.mlp, "gate"))
    gen = torch.Generator(device=dev).manual_seed(2)
    saved = (int4.GROUPED_MIN_ROWS_PER_EXPERT, int4.LINEAR_DEQUANT_MIN_ROWS)
    with torch.inference_mode():
        h = torch.randn((rows, lm.config.hidden_size), generator=gen, device=dev).to(torch.bfloat16)
        _, w, idx = layer.mlp.gate(h)
        q = layer.self_attn.q_proj
        try:
            int4.GROUPED_MIN_ROWS_PER_EXPERT, int4.LINEAR_DEQUANT_MIN_ROWS = 10**9, 10**9
            out["moe_per_expert_ms"], ref = _timed_ms(lambda: layer.mlp.experts(h, idx, w))
            out["q_proj_tinygemm_ms"], q_ref = _timed_ms(lambda: q(h))
        finally:
            int4.GROUPED_MIN_ROWS_PER_EXPERT, int4.LINEAR_DEQUANT_MIN_ROWS = saved
        out["moe_grouped_ms"], got = _timed_ms(lambda: layer.mlp.experts(h, idx, w))
        out["moe_grouped_rel_err"] = _rel(got, ref)
        out["q_proj_dense_ms"], q_got = _timed_ms(lambda: q(h))
        out["q_proj_dense_rel_err"] = _rel(q_got, q_ref)
        if prompt_inputs is not None:  # the encoders as the engine calls them, each call synchronised
            tm = engine.model.thinker.model
            x = {k: (v.to(dev) if hasattr(v, "to") else v) for k, v in prompt_inputs.items()}
            out["audio_encoder_ms"], _ = _timed_ms(lambda: tm.get_audio_features(
                x["input_features"].to(engine.dtype), x["feature_attention_mask"], return_dict=True), 5)
            out["vision_encoder_ms"], _ = _timed_ms(lambda: tm.get_image_features(
                x["pixel_values"].to(engine.dtype), x["image_grid_thw"], return_dict=True), 5)
    out["triton_gemm_error"] = int4.fused_gemm.error
    out["triton_dequant_error"] = int4.dequantize_packed.error
    return out


def _profile_steps(step, n: int) -> dict:
    """Median wall time of `step` (which synchronises) and its top kernels under torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in events) or 1.0
    top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:12]
    return {"median_ms": statistics.median(times) * 1e3, "kernels_per_call": sum(e.count for e in events) / 4,
            "device_ms_per_call": total / 4 / 1e3,
            "top": [{"name": e.key[:100], "share": e.self_device_time_total / total, "calls_per_call": e.count / 4,
                     "us_per_call": e.self_device_time_total / 4} for e in top]}


def profile_request(engine, cfg: BenchConfig, inputs: _Inputs, modes: tuple[str, ...], tokens: int = 24,
                    frames: int = 12) -> dict:
    """Kernel-level profile of a short request in each of `modes`: top CUDA kernels by device time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    result = {}
    for mode in modes:
        engine.decode = mode
        req = _request(cfg, inputs, max_new_tokens=tokens, max_audio_frames=frames)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:  # kernels only: CPU events cost minutes here
            rep = _stream(engine, req)
        torch.cuda.synchronize()
        events = prof.key_averages()
        rows = []
        total = sum(e.self_device_time_total for e in events) or 1.0
        for e in sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:25]:
            if e.self_device_time_total <= 0:
                continue
            rows.append({"name": e.key[:120], "device_ms": e.self_device_time_total / 1e3,
                         "share": e.self_device_time_total / total, "calls": e.count})
        result[mode] = {"tokens": tokens, "frames": frames, "wall_s": rep.get("wall_s"),
                        "device_ms_total": total / 1e3, "top": rows,
                        "stages_s": {k: v.get("seconds") for k, v in
                                     ((rep.get("energy") or {}).get("by_stage") or {}).items()}}
    return result


# ---------------------------------------------------------------------- the HF reference


class _Clock:
    """A generate() streamer that only records when each put() arrives (tokens are already on the host)."""

    def __init__(self):
        self.times: list[tuple[float, int]] = []

    def put(self, value) -> None:
        self.times.append((time.perf_counter(), int(value.numel())))

    def end(self) -> None:
        pass

    def generated(self) -> list[float]:
        # The first put is the prompt (or an empty tensor when generate() starts from embeddings).
        return [t for t, _ in self.times[1:]]


def build_hf_model(model_dir: str, device, seed: int):
    """Qwen3OmniMoeForConditionalGeneration at the checkpoint's config, random weights, BF16 on CUDA (fp32 on
    CPU). transformers leaves the talker's experts uninitialised and its routers at zero: drawn here."""
    import torch
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from .modelcfg import load_config

    config = load_config(model_dir)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3OmniMoeForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(previous)
    model.eval()
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    fixed = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            bad = name.startswith("talker.") and name.endswith(("experts.gate_up_proj", "experts.down_proj",
                                                                "mlp.gate.weight"))
            if bad or not bool(torch.isfinite(p).all()):
                p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32).mul_(0.02))
                fixed.append(name)
    return model, dtype, fixed


def run_hf(cfg: BenchConfig, model_dir: str, inputs: _Inputs, log_fn) -> dict:
    import torch

    from .power import PowerConfig, PowerMeter
    from .tiny import build_processor

    device = torch.device("cuda" if cfg.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    model, dtype, fixed = build_hf_model(model_dir, device, cfg.seed)
    _sync(device)
    out = {"label": "HF transformers BF16 generate()" if dtype == torch.bfloat16 else "HF transformers fp32",
           "build_s": time.perf_counter() - t0, "initialised": len(fixed)}
    out["weight_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    processor = build_processor(model_dir)
    meter = PowerMeter.from_config(PowerConfig(backend=cfg.power_backend)).start()
    speech = cfg.audio_frames > 0

    def prepare():
        text = processor.apply_chat_template(
            [{"role": m["role"], "content": [{"type": p["type"], **({"text": p["text"]} if p["type"] == "text"
                                                                    else {})} for p in m["content"]]}
             for m in inputs.messages], add_generation_prompt=True, tokenize=False)
        batch = processor(text=[text], images=inputs.images or None,
                          audio=[inputs.audio] if inputs.audio is not None else None, return_tensors="pt",
                          padding=True)
        return {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device)) for k, v in batch.items()}

    def generate(tokens: int, frames: int, thinker_clock=None, talker_clock=None):
        batch = prepare()
        kwargs = dict(return_audio=speech, speaker=cfg.speaker, thinker_max_new_tokens=tokens,
                      thinker_min_new_tokens=tokens, thinker_do_sample=False)
        if speech:
            kwargs.update(talker_max_new_tokens=frames, talker_min_new_tokens=frames)
        if thinker_clock is not None:
            kwargs["thinker_streamer"] = thinker_clock
        if talker_clock is not None and speech:
            kwargs["talker_streamer"] = talker_clock
        result = model.generate(**batch, **kwargs)
        _sync(device)
        return batch, result

    def measured() -> dict:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        thinker_clock, talker_clock = _Clock(), _Clock()
        with meter.measure("hf") as measurement:
            t0 = time.perf_counter()
            batch, result = generate(cfg.text_tokens, cfg.audio_frames, thinker_clock, talker_clock)
            t_end = time.perf_counter()
        energy = measurement.report.to_json()
        text_times, talk_times = thinker_clock.generated(), talker_clock.generated()
        sequences = result[0] if speech else result
        audio = result[1] if speech else None
        rate = ((len(text_times) - 1) / (text_times[-1] - text_times[0])) if len(text_times) > 1 else None
        return {
            "prompt_tokens": int(batch["input_ids"].shape[1]),
            "completion_tokens": int(sequences.shape[1] - batch["input_ids"].shape[1]),
            "talker_frames": len(talk_times),
            "audio_samples": int(audio.numel()) if audio is not None else 0,
            "peak_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
            "ttft_s": (text_times[0] - t0) if text_times else None,
            "first_audio_s": (t_end - t0) if speech else None,  # generate() returns the audio at the very end
            "decode_tokens_per_s": rate,
            "decode_e2e_tokens_per_s": rate,
            "talker_frames_per_s": ((len(talk_times) - 1) / (talk_times[-1] - talk_times[0]))
            if len(talk_times) > 1 else None,
            "talker_start_s": (talk_times[0] - t0) if talk_times else None,
            "total_s": t_end - t0,
            "energy_j": energy.get("joules"),
            "energy_mean_w": energy.get("mean_w"),
            "energy_backend": energy.get("backend"),
            "swap_s": 0.0,
        }

    try:
        with torch.inference_mode():
            t0 = time.perf_counter()
            generate(8, 4)
            out["warmup_s"] = time.perf_counter() - t0
            # Best of `repeats`: the reference is launch-bound, so host noise slows it; the faster run keeps
            # every comparison with it conservative. Each run's figures are kept.
            attempts = [measured() for _ in range(max(1, cfg.hf_repeats))]
            ttfts = []
            for _ in range(3):  # TTFT again on short text-only generations, as for the engine
                clock = _Clock()
                t0 = time.perf_counter()
                model.generate(**prepare(), return_audio=False, thinker_max_new_tokens=2, thinker_min_new_tokens=2,
                               thinker_do_sample=False, thinker_streamer=clock)
                ttfts.append(clock.generated()[0] - t0)
        best = min(attempts, key=lambda a: a["total_s"])
        out.update(best)
        out["attempts"] = attempts
        out.update(_ttft_stats(out["ttft_s"], ttfts))
        log_fn(f"[hf] ttft {out['ttft_s'] or 0:.3f} s, audio at {out['first_audio_s'] or 0:.1f} s, thinker "
               f"{out['decode_tokens_per_s'] or 0:.1f} tok/s, peak {format_bytes(out['peak_bytes'] or 0)}, "
               f"{out['energy_j'] or 0:.0f} J (best of {len(attempts)}: "
               + ", ".join(f"{a['total_s']:.1f} s" for a in attempts) + ")")
    finally:
        meter.stop()
        model = None  # the last reference: ~66 GiB go back before anything else runs
        _free(device)
    return out


# ---------------------------------------------------------------------- Orin projection


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
    from .layout import QuantSpec, find_targets, target_runtime_bytes
    from .plan import meta_model

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
    from .modelcfg import load_config

    config = load_config(model_dir)
    th = config.thinker_config.text_config
    act = active_bytes(config)
    ctx = prompt_tokens + text_tokens // 2
    kv_read = th.num_hidden_layers * 2 * th.num_key_value_heads * th.head_dim * 2 * ctx
    token_bytes = act["thinker_text"] + kv_read
    frame_bytes = act["talker"] + act["code_predictor_per_frame"]
    bw = ORIN["bandwidth"] * ORIN["efficiency_bw"]
    flops = ORIN["fp16_tensor_flops"] * ORIN["efficiency_flops"]
    # Prefill: 2 FLOPs per active weight per token; all experts are touched by a few hundred tokens.
    from .layout import QuantSpec
    from .plan import size_model

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


# ---------------------------------------------------------------------- the whole benchmark


@dataclass
class BenchResult:
    meta: dict
    runs: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"meta": self.meta, "runs": self.runs, "targets": evaluate_targets(self.runs), **self.extra,
                "errors": self.errors}


def _ttft_stats(first: float | None, repeats: list[float]) -> dict:
    """TTFT samples of one side: the standard request's and the short requests' (same prompt). Their median is
    what the target compares: one request's TTFT moves by tens of ms with the host (HF's: 0.10-0.24 s)."""
    samples = ([first] if first is not None else []) + list(repeats)
    return {"ttft_repeats_s": list(repeats), "ttft_repeat_min_s": min(repeats) if repeats else None,
            "ttft_median_s": statistics.median(samples) if samples else None}


def best_run(runs: dict) -> dict:
    """The fastest all-resident orin-omni run (thinker tokens/s): the figures the targets are judged on."""
    resident = [r for k, r in runs.items() if k.startswith("orin_") and "time_sliced" not in k]
    return max(resident, key=lambda r: r.get("decode_tokens_per_s") or 0.0, default={})


def evaluate_targets(runs: dict) -> list[dict]:
    best = best_run(runs)
    slices = [r for k, r in runs.items() if "time_sliced" in k and r.get("peak_bytes")]
    sliced = min(slices, key=lambda r: r["peak_bytes"], default={})  # the budget setting that meets it, if any
    hf = runs.get("hf_bf16") or {}

    def ratio(a, b):
        return (a / b) if a is not None and b else None

    values = {
        "int4_weight_bytes": best.get("weight_bytes"),
        "peak_all_resident": best.get("peak_bytes"),
        "peak_time_sliced": sliced.get("peak_bytes"),
        "decode_tokens_per_s": best.get("decode_tokens_per_s"),
        "decode_speedup_vs_hf": ratio(best.get("decode_tokens_per_s"), hf.get("decode_tokens_per_s")),
        "ttft_vs_hf": ratio(best.get("ttft_median_s"), hf.get("ttft_median_s")),
        "first_audio_s": best.get("first_audio_s"),
        "energy_vs_hf": ratio(best.get("energy_j"), hf.get("energy_j")),
    }
    out = []
    for key, (op, limit, text) in TARGETS.items():
        v = values[key]
        ok = None if v is None else (v <= limit if op == "<=" else v >= limit)
        out.append({"target": key, "text": text, "value": v, "limit": limit, "met": ok})
    return out


def _meta(cfg: BenchConfig) -> dict:
    import torch
    import transformers

    meta = {"config": asdict(cfg), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "host": platform.node()}
    if torch.cuda.is_available() and cfg.device in ("auto", "cuda"):
        props = torch.cuda.get_device_properties(0)
        meta["gpu"] = {"name": props.name, "memory_bytes": props.total_memory,
                       "multiprocessors": props.multi_processor_count}
    return meta


def _write(result: BenchResult, path: str | None) -> None:
    if path:
        from .fsutil import atomic_write_text

        atomic_write_text(Path(path), json.dumps(result.to_json(), indent=2, default=str))


def run_bench(cfg: BenchConfig, log_fn: Callable[[str], None] = lambda m: None) -> BenchResult:
    """The whole benchmark; each part's failure is recorded (errors) and the rest still runs. The JSON is
    rewritten after every part, so a run cut short keeps what it measured."""
    if cfg.synthetic == (cfg.model_dir is not None):
        raise UsageError("give either --synthetic (with --config) or --model-dir")
    if cfg.synthetic and not cfg.config:
        raise UsageError("--synthetic needs --config (a Qwen3-Omni config.json, or 'tiny')")
    for mode in cfg.decode_modes:
        from .engine import DECODE_MODES

        if mode not in DECODE_MODES:
            raise UsageError(f"--decode {mode!r}: use {', '.join(DECODE_MODES)}")
    result = BenchResult(meta=_meta(cfg))
    t_start = time.perf_counter()
    model_dir = cfg.model_dir
    if cfg.synthetic:
        from .synthetic import SyntheticConfig, write_synthetic_checkpoint

        t0 = time.perf_counter()
        out = Path(cfg.workdir) / "checkpoint"
        write_synthetic_checkpoint(SyntheticConfig(config=cfg.config, out=str(out), device=cfg.device,
                                                   seed=cfg.seed, force=True), log=log_fn)
        result.extra["synthetic_write_s"] = time.perf_counter() - t0
        model_dir = str(out)
        os.sync()  # write-back of 20 GB of dirty pages would otherwise steal CPU from the first measurements
        log_fn(f"synthetic checkpoint in {result.extra['synthetic_write_s']:.1f} s: {out}")
    from .manifest import read_manifest

    manifest = read_manifest(model_dir)
    result.extra["checkpoint"] = {"dir": model_dir, "int4_payload_bytes": sum(
        s.int4_bytes for s in manifest.segments.values()), "file_bytes": sum(
        s.total_bytes for s in manifest.segments.values())}
    inputs = make_inputs(cfg)

    def part(name: str, fn):
        t0 = time.perf_counter()
        try:
            value = fn()
        except Exception as exc:  # noqa: BLE001 - one part failing must not lose the others' figures
            log.exception("bench part %s failed", name)
            result.errors[name] = f"{type(exc).__name__}: {exc}"
            log_fn(f"{name} FAILED: {type(exc).__name__}: {exc}")
            value = None
        result.extra.setdefault("part_s", {})[name] = time.perf_counter() - t0
        _write(result, cfg.json_out)
        return value

    # The reference first: its figures are what the targets compare with, and its run time is known.
    if not cfg.skip_hf:
        hf = part("hf", lambda: run_hf(cfg, model_dir, inputs, log_fn))
        if hf:
            result.runs["hf_bf16"] = hf
    def record(key: str, value) -> None:
        if key.startswith("run:"):
            result.runs[key[4:]] = value
        elif key.startswith("error:"):
            result.errors[key[6:]] = value
        else:
            result.extra[key] = value
        _write(result, cfg.json_out)

    part("all_resident", lambda: run_all_resident(cfg, model_dir, inputs, log_fn, record))
    if not cfg.skip_sliced and cfg.budget_sliced:
        for i, budget in enumerate(cfg.budget_sliced):
            key = "orin_time_sliced" if i == 0 else f"orin_time_sliced_{i + 1}"
            sliced = part(key, lambda b=budget: run_time_sliced(cfg, model_dir, inputs, log_fn, b))
            if sliced:
                result.runs[key] = sliced
    any_run = next(iter(result.runs.values()), {})
    best = best_run(result.runs)
    proj = part("orin_projection", lambda: orin_projection(
        model_dir, any_run.get("prompt_tokens") or 0, cfg.text_tokens, cfg.audio_frames, best))
    if proj:
        result.extra["orin_projection"] = proj
    result.extra["bench_s"] = time.perf_counter() - t_start
    _write(result, cfg.json_out)
    return result


# ---------------------------------------------------------------------- the table


_ROWS = (
    ("weight bytes", "weight_bytes", "bytes"),
    ("peak GPU memory", "peak_bytes", "bytes"),
    ("time to first text token", "ttft_s", "s"),
    ("TTFT, short requests (min of 3)", "ttft_repeat_min_s", "s"),
    ("TTFT, median of all 4", "ttft_median_s", "s"),
    ("time to first audio packet", "first_audio_s", "s"),
    ("thinker decode tokens/s", "decode_tokens_per_s", "rate"),
    ("decode tokens/s incl. talker", "decode_e2e_tokens_per_s", "rate"),
    ("talker frames/s", "talker_frames_per_s", "rate"),
    ("energy per request (J)", "energy_j", "j"),
    ("swap seconds", "swap_s", "s"),
    ("prompt / text / frames", None, "counts"),
)


def _cell(run: dict, key: str | None, kind: str) -> str:
    if kind == "counts":
        return f"{run.get('prompt_tokens')}/{run.get('completion_tokens')}/{run.get('talker_frames')}"
    value = run.get(key)
    if value is None:
        return "-"
    if kind == "bytes":
        return f"{value / GiB:.2f} GiB"
    if kind == "s":
        return f"{value:.3f} s" if value < 10 else f"{value:.1f} s"
    if kind == "rate":
        return f"{value:.1f}"
    return f"{value:.0f}"


def render_table(result: BenchResult | dict, markdown: bool = False) -> str:
    data = result.to_json() if isinstance(result, BenchResult) else result
    runs = data["runs"]
    order = [k for k in ("orin_eager", "orin_static", "orin_graph", "orin_compiled") if k in runs]
    order += sorted(k for k in runs if "time_sliced" in k) + [k for k in ("hf_bf16",) if k in runs]
    heads = ["metric"] + [runs[k].get("label", k) for k in order]
    rows = [[name] + [_cell(runs[k], key, kind) for k in order] for name, key, kind in _ROWS]
    lines = []
    if markdown:
        lines.append("| " + " | ".join(heads) + " |")
        lines.append("|" + "---|" * len(heads))
        lines += ["| " + " | ".join(r) + " |" for r in rows]
    else:
        widths = [max(len(r[i]) for r in [heads] + rows) for i in range(len(heads))]
        for r in [heads] + rows:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    lines.append("")
    for t in data["targets"]:
        mark = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        v = t["value"]
        shown = "-" if v is None else (f"{v / GiB:.2f} GiB" if "bytes" in t["target"] or "peak" in t["target"]
                                       else f"{v:.3f}")
        lines.append(f"target {t['text']}: {shown} -> {mark}")
    for name, err in data.get("errors", {}).items():
        lines.append(f"error in {name}: {err}")
    return "\n".join(lines)


__all__ = ["BenchConfig", "BenchResult", "make_inputs", "orin_projection", "render_table", "run_bench",
           "summarize_engine"]
