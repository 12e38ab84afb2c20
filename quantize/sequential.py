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
starved="rtn" it is rounded to nearest. The report lists each starved expert with its token count. On the own
solver the GPTQ experts of a layer are solved in batches (gptq_solve.solve_batched, within the solver's
batch_bytes: one expert at a time leaves a GPU idle on kernel launches), an expert's gate and up stacked as one
matrix; the result is what one expert at a time gives, to float rounding, recorded and stored in the same order.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from orin.checkpoint.targets import Target

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


def _routed(calls: list) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """All tokens an experts module saw over the calls, with the experts each was routed to."""
    if not calls:
        return None, None
    return torch.cat([h for h, _ in calls]), torch.cat([i for _, i in calls])


class _Routing:
    """The tokens a fused experts module saw (calibration and held-out) and what each expert is calibrated on:
    the tokens routed to it, every token of the layer for a starved expert calibrated on all ("all-tokens"), or
    nothing (RTN: a starved expert with starved="rtn", or no calibration call at all). Inputs are selected when
    asked for, one expert at a time: all experts' copies at once would be top_k times the layer's tokens."""

    def __init__(self, calls: list, calls_heldout: list, num_experts: int, opts: StackOptions):
        self.x_all, self.index = _routed(calls)
        self.xh_all, self.index_h = _routed(calls_heldout)
        self.opts = opts
        self.experts = range(num_experts)
        self.tokens = [int((self.index == e).any(-1).sum()) if self.index is not None else 0 for e in self.experts]

    def starved(self, e: int) -> bool:
        return self.tokens[e] < self.opts.min_expert_tokens

    def calibrated(self, e: int) -> bool:
        return self.x_all is not None and (not self.starved(e) or self.opts.starved == "all-tokens")

    def rows(self, e: int) -> int:
        """The rows of expert e's Hessian (0: RTN)."""
        if not self.calibrated(e):
            return 0
        return self.x_all.shape[0] if self.starved(e) else self.tokens[e]

    def inputs(self, e: int) -> torch.Tensor | None:
        if not self.calibrated(e):
            return None
        return self.x_all if self.starved(e) else self.x_all[(self.index == e).any(-1)]

    def heldout(self, e: int) -> torch.Tensor | None:
        return self.xh_all[(self.index_h == e).any(-1)] if self.xh_all is not None else None


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

    def _experts(self, module, m: A.Member, calls: list, calls_heldout: list, bar) -> None:
        routing = _Routing(calls, calls_heldout, module.gate_up_proj.shape[0], self.opts)
        gate_up = m.kind == "experts_gate_up"
        if gate_up:
            self.result.quantized.append(m.path)
            self.result.starved += [{
                "module": m.path, "expert": e, "tokens": routing.tokens[e],
                "handled": "GPTQ on all calibration tokens of the layer" if routing.calibrated(e) else "RTN"}
                for e in routing.experts if routing.starved(e)]
        if self.solver.batched:
            (self._gate_up_batched if gate_up else self._down_batched)(module, m, routing, bar)
            return
        holder = None  # the all-tokens Hessian of this layer, shared by its starved experts
        for e in routing.experts:
            x, xh = routing.inputs(e), routing.heldout(e)
            if gate_up:
                if x is not None and routing.starved(e) and holder is None:
                    holder = self.solver.task(A.expert_weight(module, e, "gate_proj"))
                    with self._stage_timer("hessians"):
                        holder.add(routing.x_all)
                self._expert_gate_up(module, m, e, x, xh, holder if routing.starved(e) else None)
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
            results = self._rtn(gate_w), self._rtn(up_w)
        self._write_gate_up(module, m, e, (gate_w, up_w), results, xh, x.shape[0] if x is not None else 0)

    def _expert_down(self, module, m: A.Member, e: int, x, xh) -> None:
        """down_proj of expert e, calibrated on what its (already quantized) gate and up produce for x."""
        down_w = A.expert_weight(module, e, "down_proj").float()
        if x is not None and x.shape[0]:
            task = self.solver.task(down_w)
            with self._stage_timer("hessians"):
                task.add(self._intermediate(module, e, x))
            with self._stage_timer("solves"):
                result = task.solve()
        else:
            result = self._rtn(down_w)
        self._write_down(module, m, e, down_w, result, xh, x.shape[0] if x is not None else 0)

    def _gate_up_batched(self, module, m: A.Member, routing: _Routing, bar) -> None:
        """_expert_gate_up for every expert, the GPTQ ones solved a batch at a time: an expert's gate and up
        stacked as one [2I, H] matrix (one Hessian; GPTQ solves each row on its own)."""
        _experts, two_i, hidden = module.gate_up_proj.shape
        shared = None  # the all-tokens Hessian sum of this layer, for its starved experts
        if any(routing.starved(e) and routing.rows(e) for e in routing.experts):
            with self._stage_timer("hessians"):
                shared = self.solver.hessian_sum(routing.x_all)

        def solve(batch: list[int]) -> list[tuple[QuantResult, QuantResult]]:
            with self._stage_timer("hessians"):
                sources = (shared if routing.starved(e) else routing.inputs(e) for e in batch)
                H, rows = self.solver.hessians(sources, len(batch), hidden)
            with self._stage_timer("solves"):
                results = self.solver.solve_batch(module.gate_up_proj.detach()[batch], H, rows)
            return [r.split_rows(two_i // 2) for r in results]

        def write(e: int, results: tuple[QuantResult, QuantResult] | None) -> None:
            weights = A.expert_weight(module, e, "gate_proj").float(), A.expert_weight(module, e, "up_proj").float()
            if results is None:
                results = self._rtn(weights[0]), self._rtn(weights[1])
            self._write_gate_up(module, m, e, weights, results, routing.heldout(e), routing.rows(e))

        self._solve_in_order(routing, (two_i, hidden), solve, write, bar)

    def _down_batched(self, module, m: A.Member, routing: _Routing, bar) -> None:
        """_expert_down for every expert, the GPTQ ones solved a batch at a time."""
        _experts, hidden, inter = module.down_proj.shape

        def solve(batch: list[int]) -> list[QuantResult]:
            with self._stage_timer("hessians"):
                sources = (self._intermediate(module, e, routing.inputs(e)) for e in batch)
                H, rows = self.solver.hessians(sources, len(batch), inter)
            with self._stage_timer("solves"):
                return self.solver.solve_batch(module.down_proj.detach()[batch], H, rows)

        def write(e: int, result: QuantResult | None) -> None:
            down_w = A.expert_weight(module, e, "down_proj").float()
            result = self._rtn(down_w) if result is None else result
            self._write_down(module, m, e, down_w, result, routing.heldout(e), routing.rows(e))

        self._solve_in_order(routing, (hidden, inter), solve, write, bar)

    def _solve_in_order(self, routing: _Routing, shape: tuple[int, int], solve, write, bar) -> None:
        """solve() the GPTQ-calibrated experts in batches of [N, K] matrices within the solver's budget, and
        write() every expert in order (the report's sums and the stored tensors come out as one at a time gives
        them), each batch's as soon as it is solved, so no more than one batch's results are held; an expert
        that is not solved is written with None (RTN)."""
        experts = [e for e in routing.experts if routing.rows(e)]
        size = self.solver.batch_size(*shape)
        remaining = iter(routing.experts)
        for start in range(0, len(experts), size):
            batch = experts[start:start + size]
            results = dict(zip(batch, solve(batch), strict=True))
            for e in remaining:
                write(e, results.pop(e, None))
                bar.update(1)
                if e == batch[-1]:
                    break
        for e in remaining:
            write(e, None)
            bar.update(1)

    @staticmethod
    def _intermediate(module, e: int, x):
        """down_proj's inputs of expert e for tokens x, from its (already quantized) gate and up."""
        gate_q = A.expert_weight(module, e, "gate_proj")
        up_q = A.expert_weight(module, e, "up_proj")
        return A.expert_intermediate(module, x.to(gate_q.device), gate_q, up_q)

    def _rtn(self, weight) -> QuantResult:
        with self._stage_timer("solves"):
            return rtn(weight, self.opts.bits, self.opts.group_size, self.opts.sym)

    def _write_gate_up(self, module, m: A.Member, e: int, weights: tuple, results: tuple, xh, rows: int) -> None:
        """Record gate_proj and up_proj of expert e, write them back and store them."""
        for proj, w, r in zip(("gate_proj", "up_proj"), weights, results, strict=True):
            self._record(A.layer_type(self.stack.label, m.name, proj), w, r, xh, rows)
            with self._stage_timer("solves"):
                A.set_expert_weight(module, e, proj, r.dequantize())
                self._store(f"{m.path}.{e}.{proj}", r, None)

    def _write_down(self, module, m: A.Member, e: int, down_w, result: QuantResult, xh, rows: int) -> None:
        """Record down_proj of expert e on its held-out tokens' intermediates, write it back and store it."""
        with self._stage_timer("metrics"):
            hh = self._intermediate(module, e, xh) if xh is not None and xh.shape[0] else None
        self._record(A.layer_type(self.stack.label, m.name, "down_proj"), down_w, result, hh, rows)
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
