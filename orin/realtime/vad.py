"""The Realtime API's server VAD: the session's `server_vad` settings, Silero VAD (its ONNX model from the
silero-vad package, run by onnxruntime on one CPU thread) and the turn detector that turns the session's 24 kHz
input audio into speech-started and speech-stopped events on the session's audio timeline."""

from __future__ import annotations

import functools
import importlib.util
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InputError, OrinError

INSTALL_HINT = "pip install 'orin-omni[serve]'"
DEFAULT_PARAM = "session.audio.input.turn_detection"


class VadError(OrinError):
    """The VAD model or its runtime is missing or unusable, or the detector was handed audio it cannot take."""


class VadConfigError(InputError):
    """A turn_detection setting the server refuses; `param` is the offending field's dotted path."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


# --- settings ---------------------------------------------------------------------------------------------------

MIN_SILENCE_MS = 32  # one Silero window: a shorter silence is never seen
MIN_IDLE_TIMEOUT_MS = 1000  # OpenAI documents no range for idle_timeout_ms; below a second it would fire mid-reply

_FIELDS = ("threshold", "prefix_padding_ms", "silence_duration_ms", "create_response", "interrupt_response",
           "idle_timeout_ms")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ServerVad:
    """The GA session's audio.input.turn_detection {"type": "server_vad", ...}, with OpenAI's defaults."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True
    idle_timeout_ms: int | None = None

    @classmethod
    def from_json(cls, obj: dict, param: str = DEFAULT_PARAM) -> ServerVad:
        """Validate a client's turn_detection object; fields left out take OpenAI's defaults. Raises
        VadConfigError naming the offending field."""
        if not isinstance(obj, dict):
            raise VadConfigError(f"{param} must be an object such as {{\"type\": \"server_vad\"}} (or null to turn "
                                 f"turn detection off), got {type(obj).__name__}", param)
        kind = obj.get("type")
        if kind == "semantic_vad":
            raise VadConfigError(f"{param}.type 'semantic_vad' is not supported by this server: use "
                                 "{\"type\": \"server_vad\"} (Silero VAD with threshold, prefix_padding_ms and "
                                 "silence_duration_ms), or null and commit the audio buffer yourself", f"{param}.type")
        if kind != "server_vad":
            got = "missing" if "type" not in obj else f"got {kind!r}"
            raise VadConfigError(f"{param}.type must be 'server_vad' ({got})", f"{param}.type")
        unknown = sorted(set(obj) - {"type", *_FIELDS})
        if unknown:
            raise VadConfigError(f"{param} has unknown field(s) {', '.join(map(repr, unknown))}; server_vad takes "
                                 f"{', '.join(_FIELDS)}", f"{param}.{unknown[0]}")
        values = {name: obj[name] for name in _FIELDS if name in obj}

        if "threshold" in values:
            t = values["threshold"]
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not 0 <= t <= 1:
                raise VadConfigError(f"{param}.threshold must be a number from 0.0 to 1.0 (0.5 by default; higher "
                                     f"needs louder speech), got {t!r}", f"{param}.threshold")
            values["threshold"] = float(t)
        for name, low in (("prefix_padding_ms", 0), ("silence_duration_ms", MIN_SILENCE_MS)):
            if name in values and (not _is_int(values[name]) or values[name] < low):
                raise VadConfigError(f"{param}.{name} must be a whole number of milliseconds >= {low}, "
                                     f"got {values[name]!r}", f"{param}.{name}")
        for name in ("create_response", "interrupt_response"):
            if name in values and not isinstance(values[name], bool):
                raise VadConfigError(f"{param}.{name} must be true or false, got {values[name]!r}",
                                     f"{param}.{name}")
        idle = values.get("idle_timeout_ms")
        if idle is not None and (not _is_int(idle) or idle < MIN_IDLE_TIMEOUT_MS):
            raise VadConfigError(f"{param}.idle_timeout_ms must be null (no idle timeout) or a whole number of "
                                 f"milliseconds >= {MIN_IDLE_TIMEOUT_MS}, got {idle!r}", f"{param}.idle_timeout_ms")
        return cls(**values)

    def to_json(self) -> dict:
        """The object echoed in session.created / session.updated: every field, defaults included."""
        return {"type": "server_vad", **{name: getattr(self, name) for name in _FIELDS}}

    @property
    def release_threshold(self) -> float:
        """Where a turn's speech counts as stopped: Silero's own recommendation (get_speech_timestamps'
        neg_threshold) of threshold - 0.15, floored at 0.01; the gap keeps a probability that wavers around
        the threshold inside a word from ending the turn."""
        return max(self.threshold - 0.15, 0.01)


# --- Silero VAD -------------------------------------------------------------------------------------------------


def default_model_path() -> Path:
    """silero_vad/data/silero_vad.onnx inside the installed silero-vad package, found without importing the
    package (its code imports torch)."""
    spec = importlib.util.find_spec("silero_vad")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in locations:
        path = Path(root) / "data" / "silero_vad.onnx"
        if path.is_file():
            return path
    raise VadError(f"the server VAD needs Silero VAD's ONNX model from the silero-vad package, which is not "
                   f"installed (or has no data/silero_vad.onnx): {INSTALL_HINT}")


@functools.lru_cache(maxsize=4)
def _session(path: str):
    """One onnxruntime session per model file, shared by every SileroVad: the recurrent state lives outside the
    session, and InferenceSession.run may be called from several threads at once."""
    try:
        import onnxruntime
    except ImportError as exc:
        raise VadError(f"the server VAD needs onnxruntime: {INSTALL_HINT}") from exc
    opts = onnxruntime.SessionOptions()
    # The GPU and the other CPU cores belong to the model being served: one thread, CPU only, errors-only logging.
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    try:
        session = onnxruntime.InferenceSession(path, sess_options=opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime's load errors (NoSuchFile, InvalidProtobuf, Fail) share no other base
        raise VadError(f"cannot load the VAD model {path}: {exc}; reinstall it with {INSTALL_HINT}") from exc
    inputs = {i.name: i.type for i in session.get_inputs()}
    expected = {"input": "tensor(float)", "state": "tensor(float)", "sr": "tensor(int64)"}
    if inputs != expected or len(session.get_outputs()) != 2:
        raise VadError(f"{path} is not Silero VAD v5's ONNX model (inputs {inputs}, expected {expected}); "
                       f"point at silero_vad/data/silero_vad.onnx from {INSTALL_HINT}")
    return session


class SileroVad:
    """Silero VAD v5 on 16 kHz audio, one 512-sample (32 ms) window per call, following silero-vad's OnnxWrapper:
    each window goes in with the last 64 samples of the one before prepended, and the recurrent state carries
    over."""

    SAMPLE_RATE = 16_000
    WINDOW = 512
    CONTEXT = 64

    def __init__(self, model_path: str | None = None):
        self.model_path = str(model_path) if model_path is not None else str(default_model_path())
        self._session = _session(self.model_path)
        self._sr = np.array(self.SAMPLE_RATE, dtype=np.int64)
        self.reset()

    def reset(self) -> None:
        """Fresh recurrent state and context (silence before the next window)."""
        self._state = np.zeros((2, 1, 128), dtype=np.float32)
        self._input = np.zeros((1, self.CONTEXT + self.WINDOW), dtype=np.float32)

    def __call__(self, window) -> float:
        """The probability that `window` (512 float32 samples at 16 kHz) is speech."""
        window = np.asarray(window, dtype=np.float32)
        if window.shape != (self.WINDOW,):
            raise VadError(f"SileroVad takes one window of {self.WINDOW} samples at {self.SAMPLE_RATE} Hz, "
                           f"got shape {window.shape}")
        self._input[0, : self.CONTEXT] = self._input[0, -self.CONTEXT :]
        self._input[0, self.CONTEXT :] = window
        prob, self._state = self._session.run(None, {"input": self._input, "state": self._state, "sr": self._sr})
        return float(prob[0, 0])


# --- 24 kHz -> 16 kHz -------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _polyphase(taps_per_phase: int, cutoff_hz: float, beta: float) -> np.ndarray:
    """The two phases (rows) of a Kaiser-windowed sinc low-pass designed at 48 kHz, each normalised to unit DC
    gain; row p, column j holds the tap applied to input sample n_hi - j."""
    length = 2 * taps_per_phase - 1  # odd, so the filter is symmetric about a whole sample: zero phase
    n = np.arange(length) - (taps_per_phase - 1)
    fc = cutoff_hz / 48_000
    h = 2 * fc * np.sinc(2 * fc * n) * np.kaiser(length, beta)
    h = np.append(h, 0.0)
    phases = np.stack([h[0::2], h[1::2]])
    return (phases / phases.sum(axis=1, keepdims=True)).astype(np.float32)


class Resampler24To16:
    """Streaming 24 kHz -> 16 kHz (an exact 3:2 ratio): a zero-phase FIR low-pass in polyphase form with the
    input history carried between calls. Output sample m is the 16 kHz sample at time m / 16000 s of the stream,
    computed once its last input sample has arrived (0.6 ms of lookahead), so the output is the same however the
    input is cut.

    Good enough for a VAD: 63 taps at 48 kHz (Kaiser, beta 8, cutoff 7 kHz) keep 0-5 kHz flat to 0.01 dB, where
    the speech cues Silero relies on lie, and everything that could alias below 7 kHz (input above 9 kHz) is down
    80 dB; only the 8-9 kHz band folds, at -23 dB or less, onto 7-8 kHz, which carries almost no speech energy."""

    TAPS = 32  # per phase
    CUTOFF_HZ = 7000.0
    BETA = 8.0

    def __init__(self):
        self._g = _polyphase(self.TAPS, self.CUTOFF_HZ, self.BETA)
        self._delay = self.TAPS - 1  # the filter's centre, in 48 kHz samples
        self._m = 0  # next output sample
        self._base = self._lowest_input(0)  # absolute index of _buf[0]; input before 0 is silence
        self._buf = np.zeros(-self._base, dtype=np.float32)

    def _last_input(self, m: int) -> int:
        return (3 * m + self._delay) // 2

    def _lowest_input(self, m: int) -> int:
        return self._last_input(m) - (self.TAPS - 1)

    def __call__(self, x) -> np.ndarray:
        """The 16 kHz samples that the 24 kHz samples `x` complete (float32; may be empty)."""
        x = np.asarray(x, dtype=np.float32)
        if x.ndim != 1:
            raise VadError(f"the resampler takes mono samples (a 1-D array), got shape {x.shape}")
        buf = np.concatenate([self._buf, x]) if x.size else self._buf
        total = self._base + buf.size  # input samples seen, absolute
        # Output m can be made once input (3m + delay) // 2 has arrived.
        end = max(self._m, (2 * total - 1 - self._delay) // 3 + 1)
        out = np.empty(end - self._m, dtype=np.float32)
        for first in (self._m, self._m + 1):
            count = len(range(first, end, 2))
            if count == 0:
                continue
            # Outputs two apart move 3 input samples on, with the same phase: strided slices, one per tap. The
            # per-tap loop fixes each sample's summation order, which keeps the output bit-identical across
            # chunkings (a matrix product may sum differently at the edge of a block).
            q = 3 * first + self._delay
            start, phase = q // 2 - self._base, q % 2
            acc = np.zeros(count, dtype=np.float32)
            for j, g in enumerate(self._g[phase]):
                lo = start - j
                acc += g * buf[lo : lo + 3 * (count - 1) + 1 : 3]
            out[first - self._m :: 2] = acc
        self._m = end
        keep = self._lowest_input(end)
        self._buf = buf[keep - self._base :]
        self._base = keep
        return out


# --- turns ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpeechStarted:
    audio_start_ms: int  # where the turn's audio starts: onset minus prefix_padding_ms, clamped to >= 0


@dataclass(frozen=True)
class SpeechStopped:
    audio_end_ms: int  # where speech ended (the start of the silence that ended the turn)


class TurnDetector:
    """OpenAI's server_vad on the session's input audio. A turn starts at the first 32 ms window whose speech
    probability reaches `threshold` and stops once the probability has stayed below the release threshold for
    `silence_duration_ms`. Positions are milliseconds from the start of all audio fed during the session."""

    INPUT_RATE = 24_000  # the Realtime API's audio/pcm: 16-bit mono at 24 kHz (the caller converts to float32)

    def __init__(self, cfg: ServerVad, vad: SileroVad | None = None):
        self.cfg = cfg
        self.vad = vad if vad is not None else SileroVad()
        self._release = cfg.release_threshold
        self._window_ms = self.vad.WINDOW * 1000 // self.vad.SAMPLE_RATE  # 32
        self._resample = Resampler24To16()
        self._pending = np.zeros(0, dtype=np.float32)  # 16 kHz samples short of a whole window
        self._fed = 0  # 24 kHz samples fed
        self._windows = 0  # windows run
        self._speaking = False
        self._silence_from: int | None = None  # ms where the current run of below-release windows began
        self.last_probability = 0.0  # the latest window's, for logs and metrics

    @property
    def speaking(self) -> bool:
        return self._speaking

    @property
    def position_ms(self) -> int:
        """Milliseconds of audio fed so far: the session's audio timeline."""
        return self._fed * 1000 // self.INPUT_RATE

    def configure(self, cfg: ServerVad) -> None:
        """Take new settings (session.update) without losing the timeline; a turn in progress goes on under them."""
        self.cfg = cfg
        self._release = cfg.release_threshold

    def reset_turn(self) -> None:
        """Forget a turn in progress (input_audio_buffer.clear / commit). The timeline, the resampler and the
        model's state go on: the audio itself has not restarted."""
        self._speaking = False
        self._silence_from = None

    def feed(self, samples) -> list:
        """Take float32 mono samples at 24 kHz (any length, even none); return the SpeechStarted and
        SpeechStopped events this audio completes, in order."""
        x = np.asarray(samples, dtype=np.float32)
        if x.ndim != 1:
            raise VadError(f"the turn detector takes mono samples (a 1-D array), got shape {x.shape}")
        self._fed += x.size
        y = self._resample(x)
        pending = np.concatenate([self._pending, y]) if y.size else self._pending
        events = []
        size = self.vad.WINDOW
        whole = pending.size // size * size
        for lo in range(0, whole, size):
            event = self._window(pending[lo : lo + size])
            if event is not None:
                events.append(event)
        self._pending = pending[whole:]
        return events

    def _window(self, window: np.ndarray) -> SpeechStarted | SpeechStopped | None:
        start_ms = self._windows * self._window_ms
        end_ms = start_ms + self._window_ms
        self._windows += 1
        prob = self.last_probability = self.vad(window)
        if not self._speaking:
            if prob >= self.cfg.threshold:
                self._speaking = True
                self._silence_from = None
                return SpeechStarted(audio_start_ms=max(0, start_ms - self.cfg.prefix_padding_ms))
            return None
        if prob >= self.cfg.threshold:
            self._silence_from = None
        elif prob < self._release and self._silence_from is None:
            self._silence_from = start_ms
        # Between the two thresholds a silence already begun goes on counting, as in Silero's own segmentation.
        if self._silence_from is not None and end_ms - self._silence_from >= self.cfg.silence_duration_ms:
            self._speaking = False
            end, self._silence_from = self._silence_from, None
            return SpeechStopped(audio_end_ms=end)
        return None
