"""``Int4Experts``: the INT4 replacement of HF's fused MoE experts, on torch's int4pack layout (orin.int4.pack).

The module holds the weights (loaded from GPTQ tensors or a packed copy) and the layer's geometry; its MoE backend
(orin.int4.moe: "cpu", "torch" or "triton"), chosen when it is loaded from the device profile and the packed
shapes, computes it: ``forward`` is the backend's prompt route, ``add_long`` its long-prompt route, and
orin.runtime.layer's decode step calls the backend's decode on the module's buffers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint.gptq_format import GPTQ_KEYS
from ..device.profile import CPU, DeviceProfile
from ..errors import ModelError
from .moe import MoeBackend, choose_backend
from .pack import KernelWeight, check_device, to_kernel

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
PACKED_BUFFERS = ("gate_up_packed", "gate_up_scales_and_zeros", "down_packed", "down_scales_and_zeros")


def _expert_tensors(source, e: int, proj: str, prefix: str) -> Mapping[str, torch.Tensor]:
    if isinstance(source, Sequence):
        return source[e].get(proj, {})
    return _Prefixed(source, f"{prefix}{e}.{proj}.")


class _Prefixed(Mapping):
    """A read-only view of ``source`` keyed without ``prefix``; lookups stay lazy (one tensor at a time)."""

    def __init__(self, source: Mapping[str, torch.Tensor], prefix: str) -> None:
        self._source, self._prefix = source, prefix

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._source[self._prefix + key]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and (self._prefix + key) in self._source

    def __iter__(self):
        n = len(self._prefix)
        return (k[n:] for k in self._source if k.startswith(self._prefix))

    def __len__(self) -> int:
        return sum(1 for _ in self)


# Experts convert as one layer stacked along the outputs where each expert's outputs fill whole kernel row tiles
# (the CUDA int4pack layout tiles 8 rows, the CPU one blocks of rows): then the packed rows split per expert.
BATCH_ROW_ALIGN = 64


def _batch_keys(batch: range, prefix: str) -> list[str]:
    return [f"{prefix}{e}.{p}.{k}" for e in batch for p in EXPERT_PROJS for k in GPTQ_KEYS]


def _batch_tensors(source, batch: range, prefix: str, device: torch.device, name: str, where: str):
    """A batch of experts' GPTQ tensors stacked per key: (gate_up, down), each {key: [b, ...]}, gate_up with each
    expert's gate outputs then its up outputs (HF's gate_up_proj order). Gathering is per expert; every tensor
    operation is per batch (a few stacks and concatenations, one device sync for the group layouts)."""
    raw: dict[str, dict[str, list]] = {p: {k: [] for k in GPTQ_KEYS} for p in EXPERT_PROJS}
    for e in batch:
        for p in EXPERT_PROJS:
            tensors = _expert_tensors(source, e, p, prefix)
            for k in GPTQ_KEYS:
                if k not in tensors:
                    raise ModelError(f"{name}.{e}.{p}.{k} missing from the checkpoint; re-run orin-omni quantize")
                raw[p][k].append(tensors[k])
    try:
        st = {p: {k: torch.stack([t.to(device) for t in ts]) for k, ts in raw[p].items()} for p in EXPERT_PROJS}
    except RuntimeError as exc:  # stack refuses tensors of different shapes
        raise ModelError(f"{where}: the experts of one layer are stored with different shapes ({exc}); "
                         "re-quantize") from exc
    gate, up = st["gate_proj"], st["up_proj"]
    if gate["g_idx"].shape != up["g_idx"].shape or not bool(gate["g_idx"].eq(up["g_idx"]).all()):
        raise ModelError(f"{where}: gate_proj and up_proj were quantized with different group layouts; re-quantize")
    gate_up = {k: torch.cat([gate[k], up[k]], dim=2) for k in ("qweight", "qzeros", "scales")}
    gate_up["g_idx"] = gate["g_idx"]
    return gate_up, st["down_proj"]


def convert_batch(stacked: Mapping[str, torch.Tensor], in_features: int, device: torch.device,
                  dtype: torch.dtype, name: str,
                  cpu_chunk_rows: int = CPU.memory.cpu_convert_chunk_rows) -> KernelWeight:
    """Several experts' same-shaped GPTQ layers, stacked per key ([b, ...] each), in kernel form, stacked:
    weight [b, ...], scales_and_zeros [b, ...], each expert's exactly what `to_kernel` gives it alone (tests
    compare them). One conversion of the layers joined along their outputs where each expert's outputs fill whole
    row tiles and share their group layout; else one conversion each."""
    b, N = stacked["scales"].shape[0], stacked["scales"].shape[2]
    g_idx = stacked["g_idx"]
    # one comparison (one device sync) for the whole batch's group layouts, not one per expert
    joinable = b > 1 and N % BATCH_ROW_ALIGN == 0 and bool(g_idx.eq(g_idx[:1]).all())
    if not joinable:
        kws = [to_kernel({k: v[i] for k, v in stacked.items()}, in_features, device, dtype, name, cpu_chunk_rows)
               for i in range(b)]
        k0 = kws[0]
        return KernelWeight(torch.stack([k.weight for k in kws]), torch.stack([k.scales_and_zeros for k in kws]),
                            k0.kernel_group, k0.group, k0.K_run, k0.N)
    # [b, rows, n] -> [rows, b * n]: the experts side by side along the outputs
    joined = {k: stacked[k].transpose(0, 1).reshape(stacked[k].shape[1], -1) for k in ("qweight", "qzeros", "scales")}
    joined["g_idx"] = g_idx[0]
    kw = to_kernel(joined, in_features, device, dtype, name, cpu_chunk_rows)
    weight = kw.weight.view(b, kw.weight.shape[0] // b, *kw.weight.shape[1:])
    sz = kw.scales_and_zeros.view(kw.scales_and_zeros.shape[0], b, N, 2).transpose(0, 1).contiguous()
    return KernelWeight(weight, sz, kw.kernel_group, kw.group, kw.K_run, N)


class Int4Experts(nn.Module):
    """INT4 replacement of HF's fused experts (Qwen3OmniMoe{Thinker,Talker}TextExperts).

    Same call as the module it replaces: ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])
    -> [T, H]``, same math (``down(act(gate(x)) * up(x)) * weight`` summed over the chosen experts; an index equal to
    ``num_experts`` is skipped like HF). Tokens are grouped per expert with one sort; gate and up are one fused
    matmul. The loaders take the device profile (``profile``: its numbers and capabilities; the CPU's by
    default), from which the MoE backend (``backend``) is chosen once per load.
    """

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, act_fn: nn.Module) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.act_fn = act_fn
        self.backend: MoeBackend | None = None  # orin.int4.moe: chosen when loaded
        self.layout: str | None = None
        self.group_size: int | None = None
        self._geom: dict[str, tuple[int, int, int]] = {}  # proj -> (kernel group, K_run, N_pad)
        self._views: tuple[tuple[torch.Tensor, ...], ...] | None = None
        for buf in PACKED_BUFFERS:
            self.register_buffer(buf, None, persistent=False)

    @property
    def is_loaded(self) -> bool:
        return self.down_packed is not None

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The kernel's activation dtype: that of the scales_and_zeros buffers (``model.to(dtype)`` converts them)."""
        return None if self.down_scales_and_zeros is None else self.down_scales_and_zeros.dtype

    def tensor_keys(self) -> list[str]:
        """Checkpoint keys, relative to this module's path (GPTQModel's defused layout ``{e}.gate_proj.qweight``)."""
        return [f"{e}.{p}.{k}" for e in range(self.num_experts) for p in EXPERT_PROJS for k in GPTQ_KEYS]

    @torch.no_grad()
    def load_gptq_(
        self,
        source: Sequence[Mapping[str, Mapping[str, torch.Tensor]]] | Mapping[str, torch.Tensor],
        device: torch.device | str,
        dtype: torch.dtype = torch.bfloat16,
        name: str = "experts",
        prefix: str = "",
        *,
        profile: DeviceProfile = CPU,
    ) -> Int4Experts:
        """Fill from per-expert GPTQ tensors: ``source[e]['gate_proj'|'up_proj'|'down_proj'] -> {qweight, ...}``,
        or a flat mapping with keys ``f"{prefix}{e}.gate_proj.qweight"`` (lazy mappings are read a batch of experts
        at a time, `load_batch()`; each batch is converted on ``device`` in one call and copied into its slots of
        the stacked buffers)."""
        device = torch.device(device)
        self.unload_()  # never hold the old and the new buffers at once
        E = self.num_experts
        if isinstance(source, Sequence) and len(source) != E:
            raise ModelError(f"{name}: {len(source)} experts given, the model has {E}")
        stacks: dict[str, torch.Tensor] = {}
        step = self.load_batch(profile)
        for e0 in range(0, E, step):
            batch = range(e0, min(E, e0 + step))
            if hasattr(source, "read_block"):  # the loader's lazy view: the batch's tensors in one read, and the
                # next batch's read started in the background while this one converts
                source.read_block(_batch_keys(batch, prefix))
                # (after the last batch: nothing of this module; the loader's view then reads the next module's)
                source.read_ahead(_batch_keys(range(batch.stop, min(E, batch.stop + step)), prefix))
            where = f"{name}.{batch.start}-{batch.stop - 1}"
            gate_up, down = _batch_tensors(source, batch, prefix, device, name, where)
            for key, stacked, k_in, n_out in (("gate_up", gate_up, self.hidden_dim, 2 * self.intermediate_dim),
                                              ("down", down, self.intermediate_dim, self.hidden_dim)):
                kw = convert_batch(stacked, k_in, device, dtype, f"{where}.{key}",
                                   profile.memory.cpu_convert_chunk_rows)
                if kw.N != n_out:
                    raise ModelError(f"{where}: expert output sizes in the checkpoint do not match the model's "
                                     f"(H={self.hidden_dim}, I={self.intermediate_dim})")
                geom = (kw.kernel_group, kw.K_run, kw.N_pad)
                if e0 == 0:
                    self._geom[key] = geom
                    stacks[f"{key}_packed"] = torch.empty((E, *kw.weight.shape[1:]), dtype=kw.weight.dtype,
                                                          device=device)
                    stacks[f"{key}_scales_and_zeros"] = torch.empty(
                        (E, *kw.scales_and_zeros.shape[1:]), dtype=kw.scales_and_zeros.dtype, device=device)
                elif self._geom[key] != geom:
                    raise ModelError(f"{where}: quantized with a different group size than expert 0; re-quantize")
                stacks[f"{key}_packed"][batch.start:batch.stop].copy_(kw.weight)
                stacks[f"{key}_scales_and_zeros"][batch.start:batch.stop].copy_(kw.scales_and_zeros)
                self.group_size = kw.group
            del gate_up, down
        for key, value in stacks.items():
            setattr(self, key, value)
        self._loaded(device, profile)
        return self

    def _loaded(self, device: torch.device, profile: DeviceProfile) -> None:
        self._views = None
        self.layout = device.type
        self.backend = choose_backend(profile, device, (self.gate_up_packed, self.down_packed))

    def load_batch(self, profile: DeviceProfile = CPU) -> int:
        """Experts read and converted together when loading: one conversion a batch, not one an expert (each is a
        dozen small kernels: loading was bound by their launches, not by reading), a batch about the profile's
        moe.load_batch_bytes of packed weights (capped at moe.load_batch_experts where set)."""
        per_expert = 3 * self.hidden_dim * self.intermediate_dim // 2  # packed INT4 bytes of one expert
        return max(1, min(self.num_experts, profile.moe.load_batch_bytes // max(per_expert, 1),
                          profile.moe.load_batch_experts or self.num_experts))

    def first_read_keys(self, profile: DeviceProfile = CPU) -> list[str]:
        """The checkpoint keys (relative to the module) its load reads first: its first batch."""
        return _batch_keys(range(self.load_batch(profile)), "")

    def unload_(self) -> None:
        """Drop the packed buffers (the module becomes an empty shell again)."""
        self.gate_up_packed = self.gate_up_scales_and_zeros = self.down_packed = self.down_scales_and_zeros = None
        self._views = None

    def packed_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(the kernel-layout buffers, what else they need to run): what `load_packed_` takes back
        (orin.memory.packed_cache keeps them so a later load skips the conversion)."""
        check_device(self.down_packed, self.layout, "Int4Experts")
        return ({b: getattr(self, b) for b in PACKED_BUFFERS},
                {"group_size": self.group_size, "geometry": {k: list(v) for k, v in self._geom.items()}})

    @torch.no_grad()
    def load_packed_(self, tensors: Mapping[str, torch.Tensor], meta: Mapping, device: torch.device | str,
                     name: str = "experts", *, profile: DeviceProfile = CPU) -> Int4Experts:
        """Take `packed_state`'s buffers as they are (already in `device`'s kernel layout: no conversion)."""
        device = torch.device(device)
        self.unload_()
        try:
            stacks = {b: tensors[b] for b in PACKED_BUFFERS}
            geom = {k: tuple(int(x) for x in meta["geometry"][k]) for k in ("gate_up", "down")}
            group = int(meta["group_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelError(f"{name}: the packed copy lacks {exc}") from exc
        outs = {"gate_up": 2 * self.intermediate_dim, "down": self.hidden_dim}
        if any(t.shape[0] != self.num_experts or t.device.type != device.type for t in stacks.values()) or any(
                stacks[f"{k}_scales_and_zeros"].shape[-2] < n for k, n in outs.items()):
            raise ModelError(f"{name}: the packed copy does not fit this model's {self.num_experts} experts")
        for buf, value in stacks.items():
            setattr(self, buf, value)
        self._geom, self.group_size = geom, group
        self._loaded(device, profile)
        return self

    @classmethod
    def from_gptq(
        cls,
        source: Sequence[Mapping[str, Mapping[str, torch.Tensor]]] | Mapping[str, torch.Tensor],
        *,
        num_experts: int,
        hidden_dim: int,
        intermediate_dim: int,
        act_fn: nn.Module,
        device: torch.device | str,
        dtype: torch.dtype = torch.bfloat16,
        prefix: str = "",
        name: str = "experts",
        profile: DeviceProfile = CPU,
    ) -> Int4Experts:
        module = cls(num_experts, hidden_dim, intermediate_dim, act_fn)
        return module.load_gptq_(source, device, dtype, name=name, prefix=prefix, profile=profile)

    def _apply(self, fn, recurse=True):
        self._views = None  # .to()/.cuda() replace the buffers: drop views of the old ones
        return super()._apply(fn, recurse)

    def _expert_views(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        """Per-expert views of the stacked buffers, made once per load: indexing per call costs host time."""
        if self._views is None:
            self._views = tuple(
                t.unbind(0)
                for t in (
                    self.gate_up_packed,
                    self.gate_up_scales_and_zeros,
                    self.down_packed,
                    self.down_scales_and_zeros,
                )
            )
        return self._views

    def route_for(self, hidden_states: torch.Tensor, k: int) -> str:
        """How forward runs these rows, k experts each (the backend's prefill_route: "tinygemm", "grouped_mm" or
        "triton")."""
        return self.backend.prefill_route(self, hidden_states.shape[0], k)

    def fused(self, hidden_states: torch.Tensor, k: int) -> bool:
        """Whether forward runs these rows, k experts each, without a host sync (the "triton" route), which a
        CUDA graph can capture."""
        return self.route_for(hidden_states, k) == "triton"

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        check_device(self.down_packed, self.layout, "Int4Experts")
        return self.backend.prefill(self, hidden_states, top_k_index, top_k_weights)

    @torch.no_grad()
    def add_long(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 into: torch.Tensor, max_rows: int | None = None) -> torch.Tensor:
        """``into += forward(hidden_states, top_k_index, top_k_weights)`` for a long prompt's rows, each expert
        dequantized once, the rows `max_rows` at a time (the backend's add_long)."""
        check_device(self.down_packed, self.layout, "Int4Experts")
        return self.backend.add_long(self, hidden_states, top_k_index, top_k_weights, into, max_rows)

    def _dequantized_bytes(self, element_size: int, experts: int | None = None) -> int:
        """Bytes of `experts` (all by default) experts' weights dequantized, as the packed shapes pad them."""
        one = (self.gate_up_scales_and_zeros.shape[-2] * self._geom["gate_up"][1]
               + self.down_scales_and_zeros.shape[-2] * self._geom["down"][1]) * element_size
        return one * (self.num_experts if experts is None else experts)

    def _rows(self, hidden_states: torch.Tensor, token: torch.Tensor, columns: torch.Tensor | None = None):
        """The sorted rows in the compute dtype, padded to the kernel's K, their columns in the order `columns`
        gives (cast, padded and reordered on the T tokens, before the gather repeats each k times)."""
        x = hidden_states
        if x.dtype != self.compute_dtype:
            x = x.to(self.compute_dtype)
        K_gu = self._geom["gate_up"][1]
        if K_gu > self.hidden_dim:
            x = F.pad(x, (0, K_gu - self.hidden_dim))
        if columns is not None:
            x = x.index_select(1, columns)
        return x[token]

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up (the module's activation), padded to the down projection's K."""
        inter = self.intermediate_dim
        h = self.act_fn(gate_up[:, :inter]) * gate_up[:, inter : 2 * inter]
        K_dn = self._geom["down"][1]
        return F.pad(h, (0, K_dn - inter)) if K_dn > inter else h

    def _combine(self, final: torch.Tensor, out: torch.Tensor, weights: torch.Tensor, token: torch.Tensor):
        """final[token[i]] += weights[i] * out[i, :H]; `out` is the caller's to overwrite."""
        out = out[:, : self.hidden_dim].to(final.dtype).mul_(weights[:, None].to(final.dtype))
        return final.index_add_(0, token, out)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, intermediate_dim={self.intermediate_dim}, "
            f"group_size={self.group_size}, loaded={self.is_loaded}, layout={self.layout}, "
            f"backend={None if self.backend is None else self.backend.name}"
        )


__all__ = ["EXPERT_PROJS", "Int4Experts", "convert_batch"]
