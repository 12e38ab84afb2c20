"""What a checkpoint weighs: parameters, BF16 bytes, INT4 bytes as `quantize` writes them and resident bytes on
the device, per component, segment and loader unit, from config.json alone (a model on the meta device)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import components as C
from ..checkpoint.targets import (
    QuantSpec,
    find_targets,
    padded,
    target_file_bytes,
    target_param_count,
    target_runtime_bytes,
)


@dataclass
class ComponentSize:
    name: str
    params: int
    bf16_bytes: int
    int4_bytes: int  # on disk, in the layout quantize writes
    quantized_params: int
    runtime_int4_bytes: int  # resident after conversion to torch's int4pack layout (bf16 elsewhere)
    targets: int
    units: dict[str, int] = field(default_factory=dict)  # runtime bytes per unit (orin.components.unit_of)

    def to_json(self) -> dict:
        return {
            "params": self.params, "bf16_bytes": self.bf16_bytes, "int4_bytes": self.int4_bytes,
            "quantized_params": self.quantized_params, "runtime_bytes": self.runtime_int4_bytes,
            "int4_targets": self.targets,
        }


@dataclass
class ModelSizes:
    components: dict[str, ComponentSize]
    segments: dict[str, tuple[str, ...]]
    spec: QuantSpec
    dims: dict
    padded_layers: list[dict] = field(default_factory=list)
    # (component, name, bytes) of the largest single weight tensor on the device: one allocation where its unit's
    # weights have no arena (all-resident, or an arena's fallback), orin.memory.request_sizes.allocations
    largest_tensor: tuple[str, str, int] | None = None

    @property
    def total_params(self) -> int:
        return sum(c.params for c in self.components.values())

    def segment(self, name: str) -> dict:
        comps = [self.components[c] for c in self.segments[name]]
        return {
            "components": list(self.segments[name]),
            "params": sum(c.params for c in comps),
            "bf16_bytes": sum(c.bf16_bytes for c in comps),
            "int4_bytes": sum(c.int4_bytes for c in comps),
        }


def model_dims(config) -> dict:
    th = config.thinker_config
    tt, au, vi = th.text_config, th.audio_config, th.vision_config
    tk = config.talker_config
    ktt, cp, c2w = tk.text_config, tk.code_predictor_config, config.code2wav_config
    return {
        "thinker": {"layers": tt.num_hidden_layers, "hidden": tt.hidden_size, "heads": tt.num_attention_heads,
                    "kv_heads": tt.num_key_value_heads, "head_dim": tt.head_dim, "experts": tt.num_experts,
                    "top_k": tt.num_experts_per_tok, "moe_intermediate": tt.moe_intermediate_size,
                    "vocab": tt.vocab_size, "deepstack": len(vi.deepstack_visual_indexes)},
        "audio": {"d_model": au.d_model, "ffn": au.encoder_ffn_dim, "layers": au.encoder_layers,
                  "n_window": au.n_window, "mel_bins": au.num_mel_bins, "conv_channels": au.downsample_hidden_size,
                  "conv_chunksize": au.conv_chunksize},
        "vision": {"hidden": vi.hidden_size, "intermediate": vi.intermediate_size, "heads": vi.num_heads,
                   "patch": vi.patch_size, "merge": vi.spatial_merge_size, "depth": vi.depth,
                   "in_channels": vi.in_channels, "temporal_patch": vi.temporal_patch_size},
        "talker": {"layers": ktt.num_hidden_layers, "hidden": ktt.hidden_size, "heads": ktt.num_attention_heads,
                   "kv_heads": ktt.num_key_value_heads, "head_dim": ktt.head_dim, "experts": ktt.num_experts,
                   "top_k": ktt.num_experts_per_tok, "moe_intermediate": ktt.moe_intermediate_size,
                   "shared_intermediate": ktt.shared_expert_intermediate_size, "vocab": ktt.vocab_size},
        "code_predictor": {"layers": cp.num_hidden_layers, "hidden": cp.hidden_size, "kv_heads": cp.num_key_value_heads,
                           "head_dim": cp.head_dim, "groups": tk.num_code_groups},
        "code2wav": {"hidden": c2w.hidden_size, "decoder_dim": c2w.decoder_dim,
                     "upsample_rates": list(c2w.upsample_rates), "upsampling_ratios": list(c2w.upsampling_ratios)},
    }


def meta_model(config):
    """The model tree (orin.model.omni, from an orin.model.config.OmniConfig) on the meta device: shapes without a
    byte of weights."""
    import torch

    from ..model.omni import OmniModel

    with torch.device("meta"):
        return OmniModel(config)


def size_model(config, spec: QuantSpec, segments: dict[str, tuple[str, ...]], dtype_bytes: int = 2) -> ModelSizes:
    model = meta_model(config)
    params = {c: 0 for c in C.NAMES}
    unit_params: dict[str, int] = {}
    for name, p in model.named_parameters():
        unit = C.unit_of(name)
        if unit is not None:
            params[C.unit_component(unit)] += p.numel()
            unit_params[unit] = unit_params.get(unit, 0) + p.numel()
    targets = find_targets(model, spec)
    g = spec.group_size
    q_params = {c: 0 for c in C.NAMES}
    q_file = {c: 0 for c in C.NAMES}
    q_run = {c: 0 for c in C.NAMES}
    n_targets = {c: 0 for c in C.NAMES}
    unit_q: dict[str, tuple[int, int]] = {}  # unit -> (quantized params, their runtime bytes)
    padded_layers: dict[tuple[int, int], int] = {}
    for t in targets:
        n, run = target_param_count(t), target_runtime_bytes(t, g, scale_bytes=dtype_bytes)  # scales: compute dtype
        q_params[t.component] += n
        q_file[t.component] += target_file_bytes(t, g)
        q_run[t.component] += run
        n_targets[t.component] += 1
        unit = C.unit_of(t.path + ".")
        old = unit_q.get(unit, (0, 0))
        unit_q[unit] = (old[0] + n, old[1] + run)
        for _, k, _n, _b in t.linears():
            if k % g:
                padded_layers[(k, padded(k, g))] = padded_layers.get((k, padded(k, g)), 0) + 1
    units = {u: (n - unit_q.get(u, (0, 0))[0]) * dtype_bytes + unit_q.get(u, (0, 0))[1] for u, n in unit_params.items()}
    comps = {}
    for c in C.NAMES:
        rest = params[c] - q_params[c]
        comps[c] = ComponentSize(
            name=c, params=params[c], bf16_bytes=params[c] * 2, int4_bytes=rest * 2 + q_file[c],
            quantized_params=q_params[c], runtime_int4_bytes=rest * dtype_bytes + q_run[c], targets=n_targets[c],
            units={u: b for u, b in sorted(units.items(), key=lambda kv: C.unit_sort_key(kv[0]))
                   if C.unit_component(u) == c},
        )
    pads = [{"in_features": k, "padded_in_features": kp, "layers": n} for (k, kp), n in sorted(padded_layers.items())]
    return ModelSizes(comps, segments, spec, model_dims(config), pads, _largest_tensor(model, targets, g, dtype_bytes))


def _largest_tensor(model, targets, group_size: int, dtype_bytes: int) -> tuple[str, str, int] | None:
    """(component, name, bytes) of the largest tensor the loaded model holds: a plain parameter in the compute dtype,
    or an INT4 target's packed weight in torch's int4pack layout (an experts target's stacked over its experts:
    orin.int4.experts), half a byte a padded weight (orin.checkpoint.targets.runtime_int4_bytes)."""
    from ..checkpoint.targets import INT4_N_ALIGN

    def packed(k: int, n: int) -> int:
        return padded(k, group_size) * (-(-n // INT4_N_ALIGN) * INT4_N_ALIGN) // 2

    quantized = {t.path: t for t in targets}
    best = None
    for name, p in model.named_parameters():
        path, _, leaf = name.rpartition(".")
        t = quantized.get(path)
        if t is None or leaf == "bias":
            nbytes = p.numel() * dtype_bytes
        elif t.kind == "experts":
            nbytes = t.num_experts * (packed(t.in_features, 2 * t.intermediate) if leaf == "gate_up_proj"
                                      else packed(t.intermediate, t.out_features))
        else:
            nbytes = packed(t.in_features, t.out_features)
        unit = C.unit_of(name)
        if unit is not None and (best is None or nbytes > best[2]):
            best = (C.unit_component(unit), name, nbytes)
    return best
