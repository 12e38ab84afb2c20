"""The inference engine: encoders -> thinker prefill and decode -> talker -> code predictor -> code2wav.

The pipeline is driven here rather than through transformers' `Qwen3OmniMoeForConditionalGeneration.generate`
(the tests' oracle, not a dependency), because the reference waits for the whole text before the talker starts (42 s to the first audio at real dimensions). The
talker needs, at its step s, the thinker's generated token s+1 (or the knowledge that the text ended), so it
runs one step behind the thinker and code2wav decodes the codec frames in chunks: the first audio packet comes
after a handful of tokens. Under a memory budget the planner's schedule decides what is resident together;
when the thinker and the talker side cannot be resident at once, speech follows the text instead (same
tokens, same codes, same audio: the streaming is a schedule, not different math).

What a request asks and what it gets back are orin.contract's types; the stages (orin.runtime.thinker, orin.runtime.talker,
orin.runtime.vocoder) are handed what they need; the loader owns residency, memory accounting and the budget.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from ..contract import AudioChunk, Done, GenerationRequest, Observer, Staged, TextDelta
from ..device.profile import DeviceProfile
from ..memory.oom import MemoryReading, allocation_failure, out_of_memory, read_memory
from .attention import without_cudnn_attention
from .heap import HeapSettler
from .request_state import Cancelled, RequestPlan, RequestState, build_report, plan_prompt, release_failed, validate

log = logging.getLogger("orin.runtime.engine")


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    device: str = "auto"  # "cpu" | "cuda" | "auto"
    budget: int | None = None
    power_backend: str = "auto"
    power_hz: float = 10.0
    sysfs_root: str = "/sys"
    verify_checksums: bool = True
    prefetch: bool = True
    # torch.compile of the decoder layer function (fuses the elementwise work between the matmuls). None: on
    # CUDA, where the serve warm-up absorbs the one-off compile; off on CPU.
    compile: bool | None = None
    # Where INT4 modules are kept in the device's kernel layout after their first load (orin.memory.packed_cache), so
    # later loads read instead of converting; None converts on every load.
    packed_cache: str | None = None
    # Every tuning number and capability of the hot path (orin.device.profile). None: detected from the device
    # when the engine starts; tests and the benchmark pass one (dataclasses.replace of a named profile).
    profile: DeviceProfile | None = None
    # Under a budget, the virtual memory management the weight arenas map with, given the device (None: the
    # device's own, orin.memory.vmm_driver.driver_for); tests pass a stand-in over the host's memory, or one that
    # fails on purpose.
    arena_driver: Callable | None = None
    # What the board has free (orin.memory.oom.MemoryReading; None: the device's and /proc/meminfo's). Tests fake it
    memory_reader: Callable[[], MemoryReading] | None = None
    # Called with the RequestState at each step's check (encoder, token, codec frame): tests raise an allocation
    # failure from it mid-request. None in production.
    fault_hook: Callable[[RequestState], None] | None = None


class Engine:
    def __init__(self, cfg: EngineConfig, observer: Observer | None = None):
        """`observer`, if given, is called with each orin.contract.Staged and Swap event as it happens."""
        import torch

        from ..checkpoint.reader import Checkpoint
        from ..device.select import pick_device
        from ..inputs import Processor
        from ..memory.loader import Loader
        from ..memory.model_sizes import size_model
        from ..memory.packed_cache import PackedCache
        from ..power.meter import PowerConfig, PowerMeter
        from .decode import Decoders
        from .thinker import Thinker

        self.cfg = cfg
        self._observer = observer
        self.device = pick_device(cfg.device)
        from ..device.capabilities import detect

        self.profile = cfg.profile or detect(self.device)
        self.dtype = getattr(torch, self.profile.compute_dtype)  # one decision: plan sizes with the same
        log.info("%s", self.profile.render().splitlines()[0])
        self.ckpt = Checkpoint.open(cfg.model_dir, verify=cfg.verify_checksums)
        self.config = self.ckpt.config
        self.sizes = size_model(self.config, self.ckpt.spec, self.ckpt.split, dtype_bytes=self.dtype.itemsize)
        packed = (PackedCache.open(cfg.packed_cache, self.ckpt, self.device, self.dtype)
                  if cfg.packed_cache else None)
        self.loader = Loader(self.ckpt, self.device, self.dtype, cfg.budget,
                             estimates={u: b for s in self.sizes.components.values() for u, b in s.units.items()},
                             on_swap=self._notify, packed=packed, profile=self.profile,
                             arena_driver=cfg.arena_driver)
        self.model = self.loader.model
        self.processor = Processor.from_dir(cfg.model_dir)
        self.tokenizer = self.processor.tokenizer
        self.model_name = self.ckpt.name
        self.meter = PowerMeter.from_config(PowerConfig(backend=cfg.power_backend, hz=cfg.power_hz,
                                                        sysfs_root=cfg.sysfs_root)).start()
        self._lock = threading.Lock()
        compile = cfg.compile if cfg.compile is not None else self.device.type == "cuda"
        self.decoders = Decoders(self.model, self.device, compile, self.profile)
        self.thinker = Thinker(self.model, self.config, self.device, self.dtype, self.decoders, self.profile)
        from .encoder_graphs import EncoderGraphs

        self.vocoder_graphs = EncoderGraphs(self.device, self.profile.capture)  # code2wav's chunk shapes
        self.heap = HeapSettler()
        self._kept_weights = False  # whether the last request's plan kept every weight in place
        self._expected: tuple[tuple[int, int], int] | None = None  # expect_conversation's, for the idle captures

    # ------------------------------------------------------------------ public API

    def close(self) -> None:
        self.meter.stop()
        self.loader.close()
        self.heap.release()

    @property
    def voices(self) -> tuple[str, ...]:
        """The talker's speaker names (lower case, as requests match them), from the checkpoint's config."""
        return tuple(sorted(self.config.talker_config.speaker_id or {}))

    @property
    def context_tokens(self) -> int:
        """The thinker's context length (its max_position_embeddings): what a prompt and its answer share."""
        text = self.config.raw.get("thinker_config", {}).get("text_config", {})
        return int(text.get("max_position_embeddings", 32768))

    def count_tokens(self, messages, *, generation_prompt: bool = False) -> int:
        """Tokens of `messages` (orin.inputs.prompt's format) as the chat template renders them, each media part as its
        one placeholder token (audio_tokens and image_tokens count what it expands to); nothing is featurised."""
        text = self.processor.apply_chat_template(list(messages), add_generation_prompt=generation_prompt)
        return len(self.tokenizer.encode(text))

    def audio_tokens(self, samples_16k: int) -> int:
        """The prompt tokens an audio of `samples_16k` samples at 16 kHz expands to (its Whisper frames)."""
        import math

        from ..audio_format import audio_token_count

        s = self.processor.log_mel.settings
        return audio_token_count(math.ceil(samples_16k / s.hop_length), s.n_window)

    def image_tokens(self, image) -> int:
        """The prompt tokens a PIL image expands to: its patch grid after the processor's resize, merged."""
        from ..inputs.image_patches import smart_resize

        s = self.processor.patcher.settings
        height, width = image.height, image.width
        if s.do_resize:
            height, width = smart_resize(height, width, s.factor, s.min_pixels, s.max_pixels)
        return (height // s.patch_size) * (width // s.patch_size) // (s.merge_size ** 2)

    def decode_tokens(self, ids) -> str:
        """The text of token ids, special tokens left out (as a request's answer is)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def memory(self) -> dict:
        return {"resident_bytes": self.loader.resident_bytes(), "allocated_bytes": self.loader.allocated_bytes(),
                "budget": self.cfg.budget, "resident": list(self.loader.resident())}

    def decoder_stats(self) -> dict:
        return self.decoders.stats()

    def defer_captures(self, defer: bool) -> None:
        """A server's engine: the CUDA graphs of a prompt bucket or an encoder input shape not seen before are
        captured between requests (capture_deferred), not by the request that first needs them, which runs
        eagerly instead: a capture costs about four eager passes, which that request's client would wait for."""
        self.decoders.defer_captures(defer)
        self.thinker.encoder_graphs.defer = self.vocoder_graphs.defer = defer

    def expect_conversation(self, rows: tuple[int, int], answer: int) -> None:
        """A conversation whose first prompt is `rows` (least, most) long and its answer up to `answer` tokens is
        about to start (a Realtime session): the next idle captures take its prefill graphs first. Callable from
        any thread while a request runs: it is only noted here."""
        self._expected = (rows, answer)

    def capture_deferred(self, stop: Callable[[], bool]) -> int:
        """The deferred captures, one at a time until `stop()` says a request waits; only where the last request
        kept every weight in place (all-resident: a time-sliced engine's weights move, and its graphs with them).
        Returns the captures made."""
        import torch

        with self._lock, torch.inference_mode(), without_cudnn_attention():
            if not self._kept_weights:
                return 0
            made = 0
            while True:  # until nothing is wanted; a session that starts meanwhile adds its graphs
                expected, self._expected = self._expected, None
                if expected is not None:
                    self.thinker.expect_conversation(*expected)
                made += (self.thinker.encoder_graphs.capture_deferred(stop)
                         + self.vocoder_graphs.capture_deferred(stop) + self.decoders.capture_deferred(stop))
                if self._expected is None or stop():
                    break
            self._settle_heap()
            return made

    def prepare(self, req: GenerationRequest):
        """The request's prompt as the model sees it (orin.inputs.prompt.Prompt)."""
        from ..inputs.prompt import prepare_prompt

        return prepare_prompt(self.processor, self.config.thinker_config, req.messages, self.device, self.dtype)

    def plan(self, req: GenerationRequest) -> RequestPlan:
        """The planner's verdict and schedule for `req` under this engine's budget, without running it (a
        BudgetError where it cannot run; the verdict's `min_budget` is the least budget it runs in)."""
        validate(req, self.voices)
        return self._plan(req, self.prepare(req))

    def generate(self, req: GenerationRequest, cancel: threading.Event | None = None):
        """(text, audio samples or None, Report) of a whole request."""
        text, chunks, report = "", [], None
        for event in self.stream(req, cancel):
            if isinstance(event, TextDelta):
                text += event.text
            elif isinstance(event, AudioChunk):
                chunks.append(event.samples)
            elif isinstance(event, Done):
                report = event.report
        audio = np.concatenate(chunks) if chunks else (np.zeros(0, np.float32) if req.speech else None)
        return text, audio, report

    def stream(self, req: GenerationRequest, cancel: threading.Event | None = None,
               admit: Callable[[int], None] | None = None) -> Iterator:
        """TextDelta and AudioChunk events as they are produced, then Done with the request's Report. `admit(bytes
        planned)` may refuse it before it runs (orin.serve.admission.MemoryPolicy). An allocation that fails while
        it runs raises orin.errors.OutOfMemoryError once the request's memory is released."""
        import torch

        validate(req, self.voices)
        with self._lock, torch.inference_mode(), without_cudnn_attention():
            state = RequestState(req, cancel)
            self.loader.begin_request()
            with self.meter.measure("request") as measurement:
                prompt = self.prepare(req)
                state.mark("prepared")
                plan = self._plan(req, prompt)
                self._kept_weights = plan.keeps_weights
                state.mark("planned")
                if admit is not None:
                    admit(plan.asked)
                failure = None
                try:
                    yield from self._pipeline(state, prompt, plan)
                except Cancelled:
                    log.info("request cancelled by the client after %d tokens", len(state.tokens))
                except Exception as exc:  # noqa: BLE001 - the one place an allocation failure becomes an answer
                    failure = allocation_failure(exc)
                    if failure is None:
                        raise
            if failure is not None:  # out of the except: the failure's traceback, and the frames it holds, are gone
                del prompt
                release_failed(self.loader, self.decoders, self.device, failure, len(state.tokens))
                raise out_of_memory(failure, plan.asked, self.free_memory())
            # the named routes it took (Report.routes), each decided once: at construction or by the prefill's route
            routes = {"profile": self.profile.name, "moe": self.decoders.moe_backend() or "none", **state.routes}
            report = build_report(state, prompt, plan, measurement.report, routes,
                                  text=self.decode_tokens(state.tokens), loader=self.loader, budget=self.cfg.budget,
                                  device=str(self.device))
            self._prepare_next(plan)
            self._settle_heap()
            yield Done(report)

    def free_memory(self) -> MemoryReading:
        """What the board has free now: the device's, MemAvailable and NvMap's, where readable."""
        return self.cfg.memory_reader() if self.cfg.memory_reader is not None else read_memory(self.device)

    def _notify(self, event) -> None:
        if self._observer is not None:
            self._observer(event)

    def _settle_heap(self) -> None:
        """After a request or idle captures that added CUDA graphs (orin.runtime.heap). Time-sliced, the decoders
        re-capture whenever their weights move, at every request: the heap is frozen once, after the first, and
        never collected at the end of a request, where the collection would hold the GIL from the next request's
        background load."""
        if self.heap.frozen and not self._kept_weights:
            return
        self.heap.settle(self.decoders.capture_count() + self.thinker.encoder_graphs.captures
                         + self.vocoder_graphs.captures)

    # ------------------------------------------------------------------ preparation

    def _plan(self, req: GenerationRequest, prompt) -> RequestPlan:
        return plan_prompt(req, prompt, sizes=self.sizes, profile=self.profile, loader=self.loader,
                           dtype_bytes=self.dtype.itemsize, budget=self.cfg.budget, prefetch=self.cfg.prefetch)

    def _stage(self, call) -> None:
        """Make the call's components resident (the loader evicts and prefetches within the budget), then tell
        the observer."""
        self.loader.stage(call)
        self.decoders.weights_may_have_moved()
        self._notify(Staged(call.comps, self.loader.resident(), self.loader.allocated_bytes(),
                            self.loader.peak_bytes()))

    def _prepare_next(self, plan: RequestPlan) -> None:
        """Time-sliced, the next request of a stream is expected to be like this one: its first stage (the
        encoders, where this request had audio or images) starts loading now, in the background, after the
        speech side (needed last) makes room. Its bytes count in the next request's swaps."""
        if plan.stages.next is not None:
            self.loader.stage(plan.stages.next)

    def _check(self, state: RequestState) -> None:
        self.loader.observe()
        if self.cfg.fault_hook is not None:
            self.cfg.fault_hook(state)
        state.stop_if_cancelled()

    # ------------------------------------------------------------------ the pipeline

    def _pipeline(self, state: RequestState, prompt, plan: RequestPlan) -> Iterator:
        import torch

        from ..device.gate import GATE
        from .thinker import Detokenizer, TextEmbeddings, Thinker, next_turn_rows
        from .vocoder import Vocoder

        req = state.req
        streaming = plan.streaming
        inputs = {k: (v.to(self.device) if hasattr(v, "to") else v) for k, v in prompt.inputs.items()}

        audio_feats, image_feats, video_feats = None, None, None
        for call in plan.stages.encode:
            self._stage(call)
            with self.meter.stage("encode"):
                if "audio_encoder" in call.comps:
                    audio_feats = self.thinker.encode_audio(inputs, prompt, graph="audio_encoder" in plan.graphs)
                    state.mark("audio_encoded")
                if "vision_encoder" in call.comps:
                    if prompt.has_image:
                        image_feats = self.thinker.encode_image(inputs, prompt,
                                                                 graph="vision_encoder" in plan.graphs)
                        state.mark("image_encoded")
                    if prompt.has_video:
                        video_feats = self.thinker.encode_video(prompt)
                        state.mark("video_encoded")
            self._check(state)
        state.mark("encoded")
        self._stage(plan.stages.think)
        state.mark("thinker_resident")

        gen = torch.Generator(device="cpu").manual_seed(req.seed)
        graphs = "thinker_text" in plan.graphs
        # An eager prefill's launches take the GIL and the GPU back from a background load (orin.cuda_gate); a
        # replayed one is a few launches, and the speech side goes on loading beside it.
        with self.meter.stage("thinker_prefill"), contextlib.nullcontext() if graphs else GATE:
            merged = self.thinker.merge(inputs, prompt, audio_feats, image_feats, video_feats)
            # merged holds what the prefill reads (the features in their rows, the deepstack levels joined)
            del audio_feats, image_feats, video_feats
            state.mark("merged")
            decoder, hidden_states, logits = self.thinker.prefill(merged, prompt.length + req.max_new_tokens,
                                                                  graphs, req.continues)
            self.loader.set_cache_bytes(decoder.cache_bytes())
        state.mark("prefilled")
        state.mark(f"prefill_{decoder.last_prefill}")  # how it ran: StaticDecoder.last_prefill
        state.routes["prefill"] = str(decoder.last_prefill)
        state.cached_tokens = decoder.last_shared
        token = Thinker.sample(logits, req.temperature, req.top_p, gen)
        state.ttft = time.perf_counter() - state.t0
        state.mark("first_token")
        state.decode_start = time.perf_counter()
        eos = self.config.im_end_token_id
        embeddings = TextEmbeddings(self.model, self.config, self.device, self.loader.is_resident)
        talker, talker_ctx = None, None
        if req.speech:
            accept = self.config.talker_config.accept_hidden_layer
            talker_ctx = (embeddings, prompt, hidden_states[accept])
        # The talker needs one of the prefill's hidden-state layers; any other is dead weight during decode.
        del hidden_states
        vocoder = Vocoder(self.model, self.device, state, self._code2wav_stager(plan, state),
                          self.vocoder_graphs if "code2wav" in plan.graphs else None,
                          self.meter.stage, self.profile.speech) if req.speech else None
        detok = Detokenizer(self.tokenizer)
        while True:
            state.tokens.append(token)
            delta = detok.push(token)
            if delta:
                yield TextDelta(delta, (token,))
            done = (token == eos and not req.ignore_eos) or len(state.tokens) >= req.max_new_tokens
            # The talker joins once its weights (prefetched since the prefill) have landed; until then the
            # thinker goes on decoding and the talker catches up on the tokens it finds.
            if streaming and talker is None and (done or self.loader.arrived(plan.stages.join[0].comps)):
                talker = self._join_talker(state, talker_ctx, plan)
            if talker is not None:
                yield from self._advance_talker(state, talker, vocoder, thinker_done=done)
            self._check(state)
            if done:
                break
            with self.meter.stage("thinker_decode", edge_reads=False):  # per token: no power read
                logits = decoder.step(token)
            token = Thinker.sample(logits, req.temperature, req.top_p, gen)
        state.decode_end = time.perf_counter()
        if req.continues:  # a conversation's next turn: its bucket, now that the answer's length is known
            decoder.turn_ended(next_turn_rows(self.config, self.tokenizer, prompt, state.tokens))
        if req.speech and not streaming:  # the talker reads the prompt's text rows from the table too
            embeddings.remember(state.tokens + prompt.input_ids.reshape(-1).tolist())
        tail = detok.flush()
        if tail:
            yield TextDelta(tail, ())
        if not req.speech:
            return
        if talker is None:
            talk, *vocode = plan.stages.speak
            self._stage(talk)
            talker = self._start_talker(state, talker_ctx, plan)
            if vocode:
                # One component at a time: collect every frame first, then vocode.
                yield from self._advance_talker(state, talker, None, thinker_done=True)
                self._stage(vocode[0])
                yield from vocoder.feed(state.frames, final=True)
                return
        yield from self._advance_talker(state, talker, vocoder, thinker_done=True)
        yield from vocoder.feed([], final=True)
        vocoder.make_resident()  # staged once per request even when no frame came (the schedule `plan` shows)

    def _code2wav_stager(self, plan: RequestPlan, state: RequestState):
        """What the vocoder calls before each chunk: streaming, the speech side's last staging beside the
        thinker, once (it may evict what that stage's working bytes need room from, as `plan` simulates);
        otherwise code2wav alone, where it is not resident."""
        from ..memory.request_sizes import working_bytes
        from ..memory.residency import StageCall

        staged = False

        def make_resident() -> None:
            nonlocal staged
            if plan.streaming:
                if not staged:
                    self._stage(plan.stages.join[-1])
                    state.mark("speech_resident")
                    staged = True
            elif not self.loader.is_resident("code2wav"):
                self._stage(StageCall(("code2wav",), working_bytes(("code2wav",), plan.kv, plan.act, plan.margin)))

        return make_resident

    def _join_talker(self, state: RequestState, ctx, plan: RequestPlan):
        """Streaming speech: the talker staged and prefilled, then the code predictor its first step needs (loading
        meanwhile); code2wav follows with the first audio chunk (orin.runtime.vocoder asks for it)."""
        first, *rest = plan.stages.join
        self._stage(first)
        state.mark("talker_resident")
        talker = self._start_talker(state, ctx, plan)
        for call in rest[:-1]:
            self._stage(call)
        state.mark("predictor_resident")
        return talker

    # ------------------------------------------------------------------ talker

    def _start_talker(self, state: RequestState, ctx, plan: RequestPlan):
        from .talker import Talker

        embeddings, prompt, thinker_hidden = ctx
        talker = Talker(self.model, self.config, self.device, self.decoders, embeddings, state, prompt,
                        thinker_hidden, on_cache=self.loader.set_cache_bytes, prefill=self.profile.prefill)
        with self.meter.stage("talker"):
            talker.prefill("talker" in plan.graphs)
        state.mark("talker_prefilled")
        state.mark(f"talker_prefill_{talker.decoder.last_prefill}")
        state.routes["talker_prefill"] = str(talker.decoder.last_prefill)
        return talker

    def _advance_talker(self, state: RequestState, talker, vocoder, thinker_done: bool):
        """Make each frame as soon as its first code is chosen, and run the talker steps whose text input is known:
        step s needs generated token s+1, or the end of text."""
        while not talker.finished:
            if talker.frame_due:
                frame = self._talker_timed(state, talker.frame)
                state.frames.append(frame)
                if vocoder is not None:
                    yield from vocoder.feed([frame], final=False)
            s = talker.step_index
            n = len(state.tokens)
            if s + 1 < n:
                text = ("token", state.tokens[s + 1])
            elif thinker_done and s == n - 1:
                text = ("eos", None)
            elif thinker_done:
                text = ("pad", None)
            else:
                return
            self._talker_timed(state, talker.advance, text)

    def _talker_timed(self, state: RequestState, fn, *args):
        """fn(*args), a talker frame or step: its time counted as the talker's, under the meter's per-frame stage
        (no power read: the report interpolates), and the request's cancellation checked after it."""
        start = time.perf_counter()
        with self.meter.stage("talker", edge_reads=False):  # per frame: no power read
            out = fn(*args)
        state.talker_seconds += time.perf_counter() - start
        self._check(state)
        return out
