"""Whisper log-mel features of the request's audio, the numbers transformers' WhisperFeatureExtractor gives
(its torch path) under the Qwen3-Omni processor's settings, and how many `<|audio_pad|>` tokens each audio becomes.

Shape logic, as the Qwen3-Omni processor does it: the audios of one prompt are padded with `padding_value` to the
longest (never truncated, never padded to `chunk_length`: the processor asks for padding="longest",
truncation=False, so a 40 s audio gives 4000 frames), one centred STFT over the batch, the last frame dropped, so
an audio of L samples in a batch of longest Lmax has Lmax // hop frames of which ceil(L / hop) are real (the
feature attention mask). The log-mel floor (max - 8) is taken per audio over its padded frames, as Whisper's.

The audio encoder turns F real frames into tokens chunk by chunk (chunks of 2 * n_window frames, each through
three stride-2 convolutions): orin.audio_format.audio_token_count, the one formula for the processor, the positions
and the encoder (13 tokens for a whole 100-frame chunk).

The mel filter bank (slaney scale and norm, 0..8000 Hz as Whisper fixes it) is computed once per setting in
float64 like transformers' mel_filter_bank; its float32 copy and the Hann window are kept per device. On the host
the features are bit-identical to transformers'; on CUDA they are its CUDA path's, whose FFT (cuFFT) rounds
differently from the host's: a few values in 10^5 differ from the host's by up to ~1.3e-5.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from ..audio_format import audio_token_count
from ..errors import InputError, ModelError

_MAX_MEL_HZ = 8000.0  # Whisper's filter bank stops at 8 kHz whatever the sampling rate


@dataclass(frozen=True)
class AudioSettings:
    feature_size: int = 128
    sampling_rate: int = 16000
    hop_length: int = 160
    n_fft: int = 400
    chunk_length: int = 300  # read for completeness: the Qwen3-Omni processor neither pads nor truncates to it
    padding_value: float = 0.0
    dither: float = 0.0
    n_window: int = 50

    @classmethod
    def from_values(cls, values: dict, defaults: dict, n_window: int, source: str) -> AudioSettings:
        """`values` from the checkpoint's file, completed by `defaults`."""
        get = {**defaults, **values}.get
        try:
            settings = cls(int(get("feature_size")), int(get("sampling_rate")), int(get("hop_length")),
                           int(get("n_fft")), int(get("chunk_length")), float(get("padding_value")),
                           float(get("dither")), int(n_window))
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelError(f"{source}: the feature extractor's settings are unreadable ({exc!r})") from exc
        if min(settings.feature_size, settings.sampling_rate, settings.hop_length, settings.n_fft) <= 0:
            raise ModelError(f"{source}: feature_size, sampling_rate, hop_length and n_fft must be positive")
        return settings


def _hz_to_mel(freq: float) -> float:
    if freq >= 1000.0:
        return 15.0 + np.log(freq / 1000.0) * (27.0 / np.log(6.4))
    return 3.0 * freq / 200.0


def _mel_to_hz(mels: np.ndarray) -> np.ndarray:
    freq = 200.0 * mels / 3.0
    high = mels >= 15.0
    freq[high] = 1000.0 * np.exp((np.log(6.4) / 27.0) * (mels[high] - 15.0))
    return freq


@lru_cache(maxsize=8)
def mel_filters(n_fft: int, n_mels: int, sampling_rate: int) -> np.ndarray:
    """[1 + n_fft // 2, n_mels] float64: Whisper's slaney filter bank, the operations of mel_filter_bank."""
    n_freq = 1 + n_fft // 2
    mel_freqs = np.linspace(_hz_to_mel(0.0), _hz_to_mel(_MAX_MEL_HZ), n_mels + 2)
    filter_freqs = _mel_to_hz(mel_freqs)
    fft_freqs = np.linspace(0, sampling_rate // 2, n_freq)
    diff = np.diff(filter_freqs)
    slopes = np.expand_dims(filter_freqs, 0) - np.expand_dims(fft_freqs, 1)
    down = -slopes[:, :-2] / diff[:-1]
    up = slopes[:, 2:] / diff[1:]
    filters = np.maximum(np.zeros(1), np.minimum(down, up))
    filters *= np.expand_dims(2.0 / (filter_freqs[2:n_mels + 2] - filter_freqs[:n_mels]), 0)
    filters.setflags(write=False)
    return filters


@dataclass(frozen=True)
class AudioFeatures:
    input_features: torch.Tensor  # [n_audio, feature_size, frames] float32, on the device it was computed on
    feature_attention_mask: torch.Tensor  # [n_audio, frames] int32, on the host
    frames: tuple[int, ...]  # real frames of each audio (the mask's row sums)
    token_counts: tuple[int, ...]  # `<|audio_pad|>` tokens of each audio


class LogMel:
    """The feature extractor of one checkpoint; `__call__` featurises the audios of one prompt together."""

    def __init__(self, settings: AudioSettings):
        self.settings = settings
        self._constants: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def _window_and_filters(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = str(device)
        if key not in self._constants:
            s = self.settings
            window = torch.hann_window(s.n_fft, device=device)
            filters = torch.from_numpy(mel_filters(s.n_fft, s.feature_size, s.sampling_rate).copy())
            self._constants[key] = (window, filters.to(device, torch.float32))
        return self._constants[key]

    def __call__(self, audios, device: str | torch.device | None = None) -> AudioFeatures:
        s = self.settings
        waves = [_mono(a, i, s) for i, a in enumerate(audios)]
        if not waves:
            raise InputError("no audio to featurise")
        longest = max(len(w) for w in waves)
        if longest <= s.n_fft // 2:  # the centred STFT reflects n_fft // 2 samples at each end
            raise InputError(f"the audio has {longest} samples; at least {s.n_fft // 2 + 1} "
                             f"({(s.n_fft // 2 + 1) / s.sampling_rate * 1000:.1f} ms) are needed")
        batch = np.full((len(waves), longest), s.padding_value, dtype=np.float32)
        for i, w in enumerate(waves):
            batch[i, :len(w)] = w
        device = torch.device(device or "cpu")
        window, filters = self._window_and_filters(device)
        wave = torch.from_numpy(batch).to(device)
        if s.dither != 0.0:
            wave += s.dither * torch.randn(wave.shape, dtype=wave.dtype, device=wave.device)
        stft = torch.stft(wave, s.n_fft, s.hop_length, window=window, return_complex=True)
        power = (stft[..., :-1].abs() ** 2).contiguous()
        log_spec = torch.clamp(filters.T @ power, min=1e-10).log10()
        floor = log_spec.amax(dim=(1, 2), keepdim=True) - 8.0
        features = (torch.maximum(log_spec, floor) + 4.0) / 4.0
        n_frames = longest // s.hop_length
        frames = tuple(min(math.ceil(len(w) / s.hop_length), n_frames) for w in waves)
        mask = (torch.arange(n_frames) < torch.tensor(frames)[:, None]).to(torch.int32)
        tokens = tuple(audio_token_count(f, s.n_window) for f in frames)
        return AudioFeatures(features, mask, frames, tokens)


def waveform_key(audio, frames: int) -> bytes:
    """A digest of one audio's samples (as float32), their count and its feature frames: what the engine keeps
    an audio's encoder tokens under between requests. Not of its features: on a GPU the STFT and the mel
    projection of a batch round differently with the batch's shape, so the same audio in another turn's batch
    gave other feature bits (an earlier turn's audio was re-encoded on some turns). The frames count: the
    longest audio of a batch gets a frame fewer than it would beside a longer one (LogMel), and so its tokens."""
    wave = np.ascontiguousarray(np.asarray(audio, dtype=np.float32))
    return hashlib.blake2b(wave.tobytes(), digest_size=20, person=f"{wave.size}:{frames}".encode()[:16]).digest()


def _mono(audio, index: int, s: AudioSettings) -> np.ndarray:
    wave = np.asarray(audio, dtype=np.float32)
    if wave.ndim != 1:
        raise InputError(f"audio {index} has shape {wave.shape}: give mono samples at {s.sampling_rate} Hz "
                         "(one number per sample)")
    if len(wave) == 0:
        raise InputError(f"audio {index} is empty")
    return wave
