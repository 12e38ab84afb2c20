"""Request media in and out: decode audio to 16 kHz mono float32 and images to RGB, refusing what cannot be
decoded safely with an InputError that names the input and says what to do; write 16-bit WAV; and make
deterministic synthetic audio and images for calibration and smoke tests.

Audio goes through libsndfile (soundfile): WAV, FLAC, OGG and, with libsndfile >= 1.1, MP3. Resampling is a
band-limited windowed-sinc (Kaiser) polyphase filter in numpy, since scipy is not a dependency. Images go
through Pillow; the pixel count is checked from the header before any pixel is decoded.
"""

from __future__ import annotations

import functools
import io
import math
import os
import wave
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageOps, UnidentifiedImageError

from ..audio_format import INPUT_SAMPLE_RATE, OUTPUT_SAMPLE_RATE
from ..errors import InputError, UsageError
from ..fsutil import atomic_write_bytes

Source = str | os.PathLike | bytes | bytearray | memoryview

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")
DEFAULT_MAX_PIXELS = 16_000_000
DEFAULT_MAX_BYTES = 256 * 1024 * 1024


def _label(src: Source, name: str | None, kind: str) -> str:
    if name:
        return name
    if isinstance(src, (bytes, bytearray, memoryview)):
        return f"{kind} bytes"
    return str(src)


def _read_source(src: Source, label: str, kind: str, max_bytes: int) -> bytes:
    """The input's bytes. A path is checked for existence and size first, so a huge file is never read."""
    if isinstance(src, (bytes, bytearray, memoryview)):
        data = bytes(src)
    else:
        path = Path(src)
        if not path.exists():
            raise InputError(f"{kind} file not found: {path}")
        if not path.is_file():
            raise InputError(f"{kind} input {path} is not a file")
        size = path.stat().st_size
        if size > max_bytes:
            raise InputError(f"{kind} file {path} is {size} bytes, over the {max_bytes}-byte limit; send a smaller file")
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise InputError(f"cannot read {kind} file {path}: {exc.strerror or exc}") from exc
    if len(data) > max_bytes:
        raise InputError(f"{label} is {len(data)} bytes, over the {max_bytes}-byte limit; send a smaller file")
    if not data:
        raise InputError(f"{label} is empty (0 bytes)")
    return data


# ------------------------------------------------------------------------------------------------ audio


def _sniff_audio(head: bytes) -> str | None:
    """The container from its magic bytes: enough to explain a refusal better than "format not recognised"."""
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return "WAV"
    if head[:4] == b"fLaC":
        return "FLAC"
    if head[:4] == b"OggS":
        return "OGG"
    if head[:3] == b"ID3":
        return "MP3"
    if len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0:
        # MPEG frame sync; layer bits 00 are ADTS AAC, anything else is MPEG audio (MP3/MP2).
        return "AAC" if (head[1] >> 1) & 0x3 == 0 else "MP3"
    if head[4:8] == b"ftyp":
        return "MP4/M4A"
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "WebM/Matroska"
    return None


def mp3_supported() -> bool:
    """libsndfile decodes MP3 from 1.1 on; soundfile exposes it from 0.12 on."""
    import soundfile as sf

    return "MP3" in sf.available_formats()


def load_audio(src: Source, *, target_sr: int = INPUT_SAMPLE_RATE, max_seconds: float | None = None,
               name: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> np.ndarray:
    """Decode `src` (a path or the file's bytes) to mono float32 at `target_sr` Hz. Multi-channel audio is
    averaged. Raises InputError for a missing, empty, corrupt, unsupported, silent-length or too-long input."""
    import soundfile as sf

    if not isinstance(target_sr, int) or target_sr <= 0:
        raise UsageError(f"target sample rate {target_sr!r} must be a positive integer")
    label = _label(src, name, "audio")
    data = _read_source(src, label, "audio", max_bytes)
    kind = _sniff_audio(data[:16])
    if kind == "MP3" and not mp3_supported():
        raise InputError(f"{label}: MP3 decoding needs libsndfile >= 1.1 (with soundfile >= 0.12), found "
                         f"libsndfile {sf.__libsndfile_version__}; upgrade it or convert: ffmpeg -i in.mp3 out.wav")
    if kind in ("AAC", "MP4/M4A", "WebM/Matroska"):
        raise InputError(f"{label}: {kind} audio is not supported; send WAV, FLAC, OGG or MP3 "
                         "(convert: ffmpeg -i in.m4a out.wav)")
    try:
        with sf.SoundFile(io.BytesIO(data)) as fh:
            frames, sr = fh.frames, fh.samplerate
            if max_seconds is not None and sr > 0 and frames / sr > max_seconds:
                raise InputError(f"{label} is {frames / sr:.1f} s long, over the {max_seconds:g} s limit; "
                                 "trim it or raise the limit")
            audio = fh.read(dtype="float32", always_2d=True)
    except sf.LibsndfileError as exc:
        if kind is None:
            raise InputError(f"{label}: not a supported audio file ({exc.error_string}); send WAV, FLAC, OGG "
                             "or MP3") from exc
        raise InputError(f"{label}: corrupt or unreadable {kind} audio ({exc.error_string})") from exc
    except (RuntimeError, ValueError, EOFError) as exc:
        raise InputError(f"{label}: corrupt or unreadable audio ({exc})") from exc
    if audio.shape[0] == 0 or sr <= 0:
        raise InputError(f"{label} has no audio samples (zero length)")
    if max_seconds is not None and audio.shape[0] / sr > max_seconds:
        # Some containers (MP3 without a header frame) only know their length once decoded.
        raise InputError(f"{label} is {audio.shape[0] / sr:.1f} s long, over the {max_seconds:g} s limit; "
                         "trim it or raise the limit")
    if not np.isfinite(audio).all():
        raise InputError(f"{label} contains NaN or infinite samples; re-export it as 16-bit PCM")
    mono = audio.mean(axis=1, dtype=np.float64) if audio.shape[1] > 1 else audio[:, 0]
    return resample(mono, sr, target_sr)


@functools.lru_cache(maxsize=8)
def _kaiser_sinc_table(up: int, taps: int, scale: float, half_width: float, beta: float) -> np.ndarray:
    """Filter coefficients for each of the `up` fractional phases: row p holds the kernel centred p/up of an
    input sample to the right of tap taps/2 - 1. Each row sums to 1 so DC passes unchanged. Cached: a server
    sees the same few input rates again and again."""
    k = np.arange(taps)
    d = np.arange(up)[:, None] / up + (taps // 2 - 1) - k[None, :]
    inside = np.abs(d) <= half_width
    window = np.where(inside, np.i0(beta * np.sqrt(np.clip(1.0 - (d / half_width) ** 2, 0.0, None))), 0.0)
    table = np.sinc(scale * d) * window / np.i0(beta)
    table = (table / table.sum(axis=1, keepdims=True)).astype(np.float32)
    table.flags.writeable = False
    return table


def resample(x: np.ndarray, src_sr: int, dst_sr: int, *, zeros: int = 24, rolloff: float = 0.945,
             beta: float = 8.0, chunk: int = 8192) -> np.ndarray:
    """Band-limited resampling of a 1-D signal: a Kaiser-windowed sinc (`zeros` lobes each side, cutoff at
    `rolloff` of the lower Nyquist rate, about -80 dB stopband) evaluated in polyphase form for the reduced
    ratio dst/src. Output length is ceil(len * dst / src); deterministic; float32 out."""
    x = np.asarray(x)
    if x.ndim != 1:
        raise ValueError(f"resample takes a 1-D signal, got shape {x.shape}")
    if src_sr <= 0 or dst_sr <= 0:
        raise ValueError(f"sample rates must be positive, got {src_sr} and {dst_sr}")
    if src_sr == dst_sr or x.size == 0:
        return x.astype(np.float32, copy=True)
    g = math.gcd(int(src_sr), int(dst_sr))
    up, down = int(dst_sr) // g, int(src_sr) // g
    scale = rolloff * min(1.0, dst_sr / src_sr)  # cutoff as a fraction of the input Nyquist rate
    half_width = zeros / scale  # in input samples
    half = int(math.ceil(half_width)) + 1
    taps = 2 * half
    table = _kaiser_sinc_table(up, taps, scale, half_width, beta)
    # float32 throughout: long inputs are large, and its rounding (~-140 dB) is far below the filter's stopband.
    padded = np.pad(x.astype(np.float32, copy=False), (half, half))
    n_out = -(-x.size * up // down)
    out = np.empty(n_out, dtype=np.float32)
    offsets = np.arange(taps)
    for start in range(0, n_out, chunk):
        pos = np.arange(start, min(n_out, start + chunk), dtype=np.int64) * down
        whole, phase = pos // up, pos % up
        # Input sample j sits at padded index j + half; the first tap is j = whole - half + 1.
        window = padded[(whole + 1)[:, None] + offsets[None, :]]
        out[start : start + pos.size] = np.einsum("ij,ij->i", window, table[phase])
    return out


def encode_pcm16(samples) -> bytes:
    """Float samples as 16-bit little-endian PCM, clipped to [-1, 1] (OpenAI's `pcm16` and the Realtime API's
    `audio/pcm`)."""
    clipped = np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0)
    return (clipped * 32767.0).round().astype("<i2").tobytes()


def encode_wav(samples: np.ndarray, sr: int = OUTPUT_SAMPLE_RATE) -> bytes:
    """16-bit PCM WAV bytes. Float input is in [-1, 1] (clipped); int16 input is written as is; a 2-D input is
    (frames, channels)."""
    arr = np.asarray(samples)
    if arr.ndim not in (1, 2) or (arr.ndim == 2 and arr.shape[1] < 1):
        raise ValueError(f"audio must be (frames,) or (frames, channels), got shape {arr.shape}")
    if not isinstance(sr, int) or sr <= 0:
        raise ValueError(f"sample rate must be a positive integer, got {sr!r}")
    if arr.dtype == np.int16:
        pcm = arr
    elif np.issubdtype(arr.dtype, np.floating):
        if not np.isfinite(arr).all():
            raise ValueError("audio contains NaN or infinite samples")
        pcm = np.round(np.clip(arr, -1.0, 1.0) * 32767.0).astype(np.int16)
    else:
        raise ValueError(f"audio must be float or int16, got {arr.dtype}")
    channels = 1 if pcm.ndim == 1 else pcm.shape[1]
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(sr)
        w.writeframes(np.ascontiguousarray(pcm).astype("<i2").tobytes())
    return buf.getvalue()


def write_wav(path: str | os.PathLike, samples: np.ndarray, sr: int = OUTPUT_SAMPLE_RATE) -> Path:
    """Write 16-bit PCM WAV atomically: a killed run never leaves a half-written file."""
    atomic_write_bytes(path, encode_wav(samples, sr))
    return Path(path)


# ------------------------------------------------------------------------------------------------ images


def sniff_image(head: bytes) -> str | None:
    """The image format from its magic bytes (the first 16 are enough), or None."""
    if head[:8] == b"\x89PNG\r\n\x1a\n":
        return "PNG"
    if head[:3] == b"\xff\xd8\xff":
        return "JPEG"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return "TIFF"
    if head[:2] == b"BM":
        return "BMP"
    if head[4:12] in (b"ftypheic", b"ftypheix", b"ftypmif1", b"ftypavif"):
        return "HEIF/AVIF"
    return None


# The opening of a PNG, JPEG or WebP file once base64-encoded: bytes sent encoded twice.
_BASE64_IMAGE = (b"iVBORw0KGgo", b"/9j/", b"UklGR")


def describe_bytes(data: bytes) -> str | None:
    """What bytes that are not an image look like, where that can be told: "text", "WAV audio", "a PDF
    document"; None where they are binary and unknown."""
    head = data[:16]
    audio = _sniff_audio(head)
    if audio in ("MP4/M4A", "WebM/Matroska"):
        return f"{audio} (a video or audio container); send a video as a video part"
    if audio is not None:
        return f"{audio} audio"
    if head.startswith(b"%PDF"):
        return "a PDF document"
    if head[:2] == b"PK":
        return "a ZIP archive"
    try:
        text = data[:4096].decode("utf-8")
    except UnicodeDecodeError as exc:
        # a prefix may end inside a character: only an error before the last few bytes means binary
        if exc.start < min(len(data), 4096) - 3:
            return None
        text = data[: exc.start].decode("utf-8")
    if text and all(ch.isprintable() or ch in "\t\n\r\f" for ch in text):
        if text.lstrip().encode().startswith(_BASE64_IMAGE):
            return "an image base64-encoded twice; encode it once"
        return "text"
    return None


def load_image(src: Source, *, max_pixels: int = DEFAULT_MAX_PIXELS, name: str | None = None,
               max_bytes: int = DEFAULT_MAX_BYTES) -> Image.Image:
    """Decode a PNG, JPEG or WebP (a path or the file's bytes) to an RGB image, upright per its EXIF
    orientation, transparency flattened onto white. The size is read from the header and checked against
    `max_pixels` before any pixel is decoded, so a decompression bomb costs nothing."""
    label = _label(src, name, "image")
    data = _read_source(src, label, "image", max_bytes)
    fmt = sniff_image(data[:16])
    if fmt is not None and fmt not in IMAGE_FORMATS:
        raise InputError(f"{label}: {fmt} images are not supported; send PNG, JPEG or WebP")
    if fmt is None:
        looks = describe_bytes(data)
        raise InputError(f"{label}: not an image: PNG, JPEG or WebP expected"
                         + (f" (the bytes look like {looks})" if looks else ""))
    try:
        # Only the sniffed format's parser runs, so no other plugin ever sees untrusted bytes.
        image = Image.open(io.BytesIO(data), formats=[fmt])
    except Image.DecompressionBombError as exc:
        raise InputError(f"{label}: image is too large to decode safely ({exc}); downscale it first") from exc
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise InputError(f"{label}: corrupt or unreadable {fmt} image ({exc})") from exc
    width, height = image.size
    if width * height > max_pixels:
        raise InputError(f"{label}: {width}x{height} image is {width * height / 1e6:.1f} megapixels, over the "
                         f"{max_pixels / 1e6:g}-megapixel limit; downscale it first")
    if width == 0 or height == 0:
        raise InputError(f"{label}: image has no pixels ({width}x{height})")
    try:
        image.load()
        image = ImageOps.exif_transpose(image)
    except Image.DecompressionBombError as exc:
        raise InputError(f"{label}: image is too large to decode safely ({exc}); downscale it first") from exc
    except (OSError, SyntaxError, ValueError) as exc:
        raise InputError(f"{label}: corrupt or truncated {fmt} image ({exc})") from exc
    return to_rgb(image)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with 16-bit depth scaled (not clipped) to 8 bits and transparency composited onto white."""
    if image.mode.startswith("I;16") or image.mode == "I":
        arr = np.asarray(image, dtype=np.float64)
        if image.mode.startswith("I;16") or arr.max(initial=0) > 255:
            arr = arr / 257.0
        image = Image.fromarray(np.clip(np.round(arr), 0, 255).astype(np.uint8), "L")
    if image.mode in ("RGBA", "LA", "PA", "La", "RGBa") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image.convert("RGB") if image.mode != "RGB" else image.copy()


# ------------------------------------------------------------------------------------------------ synthetic


def _check_length(seconds: float, sr: int) -> int:
    if not (seconds > 0 and math.isfinite(seconds)):
        raise UsageError(f"synthetic audio length {seconds!r} s must be positive")
    if not isinstance(sr, int) or sr <= 0:
        raise UsageError(f"sample rate {sr!r} must be a positive integer")
    return int(round(seconds * sr))


def synth_tone(seconds: float, sr: int = INPUT_SAMPLE_RATE, freqs: Sequence[float] = (440.0,), *, amplitude: float = 0.5,
               noise: float = 0.0, seed: int = 0) -> np.ndarray:
    """A sum of sines with peak `amplitude`, plus Gaussian noise of standard deviation `noise`; float32."""
    n = _check_length(seconds, sr)
    if any(not 0 < f < sr / 2 for f in freqs) or not freqs:
        raise UsageError(f"tone frequencies {list(freqs)} must lie between 0 and {sr / 2:g} Hz (Nyquist)")
    t = np.arange(n) / sr
    rng = np.random.default_rng(seed)
    phases = rng.uniform(0, 2 * np.pi, len(freqs))
    signal = np.sum([np.sin(2 * np.pi * f * t + p) for f, p in zip(freqs, phases, strict=True)], axis=0)
    peak = np.abs(signal).max()
    signal = signal * (amplitude / peak) if peak > 0 else signal
    if noise > 0:
        signal = signal + rng.normal(0.0, noise, n)
    return signal.astype(np.float32)


# Rough vowel formants (F1, F2, F3) in Hz, so the spectrum has speech's shape.
_VOWELS = ((730, 1090, 2440), (270, 2290, 3010), (300, 870, 2240), (530, 1840, 2480), (570, 840, 2410))


def synth_speechlike(seconds: float, sr: int = INPUT_SAMPLE_RATE, seed: int = 0) -> np.ndarray:
    """Voice-like audio: a glottal harmonic series with pitch drift and vibrato (FM), shaped by vowel formants,
    in syllables of 120-300 ms (AM) grouped into words separated by pauses. Deterministic for a seed; float32
    with a peak of 0.5. Not speech, but it exercises an audio encoder with speech's spectrum and rhythm."""
    n = _check_length(seconds, sr)
    rng = np.random.default_rng(seed)
    out = np.zeros(n)
    t0 = 0.0
    while t0 < seconds:
        # A word: 1-4 syllables, then a pause.
        for _ in range(int(rng.integers(1, 5))):
            dur = float(rng.uniform(0.12, 0.30))
            start, stop = int(t0 * sr), min(n, int((t0 + dur) * sr))
            if start >= n:
                break
            t = np.arange(stop - start) / sr
            f0 = rng.uniform(100, 220) * (1 + 0.08 * (t / dur - 0.5)) * (1 + 0.01 * np.sin(2 * np.pi * 5.5 * t))
            phase = 2 * np.pi * np.cumsum(f0) / sr
            formants = _VOWELS[int(rng.integers(len(_VOWELS)))]
            voice = np.zeros_like(t)
            for h in range(1, int(min(4000, sr / 2 - 200) // 100)):
                freq = h * f0
                gain = sum(np.exp(-0.5 * ((freq - fm) / (60 + 0.1 * fm)) ** 2) for fm in formants) / h**0.5
                voice += np.where(freq < sr / 2, gain, 0.0) * np.sin(h * phase)
            envelope = np.sin(np.pi * np.clip(t / dur, 0, 1)) ** 2
            out[start:stop] += voice * envelope
            t0 += dur
        t0 += float(rng.uniform(0.15, 0.45))
    out += rng.normal(0.0, 1e-3 * (np.abs(out).max() or 1.0), n)  # a floor of room noise
    return (0.5 * out / np.abs(out).max()).astype(np.float32)


def synth_image(size: int | tuple[int, int] = 224, seed: int = 0, kind: str = "shapes") -> Image.Image:
    """A deterministic RGB test image: random filled shapes, a two-axis colour gradient, or a checkerboard."""
    width, height = (size, size) if isinstance(size, int) else size
    if width <= 0 or height <= 0:
        raise UsageError(f"image size {size!r} must be positive")
    rng = np.random.default_rng(seed)
    if kind == "gradient":
        x = np.linspace(0, 1, width)[None, :, None]
        y = np.linspace(0, 1, height)[:, None, None]
        c0, c1, c2 = (rng.uniform(0, 255, 3) for _ in range(3))
        arr = c0 * (1 - x) * (1 - y) + c1 * x + c2 * y * (1 - x)
        return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), "RGB")
    if kind == "checker":
        cell = max(1, min(width, height) // 8)
        a, b = rng.integers(0, 256, (2, 3), dtype=np.uint8)
        mask = ((np.arange(height)[:, None] // cell + np.arange(width)[None, :] // cell) % 2).astype(bool)
        return Image.fromarray(np.where(mask[:, :, None], a, b).astype(np.uint8), "RGB")
    if kind == "shapes":
        image = Image.new("RGB", (width, height), tuple(int(v) for v in rng.integers(0, 256, 3)))
        draw = ImageDraw.Draw(image)
        for _ in range(int(rng.integers(4, 9))):
            x0, x1 = sorted(int(v) for v in rng.integers(0, width, 2))
            y0, y1 = sorted(int(v) for v in rng.integers(0, height, 2))
            box = (x0, y0, max(x1, x0 + 1), max(y1, y0 + 1))
            fill = tuple(int(v) for v in rng.integers(0, 256, 3))
            shape = int(rng.integers(3))
            if shape == 0:
                draw.rectangle(box, fill=fill)
            elif shape == 1:
                draw.ellipse(box, fill=fill)
            else:
                draw.polygon([(box[0], box[3]), ((box[0] + box[2]) // 2, box[1]), (box[2], box[3])], fill=fill)
        return image
    raise UsageError(f"unknown synthetic image kind {kind!r}; choose shapes, gradient or checker")
