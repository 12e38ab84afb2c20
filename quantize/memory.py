"""The memory plan of a quantize run, made before any weight is loaded: what the run holds at its largest in GPU
memory and in host memory, stage by stage, and the choices that keep both under --max-gpu-memory and
--max-host-memory.

What can vary, fastest first:
- where calibration activations live (quantize.activations): on the device, in host memory, or on disk;
- how many conversations the speech pass generates replies for at once (its `wave`: each wave costs one sweep
  over the thinker's 48 layers per reply token, and each of its conversations holds a KV cache meanwhile);
- how many thinker layers stay loaded through the speech pass's sweeps (`keep_layers`: each one kept is read
  from disk once instead of once per reply token).
What cannot: one decoder layer of the largest stack with its GPTQ working set, the thinker's encoders and
embeddings through the BF16 passes, and the talker with code2wav through the speech pass, with what one
conversation works in there (its longest: `speech_working_set`). A limit below that fails here, naming the option
to change and the least it must be.

The figures are estimates from the model's shapes and the encoded calibration set (token counts per
conversation), with margins for the allocator and library workspaces. On CUDA the GPU limit is also enforced
(torch.cuda.set_per_process_memory_fraction): an estimate that falls short stops the run with an error (and the
run resumes where it stopped) instead of taking more than the limit. With --device cpu there is no GPU:
everything counts as host memory.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from orin.errors import BudgetError
from orin.units import format_bytes

from . import adapters as A
from .activations import tree_bytes

DEFAULT_MAX_GPU_MEMORY = 16 << 30  # fits a 24 GB card with room for the CUDA context, and the Orin beside the OS
DEFAULT_MAX_HOST_MEMORY = 24 << 30
# Beyond the estimated tensors: cuBLAS and SDPA workspaces, the caching allocator's rounding and fragmentation.
DEVICE_MARGIN = 768 << 20
# Host memory the run needs beyond the interpreter it starts in: orin.memory.block_reader's staging buffers (2 x 64 MiB
# per reading thread, pinned on CUDA), the shard writer's queue, a layer's GPTQ tensors while written, slack.
HOST_MARGIN = 1536 << 20
# Bytes one token's activations take per hidden unit in a stored call: the BF16 hidden states (2) plus the
# keyword arguments every layer gets (rotary cos/sin, positions): measured at most ~1.25x the hidden states.
CALL_BYTES_PER_UNIT = 2.5
# The report's logits comparison in float32, LOGIT_ROWS positions of two conversations' logits at a time.
LOGITS_WORK = 2 * 4 * 1024 * 152064
# On CUDA each thread that runs a matmul has a cuBLAS handle of its own, and torch keeps a workspace per handle in
# the caching allocator (32 MiB on Hopper, ~8 MiB before it, plus cuBLASLt's 1 MiB): the speech pass's layer gate
# runs each conversation of a wave in a thread.
THREAD_WORKSPACE = 33 << 20
# code2wav decodes at most this many codec frames at once (transformers' chunked_decode: 300 and 25 of context).
CODE2WAV_CHUNK = 325


@dataclass
class MemoryPlan:
    device: str  # the compute device's type: "cuda" or "cpu"
    max_gpu_memory: int | None
    max_host_memory: int
    activations: str  # "device", "host" or "disk"
    speech_wave: int
    keep_layers: int
    gpu: dict = field(default_factory=dict)  # stage -> estimated peak bytes on the GPU
    host: dict = field(default_factory=dict)  # stage -> estimated peak host RSS

    def to_json(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        where = {"device": "on the GPU" if self.device == "cuda" else "in memory", "host": "in host memory",
                 "disk": "on disk (OUT/.partial)"}[self.activations]
        gpu = f"GPU {format_bytes(max(self.gpu.values(), default=0))} of {format_bytes(self.max_gpu_memory)}, " \
            if self.device == "cuda" else ""
        return (f"memory plan: {gpu}host {format_bytes(max(self.host.values(), default=0))} of "
                f"{format_bytes(self.max_host_memory)} at most; activations {where}; speech pass replies "
                f"{self.speech_wave} at a time, {self.keep_layers} thinker layer(s) kept loaded")


@dataclass(frozen=True)
class Sizes:
    """What the plan reads off the model and the calibration set, in bytes (BF16 weights)."""

    layer: dict  # stack -> its largest layer
    staging: int  # the largest tensor of a thinker decoder layer: loading it holds its parts beside it
    layers: dict  # stack -> number of layers
    shell: int  # the thinker's encoders and embeddings
    head: int  # the thinker's final norm and lm_head
    speech: int  # the talker (with its code predictor), and code2wav when it is calibrated
    solver: int  # the largest GPTQ working set: of one matrix (fp32 weight copies, Hessian and its inverse), or of
    # one batch of experts (gptq_solve.solve_batched within gptq_solve.BATCH_BYTES)
    acts: dict  # stack -> its stored calls (calibration + held-out), one layer's worth
    capture: dict  # stack -> one stage's captured inputs at the widest input
    encode: int  # the largest transient of one conversation's encoder pass
    refs: int  # the held-out BF16 logits kept for the report
    logits: int  # one conversation's logits (the longest's), BF16
    inputs: int  # the encoded calibration set (pixels, audio features, token ids), in host memory
    per_reply: int  # one speech-pass conversation's KV cache and kept hidden states, on the device
    speech_work: int  # what one speech-pass conversation (the longest) works in beside that, at its largest
    speech_convs: int  # conversations the speech pass generates replies for
    speech_acts: int  # the speech stacks' calls the speech pass collects


def measure(skeleton, config, samples, stacks: set[str], comps: set[str], targets: list, settings) -> Sizes:
    """Sizes for a run over `samples` quantizing `stacks` (of the requested components `comps`)."""
    from .capture import THINKER_HEAD, THINKER_SHELL
    from .weights import module_bytes

    layer, layers = {}, {}
    for s in A.STACKS:
        mods = skeleton.get_submodule(s.layers)
        layers[s.component] = len(mods)
        layer[s.component] = max(module_bytes(skeleton, f"{s.layers}.{i}") for i in range(len(mods)))
    staging = max(p.numel() * p.element_size() for p in skeleton.get_submodule(A.STACK_OF["thinker_text"].layers)
                  .parameters())
    shell = sum(module_bytes(skeleton, p) for p in THINKER_SHELL)
    head = sum(module_bytes(skeleton, p) for p in THINKER_HEAD)
    speech = module_bytes(skeleton, "talker") + module_bytes(skeleton, "code2wav")
    solver = 0
    for t in targets:
        if t.component not in stacks:
            continue
        for _suffix, k, n, _bias in t.linears()[:3]:
            kp = -(-k // 128) * 128
            solver = max(solver, 4 * (4 * n * kp + 3 * kp * kp))
        solver = max(solver, _expert_batches(t))
    tc = config.thinker_config
    text, vision, audio = tc.text_config, tc.vision_config, tc.audio_config
    talker = config.talker_config.text_config
    widths = {"thinker_text": text.hidden_size, "vision_encoder": vision.hidden_size, "audio_encoder": audio.d_model,
              "talker": talker.hidden_size, "code_predictor": config.talker_config.code_predictor_config.hidden_size,
              "code2wav": config.code2wav_config.hidden_size}
    inputs = {"thinker_text": 0, "vision_encoder": 0, "audio_encoder": 0}
    for s in samples:
        inputs["thinker_text"] += s.tokens
        inputs["vision_encoder"] += sum(int(s.inputs[k].shape[0]) for k in ("pixel_values", "pixel_values_videos")
                                        if k in s.inputs)
        inputs["audio_encoder"] += _audio_tokens(s.inputs, audio.n_window)
    n_speech = min(len(samples), settings.max_conversations + sum(s.heldout for s in samples))
    longest = sorted((s.tokens for s in samples), reverse=True)[:n_speech]
    frames = settings.speech_frames
    speech_tokens = sum(t + settings.reply_tokens + frames for t in longest)
    inputs.update(talker=speech_tokens, code_predictor=n_speech * frames * (config.talker_config.num_code_groups + 1),
                  code2wav=n_speech * frames)
    acts = {s: int(CALL_BYTES_PER_UNIT * inputs[s] * widths[s]) for s in inputs}
    widest = {s.component: _widest_input(targets, s.component, widths[s.component]) for s in A.STACKS}
    capture = {s: 2 * inputs[s] * widest[s] for s in inputs}
    heldout_tokens = sum(s.tokens for s in samples if s.heldout)
    refs = 2 * heldout_tokens * text.vocab_size
    biggest = max(samples, key=lambda s: s.tokens)
    logits = 2 * biggest.tokens * text.vocab_size
    encoded = sum(tree_bytes(s.inputs) + tree_bytes(getattr(s, "prompt_inputs", {})) for s in samples)
    patches = max((sum(int(s.inputs[k].shape[0]) for k in ("pixel_values", "pixel_values_videos") if k in s.inputs)
                   for s in samples), default=0)
    encode = encoder_working_set(config, patches, biggest.tokens)
    per_reply = reply_bytes(config, biggest.tokens, settings.reply_tokens)
    speech_work = max(encode, speech_working_set(config, biggest.tokens, settings, "code2wav" in stacks))
    speech_acts = sum(acts[s] for s in ("talker", "code_predictor", "code2wav") if s in stacks)
    return Sizes(layer, staging, layers, shell, head, speech, solver, {s: a for s, a in acts.items() if s in stacks},
                 {s: c for s, c in capture.items() if s in stacks}, encode, refs, logits, encoded, per_reply,
                 speech_work, n_speech, speech_acts)


def _expert_batches(t) -> int:
    """The own solver's batch of a fused experts target at its largest (quantize/sequential.py): experts' gate
    and up stacked [2I, H], or their down [H, I], as many as gptq_solve.BATCH_BYTES takes. Counted whichever
    solver runs: GPTQModel's may not be known here, and it is at most that budget."""
    from .gptq_solve import batch_bytes

    if t.kind != "experts":
        return 0
    # K rounded up as above; 32, the smallest group size the INT4 kernels take, has the most scales
    return max(batch_bytes(n, -(-k // 128) * 128, 32, t.num_experts)
               for n, k in ((2 * t.intermediate, t.in_features), (t.out_features, t.intermediate)))


def encoder_working_set(config, patches: int, tokens: int) -> int:
    """The largest transient of one conversation's pass through the thinker's encoders and embeddings (vision
    patches, prompt tokens)."""
    tc = config.thinker_config
    return 24 * patches * tc.vision_config.hidden_size + 24 * tokens * tc.text_config.hidden_size


def reply_bytes(config, tokens: int, reply_tokens: int) -> int:
    """What the thinker's reply to a conversation of `tokens` tokens holds while the speech pass keeps it: its KV
    cache through generate() (dropped once done), and the two hidden states generate(return_audio=True) reads of
    every position (the embeddings and those of accept_hidden_layer)."""
    text = config.thinker_config.text_config
    kv_width = 2 * text.num_key_value_heads * text.head_dim * 2 * text.num_hidden_layers
    return (tokens + reply_tokens) * (kv_width + 2 * 2 * text.hidden_size)


def speech_working_set(config, tokens: int, settings, decode_audio: bool) -> int:
    """Bytes one speech-pass conversation of `tokens` tokens works in at its largest, beside the reply it keeps
    (Sizes.per_reply), as quantize/speech_capture.py runs it (grouped_mm experts in every prefill, a prefill's
    logits at its last position only): the largest of its thinker prefill (thinker_prefill_bytes), its talker side
    (talker_side_bytes) and, when code2wav is calibrated (decode_audio), code2wav's decode of its speech: ~10
    bytes per channel and output sample of the last upsampling stage (1.84 MB a frame at the real widths, 1.70
    MB measured on the CPU), CODE2WAV_CHUNK frames at most."""
    import math

    audio = 0
    if decode_audio:
        c2w = config.code2wav_config
        channels = c2w.decoder_dim >> len(c2w.upsample_rates)
        samples = math.prod(c2w.upsample_rates) * math.prod(c2w.upsampling_ratios)
        audio = 10 * channels * samples * min(settings.speech_frames, CODE2WAV_CHUNK)
    return max(thinker_prefill_bytes(config, tokens), talker_side_bytes(config, tokens, settings), audio)


def _moe_bytes(width: int, intermediate: int, top_k: int) -> int:
    """Per token, a grouped_mm MoE at its largest: the routed copies of the hidden states beside the expert
    outputs, the weighted and the reordered rows (4 x top_k rows of `width`), or beside the up projection and
    its activation; BF16."""
    return 2 * top_k * max(4 * width, width + 4 * intermediate)


def thinker_prefill_bytes(config, tokens: int) -> int:
    """A conversation's prefill through one thinker decoder layer in the layer gate, per token: the MoE, or the
    attention (q/k/v and their float32 norms), beside the layer's residual stream, the router's scores and the
    sort's indices: 145 KiB at the real widths (143 KiB measured on the CPU)."""
    text = config.thinker_config.text_config
    heads, kv_heads, head_dim = text.num_attention_heads, text.num_key_value_heads, text.head_dim
    attention = 2 * (heads + 2 * kv_heads) * head_dim + 4 * 3 * (heads + kv_heads) * head_dim
    moe = _moe_bytes(text.hidden_size, text.moe_intermediate_size, text.num_experts_per_tok)
    return tokens * (max(moe, attention) + 2 * 4 * text.hidden_size + 6 * text.num_experts
                     + 32 * text.num_experts_per_tok)


def talker_side_bytes(config, tokens: int, settings) -> int:
    """A conversation's talker side, per token of prompt, reply and speech: generate()'s talker prefill (its MoE,
    its residual stream and shared expert, the KV cache and every layer's hidden states that generate() keeps,
    the thinker's states concatenated into the talker's prompt), then the teacher-forced replay (less): 138 KiB
    at the real widths (with 2 of the talker's 20 layers: 84 KiB, 75 KiB measured on the CPU)."""
    hidden = config.thinker_config.text_config.hidden_size
    talker = config.talker_config.text_config
    width, layers = talker.hidden_size, talker.num_hidden_layers
    kept = 2 * width * (layers + 1) + 2 * 2 * layers * talker.num_key_value_heads * talker.head_dim
    stream = 2 * width * 6 + 2 * 2 * hidden + 2 * width * 4  # layer stream, shared expert; thinker states, prompt
    per_token = _moe_bytes(width, talker.moe_intermediate_size, talker.num_experts_per_tok) + kept + stream \
        + 32 * talker.num_experts_per_tok
    return (tokens + settings.reply_tokens + settings.speech_frames) * per_token


def _audio_tokens(inputs: dict, n_window: int) -> int:
    mask = inputs.get("feature_attention_mask")
    if mask is None:
        return 0
    frames = [int(x) for x in mask.sum(-1).tolist()]
    chunk = n_window * 2
    out = 0
    for f in frames:
        feat = (f % chunk - 1) // 2 + 1
        out += ((feat - 1) // 2 + 1 - 1) // 2 + 1 + (f // chunk) * 13
    return out


def _widest_input(targets: list, component: str, hidden: int) -> int:
    return max([hidden] + [k for t in targets if t.component == component for _s, k, _n, _b in t.linears()[:3]])


def make_plan(sizes: Sizes, device: str, max_gpu: int, max_host: int, host_base: int, stacks: set[str],
              thinker_side: bool, speech: bool, activations: str | None = None) -> MemoryPlan:
    """The fastest choices that fit both limits (see the module docstring); BudgetError when none does.
    `activations` forces their placement ("device", "host" or "disk") instead of choosing it."""
    cuda = device == "cuda"
    acts_total = sum(sizes.acts.values())
    largest_stack = max(stacks, key=lambda s: sizes.layer[s], default=None)

    def stage_needs(where: str, wave: int, keep: int) -> tuple[dict, dict]:
        on_device = acts_total if where == "device" else 0
        gpu: dict = {}
        # the held-out references stay in memory unless activations go to disk (then they are read back one
        # at a time), and one conversation's logits are compared with them a slice of positions at a time
        refs = 0 if where == "disk" else sizes.refs
        host: dict = {"base": host_base + HOST_MARGIN + sizes.inputs + refs + sizes.logits + LOGITS_WORK}
        if thinker_side:
            gpu["thinker_pass"] = (sizes.shell + sizes.head + sizes.layer["thinker_text"] + sizes.encode
                                   + sizes.logits + on_device)
        if speech:
            # while the gate runs a wave: the thinker's loaded layers, each conversation's reply so far and its
            # thread's cuBLAS workspace, and either one conversation's working set or the next layer's staging
            # (the talker's side comes after the wave, with less: the layers and workspaces are gone by then)
            loaded = min(keep + 1, sizes.layers["thinker_text"]) * sizes.layer["thinker_text"]
            per_conversation = sizes.per_reply + (THREAD_WORKSPACE if cuda else 0)
            gpu["speech_pass"] = (sizes.shell + sizes.head + sizes.speech + loaded + wave * per_conversation
                                  + max(sizes.speech_work, sizes.staging) + on_device)
        for s in stacks:
            stack_acts = sizes.acts.get(s, 0)
            # the calls, this layer's outputs beside its inputs, a stage's captures, the layer (its fused experts
            # stacked beside their staging), the solver
            device_acts = (on_device + stack_acts + sizes.capture.get(s, 0)) if where == "device" else 0
            gpu[f"gptq_{s}"] = 2 * sizes.layer[s] + sizes.solver + device_acts
            if where != "device":
                host[f"gptq_{s}"] = host["base"] + sizes.capture.get(s, 0) + (
                    acts_total + stack_acts if where == "host" else 0)
        if where == "host":
            host["passes"] = host["base"] + acts_total
        gpu = {k: v + DEVICE_MARGIN for k, v in gpu.items()}
        if not cuda:  # one memory: what the device would hold is host memory too
            host = {k: host.get(k, host["base"]) + gpu.get(k, 0) for k in set(host) | set(gpu)}
            gpu = {}
        return gpu, host

    def fits(gpu: dict, host: dict) -> bool:
        return (not cuda or max(gpu.values(), default=0) <= max_gpu) and max(host.values()) <= max_host

    choices = (activations,) if activations else ("device", "host", "disk")
    for where in choices:
        gpu, host = stage_needs(where, 1, 0)
        if fits(gpu, host):
            break
    else:
        _refuse(gpu, host, cuda, max_gpu, max_host, largest_stack)
    wave = 1
    while speech and wave < sizes.speech_convs and fits(*stage_needs(where, wave + 1, 0)):
        wave += 1
    keep = 0
    while speech and keep < sizes.layers["thinker_text"] and fits(*stage_needs(where, wave, keep + 1)):
        keep += 1
    gpu, host = stage_needs(where, wave, keep)
    return MemoryPlan(device, max_gpu if cuda else None, max_host, where, wave, keep, gpu, host)


def _refuse(gpu: dict, host: dict, cuda: bool, max_gpu: int, max_host: int, largest: str | None) -> None:
    if cuda and max(gpu.values(), default=0) > max_gpu:
        stage = max(gpu, key=gpu.get)
        need = gpu[stage]
        raise BudgetError(f"--max-gpu-memory {format_bytes(max_gpu)} is too small: quantizing this model needs at "
                          f"least {format_bytes(need)} of GPU memory ({_what(stage)}); raise --max-gpu-memory to "
                          f"{_round_up(need)} or more, or quantize on the CPU (--device cpu)")
    stage = max(host, key=host.get)
    need = host[stage]
    raise BudgetError(f"--max-host-memory {format_bytes(max_host)} is too small: this run needs at least "
                      f"{format_bytes(need)} of host memory ({_what(stage)}); raise --max-host-memory to "
                      f"{_round_up(need)} or more, or calibrate on fewer or shorter conversations (--samples)")


def _what(stage: str) -> str:
    if stage.startswith("gptq_"):
        return f"GPTQ of one {stage[5:].replace('_', ' ')} layer"
    return {"thinker_pass": "the thinker pass: the encoders, the embeddings and one decoder layer",
            "speech_pass": "the speech pass: the talker and code2wav, the thinker's encoders and one of its layers, "
                           "and one conversation's working memory",
            "base": "the interpreter, the BF16 reference logits and read buffers",
            "passes": "the calibration activations in host memory"}.get(stage, stage)


def _round_up(n: int) -> str:
    gib = -(-n // (1 << 29)) / 2  # to the next half GiB
    return f"{gib:g}GiB"


def enforce_gpu_limit(device, limit: int) -> float | None:
    """Cap this process's CUDA allocations at `limit` (the caching allocator then fails past it instead of
    using more); returns the fraction set, None off CUDA."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    fraction = min(1.0, limit / total)
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    return fraction


def release_gpu_limit(device) -> None:
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(1.0, device.index if device.index is not None
                                                   else torch.cuda.current_device())
