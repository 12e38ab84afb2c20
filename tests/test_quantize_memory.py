"""The speech pass in the memory its plan gives it (issue 18: the first run at the real widths, on an H200, ran out
of its 16 GiB in every speech conversation, then for good). What one conversation works in is what
quantize.memory.speech_working_set says, measured by an allocation tracer on the tiny model with transformers'
GPU-only decoding switch in force (generate() runs its decoding steps' experts as batched_mm on a GPU, and that
switch, shared between the layer gate's conversations, made their prefills copy every token's experts' weights:
50 MB a prompt token at the real widths); a conversation that runs out of memory is skipped and leaves no tensor
behind; the plan's speech pass at the real widths."""

from __future__ import annotations

import contextlib
import gc
import threading
import weakref
from pathlib import Path

import pytest
import torch
from allocations import Allocations

from devtools.tiny import build_processor
from orin.checkpoint.targets import QuantSpec, find_targets
from quantize import speech_capture as C
from quantize.activations import Placement, StackData
from quantize.calibration import Conversation, builtin_conversations, to_samples
from quantize.gate import LayerGate
from quantize.gptq_solve import BATCH_BYTES, batch_size, working_bytes
from quantize.hf_config import load_config
from quantize.memory import (
    DEVICE_MARGIN,
    THREAD_WORKSPACE,
    encoder_working_set,
    make_plan,
    measure,
    reply_bytes,
    speech_working_set,
    thinker_prefill_bytes,
)
from quantize.progress import Progress
from quantize.skips import PassRunner, Skips
from quantize.speech_capture import SpeechSettings, SpeechStreaming, capture_speech_pass
from quantize.weights import Residency, SourceWeights, build_skeleton, module_bytes

pytestmark = pytest.mark.usefixtures("single_torch_thread")

CPU = torch.device("cpu")
SETTINGS = SpeechSettings(reply_tokens=6, speech_frames=8, min_speech_frames=8, max_conversations=8)


@contextlib.contextmanager
def gpu_decoding(monkeypatch) -> contextlib.AbstractContextManager:
    """transformers' generate() as it runs on a GPU, here on the CPU: its decoding steps switch the model's experts
    from grouped_mm to batched_mm (GenerationMixin._optimize_model_for_decode, which does it only off the CPU).
    Yields the number of rows of each batched_mm experts call."""
    import transformers.integrations.moe as moe
    from transformers.generation.utils import GenerationMixin

    @contextlib.contextmanager
    def switched(self):
        original = self.get_experts_implementation()
        self.set_experts_implementation({k: "batched_mm" if v == "grouped_mm" else v for k, v in original.items()})
        try:
            yield
        finally:
            self.set_experts_implementation(original)

    rows: list[int] = []
    batched = moe.ALL_EXPERTS_FUNCTIONS._global_mapping["batched_mm"]

    def counted(module, hidden_states, *args, **kwargs):
        rows.append(hidden_states.shape[0])
        return batched(module, hidden_states, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "_optimize_model_for_decode", switched)
    monkeypatch.setitem(moe.ALL_EXPERTS_FUNCTIONS._global_mapping, "batched_mm", counted)
    yield rows


def _samples(convs: list[Conversation]) -> list:
    samples = to_samples(build_processor(), convs, CPU, Skips(print))
    for s in samples:
        s.heldout = True  # every one runs, in order, none replaced
    return samples


def _long_text(name: str, words: int) -> Conversation:
    text = " ".join(("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf")[i % 7] for i in range(words))
    return Conversation(name, [{"role": "user", "content": f"Repeat this: {text}"},
                               {"role": "assistant", "content": "Done."}])


def _patches(sample) -> int:
    return sum(int(sample.inputs[k].shape[0]) for k in ("pixel_values", "pixel_values_videos") if k in sample.inputs)


def _speech_pass(model_dir: str, samples: list, wave: int, log: list, edit=lambda _model: None):
    config = load_config(model_dir)
    model = build_skeleton(config)
    edit(model)
    residency = Residency(model, SourceWeights(Path(model_dir)), CPU, find_targets(model, QuantSpec()), None)
    runner = PassRunner("the test set", Skips(log.append), Progress(enabled=False))
    data, _refs, result = capture_speech_pass(model, residency, samples, {"talker"}, SETTINGS, True, runner,
                                              lambda _stack: StackData(Placement("device", CPU)),
                                              SpeechStreaming(wave, 0))
    return config, model, data, result


# ---------------------------------------------------------------------- what one conversation works in


def test_a_speech_conversation_works_in_what_the_plan_gives_it(tiny_model_dir, monkeypatch):
    """The layer gate's waves (every reply so far, one conversation's prefill at a time) and each conversation's
    talker side, traced with generate()'s GPU decoding switch in force: each stays within the plan's figures
    (reply_bytes for each conversation of the wave beside the working set of one; speech_working_set for the
    talker side), and no prefill runs batched_mm experts (which copy each routed token's expert weights: on the
    tiny model 128 KiB a token, 35 times the formula's thinker prefill)."""
    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration as Thinker

    chats = builtin_conversations(4)  # a text chat, an image, audio, both
    samples = _samples([chats[0], _long_text("long", 1500), *chats[1:]])
    allocations = Allocations()
    waves: list[tuple[list, int]] = []  # (its conversations, bytes at its peak beyond what was there before)
    talker_side: dict[str, int] = {}
    asked: list = []
    thinker_generate, thinker_call, gate_run = Thinker.generate, C.thinker_call, LayerGate.run
    generate_speech, speech_commit = C.generate_speech, C.speech_commit
    base = [0]

    vocab = load_config(tiny_model_dir).thinker_config.text_config.vocab_size
    made: dict[str, int] = {"bytes": 0, "logit rows": 0}

    def seen(t: torch.Tensor) -> None:  # the largest tensor made, and the most positions of logits at once
        made["bytes"] = max(made["bytes"], t.numel() * t.element_size())
        if t.dim() >= 2 and t.shape[-1] == vocab:
            made["logit rows"] = max(made["logit rows"], t.numel() // vocab)

    def traced_generate(self, *args, **kwargs):  # a conversation's thinker reply, in its gate thread
        with allocations.mode(seen):
            return thinker_generate(self, *args, **kwargs)

    def call(model, sample, *args, **kwargs):  # a wave asks for each of its conversations' thinker call first
        asked.append(sample)
        return thinker_call(model, sample, *args, **kwargs)

    def run(self, jobs):
        start = allocations.mark()
        try:
            return gate_run(self, jobs)
        finally:
            waves.append((asked[:], allocations.peak - start))
            asked.clear()

    def generate(model, sample, *args, **kwargs):
        base[0] = allocations.mark()
        return generate_speech(model, sample, *args, **kwargs)

    def commit(model, data, refs, name, *args, **kwargs):
        try:
            return speech_commit(model, data, refs, name, *args, **kwargs)
        finally:
            talker_side[name] = allocations.peak - base[0]

    monkeypatch.setattr(Thinker, "generate", traced_generate)
    monkeypatch.setattr(C, "thinker_call", call)
    monkeypatch.setattr(LayerGate, "run", run)
    monkeypatch.setattr(C, "generate_speech", generate)
    monkeypatch.setattr(C, "speech_commit", commit)
    with gpu_decoding(monkeypatch) as batched_rows, allocations.mode():
        config, model, data, result = _speech_pass(tiny_model_dir, samples, 2, [])
    assert [s.name for s in result.heldout] == [s.name for s in samples] and len(data["talker"].heldout) == 5
    assert batched_rows and set(batched_rows) == {1}  # the switch was on, for decoding steps only
    longest = max(samples, key=lambda s: s.tokens)
    assert longest.name == "long" and longest.tokens > 1500
    text = config.thinker_config.text_config
    gathered = 2 * longest.tokens * text.num_experts_per_tok * 2 * text.moe_intermediate_size * text.hidden_size
    assert made["bytes"] < gathered / 10  # batched_mm's copy of the routed experts' weights for its prefill
    assert made["logit rows"] == 1  # a prefill's logits at its last position only, not [positions, vocab]

    def prefill(s) -> int:  # what a conversation's turn in the gate works in
        return max(thinker_prefill_bytes(config, s.tokens), encoder_working_set(config, _patches(s), s.tokens))

    def working(s) -> int:
        return max(speech_working_set(config, s.tokens, SETTINGS, False),
                   encoder_working_set(config, _patches(s), s.tokens))

    # the gate's scheduler (this thread) loads one layer at a time: its tensors, and its largest one's parts
    layers = model.get_submodule("thinker.model.language_model.layers")
    layer = max(module_bytes(model, f"thinker.model.language_model.layers.{i}") for i in range(len(layers)))
    staging = max(p.numel() * p.element_size() for p in layers.parameters())
    assert [[s.name for s in wave] for wave, _used in waves] == [["builtin:0", "long"], ["builtin:1", "builtin:2"],
                                                                 ["builtin:3"]]
    for wave, used in waves:
        allowed = layer + sum(reply_bytes(config, s.tokens, SETTINGS.reply_tokens) for s in wave) + max(
            staging, *map(prefill, wave))
        assert 0 < used <= allowed, ([s.name for s in wave], used, allowed)
    for s in samples:
        assert 0 < talker_side[s.name] <= working(s), (s.name, talker_side[s.name], working(s))
    assert talker_side["long"] > working(longest) / 2  # an estimate of what it uses, not a bound far above it


# ---------------------------------------------------------------------- out of memory in one conversation


def test_a_conversation_out_of_memory_is_skipped_and_leaves_no_tensor_behind(tiny_model_dir, monkeypatch):
    """torch.OutOfMemoryError in one conversation's thinker reply (in its gate thread, at its prefill's last
    decoder layer) and in another's talker side (its third code-predictor step): both are skipped with the
    reason, the others calibrate the talker, and every tensor the two failing conversations made is freed by the
    time they are skipped, not whenever Python's garbage collector would next run (it is off here): the speech
    pass keeps a failed reply's exception until its conversation runs, its traceback held the failed forward
    pass's frames, and those frames and transformers' hooks make reference cycles."""
    samples = _samples(builtin_conversations(6))
    in_thinker, in_talker = samples[1], samples[3]
    made: dict[str, list] = {in_thinker.name: [], in_talker.name: []}
    thread = threading.local()
    allocations = Allocations()

    from transformers import Qwen3OmniMoeThinkerForConditionalGeneration as Thinker

    thinker_generate = Thinker.generate

    def tagged_generate(self, *args, **kwargs):
        ids = kwargs["input_ids"]
        thread.name = next(s.name for s in samples if torch.equal(s.prompt_inputs["input_ids"], ids))
        if thread.name != in_thinker.name:
            return thinker_generate(self, *args, **kwargs)
        with allocations.mode(lambda t: made[in_thinker.name].append(weakref.ref(t))):
            return thinker_generate(self, *args, **kwargs)

    def out_of_memory_at_prefill(_module, args):
        if getattr(thread, "name", None) == in_thinker.name and args[0].shape[1] > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.69 GiB (forced by the test)")

    generate_speech = C.generate_speech
    steps = {"n": 0}

    def generate(model, sample, *args, **kwargs):
        if sample.name != in_talker.name:
            return generate_speech(model, sample, *args, **kwargs)
        predictor = model.talker.code_predictor
        predictor_generate = predictor.generate

        def failing(*a, **k):
            steps["n"] += 1
            if steps["n"] == 3:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.91 GiB (forced by the test)")
            return predictor_generate(*a, **k)

        predictor.generate = failing
        try:
            with allocations.mode(lambda t: made[in_talker.name].append(weakref.ref(t))):
                return generate_speech(model, sample, *args, **kwargs)
        finally:
            del predictor.generate

    monkeypatch.setattr(Thinker, "generate", tagged_generate)
    monkeypatch.setattr(C, "generate_speech", generate)

    def edit(model):
        model.thinker.model.language_model.layers[-1].register_forward_pre_hook(out_of_memory_at_prefill)

    log: list[str] = []
    gc.collect()
    gc.disable()
    try:
        _config, _model, data, result = _speech_pass(tiny_model_dir, samples, 6, log, edit)
        alive = {name: sum(ref() is not None for ref in refs) for name, refs in made.items()}
    finally:
        gc.enable()
    assert steps["n"] == 3
    assert all(len(refs) > 20 for refs in made.values())  # the failing conversations did make tensors
    assert alive == {in_thinker.name: 0, in_talker.name: 0}
    assert [s.name for s in result.skipped] == [in_thinker.name, in_talker.name]
    assert len(result.heldout) == 4 and len(data["talker"].heldout) == 4
    assert (f"warning: skipping calibration conversation {in_thinker.name} (speech pass): OutOfMemoryError: CUDA "
            "out of memory. Tried to allocate 4.69 GiB (forced by the test)") in log
    assert any(line.startswith(f"warning: skipping calibration conversation {in_talker.name} (speech pass): "
                               "OutOfMemoryError") for line in log)


def test_the_pass_runner_never_holds_more_prepared_conversations_than_a_wave():
    """Replies prepared ahead wait in memory until their conversation runs: a held-out conversation that fails
    brings in a stand-in, whose wave is only as large as the room the replies still waiting leave (the plan
    sizes `wave` of them)."""
    from dataclasses import dataclass

    from quantize.skips import UnusableConversation

    @dataclass(eq=False)
    class Sample:
        name: str
        heldout: bool = False
        modalities: frozenset = frozenset({"text"})

    samples = [Sample("h0", True), Sample("h1", True)] + [Sample(f"c{i}") for i in range(8)]
    waiting: set[str] = set()
    most = [0]
    waves: list[list[str]] = []

    def prepare(batch):
        waves.append([s.name for s in batch])
        waiting.update(s.name for s in batch)
        most[0] = max(most[0], len(waiting))

    def work(sample, _heldout):
        waiting.discard(sample.name)
        if sample.name == "h0":
            raise UnusableConversation("the thinker's reply is empty (it ended at once)")
        return lambda: None

    log: list[str] = []
    result = PassRunner("the test set", Skips(log.append), Progress(enabled=False)).run(
        "speech", samples, work, 6, prepare=prepare, batch=4)
    assert "note: holding out c7 for the report in place of h0" in log
    assert [s.name for s in result.heldout] == ["h1", "c7"] and len(result.calibration) == 6
    assert waves[:2] == [["h0", "h1", "c0", "c1"], ["c7", "c2"]]  # c0 and c1 still wait: room for two
    assert most[0] == 4


# ---------------------------------------------------------------------- the plan at the real widths


class _Sample:
    def __init__(self, name: str, tokens: int, patches: int = 0, heldout: bool = False):
        self.name, self.tokens, self.heldout = name, tokens, heldout
        self.inputs = {"pixel_values": torch.empty((patches, 1), device="meta")} if patches else {}


def test_the_speech_pass_plan_at_the_real_widths(real_config):
    """speech_working_set at the real widths is the per-token formula (the figures measured on the CPU at these
    widths, in its docstring, are below it); the plan's speech pass adds, per conversation of a wave, its reply
    and its thread's cuBLAS workspace, and the loaded thinker layers (never more than the model has); a
    calibration set of long videos gets a smaller wave than short chats within the same 16 GiB."""
    config = load_config(real_config)
    # thinker prefill, per token: the MoE's 4 rows of 8 experts x 2048 (BF16) beside a 4 x 2048 stream, the
    # router's 128 scores in BF16 and float32, the sort's int64 indices
    thinker = 2 * 8 * 4 * 2048 + 2 * 4 * 2048 + 6 * 128 + 32 * 8
    # talker side, per token: its MoE (6 experts x 4 x 1024), 21 hidden states and 20 layers' KV cache kept,
    # a 6 x 1024 stream, the thinker's 2 x 2048 states and 4 x 1024 of its prompt, the sort's indices
    talker = 2 * 6 * 4 * 1024 + 2 * 1024 * 21 + 4 * 20 * 2 * 128 + 2 * 1024 * 6 + 2 * 2 * 2048 + 2 * 1024 * 4 + 32 * 6
    assert (thinker, talker) == (148_480, 141_504)
    settings = SpeechSettings()
    assert speech_working_set(config, 5000, settings, False) == 5000 * thinker
    assert speech_working_set(config, 100, settings, False) == (100 + 64 + 128) * talker
    assert speech_working_set(config, 100, settings, True) == 10 * 96 * 1920 * 128  # code2wav's last stage

    model = build_skeleton(config)
    targets = find_targets(model, QuantSpec())
    stacks = {t.component for t in targets}
    comps = {"thinker_text", "audio_encoder", "vision_encoder", "talker"}

    def plan(samples, gpu=16 << 30):
        sizes = measure(model, config, samples, stacks, comps, targets, settings)
        return sizes, make_plan(sizes, "cuda", gpu, 24 << 30, 3 << 30, stacks, True, True)

    chats = [_Sample(f"c{i}", 60 + 37 * (i % 9), 256 * (i % 4 == 1), heldout=i >= 120) for i in range(128)]
    sizes, default = plan(chats)
    loaded = min(default.keep_layers + 1, 48) * sizes.layer["thinker_text"]
    assert default.gpu["speech_pass"] == (sizes.shell + sizes.head + sizes.speech + loaded + sum(sizes.acts.values())
                                          + default.speech_wave * (sizes.per_reply + THREAD_WORKSPACE)
                                          + max(sizes.speech_work, sizes.staging) + DEVICE_MARGIN)
    assert sizes.staging == 128 * 2 * 768 * 2048 * 2  # a layer's fused gate_up_proj, loaded beside its parts
    assert default.speech_wave == 40 and max(default.gpu.values()) <= 16 << 30
    _sizes, roomy = plan(chats, 22 << 30)
    assert roomy.keep_layers > default.keep_layers
    # 30 s videos: 6,000 tokens each, 1.2 GiB of reply and 0.8 GiB of working memory for the longest
    videos = [_Sample(f"v{i}", 6000, 23520, heldout=i >= 120) for i in range(128)]
    video_sizes, long = plan(videos)
    assert video_sizes.speech_work == max(6000 * thinker, 24 * 23520 * 1152 + 24 * 6000 * 2048)  # or the encoders
    assert 1 <= long.speech_wave < default.speech_wave and max(long.gpu.values()) <= 16 << 30


def test_the_gptq_stage_counts_a_batch_of_experts(real_config):
    """The own solver solves a MoE layer's experts in batches within gptq_solve.BATCH_BYTES (quantize/sequential.py):
    the plan's GPTQ stage counts the largest batch (9 thinker experts' gate and up stacked [1536, 2048], or 102
    talker experts' down [1024, 384]: each just under the budget), more than any one matrix takes; a stack without
    experts counts its largest matrix as before."""
    config = load_config(real_config)
    model = build_skeleton(config)
    targets = find_targets(model, QuantSpec())
    stacks = {t.component for t in targets}
    samples = [_Sample(f"c{i}", 300, heldout=i >= 6) for i in range(8)]
    sizes = measure(model, config, samples, stacks, stacks, targets, SpeechSettings())
    assert batch_size(1536, 2048, 32, BATCH_BYTES) == 9 and batch_size(1024, 384, 32, BATCH_BYTES) == 102
    assert sizes.solver == 102 * working_bytes(1024, 384, 32) <= BATCH_BYTES
    assert sizes.solver > 9 * working_bytes(1536, 2048, 32) > 0.99 * BATCH_BYTES
    plan = make_plan(sizes, "cuda", 16 << 30, 24 << 30, 3 << 30, stacks, True, True)
    assert plan.activations == "device"
    acts = sum(sizes.acts.values()) + sizes.acts["thinker_text"] + sizes.capture["thinker_text"]
    assert plan.gpu["gptq_thinker_text"] == 2 * sizes.layer["thinker_text"] + sizes.solver + acts + DEVICE_MARGIN
    vision = measure(model, config, samples, {"vision_encoder"}, stacks, targets, SpeechSettings())
    assert vision.solver == 4 * (4 * 4304 * 1152 + 3 * 1152 * 1152) < sizes.solver  # its MLP's fc1, 1152 -> 4304
