"""``Int4Experts``: the INT4 replacement of HF's fused MoE experts, on torch's int4pack layout (orin.int4pack).

A MoE layer runs one of three routes (``EXPERT_ROUTES``), chosen per call from the row count unless the caller
names one (``forward(..., route=...)``; a check compares them that way):

- ``"tinygemm"``: one tinygemm launch per expert the router picked, after one host sync for the per-expert row
  counts. A few rows (decode through the HF modules, short prompts): below ``grouped_min_rows_per_expert`` rows
  per expert on average.
- ``"triton"``: prefill on CUDA with Triton: one launch of ``orin.kernels.int4_gemm``'s grouped GEMM per
  projection over all experts, dequantizing the packed tiles in registers, group boundaries on the device (no
  host sync: a CUDA graph can capture it). One launch per expert made the prefill launch-bound (12k launches
  for 467 tokens).
- ``"grouped_mm"``: prefill elsewhere (CPU; CUDA without Triton, with a kernel switched off after a failure, or
  with packed shapes the kernel does not take): experts dequantized a chunk of at most
  ``orin.plan.PREFILL_DEQUANT_CHUNK`` bytes at a time, each chunk's rows one ``torch._grouped_mm`` (one matmul
  per expert where the torch has none for the device: `grouped_matmul`).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import components as C
from .errors import ModelError
from .gptq_format import GPTQ_KEYS
from .int4pack import (
    KernelWeight,
    check_device,
    combine_rows,
    dequantize_packed,
    grouped_gemm,
    int4_mm,
    silu_mul_rows,
    to_kernel,
)
from .plan import LONG_DEQUANT_CHUNK, LONG_WHOLE_EXPERTS_BYTES, PREFILL_DEQUANT_CHUNK

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")
PACKED_BUFFERS = ("gate_up_packed", "gate_up_scales_and_zeros", "down_packed", "down_scales_and_zeros")
EXPERT_ROUTES = ("triton", "grouped_mm", "tinygemm")
# Rows per expert (on average) from which forward runs one grouped GEMM per projection instead of tinygemm per
# expert: at 1 (T * k >= E) a decode token still runs tinygemm, any real prompt the grouped GEMM.
GROUPED_MIN_ROWS_PER_EXPERT = 1


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


# Experts converted to the kernel layout per call when loading: one conversion per batch instead of one per expert
# (each is a dozen small kernels and their launches: loading was bound by them, not by reading). A batch holds
# about LOAD_BATCH_BYTES of packed weights, the load's transient memory twice over (raw and converted): 20 of the
# real thinker's experts, 81 of a talker layer's. With its scales, zeros and group indices (~5 % more) a batch's
# read fits one staging buffer (orin.block_reader.STAGE), so the next batch is read while this one converts.
# LOAD_BATCH_EXPERTS, where set, caps it (the tests).
LOAD_BATCH_BYTES = 48 << 20
LOAD_BATCH_EXPERTS: int | None = None
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
                  dtype: torch.dtype, name: str) -> KernelWeight:
    """Several experts' same-shaped GPTQ layers, stacked per key ([b, ...] each), in kernel form, stacked:
    weight [b, ...], scales_and_zeros [b, ...], each expert's exactly what `to_kernel` gives it alone (tests
    compare them). One conversion of the layers joined along their outputs where each expert's outputs fill whole
    row tiles and share their group layout; else one conversion each."""
    b, N = stacked["scales"].shape[0], stacked["scales"].shape[2]
    g_idx = stacked["g_idx"]
    # one comparison (one device sync) for the whole batch's group layouts, not one per expert
    joinable = b > 1 and N % BATCH_ROW_ALIGN == 0 and bool(g_idx.eq(g_idx[:1]).all())
    if not joinable:
        kws = [to_kernel({k: v[i] for k, v in stacked.items()}, in_features, device, dtype, name) for i in range(b)]
        k0 = kws[0]
        return KernelWeight(torch.stack([k.weight for k in kws]), torch.stack([k.scales_and_zeros for k in kws]),
                            k0.kernel_group, k0.group, k0.K_run, k0.N)
    # [b, rows, n] -> [rows, b * n]: the experts side by side along the outputs
    joined = {k: stacked[k].transpose(0, 1).reshape(stacked[k].shape[1], -1) for k in ("qweight", "qzeros", "scales")}
    joined["g_idx"] = g_idx[0]
    kw = to_kernel(joined, in_features, device, dtype, name)
    weight = kw.weight.view(b, kw.weight.shape[0] // b, *kw.weight.shape[1:])
    sz = kw.scales_and_zeros.view(kw.scales_and_zeros.shape[0], b, N, 2).transpose(0, 1).contiguous()
    return KernelWeight(weight, sz, kw.kernel_group, kw.group, kw.K_run, N)


class Int4Experts(nn.Module):
    """INT4 replacement of HF's fused experts (Qwen3OmniMoe{Thinker,Talker}TextExperts).

    Same call as the module it replaces: ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])
    -> [T, H]``, same math (``down(act(gate(x)) * up(x)) * weight`` summed over the chosen experts; an index equal to
    ``num_experts`` is skipped like HF). Tokens are grouped per expert with one sort; gate and up are one fused
    matmul. The route (module doc) follows ``route_for``; ``grouped_min_rows_per_expert`` moves its threshold for
    this module.
    """

    def __init__(self, num_experts: int, hidden_dim: int, intermediate_dim: int, act_fn: nn.Module, *,
                 grouped_min_rows_per_expert: int = GROUPED_MIN_ROWS_PER_EXPERT) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        self.act_fn = act_fn
        self.grouped_min_rows_per_expert = grouped_min_rows_per_expert
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
        step = self.load_batch()
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
                kw = convert_batch(stacked, k_in, device, dtype, f"{where}.{key}")
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
        self._views = None
        self.layout = device.type
        return self

    def load_batch(self) -> int:
        """Experts read and converted together when loading (LOAD_BATCH_BYTES of packed weights)."""
        per_expert = 3 * self.hidden_dim * self.intermediate_dim // 2  # packed INT4 bytes of one expert
        return max(1, min(self.num_experts, LOAD_BATCH_BYTES // max(per_expert, 1),
                          LOAD_BATCH_EXPERTS or self.num_experts))

    def first_read_keys(self) -> list[str]:
        """The checkpoint keys (relative to the module) its load reads first: its first batch."""
        return _batch_keys(range(self.load_batch()), "")

    def unload_(self) -> None:
        """Drop the packed buffers (the module becomes an empty shell again)."""
        self.gate_up_packed = self.gate_up_scales_and_zeros = self.down_packed = self.down_scales_and_zeros = None
        self._views = None

    def packed_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """(the kernel-layout buffers, what else they need to run): what `load_packed_` takes back
        (orin.packed_cache keeps them so a later load skips the conversion)."""
        check_device(self.down_packed, self.layout, "Int4Experts")
        return ({b: getattr(self, b) for b in PACKED_BUFFERS},
                {"group_size": self.group_size, "geometry": {k: list(v) for k, v in self._geom.items()}})

    @torch.no_grad()
    def load_packed_(self, tensors: Mapping[str, torch.Tensor], meta: Mapping, device: torch.device | str,
                     name: str = "experts") -> Int4Experts:
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
        self._views = None
        self.layout = device.type
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
    ) -> Int4Experts:
        module = cls(num_experts, hidden_dim, intermediate_dim, act_fn)
        return module.load_gptq_(source, device, dtype, name=name, prefix=prefix)

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
        """The route forward takes for these rows, k experts each, when the caller names none."""
        if hidden_states.shape[0] * k < self.grouped_min_rows_per_expert * self.num_experts:
            return "tinygemm"
        return "triton" if self._triton_usable(hidden_states) else "grouped_mm"

    def fused(self, hidden_states: torch.Tensor, k: int) -> bool:
        """Whether forward takes the "triton" route for these rows, k experts each: the one without a host sync,
        which a CUDA graph can capture."""
        return self.route_for(hidden_states, k) == "triton"

    def _triton_usable(self, hidden_states: torch.Tensor) -> bool:
        return grouped_gemm.usable(hidden_states, self.gate_up_packed) and grouped_gemm.usable(
            hidden_states, self.down_packed)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *,
                route: str | None = None) -> torch.Tensor:
        """``route``: one of ``EXPERT_ROUTES`` to run that one (no fallback), else ``route_for``'s choice, which
        falls back from a failing Triton kernel to "grouped_mm" (the kernel is then off for the process)."""
        check_device(self.down_packed, self.layout, "Int4Experts")
        T, k = top_k_index.shape
        E = self.num_experts
        chosen = self.route_for(hidden_states, k) if route is None else route
        if chosen not in EXPERT_ROUTES:
            raise ValueError(f"unknown route {route!r} for Int4Experts: use one of {', '.join(EXPERT_ROUTES)}")
        if chosen == "triton":
            if route is not None and not self._triton_usable(hidden_states):
                raise ValueError("the triton route needs CUDA, Triton, weights packed with 4 inner k-tiles and a "
                                 "kernel not switched off (orin.int4pack.kernel_errors()); use another route")
            if T:
                try:
                    return self._forward_triton(hidden_states, top_k_index, top_k_weights)
                except Exception:  # noqa: BLE001 - the kernel's own failure (recorded, and it is now off) falls back
                    if route is not None or grouped_gemm.error is None:
                        raise
            chosen = "grouped_mm"
        final = torch.zeros_like(hidden_states)
        if T == 0:
            return final
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # indices >= num_experts sort last and are skipped
        counts_dev = torch.bincount(flat.clamp(max=E), minlength=E + 1)[:E]
        counts = counts_dev.tolist()  # the one host sync
        rows = sum(counts)
        if rows == 0:
            return final
        order = order[:rows]
        token = order // k
        x = self._rows(hidden_states, token)
        # Every expert's rows are a contiguous slice of the sorted batch, so padding, activation and joins run
        # once over all rows; only the matmuls are per expert (tinygemm) or per chunk of experts (grouped_mm).
        if chosen == "grouped_mm":
            ends = torch.cumsum(counts_dev, 0)
            gate_up = self._grouped(x, self.gate_up_packed, self.gate_up_scales_and_zeros, self._geom["gate_up"][0],
                                    counts, ends)
            h = self._act(gate_up)
            out = self._grouped(h, self.down_packed, self.down_scales_and_zeros, self._geom["down"][0], counts, ends)
        else:
            h = self._act(self._per_expert(x, 0, self._geom["gate_up"][0], counts))
            out = self._per_expert(h, 2, self._geom["down"][0], counts)
        weights = top_k_weights.reshape(-1)[order]
        return self._combine(final, out, weights, token)

    @torch.no_grad()
    def add_long(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 into: torch.Tensor, max_rows: int | None = None) -> torch.Tensor:
        """``into += forward(hidden_states, top_k_index, top_k_weights)`` for a long prompt's rows (thousands of
        tokens): experts dequantized whole, a piece of at most LONG_DEQUANT_CHUNK bytes at a time and each
        once (all of them at once where they fit in LONG_WHOLE_EXPERTS_BYTES), their rows through BF16 grouped
        GEMMs in blocks of at most `max_rows` (half that with all experts at once; the gathered rows' memory stays
        a block's, whatever the prompt's length). Over a 25k-token prompt this is the prefill's fastest route:
        per layer one dequantization of every expert (1.6 ms on an H200) and GEMMs at the BF16 rate, against the
        fused INT4 kernel's 18 ms (BENCHMARKS.md). Pieces need the experts' row counts on the host, one sync a
        layer; experts taken whole through torch._grouped_mm need none (`_add_long_on_device`)."""
        check_device(self.down_packed, self.layout, "Int4Experts")
        E = self.num_experts
        max_rows = max_rows or C.LONG_MOE_BLOCK_ROWS
        whole = self._dequantized_bytes(into.element_size()) <= LONG_WHOLE_EXPERTS_BYTES
        if whole:
            # the experts' extra bytes come out of the blocks' (orin.plan counts it so); without the host sync more
            # blocks leave the GPU no idler
            max_rows = max(1, max_rows // 2)
        if whole and top_k_index.numel() and _grouped_mm_works(into.device, self.compute_dtype):
            return self._add_long_on_device(hidden_states, top_k_index, top_k_weights, into, max_rows)
        k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # indices >= num_experts sort last and are skipped
        counts = torch.bincount(flat.clamp(max=E), minlength=E + 1)[:E]
        # launched before the sync, while the GPU is still busy: what needs no counts
        token = order // k
        weights = top_k_weights.reshape(-1)[order]
        inv = combine_rows.inverse(order)
        counts = counts.tolist()  # the one host sync
        per = E if whole else max(1, LONG_DEQUANT_CHUNK // self._dequantized_bytes(into.element_size(), 1))
        pieces = [(e0, min(E, e0 + per), list(_row_blocks(counts[e0:e0 + per], max_rows)))
                  for e0 in range(0, E, per) if sum(counts[e0:e0 + per])]
        # every block's group ends in one copy: a tensor made from a host list per block is a pageable copy,
        # which waits for the GPU to drain, so the host's launches stopped being ahead of it ~20 times a layer
        ends_all = _to_device([e for _, _, blocks in pieces for _, block in blocks
                               for e in itertools.accumulate(block)], into.device)
        start = at = 0
        for e0, e1, blocks in pieces:
            w_gu, w_dn = self._dequantized(e0, e1)
            for lo, block in blocks:
                rows = sum(block)
                ends = ends_all[at:at + len(block)]
                at += len(block)
                self._add_block(hidden_states, token, weights, inv, into, k, start, rows,
                                w_gu[lo:lo + len(block)], w_dn[lo:lo + len(block)], block, ends)
                start += rows
            del w_gu, w_dn
        return into

    def _add_long_on_device(self, hidden_states, top_k_index, top_k_weights, into, max_rows: int) -> torch.Tensor:
        """add_long with every expert dequantized at once and no host sync: blocks of `max_rows` consecutive
        sorted rows whatever experts they hold, each block's group ends computed on the GPU (an expert with no
        row in a block is an empty group). The host queues a whole prefill ahead of the GPU; with a sync a layer
        the GPU sat idle after each while the host launched the MoE and the next attention (BENCHMARKS.md, runs
        66v-67). Rows routed to indices >= num_experts sort last: counted with the last expert, computed, and
        weighted 0."""
        T, k = top_k_index.shape
        E = self.num_experts
        n = T * k
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        # scatter_add, not bincount: bincount on CUDA syncs to size its output
        counts = torch.zeros(E, dtype=torch.int32, device=flat.device)
        counts.scatter_add_(0, flat.clamp(max=E - 1), torch.ones_like(flat, dtype=torch.int32))
        ends = torch.cumsum(counts, 0, dtype=torch.int32)
        token = order // k
        weights = top_k_weights.reshape(-1)[order]
        weights = torch.where(flat[order] < E, weights, torch.zeros_like(weights))
        inv = combine_rows.inverse(order)
        starts = range(0, n, max_rows)
        # every block's group ends in one launch: [blocks, E]
        first = torch.arange(0, n, max_rows, dtype=torch.int32, device=into.device)
        offs = (ends.unsqueeze(0) - first.unsqueeze(1)).clamp_(min=0, max=max_rows)
        w_gu, w_dn = self._dequantized(0, E)
        for b, start in enumerate(starts):
            rows = min(max_rows, n - start)
            self._add_block(hidden_states, token, weights, inv, into, k, start, rows, w_gu, w_dn, None, offs[b])
        return into

    def _add_block(self, hidden_states, token, weights, inv, into, k: int, start: int, rows: int, w_gu, w_dn,
                   block: list[int] | None, ends: torch.Tensor) -> None:
        """into += the weighted expert outputs of sorted rows [start, start + rows): `block` the row counts of
        the experts w_gu/w_dn hold (None where torch._grouped_mm runs from `ends` alone)."""
        sl = slice(start, start + rows)
        # each intermediate dropped as soon as the next exists: a block's peak is its rows times (K + 2I), not the
        # sum of every intermediate
        fused = True if block is None else None
        gate_up = grouped_matmul(self._rows(hidden_states, token[sl]), w_gu, block, ends, fused)
        act = self._act(gate_up, fused=True)
        del gate_up
        out = grouped_matmul(act, w_dn, block, ends, fused)
        del act
        if not combine_rows(into, out, weights, inv, start, k):
            self._combine(into, out, weights[sl], token[sl])

    def _dequantized_bytes(self, element_size: int, experts: int | None = None) -> int:
        """Bytes of `experts` (all by default) experts' weights dequantized, as the packed shapes pad them."""
        one = (self.gate_up_scales_and_zeros.shape[-2] * self._geom["gate_up"][1]
               + self.down_scales_and_zeros.shape[-2] * self._geom["down"][1]) * element_size
        return one * (self.num_experts if experts is None else experts)

    def _dequantized(self, e0: int, e1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts [e0, e1)'s gate/up and down weights in the compute dtype."""
        return (dequantize_packed(self.gate_up_packed[e0:e1], self.gate_up_scales_and_zeros[e0:e1],
                                  self._geom["gate_up"][0]),
                dequantize_packed(self.down_packed[e0:e1], self.down_scales_and_zeros[e0:e1], self._geom["down"][0]))

    def _forward_triton(self, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        """One Triton launch per projection over all experts, group boundaries on the device (no host sync, so
        the host queues the next layers while this one runs)."""
        E, (T, k) = self.num_experts, top_k_index.shape
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        # counted by scatter_add: bincount on CUDA syncs with the host to size its output
        counts = torch.zeros(E + 1, dtype=torch.long, device=flat.device)
        counts.scatter_add_(0, flat.clamp(max=E), torch.ones_like(flat))
        ends = torch.cumsum(counts[:E], 0)
        token = order // k
        from .kernels import int4_gemm

        # activations handed over in the kernel's column order (int4_gemm.nibble_order)
        x = self._rows(hidden_states, token, int4_gemm.nibble_order(self.gate_up_packed))
        gate_up = grouped_gemm(x, self.gate_up_packed, self.gate_up_scales_and_zeros, self._geom["gate_up"][0],
                               ends, T)
        h = self._act(gate_up).index_select(1, int4_gemm.nibble_order(self.down_packed))
        out = grouped_gemm(h, self.down_packed, self.down_scales_and_zeros, self._geom["down"][0], ends, T)
        # Back to each token's k rows (a permutation: every row has one place), weighted and summed in one
        # reduction; index_add_'s atomics took 50 us a layer. Rows of out-of-range indices sorted last, beyond
        # ends[-1], and came back zero: they weigh 0 as well.
        H = self.hidden_dim
        dtype = hidden_states.dtype
        back = torch.empty((T * k, H), dtype=dtype, device=hidden_states.device)
        back.index_copy_(0, order, out[:, :H].to(dtype))
        weights = torch.where(flat < E, top_k_weights.reshape(-1), 0).to(dtype)
        return (back.view(T, k, H) * weights.view(T, k, 1)).sum(1)

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

    def _act(self, gate_up: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """silu(gate) * up, padded to the down projection's K; `fused`: as one Triton pass where it runs (a long
        prompt's blocks; elsewhere the torch ops keep the short prompts' bits)."""
        inter = self.intermediate_dim
        if fused and isinstance(self.act_fn, nn.SiLU):
            h = silu_mul_rows(gate_up, inter, max(inter, self._geom["down"][1]))
            if h is not None:
                return h
        h = self.act_fn(gate_up[:, :inter]) * gate_up[:, inter : 2 * inter]
        K_dn = self._geom["down"][1]
        return F.pad(h, (0, K_dn - inter)) if K_dn > inter else h

    def _combine(self, final: torch.Tensor, out: torch.Tensor, weights: torch.Tensor, token: torch.Tensor):
        """final[token[i]] += weights[i] * out[i, :H]; `out` is the caller's to overwrite."""
        out = out[:, : self.hidden_dim].to(final.dtype).mul_(weights[:, None].to(final.dtype))
        return final.index_add_(0, token, out)

    def _per_expert(self, x: torch.Tensor, which: int, kernel_group: int, counts: list[int]) -> torch.Tensor:
        """tinygemm, one launch per expert that got rows."""
        views = self._expert_views()
        packed, sz = views[which], views[which + 1]
        outs, start = [], 0
        for e, c in enumerate(counts):
            if c:
                outs.append(int4_mm(x[start : start + c], packed[e], kernel_group, sz[e]))
                start += c
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _grouped(self, x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, kernel_group: int,
                 counts: list[int], ends: torch.Tensor) -> torch.Tensor:
        """All experts' rows in a few grouped GEMMs: experts dequantized a chunk at a time (bounded transient),
        each chunk's token groups one ``torch._grouped_mm``."""
        E = self.num_experts
        N_pad = scales_and_zeros.shape[-2]
        per = max(1, PREFILL_DEQUANT_CHUNK // (N_pad * x.shape[1] * x.element_size()))
        out = x.new_empty((x.shape[0], N_pad))
        start = 0
        for e0 in range(0, E, per):
            e1 = min(E, e0 + per)
            rows = sum(counts[e0:e1])
            if not rows:
                continue
            w = dequantize_packed(packed[e0:e1], scales_and_zeros[e0:e1], kernel_group)
            out[start : start + rows] = grouped_matmul(x[start : start + rows], w, counts[e0:e1], ends[e0:e1] - start)
            start += rows
        return out

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, intermediate_dim={self.intermediate_dim}, "
            f"group_size={self.group_size}, loaded={self.is_loaded}, layout={self.layout}"
        )


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """An int32 tensor of `values` on `device`, without the host waiting for the GPU (pinned, asynchronous)."""
    host = torch.tensor(values, dtype=torch.int32)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _row_blocks(counts: list[int], max_rows: int):
    """Blocks of at most `max_rows` rows over consecutive experts' rows, in order: (first expert, row counts of
    that expert and the ones after it). An expert whose rows overflow a block continues at the next one's start."""
    block, lo, room = [], 0, max_rows
    for e, c in enumerate(counts):
        if not c:
            if block:
                block.append(0)  # keeps the block's experts consecutive
            continue
        while c:
            if not block:
                lo = e
            take = min(c, room)
            block.append(take)
            c -= take
            room -= take
            if not room:
                yield lo, block
                block, room = [], max_rows
    if block:
        yield lo, block


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: list[int], ends: torch.Tensor,
                   fused: bool | None = None) -> torch.Tensor:
    """x [rows, K] (each expert's rows contiguous, `counts` of them, ending at `ends`) times each expert's w [E, N, K]
    transposed -> [rows, N]: one ``torch._grouped_mm`` where this torch has one for the device and dtype (2.8 has
    it for CUDA sm90 only, 2.6 and 2.7 not at all), else one matmul per expert. `fused` forces one or the other."""
    if fused is None:
        fused = _grouped_mm_works(x.device, x.dtype)
    if fused:
        return torch._grouped_mm(x, w.transpose(1, 2), offs=ends.to(torch.int32))
    out = x.new_empty((x.shape[0], w.shape[1]))
    start = 0
    for e, c in enumerate(counts):
        if c:
            out[start : start + c] = x[start : start + c] @ w[e].t()
            start += c
    return out


_GROUPED_MM: dict = {}


def _grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs here: tried once per device and dtype on a tiny problem."""
    key = (device.type, device.index, dtype)
    if key not in _GROUPED_MM:
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            try:
                a = torch.zeros((16, 16), device=device, dtype=dtype)
                b = torch.zeros((2, 16, 16), device=device, dtype=dtype)
                torch._grouped_mm(a, b, offs=torch.tensor([8, 16], device=device, dtype=torch.int32))
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        _GROUPED_MM[key] = ok
    return _GROUPED_MM[key]


__all__ = ["EXPERT_PROJS", "EXPERT_ROUTES", "GROUPED_MIN_ROWS_PER_EXPERT", "Int4Experts", "grouped_matmul"]
