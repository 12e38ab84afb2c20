"""GPTQ through one decoder stack, one layer at a time (true-sequential, as TGI and GPTQModel do): layer i's
stages are quantized in forward order, each calibrated on inputs computed through the already-quantized
modules before it, and layer i+1 is calibrated on layer i's quantized output. Errors therefore do not pile up
unseen: every module compensates for the quantization upstream of it.

Quantized weights are written back into the live model as their exact dequantized values (what the device
computes), so later stages and layers see them; the GPTQ v1 tensors are kept for the checkpoint. On the streamed
model (quantize/weights.py) each layer is loaded in BF16 just before its turn and released after it, and a layer
checkpoint (quantize/partial.py) takes its GPTQ tensors, the report's figures so far and the next layer's inputs,
so a killed run resumes at the layer it was in. Calibration activations stay where the memory plan put them
(quantize/activations.py); what a stage captures from them is kept there too, and moved to the compute device
only where it is used, so the numbers are the same wherever they are kept.

Experts: each routed expert of a fused experts module gets its own Hessian from the calibration tokens the
router (running on the quantized upstream) sends to it. An expert with fewer than `min_expert_tokens` tokens
is "starved": by default it is calibrated on every token of the layer ("all-tokens": the inputs it would see
if the router picked it, rather than a rank-deficient Hessian of a handful of tokens), or with
starved="rtn" it is rounded to nearest. The report lists each starved expert with its token count.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from orin.layout import Target

from . import adapters as A
from .activations import StackData
from .capture import StageInputs, capture_stage
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

    def state(self) -> dict:
        """Everything but the tensors, exactly (JSON floats round-trip): what a layer checkpoint records."""
        return {"quantized": list(self.quantized), "starved": list(self.starved),
                "types": {name: {"gptq": vars(t.gptq), "rtn": vars(t.rtn), "rtn_other": vars(t.rtn_other),
                                 "modules": t.modules, "rtn_modules": t.rtn_modules, "calib_rows": t.calib_rows}
                          for name, t in self.types.items()}}

    @classmethod
    def from_state(cls, state: dict) -> StackResult:
        types = {name: TypeStats(ErrorSums(**t["gptq"]), ErrorSums(**t["rtn"]), ErrorSums(**t["rtn_other"]),
                                 t["modules"], t["rtn_modules"], t["calib_rows"])
                 for name, t in state["types"].items()}
        return cls({}, list(state["quantized"]), types, list(state["starved"]))


class StackQuantizer:
    """GPTQ of one stack. `residency` (quantize.weights.Residency) loads each layer before its turn and releases
    it after; None for a model whose weights are all loaded. `checkpoints` (quantize.partial.StackCheckpoints)
    records each finished layer so a killed run resumes at the next one, and takes its GPTQ tensors out of
    memory; None keeps them in `result.tensors`. `meter` (quantize.meter.RunMeter) times the stages."""

    def __init__(self, model, stack: A.StackSpec, solver: GPTQSolver, opts: StackOptions, progress,
                 residency=None, checkpoints=None, meter=None):
        self.model = model
        self.stack = stack
        self.solver = solver
        self.opts = opts
        self.progress = progress
        self.residency = residency
        self.checkpoints = checkpoints
        self.meter = meter
        self.result = StackResult()

    def _stage_timer(self, name: str):
        return self.meter.stage(name) if self.meter is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def _loaded(self, *prefixes: str):
        if self.residency is None:
            yield
            return
        with self.residency.loaded(*prefixes):
            yield

    # ------------------------------------------------------------------ the stack

    @torch.no_grad()
    def run(self, by_layer: dict[int, list[Target]], tail: list[Target], data: StackData, desc: str) -> StackResult:
        layers = self.model.get_submodule(self.stack.layers)
        last = len(layers) - 1 if tail else max(by_layer, default=-1)
        calib, heldout = data.calib, data.heldout
        start = 0
        resumed = self.checkpoints.resume(self.stack.component) if self.checkpoints is not None else None
        if resumed is not None:
            start, state, calib, heldout = resumed
            self.result = StackResult.from_state(state)
            if start > 0:
                self.progress.log(f"{desc}: resuming at layer {start} of {last + 1} (the layers before it are "
                                  "checkpointed)")
        with self.progress.bar(last + 1, desc, initial=min(start, last + 1), unit="layer") as bar:
            for i in range(start, last + 1):
                with self._loaded(f"{self.stack.layers}.{i}"):
                    layer = layers[i]
                    stages = A.layer_stages(self.stack, i, by_layer.get(i, []))
                    with self.progress.bar(sum(self._units(layer, s) for s in stages), f"layer {i}",
                                           leave=False) as inner:
                        for stage in stages:
                            with self._stage_timer("calibration_forward"):
                                # kept where the calls are kept: host memory unless they stay on the device
                                seen = capture_stage(layer, calib, stage, calib.placement.holder)
                                seen_heldout = capture_stage(layer, heldout, stage, heldout.placement.holder)
                            self._stage(layer, stage, seen, seen_heldout, inner)
                            del seen, seen_heldout
                    where = self.checkpoints.layer_dir(self.stack.component, i) if self.checkpoints else None
                    more = i < last or bool(tail)  # a next layer (or lm_head) reads this one's outputs
                    if more:
                        with self._stage_timer("calibration_forward"):
                            calib = self._next(layer, i, calib, where / "calib" if where else None)
                            heldout = self._next(layer, i, heldout, where / "heldout" if where else None)
                if self.checkpoints is not None:
                    with self._stage_timer("writing"):
                        self.checkpoints.commit(self.stack.component, i, self.result, calib if more else None,
                                                heldout if more else None)
                bar.update(1)
        if tail and start <= last + 1:
            norm_path = self.stack.final_norm
            with self._loaded(norm_path, *[t.path for t in tail]):
                norm = self.model.get_submodule(norm_path)
                for t in tail:
                    module = self.model.get_submodule(t.path)
                    with self._stage_timer("calibration_forward"):
                        x = [norm(c.hidden).reshape(-1, t.in_features).to(calib.placement.holder) for c in calib]
                        xh = [norm(c.hidden).reshape(-1, t.in_features).to(calib.placement.holder)
                              for c in heldout]
                    self._linear(module, t, f"{self.stack.label}.lm_head", x, xh, task=None)
            if self.checkpoints is not None:
                with self._stage_timer("writing"):
                    self.checkpoints.commit(self.stack.component, last + 1, self.result, None, None)
        return self.result

    def _next(self, layer, index: int, calls, hidden_dir):
        """The calls of the next layer: this (now quantized) layer's outputs, between-layer steps applied."""
        outs = (A.after_layer(self.model, self.stack, index, A.layer_output(layer(*c.args, **c.kwargs)).detach(),
                              c.extra) for c in calls)
        return calls.with_hidden(outs, hidden_dir)

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
            with self._stage_timer("hessians"):
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
            with self._stage_timer("hessians"):
                for part in x:
                    task.add(part)
        rows = sum(p.shape[0] for p in x)
        with self._stage_timer("solves"):
            result = task.solve() if task.nsamples else rtn(weight, self.opts.bits, self.opts.group_size,
                                                            self.opts.sym)
        self._record(layer_type, weight, result, torch.cat(xh) if xh else None, rows)
        with self._stage_timer("solves"):
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
                    with self._stage_timer("hessians"):
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
            with self._stage_timer("hessians"):
                if shared is not None:
                    gate_task.adopt(shared)
                else:
                    gate_task.add(x)
                up_task = self.solver.task(up_w)
                up_task.adopt(gate_task)
            with self._stage_timer("solves"):
                results = gate_task.solve(), up_task.solve()
        else:
            with self._stage_timer("solves"):
                results = (rtn(gate_w, self.opts.bits, self.opts.group_size, self.opts.sym),
                           rtn(up_w, self.opts.bits, self.opts.group_size, self.opts.sym))
        rows = x.shape[0] if x is not None else 0
        for proj, w, r in (("gate_proj", gate_w, results[0]), ("up_proj", up_w, results[1])):
            self._record(A.layer_type(self.stack.label, m.name, proj), w, r, xh, rows)
            with self._stage_timer("solves"):
                A.set_expert_weight(module, e, proj, r.dequantize())
                self._store(f"{m.path}.{e}.{proj}", r, None)

    def _expert_down(self, module, m: A.Member, e: int, x, xh) -> None:
        """down_proj of expert e, calibrated on what its (already quantized) gate and up produce for x."""
        gate_q = A.expert_weight(module, e, "gate_proj")
        up_q = A.expert_weight(module, e, "up_proj")
        down_w = A.expert_weight(module, e, "down_proj").float()
        device = gate_q.device
        if x is not None and x.shape[0]:
            task = self.solver.task(down_w)
            with self._stage_timer("hessians"):
                task.add(A.expert_intermediate(module, x.to(device), gate_q, up_q))
            with self._stage_timer("solves"):
                result = task.solve()
        else:
            with self._stage_timer("solves"):
                result = rtn(down_w, self.opts.bits, self.opts.group_size, self.opts.sym)
        with self._stage_timer("metrics"):
            hh = A.expert_intermediate(module, xh.to(device), gate_q, up_q) if xh is not None and xh.shape[0] \
                else None
        self._record(A.layer_type(self.stack.label, m.name, "down_proj"), down_w, result, hh,
                     x.shape[0] if x is not None else 0)
        with self._stage_timer("solves"):
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
            with self._stage_timer("metrics"):
                x_heldout = x_heldout.to(weight.device)
                baseline = rtn(weight, self.opts.bits, self.opts.group_size, self.opts.sym)
                other = rtn(weight, self.opts.bits, self.opts.group_size, not self.opts.sym)
                stats.gptq.add(output_error(x_heldout, weight, result.dequantize()))
                stats.rtn.add(output_error(x_heldout, weight, baseline.dequantize()))
                stats.rtn_other.add(output_error(x_heldout, weight, other.dequantize()))

    def _store(self, key: str, result: QuantResult, bias) -> None:
        for name, tensor in result.pack(bias).items():
            self.result.tensors[f"{key}.{name}"] = tensor.cpu()
