"""Calibration on video (issue 16): video parts in a calibration JSONL (and loose clips in a directory) decoded as
the server decodes them, refused with file:line when bad; encoded by orin.inputs' processor with audio in video;
and a quantize run on the tiny model whose vision encoder is calibrated on temporal grids of more than one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from orin.errors import InputError
from orin.inputs.media import synth_image, synth_tone, write_wav
from orin.inputs.video import synth_clip
from quantize import calibration
from quantize.calibration import builtin_conversations, load_calibration, to_samples
from quantize.skips import Skips

SPEECH_SHORT = {"reply_tokens": 3, "speech_frames": 4, "min_speech_frames": 4, "device": "cpu", "progress": False}


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    """Clips (3 s 96x128 and 2 s 64x96 with a soundtrack, 2 s 64x64 silent), an image, a WAV and a non-video."""
    root = tmp_path_factory.mktemp("video_calib")
    (root / "clip.mp4").write_bytes(synth_clip(3.0, 4, (96, 128), seed=1))
    (root / "short.mp4").write_bytes(synth_clip(2.0, 4, (64, 96), seed=2))
    (root / "silent.mp4").write_bytes(synth_clip(2.0, 4, (64, 64), audio=False, seed=3))
    (root / "notes.mp4").write_bytes(b"these are not the frames you are looking for" * 20)
    synth_image(96, seed=4).save(root / "shapes.png")
    write_wav(root / "tone.wav", synth_tone(1.0, freqs=(440.0,)), sr=16000)
    return root


def _video(path: str, **keys) -> dict:
    return {"type": "video", "path": path, **keys}


def _user(*parts, text: str = "What happens here?") -> dict:
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]}


def _jsonl(root: Path, lines: list[dict], name: str = "calib.jsonl") -> Path:
    path = root / name
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


# ---------------------------------------------------------------------- loading


def test_video_parts_load_with_fps_audio_and_soundtrack(media):
    path = _jsonl(media, [
        _user(_video("clip.mp4")),
        _user(_video("clip.mp4", fps=1, audio=False)),
        {"messages": [{"role": "user", "content": [_video("short.mp4"), {"type": "image", "path": "shapes.png"},
                                                   {"type": "text", "text": "Same colours?"}]},
                      {"role": "assistant", "content": "Yes."}]},
        _user(_video("silent.mp4")),  # no audio stream: a video without a soundtrack
    ], name="load.jsonl")
    convs = load_calibration(path)
    assert [sorted(c.modalities) for c in convs] == [["audio", "text", "video"], ["text", "video"],
                                                     ["audio", "image", "text", "video"], ["text", "video"]]
    clip = convs[0].videos[0]
    assert clip.frames.shape == (6, 96, 128, 3) and clip.fps == 2.0 and clip.audio is not None
    assert clip.audio.size == pytest.approx(3 * 16000, rel=0.05)
    assert convs[1].videos[0].frames.shape[0] == 4 and convs[1].videos[0].audio is None  # fps 1, rounded up to 4
    assert [c.audio_in_video for c in convs] == [True, False, True, False]
    assert convs[2].messages[0]["content"] == [{"type": "video"}, {"type": "image"},
                                               {"type": "text", "text": "Same colours?"}]


def test_loose_clips_in_a_directory_and_long_clips_are_cut(media, tmp_path, monkeypatch):
    (tmp_path / "a.mp4").write_bytes((media / "clip.mp4").read_bytes())
    (tmp_path / "b.mov.txt").write_text("Tell me about films.")
    monkeypatch.setattr(calibration, "MAX_VIDEO_SECONDS", 2.0)
    convs = load_calibration(tmp_path)
    assert [c.name.rsplit("/", 1)[-1] for c in convs] == ["a.mp4", "b.mov.txt"]
    assert convs[0].messages[0]["content"][0] == {"type": "video"}
    video = convs[0].videos[0]
    assert video.frames.shape[0] == 4 and video.duration == 2.0 and video.audio.size == 2 * 16000


@pytest.mark.parametrize("part, match", [
    (_video("notes.mp4"), "not a video file FFmpeg can read"),
    (_video("gone.mp4"), "video file not found"),
    (_video("tone.wav"), "has no video stream"),
    (_video("clip.mp4", fps=0), "video fps 0 must be a positive number"),
    (_video("clip.mp4", fps="2"), '"fps" must be a number'),
    (_video("clip.mp4", audio="yes"), '"audio" must be true'),
    (_video("clip.mp4", fsp=2), "unknown key(s) 'fsp' in a video part"),
    ({"type": "video"}, 'a video part needs "path"'),
])
def test_bad_video_parts_name_file_and_line(media, part, match):
    path = _jsonl(media, [{"messages": [{"role": "user", "content": "Hello."}]}, _user(part)], name="bad.jsonl")
    with pytest.raises(InputError) as err:
        load_calibration(path)
    assert str(err.value).startswith(f"{path}:2: message 0 part 0: ") and match in str(err.value)


def test_videos_heard_and_silent_in_one_conversation_are_refused(media):
    path = _jsonl(media, [_user(_video("clip.mp4"), _video("short.mp4", audio=False))], name="mixed.jsonl")
    with pytest.raises(InputError, match=rf"{path}:1: some of its videos have a soundtrack and some have none"):
        load_calibration(path)
    with pytest.raises(InputError, match=r"x.jsonl:1: message 1 part 0: video parts are only allowed in user turns"):
        calibration._conversation({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": [
            _video("clip.mp4")]}]}, "x.jsonl:1", media)


# ---------------------------------------------------------------------- the built-in set and encoding


def test_builtin_set_has_short_videos_with_their_soundtracks():
    convs = builtin_conversations(24)
    videos = [c for c in convs if c.videos]
    assert [c.name for c in videos] == ["builtin:7", "builtin:15", "builtin:23"]
    assert all(c.modalities == {"text", "video", "audio"} and c.audio_in_video for c in videos)
    grids = [(len(c.videos[0].frames) // 2, *c.videos[0].frames.shape[1:3]) for c in videos]
    assert grids == [(3, 96, 128), (2, 64, 96), (4, 128, 64)]
    assert all(v.fps == 2.0 for c in videos for v in c.videos)
    # the first conversations are what they were (the other tests' and users' runs with few samples)
    assert not any(c.videos for c in convs[:7]) and convs[3].modalities == {"text", "image", "audio"}


def test_video_conversations_are_encoded_with_audio_in_video(tiny_model_dir):
    from devtools.tiny import build_processor
    from orin.inputs.processor import Processor

    convs = builtin_conversations(8)
    with pytest.raises(ValueError, match="need a video_processor"):
        to_samples(build_processor(), convs, "cpu", Skips(print))
    samples = to_samples(build_processor(), convs, "cpu", Skips(print), Processor.from_dir(tiny_model_dir))
    video = samples[7]
    assert video.modalities == {"text", "audio", "video"}
    inputs = video.inputs
    assert inputs["video_grid_thw"].tolist() == [[3, 6, 8]] and inputs["use_audio_in_video"] is True
    assert inputs["pixel_values_videos"].shape[0] == 3 * 6 * 8
    assert inputs["video_second_per_grid"].tolist() == [1.0]
    assert inputs["input_features"].shape[0] == 1  # the soundtrack's features
    assert video.prompt_inputs["input_ids"].shape[1] == video.tokens  # no reply: the prompt is the conversation
    assert all("use_audio_in_video" not in s.inputs and "pixel_values_videos" not in s.inputs for s in samples[:7])


# ---------------------------------------------------------------------- quantize


def test_quantize_calibrates_the_vision_encoder_on_video_grids(tiny_model_dir, media, tmp_path, monkeypatch,
                                                               single_torch_thread):
    """The talker_vision segment (the vision encoder) calibrated on a JSONL with videos: the vision encoder's
    recorded first-layer calls include a video's temporal grids (cu_seqlens: one window per two frames) and its
    GPTQ Hessians saw every calibration patch, images' and videos' alike."""
    from quantize import capture
    from quantize.pipeline import QuantConfig, run_quantize
    from quantize.report import load_report

    path = _jsonl(media, [
        {"messages": [{"role": "user", "content": "Name three colours."},
                      {"role": "assistant", "content": "Red, green, blue."}]},
        _user({"type": "image", "path": "shapes.png"}),
        _user(_video("clip.mp4"), text="What moves?"),
        _user(_video("short.mp4", fps=4, audio=False), text="Describe it."),
        _user(_video("short.mp4"), text="What do you hear?"),
    ])
    recorded = {}
    real = capture.capture_thinker_pass

    def spy(model, residency, samples, *args):
        data, refs, result = real(model, residency, samples, *args)
        recorded.update(data=data, samples=list(samples))
        return data, refs, result

    monkeypatch.setattr(capture, "capture_thinker_pass", spy)
    out = tmp_path / "q"
    m = run_quantize(QuantConfig(model=tiny_model_dir, out=str(out), segments=("talker_vision",), calib=str(path),
                                 samples=8, **SPEECH_SHORT))
    assert m.finished == ("talker_vision",)
    seg = load_report(out)["segments"]["talker_vision"]
    calib = seg["calibration"]
    assert calib["heldout"] == 1 and calib["skipped"] == []
    held = [s for s in recorded["samples"] if s.heldout]
    assert [s.name for s in held] == [f"{path}:5"]  # the last one with video: the other two stay to calibrate
    assert calib["modalities"] == {"text": 4, "image": 1, "audio": 1, "video": 2}

    vision = recorded["data"]["vision_encoder"]
    windows = [torch.diff(call.kwargs["cu_seqlens"]).tolist() for call in vision.calib]
    assert [6 * 8] * 3 in windows  # clip.mp4: 3 s at 2 fps, 96x128: three temporal grids of 6x8 patches
    assert [4 * 6] * 4 in windows  # short.mp4 at 4 fps: 8 frames, four temporal grids of 4x6 patches
    assert [6 * 6] in windows  # the image
    patches = sum(int(s.inputs[k].shape[0]) for s in recorded["samples"] if not s.heldout
                  for k in ("pixel_values", "pixel_values_videos") if k in s.inputs)
    assert patches == 36 + 3 * 48 + 4 * 24 == vision.calib_rows
    qkv = seg["layer_types"]["vision.attn.qkv"]
    assert qkv["calib_rows"] == qkv["modules"] * patches and qkv["heldout_rows"] == qkv["modules"] * 2 * 4 * 6
    assert 0.9 < seg["metrics"]["vision_cosine"] <= 1 and seg["metrics"]["vision_tokens"] == 2 * 2 * 3
