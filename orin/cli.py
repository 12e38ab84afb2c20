"""The `orin-omni` command line. Commands only parse and call: each builds one frozen config dataclass and
hands it to a library function. Heavy imports (torch, transformers) happen inside the commands that need them,
so `orin-omni --help` and `install-service` stay instant. OrinError becomes a Click error here and nowhere else."""

from __future__ import annotations

import json
import sys

import click

from . import __version__
from .errors import OrinError, UsageError


class _OrinGroup(click.Group):
    """Converts the OrinError family into Click errors in one place."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except UsageError as exc:
            raise click.UsageError(str(exc), ctx=ctx) from exc
        except OrinError as exc:
            err = click.ClickException(str(exc))
            err.exit_code = exc.exit_code
            raise err from exc


class _Size(click.ParamType):
    """A byte size such as 24GiB; bad input is a usage error (exit 2) naming the value."""

    name = "size"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        from .units import parse_bytes

        try:
            return parse_bytes(value)
        except UsageError as exc:
            self.fail(str(exc), param, ctx)


SIZE = _Size()


def _csv(value: str | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    return tuple(part.strip() for part in value.split(",") if part.strip())


@click.group(cls=_OrinGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="orin-omni")
def cli():
    """Qwen3-Omni-30B-A3B on a Jetson AGX Orin: quantize, plan, serve, install, smoke-test."""


@cli.command("tiny-model")
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--seed", type=int, default=0, show_default=True, help="Random seed; same seed, same bytes.")
@click.option("--force", is_flag=True, help="Overwrite an existing checkpoint in OUT.")
def tiny_model_cmd(out, seed, force):
    """Write a tiny random Qwen3-Omni checkpoint (config, weights, tokenizer, processor) to OUT, offline."""
    from .tiny import TinyModelConfig, write_tiny_model

    path = write_tiny_model(TinyModelConfig(out=out, seed=seed, force=force))
    click.echo(f"tiny Qwen3-Omni written to {path}")


@cli.command("plan")
@click.argument("model", type=click.Path())
@click.option("--budget", type=SIZE, default="24GiB", show_default=True, help="GPU memory budget.")
@click.option("--audio-seconds", type=click.FloatRange(min=0), default=30.0, show_default=True)
@click.option("--images", type=click.IntRange(min=0), default=1, show_default=True)
@click.option("--image-size", type=click.IntRange(min=1), default=224, show_default=True)
@click.option("--video-seconds", type=click.FloatRange(min=0), default=0.0, show_default=True)
@click.option("--text-tokens", type=click.IntRange(min=1), default=256, show_default=True, help="Text tokens to generate.")
@click.option("--speech/--no-speech", default=True, show_default=True)
@click.option("--group-size", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--segments", "segments", default=None,
              help="Segment split, e.g. 'thinker=audio_encoder+thinker_text;talker_vision=vision_encoder+talker+code_predictor+code2wav'.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan_cmd(model, budget, audio_seconds, images, image_size, video_seconds, text_tokens, speech, group_size,
             segments, as_json):
    """Size MODEL (checkpoint dir or config.json) per component and segment, and say whether a request fits."""
    from .plan import PlanConfig, make_plan, render_plan

    cfg = PlanConfig(
        model=model, budget=budget, audio_seconds=audio_seconds, images=images, image_size=image_size,
        video_seconds=video_seconds, text_tokens=text_tokens, speech=speech, group_size=group_size,
        segments=segments,
    )
    result = make_plan(cfg)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
    else:
        click.echo(render_plan(result))


def main(argv: list[str] | None = None) -> None:
    cli.main(args=argv, prog_name="orin-omni")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
