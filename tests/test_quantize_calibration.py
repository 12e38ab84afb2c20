"""Calibration data: the user's JSONL and directory formats, the built-in set, and the held-out split."""

from __future__ import annotations

import json

import numpy as np
import pytest

from orin.errors import InputError
from orin.inputs.media import synth_image, synth_tone, write_wav
from quantize.calibration import (
    MAX_AUDIO_SECONDS,
    MAX_IMAGE_SIDE,
    Conversation,
    builtin_conversations,
    hold_out,
    holdout_count,
    load_calibration,
    split_heldout,
    to_samples,
)
from quantize.skips import Skips, TooFewConversations


def test_directory_of_jsonl_and_loose_files(tmp_path):
    (tmp_path / "b.jsonl").write_text(json.dumps({"messages": [
        {"role": "user", "content": [{"type": "image", "path": "sub/big.png"}, {"type": "text", "text": "?"}]},
        {"role": "assistant", "content": "A picture."}]}) + "\n\n")
    (tmp_path / "sub").mkdir()
    synth_image((1200, 600), seed=1).save(tmp_path / "sub" / "big.png")
    synth_image(64, seed=2).save(tmp_path / "a.png")
    write_wav(tmp_path / "long.wav", synth_tone(MAX_AUDIO_SECONDS + 2), sr=16000)
    (tmp_path / "note.txt").write_text("  Tell me about the moon.  \n")
    (tmp_path / "README.md").write_text("ignored")
    (tmp_path / ".hidden.jsonl").write_text("{broken")
    convs = load_calibration(tmp_path)
    assert [c.name.rsplit("/", 1)[-1] for c in convs] == ["b.jsonl:1", "a.png", "long.wav", "note.txt"]
    assert [sorted(c.modalities) for c in convs] == [["image", "text"], ["image", "text"], ["audio", "text"],
                                                     ["text"]]
    assert max(convs[0].images[0].size) == MAX_IMAGE_SIDE and convs[0].images[0].size == (448, 224)
    assert convs[1].images[0].size == (64, 64)
    assert len(convs[2].audios[0]) == int(MAX_AUDIO_SECONDS * 16000)
    assert convs[3].messages == [{"role": "user", "content": "Tell me about the moon."}]
    assert convs[0].messages[1] == {"role": "assistant", "content": "A picture."}


def test_empty_or_wrong_calibration_paths(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        load_calibration(tmp_path / "nope")
    with pytest.raises(InputError, match="no calibration conversations"):
        load_calibration(tmp_path)
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(InputError, match="not a .jsonl file"):
        load_calibration(tmp_path / "x.json")
    (tmp_path / "empty.txt").write_text(" \n")
    with pytest.raises(InputError, match="empty.txt: calibration text file is empty"):
        load_calibration(tmp_path)


def test_builtin_set_is_deterministic_and_multimodal():
    a, b = builtin_conversations(8, seed=0), builtin_conversations(8, seed=0)
    assert [c.messages for c in a] == [c.messages for c in b]
    assert all(np.array_equal(x, y) for ca, cb in zip(a, b, strict=True) for x, y in zip(ca.audios, cb.audios,
                                                                                         strict=True))
    assert [sorted(c.modalities) for c in a[:4]] == [["text"], ["image", "text"], ["audio", "text"],
                                                    ["audio", "image", "text"]]
    assert builtin_conversations(8, seed=1)[1].images[0].tobytes() != a[1].images[0].tobytes()


def test_heldout_split_covers_modalities_and_keeps_them_for_calibration():
    convs = builtin_conversations(24)
    held = split_heldout(convs, holdout_count(24))
    assert len(held) == 3
    assert set().union(*(convs[i].modalities for i in held)) == {"text", "image", "audio", "video"}
    calib = [c for i, c in enumerate(convs) if i not in held]
    assert set().union(*(c.modalities for c in calib)) == {"text", "image", "audio", "video"}
    # The only image conversation is never held out.
    few = builtin_conversations(2)  # text, image
    assert split_heldout(few, 1) == {0}
    assert holdout_count(2) == 1 and holdout_count(128) == 8 and holdout_count(1000) == 8


def test_unencodable_conversations_are_skipped_before_the_held_out_split():
    """A banner image loads but the processor refuses it: the conversation is skipped with a warning, and the
    held-out split is drawn from the conversations that remain."""
    from PIL import Image

    from devtools.tiny import build_processor

    banner = Conversation("calib.jsonl:7", [{"role": "user", "content": [{"type": "image"},
                                                                        {"type": "text", "text": "?"}]}],
                          images=[Image.new("RGB", (448, 1))])
    convs = builtin_conversations(5) + [banner]
    warnings = []
    skips = Skips(warnings.append)
    samples = to_samples(build_processor(), convs, "cpu", skips)
    assert [s.name for s in samples] == [f"builtin:{i}" for i in range(5)]
    assert [s.index for s in samples] == list(range(5))
    assert warnings == ["warning: skipping calibration conversation calib.jsonl:7 (cannot be encoded): the processor "
                        "cannot encode it (ValueError: absolute aspect ratio must be smaller than 200, got 448.0)"]
    assert skips.to_json()["skipped_counts"] == {"encode": 1, "thinker": 0, "speech": 0}
    hold_out("calib.jsonl", convs, samples, skips)
    assert [s.name for s in samples if s.heldout] == ["builtin:3"]  # brings both image and audio
    with pytest.raises(TooFewConversations, match=r"calib.jsonl: 0 calibration conversation\(s\) that the "
                                                  r"processor can encode, 1 needed; 1 were skipped"):
        hold_out("calib.jsonl", [convs[0], banner], samples[:1], skips)
