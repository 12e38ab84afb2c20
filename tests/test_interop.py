"""One checkpoint for the Orin and for the server: the directory `orin-omni quantize` writes is an ordinary GPTQ
model that transformers loads and whose quantized modules are exactly the ones vLLM's GPTQ rules select.

transformers runs here (CPU: optimum's GPTQ path with GPTQModel's torch kernel). vLLM cannot run here (no GPU,
not installed), so the rules vLLM 0.33.0 and vLLM-Omni 0.30.0 apply to a GPTQ checkpoint of Qwen3-Omni are
re-stated below in our own code, each citing the file and lines of the release it comes from (paths inside the
vllm-project/vllm and vllm-project/vllm-omni release wheels), and applied to the module prefixes those releases
build for the tiny model's config.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from module_oracle import hf_twin

# --------------------------------------------------------------------------------------------- transformers

PROMPT = ({"role": "user", "content": "Name three colours of the rainbow, then count to five."},)
# GPTQModel's torch kernel dequantizes w = scale * (q - z) in the checkpoint's float16 (its scales' dtype), so
# every weight is rounded to fp16 (relative 2^-11 = 4.9e-4) before the fp32 matmul; orin's CPU engine runs
# torch's int4pack kernel with fp32 (scale, scale * (8 - z)) pairs, exact in fp32. Measured on the tiny thinker:
# 1.1e-3 relative over every position, 1.5e-3 on the last. A format error is far above the bound: one zero-point
# step is 1/15 of a group's range, and the unquantized tiny model is ~0.5 away from the quantized one.
LOGITS_REL_TOL = 5e-3


def _transformers_load(model_dir: str, ids_file: str, out_file: str) -> None:
    """Load `model_dir` as a user would with transformers 5.23 + optimum + GPTQModel (CPU, GPTQModel's torch
    kernel, fp32) and save what the tests check. Runs in a child process: defuser patches transformers' classes
    for the whole process, which would turn the experts of every later orin engine into per-expert ModuleLists."""
    import logging

    import defuser
    import torch
    from transformers import GPTQConfig, Qwen3OmniMoeForConditionalGeneration
    from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf_qwen3_omni

    logging.getLogger("optimum").setLevel(logging.WARNING)  # otherwise one INFO line per BF16 Linear
    # transformers 5.23 fuses each MoE layer's experts into one [E, 2I, H] tensor; a GPTQ checkpoint holds one
    # Linear per expert. defuser rebuilds the MoE blocks with per-expert nn.Linear before optimum swaps them.
    defuser.replace_fused_blocks("qwen3_omni_moe")
    # defuser 0.0.28's _init_weights fallback for those blocks calls normal_() on every expert's `.weight`, which
    # a GPTQ QuantLinear does not have (AttributeError). Skip the init of such a block only: all its tensors come
    # from the checkpoint, as the empty missing_keys the test asserts confirm.
    init_weights = hf_qwen3_omni.Qwen3OmniMoePreTrainedModel._init_weights

    def init_unless_gptq_experts(self, module):
        try:
            init_weights(self, module)
        except AttributeError:
            experts = getattr(module, "experts", None)
            if experts is None or not any(hasattr(m, "qweight") for m in experts.modules()):
                raise

    hf_qwen3_omni.Qwen3OmniMoePreTrainedModel._init_weights = init_unless_gptq_experts
    # The checkpoint's quantization_config is used as it is; only `backend`, a loading attribute, comes from here.
    model, info = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32, device_map="cpu", output_loading_info=True,
        quantization_config=GPTQConfig(bits=4, backend="torch"))
    gptq, dense = {}, {}
    for name, module in model.named_modules():
        if hasattr(module, "qweight"):
            gptq[name] = {"cls": type(module).__name__, "bits": module.bits, "group_size": module.group_size}
        elif isinstance(getattr(module, "weight", None), torch.nn.Parameter) and module.weight.dim() == 2:
            dense[name] = type(module).__name__
    prompt = torch.load(ids_file)
    with torch.inference_mode():
        logits = model.thinker(input_ids=prompt["ids"], attention_mask=prompt["mask"]).logits.float()
    torch.save({"info": {k: sorted(str(x) for x in (v or ())) for k, v in info.items()}, "gptq": gptq,
                "dense": dense, "logits": logits}, out_file)


@pytest.fixture(scope="module")
def engine_logits(engine):
    """The thinker's logits for PROMPT from orin-omni's engine (CPU, fp32): the production prefill (chat template,
    the thinker's prefill on orin.runtime.decode: the last position) and the engine's loaded model over every position."""
    import torch

    from orin.contract import GenerationRequest

    req = GenerationRequest(messages=PROMPT, max_new_tokens=1, speech=False)
    prompt = engine.prepare(req)
    engine.loader.ensure("thinker_text")
    ids, mask = prompt.input_ids, prompt.inputs["attention_mask"]
    with torch.inference_mode():
        merged = engine.thinker.merge(prompt.inputs, prompt, None, None)
        _, _, last = engine.thinker.prefill(merged, prompt.length + 1, graph=False)
        every = hf_twin(engine.model, engine.cfg.model_dir).thinker(input_ids=ids, attention_mask=mask).logits
    return {"ids": ids, "mask": mask, "last": last.float().reshape(-1), "every": every.float()}


@pytest.fixture(scope="module")
def hf_loaded(quantized_dir, engine_logits, tmp_path_factory):
    import torch

    work = tmp_path_factory.mktemp("interop")
    model_dir = work / "checkpoint"
    shutil.copytree(quantized_dir, model_dir)
    torch.save({"ids": engine_logits["ids"], "mask": engine_logits["mask"]}, work / "prompt.pt")
    out = work / "hf.pt"
    proc = subprocess.run([sys.executable, __file__, str(model_dir), str(work / "prompt.pt"), str(out)],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"transformers could not load the checkpoint:\n{proc.stderr[-6000:]}")
    return torch.load(out)


def _gptq_modules_on_disk(model_dir: str) -> set[str]:
    index = json.loads((Path(model_dir) / "model.safetensors.index.json").read_text())
    return {key.removesuffix(".qweight") for key in index["weight_map"] if key.endswith(".qweight")}


def test_transformers_loads_every_tensor(hf_loaded):
    info = hf_loaded["info"]
    assert info["missing_keys"] == [] and info["unexpected_keys"] == []
    assert info["mismatched_keys"] == [] and info["error_msgs"] == []


def test_transformers_quantizes_exactly_the_gptq_modules(hf_loaded, quantized_dir):
    from orin.checkpoint.hub_names import to_runtime

    expected = {to_runtime(name) for name in _gptq_modules_on_disk(quantized_dir)}
    assert any(".visual." in n for n in expected) and any(n.startswith("talker.") for n in expected)
    assert set(hf_loaded["gptq"]) == expected
    for name, module in hf_loaded["gptq"].items():
        # GPTQModel's torch kernel. Its `sym` attribute is not checked: optimum 2.3.0 passes (bits, group_size,
        # desc_act, sym) positionally to a class that takes (bits, group_size, sym, desc_act), which swaps the two
        # flags; harmless here (v1 zero points are stored, g_idx is the plain order: the logits test holds).
        assert module["cls"] == "TorchLinear", name
        assert (module["bits"], module["group_size"]) == (4, 128), name
    dense = hf_loaded["dense"]
    bf16_parts = {  # stay BF16 in the checkpoint, so must stay dense modules in transformers
        "vision fc2": r"thinker\.model\.visual\.blocks\.\d+\.mlp\.linear_fc2",
        "audio tower": r"thinker\.model\.audio_tower\.layers\.\d+\.(self_attn\.\w+_proj|fc\d)",
        "routers": r".*\.mlp\.gate",
        "lm_head": r"thinker\.lm_head",
        "code predictor": r"talker\.code_predictor\.model\.layers\.\d+\..*_proj",
        "code2wav": r"code2wav\.pre_transformer\.layers\.\d+\..*_proj",
    }
    for part, pattern in bf16_parts.items():
        found = [n for n in dense if re.fullmatch(pattern, n)]
        assert found, f"no {part} module in the loaded model"
        assert not any(re.fullmatch(pattern, n) for n in hf_loaded["gptq"]), part


def test_transformers_thinker_logits_match_the_engine(hf_loaded, engine_logits):
    hf = hf_loaded["logits"]
    every = engine_logits["every"]
    assert hf.shape == every.shape
    assert float((hf - every).norm() / every.norm()) < LOGITS_REL_TOL
    last = engine_logits["last"]  # the engine's own prefill
    assert float((hf[0, -1] - last).norm() / last.norm()) < LOGITS_REL_TOL
    assert int(hf[0, -1].argmax()) == int(last.argmax())


# ------------------------------------------------------------------------------------------------ vLLM's rules
# Re-stated, not copied: vllm-project/vllm v0.33.0 ("vllm 0.33") and vllm-project/vllm-omni v0.30.0 ("omni 0.30").

# vllm 0.33 vllm/model_executor/models/qwen3_omni_moe_thinker.py:1623-1634, the thinker's hf_to_vllm_mapper
# (`vllm serve DIR` builds Qwen3OmniMoeThinkerForConditionalGeneration, models/registry.py:603-606). None drops
# the tensor. WeightsMapper tries every prefix rule in order on the running name (models/utils.py:131-136).
THINKER_PREFIXES = (
    ("thinker.lm_head.", "language_model.lm_head."),
    ("thinker.model.", "language_model.model."),
    ("thinker.", ""),
    ("talker.", None),
    ("code2wav.", None),
    ("model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
)
# omni 0.30 vllm_omni/model_executor/models/qwen3_omni/qwen3_omni.py:124-130: the unified model's mapper, the one
# applied to the quantization config (quantization.py:10-29: the nested thinker/talker mappers are then skipped).
# No trailing dots: `thinker.model` also renames `thinker.model.x`.
OMNI_OUTER_PREFIXES = (
    ("thinker.lm_head", "thinker.language_model.lm_head"),
    ("thinker.model", "thinker.language_model.model"),
    ("talker.model", "talker.language_model.model"),
)
# How omni 0.30 names the weights it loads: the thinker's and the talker's own mappers (qwen3_omni_moe_thinker.py:
# 1036-1042, qwen3_omni_moe_talker.py:62-80), under the stage's module ("thinker." / "talker.", qwen3_omni.py:
# 1412-1446).
OMNI_THINKER_WEIGHTS = (("thinker.lm_head.", "language_model.lm_head."), ("thinker.model.", "language_model.model."),
                        ("thinker.", ""))
OMNI_TALKER_WEIGHTS = (("talker.model.", "language_model.model."), ("talker.codec_head.", "codec_head."),
                       ("talker.code_predictor.", "code_predictor."), ("talker.text_projection.", "text_projection."),
                       ("talker.hidden_projection.", "hidden_projection."), ("talker.", ""))
# qwen3_omni_moe_thinker.py:1636-1647 (omni 0.30's outer model reuses it, qwen3_omni.py:131): a fused vLLM Linear
# (its prefix's last component) -> the checkpoint Linears stacked into it.
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"), "qkv": ("qkv",)}
# The sub-models' stacking renames of checkpoint tensor names (substring -> substring, first occurrence): vllm 0.33
# qwen3_omni_moe_thinker.py:348-355 (audio encoder), 754-760 (vision), qwen3_moe.py:436-448 (language models).
STACKED = {
    "audio_tower.": tuple((f".self_attn.{p}_proj.", ".self_attn.qkv_proj.") for p in "qkv"),
    "visual.": tuple((f".attn.{p}.", ".attn.qkv.") for p in "qkv"),
    "language_model.model.": (*((f".{p}_proj", ".qkv_proj") for p in "qkv"),
                              (".mlp.gate_proj", ".mlp.gate_up_proj"), (".mlp.up_proj", ".mlp.gate_up_proj"),
                              (".shared_expert.gate_proj", ".shared_expert.gate_up_proj"),
                              (".shared_expert.up_proj", ".shared_expert.gate_up_proj")),
}
# routed_experts.py:1274-1289 (vllm 0.33, per-expert mapping) and 1004-1060 (load_weights): `experts.{e}.{proj}.`
# of a checkpoint name becomes the MoE layer's `w13_` (gate, up) or `w2_` (down) parameter, expert e's slice.
EXPERT = re.compile(r"^(?P<layer>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate|up|down)_proj\.(?P<leaf>\w+)$")
# Parameters of a GPTQ Linear (auto_gptq.py:427-429; no g_idx: base_config.py:255-259 drops `.g_idx` tensors
# while loading) and of a GPTQ MoE layer (auto_gptq.py:522-579; moe_wna16.py:308-372 has the same names).
GPTQ_LINEAR = {"qweight", "qzeros", "scales"}
GPTQ_MOE = {f"w{w}_{leaf}" for w in (13, 2) for leaf in GPTQ_LINEAR}


def rename(name: str, rules, keep_drops: bool = True) -> str | None:
    """WeightsMapper's prefix renames (models/utils.py:131-136). keep_drops=False is get_rename_mapper
    (utils.py:180-200), what the quantization config's module list goes through: rules to None are left out."""
    for old, new in rules:
        if name.startswith(old):
            if new is None:
                if keep_drops:
                    return None
                continue
            name = new + name[len(old):]
    return name


def dynamic_verdict(prefix: str, dynamic: dict):
    """gptq_utils.py:85-103 get_dynamic_override: the first rule whose regex re.match-es the prefix decides;
    a `-:` rule means "not quantized" (False), a `+:` or unsigned one gives its overrides; None when none does."""
    for pattern, overrides in dynamic.items():
        if pattern.startswith("-:"):
            if re.match(pattern[2:], prefix):
                return False
        elif re.match(pattern.removeprefix("+:"), prefix):
            return overrides
    return None


def is_listed(prefix: str, listed: list[str]) -> bool:
    """gptq_utils.py:120-169 is_layer_gptq_quantized: an entry counts when it is a substring of the prefix; a fused
    prefix asks once per shard (its last component replaced by each shard's) and all shards must agree; an empty
    list means "no metadata" and counts as quantized."""
    if not listed:
        return True
    proj = prefix.rsplit(".", 1)[-1]
    if proj not in PACKED:
        return any(entry in prefix for entry in listed)
    votes = {any(entry in prefix.replace(proj, shard) for entry in listed) for shard in PACKED[proj]}
    if len(votes) > 1:
        raise ValueError(f"{prefix}: some but not all of its shards are listed; vLLM refuses such a checkpoint")
    return votes.pop()


def listed_modules(qconfig: dict, header: dict[str, str], mapper_rules) -> list[str]:
    """auto_gptq.py:273-299 maybe_update_config: modules_in_block_to_quantize flattened one level or, absent or
    empty, the module of every tensor whose dtype is not F16/BF16/F32; then apply_vllm_mapper (auto_gptq.py:
    267-271) renames them with the model's rename mapper."""
    listed = [m for group in qconfig.get("modules_in_block_to_quantize") or [] for m in group]
    if not listed:
        listed = sorted({k.rsplit(".", 1)[0] for k, dtype in header.items() if dtype not in ("F16", "BF16", "F32")})
    return [rename(m, mapper_rules, keep_drops=False) for m in listed]


def config_refusals(qconfig: dict) -> list[str]:
    """What AutoGPTQConfig refuses before looking at any module: auto_gptq.py:99-102 + 152-156 (only symmetric
    4/8 bit: its Marlin kernels take no zero points) and gptq_utils.py:23-50 (no desc_act with groups)."""
    out = []
    if (qconfig.get("bits"), qconfig.get("sym")) not in ((4, True), (8, True)):
        out.append(f"bits={qconfig.get('bits')} sym={qconfig.get('sym')}: vLLM 0.33 takes symmetric 4/8 bit only")
    if qconfig.get("desc_act") and qconfig.get("group_size") != -1:
        out.append("desc_act with a group size: vLLM 0.33 refuses activation ordering")
    return out


@dataclass(frozen=True)
class VllmLayer:
    prefix: str  # what vLLM asks the quantization config about, also the module its parameters live in
    quant_aware: bool = True  # built with the quantization config (False: quant_config=None or a plain nn.Linear)
    moe: bool = False  # routed experts: a fused MoE layer

    def sources(self, num_experts: int = 0) -> tuple[str, ...]:
        """The checkpoint Linears (vLLM-renamed) this layer is built from."""
        if self.moe:
            return tuple(f"{self.prefix}.{e}.{p}_proj" for e in range(num_experts) for p in ("gate", "up", "down"))
        proj = self.prefix.rsplit(".", 1)[-1]
        return tuple(self.prefix.replace(proj, shard) for shard in PACKED.get(proj, (proj,)))


def _num_experts(text: dict) -> int:
    return text.get("num_experts", text.get("num_local_experts", 0))


def _decoder_layers(text: dict, model: str) -> list[VllmLayer]:
    """qwen3_moe.py (vllm 0.33): attention 285-300 (qkv_proj, o_proj), the MoE-or-dense choice 385-405, the sparse
    block 133-215 (router `gate`: a GateLinear with the config; shared expert MLP with it, shared_expert_gate
    without), the dense MLP 88-115."""
    out = []
    for i in range(text["num_hidden_layers"]):
        p = f"{model}.layers.{i}"
        out += [VllmLayer(f"{p}.self_attn.qkv_proj"), VllmLayer(f"{p}.self_attn.o_proj")]
        sparse = (i not in (text.get("mlp_only_layers") or []) and _num_experts(text) > 0
                  and (i + 1) % text.get("decoder_sparse_step", 1) == 0)
        if not sparse:
            out += [VllmLayer(f"{p}.mlp.gate_up_proj"), VllmLayer(f"{p}.mlp.down_proj")]
            continue
        out += [VllmLayer(f"{p}.mlp.gate"), VllmLayer(f"{p}.mlp.experts", moe=True)]
        if text.get("shared_expert_intermediate_size", 0) > 0:
            out += [VllmLayer(f"{p}.mlp.shared_expert.gate_up_proj"), VllmLayer(f"{p}.mlp.shared_expert.down_proj"),
                    VllmLayer(f"{p}.mlp.shared_expert_gate", False)]
    return out


def thinker_layers(config: dict, root: str = "", vision_quant_aware: bool = True) -> list[VllmLayer]:
    """The thinker's Linear and MoE layers (vllm 0.33 qwen3_omni_moe_thinker.py): the audio encoder is built
    without quant_config (196-435, 1677-1681), the vision tower with it (642-672 blocks, 696-740 mergers, 805-839;
    omni 0.30 gives it none: vision_quant_aware=False), the language model as qwen3_moe's (1141-1160, lm_head
    qwen3_moe.py:580-585, quantized only with `lm_head: true`, gptq_utils.py:178-182)."""
    th = config["thinker_config"]
    audio, vision = th["audio_config"], th["vision_config"]
    out = []
    for i in range(audio["encoder_layers"]):
        p = f"{root}audio_tower.layers.{i}"
        out += [VllmLayer(f"{p}.{n}", False) for n in ("self_attn.qkv_proj", "self_attn.out_proj", "fc1", "fc2")]
    out += [VllmLayer(f"{root}audio_tower.{n}", False) for n in ("conv_out", "proj1", "proj2")]
    for i in range(vision["depth"]):
        out += [VllmLayer(f"{root}visual.blocks.{i}.{n}", vision_quant_aware)
                for n in ("attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2")]
    mergers = ["merger", *(f"merger_list.{j}" for j in range(len(vision.get("deepstack_visual_indexes") or [])))]
    out += [VllmLayer(f"{root}visual.{m}.mlp.{k}", vision_quant_aware) for m in mergers for k in (0, 2)]
    out += _decoder_layers(th["text_config"], f"{root}language_model.model")
    out.append(VllmLayer(f"{root}language_model.lm_head", bool(config.get("quantization_config", {}).get("lm_head"))))
    return out


def talker_layers(config: dict) -> list[VllmLayer]:
    """omni 0.30's talker stage (qwen3_omni_moe_talker.py): its language model is qwen3_moe's under
    `talker.language_model` (123-127, 356-375; quant_config as given, 102-105); the projections and codec_head are
    plain nn.Linear (116-118, 332-352); the code predictor's Linears too (common/qwen3_code_predictor.py:157-350)."""
    tk = config["talker_config"]
    out = _decoder_layers(tk["text_config"], "talker.language_model.model")
    out += [VllmLayer(f"talker.{m}.{n}", False) for m in ("text_projection", "hidden_projection")
            for n in ("linear_fc1", "linear_fc2")]
    out.append(VllmLayer("talker.codec_head", False))
    for i in range(tk["code_predictor_config"]["num_hidden_layers"]):
        p = f"talker.code_predictor.model.layers.{i}"
        out += [VllmLayer(f"{p}.{n}", False) for n in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                                                      "mlp.down_proj")]
    return out


def vllm_quantizes(layer: VllmLayer, qconfig: dict, listed: list[str]) -> bool:
    """Whether vLLM builds `layer` with GPTQ parameters: a Linear when listed and not excluded by `dynamic`
    (gptq_utils.py:172-195 get_linear_quant_method); a MoE layer consults `dynamic` only (auto_gptq.py:69-92
    get_moe_quant_method, called from get_quant_method 235-257)."""
    if not layer.quant_aware:
        return False
    dynamic = qconfig.get("dynamic") or {}
    if layer.moe:
        return dynamic_verdict(layer.prefix, dynamic) is not False
    return is_listed(layer.prefix, listed) and dynamic_verdict(layer.prefix, dynamic) is not False


def stack(name: str) -> str:
    """A tensor name (vLLM prefixes already applied) through the stacking renames of the sub-model it loads into."""
    for root, rules in STACKED.items():
        if name.startswith(root):
            for old, new in rules:
                if old in name:
                    name = name.replace(old, new, 1)
    return name


def selection_mismatches(model_dir: str, omni: bool, qconfig: dict | None = None) -> list[str]:
    """Every vLLM layer whose quantization (as vLLM decides it) differs from what the checkpoint holds for it:
    GPTQ tensors for all its source Linears (quantized), for none (BF16) or for some (refused either way); and
    every GPTQ Linear on disk that no layer is built from (the talker and code2wav are dropped for plain vLLM)."""
    from orin.checkpoint.files import read_header

    d = Path(model_dir)
    config = json.loads((d / "config.json").read_text())
    qconfig = config["quantization_config"] if qconfig is None else qconfig
    header = {k: v["dtype"] for shard in sorted(d.glob("model-*.safetensors")) for k, v in read_header(shard).items()}
    if omni:
        layers = thinker_layers(config, "thinker.", vision_quant_aware=False) + talker_layers(config)
        listed = listed_modules(qconfig, header, OMNI_OUTER_PREFIXES)

        def weight_module(hub: str) -> str | None:
            stage, rules = ("talker", OMNI_TALKER_WEIGHTS) if hub.startswith("talker.") else (
                "thinker", OMNI_THINKER_WEIGHTS)
            return None if hub.startswith("code2wav.") else f"{stage}.{rename(hub, rules)}"
    else:
        layers = thinker_layers(config)
        listed = listed_modules(qconfig, header, THINKER_PREFIXES)

        def weight_module(hub: str) -> str | None:
            return rename(hub, THINKER_PREFIXES)

    # the checkpoint's GPTQ Linears under the names vLLM loads them by (stacking not applied: layer sources are
    # the unstacked Linears)
    gptq_on_disk = {weight_module(k.removesuffix(".qweight")) for k in header if k.endswith(".qweight")} - {None}
    sources = {layer.prefix: layer.sources(_experts_of(config, layer)) for layer in layers}
    covered = {src for srcs in sources.values() for src in srcs}
    out = [f"{m}: GPTQ on disk, no vLLM layer is built from it" for m in sorted(gptq_on_disk - covered)]
    for layer in layers:
        held = [src in gptq_on_disk for src in sources[layer.prefix]]
        try:
            wanted = vllm_quantizes(layer, qconfig, listed)
        except ValueError as exc:
            out.append(str(exc))
            continue
        if len(set(held)) > 1:
            out.append(f"{layer.prefix}: GPTQ tensors for some of its source Linears only")
        elif wanted != held[0]:
            out.append(f"{layer.prefix}: vLLM builds it {'GPTQ' if wanted else 'unquantized'}, the checkpoint "
                       f"holds {'GPTQ' if held[0] else 'BF16'} tensors")
    return out


def _experts_of(config: dict, layer: VllmLayer) -> int:
    part = "talker_config" if layer.prefix.startswith("talker.") else "thinker_config"
    return _num_experts(config[part]["text_config"])


def _qconfig(model_dir: str) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())["quantization_config"]


def test_vllm_accepts_the_quantization_config(quantized_dir):
    qconfig = _qconfig(quantized_dir)
    assert config_refusals(qconfig) == []
    assert qconfig["quant_method"] == "gptq" and qconfig["checkpoint_format"] == "gptq"
    # the file vLLM's AutoGPTQConfig also names as its config (auto_gptq.py:186-187)
    assert json.loads((Path(quantized_dir) / "quantize_config.json").read_text()) == qconfig


def test_vllm_selects_exactly_the_gptq_modules(quantized_dir):
    """`vllm serve DIR` (vLLM 0.33, the thinker): every Linear and MoE layer it builds is GPTQ exactly when the
    checkpoint holds GPTQ tensors for it."""
    assert selection_mismatches(quantized_dir, omni=False) == []


def test_vllm_omni_selection_differs_only_on_the_vision_tower(quantized_dir):
    """vLLM-Omni 0.30 (thinker and talker stages): its thinker builds the vision and audio towers without the
    quantization config (omni 0.30 qwen3_omni_moe_thinker.py:1092-1139), so the INT4 vision blocks orin-omni writes
    are the only disagreement; the thinker's language model and the talker match."""
    config = json.loads((Path(quantized_dir) / "config.json").read_text())
    depth = config["thinker_config"]["vision_config"]["depth"]
    expected = {f"thinker.visual.blocks.{i}.{n}" for i in range(depth) for n in ("attn.qkv", "attn.proj",
                                                                                 "mlp.linear_fc1")}
    found = selection_mismatches(quantized_dir, omni=True)
    assert {m.split(":", 1)[0] for m in found} == expected
    assert all("builds it unquantized, the checkpoint holds GPTQ" in m for m in found)


def test_a_bf16_vision_checkpoint_matches_vllm_omni_completely(tiny_model_dir, tmp_path):
    """`orin-omni quantize --no-quantize-vision` writes what vLLM-Omni 0.30 builds: its vision tower BF16, declared
    so; every layer of both vLLM-Omni stages and of upstream vLLM then agrees with the checkpoint."""
    from quantize.pipeline import QuantConfig, run_quantize

    out = tmp_path / "bf16-vision"
    run_quantize(QuantConfig(model=tiny_model_dir, out=str(out), samples=4, reply_tokens=2,
                             speech_frames=2, min_speech_frames=2, speech_samples=2, device="cpu",
                             progress=False, quantize_vision=False))
    qconfig = _qconfig(str(out))
    assert r"-:.*visual\..*" in qconfig["dynamic"]
    assert not any("visual" in m for m in qconfig["modules_in_block_to_quantize"][0])
    assert selection_mismatches(str(out), omni=True) == []
    assert selection_mismatches(str(out), omni=False) == []


@pytest.mark.parametrize("break_it", ["hub names dropped", "asymmetric"])
def test_vllm_checks_fail_on_a_broken_config(quantized_dir, break_it):
    """The checks above can fail: a list without the hub names selects no thinker attention or vision Linear
    under vLLM's substring rule; an asymmetric config is refused outright."""
    from orin.checkpoint.hub_names import to_runtime

    qconfig = _qconfig(quantized_dir)
    if break_it == "hub names dropped":
        qconfig["modules_in_block_to_quantize"] = [[m for m in group if to_runtime(m) == m]
                                                   for group in qconfig["modules_in_block_to_quantize"]]
        found = selection_mismatches(quantized_dir, omni=False, qconfig=qconfig)
        assert any(".self_attn.qkv_proj:" in m for m in found) and any("visual.blocks." in m for m in found)
    else:
        assert config_refusals({**qconfig, "sym": False})


def _tensors(model_dir: str) -> dict:
    from safetensors import safe_open

    out = {}
    for shard in sorted(Path(model_dir).glob("model*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_gptq_tensors_have_the_shapes_vllm_builds(quantized_dir, tiny_model_dir):
    """Against the source model's BF16 weight [N, K] of each quantized Linear: qweight [K/8, N], qzeros [K/g, N/8],
    scales [K/g, N] with K % g == 0 (vLLM sizes them from the model config, auto_gptq.py:353-372), g_idx the plain
    group order (desc_act false) and every zero point 8: symmetric, which GPTQ v1 stores as 7 per nibble, since
    vLLM's kernels take no zero points (uint4b8, zero_points=False: auto_gptq.py:99-102, 336-345)."""
    import torch

    g = _qconfig(quantized_dir)["group_size"]
    tensors, source = _tensors(quantized_dir), _tensors(tiny_model_dir)
    modules = _gptq_modules_on_disk(quantized_dir)
    assert modules
    for m in sorted(modules):
        N, K = source[f"{m}.weight"].shape
        assert K % g == 0, m
        assert tuple(tensors[f"{m}.qweight"].shape) == (K // 8, N) and tensors[f"{m}.qweight"].dtype == torch.int32
        assert tuple(tensors[f"{m}.qzeros"].shape) == (K // g, N // 8)
        assert tuple(tensors[f"{m}.scales"].shape) == (K // g, N) and tensors[f"{m}.scales"].dtype == torch.float16
        assert torch.equal(tensors[f"{m}.g_idx"], torch.arange(K, dtype=torch.int32) // g), m
        assert bool((tensors[f"{m}.qzeros"] == 0x77777777).all()), m
        assert f"{m}.weight" not in tensors


def thinker_plain_params(config: dict) -> set[str]:
    """The thinker's parameters outside Linear and MoE layers (vllm 0.33 qwen3_omni_moe_thinker.py: audio encoder
    convs and norms 287-305, 376-415; vision patch embed, position embedding, block norms and merger norms
    579-600, 652-653, 716-719, 781-793; qwen3_moe.py: embeddings and final norm 466-480, q/k norms 326-327,
    decoder layer norms 406-408)."""
    th = config["thinker_config"]
    out = {"language_model.model.embed_tokens.weight", "language_model.model.norm.weight",
           "visual.patch_embed.proj.weight", "visual.patch_embed.proj.bias", "visual.pos_embed.weight"}
    wb = ("weight", "bias")
    out |= {f"audio_tower.{c}.{w}" for c in ("conv2d1", "conv2d2", "conv2d3", "ln_post") for w in wb}
    for i in range(th["audio_config"]["encoder_layers"]):
        out |= {f"audio_tower.layers.{i}.{n}.{w}" for n in ("self_attn_layer_norm", "final_layer_norm") for w in wb}
    for i in range(th["vision_config"]["depth"]):
        out |= {f"visual.blocks.{i}.{n}.{w}" for n in ("norm1", "norm2") for w in wb}
    mergers = ["merger", *(f"merger_list.{j}" for j in range(len(th["vision_config"]["deepstack_visual_indexes"])))]
    out |= {f"visual.{m}.ln_q.{w}" for m in mergers for w in wb}
    for i in range(th["text_config"]["num_hidden_layers"]):
        p = f"language_model.model.layers.{i}"
        out |= {f"{p}.{n}.weight" for n in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm",
                                             "self_attn.k_norm")}
    return out


def test_vllm_maps_every_thinker_tensor_onto_a_parameter(quantized_dir):
    """Every on-disk `thinker.*` tensor, through the thinker's WeightsMapper, the sub-models' stacking renames and
    the MoE expert mapping, lands on a parameter of the module vLLM 0.33 builds (GPTQ parameters where it builds
    GPTQ, `weight` where it does not), `.g_idx` (dropped while loading) aside; and every such parameter is fed."""
    from orin.checkpoint.files import read_header

    d = Path(quantized_dir)
    config = json.loads((d / "config.json").read_text())
    qconfig = config["quantization_config"]
    header = {k: v["dtype"] for shard in sorted(d.glob("model-*.safetensors")) for k, v in read_header(shard).items()}
    listed = listed_modules(qconfig, header, THINKER_PREFIXES)
    layers = {layer.prefix: layer for layer in thinker_layers(config)}
    quantized = {p: vllm_quantizes(layer, qconfig, listed) for p, layer in layers.items()}
    plain = thinker_plain_params(config)
    fed: dict[str, set[str]] = {p: set() for p in layers}
    fed_plain, unmapped = set(), []
    for key in sorted(k for k in header if k.startswith("thinker.")):
        name = rename(key, THINKER_PREFIXES)
        if name is None:
            unmapped.append(f"{key}: dropped by the thinker's mapper")
            continue
        if key.endswith(".g_idx"):
            assert key.removesuffix(".g_idx") + ".qweight" in header, key
            continue
        name = stack(name)
        expert = EXPERT.match(name)
        module, leaf = (expert["layer"], ("w13_" if expert["proj"] in ("gate", "up") else "w2_") + expert["leaf"]) \
            if expert else name.rsplit(".", 1)
        if module in layers:
            allowed = ((GPTQ_MOE if quantized[module] else {"w13_weight", "w2_weight"}) if layers[module].moe
                       else (GPTQ_LINEAR if quantized[module] else {"weight"}) | {"bias"})
            if leaf not in allowed:
                unmapped.append(f"{key} -> {module}.{leaf}: no such parameter (vLLM builds {sorted(allowed)})")
            fed[module].add(leaf)
        elif name in plain:
            fed_plain.add(name)
        else:
            unmapped.append(f"{key} -> {name}: no such parameter in vLLM's thinker")
    assert unmapped == []
    for prefix, leaves in fed.items():
        need = (GPTQ_MOE if quantized[prefix] else {"w13_weight", "w2_weight"}) if layers[prefix].moe else (
            GPTQ_LINEAR if quantized[prefix] else {"weight"})
        assert need <= leaves, f"{prefix}: {sorted(need - leaves)} not in the checkpoint"
    assert fed_plain == plain


if __name__ == "__main__":  # the child process of the `hf_loaded` fixture
    _transformers_load(*sys.argv[1:4])
