"""The audio formats around the model, in one place: what the encoder takes, what code2wav gives, and the
talker's codec frame rate that ties speech length to frames."""

INPUT_SAMPLE_RATE = 16_000  # audio into the audio encoder (Whisper features)
OUTPUT_SAMPLE_RATE = 24_000  # speech out of code2wav
CODEC_FRAMES_PER_SECOND = 12.5  # one codec frame per 80 ms of speech
SAMPLES_PER_FRAME = int(OUTPUT_SAMPLE_RATE / CODEC_FRAMES_PER_SECOND)  # 1920
