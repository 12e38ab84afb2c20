"""The MoE's named backends: how a layer's INT4 experts (orin.int4.experts.Int4Experts) run, chosen once per layer
when the experts are loaded (`choose_backend`: a pure function of the device profile and the packed shapes),
never per call. Each has `prefill` (a prompt through the experts module: Int4Experts.forward) and `add_long` (a
long prompt's rows, each expert dequantized once a layer); the CUDA ones `decode` too (a step's few tokens on the
stacked buffers, inside a CUDA graph).

- ``cpu``: the CPU's int4pack layout. The experts module computes decode and prompt alike (no CUDA graph to keep a
  host sync out of): tinygemm per chosen expert below `grouped_min_rows_per_expert` rows an expert, else experts
  dequantized a chunk at a time and each chunk's rows one grouped GEMM.
- ``torch``: CUDA without orin's Triton kernels. Decode gathers the chosen experts' packed tiles on the device and
  runs them as two tinygemm calls: torch's CUDA int4pack layout is tile-local ([N/8, K/(16*tiles), 32,
  tiles/2]), so concatenating packed tiles is packing the concatenated matrix; gate/up of all k concatenated
  along N (one input), down along K with each expert's routing weight applied to its input first, so the kernel
  sums the experts. Prompts as on the CPU.
- ``triton``: CUDA where orin's Triton kernels passed their start-up check (orin.kernels.check). Decode reads the
  chosen experts' tiles where they lie (orin.kernels.int4_gemm's GEMV: no gather of 19 MB a layer) after one
  softmax/top-k kernel; a prompt runs one grouped INT4 GEMM launch per projection over all experts, the group
  boundaries on the device (no host sync: a CUDA graph captures it), where the packed shapes suit it; a long
  prompt's dequantization, activation and combine are Triton kernels too.

A long prompt dequantizes every expert once a layer and runs its rows through BF16 grouped GEMMs in blocks: at
tens of thousands of rows that beats the fused INT4 kernel by an order of magnitude (docs/architecture.md).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..device.profile import DeviceProfile
from ..model.text import topk_routing
from .pack import dequantize_packed, int4_mm


def triton_runs(profile: DeviceProfile, device: torch.device,
                check: Callable[[torch.device], bool] | None = None) -> bool:
    """Whether orin's Triton kernels run for tensors on `device`: CUDA, the profile's Triton capability, and the
    kernels' start-up check passed there (`check`, default orin.kernels.check.passes: once per device)."""
    if device.type != "cuda" or not profile.capabilities.triton:
        return False
    if check is None:
        from ..kernels.check import passes as check
    return check(device)


def choose_backend(profile: DeviceProfile, device: torch.device, packed: tuple[torch.Tensor, ...] = (),
                   check: Callable[[torch.device], bool] | None = None) -> MoeBackend:
    """The backend of INT4 experts on `device` run by `profile`; `packed`: their packed weights (gate/up, down),
    whose shapes say whether the Triton grouped GEMM takes them (4 inner k-tile pairs); `check` as triton_runs'."""
    if device.type != "cuda":
        return _backend(CpuBackend, profile)
    if not triton_runs(profile, device, check):
        return _backend(TorchBackend, profile)
    grouped = True
    if packed:
        from ..kernels import int4_gemm

        grouped = all(int4_gemm.supports(p) for p in packed)
    return _backend(TritonBackend, profile, grouped)


@functools.cache
def _backend(cls, profile: DeviceProfile, *args) -> MoeBackend:
    """One instance per kind and profile, shared by every layer: a compiled layer function sees one object."""
    return cls(profile, *args)


class MoeBackend:
    """What the backends share: torch ops throughout, each part a method a backend replaces where it runs
    otherwise. `name` is what the engine's stats show."""

    name = ""
    graph_decode = False  # decode on the device with no host sync (a CUDA graph holds it), else the module's
    triton = False  # orin's Triton kernels run: the dequantizer here, and the layer's query/key norm and rotary

    def __init__(self, profile: DeviceProfile) -> None:
        self.tuning = profile.moe
        self.long_block_rows = profile.prefill.long_moe_block_rows
        self.grouped_mm = profile.capabilities.grouped_mm  # torch._grouped_mm runs (else one matmul an expert)

    def __repr__(self) -> str:
        return f"<{self.name} MoE backend>"

    def route(self, logits: torch.Tensor, top_k: int, norm_topk: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """HF's top-k router: softmax in float32, top-k, renormalised, in the logits' dtype -> (weights, ids)."""
        return topk_routing(logits, top_k, norm_topk)

    def dequantize(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor, kernel_group: int) -> torch.Tensor:
        return dequantize_packed(packed, scales_and_zeros, kernel_group, self.triton)

    # ------------------------------------------------------------------ a prompt (Int4Experts.forward)

    def prefill_route(self, experts, rows: int, k: int) -> str:
        """How `prefill` runs `rows` tokens of k experts each: "tinygemm" (one launch per chosen expert, after a
        host sync for the row counts: a few rows), "triton" (one grouped INT4 GEMM a projection, no host sync) or
        "grouped_mm" (experts dequantized a chunk at a time, each chunk's rows one grouped GEMM)."""
        if rows * k < self.tuning.grouped_min_rows_per_expert * experts.num_experts:
            return "tinygemm"
        return "grouped_mm"

    def prefill(self, experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """Int4Experts.forward: the chosen experts of T tokens [T, H], weighted and summed."""
        T, k = top_k_index.shape
        E = experts.num_experts
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
        x = experts._rows(hidden_states, token)
        # Every expert's rows are a contiguous slice of the sorted batch, so padding, activation and joins run
        # once over all rows; only the matmuls are per expert (tinygemm) or per chunk of experts (grouped_mm).
        geom = experts._geom
        if self.prefill_route(experts, T, k) == "tinygemm":
            h = experts._act(self._per_expert(experts, x, 0, geom["gate_up"][0], counts))
            out = self._per_expert(experts, h, 2, geom["down"][0], counts)
        else:
            ends = torch.cumsum(counts_dev, 0)
            gate_up = self._grouped(experts, x, experts.gate_up_packed, experts.gate_up_scales_and_zeros,
                                    geom["gate_up"][0], counts, ends)
            h = experts._act(gate_up)
            out = self._grouped(experts, h, experts.down_packed, experts.down_scales_and_zeros, geom["down"][0],
                                counts, ends)
        weights = top_k_weights.reshape(-1)[order]
        return experts._combine(final, out, weights, token)

    def _per_expert(self, experts, x: torch.Tensor, which: int, kernel_group: int, counts: list[int]):
        """tinygemm, one launch per expert that got rows."""
        views = experts._expert_views()
        packed, sz = views[which], views[which + 1]
        outs, start = [], 0
        for e, c in enumerate(counts):
            if c:
                outs.append(int4_mm(x[start : start + c], packed[e], kernel_group, sz[e]))
                start += c
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _grouped(self, experts, x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                 kernel_group: int, counts: list[int], ends: torch.Tensor) -> torch.Tensor:
        """All experts' rows in a few grouped GEMMs: experts dequantized a chunk of at most
        `prefill_dequant_chunk` bytes at a time (a bounded transient), each chunk's token groups one GEMM."""
        E = experts.num_experts
        N_pad = scales_and_zeros.shape[-2]
        per = max(1, self.tuning.prefill_dequant_chunk // (N_pad * x.shape[1] * x.element_size()))
        out = x.new_empty((x.shape[0], N_pad))
        start = 0
        for e0 in range(0, E, per):
            e1 = min(E, e0 + per)
            rows = sum(counts[e0:e1])
            if not rows:
                continue
            w = self.dequantize(packed[e0:e1], scales_and_zeros[e0:e1], kernel_group)
            out[start : start + rows] = grouped_matmul(x[start : start + rows], w, counts[e0:e1],
                                                       ends[e0:e1] - start, self.grouped_mm)
            start += rows
        return out

    # ------------------------------------------------------------------ a long prompt (Int4Experts.add_long)

    def add_long(self, experts, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor, into: torch.Tensor, max_rows: int | None = None) -> torch.Tensor:
        """``into += prefill(...)`` for a long prompt's rows (thousands of tokens): experts dequantized a piece of
        at most `long_dequant_chunk` bytes at a time and each once (all at once where they fit in
        `long_whole_experts_bytes`), their rows through BF16 grouped GEMMs in blocks of at most `max_rows`
        (default the profile's long_moe_block_rows; half that with all experts at once), so the gathered rows'
        memory stays a block's whatever the prompt's length. Pieces need the experts' row counts on the host, one
        sync a layer; experts taken whole through torch._grouped_mm need none (`_add_long_on_device`)."""
        E = experts.num_experts
        max_rows = max_rows or self.long_block_rows
        whole = experts._dequantized_bytes(into.element_size()) <= self.tuning.long_whole_experts_bytes
        if whole:
            # the experts' extra bytes come out of the blocks' (the plan counts it so); without the host sync more
            # blocks leave the GPU no idler
            max_rows = max(1, max_rows // 2)
        if whole and top_k_index.numel() and self.grouped_mm:
            return self._add_long_on_device(experts, hidden_states, top_k_index, top_k_weights, into, max_rows)
        k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # indices >= num_experts sort last and are skipped
        counts = torch.bincount(flat.clamp(max=E), minlength=E + 1)[:E]
        # launched before the sync, while the GPU is still busy: what needs no counts
        token = order // k
        weights = top_k_weights.reshape(-1)[order]
        inv = self._inverse(order)
        counts = counts.tolist()  # the one host sync
        per = E if whole else max(1, self.tuning.long_dequant_chunk // experts._dequantized_bytes(
            into.element_size(), 1))
        pieces = [(e0, min(E, e0 + per), list(_row_blocks(counts[e0:e0 + per], max_rows)))
                  for e0 in range(0, E, per) if sum(counts[e0:e0 + per])]
        # every block's group ends in one copy: a tensor made from a host list per block is a pageable copy,
        # which waits for the GPU to drain, so the host's launches would stop being ahead of it
        ends_all = _to_device([e for _, _, blocks in pieces for _, block in blocks
                               for e in itertools.accumulate(block)], into.device)
        start = at = 0
        for e0, e1, blocks in pieces:
            w_gu, w_dn = self._dequantized(experts, e0, e1)
            for lo, block in blocks:
                rows = sum(block)
                ends = ends_all[at:at + len(block)]
                at += len(block)
                self._add_block(experts, hidden_states, token, weights, inv, into, k, start, rows,
                                w_gu[lo:lo + len(block)], w_dn[lo:lo + len(block)], block, ends)
                start += rows
            del w_gu, w_dn
        return into

    def _add_long_on_device(self, experts, hidden_states, top_k_index, top_k_weights, into,
                            max_rows: int) -> torch.Tensor:
        """add_long with every expert dequantized at once and no host sync: blocks of `max_rows` consecutive
        sorted rows whatever experts they hold, each block's group ends computed on the GPU (an expert with no
        row in a block is an empty group). The host queues a whole prefill ahead of the GPU, where a sync a layer
        left the GPU idle while the host launched the MoE and the next attention. Rows routed to indices >=
        num_experts sort last: counted with the last expert, computed, and weighted 0."""
        T, k = top_k_index.shape
        E = experts.num_experts
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
        inv = self._inverse(order)
        starts = range(0, n, max_rows)
        # every block's group ends in one launch: [blocks, E]
        first = torch.arange(0, n, max_rows, dtype=torch.int32, device=into.device)
        offs = (ends.unsqueeze(0) - first.unsqueeze(1)).clamp_(min=0, max=max_rows)
        w_gu, w_dn = self._dequantized(experts, 0, E)
        for b, start in enumerate(starts):
            rows = min(max_rows, n - start)
            self._add_block(experts, hidden_states, token, weights, inv, into, k, start, rows, w_gu, w_dn, None,
                            offs[b])
        return into

    def _add_block(self, experts, hidden_states, token, weights, inv, into, k: int, start: int, rows: int, w_gu,
                   w_dn, block: list[int] | None, ends: torch.Tensor) -> None:
        """into += the weighted expert outputs of sorted rows [start, start + rows): `block` the row counts of
        the experts w_gu/w_dn hold (None where torch._grouped_mm runs from `ends` alone)."""
        sl = slice(start, start + rows)
        # each intermediate dropped as soon as the next exists: a block's peak is its rows times (K + 2I), not the
        # sum of every intermediate
        fused = True if block is None else self.grouped_mm
        gate_up = grouped_matmul(experts._rows(hidden_states, token[sl]), w_gu, block, ends, fused)
        act = self._act_long(experts, gate_up)
        del gate_up
        out = grouped_matmul(act, w_dn, block, ends, fused)
        del act
        self._combine_block(experts, into, out, weights, inv, start, k, token[sl])

    def _dequantized(self, experts, e0: int, e1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts [e0, e1)'s gate/up and down weights in the compute dtype."""
        return (self.dequantize(experts.gate_up_packed[e0:e1], experts.gate_up_scales_and_zeros[e0:e1],
                                experts._geom["gate_up"][0]),
                self.dequantize(experts.down_packed[e0:e1], experts.down_scales_and_zeros[e0:e1],
                                experts._geom["down"][0]))

    def _act_long(self, experts, gate_up: torch.Tensor) -> torch.Tensor:
        """A long prompt's block activation: silu(gate) * up, padded to the down projection's K."""
        return experts._act(gate_up)

    def _inverse(self, order: torch.Tensor) -> torch.Tensor | None:
        """What `_combine_block` looks rows up by (None: nothing)."""
        return None

    def _combine_block(self, experts, into, out, weights, inv, start: int, k: int, token) -> None:
        """into[token[i]] += weights[start + i] * out[i]: index_add_'s atomics."""
        experts._combine(into, out, weights[start:start + out.shape[0]], token)


class CpuBackend(MoeBackend):
    """The CPU's: the experts module computes every MoE (see the module doc)."""

    name = "cpu"


class TorchBackend(MoeBackend):
    """CUDA without orin's Triton kernels: decode gathers the chosen experts' tiles (see the module doc)."""

    name = "torch"
    graph_decode = True

    def decode(self, h: torch.Tensor, spec, experts: tuple, top_w: torch.Tensor, top_i: torch.Tensor):
        """The chosen INT4 experts of a step's T tokens, weighted and summed, no host sync. `spec`: the layer's
        (orin.runtime.layer.LayerSpec: hidden, inter, top_k and the packed geometry); `experts`: the stacked
        (gate/up, its scales and zeros, down, its scales and zeros)."""
        T = h.shape[0]
        kg_gu, K_gu, Np_gu = spec.gate_up
        kg_dn, K_dn, Np_dn = spec.down
        H, inter, k = spec.hidden, spec.inter, spec.top_k
        gu_all, gu_sz_all, dn_all, dn_sz_all = experts
        x = h.to(gu_sz_all.dtype)
        if K_gu > H:
            x = F.pad(x, (0, K_gu - H))
        outs = []
        for t in range(T):
            sel = top_i[t]
            gu = self._decode_gate_up(x[t:t + 1].contiguous(), sel, gu_all, gu_sz_all, kg_gu, Np_gu, k)
            act = F.silu(gu[:, :inter]) * gu[:, inter:2 * inter]
            act = act * top_w[t].reshape(k, 1).to(act.dtype)
            if K_dn > inter:
                act = F.pad(act, (0, K_dn - inter))
            out = self._decode_down(act, sel, dn_all, dn_sz_all, kg_dn, K_dn, Np_dn, k)
            outs.append(out[:, :H])
        return (torch.cat(outs) if T > 1 else outs[0]).to(h.dtype)

    def _decode_gate_up(self, xt, sel, gu_all, gu_sz_all, kg: int, Np: int, k: int) -> torch.Tensor:
        """[k, Np]: the chosen experts' gate/up of one row, their tiles gathered into one matrix."""
        gu_w = gu_all.index_select(0, sel)
        gu_w = gu_w.reshape(k * gu_w.shape[1], *gu_w.shape[2:])
        gu_sz = gu_sz_all.transpose(0, 1).index_select(1, sel)
        gu_sz = gu_sz.reshape(gu_sz.shape[0], k * Np, 2)
        return int4_mm(xt, gu_w, kg, gu_sz).view(k, Np)

    def _decode_down(self, act, sel, dn_all, dn_sz_all, kg: int, K: int, Np: int, k: int) -> torch.Tensor:
        """[1, Np]: the chosen experts' down projections of their (weighted) rows act [k, K], summed."""
        dn_w = dn_all.transpose(0, 1).index_select(1, sel)
        dn_w = dn_w.reshape(dn_w.shape[0], k * dn_w.shape[2], *dn_w.shape[3:])
        dn_sz = dn_sz_all.index_select(0, sel)
        dn_sz = dn_sz.reshape(k * dn_sz.shape[1], Np, 2)
        return int4_mm(act.reshape(1, k * K).contiguous(), dn_w, kg, dn_sz)


class TritonBackend(TorchBackend):
    """CUDA with orin's Triton kernels (see the module doc); `grouped_gemm`: the packed shapes suit the grouped
    INT4 GEMM (else a prompt's experts are dequantized, as on the torch backend, by the Triton dequantizer)."""

    name = "triton"
    triton = True

    def __init__(self, profile: DeviceProfile, grouped_gemm: bool = True) -> None:
        super().__init__(profile)
        self.grouped_gemm = grouped_gemm
        from ..kernels import int4_gemm, router  # noqa: F401 - registers torch.ops.orin's GEMV and softmax_topk

    def route(self, logits, top_k: int, norm_topk: bool):
        top_w, top_i = torch.ops.orin.softmax_topk(logits, top_k)  # one kernel for softmax and top-k
        if norm_topk:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return top_w.to(logits.dtype), top_i

    def _decode_gate_up(self, xt, sel, gu_all, gu_sz_all, kg: int, Np: int, k: int) -> torch.Tensor:
        return torch.ops.orin.int4_moe_gemv(xt, gu_all, gu_sz_all, sel, kg).sum(0).to(xt.dtype)

    def _decode_down(self, act, sel, dn_all, dn_sz_all, kg: int, K: int, Np: int, k: int) -> torch.Tensor:
        return torch.ops.orin.int4_moe_gemv(act, dn_all, dn_sz_all, sel, kg).sum((0, 1)).unsqueeze(0)

    def prefill_route(self, experts, rows: int, k: int) -> str:
        route = super().prefill_route(experts, rows, k)
        return "triton" if route == "grouped_mm" and self.grouped_gemm else route

    def prefill(self, experts, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        T, k = top_k_index.shape
        if T and self.prefill_route(experts, T, k) == "triton":
            return self._prefill_grouped_int4(experts, hidden_states, top_k_index, top_k_weights)
        return super().prefill(experts, hidden_states, top_k_index, top_k_weights)

    def _prefill_grouped_int4(self, experts, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
        """One Triton launch per projection over all experts, group boundaries on the device (no host sync, so
        the host queues the next layers while this one runs)."""
        from ..kernels import int4_gemm

        E, (T, k) = experts.num_experts, top_k_index.shape
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        # counted by scatter_add: bincount on CUDA syncs with the host to size its output
        counts = torch.zeros(E + 1, dtype=torch.long, device=flat.device)
        counts.scatter_add_(0, flat.clamp(max=E), torch.ones_like(flat))
        ends = torch.cumsum(counts[:E], 0)
        token = order // k
        geom = experts._geom
        # activations handed over in the kernel's column order (int4_gemm.nibble_order)
        x = experts._rows(hidden_states, token, int4_gemm.nibble_order(experts.gate_up_packed))
        gate_up = int4_gemm.grouped_int4_mm(x, experts.gate_up_packed, experts.gate_up_scales_and_zeros,
                                            geom["gate_up"][0], ends, T, x_ordered=True)
        h = experts._act(gate_up).index_select(1, int4_gemm.nibble_order(experts.down_packed))
        out = int4_gemm.grouped_int4_mm(h, experts.down_packed, experts.down_scales_and_zeros, geom["down"][0],
                                        ends, T, x_ordered=True)
        # Back to each token's k rows (a permutation: every row has one place), weighted and summed in one
        # reduction, where index_add_'s atomics cost more. Rows of out-of-range indices sorted last, beyond
        # ends[-1], and came back zero: they weigh 0 as well.
        H = experts.hidden_dim
        dtype = hidden_states.dtype
        back = torch.empty((T * k, H), dtype=dtype, device=hidden_states.device)
        back.index_copy_(0, order, out[:, :H].to(dtype))
        weights = torch.where(flat < E, top_k_weights.reshape(-1), 0).to(dtype)
        return (back.view(T, k, H) * weights.view(T, k, 1)).sum(1)

    def _act_long(self, experts, gate_up: torch.Tensor) -> torch.Tensor:
        """One Triton pass (orin.kernels.silu_mul) for SiLU experts; the torch ops keep other activations."""
        if isinstance(experts.act_fn, nn.SiLU) and gate_up.stride(1) == 1:
            from ..kernels import silu_mul

            inter = experts.intermediate_dim
            return silu_mul.silu_mul(gate_up, inter, max(inter, experts._geom["down"][1]))
        return experts._act(gate_up)

    def _inverse(self, order: torch.Tensor) -> torch.Tensor:
        """Where each (token, choice) landed in the expert sort `order`: what the combine kernel reads rows by."""
        inv = torch.empty_like(order)
        inv[order] = torch.arange(order.numel(), device=order.device)
        return inv

    def _combine_block(self, experts, into, out, weights, inv, start: int, k: int, token) -> None:
        """One Triton kernel (orin.kernels.moe_combine): each token's rows in the block summed once, no atomics."""
        from ..kernels import moe_combine

        moe_combine.combine_block(into, out, weights, inv, start, k)


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


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, counts: list[int] | None, ends: torch.Tensor,
                   fused: bool) -> torch.Tensor:
    """x [rows, K] (each expert's rows contiguous, `counts` of them, ending at `ends`) times each expert's w [E, N, K]
    transposed -> [rows, N]: one ``torch._grouped_mm`` where `fused` (the profile's grouped_mm capability: torch 2.8
    has it for CUDA sm90 only, 2.6 and 2.7 not at all), else one matmul per expert."""
    if fused:
        return torch._grouped_mm(x, w.transpose(1, 2), offs=ends.to(torch.int32))
    out = x.new_empty((x.shape[0], w.shape[1]))
    start = 0
    for e, c in enumerate(counts):
        if c:
            out[start : start + c] = x[start : start + c] @ w[e].t()
            start += c
    return out


__all__ = ["CpuBackend", "MoeBackend", "TorchBackend", "TritonBackend", "choose_backend", "grouped_matmul",
           "triton_runs"]
