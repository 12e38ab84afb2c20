"""The `orin-omni` command line. Commands only parse and call: each builds one frozen config dataclass and
hands it to a library function. Heavy imports (torch, transformers) happen inside the commands that need them,
so `orin-omni --help` and `install-service` stay instant. OrinError becomes a Click error here and nowhere else."""

from __future__ import annotations

import json
import os
import sys

import click

from . import __version__
from .cli_dev import bench_cmd, synthetic_bf16_cmd, tiny_model_cmd
from .cli_options import POWER_BACKENDS, SIZE, packed_cache_option
from .device.profile import PROFILES
from .errors import OrinError, UsageError


class _OrinGroup(click.Group):
    """Converts the OrinError family into Click errors in one place."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except UsageError as exc:
            raise click.UsageError(str(exc), ctx=self._command_context(ctx)) from exc
        except OrinError as exc:
            err = click.ClickException(str(exc))
            err.exit_code = exc.exit_code
            raise err from exc

    def _command_context(self, ctx: click.Context) -> click.Context:
        """A context for the subcommand that raised, so the usage printed above the error is that command's
        (`orin-omni install-service [OPTIONS]`), not the group's. The subcommand's own context is closed by
        the time the error gets here; this one only renders usage and the help hint."""
        name = ctx.invoked_subcommand
        command = self.get_command(ctx, name) if name else None
        return ctx if command is None else click.Context(command, info_name=name, parent=ctx)


def _csv(value: str | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    return tuple(part.strip() for part in value.split(",") if part.strip())


@click.group(cls=_OrinGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="orin-omni")
def cli():
    """Qwen3-Omni-30B-A3B on a Jetson AGX Orin: quantize, plan, serve, install, smoke-test."""


@cli.command("plan")
@click.argument("model", type=click.Path())
@click.option("--budget", type=SIZE, default="24GiB", show_default=True, help="GPU memory budget.")
@click.option("--audio-seconds", type=click.FloatRange(min=0), default=30.0, show_default=True)
@click.option("--images", type=click.IntRange(min=0), default=1, show_default=True)
@click.option("--image-size", type=click.IntRange(min=1), default=224, show_default=True)
@click.option("--video-seconds", type=click.FloatRange(min=0), default=0.0, show_default=True)
@click.option("--video-fps", type=click.FloatRange(min=0, min_open=True, max=60), default=2.0, show_default=True,
              help="Video frames sampled per second.")
@click.option("--video-frame-pixels", type=click.IntRange(min=32 * 32), default=448 * 448, show_default=True,
              help="Cap on a sampled frame's area.")
@click.option("--video-audio/--no-video-audio", default=True, show_default=True,
              help="The video's soundtrack interleaved with its frames.")
@click.option("--text-tokens", type=click.IntRange(min=1), default=256, show_default=True, help="Text tokens to generate.")
@click.option("--speech/--no-speech", default=True, show_default=True)
@click.option("--group-size", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--segments", "segments", default=None,
              help="Segment split, e.g. 'thinker=audio_encoder+thinker_text;talker_vision=vision_encoder+talker+code_predictor+code2wav'.")
@click.option("--device-profile", type=click.Choice(["auto", *PROFILES]), default="auto", show_default=True,
              help="The device the plan is for: its tuning numbers size the working memory and the margin. auto: "
                   "this machine's (cpu without CUDA, a Jetson's orin); pass orin to plan for the board from "
                   "another machine.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan_cmd(model, budget, audio_seconds, images, image_size, video_seconds, video_fps, video_frame_pixels,
             video_audio, text_tokens, speech, group_size, segments, device_profile, as_json):
    """Size MODEL (checkpoint dir or config.json) per component and segment, and say whether a request fits."""
    from .memory.plan import PlanConfig, make_plan, render_plan

    cfg = PlanConfig(
        model=model, budget=budget, audio_seconds=audio_seconds, images=images, image_size=image_size,
        video_seconds=video_seconds, video_fps=video_fps, video_frame_pixels=video_frame_pixels,
        video_audio=video_audio, text_tokens=text_tokens, speech=speech, group_size=group_size, segments=segments,
        device_profile=device_profile,
    )
    result = make_plan(cfg)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
    else:
        click.echo(render_plan(result))


@cli.command("power")
@click.option("--backend", type=click.Choice(["auto", "jtop", "ina3221", "nvml", "none"]), default="auto",
              show_default=True, help="Power source; auto tries jtop, ina3221, nvml, then none.")
@click.option("--hz", type=click.FloatRange(min=0, min_open=True, max=1000), default=10.0, show_default=True,
              help="Sampling rate.")
@click.option("--seconds", type=click.FloatRange(min=0, min_open=True, max=3600), default=2.0, show_default=True,
              help="How long to sample.")
@click.option("--sysfs-root", type=click.Path(file_okay=False), default="/sys", show_default=True,
              help="Where the INA3221 monitors are looked up (bus/i2c/devices below it).")
@click.option("--json", "as_json", is_flag=True, help="Print the energy report as JSON.")
def power_cmd(backend, hz, seconds, sysfs_root, as_json):
    """Sample board power for a few seconds and print mean/peak watts and energy per rail."""
    from .power.meter import PowerProbeConfig, probe_power, render_report

    report = probe_power(PowerProbeConfig(backend=backend, hz=hz, seconds=seconds, sysfs_root=sysfs_root))
    click.echo(json.dumps(report.to_json(), indent=2) if as_json else render_report(report))


@cli.command("install-service")
@click.option("--model-dir", required=True, type=click.Path(file_okay=False), help="Quantized checkpoint to serve.")
@click.option("--name", default="qwen3-omni", show_default=True, help="Unit name (NAME.service).")
@click.option("--user", default="orin-omni", show_default=True, help="Unprivileged user the server runs as.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on; loopback also fences off outbound IP.")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--budget", type=SIZE, default="24GiB", show_default=True, help="GPU memory budget; MemoryMax= is this plus headroom.")
@click.option("--power-mode", type=click.Choice(["MAXN", "50W", "30W", "15W"], case_sensitive=False), default=None,
              help="nvpmodel mode set before each start (Jetson AGX Orin 64GB).")
@click.option("--jetson-clocks", is_flag=True, help="Run jetson_clocks before each start (Jetson).")
@click.option("--platform", type=click.Choice(["auto", "jetson", "discrete"]), default="auto", show_default=True,
              help="GPU device nodes and groups to allow; auto looks under --root.")
@click.option("--cpu-quota", default="600%", show_default=True, help="CPUQuota= (100% is one core).")
@click.option("--api-key-file", type=click.Path(dir_okay=False), default=None, help="File with the API keys serve accepts.")
@click.option("--max-queue", type=click.IntRange(min=1), default=None, help="Requests serve queues before refusing.")
@click.option("--served-model-name", default=None,
              help="The model name clients pass as `model` in the OpenAI API (default: the checkpoint's).")
@click.option("--root", type=click.Path(file_okay=False), default="/", show_default=True,
              help="Install under this directory; systemctl and user creation only happen when it is /.")
@click.option("--dry-run", is_flag=True,
              help="Print what would be done and the rendered files; write nothing. Exits 1 when the real run "
                   "would be refused for permissions.")
@click.option("--force", is_flag=True, help="Replace a differing unit or environment file (the old one is kept as .bak).")
@click.option("--fix-permissions", is_flag=True,
              help="Open up what keeps --user from reading the model or running Python (chmod -R a+rX on the model "
                   "directory, the missing x on its parents) instead of refusing.")
@click.option("--enable/--no-enable", default=True, show_default=True, help="systemctl enable the unit.")
def install_service_cmd(model_dir, name, user, host, port, budget, power_mode, jetson_clocks, platform, cpu_quota,
                        api_key_file, max_queue, served_model_name, root, dry_run, force, fix_permissions, enable):
    """Install NAME.service running `orin-omni serve` under a hardened systemd sandbox.

    Before writing anything it checks that --user can read every file of --model-dir and run this Python (every
    parent directory searchable, symlinks followed), and refuses with the chmod commands that fix it unless
    --fix-permissions. A user that does not exist yet is checked as the system user install-service creates
    (its own new group, so only the 'other' permission bits count); under a --root other than / such a user is
    created on the target, so its problems are printed as a warning instead."""
    from .service.install import InstallConfig, install_service

    cfg = InstallConfig(
        model_dir=model_dir, name=name, user=user, host=host, port=port, budget=budget, power_mode=power_mode,
        jetson_clocks=jetson_clocks, platform=platform, cpu_quota=cpu_quota, api_key_file=api_key_file,
        max_queue=max_queue, served_model_name=served_model_name, root=root, dry_run=dry_run, force=force,
        enable=enable, fix_permissions=fix_permissions,
    )
    install_service(cfg, log=click.echo)


@cli.command("uninstall-service")
@click.option("--name", default="qwen3-omni", show_default=True, help="Unit name given to install-service.")
@click.option("--root", type=click.Path(file_okay=False), default="/", show_default=True,
              help="The --root given to install-service.")
@click.option("--dry-run", is_flag=True, help="Print what would be removed; remove nothing.")
def uninstall_service_cmd(name, root, dry_run):
    """Remove exactly the files install-service recorded for NAME (disabling the unit when --root is /)."""
    from .service.uninstall import UninstallConfig, uninstall_service

    uninstall_service(UninstallConfig(name=name, root=root, dry_run=dry_run), log=click.echo)


@cli.command("generate")
@click.argument("model_dir", type=click.Path())
@click.option("--text", default=None, help="The question or instruction.")
@click.option("--image", "images", multiple=True, type=click.Path(), help="PNG/JPEG image (repeatable).")
@click.option("--audio", "audios", multiple=True, type=click.Path(),
              help="WAV/FLAC (MP3 where libsndfile decodes it), any sample rate (repeatable).")
@click.option("--video", "videos", multiple=True, type=click.Path(),
              help="Video file (MP4, MKV, WebM, MOV...; decoded by PyAV's bundled FFmpeg), with its soundtrack "
                   "(repeatable).")
@click.option("--fps", "video_fps", type=float, default=2.0, show_default=True,
              help="Video frames sampled per second (4 to 768 frames a clip).")
@click.option("--video-audio/--no-video-audio", default=True, show_default=True,
              help="Interleave each video's soundtrack with its frames.")
@click.option("--max-video-seconds", type=click.FloatRange(min=0, min_open=True), default=600.0,
              show_default=True, help="Refuse longer videos.")
@click.option("--out-wav", type=click.Path(dir_okay=False), default=None,
              help="Answer with speech too and write it here (24 kHz WAV).")
@click.option("--speech/--no-speech", default=None,
              help="Generate speech (default: only when --out-wav says where it goes).")
@click.option("--budget", type=SIZE, default=None, help="GPU memory budget; components are time-sliced under it.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--max-audio-frames", type=click.IntRange(min=1), default=None,
              help="Cap on codec frames (12.5 per second of speech).")
@click.option("--voice", default="ethan", show_default=True, help="Voice (a speaker name of the model config).")
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="0 = greedy.")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option("--power-backend", type=click.Choice(["auto", "jtop", "ina3221", "nvml", "none"]), default="auto",
              show_default=True)
@click.option("--json", "as_json", is_flag=True,
              help="Print only the request report, as one line of JSON (no answer text).")
@packed_cache_option
def generate_cmd(model_dir, text, images, audios, videos, video_fps, video_audio, max_video_seconds, out_wav, speech,
                 budget, max_new_tokens, max_audio_frames, voice, temperature, device, power_backend, as_json,
                 packed_cache):
    """Run one request on a quantized checkpoint: print the answer, then a summary (TTFT, tokens/s, peak memory,
    energy, where the speech went) on stderr."""
    from .generate import GenerateConfig, run_generate
    from .memory.packed_cache import resolve_dir
    from .runtime.engine import EngineConfig

    engine = EngineConfig(model_dir=model_dir, device=device, budget=budget, power_backend=power_backend,
                          packed_cache=resolve_dir(packed_cache, model_dir))
    run_generate(GenerateConfig(
        engine=engine, text=text, images=tuple(images), audios=tuple(audios), videos=tuple(videos),
        video_fps=video_fps, video_audio=video_audio, max_video_seconds=max_video_seconds, out_wav=out_wav,
        speech=speech, max_new_tokens=max_new_tokens, voice=voice, as_json=as_json, temperature=temperature,
        max_audio_frames=max_audio_frames,
    ))


@cli.command("serve")
@click.option("--model-dir", required=True, type=click.Path(file_okay=False), help="Checkpoint to serve.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="0 picks a free port (logged, and sent to systemd in STATUS=).")
@click.option("--budget", type=SIZE, default=None, help="GPU memory budget; components are time-sliced under it.")
@click.option("--api-key-file", type=click.Path(dir_okay=False), default=None,
              help="File with the accepted API keys, one a line; clients send 'Authorization: Bearer KEY'.")
@click.option("--max-queue", type=click.IntRange(min=0), default=4, show_default=True,
              help="Requests that may wait for the GPU; more get HTTP 429.")
@click.option("--allow-dir", type=click.Path(file_okay=False, exists=True), default=None,
              help="Allow file:// image and video URLs under this directory (default: refused).")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option("--power-backend", type=click.Choice(POWER_BACKENDS), default="auto", show_default=True)
@click.option("--power-hz", type=click.FloatRange(min=0, min_open=True, max=1000), default=10.0, show_default=True)
@click.option("--sysfs-root", type=click.Path(file_okay=False), default="/sys", show_default=True)
@click.option("--verify-checksums/--no-verify-checksums", default=True, show_default=True,
              help="Check every file's sha256 against the manifest before loading.")
@click.option("--warmup/--no-warmup", default=True, show_default=True,
              help="Run one short request before reporting ready.")
@click.option("--max-body", type=SIZE, default="64MiB", show_default=True, help="Largest request body.")
@click.option("--max-audio-seconds", type=click.FloatRange(min=0, min_open=True), default=300.0, show_default=True)
@click.option("--max-image-pixels", type=click.IntRange(min=1), default=32 * 1024 * 1024, show_default=True)
@click.option("--max-video-seconds", type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True)
@click.option("--max-speech-seconds", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Cap on the speech one answer may generate (default: follows the text).")
@click.option("--drain-seconds", type=click.FloatRange(min=0), default=60.0, show_default=True,
              help="On SIGTERM, how long the request in flight may run before it is cancelled.")
@click.option("--served-model-name", default=None,
              help="The model id clients pass as model= (default: the name recorded in the checkpoint's manifest).")
@click.option("--realtime-max-sessions", type=click.IntRange(min=1), default=4, show_default=True,
              help="Realtime API (WebSocket) sessions open at once.")
@click.option("--realtime-busy", type=click.Choice(["wait", "error"]), default="wait", show_default=True,
              help="A Realtime session beyond the limit, or a response while the GPU is busy: wait, or get an error.")
@click.option("--realtime-max-session-seconds", type=click.FloatRange(min=0, min_open=True), default=3600.0,
              show_default=True, help="A Realtime session is closed after this long.")
@click.option("--realtime-max-buffer-seconds", type=click.FloatRange(min=0, min_open=True), default=120.0,
              show_default=True, help="Most uncommitted input audio a Realtime session may hold.")
@click.option("--realtime-max-message", type=SIZE, default="16MiB", show_default=True,
              help="Largest Realtime client event (one WebSocket message).")
@click.option("--realtime-context-tokens", type=click.IntRange(min=256), default=None,
              help="Context a Realtime conversation may fill (prompt and answer; older items are dropped to fit; "
                   "default: the model's).")
@packed_cache_option
def serve_cmd(model_dir, host, port, budget, api_key_file, max_queue, allow_dir, device, power_backend, power_hz,
              sysfs_root, verify_checksums, warmup, max_body, max_audio_seconds, max_image_pixels, max_video_seconds,
              max_speech_seconds, drain_seconds, served_model_name, realtime_max_sessions, realtime_busy,
              realtime_max_session_seconds, realtime_max_buffer_seconds, realtime_max_message,
              realtime_context_tokens, packed_cache):
    """Serve the model over an OpenAI-compatible HTTP API (chat completions with image/audio/video in, speech
    out)."""
    from .memory.packed_cache import resolve_dir
    from .runtime.engine import EngineConfig
    from .serve.app import ServeConfig, serve

    engine = EngineConfig(model_dir=model_dir, device=device, budget=budget, power_backend=power_backend,
                          power_hz=power_hz, sysfs_root=sysfs_root, verify_checksums=verify_checksums,
                          packed_cache=resolve_dir(packed_cache, model_dir))
    serve(ServeConfig(
        engine=engine, host=host, port=port, api_key_file=api_key_file, max_queue=max_queue, allow_dir=allow_dir,
        warmup=warmup, max_body_bytes=max_body, max_audio_seconds=max_audio_seconds,
        max_image_pixels=max_image_pixels, max_video_seconds=max_video_seconds,
        max_speech_seconds=max_speech_seconds, drain_s=drain_seconds, served_model_name=served_model_name,
        realtime_max_sessions=realtime_max_sessions, realtime_busy=realtime_busy,
        realtime_max_session_s=realtime_max_session_seconds, realtime_max_buffer_s=realtime_max_buffer_seconds,
        realtime_max_message_bytes=realtime_max_message, realtime_context_tokens=realtime_context_tokens,
    ), env=os.environ)  # systemd's notify socket and journal: the environment is read here, at the edge


@cli.command("smoke")
@click.option("--url", default=None, help="A running server, e.g. http://127.0.0.1:8000.")
@click.option("--model-dir", type=click.Path(file_okay=False), default=None, help="Run the engine in-process instead.")
@click.option("--budget", type=SIZE, default=None,
              help="GPU memory budget (in-process); also the peak-memory limit unless --max-peak is given.")
@click.option("--max-ttft", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Fail when the time to first token exceeds this many seconds.")
@click.option("--max-peak", type=SIZE, default=None,
              help="Fail when a request's peak memory exceeds this (default: the budget).")
@click.option("--api-key-file", type=click.Path(dir_okay=False), default=None, help="Key for --url.")
@click.option("--voice", default=None, help="Voice for the speech request (default: the model's).")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option("--power-backend", type=click.Choice(POWER_BACKENDS), default="auto", show_default=True)
@click.option("--timeout", "timeout_s", type=click.FloatRange(min=1), default=600.0, show_default=True,
              help="Seconds to wait for each HTTP request.")
@click.option("--video/--no-video", default=True, show_default=True,
              help="Also send a short clip with a soundtrack and check the answer and its prompt tokens.")
@click.option("--voice-endpoints/--no-voice-endpoints", default=True, show_default=True,
              help="With --url: also check /v1/audio/speech, /v1/audio/transcriptions and a /v1/realtime session.")
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
@packed_cache_option
@click.pass_context
def smoke_cmd(ctx, url, model_dir, budget, max_ttft, max_peak, api_key_file, voice, device, power_backend, timeout_s,
              video, voice_endpoints, as_json, packed_cache):
    """Check a server (--url) or the engine (--model-dir) end to end: text, image+audio+text, speech and video
    requests, TTFT, peak memory, WAV output, video prompt tokens, power; with --url also the speech,
    transcription and Realtime endpoints. Exits 1 if any check fails."""
    from .checks.smoke import SmokeConfig, render_table, run_smoke
    from .memory.packed_cache import resolve_dir
    from .runtime.engine import EngineConfig

    engine = None if model_dir is None else EngineConfig(
        model_dir=model_dir, device=device, budget=budget, power_backend=power_backend,
        packed_cache=resolve_dir(packed_cache, model_dir))
    result = run_smoke(SmokeConfig(
        url=url, engine=engine, max_ttft=max_ttft, api_key_file=api_key_file, voice=voice, timeout_s=timeout_s,
        max_peak=max_peak if max_peak is not None else budget,  # --budget is the limit where --max-peak is not
        video=video, voice_endpoints=voice_endpoints,
    ))
    click.echo(json.dumps(result.to_json(), indent=2) if as_json else render_table(result))
    if not result.ok:
        ctx.exit(1)


@cli.command("doctor")
@click.option("--model-dir", type=click.Path(file_okay=False), default=None,
              help="Checkpoint to check (default: the one the installed unit serves).")
@click.option("--user", default=None, help="Service user that must read the model (default: the unit's, else orin-omni).")
@click.option("--name", default="qwen3-omni", show_default=True, help="Unit name given to install-service.")
@click.option("--budget", type=SIZE, default=None,
              help="GPU memory budget the model is sized at (default: the unit's, else 24GiB).")
@click.option("--device", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True,
              help="cuda: a missing GPU is a failure; auto: the GPU checks are skipped without one.")
@click.option("--root", type=click.Path(file_okay=False), default="/", show_default=True,
              help="The --root given to install-service; systemctl is only asked when it is /.")
@click.option("--sysfs-root", type=click.Path(file_okay=False), default="/sys", show_default=True,
              help="Where the INA3221 monitors are looked up.")
@click.option("--proc-root", type=click.Path(file_okay=False), default="/proc", show_default=True,
              help="Where meminfo is read.")
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
@click.pass_context
def doctor_cmd(ctx, model_dir, user, name, budget, device, root, sysfs_root, proc_root, as_json):
    """Check this board for orin-omni: Python, torch, CUDA, the INT4 kernel, Triton, CUDA graphs, power
    backends, nvpmodel, memory and disk, the checkpoint's checksums and permissions, the service. Exits 1 if any
    check fails, printing its fix."""
    from .checks.doctor import DoctorConfig, render_table, run_doctor

    result = run_doctor(DoctorConfig(
        model_dir=model_dir, user=user, name=name, budget=budget, device=device, root=root, sysfs_root=sysfs_root,
        proc_root=proc_root,
    ))
    click.echo(json.dumps(result.to_json(), indent=2) if as_json else render_table(result))
    if not result.ok:
        ctx.exit(1)


@cli.command("quantize")
@click.argument("model_dir", type=click.Path())
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Directory of the quantized checkpoint.")
@click.option("--segments", default=None, help="Segments to quantize, comma-separated (default: all).")
@click.option("--split", default=None,
              help="Segment split, e.g. 'thinker=audio_encoder+thinker_text;talker_vision=vision_encoder+talker+code_predictor+code2wav'.")
@click.option("--bits", type=int, default=4, show_default=True)
@click.option("--group-size", type=int, default=128, show_default=True)
@click.option("--calib", type=click.Path(), default=None,
              help="Calibration conversations: a .jsonl file or a directory (default: a built-in synthetic set).")
@click.option("--samples", type=click.IntRange(min=2), default=128, show_default=True,
              help="Conversations to use (an eighth, 1 to 8, are held out for the report).")
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda or cuda:N.")
@click.option("--quantize-audio-encoder", is_flag=True, help="Also quantize the audio encoder (BF16 by default).")
@click.option("--quantize-code-predictor", is_flag=True, help="Also quantize the code predictor (BF16 by default).")
@click.option("--quantize-code2wav", is_flag=True, help="Also quantize code2wav's pre-transformer (BF16 by default).")
@click.option("--quantize-lm-head", is_flag=True, help="Also quantize the thinker's lm_head (BF16 by default).")
@click.option("--min-expert-tokens", type=click.IntRange(min=0), default=64, show_default=True,
              help="Experts routed fewer calibration tokens than this are 'starved' (see --starved-experts).")
@click.option("--starved-experts", type=click.Choice(["all-tokens", "rtn"]), default="all-tokens", show_default=True,
              help="Calibrate a starved expert on every token of its layer, or round it to nearest.")
@click.option("--speech-samples", type=click.IntRange(min=1), default=32, show_default=True,
              help="Conversations replied to with speech (generate) to calibrate the talker side; held-out ones add.")
@click.option("--reply-tokens", type=click.IntRange(min=1), default=64, show_default=True,
              help="Text tokens the thinker generates per speech-pass reply.")
@click.option("--speech-frames", type=click.IntRange(min=1), default=128, show_default=True,
              help="Codec frames the talker generates at most per reply (12.5 per second of speech).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the built-in calibration set.")
@click.option("--force", is_flag=True, help="Redo finished segments (and start over if the settings changed).")
@click.option("--quantize-vision/--no-quantize-vision", default=True, show_default=True,
              help="INT4 vision blocks; --no-quantize-vision keeps the vision encoder BF16, as vLLM-Omni 0.30 needs.")
@click.option("--sym/--asym", default=True, show_default=True,
              help="Symmetric 4-bit (what vLLM's GPTQ kernels take) or asymmetric; report.json measures the other.")
@click.option("--served-model-name", default=None,
              help="Model id recorded in the manifest, which `serve` answers to (default: qwen3-omni-int<bits>).")
@click.option("--max-gpu-memory", type=SIZE, default="16GiB", show_default=True,
              help="GPU memory the run may use; planned before anything is loaded, enforced on CUDA.")
@click.option("--max-host-memory", type=SIZE, default="24GiB", show_default=True,
              help="Host memory (RSS) the run may use; calibration activations go to disk when it is short.")
@click.option("--activations", type=click.Choice(["auto", "device", "host", "disk"]), default="auto",
              show_default=True, help="Where calibration activations live; auto: as the memory plan decides.")
@click.option("--solver", type=click.Choice(["auto", "gptqmodel", "own"]), default="auto", show_default=True,
              help="GPTQ solver: GPTQModel's, or orin-omni's own (plain torch; for boards GPTQModel does not "
                   "install on); auto: GPTQModel where it imports.")
@click.option("--json", "as_json", is_flag=True,
              help="Print the manifest summary as JSON, with the run's memory plan, time per stage and peaks.")
def quantize_cmd(model_dir, out, segments, split, bits, group_size, calib, samples, device, quantize_audio_encoder,
                 quantize_code_predictor, quantize_code2wav, quantize_lm_head, min_expert_tokens, starved_experts,
                 speech_samples, reply_tokens, speech_frames, seed, force, quantize_vision, sym, served_model_name,
                 max_gpu_memory, max_host_memory, activations, solver, as_json):
    """GPTQ-quantize MODEL_DIR (a Qwen3-Omni checkpoint) to INT4 in bounded memory, layer by layer, resumable."""
    from quantize.pipeline import QuantConfig, quantize_run, render_result

    cfg = QuantConfig(
        model=model_dir, out=out, segments=_csv(segments), split=split, bits=bits, group_size=group_size, calib=calib,
        samples=samples, device=device, quantize_audio_encoder=quantize_audio_encoder,
        quantize_code_predictor=quantize_code_predictor, quantize_code2wav=quantize_code2wav,
        quantize_lm_head=quantize_lm_head, min_expert_tokens=min_expert_tokens, starved_experts=starved_experts,
        speech_samples=speech_samples, reply_tokens=reply_tokens, speech_frames=speech_frames, seed=seed,
        force=force, quantize_vision=quantize_vision, sym=sym, served_model_name=served_model_name,
        max_gpu_memory=max_gpu_memory, max_host_memory=max_host_memory,
        activations=None if activations == "auto" else activations, solver=solver,
    )
    run = quantize_run(cfg)
    summary = {**run.manifest.summary(), "run": run.figures}
    click.echo(json.dumps(summary, indent=2) if as_json else render_result(out, run.manifest))


@cli.command("convert")
@click.argument("model_dir", type=click.Path())
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Directory of the converted checkpoint.")
@click.option("--force", is_flag=True, help="Replace an existing OUT.")
@click.option("--json", "as_json", is_flag=True, help="Print the new manifest's summary as JSON (progress on stderr).")
def convert_cmd(model_dir, out, force, as_json):
    """Rewrite an orin-omni 0.1 checkpoint (one directory per segment) as a standard GPTQ directory that vLLM,
    transformers and orin-omni load, without re-quantizing. MODEL_DIR is left as it is."""
    from .checkpoint.convert import ConvertConfig, convert_checkpoint, convert_summary

    path = convert_checkpoint(ConvertConfig(model_dir=model_dir, out=out, force=force),
                              log=lambda m: click.echo(m, err=as_json))
    click.echo(json.dumps(convert_summary(path), indent=2) if as_json else f"standard GPTQ checkpoint written to {path}")


for _command in (tiny_model_cmd, bench_cmd, synthetic_bf16_cmd):
    cli.add_command(_command)


def main(argv: list[str] | None = None) -> None:
    import logging

    # torchao (pulled in by GPTQModel) logs failed optional CUDA extensions at import, and registers pytree
    # types torch warns about: noise on every command of a CPU install, not something a user can act on.
    for noisy in ("torchao", "torchao.kernel.intmm", "torch.utils._pytree"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    cli.main(args=argv, prog_name="orin-omni")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
