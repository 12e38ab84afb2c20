"""The developer's `orin-omni` commands: tiny-model, bench and synthetic-bf16. Their code is devtools/, beside
orin/ in a checkout and not in the wheel; orin.cli adds these commands to its group."""

from __future__ import annotations

import sys

import click

from .cli_options import POWER_BACKENDS, SIZE, packed_cache_option
from .errors import UsageError


def _devtools(module: str) -> None:
    """Make the developer tools' `module` importable: devtools/ sits beside orin/ in a checkout and is not in the
    wheel, so from an installed wheel these commands say they need a checkout."""
    import importlib.util
    from pathlib import Path

    import orin

    root = str(Path(orin.__file__).resolve().parent.parent)
    if Path(root, "devtools").is_dir() and root not in sys.path:
        sys.path.insert(0, root)
    try:
        found = importlib.util.find_spec(f"devtools.{module}") is not None
    except ModuleNotFoundError:  # no devtools package at all
        found = False
    if not found:
        raise UsageError("this is a developer command (tiny-model, synthetic-bf16, bench): the developer tools do "
                         "not ship in the wheel; run it from a checkout of orin-omni (pip install -e .)")


@click.command("tiny-model")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--seed", type=int, default=0, show_default=True, help="Random seed; same seed, same bytes.")
@click.option("--force", is_flag=True, help="Overwrite an existing checkpoint in OUT.")
def tiny_model_cmd(out, seed, force):
    """Write a tiny random Qwen3-Omni checkpoint (config, weights, tokenizer, processor) to OUT, offline."""
    _devtools("tiny")
    from devtools.tiny import TinyModelConfig, write_tiny_model

    path = write_tiny_model(TinyModelConfig(out=out, seed=seed, force=force))
    click.echo(f"tiny Qwen3-Omni written to {path}")


@click.command("bench")
@click.option("--config", "config", default=None,
              help="With --synthetic: a Qwen3-Omni config.json (or checkpoint dir), or 'tiny'.")
@click.option("--model-dir", type=click.Path(file_okay=False), default=None,
              help="Benchmark an existing quantized checkpoint instead of a synthetic one.")
@click.option("--synthetic", is_flag=True, help="Write a random-weight INT4 checkpoint at the config's dimensions.")
@click.option("--workdir", type=click.Path(file_okay=False), default="build/bench", show_default=True,
              help="Where the synthetic checkpoint is written.")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option("--audio-seconds", type=click.FloatRange(min=0), default=30.0, show_default=True)
@click.option("--images", type=click.IntRange(min=0), default=1, show_default=True)
@click.option("--image-size", type=click.IntRange(min=32), default=224, show_default=True)
@click.option("--text-tokens", type=click.IntRange(min=2), default=256, show_default=True,
              help="Text tokens generated (EOS ignored).")
@click.option("--audio-frames", type=click.IntRange(min=0), default=100, show_default=True,
              help="Codec frames generated (0: no speech).")
@click.option("--budget-sliced", type=SIZE, multiple=True, default=["18GiB"], show_default=True,
              help="Memory budget of a time-sliced run (repeatable: one run per budget).")
@click.option("--skip-hf", is_flag=True, help="Do not run the HF transformers BF16 reference.")
@click.option("--skip-sliced", is_flag=True, help="Do not run the time-sliced engine.")
@click.option("--compile", "compile_settings", default="off,on", show_default=True,
              help="torch.compile of the decoder layers, one all-resident engine per setting, comma-separated "
                   "(off: run orin_graph, on: run orin_compiled); the last one also runs time-sliced.")
@click.option("--profile/--no-profile", default=True, show_default=True, help="torch.profiler pass (CUDA only).")
@click.option("--power-backend", type=click.Choice(POWER_BACKENDS), default="auto", show_default=True)
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None,
              help="Write the full results here (rewritten after each part).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--hf-repeats", type=click.IntRange(min=1), default=2, show_default=True,
              help="Measured HF generate() runs; the fastest is reported.")
@packed_cache_option
@click.option("--sliced-unpacked", type=SIZE, multiple=True, default=[],
              help="Run this budget time-sliced again with --packed-cache off (repeatable): the copies' worth.")
@click.option("--video-seconds", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Also run the video cases: one image + a clip this long with its soundtrack (0: none).")
@click.option("--video-fps", type=click.FloatRange(min=0, min_open=True), multiple=True, default=[2.0],
              show_default=True, help="Sampling rate of a video case (repeatable: one case per rate).")
@click.option("--video-size", type=click.IntRange(min=32), default=448, show_default=True,
              help="Side of the video cases' square frames (a multiple of 32).")
@click.option("--realtime-question", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Also run the Realtime API case: this spoken question (an audio file) streamed to the server's "
                   "WebSocket in real time; voice-to-voice latency and barge-in.")
@click.option("--memory", type=click.Choice(["device", "orin", "fallback"]), default="device", show_default=True,
              help="The time-sliced runs' weight arenas: this device's profile, the Orin profile's bounds on "
                   "reservations and allocations, or every reservation refused (each unit on the fallback).")
@click.option("--video-only", "--cases-only", "video_only", is_flag=True,
              help="Only the video and realtime cases: no standard request, time-sliced runs, kernel timings or "
                   "profile.")
def bench_cmd(config, model_dir, synthetic, workdir, device, audio_seconds, images, image_size, text_tokens,
              audio_frames, budget_sliced, skip_hf, skip_sliced, compile_settings, profile, power_backend, json_out,
              seed, hf_repeats, packed_cache, sliced_unpacked, video_seconds, video_fps, video_size, realtime_question,
              memory, video_only):
    """The standard request (audio + image -> text + speech) through orin-omni (all-resident, time-sliced)
    and HF transformers BF16, side by side: memory, TTFT, first audio, tokens/s, energy, swaps. With
    --video-seconds, the video cases too (image + video with its soundtrack -> text + speech)."""
    _devtools("bench")
    from devtools.bench import BenchConfig, parse_compile, render_table, run_bench

    from .runtime.engine import EngineConfig

    # model_dir "": none given (--synthetic writes one)
    engine = EngineConfig(model_dir=model_dir or "", device=device, power_backend=power_backend)
    result = run_bench(BenchConfig(
        engine=engine, config=config, synthetic=synthetic, workdir=workdir,
        audio_seconds=audio_seconds, images=images, image_size=image_size, text_tokens=text_tokens,
        audio_frames=audio_frames, budget_sliced=tuple(budget_sliced), skip_hf=skip_hf, skip_sliced=skip_sliced,
        compile=parse_compile(compile_settings), profile=profile,
        json_out=json_out, seed=seed, hf_repeats=hf_repeats, packed_cache=packed_cache,
        sliced_unpacked=tuple(sliced_unpacked), video_seconds=video_seconds, video_fps=tuple(video_fps),
        video_size=video_size, video_only=video_only, realtime_question=realtime_question, memory=memory,
    ), log_fn=lambda m: click.echo(m, err=True))
    click.echo(render_table(result))


@click.command("synthetic-bf16")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--config", "config", required=True, help="A Qwen3-Omni config.json (or checkpoint dir), or 'tiny'.")
@click.option("--thinker-layers", type=click.IntRange(min=1), default=None,
              help="Thinker text layers to write (default: the config's; each is 1.2 GiB at the real widths).")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True,
              help="Where the random values are drawn (cuda is ~100x faster at real widths).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--shard-size", type=SIZE, default="4GiB", show_default=True, help="Largest safetensors shard.")
@click.option("--force", is_flag=True, help="Overwrite an existing checkpoint in OUT.")
def synthetic_bf16_cmd(out, config, thinker_layers, device, seed, shard_size, force):
    """Write a random-weight BF16 Qwen3-Omni in the published checkpoint's layout to OUT: the input to benchmark
    `orin-omni quantize` at real widths with fewer thinker layers than the real 48."""
    _devtools("synthetic_bf16")
    from devtools.synthetic_bf16 import SyntheticBF16Config, write_synthetic_bf16

    path = write_synthetic_bf16(SyntheticBF16Config(config=config, out=out, thinker_layers=thinker_layers,
                                                    device=device, seed=seed, shard_bytes=shard_size, force=force),
                                log=lambda m: click.echo(m, err=True))
    click.echo(f"synthetic BF16 Qwen3-Omni written to {path}")
