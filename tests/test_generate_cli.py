"""`orin-omni generate` as a person and as a machine sees it: the answer then a summary, speech only where it
goes, a terminal safe from the answer's control characters, --json as one line."""

from __future__ import annotations

import json

from click.testing import CliRunner

from orin.cli import cli
from orin.generate import for_terminal, render_summary

BASE = ["--max-new-tokens", "4", "--device", "cpu", "--power-backend", "none"]


def _run(quantized_dir, *args):
    res = CliRunner().invoke(cli, ["generate", quantized_dir, "--text", "hi", *BASE, *args])
    assert res.exit_code == 0, res.output + res.stderr
    return res


def test_answer_on_stdout_summary_on_stderr_and_no_speech_by_default(quantized_dir):
    res = _run(quantized_dir)
    summary = res.stderr
    assert "TTFT" in summary and "tokens/s" in summary and "peak" in summary and "prompt tokens" in summary
    assert "energy: not measured" in summary
    # Without --out-wav no speech is made: nothing was generated and thrown away, and the user is told how to get it.
    assert "speech: none (pass --out-wav FILE" in summary
    assert "TTFT" not in res.stdout and res.stdout.endswith("\n")


def test_speech_made_but_not_saved_says_so(quantized_dir):
    res = _run(quantized_dir, "--speech", "--max-audio-frames", "4")
    assert "generated but not saved; pass --out-wav FILE" in res.stderr


def test_speech_written_names_the_file(quantized_dir, tmp_path):
    wav = tmp_path / "answer.wav"
    res = _run(quantized_dir, "--out-wav", str(wav), "--max-audio-frames", "4")
    assert f"written to {wav}" in res.stderr and wav.stat().st_size > 44


def test_json_is_one_line_and_alone_on_stdout(quantized_dir):
    res = _run(quantized_dir, "--json")
    assert res.stdout.count("\n") == 1 and res.stdout.endswith("}\n")
    report = json.loads(res.stdout)
    assert report["wav"] is None and report["talker_frames"] == 0 and len(report["token_ids"]) >= 1


def test_no_speech_with_out_wav_is_refused(quantized_dir, tmp_path):
    res = CliRunner().invoke(cli, ["generate", quantized_dir, "--text", "hi", "--no-speech", "--out-wav",
                                   str(tmp_path / "a.wav"), *BASE])
    assert res.exit_code != 0 and "--out-wav needs speech" in res.output


def test_control_characters_are_escaped_for_a_terminal_only():
    assert for_terminal("a\x07b\x1b[31mc\rd\x7f\x9b\ttab\nline é 😀") == "a\\x07b\\x1b[31mc\\x0dd\\x7f\\x9b\ttab\nline é 😀"
    assert for_terminal("lone \ud800 surrogate") == "lone \ufffd surrogate"
    assert for_terminal("zero\u200dwidth joiner") == "zero\u200dwidth joiner"  # emoji sequences need it


class _Stream:
    def __init__(self, tty: bool):
        self.tty, self.written = tty, []

    def isatty(self) -> bool:
        return self.tty

    def write(self, text: str) -> None:
        self.written.append(text)

    def flush(self) -> None:
        pass


def test_the_answer_on_a_terminal_has_its_control_characters_escaped(monkeypatch):
    """A random model's bytes (a bell, an escape sequence) never reach the terminal raw; a pipe gets them as they are."""
    from orin.contract import Done, TextDelta
    from orin.generate import GenerateConfig, run_generate
    from orin.runtime import engine as engine_module
    from orin.runtime.engine import EngineConfig

    report = _report()

    class Engine:
        def __init__(self, cfg):
            pass

        def stream(self, request):
            yield TextDelta("ding\x07 \x1b[2J", (1, 2))
            yield TextDelta("done\n", (3,))
            yield Done(report)

        def close(self):
            pass

    monkeypatch.setattr(engine_module, "Engine", Engine)
    cfg = GenerateConfig(engine=EngineConfig(model_dir="unused", device="cpu"), text="hi")
    for tty, answer in ((True, "ding\\x07 \\x1b[2Jdone\n\n"), (False, "ding\x07 \x1b[2Jdone\n\n")):
        out, err = _Stream(tty), _Stream(False)
        run_generate(cfg, out=out, err=err)
        assert "".join(out.written) == answer
    out = _Stream(True)
    run_generate(GenerateConfig(engine=cfg.engine, text="hi", as_json=True), out=out, err=_Stream(False))
    assert json.loads("".join(out.written))["text"] == report.text  # --json carries the text as JSON escapes it


def _report(**overrides):
    from orin.contract import Report
    from orin.power.energy import Energy, EnergyReport

    energy = EnergyReport("request", "ina3221", ("ina3221",), Energy(12.5, 25.0, 30.0, 0.5, covered_seconds=0.5,
                                                                    samples=5))
    fields = dict(text="ding\x07", prompt_tokens=9, completion_tokens=3, token_ids=(1, 2, 3), ttft_s=0.1,
                  first_audio_s=0.3, tokens_per_s=20.0, total_s=1.0, talker_frames=25, talker_s=0.2,
                  audio_seconds=2.0, peak_bytes=3 << 30, budget_bytes=24 << 30, device="cuda:0", schedule=(),
                  streaming_speech=True, swaps=(), resident_after=(), energy=energy, cancelled=False,
                  finish_reason="length")
    return Report(**{**fields, **overrides})


def test_summary_with_energy_and_budget():
    text = render_summary(_report(text="abc"), "/tmp/a.wav")
    assert "3.00 GiB of a 24.00 GiB budget" in text and "12.5 J, mean 25.0 W (ina3221)" in text
    assert "speech: 2.00 s (25 codec frames" in text and "/tmp/a.wav" in text


def test_packed_cache_option_reaches_the_loader(quantized_dir, tmp_path):
    """`--packed-cache DIR`: the thinker's INT4 layers are written there on this first load (the tests' default,
    set in conftest, is off; the command line wins over the environment)."""
    res = _run(quantized_dir, "--packed-cache", str(tmp_path / "copies"))
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in (tmp_path / "copies").iterdir())[:1] == ["thinker_text.0.safetensors"]
