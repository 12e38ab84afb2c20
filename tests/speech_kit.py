"""Real speech for the voice tests: espeak-ng (Debian's package, installed by `make system-deps`) speaking a
sentence, as float32 mono at the rate asked for, and the helpers that turn it into what clients send.

A test that needs speech fails (it does not skip) when espeak-ng is missing: a skipped voice test would pass CI
without hearing anything."""

from __future__ import annotations

import functools
import io
import shutil
import subprocess

import numpy as np
import soundfile as sf

from orin.inputs.media import encode_pcm16, resample


def espeak_path() -> str:
    path = shutil.which("espeak-ng")
    if path is None:
        raise RuntimeError("espeak-ng is not installed: run `make system-deps` (Debian/Ubuntu package espeak-ng)")
    return path


@functools.lru_cache(maxsize=64)
def _spoken(text: str, voice: str, words_per_minute: int) -> tuple[np.ndarray, int]:
    out = subprocess.run([espeak_path(), "-v", voice, "-s", str(words_per_minute), "--stdout", text],
                         check=True, capture_output=True, timeout=60).stdout
    samples, sr = sf.read(io.BytesIO(out), dtype="float32", always_2d=False)
    samples.setflags(write=False)
    return samples, sr


def speak(text: str, sr: int = 24_000, *, voice: str = "en-us", words_per_minute: int = 160) -> np.ndarray:
    """`text` spoken by espeak-ng (22.05 kHz), resampled to `sr`: float32 mono in [-1, 1]."""
    samples, native = _spoken(text, voice, words_per_minute)
    return resample(samples, native, sr).astype(np.float32) if native != sr else samples.copy()


def silence(seconds: float, sr: int = 24_000) -> np.ndarray:
    return np.zeros(int(round(seconds * sr)), dtype=np.float32)


def pcm16(samples: np.ndarray) -> bytes:
    """Little-endian 16-bit PCM, the Realtime API's `audio/pcm`."""
    return encode_pcm16(samples)


def wav_bytes(samples: np.ndarray, sr: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, sr, format="WAV", subtype="PCM_16")
    return buf.getvalue()
