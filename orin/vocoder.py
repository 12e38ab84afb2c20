"""code2wav in chunks with left context, so audio streams as codec frames arrive. The chunk schedule is fixed
(not driven by timing), so a streamed request and a non-streamed one produce the same samples."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from . import components as C
from .contract import AudioChunk
from .request_state import RequestState


class Vocoder:
    def __init__(self, model, device, state: RequestState, make_resident: Callable[[], None], measure):
        """`make_resident()` stages code2wav (the engine's residency); `measure(stage)` is the power meter's
        stage context."""
        self.model, self.device = model, device
        self.state = state
        self.make_resident = make_resident
        self.measure = measure
        self.frames: list = []
        self.done = 0
        self.index = 0

    def feed(self, frames, final: bool) -> Iterator[AudioChunk]:
        import torch

        self.frames.extend(frames)
        while True:
            want = C.CODE2WAV_FIRST_CHUNK if self.done == 0 else C.CODE2WAV_CHUNK
            available = len(self.frames) - self.done
            if available <= 0 or (available < want and not final):
                return
            end = self.done + min(want, available)
            ctx = min(C.CODE2WAV_LEFT_CONTEXT, self.done)
            self.make_resident()
            codes = torch.stack(self.frames[self.done - ctx:end], dim=1).unsqueeze(0).to(self.device)
            c2w = self.model.code2wav
            with self.measure("code2wav"):
                wav = c2w(codes)[..., ctx * int(c2w.total_upsample):]
            samples = wav.reshape(-1).float().cpu().numpy()
            new_frames = tuple(tuple(int(c) for c in f.tolist()) for f in self.frames[self.done:end])
            self.done = end
            if self.state.first_audio is None:
                self.state.first_audio = time.perf_counter() - self.state.t0
                self.state.mark("first_audio")
            self.state.audio_samples += samples.size
            yield AudioChunk(samples, self.index, new_frames)
            self.index += 1
