"""`orin-omni quantize` through the CLI: bad input is a clear one-line error with a non-zero exit, before any
finished segment is touched; a rerun on a finished checkpoint skips everything and verifies checksums."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from orin.checkpoint.manifest import read_manifest, remove_segment_entry
from orin.cli import cli
from quantize.pipeline import LOCK_NAME


def _run(*args):
    return CliRunner().invoke(cli, ["quantize", *map(str, args)])


SHARDS = {"thinker": "model-00001-of-00002.safetensors", "talker_vision": "model-00002-of-00002.safetensors"}


def _stat(path: Path) -> tuple[int, int]:
    """A file's identity and last write: unchanged means never rewritten."""
    return path.stat().st_ino, path.stat().st_mtime_ns


def test_missing_model_files(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = _run(empty, "--out", tmp_path / "out")
    assert result.exit_code == 1 and "no config.json" in result.output
    result = _run(tmp_path / "absent", "--out", tmp_path / "out")
    assert result.exit_code == 1 and "not a directory" in result.output


def test_config_without_weights(tiny_model_dir, tmp_path):
    model = tmp_path / "noweights"
    model.mkdir()
    shutil.copy(Path(tiny_model_dir) / "config.json", model)
    result = _run(model, "--out", tmp_path / "out")
    assert result.exit_code == 1 and "no *.safetensors weights" in result.output
    assert not (tmp_path / "out").exists()


def test_not_a_qwen3_omni_checkpoint(tmp_path):
    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    result = _run(model, "--out", tmp_path / "out")
    assert result.exit_code == 1 and "model_type is 'llama'" in result.output


@pytest.mark.parametrize("args, match", [
    (["--segments", "thinker,speech"], "unknown segment 'speech'"),
    (["--split", "thinker=thinker_text"], "leaves out component"),
    (["--group-size", "100"], "--group-size 100 is not supported"),
    (["--group-size", "256"], "does not divide in_features 128"),
    (["--bits", "8"], "--bits 8 is not supported"),
    (["--starved-experts", "drop"], "Invalid value for '--starved-experts'"),
])
def test_bad_options_are_usage_errors(tiny_model_dir, tmp_path, args, match):
    result = _run(tiny_model_dir, "--out", tmp_path / "out", *args)
    assert result.exit_code == 2, result.output
    assert match in result.output
    assert not (tmp_path / "out").exists()


def test_out_that_is_not_a_checkpoint_is_refused(tiny_model_dir, tmp_path):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    result = _run(tiny_model_dir, "--out", out)
    assert result.exit_code == 2 and "is not an orin-omni checkpoint" in result.output
    assert (out / "notes.txt").read_text() == "mine"


@pytest.fixture
def half_done(quantized_dir, tmp_path) -> Path:
    """A copy of the quantized tiny model whose second segment is not finished."""
    out = tmp_path / "half"
    shutil.copytree(quantized_dir, out)
    remove_segment_entry(out, "talker_vision")
    return out


@pytest.mark.parametrize("entry, content, match", [
    ({"type": "image", "path": "missing.png"}, None, "image file not found"),
    ({"type": "audio", "path": "missing.wav"}, None, "audio file not found"),
    ({"type": "image", "path": "broken.png"}, b"\x89PNG\r\n\x1a\nthis is not a PNG body", "corrupt or unreadable PNG"),
    ({"type": "audio", "path": "broken.wav"}, b"hello, not audio at all", "not a supported audio file"),
])
def test_bad_calibration_media_names_the_file_and_leaves_finished_segments(half_done, tiny_model_dir, tmp_path,
                                                                            entry, content, match):
    calib = tmp_path / "calib"
    calib.mkdir()
    if content is not None:
        (calib / entry["path"]).write_bytes(content)
    line = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, entry]}]}
    (calib / "set.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "ok"}]}) + "\n"
                                     + json.dumps(line) + "\n")
    before = _stat(half_done / SHARDS["thinker"])
    manifest_before = (half_done / "manifest.json").read_bytes()
    result = _run(tiny_model_dir, "--out", half_done, "--calib", calib, "--samples", 4)
    assert result.exit_code == 1
    message = result.output.strip().splitlines()[-1]
    assert "set.jsonl:2" in message and entry["path"] in message and match in message
    assert _stat(half_done / SHARDS["thinker"]) == before
    assert (half_done / "manifest.json").read_bytes() == manifest_before
    assert read_manifest(half_done).finished == ("thinker",)


@pytest.mark.parametrize("line, match", [
    ("{not json", "not valid JSON"),
    (json.dumps({"text": "no messages"}), 'expected {"messages": [...]}'),
    (json.dumps({"messages": [{"role": "robot", "content": "x"}]}), "needs a role"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "hologram", "path": "v.mp4"}]}]}),
     "unknown part type 'hologram'"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "video", "path": "v.mp4"}]}]}),
     "video file not found"),
    (json.dumps({"messages": [{"role": "assistant", "content": "no question"}]}), "no user message"),
])
def test_bad_calibration_entries(half_done, tiny_model_dir, tmp_path, line, match):
    calib = tmp_path / "calib.jsonl"
    calib.write_text(line + "\n")
    result = _run(tiny_model_dir, "--out", half_done, "--calib", calib)
    assert result.exit_code == 1 and f"{calib}:1" in result.output and match in result.output
    assert not (half_done / LOCK_NAME).exists()  # a run that stops on bad input takes its lock with it


def test_calibration_without_images_cannot_calibrate_the_vision_encoder(half_done, tiny_model_dir, tmp_path):
    calib = tmp_path / "text.jsonl"
    calib.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]}) for i in range(3)))
    result = _run(tiny_model_dir, "--out", half_done, "--calib", calib)
    assert result.exit_code == 1 and "no conversation has an image" in result.output


def test_rerun_on_a_finished_checkpoint_skips_and_prints_json(quantized_dir, tiny_model_dir, tmp_path):
    out = tmp_path / "done"
    shutil.copytree(quantized_dir, out)
    before = {seg: _stat(out / shard) for seg, shard in SHARDS.items()}
    result = _run(tiny_model_dir, "--out", out, "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["finished"] == ["thinker", "talker_vision"] and summary["group_size"] == 128
    assert "skipping finished segment(s) thinker, talker_vision" in result.stderr
    assert before == {seg: _stat(out / shard) for seg, shard in SHARDS.items()}
    result = _run(tiny_model_dir, "--out", out)
    assert result.exit_code == 0 and "GPTQ err" in result.stdout and "thinker.experts.down_proj" in result.stdout


def test_rerun_with_other_settings_needs_force(quantized_dir, tiny_model_dir, tmp_path):
    out = tmp_path / "done"
    shutil.copytree(quantized_dir, out)
    result = _run(tiny_model_dir, "--out", out, "--group-size", "64")
    assert result.exit_code == 2 and "quantization settings differ" in result.output and "--force" in result.output


def test_rerun_detects_a_corrupted_finished_segment(quantized_dir, tiny_model_dir, tmp_path):
    out = tmp_path / "done"
    shutil.copytree(quantized_dir, out)
    shard = out / SHARDS["thinker"]
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF  # a weight byte: same size, other sha256
    shard.write_bytes(bytes(data))
    result = _run(tiny_model_dir, "--out", out)
    assert result.exit_code == 1 and str(shard) in result.output and "sha256" in result.output


def test_checkpoint_without_tokenizer(tiny_model_dir, tmp_path):
    model = tmp_path / "notok"
    shutil.copytree(tiny_model_dir, model)
    (model / "tokenizer.json").unlink()
    result = _run(model, "--out", tmp_path / "out")
    assert result.exit_code == 1 and "no tokenizer" in result.output
    assert not (tmp_path / "out").exists()


def test_unavailable_device_is_a_usage_error(tiny_model_dir, tmp_path):
    import torch

    result = _run(tiny_model_dir, "--out", tmp_path / "out", "--device", "tpu")
    assert result.exit_code == 2 and "--device 'tpu'" in result.output
    if not torch.cuda.is_available():
        result = _run(tiny_model_dir, "--out", tmp_path / "out", "--device", "cuda")
        assert result.exit_code == 2 and "no CUDA GPU" in result.output
    assert not (tmp_path / "out").exists()


def test_one_run_per_out_and_no_lock_left(tmp_path):
    from orin.errors import UsageError
    from quantize.pipeline import _exclusive

    out = tmp_path / "q"
    with _exclusive(out):
        assert (out / LOCK_NAME).exists()
        with pytest.raises(UsageError, match="another orin-omni quantize is writing"), _exclusive(out):
            pass
        assert (out / LOCK_NAME).exists()  # the refused run leaves the holder's lock alone
    assert not (out / LOCK_NAME).exists()
    with pytest.raises(RuntimeError), _exclusive(out):
        raise RuntimeError("a failed run")
    assert list(out.iterdir()) == []
