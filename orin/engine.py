"""The inference engine: encoders -> thinker prefill and decode -> talker -> code predictor -> code2wav.

The pipeline is driven here rather than through `Qwen3OmniMoeForConditionalGeneration.generate`, because the
reference waits for the whole text before the talker starts (42 s to the first audio at real dimensions). The
talker needs, at its step s, the thinker's generated token s+1 (or the knowledge that the text ended), so it
runs one step behind the thinker and code2wav decodes the codec frames in chunks: the first audio packet comes
after a handful of tokens. Under a memory budget the planner's schedule decides what is resident together;
when the thinker and the talker side cannot be resident at once, speech follows the text instead (same
tokens, same codes, same audio: the streaming is a schedule, not different math).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from . import components as C
from .errors import InputError, ModelError, UsageError

log = logging.getLogger("orin.engine")
SAMPLE_RATE = 24000
DECODE_MODES = ("auto", "eager", "static", "graph", "compiled")


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    device: str = "auto"  # "cpu" | "cuda" | "auto"
    budget: int | None = None
    power_backend: str = "auto"
    power_hz: float = 10.0
    sysfs_root: str = "/sys"
    verify_checksums: bool = True
    dtype: str | None = None  # default: bfloat16 on CUDA, float32 on CPU
    prefetch: bool = True
    # Decoding (thinker, talker, code predictor): "eager" = HF modules with dynamic caches and generate();
    # "static" = orin.fastdecode (static KV caches, fused INT4 MoE, no host sync); "graph" = "static" captured in
    # CUDA graphs; "compiled" = "graph" with the layer function through torch.compile (CUDA; "static" on CPU).
    # "auto": "compiled" on CUDA (the serve warm-up absorbs its one-off compile), "eager" on CPU.
    decode: str = "auto"


@dataclass(frozen=True)
class GenerationRequest:
    messages: tuple
    max_new_tokens: int = 256
    speech: bool = True
    speaker: str = "ethan"
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    max_audio_frames: int | None = None
    talker_temperature: float = 0.0  # 0 = greedy; the HF reference samples at 0.9 with top_k 50
    stream_speech: bool = True  # False: speak after the whole text, as the HF reference does
    ignore_eos: bool = False  # fixed lengths, for benchmarks

    @property
    def frame_cap(self) -> int:
        """Most codec frames the talker may produce: the planner's cap, so its KV cache is what was budgeted."""
        from .plan import frame_cap

        return frame_cap(self.max_new_tokens, self.max_audio_frames)


@dataclass
class TextDelta:
    text: str
    token_ids: list[int]


@dataclass
class AudioChunk:
    samples: np.ndarray
    index: int


@dataclass
class Done:
    report: dict


@dataclass
class _Prompt:
    inputs: dict
    input_ids: object
    n_audio_tokens: int
    n_image_tokens: int
    vision_patches: int
    has_audio: bool
    has_image: bool


@dataclass
class _Run:
    """Per-request state and timings."""

    req: GenerationRequest
    cancel: threading.Event | None
    t0: float = field(default_factory=time.perf_counter)
    ttft: float | None = None
    first_audio: float | None = None
    decode_start: float | None = None
    decode_end: float | None = None
    tokens: list[int] = field(default_factory=list)
    frames: list = field(default_factory=list)
    audio_samples: int = 0
    talker_seconds: float = 0.0
    timeline: dict[str, float] = field(default_factory=dict)  # seconds from t0 at each step to the first outputs

    def mark(self, name: str) -> None:
        self.timeline.setdefault(name, time.perf_counter() - self.t0)

    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()


class Cancelled(Exception):
    """The client went away; the request stops at the next step."""


def _pick_device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is visible to torch; use --device cpu")
    if name not in ("cpu", "cuda"):
        raise UsageError(f"--device {name!r}: use cpu, cuda or auto")
    return torch.device(name)


class Engine:
    def __init__(self, cfg: EngineConfig):
        import torch

        from .checkpoint import Checkpoint
        from .loader import Loader
        from .plan import size_model
        from .power import PowerConfig, PowerMeter
        from .tiny import build_processor

        self.cfg = cfg
        self.device = _pick_device(cfg.device)
        if cfg.dtype is None:
            self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        else:
            self.dtype = getattr(torch, cfg.dtype)
        self.ckpt = Checkpoint.open(cfg.model_dir, verify=cfg.verify_checksums)
        self.config = self.ckpt.config
        self.loader = Loader(self.ckpt, self.device, self.dtype, cfg.budget)
        self.model = self.loader.model
        self.processor = build_processor(cfg.model_dir)
        self.tokenizer = self.processor.tokenizer
        self.sizes = size_model(self.config, self.ckpt.spec, self.ckpt.split,
                                dtype_bytes=torch.tensor([], dtype=self.dtype).element_size())
        self.model_name = self.ckpt.name
        self.meter = PowerMeter.from_config(PowerConfig(backend=cfg.power_backend, hz=cfg.power_hz,
                                                        sysfs_root=cfg.sysfs_root)).start()
        self._lock = threading.Lock()
        if cfg.decode not in DECODE_MODES:
            raise UsageError(f"decode mode {cfg.decode!r}: use one of {', '.join(DECODE_MODES)}")
        decode = cfg.decode
        if decode == "auto":
            decode = "compiled" if self.device.type == "cuda" else "eager"
        self.decode = decode  # may be switched between requests (the benchmark compares the modes)
        self._decoders: dict = {}
        self._heap_frozen = False
        self._embed_cache: dict = {}

    # ------------------------------------------------------------------ public API

    def close(self) -> None:
        self.meter.stop()
        self.loader.close()
        if self._heap_frozen:  # what _settle_heap froze is collectable again (the engine's own cycles included)
            gc.unfreeze()
            self._heap_frozen = False

    def memory(self) -> dict:
        return {"resident_bytes": self.loader.resident_bytes(), "allocated_bytes": self.loader.memory.current(),
                "budget": self.cfg.budget, "resident": list(self.loader.resident())}

    def generate(self, req: GenerationRequest, cancel: threading.Event | None = None):
        text, chunks, report = "", [], {}
        for event in self.stream(req, cancel):
            if isinstance(event, TextDelta):
                text += event.text
            elif isinstance(event, AudioChunk):
                chunks.append(event.samples)
            elif isinstance(event, Done):
                report = event.report
        audio = np.concatenate(chunks) if chunks else (np.zeros(0, np.float32) if req.speech else None)
        return text, audio, report

    def stream(self, req: GenerationRequest, cancel: threading.Event | None = None) -> Iterator:
        """Text deltas and audio chunks as they are produced, then Done with the request's report."""
        import torch

        self._validate(req)
        with self._lock, torch.inference_mode():
            run = _Run(req, cancel)
            self.loader.swaps.clear()
            self.loader.memory.reset_peak()
            with self.meter.measure("request") as measurement:
                prompt = self._prepare(req)
                run.mark("prepared")
                verdict = self._plan(req, prompt)
                run.mark("planned")
                try:
                    yield from self._pipeline(run, prompt, verdict)
                except Cancelled:
                    log.info("request cancelled by the client after %d tokens", len(run.tokens))
            self.last_frames = list(run.frames)  # the codec frames of the last request (tests, debugging)
            report = self._report(run, prompt, verdict, measurement.report)
            self._settle_heap()
            yield Done(report)

    def _settle_heap(self) -> None:
        """Once, after the first request that compiled or captured decoders (the warm-up): collect, then move
        what is left (dynamo's and inductor's graphs, guards and kernels: millions of objects) to the permanent
        generation. Full collections otherwise walk all of it at random points of later requests (compiled
        mode's TTFT varied by 10-20 ms where graph mode's did not, BENCHMARKS.md). Only once: a frozen object
        that later becomes part of a garbage cycle is not collected until close() unfreezes."""
        if self._heap_frozen:
            return
        if any(dec.runner.captures or getattr(dec, "prefill_captures", 0) for dec in self._decoders.values()):
            gc.collect()
            gc.freeze()
            self._heap_frozen = True

    # ------------------------------------------------------------------ preparation

    def _validate(self, req: GenerationRequest) -> None:
        if req.max_new_tokens < 1:
            raise InputError("max_new_tokens must be at least 1")
        if req.speech:
            speakers = self.config.talker_config.speaker_id or {}
            if req.speaker.lower() not in speakers:
                raise InputError(f"unknown voice {req.speaker!r}; voices: {', '.join(sorted(speakers))}")
        if not req.messages:
            raise InputError("messages is empty: give at least one user message")

    def _prepare(self, req: GenerationRequest) -> _Prompt:
        images, audios, messages = [], [], []
        for msg in req.messages:
            content = msg.get("content")
            if isinstance(content, str):
                messages.append({"role": msg["role"], "content": [{"type": "text", "text": content}]})
                continue
            parts = []
            for part in content or []:
                kind = part.get("type")
                if kind == "text":
                    parts.append({"type": "text", "text": part["text"]})
                elif kind == "image":
                    images.append(part["image"])
                    parts.append({"type": "image"})
                elif kind == "audio":
                    audios.append(np.asarray(part["audio"], dtype=np.float32))
                    parts.append({"type": "audio"})
                else:
                    raise InputError(f"unsupported content part type {kind!r}: use text, image or audio")
            messages.append({"role": msg["role"], "content": parts})
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # On CUDA the Whisper features of the audio (an STFT of up to 30 s) are computed on the GPU: ~1 ms
        # instead of ~5-10 ms of host time ahead of everything else in the request.
        extra = {"device": str(self.device)} if audios and self.device.type == "cuda" else {}
        inputs = self.processor(text=[text], images=images or None, audio=audios or None, return_tensors="pt",
                                padding=True, **extra)
        ids = inputs["input_ids"]
        th = self.config.thinker_config
        return _Prompt(
            inputs=dict(inputs), input_ids=ids,
            n_audio_tokens=int((ids == th.audio_token_id).sum()), n_image_tokens=int((ids == th.image_token_id).sum()),
            vision_patches=int(inputs["pixel_values"].shape[0]) if images else 0,
            has_audio=bool(audios), has_image=bool(images),
        )

    def _needed(self, req: GenerationRequest, prompt: _Prompt) -> tuple[str, ...]:
        need = {"thinker_text"}
        if prompt.has_audio:
            need.add("audio_encoder")
        if prompt.has_image:
            need.add("vision_encoder")
        if req.speech:
            need.update(C.SPEECH_COMPONENTS)
        return tuple(c for c in C.PIPELINE if c in need)

    def _plan(self, req: GenerationRequest, prompt: _Prompt):
        from .plan import RUNTIME_MARGIN, activation_bytes, decide, kv_bytes, require_fit

        n = int(prompt.input_ids.shape[1])
        frames = req.frame_cap if req.speech else 0
        tokens = {"audio": prompt.n_audio_tokens, "image": prompt.n_image_tokens, "video": 0, "prompt": n,
                  "generated": req.max_new_tokens, "total": n + req.max_new_tokens, "talker_frames": frames,
                  "vision_patches": prompt.vision_patches}
        eb = self.loader.dtype.itemsize if hasattr(self.loader.dtype, "itemsize") else 2
        kv = kv_bytes(tokens, self.sizes.dims, eb)
        act = activation_bytes(tokens, self.sizes.dims, eb)
        resident = {c: self.loader.memory.resident.get(c, s.runtime_int4_bytes) for c, s in self.sizes.components.items()}
        budget = self.cfg.budget if self.cfg.budget is not None else 1 << 62
        # On CPU the tracker counts the engine's tensors exactly; on CUDA the allocator also holds graph pools,
        # workspaces and slack that no estimate lists.
        margin = RUNTIME_MARGIN if self.device.type == "cuda" else 0
        verdict = decide(resident, kv, act, self._needed(req, prompt), budget, margin)
        require_fit(verdict)
        # Prefill graphs only where the weights stay put between requests: time-sliced, each request would
        # capture anew (four prefills' work for one replay) and the graph's memory pool is not in the budget.
        self._keeps_weights = verdict.all_resident
        self._kv, self._act, self._resident_est, self._margin = kv, act, resident, margin
        return verdict

    # ------------------------------------------------------------------ residency

    def _stage(self, comps: tuple[str, ...], next_comps: tuple[str, ...] = ()) -> None:
        """Make `comps` resident, evicting others when the budget needs it; then prefetch what comes next
        if it fits beside them."""
        need = [c for c in comps if not self.loader.is_resident(c)]
        working = (max([self._act.get(c, 0) for c in comps] or [0]) + sum(self._kv.get(c, 0) for c in comps)
                   + self._margin)
        incoming = sum(self._resident_est[c] for c in need)
        self.loader.make_room(keep=comps, incoming=incoming, working=working)
        for c in comps:
            self.loader.ensure(c)
        self.loader.memory.observe()
        if self.cfg.prefetch and next_comps:
            budget = self.cfg.budget
            queued = 0  # a prefetch counts as resident only once it lands: count the ones queued here ourselves
            for c in next_comps:
                if self.loader.is_resident(c):
                    continue
                if budget is None or self.loader.resident_bytes() + queued + self._resident_est[c] + working <= budget:
                    self.loader.prefetch(c)
                    queued += self._resident_est[c]

    # ------------------------------------------------------------------ the pipeline

    def _pipeline(self, run: _Run, prompt: _Prompt, verdict) -> Iterator:
        import torch

        req = run.req
        stages = [s.resident for s in verdict.schedule]
        streaming = req.speech and req.stream_speech and verdict.streaming
        think_comps = next(s for s in stages if "thinker_text" in s)
        speak_after = [s for s in stages[stages.index(think_comps) + 1:]]
        inputs = {k: (v.to(self.device) if hasattr(v, "to") else v) for k, v in prompt.inputs.items()}
        thinker = self.model.thinker
        encoders = tuple(c for c in ("audio_encoder", "vision_encoder") if c in verdict.needed)

        audio_feats, image_out = None, None
        enc_stages = [s for s in stages if s and set(s) <= set(encoders)]
        for i, comps in enumerate(enc_stages):
            self._stage(comps, next_comps=enc_stages[i + 1] if i + 1 < len(enc_stages) else think_comps)
            with self.meter.stage("encode"):
                if "audio_encoder" in comps:
                    audio_feats = thinker.model.get_audio_features(
                        inputs["input_features"].to(self.dtype), inputs["feature_attention_mask"], return_dict=True,
                    ).last_hidden_state
                    run.mark("audio_encoded")
                if "vision_encoder" in comps:
                    image_out = thinker.model.get_image_features(
                        inputs["pixel_values"].to(self.dtype), inputs["image_grid_thw"], return_dict=True)
                    run.mark("image_encoded")
            self._check(run)
        run.mark("encoded")
        self._stage(think_comps, next_comps=speak_after[0] if speak_after else ())
        run.mark("thinker_resident")

        gen = torch.Generator(device="cpu").manual_seed(req.seed)
        ids = inputs["input_ids"]
        with self.meter.stage("thinker_prefill"):
            merged = self._thinker_inputs(inputs, ids, audio_feats, image_out)
            run.mark("merged")
            cache, hidden_states, logits = self._thinker_prefill(merged, inputs["attention_mask"], req.speech,
                                                                 int(ids.shape[1]) + req.max_new_tokens)
        run.mark("prefilled")
        token = self._sample(logits, req.temperature, req.top_p, gen)
        run.ttft = time.perf_counter() - run.t0
        run.mark("first_token")
        run.decode_start = time.perf_counter()
        eos = self.config.im_end_token_id
        talker = None
        if req.speech:
            thinker_embed = hidden_states[0]
            thinker_hidden = hidden_states[self.config.talker_config.accept_hidden_layer]
            talker_ctx = (ids, inputs, thinker_embed, thinker_hidden)
        # The talker needs two of the prefill's hidden-state layers; the other layers are dead weight during decode.
        del hidden_states
        vocoder = _Vocoder(self, run) if req.speech else None
        detok = _Detokenizer(self.tokenizer)
        finished = False
        while True:
            run.tokens.append(token)
            delta = detok.push(token)
            if delta:
                yield TextDelta(delta, [token])
            done = (token == eos and not req.ignore_eos) or len(run.tokens) >= req.max_new_tokens
            if streaming:
                if talker is None:
                    talker = self._start_talker(run, talker_ctx, streaming=True)
                yield from self._advance_talker(run, talker, vocoder, thinker_done=done)
            self._check(run)
            if done:
                finished = True
                break
            with self.meter.stage("thinker_decode", edge_reads=False):  # per token: no power read
                logits = self._thinker_step(token, cache)
            token = self._sample(logits, req.temperature, req.top_p, gen)
        run.decode_end = time.perf_counter()
        if req.speech and not streaming:
            self._remember_embeddings(run.tokens)
        tail = detok.flush()
        if tail:
            yield TextDelta(tail, [])
        del cache
        if req.speech and finished:
            if talker is None:
                one_at_a_time = len(speak_after) > 1
                self._stage(("talker", "code_predictor") if one_at_a_time else C.SPEECH_COMPONENTS,
                            next_comps=("code2wav",) if one_at_a_time else ())
                talker = self._start_talker(run, talker_ctx, streaming=False)
                if one_at_a_time:
                    # One component at a time: collect every frame first, then vocode.
                    yield from self._advance_talker(run, talker, None, thinker_done=True, until_end=True)
                    self._stage(("code2wav",))
                    yield from vocoder.feed(run.frames, final=True)
                    return
            yield from self._advance_talker(run, talker, vocoder, thinker_done=True, until_end=True)
            yield from vocoder.feed([], final=True)

    def _check(self, run: _Run) -> None:
        self.loader.memory.observe()
        if run.cancelled():
            raise Cancelled()

    # ------------------------------------------------------------------ thinker

    def _thinker_inputs(self, inputs, ids, audio_feats, image_out):
        """The thinker's input embeddings with the audio and image features merged, its M-RoPE positions
        (setting the rope deltas decoding continues from) and the image's deepstack features, as
        Qwen3OmniMoeThinkerModel.forward builds them before its language model."""
        import torch

        tm = self.model.thinker.model
        embeds = tm.get_input_embeddings()(ids)
        if audio_feats is not None:
            _, _, audio_mask = tm.get_placeholder_mask(ids, inputs_embeds=embeds)
            embeds = embeds.masked_scatter(audio_mask, audio_feats.to(embeds.dtype))
        visual = None
        if image_out is not None:
            image_embeds = torch.cat(image_out.pooler_output, dim=0).to(embeds.dtype)
            image_mask, _, _ = tm.get_placeholder_mask(ids, inputs_embeds=embeds, image_features=image_embeds)
            embeds = embeds.masked_scatter(image_mask, image_embeds)
            visual = (image_mask[..., 0], [torch.cat(f, dim=0) for f in image_out.deepstack_features])
        fam = inputs.get("feature_attention_mask")
        tm.rope_deltas = None
        position_ids = tm.compute_3d_position_ids(
            input_ids=ids, image_grid_thw=inputs.get("image_grid_thw"), video_grid_thw=None, inputs_embeds=embeds,
            attention_mask=inputs["attention_mask"], past_key_values=None,
            audio_feature_lengths=fam.sum(dim=1) if fam is not None else None)
        return embeds, position_ids, visual

    def _thinker_prefill(self, merged, attention_mask, want_hidden: bool, max_len: int):
        """The prompt (`merged`: what _thinker_inputs built) through the thinker: (cache, hidden states
        {HF index: [1, T, H]} the talker reads, last position's logits). The cache is the static decoder
        (orin.fastdecode, which the prefill fills directly) or, in eager mode, an HF DynamicCache."""
        from transformers import DynamicCache

        embeds, position_ids, visual = merged
        accept = self.config.talker_config.accept_hidden_layer
        if self.decode != "eager" and (fast := self._fast("thinker")).supported():
            # always recorded (two [T, H] copies): text-only and speech requests then share a prefill graph
            out = fast.prefill(embeds[0], position_ids, max_len, record=(0, accept), visual=visual,
                               graph=self._keeps_weights)
            self._track_kv(fast)
            return fast, out.states, out.logits
        record = (0, accept) if want_hidden else ()
        thinker = self.model.thinker
        cache = DynamicCache(config=self.config.thinker_config.text_config)
        out = thinker.model.language_model(
            inputs_embeds=embeds, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=cache, use_cache=True, output_hidden_states=want_hidden,
            visual_pos_masks=None if visual is None else visual[0],
            deepstack_visual_embeds=None if visual is None else visual[1],
        )
        self._track_kv(cache)
        logits = thinker.lm_head(out.last_hidden_state[:, -1:])
        states = {i: out.hidden_states[i] for i in record}
        return cache, states, logits[:, -1]

    def _fast(self, kind: str):
        """The orin.fastdecode decoder of `kind` (thinker, talker, code_predictor) for the current mode."""
        from . import fastdecode

        key = (kind, self.decode == "compiled")
        if key not in self._decoders:
            make = {"thinker": fastdecode.ThinkerDecoder, "talker": fastdecode.TalkerDecoder,
                    "code_predictor": fastdecode.CodePredictor}[kind]
            self._decoders[key] = make(self.model, self.device, compile=self.decode == "compiled")
        dec = self._decoders[key]
        dec.graph_enabled = self.decode in ("graph", "compiled") and self.device.type == "cuda"
        return dec

    def _remember_embeddings(self, tokens) -> None:
        """Keep the thinker's input embeddings of the generated tokens and the TTS specials: when speech follows
        the text under a budget, the talker runs after the thinker (and its embedding table) is swapped out."""
        import torch

        ids = sorted(set(tokens) | {self.config.tts_bos_token_id, self.config.tts_eos_token_id,
                                    self.config.tts_pad_token_id})
        table = self.model.thinker.model.get_input_embeddings()(torch.tensor([ids], device=self.device))
        self._embed_cache = {t: table[:, i:i + 1] for i, t in enumerate(ids)}

    def _text_embeddings(self, ids):
        """Thinker input embeddings [1, n, H] of token ids [1, n]: from the table while the thinker is resident,
        else from what _remember_embeddings kept."""
        import torch

        if self.loader.is_resident("thinker_text"):
            return self.model.thinker.model.get_input_embeddings()(ids)
        try:
            return torch.cat([self._embed_cache[int(t)] for t in ids.reshape(-1).tolist()], dim=1)
        except KeyError as exc:
            raise ModelError(f"token {exc} has no remembered embedding while the thinker is swapped out") from exc

    def _thinker_step(self, token: int, cache):
        import torch

        if not hasattr(cache, "get_seq_length"):  # orin.fastdecode.ThinkerDecoder
            return cache.step(token)
        thinker = self.model.thinker
        tok = torch.tensor([[token]], device=self.device)
        embeds = thinker.model.get_input_embeddings()(tok)
        out = thinker.model(inputs_embeds=embeds, past_key_values=cache, use_cache=True)
        self._track_kv(cache)
        return thinker.lm_head(out.last_hidden_state)[:, -1]

    def _track_kv(self, *caches) -> None:
        total = 0
        for cache in caches:
            if cache is None:
                continue
            if hasattr(cache, "cache_bytes"):  # orin.fastdecode.StaticDecoder
                total += cache.cache_bytes()
                continue
            for layer in getattr(cache, "layers", []):
                for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                    if t is not None and hasattr(t, "numel"):
                        total += t.numel() * t.element_size()
        self.loader.memory.dynamic = total
        self.loader.memory.observe()

    @staticmethod
    def _sample(logits, temperature: float, top_p: float, gen) -> int:
        import torch

        if temperature <= 0:
            return int(torch.argmax(logits, dim=-1)[0])
        probs = torch.softmax(logits.float() / temperature, dim=-1)[0].cpu()
        if top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
        return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))

    # ------------------------------------------------------------------ talker

    def _start_talker(self, run: _Run, ctx, streaming: bool) -> _Talker:
        ids, inputs, thinker_embed, thinker_hidden = ctx
        talker = _Talker(self, run, ids, inputs, thinker_embed, thinker_hidden)
        with self.meter.stage("talker"):
            talker.prefill()
        run.mark("talker_prefilled")
        return talker

    def _advance_talker(self, run: _Run, talker: _Talker, vocoder, thinker_done: bool, until_end: bool = False):
        """Run talker steps whose text input is known: step s needs generated token s+1, or the end of text."""
        while not talker.finished:
            s = talker.step_index
            n = len(run.tokens)
            if s + 1 < n:
                text = ("token", run.tokens[s + 1])
            elif thinker_done and s == n - 1:
                text = ("eos", None)
            elif thinker_done:
                text = ("pad", None)
            else:
                return
            start = time.perf_counter()
            with self.meter.stage("talker", edge_reads=False):  # per frame: no power read
                frame = talker.step(text)
            run.talker_seconds += time.perf_counter() - start
            self._check(run)
            if frame is not None:
                run.frames.append(frame)
                if vocoder is not None:
                    yield from vocoder.feed([frame], final=False)
            if not until_end and not thinker_done and talker.step_index + 1 >= len(run.tokens):
                return

    # ------------------------------------------------------------------ report

    def _report(self, run: _Run, prompt: _Prompt, verdict, energy) -> dict:
        decode_tokens = max(0, len(run.tokens) - 1)
        decode_s = (run.decode_end or time.perf_counter()) - (run.decode_start or run.t0)
        text = self.tokenizer.decode(run.tokens, skip_special_tokens=True)
        return {
            "text": text,
            "prompt_tokens": int(prompt.input_ids.shape[1]),
            "completion_tokens": len(run.tokens),
            "token_ids": list(run.tokens),
            "ttft_s": run.ttft,
            "first_audio_s": run.first_audio,
            "timeline_s": dict(run.timeline),
            "tokens_per_s": (decode_tokens / decode_s) if decode_tokens and decode_s > 0 else None,
            "total_s": time.perf_counter() - run.t0,
            "talker_frames": len(run.frames),
            "talker_s": run.talker_seconds,
            "audio_seconds": run.audio_samples / SAMPLE_RATE,
            "peak_bytes": self.loader.memory.peak,
            "budget_bytes": self.cfg.budget,
            "device": str(self.device),
            "schedule": [s.to_json() for s in verdict.schedule],
            "streaming_speech": bool(run.req.speech and run.req.stream_speech and verdict.streaming),
            "swaps": [s.to_json() for s in self.loader.swaps],
            "resident_after": list(self.loader.resident()),
            "energy": energy.to_json(),
            "cancelled": run.cancelled(),
        }


class _Talker:
    """The talker and its code predictor, one codec frame per step, fed the thinker's text step by step.
    Input construction follows Qwen3OmniMoeForConditionalGeneration.generate for a single sequence."""

    def __init__(self, engine: Engine, run: _Run, ids, inputs, thinker_embed, thinker_hidden):
        self.e = engine
        self.run = run
        self.ids = ids
        self.inputs = inputs
        self.thinker_embed = thinker_embed
        self.thinker_hidden = thinker_hidden
        self.step_index = 0
        self.finished = False
        self.generated: list[int] = []
        self.cache = None
        self.next_code = None
        self.past_hidden = None
        self.gen = None
        self.fast = None  # orin.fastdecode.StaticDecoder once the prefill is done, when decode != "eager"

    def _proj(self, embeds):
        return self.e.model.talker.text_projection(embeds)

    def _thinker_embed_of(self, token: int):
        import torch

        tok = torch.tensor([[token]], device=self.e.device)
        return self.e._text_embeddings(tok)

    def prefill(self) -> None:
        import torch
        from transformers import DynamicCache

        model, cfg = self.e.model, self.e.config
        ids = self.ids
        tk = cfg.talker_config
        self.gen = torch.Generator(device="cpu").manual_seed(self.run.req.seed + 1)
        seq_len = ids.shape[1]
        th = cfg.thinker_config
        mm_mask = (ids == th.audio_token_id) | (ids == th.image_token_id) | (ids == th.video_token_id)
        positions = torch.arange(seq_len, device=ids.device).unsqueeze(0)
        im_start = torch.where(ids == cfg.im_start_token_id, positions, positions.new_full((), -1))
        prev = torch.cummax(im_start, dim=-1).values.clamp_min(0)
        roles = ids.gather(1, (prev + 1).clamp_max(seq_len - 1))
        user_mask = roles == cfg.user_token_id
        user_idx = torch.nonzero(user_mask[0]).flatten()
        full_user = model._get_talker_user_parts(0, seq_len, mm_mask, self.thinker_hidden, self.thinker_embed)
        user_embeds = full_user[:, user_idx]
        user_ids = ids[:, user_idx]
        starts = torch.nonzero((ids[0, :-1] == cfg.im_start_token_id) & (ids[0, 1:] == cfg.assistant_token_id))
        if len(starts) == 0:
            raise ModelError("the prompt has no assistant turn; the chat template must add the generation prompt")
        a_start = int(starts.flatten()[-1])
        specials = torch.tensor([[cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id]],
                                device=ids.device)
        bos, eos, pad = self._proj(self.e._text_embeddings(specials)).chunk(3, dim=1)
        self.tts_eos, self.tts_pad = eos, pad
        first = self._thinker_embed_of(self.run.tokens[0])
        embed_all = torch.cat([self.thinker_embed, first], dim=1)
        speaker_id = tk.speaker_id[self.run.req.speaker.lower()]
        a_embeds, a_ids, _ = model._get_talker_assistant_parts(a_start, seq_len + 1, speaker_id, embed_all,
                                                               pad, bos, eos)
        embeds = torch.cat([user_embeds, a_embeds], dim=1)
        talker_ids = torch.cat([user_ids, a_ids], dim=1)
        mask = torch.ones_like(talker_ids)
        kwargs = {}
        if "image_grid_thw" in self.inputs:
            kwargs["image_grid_thw"] = self.inputs["image_grid_thw"]
        if "feature_attention_mask" in self.inputs:
            kwargs["audio_feature_lengths"] = self.inputs["feature_attention_mask"].sum(dim=1)
        model.talker.rope_deltas = None
        if self.e.decode != "eager" and (dec := self.e._fast("talker")).supported():
            position_ids = model.talker.compute_3d_position_ids(
                embeds, talker_input_ids=talker_ids, attention_mask=mask, past_key_values=None,
                image_grid_thw=kwargs.get("image_grid_thw"), audio_feature_lengths=kwargs.get("audio_feature_lengths"))
            res = dec.prefill(embeds[0], position_ids, int(embeds.shape[1]) + self.run.req.frame_cap + 2,
                              graph=self.e._keeps_weights)
            self.fast = dec
            out = SimpleNamespace(logits=res.logits.unsqueeze(1), hidden_states=((res.hidden,),))
        else:
            self.cache = DynamicCache(config=tk.text_config)
            out = model.talker(inputs_embeds=embeds, talker_input_ids=talker_ids, attention_mask=mask,
                               past_key_values=self.cache, use_cache=True, output_hidden_states=True, **kwargs)
        self._after_forward(out)

    def _after_forward(self, out) -> None:
        self.past_hidden = out.hidden_states[0][-1][:, -1:]
        code = self._choose(out.logits[:, -1])
        self.generated.append(code)
        eos = self.e.config.talker_config.codec_eos_token_id
        if code == eos or len(self.generated) > self.run.req.frame_cap:
            self.finished = True
        self.next_code = code
        self.e._track_kv(self.cache if self.fast is None else self.fast)

    def _choose(self, logits) -> int:
        import torch

        tk = self.e.config.talker_config
        vocab = tk.text_config.vocab_size
        logits = logits.float().clone()
        if self.generated:
            prev = torch.tensor(sorted(set(self.generated)), device=logits.device)
            score = logits[:, prev]
            logits[:, prev] = torch.where(score < 0, score * 1.05, score / 1.05)
        suppress = torch.arange(vocab - 1024, vocab, device=logits.device)
        suppress = suppress[suppress != tk.codec_eos_token_id]
        logits[:, suppress] = -float("inf")
        if self.run.req.ignore_eos:  # fixed lengths: speech ends at max_audio_frames, as HF's min_new_tokens does
            logits[:, tk.codec_eos_token_id] = -float("inf")
        temp = self.run.req.talker_temperature
        if temp <= 0:
            return int(torch.argmax(logits, dim=-1)[0])
        logits = logits / temp
        kth = torch.topk(logits, 50, dim=-1).values[:, -1:]
        logits[logits < kth] = -float("inf")
        probs = torch.softmax(logits, dim=-1)[0].cpu()
        return int(torch.multinomial(probs, 1, generator=self.gen))

    def step(self, text) -> object:
        """One codec frame: the code predictor fills the residual groups of the frame whose first code the
        talker chose, then the talker reads that frame plus the next text position."""
        import torch

        model = self.e.model
        tk = self.e.config.talker_config
        code = torch.tensor([[self.next_code]], device=self.e.device)
        last_id_hidden = model.talker.get_input_embeddings()(code)
        cp = model.talker.code_predictor
        if self.fast is not None and self.run.req.talker_temperature <= 0:
            codes, embeds = self.e._fast("code_predictor").run(self.past_hidden, last_id_hidden)
            frame = torch.cat((code[0], codes))
        else:
            cp_kwargs = {"do_sample": self.run.req.talker_temperature > 0}
            if cp_kwargs["do_sample"]:
                cp_kwargs.update(top_k=50, top_p=0.8)
            pred = cp.generate(inputs_embeds=torch.cat((self.past_hidden, last_id_hidden), dim=1),
                               max_new_tokens=tk.num_code_groups - 1, output_hidden_states=True,
                               return_dict_in_generate=True, **cp_kwargs)
            frame = torch.cat((code, pred.sequences.to(code.device)), dim=-1)[0]
            mid = [h[0] for h in pred.hidden_states[1:]]
            last = cp.get_input_embeddings()[-1](pred.sequences[..., -1:])
            embeds = torch.cat([last_id_hidden] + mid + [last], dim=1).sum(1, keepdim=True)
        kind, token = text
        if kind == "token":
            embeds = embeds + self._proj(self._thinker_embed_of(token))
        elif kind == "eos":
            embeds = embeds + self.tts_eos
        else:
            embeds = embeds + self.tts_pad
        if self.fast is not None:
            logits, hidden = self.fast.step_embeds(embeds)
            out = SimpleNamespace(logits=logits.unsqueeze(1), hidden_states=((hidden,),))
        else:
            out = model.talker(inputs_embeds=embeds, past_key_values=self.cache, use_cache=True,
                               output_hidden_states=True, generation_step=self.step_index)
        self.step_index += 1
        self._after_forward(out)
        return frame.cpu()


class _Vocoder:
    """code2wav in chunks with left context, so audio streams as frames arrive. The chunk schedule is fixed
    (not driven by timing), so a streamed request and a non-streamed one produce the same samples."""

    def __init__(self, engine: Engine, run: _Run):
        self.e = engine
        self.run = run
        self.frames: list = []
        self.done = 0
        self.index = 0

    def feed(self, frames, final: bool):
        import torch

        self.frames.extend(frames)
        while True:
            want = C.CODE2WAV_FIRST_CHUNK if self.done == 0 else C.CODE2WAV_CHUNK
            available = len(self.frames) - self.done
            if available <= 0 or (available < want and not final):
                return
            end = self.done + min(want, available)
            ctx = min(C.CODE2WAV_LEFT_CONTEXT, self.done)
            if "code2wav" not in self.e.loader.memory.resident:
                self.e._stage(("code2wav",))
            codes = torch.stack(self.frames[self.done - ctx:end], dim=1).unsqueeze(0).to(self.e.device)
            c2w = self.e.model.code2wav
            with self.e.meter.stage("code2wav"):
                wav = c2w(codes)[..., ctx * int(c2w.total_upsample):]
            samples = wav.reshape(-1).float().cpu().numpy()
            self.done = end
            if self.run.first_audio is None:
                self.run.first_audio = time.perf_counter() - self.run.t0
                self.run.mark("first_audio")
            self.run.audio_samples += samples.size
            yield AudioChunk(samples, self.index)
            self.index += 1


class _Detokenizer:
    """Incremental detokenization that never emits half a UTF-8 character."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.sent = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        # Trailing replacement characters may be the start of a multi-byte character: hold them back.
        text = self.tok.decode(self.ids, skip_special_tokens=True).rstrip("\ufffd")
        delta = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sent = text if text.startswith(self.sent) else self.sent
        return delta

    def flush(self) -> str:
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        delta = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sent = text
        return delta

