"""What `quantize` turns into INT4, decided in one place for the planner, the quantizer and the loader.

A target is either one nn.Linear or one fused MoE experts module (transformers 5.x stores a layer's experts as
3-D `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]; on disk they become one GPTQ Linear per expert and
projection). Embeddings, lm_head, routers, norms, convolutions and the small projection MLPs stay BF16.
The vision MLP's `linear_fc2` (4304 inputs, 16 x 269: no group size the INT4 kernels or vLLM's GPTQ kernels
take divides it) stays BF16 and is declared so in the checkpoint's quantization_config. Any other Linear whose
in_features is not a multiple of the group size (possible with --group-size 256) is stored the way GPTQ tools
write it (a partial last group) and padded with zero columns at load time, where the kernels need it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..components import component_of
from ..errors import ModelError

BF16 = 2


@dataclass(frozen=True)
class QuantSpec:
    bits: int = 4
    group_size: int = 128
    quantize_audio_encoder: bool = False
    quantize_code_predictor: bool = False
    quantize_code2wav: bool = False
    quantize_lm_head: bool = False
    sym: bool = True  # vLLM's GPTQ kernels take symmetric 4-bit only
    quantize_vision: bool = True  # False for vLLM-Omni 0.30, which builds the vision tower without GPTQ

    def describe(self) -> dict:
        return {
            "bits": self.bits,
            "group_size": self.group_size,
            "format": "gptq_v1",
            "sym": self.sym,
            "desc_act": False,
            "quantized": {
                "thinker_text": "attention q/k/v/o projections and every routed expert's gate/up/down"
                + (", lm_head" if self.quantize_lm_head else ""),
                "vision_encoder": "every block's attn qkv/proj and mlp linear_fc1 (linear_fc2 stays BF16)"
                if self.quantize_vision else "stays BF16",
                "talker": "attention projections, routed experts and the shared expert",
                "audio_encoder": "encoder layers' linears" if self.quantize_audio_encoder else "stays BF16",
                "code_predictor": "decoder layers' linears" if self.quantize_code_predictor else "stays BF16",
                "code2wav": "pre-transformer linears" if self.quantize_code2wav else "stays BF16",
            },
            "stays_bf16": "embeddings, lm_head, routers, norms, convolutions, projection MLPs, biases",
        }


# Per component: the module paths whose Linears and experts are quantized, as regexes over module names.
_RULES: dict[str, str] = {
    "thinker_text": r"^thinker\.model\.language_model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.experts|mlp\.(gate|up|down)_proj)$",
    "audio_encoder": r"^thinker\.model\.audio_tower\.layers\.\d+\.(self_attn\.(q|k|v|out)_proj|fc1|fc2)$",
    "vision_encoder": r"^thinker\.model\.visual\.blocks\.\d+\.(attn\.(qkv|proj)|mlp\.linear_fc1)$",
    "talker": r"^talker\.model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.experts|mlp\.shared_expert\.(gate|up|down)_proj)$",
    "code_predictor": r"^talker\.code_predictor\.model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)$",
    "code2wav": r"^code2wav\.pre_transformer\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)$",
}
_LM_HEAD = r"^thinker\.lm_head$"


@dataclass(frozen=True)
class Target:
    path: str
    component: str
    kind: str  # "linear" or "experts"
    in_features: int  # H for experts
    out_features: int  # H for experts (down_proj output)
    bias: bool = False
    num_experts: int = 0
    intermediate: int = 0  # I for experts

    def linears(self) -> list[tuple[str, int, int, bool]]:
        """(suffix, K, N, bias) of every GPTQ Linear stored for this target."""
        if self.kind == "linear":
            return [("", self.in_features, self.out_features, self.bias)]
        out = []
        for e in range(self.num_experts):
            out.append((f".{e}.gate_proj", self.in_features, self.intermediate, False))
            out.append((f".{e}.up_proj", self.in_features, self.intermediate, False))
            out.append((f".{e}.down_proj", self.intermediate, self.out_features, False))
        return out

    @property
    def weight_params(self) -> int:
        return sum(k * n for _, k, n, _ in self.linears())


def enabled_components(spec: QuantSpec) -> set[str]:
    comps = {"thinker_text", "talker"} | ({"vision_encoder"} if spec.quantize_vision else set())
    if spec.quantize_audio_encoder:
        comps.add("audio_encoder")
    if spec.quantize_code_predictor:
        comps.add("code_predictor")
    if spec.quantize_code2wav:
        comps.add("code2wav")
    return comps


def padded(k: int, group_size: int) -> int:
    return -(-k // group_size) * group_size


def gptq_v1_bytes(k: int, n: int, group_size: int, bias: bool) -> int:
    """File bytes of one GPTQ v1 Linear as GPTQ tools store it: int32 qweight [ceil(K/8), N], int32 qzeros
    [ceil(K/g), N/8], fp16 scales [ceil(K/g), N], int32 g_idx [K], bias in 16 bits."""
    groups = -(-k // group_size)
    return -(-k // 8) * n * 4 + groups * (n // 8) * 4 + groups * n * 2 + k * 4 + (n * 2 if bias else 0)


# torch's int4pack kernels (orin.int4.pack) take these group sizes; a checkpoint's larger group repeats its scales
# per kernel group. Outputs are padded to a multiple of INT4_N_ALIGN (the CPU kernel's requirement).
KERNEL_GROUP_SIZES = (256, 128, 64, 32)
INT4_N_ALIGN = 16


def kernel_group_size(group_size: int) -> int:
    """The largest kernel group size dividing the checkpoint's group size (scales repeat group_size/kg times)."""
    for kg in KERNEL_GROUP_SIZES:
        if group_size % kg == 0:
            return kg
    raise ModelError(f"group size {group_size} is not a multiple of 32; the INT4 kernels need 32, 64, 128 or 256 "
                     "— re-quantize")


def runtime_int4_bytes(k: int, n: int, group_size: int, bias: bool, scale_bytes: int = BF16) -> int:
    """Resident bytes of one GPTQ Linear [k -> n] once loaded in torch's int4pack layout (orin.int4.pack): nibbles
    over the padded shape (k up to whole groups, n up to INT4_N_ALIGN), a scale/zero pair per kernel group and
    padded output, and the bias; scales and bias in the compute dtype (`scale_bytes` each: bf16 on CUDA). The one
    formula: tests/test_int4.py checks it against the buffers of loaded modules."""
    kp = padded(k, group_size)
    n_pad = -(-n // INT4_N_ALIGN) * INT4_N_ALIGN
    groups = kp // kernel_group_size(group_size)
    return kp * n_pad // 2 + groups * n_pad * 2 * scale_bytes + (n * scale_bytes if bias else 0)


def find_targets(model, spec: QuantSpec) -> list[Target]:
    """Every INT4 target of a (meta-device or real) Qwen3-Omni model under `spec`."""
    import torch.nn as nn

    rules = {c: re.compile(r) for c, r in _RULES.items() if c in enabled_components(spec)}
    lm_head = re.compile(_LM_HEAD) if spec.quantize_lm_head else None
    targets = []
    for name, module in model.named_modules():
        comp = component_of(name + ".")
        if comp is None:
            continue
        rule = rules.get(comp)
        hit = (rule is not None and rule.match(name)) or (lm_head is not None and lm_head.match(name))
        if not hit:
            continue
        if isinstance(module, nn.Linear):
            if module.out_features % 8:
                continue  # qzeros pack 8 output columns per int32
            targets.append(Target(name, comp, "linear", module.in_features, module.out_features,
                                  bias=module.bias is not None))
        elif hasattr(module, "gate_up_proj") and hasattr(module, "down_proj"):
            e, two_i, h = module.gate_up_proj.shape
            targets.append(Target(name, comp, "experts", h, h, num_experts=e, intermediate=two_i // 2))
    return targets


def target_file_bytes(t: Target, group_size: int) -> int:
    return sum(gptq_v1_bytes(k, n, group_size, b) for _, k, n, b in t.linears())


def target_runtime_bytes(t: Target, group_size: int, scale_bytes: int = BF16) -> int:
    """Resident bytes of a target once loaded (orin.int4.linear): an experts target holds each expert's gate and up
    projections as one [2I x H] layer, as HF's gate_up_proj, and its down projection."""
    if t.kind == "experts":
        gate_up = runtime_int4_bytes(t.in_features, 2 * t.intermediate, group_size, False, scale_bytes)
        down = runtime_int4_bytes(t.intermediate, t.out_features, group_size, False, scale_bytes)
        return t.num_experts * (gate_up + down)
    return runtime_int4_bytes(t.in_features, t.out_features, group_size, t.bias, scale_bytes)


def target_param_count(t: Target) -> int:
    return t.weight_params + sum(n for _, _, n, b in t.linears() if b)
