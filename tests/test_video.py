"""Video decoding (orin.inputs.video, issue 16): frames sampled at the requested rate within the frame bounds, an even
count, resized under the pixel cap to sides of whole 32-pixel tiles; the soundtrack as 16 kHz mono; every bad
input refused with an InputError naming it; only the sampled frames kept while decoding."""

from __future__ import annotations

import io
import tracemalloc

import numpy as np
import pytest

from orin.errors import InputError
from orin.inputs.video import VideoOptions, frame_size, load_video, synth_clip

FPS = 10


@pytest.fixture(scope="module")
def clip() -> bytes:
    return synth_clip(4.0, FPS, (96, 128), seed=1)


def _index(frames: np.ndarray) -> list[int]:
    """Which source frame each sampled one is: synth_clip spells its index in binary along the top rows."""
    cells = frames[:, 2:6, :, :].reshape(len(frames), 4, 8, -1, 3).mean(axis=(1, 3, 4)) > 128
    return [int(sum(1 << b for b in range(8) if row[b])) for row in cells]


def test_frames_are_sampled_at_the_requested_rate(clip):
    video = load_video(clip)
    assert video.frames.shape == (8, 96, 128, 3) and video.frames.dtype == np.uint8
    assert video.fps == pytest.approx(2.0) and video.second_per_grid == pytest.approx(1.0)
    assert video.timestamps == pytest.approx(np.arange(8) * 0.5)
    assert video.duration == pytest.approx(4.0)
    assert list(_index(video.frames)) == [round(t * FPS) for t in video.timestamps]
    one = load_video(clip, VideoOptions(fps=1.0))
    assert one.frames.shape[0] == 4 and list(_index(one.frames)) == [0, 10, 20, 30]


def test_frame_counts_stay_within_bounds_and_even(clip):
    assert load_video(clip, VideoOptions(fps=0.25)).frames.shape[0] == 4  # 1 frame asked, min 4
    assert load_video(clip, VideoOptions(fps=2.0, max_frames=5)).frames.shape[0] == 4  # even, under the max
    odd = load_video(clip, VideoOptions(fps=1.25))  # 5 asked: 6, evenly spread
    assert odd.frames.shape[0] == 6 and odd.fps == pytest.approx(1.5)


def test_frames_are_resized_under_the_cap_in_whole_tiles():
    video = load_video(synth_clip(1.0, 4, (720, 1280), audio=False), VideoOptions(max_frame_pixels=448 * 448))
    _, h, w, _ = video.frames.shape
    assert h % 32 == 0 and w % 32 == 0 and h * w <= 448 * 448
    assert abs(w / h - 1280 / 720) < 0.1
    assert frame_size(96, 128, 448 * 448) == (96, 128)  # never enlarged
    assert frame_size(2160, 3840, 448 * 448) == (320, 576)
    assert frame_size(20, 20, 448 * 448) == (32, 32)  # at least one tile


def test_the_soundtrack_is_16k_mono_and_optional(clip):
    video = load_video(clip)
    assert video.audio is not None and video.audio.dtype == np.float32 and video.audio.ndim == 1
    assert abs(video.audio.size / 16000 - 4.0) < 0.1
    assert 0.1 < float(np.abs(video.audio).max()) < 1.0  # the tone, not silence
    assert load_video(clip, VideoOptions(audio=False)).audio is None
    assert load_video(synth_clip(1.0, 4, audio=False)).audio is None


def test_decoding_keeps_only_the_sampled_frames():
    long = synth_clip(20.0, 10, (240, 320), audio=False)
    tracemalloc.start()
    try:
        video = load_video(long, VideoOptions(fps=0.5))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    every_frame = 200 * 240 * 320 * 3
    assert video.frames.shape[0] == 10
    assert peak < every_frame / 4, peak


def _audio_only() -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("aac", rate=16000, layout="mono")
        for k in range(0, 16000, 1024):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            frame.sample_rate, frame.pts = 16000, k
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return buf.getvalue()


def _png() -> bytes:
    from orin.inputs.media import synth_image

    buf = io.BytesIO()
    synth_image(64).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("make, opts, match", [
    (lambda c: b"not a video at all" * 50, VideoOptions(), "not a video file"),
    (lambda c: b"", VideoOptions(), "empty"),
    (lambda c: c[: len(c) // 2], VideoOptions(), "truncated"),
    (lambda c: c[: len(c) * 4 // 5], VideoOptions(), "truncated"),
    (lambda c: _audio_only(), VideoOptions(), "no video stream .an audio-only file"),
    (lambda c: _png(), VideoOptions(), "still image"),
    (lambda c: c, VideoOptions(max_seconds=3.0), "over the 3 s limit"),
    (lambda c: c, VideoOptions(max_source_pixels=100 * 100), "128x96 pixels, over the 10000-pixel limit"),
    (lambda c: c, VideoOptions(fps=0.0), "fps 0.0 must be a positive"),
    (lambda c: c, VideoOptions(fps=float("nan")), "must be a positive"),
    (lambda c: c, VideoOptions(max_bytes=1000), "over the 1000-byte limit"),
])
def test_bad_input_is_refused_by_name(clip, make, opts, match):
    with pytest.raises(InputError, match=match):
        load_video(make(clip), opts, name="clip.mp4")


def test_a_missing_path_is_named(tmp_path):
    with pytest.raises(InputError, match="video file not found"):
        load_video(tmp_path / "none.mp4")
    (tmp_path / "dir.mp4").mkdir()
    with pytest.raises(InputError, match="is not a file"):
        load_video(tmp_path / "dir.mp4")


def test_a_path_decodes_like_its_bytes(clip, tmp_path):
    path = tmp_path / "clip.mp4"
    path.write_bytes(clip)
    assert np.array_equal(load_video(path).frames, load_video(clip).frames)
