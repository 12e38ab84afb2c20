"""The audio formats around the model, in one place: what the encoder takes, what code2wav gives, and the
talker's codec frame rate that ties speech length to frames."""

INPUT_SAMPLE_RATE = 16_000  # audio into the audio encoder (Whisper features)
INPUT_HOP = 160  # samples a Whisper feature frame advances by at 16 kHz (Qwen3-Omni's preprocessor: 10 ms)
OUTPUT_SAMPLE_RATE = 24_000  # speech out of code2wav
CODEC_FRAMES_PER_SECOND = 12.5  # one codec frame per 80 ms of speech
SAMPLES_PER_FRAME = int(OUTPUT_SAMPLE_RATE / CODEC_FRAMES_PER_SECOND)  # 1920


def conv_length(n):
    """Frames left after the audio encoder's three stride-2, kernel-3, padding-1 convolutions (ints or integer
    arrays)."""
    for _ in range(3):
        n = (n - 1) // 2 + 1
    return n


def conv_batch(chunks: int, chunksize: int) -> int:
    """The batch the audio encoder's convolutions run at for a part of `chunks` chunks (at most `chunksize`,
    the config's conv_chunksize): the next power of two, capped at `chunksize`, the rest zero chunks whose output
    is dropped. cuDNN plans a convolution per input shape on its first sight; unpadded, every Realtime turn's audio
    (a length of its own) would be a new shape, where padded a handful of shapes recur."""
    return min(chunksize, 1 << max(0, chunks - 1).bit_length())


def audio_token_count(frames: int, n_window: int = 50) -> int:
    """Audio tokens the encoder makes of `frames` Whisper feature frames, cut into chunks of 2 * n_window: whole
    chunks plus the tail's. The one formula for the processor's placeholders, the M-RoPE positions and the
    encoder (HF writes a full chunk's 13 tokens as a constant: conv_length(100) at Qwen3-Omni's n_window 50)."""
    chunk = 2 * n_window
    tail = frames % chunk
    return (frames // chunk) * conv_length(chunk) + (conv_length(tail) if tail else 0)


def frame_aligned(audio):
    """16 kHz samples padded with silence to a whole number of feature frames (under 10 ms more). A prompt's
    audios are featurised as one batch whose longest gets a frame fewer when its length is not a whole number of
    frames (orin.inputs.audio_features), so a conversation's earlier turn, the longest of its own prompt, would get
    another frame count, other tokens and another cache key once a longer turn joins it: the rows a next turn
    shares with the last would end at that audio. Aligned, an audio has the same frames in every batch."""
    import numpy as np

    audio = np.asarray(audio, dtype=np.float32)
    short = -len(audio) % INPUT_HOP
    return np.concatenate([audio, np.zeros(short, np.float32)]) if short else audio
