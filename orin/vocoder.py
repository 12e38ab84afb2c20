"""code2wav in chunks with left context, so audio streams as codec frames arrive. The chunk schedule is fixed
(not driven by timing), so a streamed request and a non-streamed one produce the same samples."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from . import components as C
from .contract import AudioChunk
from .request_state import RequestState


def chunk_frames(done: int) -> int:
    """The frames of the chunk after the first `done`: CODE2WAV_FIRST_CHUNK, then as many as all the chunks
    before it (1, 1, 2, 4, ... would wait twice for one frame: 1, 2, 4, 8, 16, 32, 32, ...), up to
    CODE2WAV_CHUNK. Fixed by `done` alone, so a reply's chunks and their shapes never depend on timing, and a
    handful of shapes recur in every reply (each replayed from its own graph)."""
    return C.CODE2WAV_FIRST_CHUNK if done == 0 else min(C.CODE2WAV_CHUNK, done + C.CODE2WAV_FIRST_CHUNK)


def chunk_count(frames: int) -> int:
    """How many chunks code2wav decodes `frames` codec frames in."""
    done = chunks = 0
    while done < frames:
        done += chunk_frames(done)
        chunks += 1
    return chunks


def every_shape_frames() -> int:
    """The fewest codec frames whose chunks meet every recurring shape: the growing chunks, then one frame of
    a whole one (padded to its shape as a last chunk). A warm-up that speaks this many leaves no shape for a
    client's reply to meet first (run without graphs: eagerly, ~1,000 launches, up to 137 ms a chunk)."""
    done = 0
    while chunk_frames(done) < C.CODE2WAV_CHUNK:
        done += chunk_frames(done)
    return done + 1


class Vocoder:
    def __init__(self, model, device, state: RequestState, make_resident: Callable[[], None], graphs, measure):
        """`make_resident()` stages code2wav (the engine's residency); `graphs`: an orin.encoder_graphs
        EncoderGraphs where code2wav's weights stay put (all-resident), else None; `measure(stage)` is the power
        meter's stage context."""
        self.model, self.device = model, device
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
            want = chunk_frames(self.done)
            available = len(self.frames) - self.done
            if available <= 0 or (available < want and not final):
                return
            end = self.done + min(want, available)
            ctx = min(C.CODE2WAV_LEFT_CONTEXT, self.done)
            self.make_resident()
            codes = torch.stack(self.frames[self.done - ctx:end], dim=1).unsqueeze(0).to(self.device)
            c2w = self.model.code2wav
            with self.measure("code2wav"):
                wav = self._decode(c2w, codes, want + ctx)[..., ctx * int(c2w.total_upsample):]
            samples = wav.reshape(-1).float().cpu().numpy()
            new_frames = tuple(tuple(int(c) for c in f.tolist()) for f in self.frames[self.done:end])
            self.done = end
            if self.state.first_audio is None:
                self.state.first_audio = time.perf_counter() - self.state.t0
                self.state.mark("first_audio")
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
