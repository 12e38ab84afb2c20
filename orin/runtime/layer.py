"""A decoder layer of the thinker, the talker or the code predictor as one pure function of tensors
(`decoder_layer`): the same math as the HF layer it replaces, reorganised so that nothing depends on host values
and the whole step can be captured in a CUDA graph. Its attention half is orin.runtime.attention's; its MLP half is here:
a dense SiLU MLP, or routed experts (and the talker's gated shared expert). INT4 experts run on their MoE backend
(orin.int4.moe, chosen when they were loaded): a decode step through the backend's `decode` on the stacked
buffers (no host sync), a prompt through the experts module (the backend's `prefill`), a long prompt through its
`add_long`. On CPU and for BF16 experts (where a checkpoint keeps them) the experts module computes every MoE.

`layer_weights(layer, device, profile)` reads an HF-named layer into (LayerSpec, tensors): the spec carries what
the layer functions need of the device profile (attention tuning, capabilities, the MoE backend), so they take
no other parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..device.profile import AttentionTuning, DeviceProfile
from ..int4.moe import MoeBackend, triton_runs
from ..model.text import topk_routing
from .attention import LinearSpec, _linear, _rms, _rms_rows, attention_block


@dataclass(frozen=True)
class LayerSpec:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    qk_eps: float
    scaling: float
    q: LinearSpec
    k: LinearSpec
    v: LinearSpec
    o: LinearSpec
    mlp: str  # "dense" | "moe" | "moe+shared"
    top_k: int = 0
    norm_topk: bool = True
    inter: int = 0
    gate_up: tuple = ()  # MoE: (kernel group, K_run, N_pad) of the fused gate/up and of down
    down: tuple = ()
    dense: tuple[LinearSpec, ...] = ()  # gate, up, down of a dense MLP or of the shared expert
    # what the layer functions need of the device profile (orin.device.profile), set by layer_weights
    attention: AttentionTuning = field(default_factory=AttentionTuning)
    flash_lower_right: bool = False  # capabilities.flash_lower_right on the layer's (CUDA) device
    triton: bool = False  # orin's Triton kernels run here (orin.int4.moe.triton_runs)
    # INT4 experts' MoE backend, chosen when they were loaded (None: a dense MLP, or BF16 experts); its `name`
    # ("triton", "torch", "cpu") is what the engine's stats show
    backend: MoeBackend | None = None


def _route(h, spec: LayerSpec, w: dict):
    """HF's top-k router: softmax in float32, top-k, renormalised, in h's dtype (INT4 experts: their backend's)."""
    logits = F.linear(h, w["router"])
    if spec.backend is None:
        return topk_routing(logits, spec.top_k, spec.norm_topk)
    return spec.backend.route(logits, spec.top_k, spec.norm_topk)


def _moe(h, spec: LayerSpec, w: dict):
    """Routed experts (+ the gated shared expert, as the talker has) for T tokens. A prefill's weights carry the
    experts module (its backend's prompt route, the one the HF modules call); a CUDA decode step's the stacked
    buffers its backend decodes on the device."""
    top_w, top_i = _route(h, spec, w)
    if "valid_rows" in w:  # an expert id past the last is no expert: Int4Experts skips those rows
        top_i = torch.where(w["valid_rows"], top_i, w["router"].shape[0])
    if "experts_module" in w:
        y = w["experts_module"](h, top_i, top_w)
    else:
        y = spec.backend.decode(h, spec, w["experts"], top_w, top_i)
    if spec.mlp == "moe+shared":
        g, u, d = spec.dense
        shared = _linear(F.silu(_linear(h, g, w["shared_gate"])) * _linear(h, u, w["shared_up"]), d,
                         w["shared_down"])
        y = y + torch.sigmoid(F.linear(h, w["shared_expert_gate"])) * shared
    return y


def decoder_layer(x, cos, sin, mask, pos, k_cache, v_cache, w: dict, spec: LayerSpec, prefix: int = 0):
    """One decoder layer for T positions. x [T, H]; cos/sin [T, head_dim]; pos [T] cache positions; mask
    [1, 1, rep*T, max_len] (row r*T+t: position t's query for head r of a group), or None for a prefill: from
    position 0 (`prefix` 0: causal over the T new keys, the cache's older contents unread), or a later chunk of
    one (`prefix` > 0: the T new keys after the prefix's, already in the cache); the caches are updated in
    place. Returns the layer's output [T, H]."""
    return mlp_block(attention_block(x, cos, sin, mask, pos, k_cache, v_cache, w, spec, prefix), w, spec)


def mlp_block(x, w: dict, spec: LayerSpec):
    """The layer's second half: x plus its MLP's (dense, or routed experts and a shared one) output."""
    h = _rms(x, w["ln2"], spec.eps)
    if spec.mlp == "dense":
        g, u, d = spec.dense
        return x + _linear(F.silu(_linear(h, g, w["gate"])) * _linear(h, u, w["up"]), d, w["down"])
    return x + _moe(h, spec, w)


def mlp_block_long(x, w: dict, spec: LayerSpec, chunk: int, max_rows: int | None = None):
    """mlp_block over a whole long prompt, adding into x (the caller's own tensor) in place: the router and the
    experts see every row at once, so each expert's INT4 weights are dequantized once per layer
    (Int4Experts.add_long, its token-expert rows `max_rows` at a time: None, the profile's
    prefill.long_moe_block_rows), not once per chunk of rows; a dense MLP and the shared expert go `chunk` rows at a
    time."""
    T = x.shape[0]
    if spec.mlp == "dense" or not hasattr(w.get("experts_module"), "add_long"):
        for s in range(0, T, chunk):
            x[s:s + chunk] = mlp_block(x[s:s + chunk], w, spec)
        return x
    h = _rms_rows(x, w["ln2"], spec.eps, chunk)
    top_w, top_i = _route(h, spec, w)
    if spec.mlp == "moe+shared":
        g, u, d = spec.dense
        for s in range(0, T, chunk):
            hs = h[s:s + chunk]
            shared = _linear(F.silu(_linear(hs, g, w["shared_gate"])) * _linear(hs, u, w["shared_up"]), d,
                             w["shared_down"])
            x[s:s + chunk] += torch.sigmoid(F.linear(hs, w["shared_expert_gate"])) * shared
    w["experts_module"].add_long(h, top_i, top_w, x, max_rows=max_rows)
    return x


# ---------------------------------------------------------------------- reading the HF modules


def _linear_of(module, profile: DeviceProfile, triton: bool) -> tuple[LinearSpec, tuple]:
    from ..int4.linear import Int4Linear

    if isinstance(module, Int4Linear):
        spec = LinearSpec(True, module.in_features, module.out_features, module.padded_in_features,
                          module.padded_out_features, module.kernel_group_size, module.bias is not None,
                          profile.prefill.graph_dequant_min_rows, triton)
        tensors = (module.weight_packed, module.scales_and_zeros) + ((module.bias,) if spec.bias else ())
        return spec, tensors
    spec = LinearSpec(False, module.in_features, module.out_features, bias=module.bias is not None)
    return spec, (module.weight,) + ((module.bias,) if spec.bias else ())


def _silu(act) -> bool:
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation")


def supported(layer) -> bool:
    """Whether decoder_layer computes this HF layer: SiLU MLPs and experts (INT4 or BF16)."""
    mlp = layer.mlp
    if hasattr(mlp, "gate") and hasattr(mlp, "experts"):
        if not _silu(mlp.experts.act_fn):
            return False
        shared = getattr(mlp, "shared_expert", None)
        return shared is None or _silu(shared.act_fn)
    return _silu(getattr(mlp, "act_fn", None))


def layer_weights(layer, device: torch.device, profile: DeviceProfile) -> tuple[LayerSpec, dict]:
    """The layer's LayerSpec and tensors on `device`, run as `profile` (orin.device.profile) says."""
    triton = triton_runs(profile, device)
    attn = layer.self_attn
    w: dict = {"ln1": layer.input_layernorm.weight, "ln2": layer.post_attention_layernorm.weight,
               "q_norm": attn.q_norm.weight, "k_norm": attn.k_norm.weight}
    specs = {}
    for name in ("q", "k", "v", "o"):
        specs[name], w[name] = _linear_of(getattr(attn, f"{name}_proj"), profile, triton)
    mlp = layer.mlp
    common = dict(hidden=layer.input_layernorm.weight.shape[0], heads=specs["q"].n // attn.head_dim,
                  kv_heads=specs["k"].n // attn.head_dim, head_dim=attn.head_dim,
                  eps=layer.input_layernorm.variance_epsilon, qk_eps=attn.q_norm.variance_epsilon,
                  scaling=attn.scaling, attention=profile.attention, triton=triton,
                  flash_lower_right=device.type == "cuda" and profile.capabilities.flash_lower_right, **specs)
    if hasattr(mlp, "gate") and hasattr(mlp, "experts"):
        from ..int4.linear import Int4Experts

        ex = mlp.experts
        w["router"] = mlp.gate.weight
        backend = ex.backend if isinstance(ex, Int4Experts) else None
        if backend is not None and backend.graph_decode:
            w["experts"] = (ex.gate_up_packed, ex.gate_up_scales_and_zeros, ex.down_packed, ex.down_scales_and_zeros)
            geometry = dict(inter=ex.intermediate_dim, gate_up=ex._geom["gate_up"], down=ex._geom["down"])
        else:
            # The module computes them: on CPU (no graphs, so its per-expert loop costs nothing a graph could
            # save; its tinygemm route is the same math), and for BF16 experts (a checkpoint that keeps them).
            w["experts_module"] = ex
            geometry = dict(inter=ex.intermediate_dim)
        dense = ()
        kind = "moe"
        if hasattr(mlp, "shared_expert"):
            kind = "moe+shared"
            sp = mlp.shared_expert
            parts = [_linear_of(p, profile, triton) for p in (sp.gate_proj, sp.up_proj, sp.down_proj)]
            dense = tuple(p[0] for p in parts)
            w["shared_gate"], w["shared_up"], w["shared_down"] = (p[1] for p in parts)
            w["shared_expert_gate"] = mlp.shared_expert_gate.weight
        spec = LayerSpec(**common, mlp=kind, top_k=mlp.gate.top_k, norm_topk=mlp.gate.norm_topk_prob, dense=dense,
                         backend=backend, **geometry)
    else:
        parts = [_linear_of(p, profile, triton) for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
        w["gate"], w["up"], w["down"] = (p[1] for p in parts)
        spec = LayerSpec(**common, mlp="dense", dense=tuple(p[0] for p in parts))
    return spec, w


def int4_experts_only(text_model) -> bool:
    """Whether every MoE layer's experts are INT4: BF16 experts (a checkpoint that keeps them) run through their
    module, whose per-expert token counts are a host sync no CUDA graph can hold."""
    from ..int4.linear import Int4Experts

    return all(isinstance(layer.mlp.experts, Int4Experts) for layer in text_model.layers
               if hasattr(layer.mlp, "experts"))


def moe_backend_name(text_model) -> str | None:
    """The name of the MoE backend a decoder's INT4 experts run on (chosen when they were loaded), or None."""
    for layer in text_model.layers:
        backend = getattr(getattr(layer.mlp, "experts", None), "backend", None)
        if backend is not None:
            return backend.name
    return None


__all__ = ["LayerSpec", "decoder_layer", "layer_weights", "mlp_block", "mlp_block_long", "supported"]
