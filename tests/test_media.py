"""Audio and image decoding, resampling quality, WAV output and synthetic inputs."""

from __future__ import annotations

import io
import struct
import time
import zlib

import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from orin.errors import InputError, UsageError
from orin.inputs import media
from orin.inputs.media import (
    encode_wav,
    load_audio,
    load_image,
    resample,
    synth_image,
    synth_speechlike,
    synth_tone,
    write_wav,
)


def sine(freq, sr, seconds=1.0, amp=0.5):
    return (amp * np.sin(2 * np.pi * freq * np.arange(int(sr * seconds)) / sr)).astype(np.float32)


def audio_bytes(data, sr, fmt="WAV", subtype=None):
    buf = io.BytesIO()
    sf.write(buf, data, sr, format=fmt, subtype=subtype)
    return buf.getvalue()


def tone_fit(x, sr, margin=0.1):
    """Frequency (FFT peak, zero-padded, parabolic) and amplitude (least squares) of a pure tone, away from edges."""
    core = x[int(len(x) * margin) : int(len(x) * (1 - margin))].astype(np.float64)
    n = 1 << 20
    spec = np.abs(np.fft.rfft(core * np.hanning(core.size), n))
    k = int(np.argmax(spec))
    a, b, c = spec[k - 1], spec[k], spec[k + 1]
    freq = (k + 0.5 * (a - c) / (a - 2 * b + c)) * sr / n
    t = np.arange(core.size) / sr
    basis = np.stack([np.sin(2 * np.pi * freq * t), np.cos(2 * np.pi * freq * t)], axis=1)
    coef, *_ = np.linalg.lstsq(basis, core, rcond=None)
    residual = core - basis @ coef
    return freq, float(np.hypot(*coef)), float(np.sqrt(np.mean(residual**2)))


# ------------------------------------------------------------------------------------------------ resampling


@pytest.mark.parametrize("src_sr", [44_100, 48_000, 22_050, 8_000, 11_025])
def test_resampling_keeps_frequency_amplitude_and_length(src_sr):
    x = sine(1000.0, src_sr)
    y = resample(x, src_sr, 16_000)
    assert y.dtype == np.float32 and y.shape == (16_000,)
    freq, amp, residual = tone_fit(y, 16_000)
    assert freq == pytest.approx(1000.0, rel=0.01)
    assert amp == pytest.approx(0.5, rel=0.01)
    assert residual < 1e-3  # band-limited: no images or aliases around the tone


def test_resampling_removes_content_above_the_new_nyquist():
    # A 10 kHz tone cannot exist at 16 kHz; naive interpolation would alias it to 6 kHz at full strength.
    y = resample(sine(10_000.0, 44_100), 44_100, 16_000)
    core = y[2000:-2000]
    assert np.sqrt(np.mean(core**2)) < 0.5 / np.sqrt(2) * 0.01


def test_resampling_identity_and_odd_rates():
    x = sine(440.0, 16_000)
    assert np.array_equal(resample(x, 16_000, 16_000), x)
    y = resample(sine(440.0, 44_099, seconds=0.5), 44_099, 16_000)  # coprime rates: 16000 phases
    assert y.size == int(np.ceil(44_099 * 0.5 * 16_000 / 44_099))
    assert tone_fit(y, 16_000)[1] == pytest.approx(0.5, rel=0.01)
    assert np.array_equal(resample(x, 16_000, 24_000), resample(x, 16_000, 24_000))  # deterministic
    with pytest.raises(ValueError):
        resample(np.zeros((2, 10)), 16_000, 8_000)


# ------------------------------------------------------------------------------------------------ load_audio


def test_load_wav_path_resamples_to_16k(tmp_path):
    path = tmp_path / "a.wav"
    sf.write(path, sine(1000.0, 48_000, seconds=0.5), 48_000, subtype="PCM_16")
    y = load_audio(path)
    assert y.dtype == np.float32 and y.shape == (8000,)
    assert tone_fit(y, 16_000)[0] == pytest.approx(1000.0, rel=0.01)


def test_stereo_is_averaged_to_mono():
    left = sine(440.0, 16_000)
    stereo = np.stack([left, 0.5 * left], axis=1)
    y = load_audio(audio_bytes(stereo, 16_000, subtype="FLOAT"))
    np.testing.assert_allclose(y, 0.75 * left, atol=1e-6)


def test_flac_round_trip(tmp_path):
    x = sine(300.0, 16_000, seconds=0.25)
    path = tmp_path / "a.flac"
    sf.write(path, x, 16_000, format="FLAC", subtype="PCM_16")
    np.testing.assert_allclose(load_audio(path), x, atol=1.5 / 32768)
    np.testing.assert_allclose(load_audio(path.read_bytes()), x, atol=1.5 / 32768)


@pytest.mark.skipif(not media.mp3_supported(), reason="libsndfile without MP3")
def test_mp3_decodes_when_libsndfile_can():
    y = load_audio(audio_bytes(sine(440.0, 16_000), 16_000, fmt="MP3"))
    assert abs(y.size - 16_000) < 2000
    assert tone_fit(y, 16_000)[0] == pytest.approx(440.0, rel=0.01)


def test_mp3_without_decoder_says_what_is_needed(monkeypatch):
    monkeypatch.setattr(media, "mp3_supported", lambda: False)
    with pytest.raises(InputError, match=r"song.mp3: MP3 decoding needs libsndfile >= 1.1"):
        load_audio(b"ID3\x04\x00\x00\x00\x00\x00\x00" + b"\x00" * 100, name="song.mp3")


def test_missing_audio_file_is_named(tmp_path):
    with pytest.raises(InputError, match=r"audio file not found: .*nope\.wav"):
        load_audio(tmp_path / "nope.wav")


def test_corrupt_audio_is_refused(tmp_path):
    good = audio_bytes(sine(440.0, 16_000), 16_000, subtype="PCM_16")
    bad = good[:12] + b"\xff" * 40  # a WAV header, then garbage where the fmt chunk should be
    path = tmp_path / "bad.wav"
    path.write_bytes(bad)
    with pytest.raises(InputError, match=r"bad\.wav: corrupt or unreadable WAV audio"):
        load_audio(path)


def test_non_audio_bytes_are_refused():
    png = io.BytesIO()
    Image.new("RGB", (4, 4)).save(png, "PNG")
    with pytest.raises(InputError, match="not a supported audio file"):
        load_audio(png.getvalue())
    with pytest.raises(InputError, match="MP4/M4A audio is not supported"):
        load_audio(b"\x00\x00\x00\x20ftypM4A " + b"\x00" * 64, name="voice.m4a")
    with pytest.raises(InputError, match="empty"):
        load_audio(b"")


def test_zero_length_audio_is_refused():
    with pytest.raises(InputError, match="no audio samples"):
        load_audio(audio_bytes(np.zeros(0, dtype=np.float32), 16_000, subtype="PCM_16"), name="silence.wav")


def test_too_long_audio_is_refused_before_decoding():
    data = audio_bytes(sine(440.0, 16_000, seconds=2.0), 16_000, subtype="PCM_16")
    with pytest.raises(InputError, match=r"long.wav is 2.0 s long, over the 1.5 s limit"):
        load_audio(data, max_seconds=1.5, name="long.wav")
    assert load_audio(data, max_seconds=2.0).size == 32_000


def test_non_finite_float_audio_is_refused():
    x = sine(440.0, 16_000, seconds=0.1)
    x[10] = np.nan
    with pytest.raises(InputError, match="NaN"):
        load_audio(audio_bytes(x, 16_000, subtype="FLOAT"))


# ------------------------------------------------------------------------------------------------ wav out


def test_encode_wav_is_16_bit_pcm_and_clips(tmp_path):
    x = np.array([0.0, 0.5, -0.5, 1.5, -2.0], dtype=np.float32)
    data = encode_wav(x, sr=24_000)
    info = sf.info(io.BytesIO(data))
    assert (info.samplerate, info.channels, info.subtype, info.frames) == (24_000, 1, "PCM_16", 5)
    back, _ = sf.read(io.BytesIO(data), dtype="int16")
    assert back.tolist() == [0, 16384, -16384, 32767, -32767]
    stereo = encode_wav(np.zeros((10, 2), dtype=np.int16), sr=16_000)
    assert sf.info(io.BytesIO(stereo)).channels == 2
    with pytest.raises(ValueError, match="NaN"):
        encode_wav(np.array([np.nan]))

    path = write_wav(tmp_path / "out" / "a.wav", sine(440.0, 24_000, seconds=0.1))
    assert path.read_bytes()[:4] == b"RIFF" and list(path.parent.iterdir()) == [path]
    np.testing.assert_allclose(load_audio(path, target_sr=24_000), sine(440.0, 24_000, 0.1), atol=1 / 32767)


# ------------------------------------------------------------------------------------------------ images


def png_bytes(image):
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return buf.getvalue()


def test_png_and_jpeg_load_as_rgb(tmp_path):
    src = synth_image(64, seed=3)
    out = load_image(png_bytes(src))
    assert out.mode == "RGB" and out.size == (64, 64)
    assert np.array_equal(np.asarray(out), np.asarray(src))
    path = tmp_path / "a.jpg"
    src.save(path, "JPEG", quality=95)
    out = load_image(path)
    assert out.mode == "RGB" and out.size == (64, 64)
    assert np.abs(np.asarray(out, dtype=int) - np.asarray(src, dtype=int)).mean() < 8


def test_transparency_goes_onto_white_and_16_bit_is_scaled():
    rgba = Image.new("RGBA", (8, 8), (255, 0, 0, 0))
    rgba.putpixel((0, 0), (0, 0, 255, 255))
    out = load_image(png_bytes(rgba))
    assert out.getpixel((0, 0)) == (0, 0, 255) and out.getpixel((5, 5)) == (255, 255, 255)
    deep = Image.fromarray(np.full((4, 4), 65535, dtype=np.uint16))
    assert load_image(png_bytes(deep)).getpixel((1, 1)) == (255, 255, 255)
    half = Image.fromarray(np.full((4, 4), 32896, dtype=np.uint16))
    assert load_image(png_bytes(half)).getpixel((1, 1)) == (128, 128, 128)


def test_exif_orientation_is_applied():
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    buf = io.BytesIO()
    Image.new("RGB", (40, 20), (10, 200, 10)).save(buf, "JPEG", exif=exif)
    assert load_image(buf.getvalue()).size == (20, 40)


def hand_made_png(width, height, idat=b"not zlib at all"):
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def test_50_megapixel_png_is_refused_from_its_header(monkeypatch):
    # The pixel data is garbage: decoding it would fail with a different error, so this proves nothing is decoded.
    bomb = hand_made_png(8000, 6250)
    loads = []
    monkeypatch.setattr(Image.Image, "load", lambda self: loads.append(1))
    start = time.perf_counter()
    with pytest.raises(InputError, match=r"bomb.png: 8000x6250 image is 50.0 megapixels, over the 16-megapixel"):
        load_image(bomb, name="bomb.png")
    assert time.perf_counter() - start < 1.0 and loads == []
    # Past Pillow's own bomb limit too.
    with pytest.raises(InputError, match="megapixels|too large"):
        load_image(hand_made_png(20000, 20000), max_pixels=10**9)


def test_corrupt_images_are_refused_naming_the_file(tmp_path):
    path = tmp_path / "broken.png"
    path.write_bytes(hand_made_png(16, 16))
    with pytest.raises(InputError, match=r"broken\.png: corrupt or truncated PNG image"):
        load_image(path)
    truncated = tmp_path / "cut.jpg"
    buf = io.BytesIO()
    synth_image(64).save(buf, "JPEG")
    truncated.write_bytes(buf.getvalue()[:200])
    with pytest.raises(InputError, match=r"cut\.jpg: corrupt"):
        load_image(truncated)
    with pytest.raises(InputError, match="image file not found"):
        load_image(tmp_path / "missing.png")


def test_unsupported_image_formats_are_refused():
    gif = io.BytesIO()
    Image.new("P", (4, 4)).save(gif, "GIF")
    with pytest.raises(InputError, match="GIF images are not supported; send PNG, JPEG or WebP"):
        load_image(gif.getvalue())
    with pytest.raises(InputError, match=r"^image bytes: not an image: PNG, JPEG or WebP expected "
                                          r"\(the bytes look like text\)$"):
        load_image(b"hello, I am text\n")


@pytest.mark.parametrize("data, looks", [
    ("Grüße, ça va?\n".encode()[:8], "text"),  # cut inside a character: still text
    (encode_wav(np.zeros(160, np.float32), sr=16000), "WAV audio"),
    (b"%PDF-1.7\n%\xe2\xe3", "a PDF document"),
    (b"iVBORw0KGgoAAAANSUhEUg==", "an image base64-encoded twice; encode it once"),
    (b"\x00\x01\x02\x03binary", None),
])
def test_what_a_non_image_looks_like_is_said(data, looks):
    with pytest.raises(InputError) as info:
        load_image(data, name="photo")
    message = str(info.value)
    assert message.startswith("photo: not an image: PNG, JPEG or WebP expected")
    assert message.endswith(f"(the bytes look like {looks})" if looks else "expected"), message


def test_a_still_image_sent_as_a_video_is_named_alike_from_a_path_and_from_bytes(tmp_path):
    from orin.inputs.video import load_video

    buf = io.BytesIO()
    synth_image(64).save(buf, "JPEG")
    path = tmp_path / "photo.jpg"
    path.write_bytes(buf.getvalue())
    messages = []
    for src in (path, buf.getvalue()):
        with pytest.raises(InputError) as info:
            load_video(src, name="clip")
        messages.append(str(info.value))
    assert messages == ["clip is a still image (JPEG), not a video; send it as an image"] * 2


def test_webp_loads():
    buf = io.BytesIO()
    synth_image(32, kind="checker").save(buf, "WEBP", lossless=True)
    assert np.array_equal(np.asarray(load_image(buf.getvalue())), np.asarray(synth_image(32, kind="checker")))


# ------------------------------------------------------------------------------------------------ synthetic


def test_synth_tone_is_deterministic_and_shaped():
    a = synth_tone(0.5, freqs=(440.0, 880.0), noise=0.01, seed=1)
    assert a.dtype == np.float32 and a.shape == (8000,)
    assert np.array_equal(a, synth_tone(0.5, freqs=(440.0, 880.0), noise=0.01, seed=1))
    assert not np.array_equal(a, synth_tone(0.5, freqs=(440.0, 880.0), noise=0.01, seed=2))
    clean = synth_tone(1.0, freqs=(1000.0,))
    assert np.abs(clean).max() == pytest.approx(0.5, rel=1e-3)
    assert tone_fit(clean, 16_000)[0] == pytest.approx(1000.0, rel=1e-3)
    with pytest.raises(UsageError, match="Nyquist"):
        synth_tone(1.0, freqs=(9000.0,))
    with pytest.raises(UsageError):
        synth_tone(0.0)


def test_synth_speechlike_has_speech_rhythm_and_spectrum():
    x = synth_speechlike(3.0, seed=0)
    assert x.dtype == np.float32 and x.shape == (48_000,)
    assert np.array_equal(x, synth_speechlike(3.0, seed=0))
    assert not np.array_equal(x, synth_speechlike(3.0, seed=1))
    assert np.abs(x).max() == pytest.approx(0.5)
    frames = x[: x.size // 320 * 320].reshape(-1, 320)  # 20 ms frames
    rms = np.sqrt((frames.astype(np.float64) ** 2).mean(axis=1))
    assert (rms < 0.01 * rms.max()).mean() > 0.1  # pauses
    assert (rms > 0.1 * rms.max()).mean() > 0.3  # voiced syllables
    spec = np.abs(np.fft.rfft(x)) ** 2
    freqs = np.fft.rfftfreq(x.size, 1 / 16_000)
    assert spec[(freqs > 80) & (freqs < 4000)].sum() > 0.99 * spec.sum()


def test_synth_image_kinds():
    for kind in ("shapes", "gradient", "checker"):
        image = synth_image(96, seed=5, kind=kind)
        assert image.mode == "RGB" and image.size == (96, 96)
        assert np.array_equal(np.asarray(image), np.asarray(synth_image(96, seed=5, kind=kind)))
        assert len(np.unique(np.asarray(image).reshape(-1, 3), axis=0)) > 1
    assert not np.array_equal(np.asarray(synth_image(96, seed=5)), np.asarray(synth_image(96, seed=6)))
    assert synth_image((64, 32), kind="gradient").size == (64, 32)
    with pytest.raises(UsageError, match="unknown synthetic image kind"):
        synth_image(kind="noise")
