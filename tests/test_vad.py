"""The Realtime API's server VAD on real speech (espeak-ng): turn boundaries against the signal's own energy,
silence and noise, chunking invariance, thresholds, the session timeline across reset_turn, and the server_vad
settings' defaults and validation."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from speech_kit import silence, speak

from orin.errors import InputError, OrinError
from orin.realtime import vad as vad_module
from orin.realtime.vad import (
    Resampler24To16,
    ServerVad,
    SileroVad,
    SpeechStarted,
    SpeechStopped,
    TurnDetector,
    VadConfigError,
    VadError,
)

SR = TurnDetector.INPUT_RATE
FRAME = SR // 100  # 10 ms
ACTIVE_RMS = 0.01  # -40 dBFS: a 10 ms frame this loud is speech, espeak's padding is far below
CHUNK = 480  # 20 ms, a typical client append


def frame_rms(x: np.ndarray) -> np.ndarray:
    n = x.size // FRAME
    return np.sqrt(np.mean(x[: n * FRAME].astype(np.float64).reshape(n, FRAME) ** 2, axis=1))


def active_span_ms(x: np.ndarray) -> tuple[int, int]:
    """The first and last loud 10 ms frames: where speech truly starts and ends in `x`."""
    active = np.nonzero(frame_rms(x) > ACTIVE_RMS)[0]
    return int(active[0]) * 10, (int(active[-1]) + 1) * 10


def sentence(text: str, scale: float = 1.0) -> np.ndarray:
    """`text` spoken at 24 kHz, cut to its loud frames: espeak pads its output with ~0.4 s of near-silence, which
    would lengthen every gap a test builds."""
    x = speak(text, SR)
    start, end = active_span_ms(x)
    return x[start * SR // 1000 : end * SR // 1000] * np.float32(scale)


def join(*parts: np.ndarray) -> np.ndarray:
    return np.concatenate(parts).astype(np.float32)


def run(audio: np.ndarray, cfg: ServerVad | None = None, chunk: int = CHUNK, detector: TurnDetector | None = None):
    """Feed `audio` in `chunk`-sample appends; each event with the timeline position before and after the
    feed that returned it."""
    det = detector if detector is not None else TurnDetector(cfg or ServerVad())
    out = []
    for lo in range(0, audio.size, chunk):
        before = det.position_ms
        out += [(event, before, det.position_ms) for event in det.feed(audio[lo : lo + chunk])]
    return out


def events_of(audio, cfg=None, chunk=CHUNK):
    return [event for event, _, _ in run(audio, cfg, chunk)]


def turns(events) -> list[tuple[int, int]]:
    """(start, end) per completed turn; the events must alternate start, stop."""
    assert [type(e) for e in events] == [SpeechStarted, SpeechStopped] * (len(events) // 2)
    return [(a.audio_start_ms, b.audio_end_ms) for a, b in zip(events[::2], events[1::2], strict=True)]


FIRST = "Please turn on the kitchen lights."
SECOND = "What time is it now?"


@pytest.fixture(scope="module")
def first():
    return sentence(FIRST)


@pytest.fixture(scope="module")
def second():
    return sentence(SECOND)


# ------------------------------------------------------------------------------------------------- turns


@pytest.mark.parametrize("silence_ms", [500, 800])
def test_one_sentence_is_one_turn_at_its_true_bounds(first, silence_ms):
    audio = join(silence(1.0), first, silence(2.0))
    onset_ms, end_ms = active_span_ms(audio)
    cfg = ServerVad(silence_duration_ms=silence_ms)
    det = TurnDetector(cfg)
    got = run(audio, detector=det)
    assert [type(e) for e, _, _ in got] == [SpeechStarted, SpeechStopped]
    (started, _, started_at), (stopped, before, after) = got
    assert abs(started.audio_start_ms - (onset_ms - cfg.prefix_padding_ms)) <= 150
    assert end_ms <= stopped.audio_end_ms <= end_ms + 300
    # Returned by the feed that completes the silence (a whole 32 ms window, and the resampler's 0.6 ms lookahead).
    assert before < stopped.audio_end_ms + silence_ms + 32 + 1
    assert after >= stopped.audio_end_ms + silence_ms
    assert started_at < stopped.audio_end_ms
    assert not det.speaking
    assert det.position_ms == audio.size * 1000 // SR


def test_speaking_between_start_and_stop(first):
    det = TurnDetector(ServerVad())
    seen = []
    audio = join(silence(0.5), first, silence(1.0))
    for lo in range(0, audio.size, CHUNK):
        events = det.feed(audio[lo : lo + CHUNK])
        seen.append((tuple(type(e) for e in events), det.speaking))
    kinds = [k for k, _ in seen]
    i, j = kinds.index((SpeechStarted,)), kinds.index((SpeechStopped,))
    assert all(speaking for _, speaking in seen[i:j]) and not any(speaking for _, speaking in seen[:i] + seen[j:])


@pytest.mark.parametrize("gap_s, expected", [(1.2, 2), (0.25, 1)])
def test_a_gap_longer_than_silence_duration_splits_turns(first, second, gap_s, expected):
    audio = join(silence(1.0), first, silence(gap_s), second, silence(1.5))
    found = turns(events_of(audio, ServerVad(silence_duration_ms=500)))
    assert len(found) == expected
    first_end_ms = 1000 + first.size * 1000 // SR
    second_onset_ms = first_end_ms + int(gap_s * 1000)
    assert found[0][0] < 1000 and found[-1][1] >= second_onset_ms + second.size * 1000 // SR
    if expected == 2:
        assert first_end_ms <= found[0][1] < second_onset_ms
        assert abs(found[1][0] - (second_onset_ms - ServerVad().prefix_padding_ms)) <= 150


def pink_noise(n: int, rms: float, seed: int) -> np.ndarray:
    spectrum = np.fft.rfft(np.random.default_rng(seed).standard_normal(n))
    f = np.arange(spectrum.size, dtype=np.float64)
    f[0] = 1.0
    x = np.fft.irfft(spectrum / np.sqrt(f), n)
    return (x * (rms / np.sqrt(np.mean(x**2)))).astype(np.float32)


@pytest.mark.parametrize("kind", ["silence", "white -50 dBFS", "white -40 dBFS", "pink -50 dBFS", "pink -40 dBFS"])
def test_silence_and_low_level_noise_are_not_speech(kind):
    n = 8 * SR
    if kind == "silence":
        audio = silence(8.0)
    elif kind.startswith("white"):
        rms = 10 ** (int(kind.split()[1]) / 20)
        audio = (np.random.default_rng(5).standard_normal(n) * rms).astype(np.float32)
    else:
        audio = pink_noise(n, 10 ** (int(kind.split()[1]) / 20), seed=6)
    det = TurnDetector(ServerVad())
    assert run(audio, detector=det, chunk=2400) == []
    assert not det.speaking and det.position_ms == 8000


def test_events_do_not_depend_on_how_the_audio_is_cut(first, second):
    audio = join(silence(0.7), first, silence(1.2), second, silence(0.3), first, silence(1.0))
    whole = TurnDetector(ServerVad()).feed(audio)
    rng = np.random.default_rng(17)
    det = TurnDetector(ServerVad())
    pieces, sizes, lo = [], [], 0
    while lo < audio.size:
        size = int(rng.choice([0, 1, 2, int(rng.integers(3, 4000))], p=[0.15, 0.15, 0.1, 0.6]))
        pieces.append(det.feed(audio[lo : lo + size]))
        sizes.append(size)
        lo += size
    assert {0, 1} <= set(sizes)
    assert [e for p in pieces for e in p] == whole
    assert len(turns(whole)) == 2  # the 0.3 s pause does not end a turn
    assert det.position_ms == audio.size * 1000 // SR


def test_a_higher_threshold_never_finds_more_turns(first, second):
    # Speech at -48, 0, -40 and -34 dB. Silero adapts to the level it has heard, so the quieter sentences score
    # around the thresholds. Not a law for any audio: the release threshold moves with `threshold`, and near its
    # 0.01 floor a low threshold can hold one turn across a pause that a higher one splits.
    audio = join(silence(1.0), second * np.float32(0.004), silence(1.2), first, silence(1.2),
                 second * np.float32(0.01), silence(1.2), first * np.float32(0.02), silence(1.5))
    thresholds = [0.3, 0.5, 0.7, 0.9, 0.97]
    found = [turns(events_of(audio, ServerVad(threshold=t))) for t in thresholds]
    counts = [len(f) for f in found]
    assert counts == sorted(counts, reverse=True)
    assert counts[0] > counts[-1] >= 1
    for lower, higher in zip(found, found[1:], strict=False):
        # Each turn a stricter detector finds lies inside speech the looser one found too.
        assert all(any(s0 <= e1 and s1 <= e0 for s0, e0 in lower) for s1, e1 in higher)


def test_positions_keep_counting_across_reset_turn(first, second):
    audio = join(silence(1.0), first, silence(1.2), second, silence(1.5))
    plain = events_of(audio)
    assert len(turns(plain)) == 2

    # A reset between turns (after a commit) changes nothing, and later positions are session-relative.
    det = TurnDetector(ServerVad())
    cut = (plain[1].audio_end_ms + 600) * SR // 1000
    events = [e for e, _, _ in run(audio[:cut], detector=det)]
    position = det.position_ms
    det.reset_turn()
    assert det.position_ms == position and not det.speaking
    events += [e for e, _, _ in run(audio[cut:], detector=det)]
    assert events == plain and events[2].audio_start_ms > position - 1000

    # A reset mid-turn (input_audio_buffer.clear) forgets the turn: no stop for it, and the speech that goes on
    # opens a new turn at the current position, not at 0.
    det = TurnDetector(ServerVad())
    lo = 0
    while not det.speaking:
        det.feed(audio[lo : lo + CHUNK])
        lo += CHUNK
    det.feed(audio[lo : lo + 10 * CHUNK])
    lo += 10 * CHUNK
    position = det.position_ms
    det.reset_turn()
    assert not det.speaking and det.position_ms == position
    after = [e for e, _, _ in run(audio[lo:], detector=det)]
    assert [type(e) for e in after] == [SpeechStarted, SpeechStopped] * 2
    assert position - 300 - 32 <= after[0].audio_start_ms <= position
    assert after[1:] == plain[1:]


def test_configure_keeps_the_timeline(first):
    audio = join(silence(1.0), first, silence(2.0))
    plain = events_of(audio, ServerVad(silence_duration_ms=500))
    det = TurnDetector(ServerVad(silence_duration_ms=500))
    half = 1500 * SR // 1000  # inside the sentence
    events = run(audio[:half], detector=det)
    det.configure(ServerVad(silence_duration_ms=1000))
    assert det.speaking and det.position_ms == 1500
    rest = run(audio[half:], detector=det)
    assert [e for e, _, _ in events + rest] == plain  # the same silence ends the turn, found later
    (_, before, after), = [r for r in rest if isinstance(r[0], SpeechStopped)]
    assert plain[1].audio_end_ms + 1000 <= after and before < plain[1].audio_end_ms + 1000 + 32 + 1


def test_feed_takes_empty_and_single_samples():
    det = TurnDetector(ServerVad())
    assert det.feed(np.zeros(0, dtype=np.float32)) == [] and det.position_ms == 0
    for _ in range(24):
        assert det.feed(np.zeros(1, dtype=np.float32)) == []
    assert det.position_ms == 1
    with pytest.raises(VadError, match="mono"):
        det.feed(np.zeros((2, 480), dtype=np.float32))


# ------------------------------------------------------------------------------------------ the model itself


def test_silero_matches_the_reference_wrapper():
    """Same probabilities as silero-vad's own OnnxWrapper (torch) on the same 16 kHz windows."""
    torch = pytest.importorskip("torch")
    from silero_vad.utils_vad import OnnxWrapper

    x = np.concatenate([speak(FIRST, 16_000), np.zeros(8000, dtype=np.float32)])
    windows = x[: x.size // 512 * 512].reshape(-1, 512)
    ours = SileroVad()
    reference = OnnxWrapper(ours.model_path, force_onnx_cpu=True)
    got = np.array([ours(w) for w in windows])
    want = np.array([reference(torch.from_numpy(w.copy()), 16_000).item() for w in windows])
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert got.max() > 0.9 and got.min() < 0.1
    ours.reset()
    assert np.array_equal(np.array([ours(w) for w in windows]), got)


def test_silero_refuses_a_window_of_the_wrong_size():
    with pytest.raises(VadError, match="512 samples"):
        SileroVad()(np.zeros(480, dtype=np.float32))


def test_a_missing_model_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setattr(vad_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(VadError, match=r"pip install 'orin-omni\[serve\]'"):
        SileroVad()
    monkeypatch.undo()
    bad = tmp_path / "broken.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(VadError, match="cannot load the VAD model"):
        SileroVad(str(bad))


# ------------------------------------------------------------------------------------------------ resampler


def test_resampler_keeps_speech_band_tones_and_removes_what_would_alias():
    t24, t16 = np.arange(SR) / SR, np.arange(16_000) / 16_000
    for freq in (300.0, 1000.0, 3000.0, 5000.0):
        y = Resampler24To16()((0.5 * np.sin(2 * np.pi * freq * t24)).astype(np.float32))
        want = 0.5 * np.sin(2 * np.pi * freq * t16[: y.size])
        assert np.max(np.abs(y[64:] - want[64:])) < 2e-3, freq
    for freq in (9500.0, 11_000.0):
        y = Resampler24To16()((0.5 * np.sin(2 * np.pi * freq * t24)).astype(np.float32))
        assert np.sqrt(np.mean(y[64:] ** 2)) < 1e-4, freq


def test_resampler_output_is_bit_identical_however_the_input_is_cut():
    x = np.random.default_rng(3).standard_normal(3 * SR).astype(np.float32)
    whole = Resampler24To16()(x)
    rs, rng, parts, lo = Resampler24To16(), np.random.default_rng(4), [], 0
    while lo < x.size:
        size = int(rng.choice([0, 1, 2, 3, int(rng.integers(4, 5000))]))
        parts.append(rs(x[lo : lo + size]))
        lo += size
    assert np.array_equal(np.concatenate(parts), whole)
    assert 0 <= 2 * x.size // 3 - whole.size <= 11  # all but the lookahead's last samples


# -------------------------------------------------------------------------------------------------- settings


def test_defaults_are_openais():
    assert ServerVad().to_json() == {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300,
                                     "silence_duration_ms": 500, "create_response": True,
                                     "interrupt_response": True, "idle_timeout_ms": None}
    assert ServerVad.from_json({"type": "server_vad"}) == ServerVad()
    assert ServerVad().release_threshold == pytest.approx(0.35)
    assert ServerVad(threshold=0.1).release_threshold == 0.01


def test_to_json_from_json_round_trip():
    cfg = ServerVad(threshold=0.7, prefix_padding_ms=120, silence_duration_ms=800, create_response=False,
                    interrupt_response=False, idle_timeout_ms=6000)
    assert ServerVad.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg
    one = ServerVad.from_json({"type": "server_vad", "threshold": 1})
    assert one.threshold == 1.0 and isinstance(one.threshold, float)


BASE = "session.audio.input.turn_detection"
BAD = [
    (["server_vad"], "", "must be an object"),
    ({}, ".type", "must be 'server_vad'"),
    ({"type": "none"}, ".type", "must be 'server_vad'"),
    ({"type": "semantic_vad", "eagerness": "low"}, ".type", "not supported by this server: use"),
    ({"type": "server_vad", "threshold": 1.5}, ".threshold", "from 0.0 to 1.0"),
    ({"type": "server_vad", "threshold": -0.1}, ".threshold", "from 0.0 to 1.0"),
    ({"type": "server_vad", "threshold": "0.5"}, ".threshold", "from 0.0 to 1.0"),
    ({"type": "server_vad", "threshold": True}, ".threshold", "from 0.0 to 1.0"),
    ({"type": "server_vad", "threshold": math.nan}, ".threshold", "from 0.0 to 1.0"),
    ({"type": "server_vad", "prefix_padding_ms": -1}, ".prefix_padding_ms", ">= 0"),
    ({"type": "server_vad", "prefix_padding_ms": 1.5}, ".prefix_padding_ms", "whole number"),
    ({"type": "server_vad", "prefix_padding_ms": "300"}, ".prefix_padding_ms", "whole number"),
    ({"type": "server_vad", "silence_duration_ms": 10}, ".silence_duration_ms", ">= 32"),
    ({"type": "server_vad", "silence_duration_ms": 500.0}, ".silence_duration_ms", "whole number"),
    ({"type": "server_vad", "silence_duration_ms": False}, ".silence_duration_ms", "whole number"),
    ({"type": "server_vad", "create_response": "yes"}, ".create_response", "true or false"),
    ({"type": "server_vad", "interrupt_response": 1}, ".interrupt_response", "true or false"),
    ({"type": "server_vad", "idle_timeout_ms": 500}, ".idle_timeout_ms", ">= 1000"),
    ({"type": "server_vad", "idle_timeout_ms": "5000"}, ".idle_timeout_ms", "null"),
    ({"type": "server_vad", "eagerness": "low", "zz": 1}, ".eagerness", "'eagerness', 'zz'"),
]


@pytest.mark.parametrize("obj, suffix, message", BAD, ids=[f"{s or 'object'}-{i}" for i, (_, s, _) in enumerate(BAD)])
def test_each_bad_field_is_refused_with_its_path(obj, suffix, message):
    with pytest.raises(VadConfigError, match=message) as info:
        ServerVad.from_json(obj)
    assert info.value.param == BASE + suffix
    assert isinstance(info.value, InputError) and isinstance(info.value, OrinError)
    with pytest.raises(VadConfigError) as info:
        ServerVad.from_json(obj, param="turn_detection")
    assert info.value.param == "turn_detection" + suffix
