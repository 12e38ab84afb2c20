"""code2wav in chunks with left context, so audio streams as codec frames arrive. The chunk schedule is fixed
(not driven by timing), so a streamed request and a non-streamed one produce the same samples."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from ..contract import AudioChunk
from ..device.profile import SpeechTuning
from .request_state import RequestState


class Vocoder:
    def __init__(self, model, device, state: RequestState, make_resident: Callable[[], None], graphs, measure,
                 speech: SpeechTuning):
        """`make_resident()` stages code2wav (the engine's residency); `graphs`: an orin.runtime.encoder_graphs
        EncoderGraphs where code2wav's weights stay put (all-resident), else None; `measure(stage)` is the power
        meter's stage context; `speech`: the device profile's chunk schedule."""
        self.model, self.device = model, device
        self.speech = speech
        self.graphs = graphs
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
            want = self.speech.chunk_frames(self.done)
            available = len(self.frames) - self.done
            if available <= 0 or (available < want and not final):
                return
            end = self.done + min(want, available)
            ctx = min(self.speech.code2wav_left_context, self.done)
            self.make_resident()
            codes = torch.stack(self.frames[self.done - ctx:end], dim=1).unsqueeze(0).to(self.device)
            c2w = self.model.code2wav
            with self.measure("code2wav"):
                wav = self._decode(c2w, codes, want + ctx)[..., ctx * int(c2w.total_upsample):]
            samples = wav.reshape(-1).float().cpu().numpy()
            new_frames = tuple(tuple(int(c) for c in f.tolist()) for f in self.frames[self.done:end])
            self.done = end
            if self.state.first_audio is None:
                self.state.mark("first_audio")  # one clock reading for both: the report's and the timeline's
                self.state.first_audio = self.state.timeline["first_audio"]
            self.state.audio_samples += samples.size
            yield AudioChunk(samples, self.index, new_frames)
            self.index += 1

    def _decode(self, c2w, codes, size: int):
        """code2wav of one chunk, `size` frames with its left context where whole: the schedule's recurring
        shapes (chunk_frames: 1, 3, 7, 15, 31, then 57 frames with the context) replayed from CUDA graphs where
        the weights stay put. Eager, a chunk is ~1,000 small kernels launched from Python, and a first chunk took
        137 ms instead of 21 on an H200 in a server.

        The last chunk (and a reply shorter than a chunk) is padded on the right with code 0 to the shape of
        its place in the schedule and its samples cut back: code2wav is causal (a sample never depends on a later
        frame) and n frames give n*total_upsample samples less a constant, so the samples are those of the
        chunk alone (to rounding), and it replays a graph instead of running eagerly at a length never seen
        before. Padded without graphs too (time-sliced, CPU): every budget gives the same samples, bit for bit."""
        import torch.nn.functional as F

        frames = codes.shape[-1]
        if frames < size:
            codes = F.pad(codes, (0, size - frames))
        if self.graphs is None:
            wav = c2w(codes)
        else:
            c2w.prepare(size, codes.device)  # its host-side tables, outside the capture
            wav = self.graphs.run(("code2wav", tuple(codes.shape)), c2w, (codes,), c2w, recurring=True)
        return wav[..., :wav.shape[-1] - (size - frames) * int(c2w.total_upsample)]
