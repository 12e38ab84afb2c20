"""orin.checkpoint.manifest: the quantized checkpoint's manifest, as the loader reads it and quantize writes it."""

from __future__ import annotations

import json

import pytest

from orin.checkpoint.manifest import (
    Manifest,
    SegmentEntry,
    file_entry,
    read_manifest,
    remove_segment_entry,
    verify_files,
    write_manifest,
    write_segment_entry,
)
from orin.checkpoint.targets import QuantSpec
from orin.errors import ChecksumError, ModelError

SPLIT = {"thinker": ("audio_encoder", "thinker_text"),
         "talker_vision": ("vision_encoder", "talker", "code_predictor", "code2wav")}


def _checkpoint(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_omni_moe"}')
    (tmp_path / "thinker").mkdir()
    (tmp_path / "thinker" / "model.safetensors").write_bytes(b"x" * 100)
    spec = QuantSpec(group_size=64)
    manifest = Manifest(tool_version="0.1.0", created_at="2025-01-01T00:00:00Z",
                        source={"model_dir": "/models/q", "config_sha256": "ab" * 32},
                        quantization={**spec.describe(), "spec": {"bits": 4, "group_size": 64,
                                                                  "quantize_audio_encoder": False,
                                                                  "quantize_code_predictor": False,
                                                                  "quantize_code2wav": False,
                                                                  "quantize_lm_head": False, "sym": True}},
                        split=SPLIT, shared_files=(file_entry(tmp_path, "config.json"),))
    write_manifest(tmp_path, manifest)
    entry = SegmentEntry(name="thinker", components=SPLIT["thinker"],
                         files=(file_entry(tmp_path, "thinker/model.safetensors"),), total_bytes=100, int4_bytes=90,
                         quantized_modules=("thinker.model.language_model.layers.0.mlp.experts",),
                         started_at="a", finished_at="b", extra={"calibration": {"source": "x"}})
    return write_segment_entry(tmp_path, entry)


def test_round_trip_and_queries(tmp_path):
    written = _checkpoint(tmp_path)
    m = read_manifest(tmp_path)
    assert m == written
    assert m.finished == ("thinker",) and not m.complete
    assert m.segment("thinker").int4_bytes == 90
    assert m.component_segment("talker") == "talker_vision"
    assert m.component_segment("thinker_text") == "thinker"
    assert m.quant_spec() == QuantSpec(group_size=64)
    assert m.segment_split() == SPLIT
    assert m.safetensors_files() == ["thinker/model.safetensors"]
    assert m.summary()["segments"]["thinker"]["quantized_modules"] == 1
    verify_files(tmp_path, m)


def test_unfinished_and_unknown_segments_are_clear_errors(tmp_path):
    m = _checkpoint(tmp_path)
    with pytest.raises(ModelError, match="talker_vision.*never finished"):
        m.segment("talker_vision")
    with pytest.raises(ModelError, match="unknown segment 'nope'"):
        m.segment("nope")
    with pytest.raises(ModelError, match="component 'speaker'"):
        m.component_segment("speaker")


@pytest.mark.parametrize("damage, match", [
    (lambda p: p.write_bytes(b"y" * 100), "sha256"),
    (lambda p: p.write_bytes(b"x" * 99), "99 bytes"),
    (lambda p: p.unlink(), "missing"),
])
def test_verify_files_names_the_damaged_file(tmp_path, damage, match):
    m = _checkpoint(tmp_path)
    target = tmp_path / "thinker" / "model.safetensors"
    damage(target)
    with pytest.raises(ChecksumError, match=match) as err:
        verify_files(tmp_path, m)
    assert str(target) in str(err.value)
    verify_files(tmp_path, m, segments=[])  # only the shared files: still fine


def test_entries_are_added_and_removed_atomically(tmp_path):
    _checkpoint(tmp_path)
    m = remove_segment_entry(tmp_path, "thinker")
    assert m.finished == () and read_manifest(tmp_path).finished == ()
    assert not list(tmp_path.glob(".manifest.json.*"))  # no temp file left behind


def test_damaged_manifests_are_model_errors(tmp_path):
    with pytest.raises(ModelError, match="not found"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ModelError, match="not readable JSON"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ModelError, match="not an orin-omni checkpoint manifest"):
        read_manifest(tmp_path)
    _checkpoint(tmp_path)
    data = json.loads((tmp_path / "manifest.json").read_text())
    del data["segments"]["thinker"]["int4_bytes"]
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ModelError, match="int4_bytes"):
        read_manifest(tmp_path)
    data["segments"]["thinker"]["int4_bytes"] = 1
    data["segments"]["thinker"]["files"][0]["path"] = "../outside"
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ModelError, match="relative"):
        read_manifest(tmp_path)


def test_served_model_name_is_recorded_validated_and_defaulted(tmp_path):
    from dataclasses import replace

    from orin.checkpoint.manifest import check_served_name
    from orin.errors import UsageError

    _checkpoint(tmp_path)
    manifest = read_manifest(tmp_path)
    assert manifest.model_name == "qwen3-omni-int4"  # an old manifest without the field: the default
    write_manifest(tmp_path, replace(manifest, served_model_name="cam-brain"))
    assert read_manifest(tmp_path).model_name == "cam-brain"
    data = json.loads((tmp_path / "manifest.json").read_text())
    data["served_model_name"] = "has space"
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ModelError, match="served_model_name"):
        read_manifest(tmp_path)
    for bad in ("", "a b", "x" * 129, "tab\there"):
        with pytest.raises(UsageError):
            check_served_name(bad)


def test_a_spec_recorded_before_sym_existed_reads_as_asymmetric(tmp_path):
    """orin-omni 0.1 quantized asymmetrically and recorded no `sym`: its checkpoints must not claim symmetry."""
    _checkpoint(tmp_path)
    data = json.loads((tmp_path / "manifest.json").read_text())
    del data["quantization"]["spec"]["sym"]
    data["schema_version"] = 1
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    m = read_manifest(tmp_path)
    assert m.quant_spec().sym is False and m.schema_version == 1
    data["schema_version"] = 3
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ModelError, match="schema version 3"):
        read_manifest(tmp_path)
