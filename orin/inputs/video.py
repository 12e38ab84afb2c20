"""Video in: a clip decoded as the model takes it — frames sampled at a requested rate (Qwen3-Omni's own tooling
samples 2 fps), resized under a per-frame pixel cap to sides the vision encoder's patches tile (multiples of 32:
patch 16, merge 2), an even count of them (temporal patch 2) — and its soundtrack as 16 kHz mono float32.

Decoding goes through PyAV, which bundles its own FFmpeg (no system FFmpeg, no torchvision; wheels for aarch64 and
x86-64). It streams: packets are demuxed and decoded in order, and only the sampled frames are kept, already
resized, so a two-minute 1080p clip never sits in memory whole (120 s at 2 fps and 448² is 240 frames, 144 MB).
Every refusal is an InputError that names the input and what to change, raised before decoding where the
container's header can tell (no video stream, resolution, duration), after it where only decoding can (no frame,
a truncated file).
"""

from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..audio_format import INPUT_SAMPLE_RATE
from ..errors import InputError

Source = str | os.PathLike | bytes | bytearray | memoryview

# Sides of a sampled frame are multiples of this: the vision encoder's 16-pixel patches merged 2x2.
FRAME_FACTOR = 32
TEMPORAL_PATCH = 2


@dataclass(frozen=True)
class VideoOptions:
    """How a clip is sampled and what is refused. `fps`: frames sampled per second of video; `max_frame_pixels`:
    the cap on a sampled frame's area (448² by default: 196 tokens per two frames); `max_source_pixels`: the
    largest source resolution decoded at all (8K); `max_seconds`: the longest clip; `audio`: decode the
    soundtrack too (Qwen3-Omni's audio in video)."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    max_frame_pixels: int = 448 * 448
    max_source_pixels: int = 7680 * 4320
    max_seconds: float = 600.0
    max_bytes: int = 2 * 1024**3
    audio: bool = True

    def check(self) -> None:
        if not (isinstance(self.fps, (int, float)) and math.isfinite(self.fps) and self.fps > 0):
            raise InputError(f"video fps {self.fps!r} must be a positive number of frames per second (e.g. 2)")
        if self.fps > 60:
            raise InputError(f"video fps {self.fps:g} is over 60; sample at most 60 frames per second")
        if not 2 <= self.min_frames <= self.max_frames:
            raise InputError(f"video frame bounds {self.min_frames}..{self.max_frames} must satisfy 2 <= min <= max")
        if self.max_frame_pixels < FRAME_FACTOR * FRAME_FACTOR:
            raise InputError(f"the per-frame pixel cap {self.max_frame_pixels} is under one {FRAME_FACTOR}x"
                             f"{FRAME_FACTOR} tile")
        if not self.max_seconds > 0:
            raise InputError(f"the video length limit {self.max_seconds!r} must be positive")


@dataclass(frozen=True)
class Video:
    """A decoded clip: `frames` [T, H, W, 3] uint8 RGB (T even), sampled at `fps` frames per second of video from
    `start` seconds on (`timestamps`: each frame's time in the clip); `audio`: the soundtrack, 16 kHz mono float32,
    from the clip's start, or None (none in the file, or not asked for); `source`: what the container said."""

    frames: np.ndarray
    fps: float
    timestamps: tuple[float, ...]
    duration: float
    audio: np.ndarray | None
    source: dict

    @property
    def second_per_grid(self) -> float:
        """Seconds of video one temporal grid (two frames) spans: Qwen3-Omni's `video_second_per_grid`."""
        return TEMPORAL_PATCH / self.fps


def frame_size(height: int, width: int, max_pixels: int, factor: int = FRAME_FACTOR) -> tuple[int, int]:
    """A sampled frame's (height, width): aspect kept, area at most `max_pixels`, sides multiples of `factor`,
    never larger than the source (rounded to the factor)."""
    if min(height, width) <= 0:
        raise InputError(f"a video frame of {width}x{height} pixels has no area")
    if max(height, width) / min(height, width) > 200:
        raise InputError(f"a video of {width}x{height} pixels has an aspect ratio over 200; crop or pad it")
    scale = min(1.0, math.sqrt(max_pixels / (height * width)))
    h = max(factor, math.floor(height * scale / factor) * factor)
    w = max(factor, math.floor(width * scale / factor) * factor)
    while h * w > max_pixels:  # both sides at least one tile: shrink the longer one
        if h >= w:
            h -= factor
        else:
            w -= factor
    return h, w


def _open(src: Source, label: str, max_bytes: int):
    import av

    if isinstance(src, (bytes, bytearray, memoryview)):
        data = bytes(src)
        if not data:
            raise InputError(f"{label} is empty (0 bytes)")
        if len(data) > max_bytes:
            raise InputError(f"{label} is {len(data)} bytes, over the {max_bytes}-byte limit; send a shorter clip")
        target = io.BytesIO(data)
    else:
        path = Path(src)
        if not path.is_file():
            raise InputError(f"video file not found: {path}" if not path.exists() else f"video input {path} is not a file")
        size = path.stat().st_size
        if size == 0:
            raise InputError(f"{label} is empty (0 bytes)")
        if size > max_bytes:
            raise InputError(f"{label} is {size} bytes, over the {max_bytes}-byte limit; send a shorter clip")
        target = str(path)
    try:
        return av.open(target, mode="r", metadata_errors="ignore")
    except (av.error.FFmpegError, ValueError, OSError) as exc:
        raise InputError(f"{label}: not a video file FFmpeg can read, or a truncated one ({_why(exc)}); send a "
                         "whole MP4, MKV, WebM or MOV") from exc


def _why(exc: Exception) -> str:
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


def _duration(container, stream) -> float | None:
    """The clip's length from the header: the video stream's, else the container's; None where neither says."""
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        import av

        return container.duration / av.time_base
    return None


def sampled_frames(duration: float, opts: VideoOptions) -> int:
    """How many frames a clip of `duration` seconds gives: `fps` a second, within the frame bounds, an even
    count (temporal patch 2)."""
    n = round(duration * opts.fps)
    n = min(max(n, opts.min_frames), opts.max_frames)
    n += n % TEMPORAL_PATCH
    if n > opts.max_frames:
        n -= TEMPORAL_PATCH
    return n


def _targets(duration: float, opts: VideoOptions) -> np.ndarray:
    """The sampling times: sampled_frames of them, evenly spaced from the start."""
    n = sampled_frames(duration, opts)
    return np.arange(n) * (duration / n)


def load_video(src: Source, opts: VideoOptions = VideoOptions(), *, name: str | None = None) -> Video:
    """Decode `src` (a path or the file's bytes) into sampled frames and, where `opts.audio`, its soundtrack."""
    import av

    opts.check()
    label = name or ("video bytes" if isinstance(src, (bytes, bytearray, memoryview)) else str(src))
    container = _open(src, label, opts.max_bytes)
    try:
        fmt = container.format.name if container.format is not None else ""
        if fmt == "image2" or fmt.endswith("_pipe"):  # FFmpeg opens a PNG or JPEG as a one-frame "video"
            raise InputError(f"{label} is a still image ({still_image_kind(src, fmt)}), not a video; send it as an "
                             "image")
        return _decode(container, label, opts)
    except av.error.FFmpegError as exc:
        raise InputError(f"{label}: corrupt or truncated video ({_why(exc)})") from exc
    finally:
        container.close()


def still_image_kind(src: Source, fmt: str) -> str:
    """The format a still image sent as a video is in, named alike for a path and for bytes: FFmpeg calls a JPEG
    file `image2` and JPEG bytes `jpeg_pipe`, so its own bytes decide, FFmpeg's name only where they cannot."""
    from .media import sniff_image

    if isinstance(src, (bytes, bytearray, memoryview)):
        head = bytes(src[:16])
    else:
        with open(src, "rb") as fh:
            head = fh.read(16)
    return sniff_image(head) or fmt.removesuffix("_pipe").upper()


def _decode(container, label: str, opts: VideoOptions) -> Video:
    import av

    if not container.streams.video:
        kind = "an audio-only file" if container.streams.audio else "no video stream"
        raise InputError(f"{label} has no video stream ({kind}); send audio as an audio part, or a video file")
    vstream = container.streams.video[0]
    ctx = vstream.codec_context
    codec = ctx.name if ctx is not None else "unknown"
    width, height = int(ctx.width or 0), int(ctx.height or 0)
    if width * height > opts.max_source_pixels:
        raise InputError(f"{label} is {width}x{height} pixels, over the {opts.max_source_pixels}-pixel limit; "
                         "scale it down first (e.g. ffmpeg -i in.mp4 -vf scale=-2:1080 out.mp4)")
    duration = _duration(container, vstream)
    if duration is None or duration <= 0:
        duration = _scan_duration(container, vstream, label)
    if duration > opts.max_seconds:
        raise InputError(f"{label} is {duration:.1f} s long, over the {opts.max_seconds:g} s limit; trim it or "
                         "raise the limit (--max-video-seconds of generate and serve)")
    astream = container.streams.audio[0] if opts.audio and container.streams.audio else None
    start = float(vstream.start_time * vstream.time_base) if vstream.start_time is not None else 0.0
    targets = _targets(duration, opts)
    size = None
    frames: list[np.ndarray] = []
    times: list[float] = []
    audio: list[np.ndarray] = []
    resampler = av.AudioResampler(format="flt", layout="mono", rate=INPUT_SAMPLE_RATE) if astream else None
    last_time = None
    decoded = 0
    streams = [vstream] + ([astream] if astream is not None else [])
    try:
        for packet in container.demux(*streams):
            if packet.stream.type == "audio":
                for aframe in packet.decode():
                    for out in resampler.resample(aframe):
                        audio.append(out.to_ndarray().reshape(-1))
                continue
            for frame in packet.decode():
                decoded += 1
                t = (float(frame.time) if frame.time is not None else decoded / float(vstream.average_rate or 1)) - start
                last_time = t
                if size is None:
                    size = frame_size(frame.height, frame.width, opts.max_frame_pixels)
                # the first frame at or after each sampling time not yet served (a frame may serve several)
                rgb = None
                while len(frames) < len(targets) and targets[len(frames)] <= t + 1e-6:
                    if rgb is None:
                        rgb = frame.to_ndarray(format="rgb24", width=size[1], height=size[0])
                    frames.append(rgb)
                    times.append(t)
    except av.error.InvalidDataError as exc:
        if not decoded:
            raise InputError(f"{label}: the {codec} video stream cannot be decoded ({_why(exc)})") from exc
        raise InputError(f"{label}: corrupt or truncated video after {decoded} frames ({_why(exc)})") from exc
    except av.error.DecoderNotFoundError as exc:
        raise InputError(f"{label}: no decoder for its {codec} video; re-encode it to H.264 or VP9") from exc
    if resampler is not None:
        for out in resampler.resample(None):
            audio.append(out.to_ndarray().reshape(-1))
    if not decoded:
        raise InputError(f"{label} has a video stream but no frame could be decoded (empty or truncated file)")
    if len(frames) < len(targets):
        # The header promised more than the stream holds: a cut file, unless only the last frame's span is missing.
        missing = duration - (last_time or 0.0)
        if missing > max(1.0, 2.0 / opts.fps):
            raise InputError(f"{label} is truncated: its frames end at {last_time or 0:.1f} s of the {duration:.1f} s "
                             "its header gives; re-export or re-download it")
        while len(frames) < len(targets):  # the clip's last frame stands for the rest of its span
            frames.append(frames[-1])
            times.append(times[-1])
    track = np.concatenate(audio).astype(np.float32, copy=False) if audio else None
    if track is not None and track.size == 0:  # an audio stream without a decodable sample: no soundtrack
        track = None
    return Video(frames=np.stack(frames), fps=len(frames) / duration, timestamps=tuple(times), duration=duration,
                 audio=track, source={"codec": codec, "width": width, "height": height,
                                      "rate": float(vstream.average_rate) if vstream.average_rate else None,
                                      "audio_codec": astream.codec_context.name if astream is not None else None})


def _scan_duration(container, stream, label: str) -> float:
    """The clip's length from its packets, where the header does not say (some WebM and raw streams): demuxing
    reads the file once without decoding it, then the container is rewound."""
    end = None
    for packet in container.demux(stream):
        if packet.pts is not None and packet.time_base is not None:
            t = float((packet.pts + (packet.duration or 0)) * packet.time_base)
            end = t if end is None else max(end, t)
    if end is None or end <= 0:
        raise InputError(f"{label}: its video stream has no timestamps, so its length cannot be known")
    container.seek(0)
    return end


def synth_clip(seconds: float = 2.0, fps: int = 10, size: tuple[int, int] = (96, 128), *, audio: bool = True,
               seed: int = 0) -> bytes:
    """A deterministic MP4 (MPEG-4 part 2 video, AAC audio: FFmpeg's own encoders, in every PyAV build) of moving
    shapes under a strip that spells each frame's index in binary and, with `audio`, a tone that rises over the
    clip: for tests, smoke checks and calibration."""
    import tempfile

    import av

    rng = np.random.default_rng(seed)
    h, w = size
    tmp = tempfile.TemporaryDirectory(prefix="orin-clip-")
    path = Path(tmp.name) / "clip.mp4"
    # faststart (the index first, as a web video has it: a cut download still opens, and is found short) moves the
    # index in a second pass over the file, so the clip is written to a file, not to memory
    with tmp, av.open(str(path), mode="w", format="mp4", options={"movflags": "faststart"}) as out:
        vs = out.add_stream("mpeg4", rate=fps)
        vs.width, vs.height, vs.pix_fmt = w, h, "yuv420p"
        ast = out.add_stream("aac", rate=INPUT_SAMPLE_RATE, layout="mono") if audio else None
        colors = rng.integers(40, 255, size=(3, 3))
        n = int(round(seconds * fps))
        for i in range(n):
            img = np.zeros((h, w, 3), np.uint8)
            img[:] = (i * 7 % 255, 60, 120)
            for k, c in enumerate(colors):
                y = 8 + int((h - 24) * (0.5 + 0.4 * math.sin(i / fps * (k + 1))))
                x = int((w - 16) * ((i / max(n - 1, 1) + k / 3) % 1.0))
                img[y:y + 16, x:x + 16] = c
            cell = w // 8  # the frame's index in binary along the top rows, white cells for ones: tests read it back
            for bit in range(8):
                img[:8, bit * cell:(bit + 1) * cell] = 255 if (i >> bit) & 1 else 0
            out.mux(vs.encode(av.VideoFrame.from_ndarray(img, format="rgb24")))
        out.mux(vs.encode(None))
        if ast is not None:
            t = np.arange(int(seconds * INPUT_SAMPLE_RATE)) / INPUT_SAMPLE_RATE
            tone = (0.3 * np.sin(2 * np.pi * (220 + 220 * t / max(seconds, 1e-3)) * t)).astype(np.float32)
            for k in range(0, tone.size, 1024):
                frame = av.AudioFrame.from_ndarray(tone[None, k:k + 1024], format="fltp", layout="mono")
                frame.sample_rate, frame.pts = INPUT_SAMPLE_RATE, k
                out.mux(ast.encode(frame))
            out.mux(ast.encode(None))
        out.close()
        return path.read_bytes()
