"""Kernel-level timings of the loaded model on CUDA, for the benchmark's JSON: milliseconds and profiles only.
Whether these paths compute the right thing is tests/test_device_kernels.py's job (`device` marker).

- `decode_timings`: the thinker prefill at the standard request's length, eager and replayed from its CUDA graph
  (StaticDecoder.prefill's `graph`), a decode step and a code-predictor frame under torch.profiler, and HF's own
  code predictor generate() for comparison; with the engine's torch.compile setting.
- `prefill_timings`: one thinker MoE layer's experts and its q_proj over a prompt's worth of rows on each INT4
  route (grouped against tinygemm per expert: the MoE backend the layer runs on against one built from a profile
  that sends every row count to tinygemm; dense against tinygemm: the projection's buffers loaded again under
  profiles whose dense route starts at 0 rows or never), and the encoders as the engine calls them.
- `profile_steps` / `profile_once` / `profile_events`: torch.profiler summaries (top kernels by device time).
"""

from __future__ import annotations

import statistics
import time


def timed_ms(fn, n: int = 10):
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


def profile_events(prof, calls: int, top: int) -> dict:
    """Device time of a torch.profiler run over `calls` calls: per call, and its `top` kernels by device time."""
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in events) or 1.0
    ranked = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:top]
    return {"kernels_per_call": sum(e.count for e in events) / calls, "device_ms_per_call": total / calls / 1e3,
            "top": [{"name": e.key[:100], "share": e.self_device_time_total / total, "calls_per_call": e.count / calls,
                     "us_per_call": e.self_device_time_total / calls} for e in ranked]}


def profile_once(fn, top: int = 30) -> dict:
    """The top kernels of one call of `fn` under torch.profiler (CUDA kernels only), for a long request's
    breakdown (the video cases' prefill): where its device time goes, not how long it takes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return profile_events(prof, 1, top)


def profile_steps(step, n: int, kernels: bool = True) -> dict:
    """Median wall time of `step` (which synchronises) over `n` calls, and (`kernels`) its top kernels under
    torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    if not kernels:
        return {"median_ms": statistics.median(times) * 1e3}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:  # kernels only: CPU events cost minutes here
        for _ in range(4):
            step()
        torch.cuda.synchronize()
    return {"median_ms": statistics.median(times) * 1e3, **profile_events(prof, 4, 12)}


def _random_ids(gen, vocab: int, n: int, device):
    import torch

    return torch.randint(0, vocab, (1, n), generator=gen, device=device)


def decode_timings(engine, prefill_rows: int = 467, steps: int = 16, kernels: bool = True) -> dict:
    """The decoders at the engine's torch.compile setting on its loaded model (thinker, talker and code
    predictor resident): fresh decoders, released afterwards, so the engine's own keep their caches and graphs.
    `kernels`: the steps' top kernels under torch.profiler too. The profiler leaves CUPTI attached for the rest
    of the process (kineto detaches it only when TEARDOWN_CUPTI=1, which torch does not set), and an attached
    CUPTI slows every later launch and graph replay: only the process's last engine is profiled."""
    import torch

    from orin.runtime.decode import CodePredictor, PrefillInputs, StaticDecoder

    dev, model = engine.device, engine.model
    compile = engine.decoders.compile
    out: dict = {"compile": compile, "prefill_rows": prefill_rows}
    gen = torch.Generator(device=dev).manual_seed(1)
    with torch.inference_mode():
        thinker = model.thinker
        lm = thinker.model.language_model
        ids = _random_ids(gen, lm.config.vocab_size, prefill_rows, dev)
        positions = torch.arange(prefill_rows, device=dev).view(1, 1, -1).expand(3, 1, -1)
        embeds = lm.embed_tokens(ids)
        dec = StaticDecoder(lm, thinker.lm_head, dev, engine.profile, compile)
        try:
            # eager: the layer function launched from the host; graph: replayed from the bucket's CUDA graph
            for name, graph in (("eager", False), ("graph", True)):
                out[f"prefill_{name}_ms"], _ = timed_ms(
                    lambda g=graph: dec.prefill(PrefillInputs(embeds[0], positions, prefill_rows + 8 + steps),
                                                graph=g), 3)
            out["prefill_graph_captures"] = dec.prefill_captures
            token = int(ids[0, -1])
            out["thinker_step"] = profile_steps(lambda: dec.step(token), steps, kernels)
            out["thinker_compile_error"] = dec.runner.compile_error
        finally:
            dec.release()
        talker = model.talker
        H = model.config.talker_config.text_config.hidden_size
        past = torch.randn((1, 1, H), generator=gen, device=dev).to(engine.dtype)
        first = talker.model.codec_embedding(torch.tensor([[5]], device=dev))
        predictor = CodePredictor(model, dev, engine.profile, compile)
        try:
            out["code_predictor_frame"] = profile_steps(lambda: predictor.run(past, first), 8, kernels)
            out["code_predictor_compile_error"] = predictor.runner.compile_error
        finally:
            predictor.release()
    return out


def prefill_timings(engine, rows: int = 467, prompt=None) -> dict:
    """The prefill's INT4 routes on one thinker MoE layer of the loaded model over `rows` random rows: its
    experts on the route their backend takes for that many rows against tinygemm per expert (the few-rows route),
    its q_proj dense (dequantize + GEMM) against tinygemm; with `prompt` (a prepared request, orin.inputs.prompt.Prompt)
    the audio and vision encoders as the engine calls them, each call synchronised."""
    import torch

    from orin.int4.linear import Int4Experts, Int4Linear

    out: dict = {"rows": rows}
    dev = engine.device
    lm = engine.model.thinker.model.language_model
    layer = next(layer for layer in lm.layers if hasattr(layer.mlp, "gate"))
    gen = torch.Generator(device=dev).manual_seed(2)
    with torch.inference_mode():
        h = torch.randn((rows, lm.config.hidden_size), generator=gen, device=dev).to(engine.dtype)
        w, idx = layer.mlp.gate(h)
        experts, q = layer.mlp.experts, layer.self_attn.q_proj
        if isinstance(experts, Int4Experts):
            out["moe_backend"] = experts.backend.name
            out["moe_route"] = experts.route_for(h, idx.shape[1])
            per_expert = type(experts.backend)(_with(engine.profile, "moe", grouped_min_rows_per_expert=1 << 62))
            out["moe_per_expert_ms"], _ = timed_ms(lambda: per_expert.prefill(experts, h, idx, w))
            out["moe_grouped_ms"], _ = timed_ms(lambda: experts(h, idx, w))
        if isinstance(q, Int4Linear):
            for route, first_row in (("tinygemm", 1 << 62), ("dense", 0)):
                twin = _linear_twin(q, _with(engine.profile, "prefill", linear_dequant_min_rows=first_row))
                out[f"q_proj_{route}_ms"], _ = timed_ms(lambda twin=twin: twin(h))
        if prompt is not None:
            x = {k: (v.to(dev) if hasattr(v, "to") else v) for k, v in prompt.inputs.items()}
            # eager, then replayed from its CUDA graph (what an all-resident request runs)
            for suffix, graph in (("", False), ("_graph", True)):
                if "input_features" in x:
                    out[f"audio_encoder{suffix}_ms"], _ = timed_ms(
                        lambda g=graph: engine.thinker.encode_audio(x, prompt, graph=g), 5)
                if "pixel_values" in x:
                    out[f"vision_encoder{suffix}_ms"], _ = timed_ms(
                        lambda g=graph: engine.thinker.encode_image(x, prompt, graph=g), 5)
    return out


def _with(profile, group: str, **numbers):
    """`profile` with some numbers of one of its tuning groups replaced."""
    from dataclasses import replace

    return replace(profile, **{group: replace(getattr(profile, group), **numbers)})


def _linear_twin(q, profile):
    """An Int4Linear over q's very buffers, run as `profile` says (its dense route's first row count)."""
    from orin.int4.linear import Int4Linear

    twin = Int4Linear(q.in_features, q.out_features, bias=q.has_bias)
    tensors, meta = q.packed_state()
    return twin.load_packed_(tensors, meta, q.weight_packed.device, profile=profile)


__all__ = ["decode_timings", "prefill_timings", "profile_events", "profile_steps", "timed_ms"]
