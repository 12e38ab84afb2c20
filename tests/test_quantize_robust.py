"""One bad calibration conversation never sinks a quantize run: conversations the processor cannot encode, or
that transformers' generate() fails on because the thinker or the talker replies with nothing, are skipped with a
warning naming them and listed in report.json; the run fails clearly only when too few are left. And the long
passes report progress on stderr, keeping stdout for --json."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from orin.cli import cli
from quantize.calibration import builtin_conversations, to_samples
from quantize.pipeline import QuantConfig, render_result, run_quantize
from quantize.progress import Progress
from quantize.report import load_report
from quantize.skips import Skips, TooFewConversations, UnusableConversation
from quantize.speech_capture import SpeechSettings, generate_speech, keep_results

SPEECH = SpeechSettings(reply_tokens=3, speech_frames=4, min_speech_frames=0)
SHORT = {"samples": 6, "reply_tokens": 3, "speech_frames": 4, "min_speech_frames": 0, "device": "cpu",
         "progress": False}


# ---------------------------------------------------------------------- progress


def test_progress_without_a_terminal_prints_a_line_every_ten_percent():
    stream, now = io.StringIO(), [0.0]
    progress = Progress(enabled=False, stream=stream, clock=lambda: now[0])
    for _ in progress.track(range(24), desc="thinker pass"):
        now[0] += 10.0  # each item takes 10 s
    lines = stream.getvalue().splitlines()
    assert [int(line.split("%")[0].split()[-1]) for line in lines] == [4, 12, 20, 33, 41, 50, 62, 70, 83, 91, 100]
    # no estimate from the first item alone (it pays for warm-up); then the pace from the items after it
    assert lines[0] == "thinker pass:   4% (1/24), 0:10 elapsed"
    assert lines[1] == "thinker pass:  12% (3/24), 0:30 elapsed, about 3:30 left"
    assert lines[5] == "thinker pass:  50% (12/24), 2:00 elapsed, about 2:00 left"
    assert lines[-1] == "thinker pass: 100% (24/24) in 4:00"

    stream.seek(0)
    stream.truncate()
    with progress.bar(3, "speech pass") as bar:
        bar.update(1)
        bar.grow(1)  # a skipped conversation is replaced by another
        for _ in range(3):
            bar.update(1)
    assert stream.getvalue().splitlines()[-1].startswith("speech pass: 100% (4/4) in ")
    stream.seek(0)
    stream.truncate()
    with progress.bar(5, "layer 0", leave=False) as bar:  # inner bars only show on a terminal
        bar.update(5)
    assert stream.getvalue() == ""


def test_progress_on_a_terminal_is_a_bar_with_the_time_left():
    stream, now = io.StringIO(), [0.0]
    progress = Progress(enabled=True, stream=stream, clock=lambda: now[0])
    for _ in progress.track(list("abcde"), desc="thinker pass", unit="conversation"):
        now[0] += 30.0
    out = stream.getvalue()
    assert "thinker pass" in out and "5/5" in out and "conversation" in out
    # the same estimate as the plain lines: 3 of 5 done, the two after the first at 30 s each, two to go
    assert "about 1:00 left" in out and "<" not in out


def test_the_time_left_holds_steady_after_a_slow_first_item():
    from quantize.progress import TimeLeft

    left, now, estimates = TimeLeft(initial=0, start=0.0), 0.0, []
    for done in range(1, 21):
        now += 600.0 if done == 1 else 60.0  # the first layer reads its weights cold: ten times slower
        estimates.append(left.seconds(done, 20, now))
    assert estimates[:2] == [None, None] and estimates[-1] is None  # too little known; then nothing left
    # every estimate names the same finish time, where the first item's pace would have shrunk it step by step
    finishes = {round(600.0 + 60.0 * (i - 1) + s) for i, s in enumerate(estimates, 1) if s is not None}
    assert finishes == {600 + 60 * 19}


# ---------------------------------------------------------------------- empty replies in the speech pass


def _load(model_dir):
    from transformers import Qwen3OmniMoeForConditionalGeneration

    from quantize.hf_config import load_config

    return Qwen3OmniMoeForConditionalGeneration.from_pretrained(str(model_dir), config=load_config(model_dir),
                                                                dtype=torch.bfloat16).eval()


def _edit_weights(model_dir: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    weights = load_file(str(path))
    edit(weights)
    save_file(weights, str(path), metadata={"format": "pt"})


def _first_token(model, sample, part: str) -> int:
    """The first token the thinker (part="thinker") or the talker generates for `sample`."""
    results: list = []
    with keep_results(getattr(model, part), results):
        generate_speech(model, sample, SPEECH, decode_audio=False)
    seq = results[0].sequences[0]
    return int(seq[sample.prompt_inputs["input_ids"].shape[1]] if part == "thinker" else seq[0])


def _samples(n: int):
    from devtools.tiny import build_processor

    return {s.name: s for s in to_samples(build_processor(), builtin_conversations(n), torch.device("cpu"),
                                          Skips(print))}


@pytest.fixture(scope="module")
def silent_variant(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model, edited so that for builtin:2 the thinker ends its reply at once (im_end's lm_head row
    outscores the token it would say first) and for builtin:5 (the held-out one of six) the talker emits its
    codec EOS at the first step."""
    from devtools.tiny import TOKEN_IDS

    out = tmp_path_factory.mktemp("silent") / "model"
    shutil.copytree(tiny_model_dir, out)
    samples = _samples(6)
    with torch.no_grad():
        first = _first_token(_load(out), samples["builtin:2"], "thinker")
        _edit_weights(out, lambda w: w["thinker.lm_head.weight"][TOKEN_IDS["<|im_end|>"]].copy_(
            1.05 * w["thinker.lm_head.weight"][first]))
        model = _load(out)
        first = _first_token(model, samples["builtin:5"], "talker")
    eos = model.config.talker_config.codec_eos_token_id
    _edit_weights(out, lambda w: w["talker.codec_head.weight"][eos].copy_(1.05 * w["talker.codec_head.weight"][first]))
    return out


def test_generate_crashes_on_empty_replies(silent_variant):
    """The failures quantize must survive are transformers' own: generate(return_audio=True) raises on them."""
    model = _load(silent_variant)
    failed = {}
    for name, sample in _samples(6).items():
        try:
            generate_speech(model, sample, SPEECH, decode_audio=False)
        except UnusableConversation as exc:
            failed[name] = (str(exc), exc.__cause__)
    assert set(failed) == {"builtin:2", "builtin:5"}
    reason, cause = failed["builtin:5"]
    assert reason == "the talker spoke no frame (its codec EOS came first)"
    assert isinstance(cause, RuntimeError) and "stack expects a non-empty TensorList" in str(cause)
    reason, cause = failed["builtin:2"]
    assert reason == "the thinker's reply is empty (it ended at once)"
    assert isinstance(cause, RuntimeError)


def test_quantize_skips_empty_replies_and_replaces_the_held_out_one(silent_variant, tmp_path, capsys,
                                                                    single_torch_thread):
    out = tmp_path / "q"
    m = run_quantize(QuantConfig(model=str(silent_variant), out=str(out), segments=("talker_vision",), **SHORT))
    assert m.finished == ("talker_vision",)
    err = capsys.readouterr().err
    assert ("warning: skipping calibration conversation builtin:5 (speech pass): the talker spoke no frame (its "
            "codec EOS came first)") in err
    assert ("warning: skipping calibration conversation builtin:2 (speech pass): the thinker's reply is empty (it "
            "ended at once)") in err
    assert "note: holding out builtin:4 for the report in place of builtin:5" in err
    seg = load_report(out)["segments"]["talker_vision"]
    calib = seg["calibration"]
    assert calib["skipped"] == [
        {"origin": "builtin:5", "pass": "speech", "reason": "the talker spoke no frame (its codec EOS came first)"},
        {"origin": "builtin:2", "pass": "speech", "reason": "the thinker's reply is empty (it ended at once)"}]
    assert calib["skipped_counts"] == {"encode": 0, "thinker": 0, "speech": 2}
    assert calib["heldout_names"] == ["builtin:5"] and calib["conversations"] == 5
    # The thinker pass (the vision encoder) used the planned split; the speech pass held out a stand-in.
    assert calib["passes"]["thinker"] == {"conversations": 5, "heldout": 1, "heldout_names": ["builtin:5"],
                                          "skipped": 0}
    assert calib["passes"]["speech"] == {"conversations": 3, "heldout": 1, "heldout_names": ["builtin:4"],
                                         "skipped": 2}
    assert seg["metrics"]["codec_positions"] > 0 and seg["metrics"]["vision_tokens"] > 0
    assert "skipped calibration conversations: 2" in render_result(str(out), m)


def test_quantize_fails_clearly_when_the_talker_never_speaks(tiny_model_dir, tmp_path, capsys,
                                                           single_torch_thread):
    """A talker whose codec EOS always wins: every speech-pass conversation is empty."""
    model_dir = tmp_path / "mute"
    shutil.copytree(tiny_model_dir, model_dir)
    eos = _load(model_dir).config.talker_config.codec_eos_token_id

    def mute(w):
        # Dimension 0 of every codec embedding dominates the talker's hidden states, and only EOS reads it.
        w["talker.model.codec_embedding.weight"][:, 0] = 100.0
        w["talker.codec_head.weight"].zero_()
        w["talker.codec_head.weight"][eos, 0] = 10.0
    _edit_weights(model_dir, mute)
    with pytest.raises(TooFewConversations) as err:
        run_quantize(QuantConfig(model=str(model_dir), out=str(tmp_path / "q"), segments=("talker_vision",), **SHORT))
    message = str(err.value)
    assert "the built-in calibration set: 0 calibration conversation(s) held out for the report in the speech pass" \
        in message
    assert "1 needed" in message and "the talker spoke no frame" in message and "--calib" in message
    assert "warning: skipping calibration conversation builtin:5 (speech pass)" in capsys.readouterr().err


# ---------------------------------------------------------------------- conversations that cannot be encoded


def _calib_with_unencodable_lines(tmp_path: Path) -> Path:
    """A JSONL whose line 2 has a 600x2 banner (the processor refuses aspect ratios over 200) and line 4 ten
    samples of audio (too short for the feature extractor): both load, neither encodes."""
    from PIL import Image

    from orin.inputs.media import write_wav

    Image.new("RGB", (600, 2), (200, 30, 30)).save(tmp_path / "banner.png")
    write_wav(tmp_path / "click.wav", torch.full((10,), 0.1).numpy(), sr=16000)
    text = [{"messages": [{"role": "user", "content": f"Question {i}?"},
                          {"role": "assistant", "content": f"Answer {i}."}]} for i in range(4)]
    lines = [text[0],
             {"messages": [{"role": "user", "content": [{"type": "image", "path": "banner.png"},
                                                        {"type": "text", "text": "What is this?"}]}]},
             text[1],
             {"messages": [{"role": "user", "content": [{"type": "audio", "path": "click.wav"},
                                                        {"type": "text", "text": "What is this?"}]}]},
             text[2], text[3]]
    path = tmp_path / "calib.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def test_cli_skips_unencodable_conversations_and_keeps_stdout_for_json(tiny_model_dir, tmp_path,
                                                                       single_torch_thread):
    calib = _calib_with_unencodable_lines(tmp_path)
    out = tmp_path / "q"
    result = CliRunner().invoke(cli, ["quantize", tiny_model_dir, "--out", str(out), "--segments", "thinker",
                                      "--calib", str(calib), "--samples", "8", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)  # nothing but the summary on stdout
    assert summary["finished"] == ["thinker"]
    run = summary["run"]  # the run's figures: its memory plan, wall time per stage, memory peaks
    assert run["memory_plan"]["activations"] == "device" and run["memory_plan"]["max_gpu_memory"] is None
    assert {"load", "calibration_forward", "hessians", "solves", "metrics", "writing"} <= set(run["stages"])
    assert abs(sum(s["seconds"] for s in run["stages"].values()) - run["wall_seconds"]) < 0.5
    assert run["peak_host_rss_bytes"] >= max(s["peak_host_rss_bytes"] for s in run["stages"].values()) > 0
    assert load_report(out)["run"] == run
    err = result.stderr
    assert f"warning: skipping calibration conversation {calib}:2 (cannot be encoded): the processor cannot " \
           "encode it (ValueError: absolute aspect ratio must be smaller than 200" in err
    assert f"warning: skipping calibration conversation {calib}:4 (cannot be encoded)" in err
    assert "thinker pass: 100% (4/4) in " in err and "GPTQ thinker/thinker_text: 100% (2/2) in " in err
    calibration = load_report(out)["segments"]["thinker"]["calibration"]
    assert [(s["origin"], s["pass"]) for s in calibration["skipped"]] == [(f"{calib}:2", "encode"),
                                                                          (f"{calib}:4", "encode")]
    assert calibration["skipped_counts"] == {"encode": 2, "thinker": 0, "speech": 0}
    assert calibration["conversations"] == 3 and calibration["heldout"] == 1


def test_too_few_encodable_conversations_fail_before_out_is_written(tiny_model_dir, tmp_path):
    calib = _calib_with_unencodable_lines(tmp_path)
    lines = calib.read_text().splitlines()
    calib.write_text("\n".join([lines[0], lines[1], lines[3]]) + "\n")  # one usable conversation of three
    result = CliRunner().invoke(cli, ["quantize", tiny_model_dir, "--out", str(tmp_path / "q"), "--segments",
                                      "thinker", "--calib", str(calib), "--device", "cpu"])
    assert result.exit_code == 1
    message = result.stderr.strip().splitlines()[-1]
    assert f"{calib}: 0 calibration conversation(s) that the processor can encode, 2 needed" in message
    assert f"2 were skipped (first: {calib}:2" in message and "add more or other conversations to --calib" in message
    assert not (tmp_path / "q" / "manifest.json").exists()
