"""The HF transformers reference of `orin-omni bench`: Qwen3OmniMoeForConditionalGeneration at the checkpoint's
config with random weights (BF16 on CUDA), the standard request through its own `generate(return_audio=True)`,
lengths forced as on the engine side (thinker/talker min_new_tokens), times taken from its streamers.

The video cases run on the same model after the standard request: transformers' own processor has no video
processor here, so their tensors are orin.inputs.Processor's (the layout tests/test_video_model.py checks against
transformers'), floating ones in the model's dtype except video_second_per_grid, and generate() gets
use_audio_in_video=True. The encoders' time comes from forward hooks on the vision and audio towers (synchronised:
the request is on one stream anyway)."""

from __future__ import annotations

import time
from collections.abc import Callable

from orin.units import format_bytes

from .bench_config import BenchConfig, BenchInputs, VideoCase, free, sync
from .bench_report import ttft_stats


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

    from quantize.hf_config import load_config

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


class _EncoderClock:
    """Forward hooks on the thinker's vision and audio towers: each call's (tower, input rows, start, end), the
    device synchronised at both ends."""

    def __init__(self, thinker, device):
        self.calls: list[tuple[str, int, float, float]] = []
        self._device = device
        self._handles = []
        for name in ("visual", "audio_tower"):
            # transformers 5 keeps them on the thinker's inner model; older versions on the thinker itself
            tower = getattr(getattr(thinker, "model", None), name, None) or getattr(thinker, name, None)
            if tower is not None:
                self._handles.append(tower.register_forward_pre_hook(self._pre))
                self._handles.append(tower.register_forward_hook(lambda m, a, o, n=name: self._post(n, a)))
        self._start = None

    def _pre(self, module, args) -> None:
        sync(self._device)
        self._start = time.perf_counter()

    def _post(self, name: str, args) -> None:
        sync(self._device)
        rows = int(args[0].shape[0]) if args and hasattr(args[0], "shape") else 0
        self.calls.append((name, rows, self._start, time.perf_counter()))

    def close(self) -> None:
        for h in self._handles:
            h.remove()

    def figures(self, video_rows: int) -> dict:
        """encode_s: the towers' seconds; video_encode_s: the vision call over the video's patches; encoded_at:
        when the last one ended (perf_counter)."""
        return {"encode_s": sum(e - s for _, _, s, e in self.calls) if self.calls else None,
                "video_encode_s": next((e - s for n, r, s, e in self.calls if n == "visual" and r == video_rows),
                                       None),
                "encoded_at": max((e for *_, e in self.calls), default=None)}


def run_hf(cfg: BenchConfig, model_dir: str, inputs: BenchInputs, log_fn: Callable[[str], None],
           videos: tuple[VideoCase, ...] = (), record: Callable[[str, object], None] | None = None) -> dict:
    """The standard request through HF generate(return_audio=True): a warm-up, `cfg.hf_repeats` measured runs
    (the fastest reported, each one kept), then TTFT on 3 short text-only generations. Then each video case,
    once (the model is warm), passed to `record("video:CASE", figures)`; with cfg.video_only, only the warm-up
    and the video cases run."""
    import torch

    from orin.power.meter import PowerConfig, PowerMeter
    from quantize.hf_processor import build_processor

    device = torch.device("cuda" if cfg.engine.device in ("auto", "cuda") and torch.cuda.is_available() else "cpu")
    t0 = time.perf_counter()
    model, dtype, fixed = build_hf_model(model_dir, device, cfg.seed)
    sync(device)
    out = {"label": "HF transformers BF16 generate()" if dtype == torch.bfloat16 else "HF transformers fp32",
           "build_s": time.perf_counter() - t0, "initialised": len(fixed)}
    out["weight_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    processor = build_processor(model_dir)
    if videos:
        from orin.inputs.processor import Processor

        proc = Processor.from_dir(model_dir)
    meter = PowerMeter.from_config(PowerConfig(backend=cfg.engine.power_backend)).start()
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
        kwargs = dict(return_audio=speech, speaker=cfg.voice, thinker_max_new_tokens=tokens,
                      thinker_min_new_tokens=tokens, thinker_do_sample=False)
        if speech:
            kwargs.update(talker_max_new_tokens=frames, talker_min_new_tokens=frames)
        if thinker_clock is not None:
            kwargs["thinker_streamer"] = thinker_clock
        if talker_clock is not None and speech:
            kwargs["talker_streamer"] = talker_clock
        result = model.generate(**batch, **kwargs)
        sync(device)
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

    def video_case(case: VideoCase) -> dict:
        """One video case: the processor's tensors (on the device, as the engine makes them), generate() with the
        soundtrack interleaved; peak reset before it."""
        def tensors() -> dict:
            raw = proc.prepare(case.inputs.messages, device=device if device.type == "cuda" else None,
                               video_dtype=dtype)
            return {k: (v.to(device, dtype) if v.is_floating_point() and k != "video_second_per_grid" else v.to(device))
                    for k, v in raw.items()}

        # warm-up, as the engine's: the prompt's shapes through the processor, the encoders and the prefill
        t0 = time.perf_counter()
        model.generate(**tensors(), use_audio_in_video=True, return_audio=False, thinker_max_new_tokens=2,
                       thinker_min_new_tokens=2, thinker_do_sample=False)
        sync(device)
        warm_s = time.perf_counter() - t0
        free(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        thinker_clock, talker_clock = _Clock(), _Clock()
        encoders = _EncoderClock(model.thinker, device)
        try:
            with meter.measure("hf_video") as measurement:
                t0 = time.perf_counter()
                batch = tensors()
                sync(device)
                prepared = time.perf_counter()
                kwargs = dict(return_audio=speech, speaker=cfg.voice, use_audio_in_video=True,
                              thinker_max_new_tokens=cfg.text_tokens, thinker_min_new_tokens=cfg.text_tokens,
                              thinker_do_sample=False, thinker_streamer=thinker_clock)
                if speech:
                    kwargs.update(talker_max_new_tokens=cfg.audio_frames, talker_min_new_tokens=cfg.audio_frames,
                                  talker_streamer=talker_clock)
                result = model.generate(**batch, **kwargs)
                sync(device)
                t_end = time.perf_counter()
        finally:
            encoders.close()
        energy = measurement.report.to_json()
        ids = batch["input_ids"]
        text_times, talk_times = thinker_clock.generated(), talker_clock.generated()
        sequences = result[0] if speech else result
        enc = encoders.figures(int(batch["pixel_values_videos"].shape[0]) if "pixel_values_videos" in batch else -1)
        first = text_times[0] if text_times else None
        figures = {
            "label": out["label"],
            "prompt_tokens": int(ids.shape[1]),
            "video_tokens": int((ids == proc.video_token_id).sum()),
            "audio_tokens": int((ids == proc.audio_token_id).sum()),
            "image_tokens": int((ids == proc.image_token_id).sum()),
            "video_grids": batch["video_grid_thw"].tolist() if "video_grid_thw" in batch else [],
            "completion_tokens": int(sequences.shape[1] - ids.shape[1]),
            "talker_frames": len(talk_times),
            "peak_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
            "prepare_s": prepared - t0,
            "encode_s": enc["encode_s"],
            "video_encode_s": enc["video_encode_s"],
            # from the last encoder's end to the first token: merge, positions and the thinker's prefill
            "prefill_s": (first - enc["encoded_at"]) if first is not None and enc["encoded_at"] else None,
            "ttft_s": (first - t0) if first is not None else None,
            "first_audio_s": (t_end - t0) if speech else None,  # generate() returns the audio at the very end
            "decode_tokens_per_s": ((len(text_times) - 1) / (text_times[-1] - text_times[0]))
            if len(text_times) > 1 else None,
            "talker_start_s": (talk_times[0] - t0) if talk_times else None,
            "total_s": t_end - t0,
            "energy_j": energy.get("joules"),
            "energy_mean_w": energy.get("mean_w"),
            "energy_backend": energy.get("backend"),
            "warmup_s": warm_s,
        }
        if device.type == "cuda" and cfg.profile:  # the encoders and the prefill, to set beside the engine's
            from .bench_kernels import profile_once

            try:
                figures["profile_to_first_token"] = profile_once(lambda: model.generate(
                    **tensors(), use_audio_in_video=True, return_audio=False, thinker_max_new_tokens=1,
                    thinker_min_new_tokens=1, thinker_do_sample=False))
            except Exception as exc:  # noqa: BLE001 - the case's figures above still count
                figures["profile_to_first_token"] = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
        log_fn(f"[{case.name} hf] {figures['prompt_tokens']} prompt tokens ({figures['video_tokens']} video, "
               f"{figures['audio_tokens']} audio): encode {figures['encode_s'] or 0:.2f} s, ttft "
               f"{figures['ttft_s'] or 0:.2f} s, audio at {figures['first_audio_s'] or 0:.1f} s, peak "
               f"{format_bytes(figures['peak_bytes'] or 0)}, {figures['energy_j'] or 0:.0f} J")
        return figures

    try:
        with torch.inference_mode():
            t0 = time.perf_counter()
            generate(8, 4)
            out["warmup_s"] = time.perf_counter() - t0
            if cfg.video_only:
                out["video_only"] = True
                _videos(videos, video_case, record, device)
                return out
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
            out.update(ttft_stats(out["ttft_s"], ttfts))
            log_fn(f"[hf] ttft {out['ttft_s'] or 0:.3f} s, audio at {out['first_audio_s'] or 0:.1f} s, thinker "
                   f"{out['decode_tokens_per_s'] or 0:.1f} tok/s, peak {format_bytes(out['peak_bytes'] or 0)}, "
                   f"{out['energy_j'] or 0:.0f} J (best of {len(attempts)}: "
                   + ", ".join(f"{a['total_s']:.1f} s" for a in attempts) + ")")
            if record is not None:
                record("run:hf_bf16", out)  # the standard request's figures are kept if a video case fails hard
            _videos(videos, video_case, record, device)
    finally:
        meter.stop()
        model = None  # the last reference: ~66 GiB go back before anything else runs
        free(device)
    return out


def _videos(videos, video_case, record, device) -> None:
    """Each video case's figures, or its error, to `record`: one case failing (out of memory at a long prompt)
    does not lose the others."""
    import logging

    for case in videos:
        try:
            value = video_case(case)
        except Exception as exc:  # noqa: BLE001 - recorded, the next case still runs
            logging.getLogger("devtools.bench").exception("HF video case %s failed", case.name)
            value = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
        finally:
            free(device)
        if record is not None:
            record(f"video:{case.name}", value)


__all__ = ["build_hf_model", "run_hf"]
