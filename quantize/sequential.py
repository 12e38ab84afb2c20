"""GPTQ through one decoder stack, one layer at a time (true-sequential, as TGI and GPTQModel do): layer i's
stages are quantized in forward order, each calibrated on inputs computed through the already-quantized
modules before it, and layer i+1 is calibrated on layer i's quantized output. Errors therefore do not pile up
unseen: every module compensates for the quantization upstream of it.

Quantized weights are written back into the live model as their exact dequantized values (what the device
computes), so later stages and layers see them; the GPTQ v1 tensors are kept for the checkpoint.

Experts: each routed expert of a fused experts module gets its own Hessian from the calibration tokens the
router (running on the quantized upstream) sends to it. An expert with fewer than `min_expert_tokens` tokens
is "starved": by default it is calibrated on every token of the layer ("all-tokens": the inputs it would see
if the router picked it, rather than a rank-deficient Hessian of a handful of tokens), or with
starved="rtn" it is rounded to nearest. The report lists each starved expert with its token count.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from orin.layout import Target

from . import adapters as A
from .capture import Call, StackData, StageInputs, capture_stage, forward_layer
from .gptq import ErrorSums, GPTQSolver, QuantResult, output_error, rtn

STARVED_POLICIES = ("all-tokens", "rtn")


@dataclass(frozen=True)
class StackOptions:
    bits: int = 4
    group_size: int = 128
    min_expert_tokens: int = 64
    starved: str = "all-tokens"
    sym: bool = True


@dataclass
class TypeStats:
    """Pooled held-out output errors of every module of one layer type."""

    gptq: ErrorSums = field(default_factory=ErrorSums)
    rtn: ErrorSums = field(default_factory=ErrorSums)
    rtn_other: ErrorSums = field(default_factory=ErrorSums)  # RTN with the other symmetry: the choice, measured
    modules: int = 0
    rtn_modules: int = 0  # quantized by RTN (starved experts with starved="rtn", or no calibration rows)
    calib_rows: int = 0

    def to_json(self) -> dict:
        return {"gptq_error": self.gptq.relative, "rtn_error": self.rtn.relative,
                "rtn_other_sym_error": self.rtn_other.relative, "modules": self.modules,
                "rtn_modules": self.rtn_modules, "calib_rows": self.calib_rows, "heldout_rows": self.gptq.rows}


@dataclass
class StackResult:
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # checkpoint key -> GPTQ v1 tensor (CPU)
    quantized: list[str] = field(default_factory=list)  # target paths
    types: dict[str, TypeStats] = field(default_factory=dict)
    starved: list[dict] = field(default_factory=list)

    def stats(self, layer_type: str) -> TypeStats:
        return self.types.setdefault(layer_type, TypeStats())


class StackQuantizer:
    def __init__(self, model, stack: A.StackSpec, solver: GPTQSolver, opts: StackOptions, progress):
        self.model = model
        self.stack = stack
        self.solver = solver
        self.opts = opts
        self.progress = progress
        self.result = StackResult()

    # ------------------------------------------------------------------ the stack

    @torch.no_grad()
    def run(self, by_layer: dict[int, list[Target]], tail: list[Target], data: StackData, desc: str) -> StackResult:
        layers = self.model.get_submodule(self.stack.layers)
        last = len(layers) - 1 if tail else max(by_layer, default=-1)
        calib, heldout = list(data.calib), list(data.heldout)
        with self.progress.bar(last + 1, desc) as bar:
            for i in range(last + 1):
                layer = layers[i]
                stages = A.layer_stages(self.stack, i, by_layer.get(i, []))
                with self.progress.bar(sum(self._units(layer, s) for s in stages), f"layer {i}", leave=False) as inner:
                    for stage in stages:
                        seen = capture_stage(layer, calib, stage)
                        seen_heldout = capture_stage(layer, heldout, stage)
                        self._stage(layer, stage, seen, seen_heldout, inner)
                if i < last or tail:
                    calib = self._next(layer, i, calib)
                    heldout = self._next(layer, i, heldout)
                bar.update(1)
        if tail:
            norm = self.model.get_submodule(self.stack.final_norm)
            for t in tail:
                module = self.model.get_submodule(t.path)
                x = [norm(c.hidden).reshape(-1, t.in_features) for c in calib]
                xh = [norm(c.hidden).reshape(-1, t.in_features) for c in heldout]
                self._linear(module, t, f"{self.stack.label}.lm_head", x, xh, task=None)
        return self.result

    def _next(self, layer, index: int, calls: list[Call]) -> list[Call]:
        outs = forward_layer(layer, calls)
        return [c.with_hidden(A.after_layer(self.model, self.stack, index, h, c.extra)) for c, h in zip(calls, outs, strict=True)]

    @staticmethod
    def _units(layer, stage: list[A.Member]) -> int:
        return sum(layer.get_submodule(m.name).gate_up_proj.shape[0] if m.kind != "linear" else 1 for m in stage)

    # ------------------------------------------------------------------ one stage

    def _stage(self, layer, stage: list[A.Member], seen: StageInputs, seen_heldout: StageInputs, bar) -> None:
        # Members fed the very same tensor (q/k/v, gate/up) share one Hessian: the first adds the batches, the
        # others copy it before anything is solved.
        tasks: dict[str, object] = {}
        leaders: dict[tuple, str] = {}
        for m in stage:
            if m.kind != "linear":
                continue
            task = self.solver.task(layer.get_submodule(m.name).weight)
            leader = leaders.setdefault(seen.source[m.name], m.name) if m.name in seen.source else m.name
            if leader != m.name:
                task.adopt(tasks[leader])
            else:
                for x in seen.inputs[m.name]:
                    task.add(x)
            tasks[m.name] = task
        for m in stage:
            module = layer.get_submodule(m.name)
            if m.kind == "linear":
                self._linear(module, m.target, A.layer_type(self.stack.label, m.name), seen.inputs[m.name],
                             seen_heldout.inputs[m.name], task=tasks[m.name])
                bar.update(1)
            else:
                A.check_experts(module, m.path)
                self._experts(module, m, seen.inputs[m.name], seen_heldout.inputs[m.name], bar)

    def _linear(self, module, target: Target, layer_type: str, x: list, xh: list, task) -> None:
        """Solve a Linear whose Hessian `task` holds (or accumulate one from x), record, write back, store."""
        weight = module.weight.detach().float()
        if task is None:
            task = self.solver.task(weight)
            for part in x:
                task.add(part)
        rows = sum(p.shape[0] for p in x)
        result = task.solve() if task.nsamples else rtn(weight, self.opts.bits, self.opts.group_size, self.opts.sym)
        self._record(layer_type, weight, result, torch.cat(xh) if xh else None, rows)
        module.weight.data.copy_(result.dequantize().to(module.weight.dtype))
        bias = module.bias.detach() if module.bias is not None else None
        self._store(target.path, result, bias)
        self.result.quantized.append(target.path)

    # ------------------------------------------------------------------ fused experts

    @staticmethod
    def _routed(calls: list) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """All tokens an experts module saw over the calls, with the experts each was routed to."""
        if not calls:
            return None, None
        return torch.cat([h for h, _ in calls]), torch.cat([i for _, i in calls])

    def _experts(self, module, m: A.Member, calls: list, calls_heldout: list, bar) -> None:
        x_all, index = self._routed(calls)
        xh_all, index_h = self._routed(calls_heldout)
        holder = None  # the all-tokens Hessian of this layer, shared by its starved experts
        if m.kind == "experts_gate_up":
            self.result.quantized.append(m.path)
        for e in range(module.gate_up_proj.shape[0]):
            count = int((index == e).any(-1).sum()) if index is not None else 0
            starved = count < self.opts.min_expert_tokens
            use_gptq = x_all is not None and (not starved or self.opts.starved == "all-tokens")
            # Tokens routed to the expert, or every token of the layer for a starved expert calibrated on all.
            x = (x_all if starved else x_all[(index == e).any(-1)]) if use_gptq else None
            xh = xh_all[(index_h == e).any(-1)] if xh_all is not None else None
            if m.kind == "experts_gate_up":
                if starved:
                    self.result.starved.append({
                        "module": m.path, "expert": e, "tokens": count,
                        "handled": "GPTQ on all calibration tokens of the layer" if use_gptq else "RTN"})
                if use_gptq and starved and holder is None:
                    holder = self.solver.task(A.expert_weight(module, e, "gate_proj"))
                    holder.add(x_all)
                self._expert_gate_up(module, m, e, x, xh, holder if starved else None)
            else:
                self._expert_down(module, m, e, x, xh)
            bar.update(1)

    def _expert_gate_up(self, module, m: A.Member, e: int, x, xh, shared) -> None:
        """gate_proj and up_proj of expert e: one Hessian (they read the same tokens), from x or from `shared`."""
        gate_w = A.expert_weight(module, e, "gate_proj").float()
        up_w = A.expert_weight(module, e, "up_proj").float()
        if x is not None and x.shape[0]:
            gate_task = self.solver.task(gate_w)
            if shared is not None:
                gate_task.adopt(shared)
            else:
                gate_task.add(x)
            up_task = self.solver.task(up_w)
            up_task.adopt(gate_task)
            results = gate_task.solve(), up_task.solve()
        else:
            results = (rtn(gate_w, self.opts.bits, self.opts.group_size, self.opts.sym),
                       rtn(up_w, self.opts.bits, self.opts.group_size, self.opts.sym))
        rows = x.shape[0] if x is not None else 0
        for proj, w, r in (("gate_proj", gate_w, results[0]), ("up_proj", up_w, results[1])):
            self._record(A.layer_type(self.stack.label, m.name, proj), w, r, xh, rows)
            A.set_expert_weight(module, e, proj, r.dequantize())
            self._store(f"{m.path}.{e}.{proj}", r, None)

    def _expert_down(self, module, m: A.Member, e: int, x, xh) -> None:
        """down_proj of expert e, calibrated on what its (already quantized) gate and up produce for x."""
        gate_q = A.expert_weight(module, e, "gate_proj")
        up_q = A.expert_weight(module, e, "up_proj")
        down_w = A.expert_weight(module, e, "down_proj").float()
        if x is not None and x.shape[0]:
            task = self.solver.task(down_w)
            task.add(A.expert_intermediate(module, x, gate_q, up_q))
            result = task.solve()
        else:
            result = rtn(down_w, self.opts.bits, self.opts.group_size, self.opts.sym)
        hh = A.expert_intermediate(module, xh, gate_q, up_q) if xh is not None and xh.shape[0] else None
        self._record(A.layer_type(self.stack.label, m.name, "down_proj"), down_w, result, hh,
                     x.shape[0] if x is not None else 0)
        A.set_expert_weight(module, e, "down_proj", result.dequantize())
        self._store(f"{m.path}.{e}.down_proj", result, None)

    # ------------------------------------------------------------------ bookkeeping

    def _record(self, layer_type: str, weight, result: QuantResult, x_heldout, rows: int) -> None:
        """Count the module under its layer type and add its held-out output errors, GPTQ's and RTN's."""
        stats = self.result.stats(layer_type)
        stats.modules += 1
        stats.calib_rows += rows
        if result.method == "rtn":
            stats.rtn_modules += 1
        if x_heldout is not None and x_heldout.shape[0]:
            baseline = rtn(weight, self.opts.bits, self.opts.group_size, self.opts.sym)
            other = rtn(weight, self.opts.bits, self.opts.group_size, not self.opts.sym)
            stats.gptq.add(output_error(x_heldout, weight, result.dequantize()))
            stats.rtn.add(output_error(x_heldout, weight, baseline.dequantize()))
            stats.rtn_other.add(output_error(x_heldout, weight, other.dequantize()))

    def _store(self, key: str, result: QuantResult, bias) -> None:
        for name, tensor in result.pack(bias).items():
            self.result.tensors[f"{key}.{name}"] = tensor.cpu()
