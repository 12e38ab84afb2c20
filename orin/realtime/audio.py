"""The Realtime API's audio formats: `audio/pcm` (16-bit little-endian mono at 24 kHz, the GA default, in and out)
and G.711 `audio/pcmu` (mu-law) and `audio/pcma` (A-law) at 8 kHz, accepted as input for telephony clients. Output
is `audio/pcm` at 24 kHz only: the rate code2wav speaks at, sent as it comes.

G.711 input is kept at 8 kHz in the input buffer and resampled once, band-limited, when it is committed (to the
engine's 16 kHz); the VAD, which takes 24 kHz, gets it through a streaming linear interpolation (`Upsampler`),
which is enough for a detector: telephone audio carries nothing above 3.4 kHz, and the interpolation's images
(around 8 and 16 kHz, attenuated by its sinc-squared response) fall where the VAD's own 24 -> 16 kHz filter cuts.
"""

from __future__ import annotations

import base64
import functools

from .events import EventError

PCM_RATE = 24_000
INPUT_FORMATS = {"audio/pcm": PCM_RATE, "audio/pcmu": 8_000, "audio/pcma": 8_000}
OUTPUT_FORMATS = {"audio/pcm": PCM_RATE}


@functools.lru_cache(maxsize=2)
def g711_table(law: str):
    """The 256 float32 values G.711 `law` ("mu" or "a") decodes each byte to, in [-1, 1) (ITU-T G.711's
    16-bit linear values / 32768)."""
    import numpy as np

    codes = np.arange(256)
    if law == "mu":
        u = ~codes & 0xFF
        exponent, mantissa = (u >> 4) & 0x07, u & 0x0F
        magnitude = (((mantissa << 3) + 0x84) << exponent) - 0x84
        linear = np.where(u & 0x80, -magnitude, magnitude)
    else:
        a = codes ^ 0x55
        exponent, mantissa = (a >> 4) & 0x07, a & 0x0F
        magnitude = np.where(exponent == 0, (mantissa << 4) + 8, ((mantissa << 4) + 0x108) << (exponent - 1))
        linear = np.where(a & 0x80, magnitude, -magnitude)
    table = (linear / 32768.0).astype(np.float32)
    table.flags.writeable = False
    return table


def decode(raw: bytes, fmt: str, param: str = "audio"):
    """`raw` bytes of input format `fmt` as float32 mono samples at the format's rate (INPUT_FORMATS)."""
    import numpy as np

    if fmt == "audio/pcm":
        if len(raw) % 2:
            raise EventError(f"'{param}' holds {len(raw)} bytes, an odd number: audio/pcm is 16-bit samples, two "
                             "bytes each", code="invalid_audio", param=param)
        return np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    law = {"audio/pcmu": "mu", "audio/pcma": "a"}[fmt]
    return g711_table(law)[np.frombuffer(raw, dtype=np.uint8)]


def encode_pcm(samples) -> str:
    """Float samples as base64 16-bit little-endian PCM (what `response.output_audio.delta` carries)."""
    from ..inputs.media import encode_pcm16

    return base64.b64encode(encode_pcm16(samples)).decode("ascii")


class Upsampler:
    """Streaming linear interpolation by an integer factor (8 kHz -> 24 kHz: 3), for the VAD's input. Each input
    sample yields `factor` outputs ending on it, interpolated from the sample before (carried between calls), so
    the output does not depend on how the input is cut."""

    def __init__(self, factor: int):
        self.factor = factor
        self._last = 0.0

    def __call__(self, x):
        import numpy as np

        x = np.asarray(x, dtype=np.float32)
        if self.factor == 1 or x.size == 0:
            return x
        prev = np.concatenate([[self._last], x[:-1]]).astype(np.float32)
        steps = (np.arange(1, self.factor + 1, dtype=np.float32) / self.factor)[None, :]
        out = prev[:, None] * (1 - steps) + x[:, None] * steps  # the last phase is the input sample itself
        self._last = float(x[-1])
        return out.reshape(-1).astype(np.float32)
