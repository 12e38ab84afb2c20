"""`orin-omni quantize` in bounded memory (issue 18): the model streams from the checkpoint one layer at a time and
gives what the in-memory path gave, bit for bit; activations live on the device, in host memory or on disk as the
memory plan says; a killed run resumes at the layer it was in; limits too small fail before anything is loaded;
the synthetic BF16 checkpoint at the real widths is what quantize reads."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from fixture_checkpoints import TINY_QUANTIZE

from orin.checkpoint.manifest import read_manifest
from orin.cli import cli
from orin.errors import BudgetError
from quantize.pipeline import QuantConfig, run_quantize
from quantize.report import load_report

pytestmark = pytest.mark.usefixtures("single_torch_thread")

SHARDS = {"thinker": "model-00001-of-00002.safetensors", "talker_vision": "model-00002-of-00002.safetensors"}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _ratios(layer_types: dict) -> dict:
    return {name: round(t["gptq_error"] / t["rtn_error"], 4) for name, t in layer_types.items()
            if t["gptq_error"] is not None and t["rtn_error"]}


# ---------------------------------------------------------------------- the same numbers as in memory


def test_streamed_quantize_equals_the_in_memory_path(quantized_dir, tiny_model_dir):
    """The session's checkpoint (streamed: a meta skeleton filled one module at a time, the thinker's replies
    generated over streamed layers) against the oracle that loads the whole model and runs transformers' own
    forward and generate(): every tensor of both shards, every layer error and every end-to-end measure agree."""
    from quantize_oracle import quantize_in_memory

    from orin.checkpoint.files import read_header

    oracle = quantize_in_memory(tiny_model_dir, QuantConfig(model=tiny_model_dir, out="", **TINY_QUANTIZE))
    report = load_report(quantized_dir)
    for segment, shard in SHARDS.items():
        from safetensors import safe_open

        want = oracle[segment]["tensors"]
        assert set(read_header(Path(quantized_dir) / shard)) == set(want), segment
        worst, differing = 0.0, []
        with safe_open(str(Path(quantized_dir) / shard), framework="pt") as f:
            for key, expected in want.items():
                got = f.get_tensor(key)
                if not torch.equal(got, expected):
                    differing.append(key)
                    if got.is_floating_point():
                        worst = max(worst, float((got.float() - expected.float()).abs().max()))
        streamed = report["segments"][segment]
        assert not differing, (f"{segment}: {len(differing)} of {len(want)} tensors differ (e.g. {differing[:3]}, "
                               f"max abs difference {worst}); GPTQ/RTN error ratios streamed "
                               f"{_ratios(streamed['layer_types'])} against in memory "
                               f"{_ratios(oracle[segment]['layer_types'])}")
        assert streamed["layer_types"] == oracle[segment]["layer_types"]
        assert streamed["metrics"] == oracle[segment]["metrics"] and streamed["metrics"]
        assert streamed["starved_experts"] == oracle[segment]["starved_experts"]


# ---------------------------------------------------------------------- resuming, activations on disk


def test_a_killed_run_resumes_at_its_layer_with_activations_on_disk(tiny_model_dir, quantized_dir, tmp_path,
                                                                    monkeypatch, capsys):
    """Killed while publishing the talker's layer 1 (its checkpoint fully written under its temporary name, the
    vision encoder's stack done before it, the thinker segment finished): the rerun reads the passes back, keeps
    the vision encoder and the talker's layer 0, throws the unpublished layer away and redoes it. Calibration
    activations on disk give the bytes they give on the device."""
    from quantize import adapters as A
    from quantize import partial

    out = tmp_path / "q"
    cfg = QuantConfig(model=tiny_model_dir, out=str(out), activations="disk", **TINY_QUANTIZE)
    publish = partial.publish_dir

    def killed(tmp, target):
        if target.parent.name == "talker" and target.name == "layer-00001":
            raise KeyboardInterrupt
        publish(tmp, target)

    monkeypatch.setattr(partial, "publish_dir", killed)
    with pytest.raises(KeyboardInterrupt):
        run_quantize(cfg)
    stacks = out / ".partial" / "talker_vision"
    assert read_manifest(out).finished == ("thinker",)
    assert (stacks / "talker" / ".layer-00001.tmp" / "state.json").is_file()  # whole, but never published
    assert (stacks / "talker" / "layer-00000" / "calib" / "hidden-00000.pt").is_file()
    assert (stacks / "vision_encoder" / "layer-00002" / "gptq.safetensors").is_file()
    assert (out / ".partial" / "passes" / "info.json").is_file()
    capsys.readouterr()

    monkeypatch.setattr(partial, "publish_dir", publish)
    layers_run = []
    stages = A.layer_stages
    monkeypatch.setattr(A, "layer_stages", lambda stack, i, t: layers_run.append((stack.component, i)) or
                        stages(stack, i, t))
    m = run_quantize(cfg)
    err = capsys.readouterr().err
    assert m.complete and layers_run == [("talker", 1)]
    assert "resuming: the BF16 passes' results are read back" in err
    assert "GPTQ talker_vision/talker: resuming at layer 1 of 2" in err
    assert not (out / ".partial").exists()
    for shard in SHARDS.values():
        assert _sha(out / shard) == _sha(Path(quantized_dir) / shard), shard
    assert load_report(out)["segments"]["talker_vision"]["layer_types"] == \
        load_report(quantized_dir)["segments"]["talker_vision"]["layer_types"]


def test_a_partial_state_of_other_settings_is_discarded(tmp_path):
    from quantize.activations import Placement
    from quantize.partial import PartialState

    placement = Placement("disk", torch.device("cpu"))
    first = PartialState(tmp_path, "key-a", placement)
    (first.root / "thinker" / "thinker_text" / "layer-00000").mkdir(parents=True)
    (first.root / "thinker" / "thinker_text" / ".layer-00001.tmp").mkdir()
    notes = []
    again = PartialState(tmp_path, "key-a", placement, notes.append)
    assert (again.root / "thinker" / "thinker_text" / "layer-00000").is_dir() and not notes
    assert not (again.root / "thinker" / "thinker_text" / ".layer-00001.tmp").exists()  # a killed run's
    other = PartialState(tmp_path, "key-b", placement, notes.append)
    assert not (other.root / "thinker").exists() and "discarding the partial state" in notes[0]
    assert json.loads((other.root / "run.json").read_text()) == {"key": "key-b"}


# ---------------------------------------------------------------------- memory limits


def test_limits_too_small_fail_before_anything_is_loaded(tiny_model_dir, tmp_path):
    out = tmp_path / "q"
    result = CliRunner().invoke(cli, ["quantize", tiny_model_dir, "--out", str(out), "--device", "cpu",
                                      "--samples", "4", "--max-host-memory", "256MiB"])
    assert result.exit_code == 1, result.output
    message = result.stderr.strip().splitlines()[-1]
    assert "--max-host-memory 256.00 MiB is too small" in message and "raise --max-host-memory to" in message
    assert not (out / "manifest.json").exists()
    result = CliRunner().invoke(cli, ["quantize", tiny_model_dir, "--out", str(out), "--max-gpu-memory", "0GiB"])
    assert result.exit_code == 2 and "--max-gpu-memory" in result.output


class _Sample:
    def __init__(self, name: str, tokens: int, patches: int = 0, heldout: bool = False):
        self.name, self.tokens, self.heldout = name, tokens, heldout
        self.inputs = {"pixel_values": torch.empty((patches, 1), device="meta")} if patches else {}


def test_memory_plan_at_the_real_dimensions(real_config):
    """The plan for the real model (its shapes, a calibration set like the built-in one) fits the defaults (a
    16 GiB GPU, 24 GiB of host memory), keeps more thinker layers loaded with more GPU memory, moves
    activations off the GPU for long conversations (to disk when host memory is short too), and refuses limits
    below what the run needs at least, naming the option."""
    from orin.checkpoint.targets import QuantSpec, find_targets
    from quantize import adapters as A
    from quantize.hf_config import load_config
    from quantize.memory import DEFAULT_MAX_GPU_MEMORY, DEFAULT_MAX_HOST_MEMORY, make_plan, measure
    from quantize.speech_capture import SpeechSettings
    from quantize.weights import build_skeleton

    config = load_config(real_config)
    model = build_skeleton(config)
    targets = find_targets(model, QuantSpec())
    comps = {"thinker_text", "audio_encoder", "vision_encoder", "talker", "code_predictor", "code2wav"}
    stacks = {t.component for t in targets}
    samples = [_Sample(f"c{i}", 60 + 37 * (i % 9), 256 * (i % 4 == 1), heldout=i >= 120) for i in range(128)]
    sizes = measure(model, config, samples, stacks, comps, targets, SpeechSettings())
    assert 1.15 * 2**30 < sizes.layer["thinker_text"] < 1.2 * 2**30  # 128 experts of 3 x 2048 x 768, BF16

    def plan(gpu, host=DEFAULT_MAX_HOST_MEMORY, samples_sizes=sizes):
        return make_plan(samples_sizes, "cuda", gpu, host, 3 << 30, stacks, True, True)

    default = plan(DEFAULT_MAX_GPU_MEMORY)
    assert default.activations == "device" and default.speech_wave >= 8
    assert max(default.gpu.values()) <= DEFAULT_MAX_GPU_MEMORY and max(default.host.values()) <= 24 << 30
    roomy = plan(24 << 30)
    assert roomy.keep_layers > default.keep_layers
    with pytest.raises(BudgetError, match=r"--max-gpu-memory 6\.00 GiB is too small.*raise --max-gpu-memory to"):
        plan(6 << 30)
    with pytest.raises(BudgetError, match=r"--max-host-memory 4\.00 GiB is too small"):
        plan(DEFAULT_MAX_GPU_MEMORY, 4 << 30)
    # 128 conversations of 30 s video: 6,000 thinker tokens and 23,520 patches each
    video = measure(model, config, [_Sample(f"v{i}", 6000, 23520, heldout=i >= 120) for i in range(128)], stacks,
                    comps, targets, SpeechSettings())
    assert plan(DEFAULT_MAX_GPU_MEMORY, samples_sizes=video).activations == "disk"
    assert plan(DEFAULT_MAX_GPU_MEMORY, 64 << 30, video).activations == "host"
    assert set(A.SPEECH_PASS) & stacks == {"talker"}


# ---------------------------------------------------------------------- the layer gate


def test_layer_gate_reads_each_layer_once_per_step_for_all_conversations():
    """Generation-like jobs of different lengths over gated layers, each keeping its own state on a shared object
    between steps (as the thinker keeps its rope_deltas): each computes what it computes alone, a layer is
    loaded once per step (a kept one once in all), and a failing job fails alone."""
    from quantize.gate import LayerGate

    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

    class Shared:
        offset = 0.0

    shared = Shared()

    def job(steps: int, offset: float):
        def run():
            shared.offset = offset  # set once, read at every step: another job runs in between
            x, out = torch.ones(1, 8), []
            for _ in range(steps):
                for layer in layers:
                    x = torch.tanh(layer(x))
                x = x + shared.offset
                out.append(x.clone())
            return torch.cat(out)
        return run

    shapes = ((3, 1.0), (5, 2.0), (1, 3.0))
    with torch.no_grad():
        alone = [job(n, o)() for n, o in shapes]
    loads = []
    gate = LayerGate(layers, loads.append, lambda _i: None, keep=1, swapped=[(shared, "offset")])
    results = gate.run([job(n, o) for n, o in shapes] + [lambda: 1 / 0])
    for (result, error), expected in zip(results, alone, strict=False):
        assert error is None and torch.equal(result, expected)
    assert isinstance(results[3][1], ZeroDivisionError)
    assert gate.sweeps == 5 and loads.count(0) == 1 and loads.count(1) == loads.count(3) == 5


# ---------------------------------------------------------------------- progress


def test_a_resumed_stack_estimates_the_time_left_from_this_run_only():
    from quantize.progress import Progress

    stream, now = io.StringIO(), [0.0]
    with Progress(enabled=False, stream=stream, every=10, clock=lambda: now[0]).bar(8, "GPTQ x", initial=4) as bar:
        now[0] += 60.0
        bar.update(1)  # the first layer of this run took a minute (warm-up)
        for _ in range(2):
            now[0] += 30.0
            bar.update(1)
    assert stream.getvalue().splitlines()[:3] == ["GPTQ x:  62% (5/8), 1:00 elapsed",
                                                  "GPTQ x:  75% (6/8), 1:30 elapsed",
                                                  "GPTQ x:  87% (7/8), 2:00 elapsed, about 0:30 left"]


# ---------------------------------------------------------------------- the synthetic BF16 checkpoint


def test_synthetic_bf16_checkpoint_has_the_hub_layout_at_the_real_widths(real_config):
    """What `orin-omni synthetic-bf16` plans for the real config with 2 thinker layers is, name by name, what
    transformers' model for that config loads: hub names, one BF16 weight per expert and projection."""
    from devtools.synthetic_bf16 import bf16_config, plan_tensors
    from orin.checkpoint.hub_names import expert_part, to_runtime
    from quantize.hf_config import fix_config, new_config
    from quantize.weights import build_skeleton

    data = bf16_config(real_config, 2)
    assert data["thinker_config"]["text_config"]["num_hidden_layers"] == 2
    assert data["talker_config"]["accept_hidden_layer"] == 2  # the talker reads the last one there is
    entries = plan_tensors(data)
    model = build_skeleton(fix_config(new_config(data)))
    fused: dict[str, list] = {}
    for e in entries:
        runtime = to_runtime(e.name)
        part = expert_part(runtime)
        fused.setdefault(part.fused if part else runtime, []).append(e.shape)
    params = dict(model.named_parameters())
    assert set(fused) == set(params)
    for name, shapes in fused.items():
        numel = sum(torch.Size(s).numel() for s in shapes)
        assert numel == params[name].numel(), name
    layer = sum(e.nbytes for e in entries if ".model.layers.1." in e.name and e.name.startswith("thinker."))
    assert 1.15 * 2**30 < layer < 1.2 * 2**30


def test_synthetic_bf16_checkpoint_is_quantized(tmp_path):
    """The tiny config written with one thinker layer in shards of 1 MiB quantizes end to end."""
    from devtools.synthetic_bf16 import SyntheticBF16Config, write_synthetic_bf16

    src = write_synthetic_bf16(SyntheticBF16Config(config="tiny", out=str(tmp_path / "bf16"), thinker_layers=1,
                                                   device="cpu", shard_bytes=1 << 20))
    assert len(list(src.glob("model-*-of-*.safetensors"))) > 1
    m = run_quantize(QuantConfig(model=str(src), out=str(tmp_path / "q"), segments=("thinker",), samples=4,
                                 reply_tokens=2, speech_frames=2, device="cpu", progress=False))
    assert m.finished == ("thinker",)
    assert load_report(tmp_path / "q")["segments"]["thinker"]["layer_types"]["thinker.attn.q_proj"]["modules"] == 1


def test_the_bf16_passes_run_without_cudnn_attention(tiny_model_dir, tmp_path, monkeypatch):
    """quantize's passes through transformers' generate() grow their cache a row every token: a new attention
    shape each time, which cuDNN's SDPA would plan anew (orin.attention_kernels); the run holds it off and
    gives torch's choice back."""
    from quantize import pipeline

    seen = []
    monkeypatch.setattr(pipeline, "_run", lambda *a: seen.append(torch.backends.cuda.cudnn_sdp_enabled()) or
                        (None, None))
    assert torch.backends.cuda.cudnn_sdp_enabled()
    run_quantize(QuantConfig(model=tiny_model_dir, out=str(tmp_path / "out"), **TINY_QUANTIZE))
    assert seen == [False] and torch.backends.cuda.cudnn_sdp_enabled()
