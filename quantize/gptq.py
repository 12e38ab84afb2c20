"""The quantization math of one weight matrix: GPTQ through GPTQModel's solver or orin-omni's own
(quantize/gptq_solve.py: the same algorithm in plain torch, for where GPTQModel does not install), the RTN
baseline, and the output error both leave on held-out inputs. No model structure and no calibration capture here.

GPTQModel 7.6.0's ``gptqmodel.quantization.gptq.GPTQ`` is used directly: ``add_batch`` accumulates the
Hessian ``2/n * X^T X`` of a Linear's inputs, ``quantize`` runs the blocked GPTQ update and returns the
fake-quantized weight with per-group scales and zero points. Its whole-model pipeline is not used (see
quantize/adapters.py for why); calibration inputs come from quantize/capture.py.

A weight whose in_features K is not a multiple of the group size is quantized zero-padded to K_pad: the padded
input columns are zero, so their Hessian rows and columns are zero and GPTQ treats them as dead columns
(weight forced to 0, which quantizes exactly to the group's zero point); the checkpoint then stores K_pad
columns and the device feeds zeros there.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from orin.checkpoint.gptq_format import pack_gptq_v1, pad_in_features, quantize_rtn, unpack_gptq_v1
from orin.errors import UsageError

from . import gptq_solve
from .adapters import PINNED, LayoutError, layout_error
from .gptq_solve import HessianSum

MAXQ = 15
DEFAULT_DAMP = 0.05  # GPTQModel 7.6.0's default damp_percent for GPTQ


def import_gptq():
    """GPTQModel's GPTQ class and config factory, with its version checked (the API moved between releases).

    Importing gptqmodel prints a banner and sets PYTORCH_ALLOC_CONF / CUDA_DEVICE_ORDER in os.environ; the
    banner goes to a buffer, the environment changes are GPTQModel's own and harmless here."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            import gptqmodel
            from gptqmodel.quantization.config import QuantizeConfig
            from gptqmodel.quantization.gptq import GPTQ
    except ImportError as exc:
        raise layout_error(f"gptqmodel cannot be imported ({exc})") from exc
    version = getattr(gptqmodel, "__version__", "?")
    if version != PINNED["gptqmodel"]:
        raise layout_error(f"gptqmodel {version} is installed")
    # Its logger reports every module it quantizes at INFO; quantize reports progress itself.
    logging.getLogger("gptqmodel").setLevel(logging.WARNING)
    return GPTQ, QuantizeConfig


@dataclass
class QuantResult:
    """4-bit codes of one [N, K] weight with per-group scales and zero points (8 everywhere when symmetric)."""

    codes: torch.Tensor  # uint8 [N, K] (unpadded)
    zeros: torch.Tensor  # uint8 [G, N]
    scales: torch.Tensor  # float16 [G, N]
    group_size: int
    method: str  # "gptq" or "rtn"
    nsamples: int = 0

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: exactly what the device computes from the stored tensors."""
        K = self.codes.shape[1]
        group = torch.arange(K, device=self.codes.device) // self.group_size
        z = self.zeros.float()[group].t()
        s = self.scales.float()[group].t()
        return (self.codes.float() - z) * s

    def split_rows(self, n: int) -> tuple[QuantResult, QuantResult]:
        """The results of the first n output rows and of the rest: GPTQ solves each row on its own, so two
        matrices with one Hessian (an expert's gate and up) solved stacked are the two solved apart."""
        def rows(part: slice) -> QuantResult:
            return QuantResult(self.codes[part].contiguous(), self.zeros[:, part].contiguous(),
                               self.scales[:, part].contiguous(), self.group_size, self.method, self.nsamples)

        return rows(slice(0, n)), rows(slice(n, None))

    def pack(self, bias: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        return pack_gptq_v1(self.codes, self.zeros, self.scales, self.group_size, bias)

    @classmethod
    def unpack(cls, packed: dict[str, torch.Tensor], in_features: int) -> QuantResult:
        """The result `pack` stored (its method is not stored: "gptq")."""
        codes, zeros, scales, g = unpack_gptq_v1(packed)
        return cls(codes[:, :in_features].contiguous(), zeros, scales, g, "gptq")


SOLVERS = ("auto", "gptqmodel", "own")


def gptqmodel_available() -> bool:
    """Whether GPTQModel imports at the pinned version (it does not install on every board)."""
    try:
        import_gptq()
    except LayoutError:
        return False
    return True


def resolve_solver(name: str) -> str:
    """"gptqmodel" or "own" for a --solver value: auto takes GPTQModel where it imports at the pinned version."""
    if name not in SOLVERS:
        raise UsageError(f"--solver {name!r}: use one of {', '.join(SOLVERS)}")
    if name == "auto":
        return "gptqmodel" if gptqmodel_available() else "own"
    if name == "gptqmodel":
        import_gptq()  # its error says what to install
    return name


def solver_name(solver: str) -> str:
    """The manifest's and report's name of the resolved solver."""
    from orin import __version__

    return f"gptqmodel {PINNED['gptqmodel']}" if solver == "gptqmodel" else f"orin-omni {__version__} gptq"


class GPTQSolver:
    """GPTQ for one run's parameters (bits, group size, damping) on one device, through GPTQModel's solver or
    the own one (`solver`: "gptqmodel" or "own", as resolve_solver gives). The own one also solves batches of
    matrices of one shape at once (solve_batch), `batch_bytes` of working set at a time (0: one matrix at a
    time, through tasks only)."""

    def __init__(self, bits: int, group_size: int, damp: float = DEFAULT_DAMP, device: str | torch.device = "cpu",
                 sym: bool = True, solver: str = "gptqmodel", batch_bytes: int = gptq_solve.BATCH_BYTES):
        self.solver = solver
        self.group_size = group_size
        self.bits = bits
        self.sym = sym
        self.damp = damp
        self.device = torch.device(device)
        self.batch_bytes = batch_bytes
        if solver == "own":
            return
        gptq_cls, config_factory = import_gptq()
        self._gptq = gptq_cls
        # Plain GPTQ in natural column order (desc_act=False, no group-aware reordering), so g_idx is
        # arange(K)//g as the device kernels need; symmetric by default, the only 4-bit GPTQ vLLM's kernels take.
        # GPTQModel's own low-sample fallback is off: the caller decides per expert (see quantize/sequential.py),
        # and the report lists those decisions.
        self.qcfg = config_factory(bits=bits, group_size=group_size, sym=sym, desc_act=False,
                                   act_group_aware=False, damp_percent=damp, fallback=None,
                                   offload_to_disk=False, mse=0.0)

    def task(self, weight: torch.Tensor) -> GPTQTask | OwnGPTQTask:
        return OwnGPTQTask(self, weight) if self.solver == "own" else GPTQTask(self, weight)

    # ------------------------------------------------------------------ batches (the own solver)

    @property
    def batched(self) -> bool:
        """Whether batches of one shape go through solve_batch (GPTQModel's solver takes one matrix at a time)."""
        return self.solver == "own" and self.batch_bytes > 0

    def batch_size(self, N: int, K: int) -> int:
        """How many [N, K] matrices one solve_batch takes within batch_bytes."""
        g = self.group_size
        return gptq_solve.batch_size(N, pad_in_features(K, g), g, self.batch_bytes)

    def hessian_sum(self, x: torch.Tensor) -> HessianSum:
        """Σ XᵀX of inputs x [rows, K], zero-padded as a task pads them: one sum that several matrices share."""
        K = x.shape[-1]
        total = HessianSum(pad_in_features(K, self.group_size), self.device)
        total.add(_pad_columns(x.reshape(-1, K).to(self.device), total.xtx.shape[0]))
        return total

    def hessians(self, sources: Iterable[torch.Tensor | HessianSum], count: int, K: int
                 ) -> tuple[torch.Tensor, list[int]]:
        """The Hessians 2/n·XᵀX of `count` matrices of K in_features stacked [count, K_pad, K_pad], each summed
        in its own slice (no copy of them all beside the stack), and their rows. A source is a matrix's inputs
        x [rows, K] or a HessianSum it shares; `sources` may be a generator: one source is held at a time."""
        K_pad = pad_in_features(K, self.group_size)
        H = torch.zeros((count, K_pad, K_pad), dtype=torch.float32, device=self.device)
        rows = []
        for b, source in enumerate(sources):
            if isinstance(source, HessianSum):
                H[b].copy_(source.xtx)
                n = source.rows
            else:
                total = HessianSum(K_pad, self.device, out=H[b])
                total.add(_pad_columns(source.reshape(-1, K).to(self.device), K_pad))
                n = total.rows
            H[b].mul_(2.0 / n)  # HessianSum.matrix(), in place
            rows.append(n)
        if len(rows) != count:
            raise ValueError(f"hessians: {len(rows)} sources for {count} matrices")
        return H, rows

    def solve_batch(self, weights: torch.Tensor, hessians: torch.Tensor, rows: list[int]) -> list[QuantResult]:
        """GPTQ of weights [B, N, K] with `hessians` (consumed) as hessians() gives them: each result is what a
        task of that weight and Hessian gives (to float rounding)."""
        K = weights.shape[-1]
        K_pad = hessians.shape[-1]
        w = torch.nn.functional.pad(weights.to(self.device, torch.float32), (0, K_pad - K))
        codes, scales, zeros, _damps = gptq_solve.solve_batched(w, hessians, self.bits, self.group_size, self.sym,
                                                                self.damp, max_bytes=self.batch_bytes)
        return [self.own_result(codes[b], scales[b], zeros[b], K, rows[b]) for b in range(len(rows))]

    def own_result(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, K: int,
                   rows: int) -> QuantResult:
        """The result of the own solver's output for one matrix of K in_features (padded to K_pad in codes)."""
        return QuantResult(codes[:, :K].contiguous(), zeros.t().round().clamp(0, MAXQ).to(torch.uint8),
                           scales.t().to(torch.float16).clamp(min=torch.finfo(torch.float16).tiny),
                           self.group_size, "gptq", rows)


def _pad_columns(t: torch.Tensor, K_pad: int) -> torch.Tensor:
    """t [..., K] zero-padded to K_pad columns (see the module doc)."""
    K = t.shape[-1]
    return torch.nn.functional.pad(t, (0, K_pad - K)) if K_pad > K else t


class _Task:
    """A weight matrix and its inputs on the solver's device, both zero-padded to K_pad (see the module doc)."""

    def __init__(self, solver: GPTQSolver, weight: torch.Tensor):
        self.solver = solver
        self.N, self.K = weight.shape
        self.K_pad = pad_in_features(self.K, solver.group_size)

    def padded(self, t: torch.Tensor) -> torch.Tensor:
        return _pad_columns(t.to(self.solver.device), self.K_pad)

    def add(self, x: torch.Tensor) -> None:
        """Accumulate inputs x [rows, K] (any float dtype) into the Hessian."""
        if x.numel():
            self.accumulate(self.padded(x.reshape(-1, self.K)))

    def accumulate(self, x: torch.Tensor) -> None:
        raise NotImplementedError


class GPTQTask(_Task):
    """One weight matrix's Hessian accumulation and GPTQ solve, on GPTQModel's solver."""

    def __init__(self, solver: GPTQSolver, weight: torch.Tensor):
        super().__init__(solver, weight)
        w = self.padded(weight.detach().float())
        linear = torch.nn.Linear(self.K_pad, self.N, bias=False, device=solver.device, dtype=torch.float32)
        linear.weight.data = w
        self._gptq = solver._gptq(linear, solver.qcfg)
        self._gptq.quantizer.configure(perchannel=True)

    @property
    def nsamples(self) -> int:
        return int(self._gptq.nsamples)

    def accumulate(self, x: torch.Tensor) -> None:
        self._gptq.add_batch(x, None)

    def adopt(self, leader: GPTQTask) -> None:
        """Use `leader`'s Hessian (same inputs: q/k/v, gate/up); call before either is solved."""
        self._gptq.adopt_hessian_from(leader._gptq)

    def solve(self) -> QuantResult:
        q, scale, zero, _g_idx, _t, _loss, _damp, nsamples = self._gptq.quantize()
        g = self.solver.group_size
        # GPTQ returns the fake-quantized weight with fp32 [N, groups] scale/zero; recover the integer codes.
        scale_col = scale.repeat_interleave(g, dim=1)[:, : self.K_pad]
        zero_col = zero.repeat_interleave(g, dim=1)[:, : self.K_pad]
        codes = torch.clamp(torch.round(q.float() / scale_col) + zero_col, 0, MAXQ)[:, : self.K]
        scales = scale.t().to(torch.float16).clamp(min=torch.finfo(torch.float16).tiny)
        self._gptq.free()
        return QuantResult(codes.to(torch.uint8), zero.t().round().clamp(0, MAXQ).to(torch.uint8), scales, g,
                           "gptq", int(nsamples))


class OwnGPTQTask(_Task):
    """GPTQTask's calls on quantize/gptq_solve.py."""

    def __init__(self, solver: GPTQSolver, weight: torch.Tensor):
        super().__init__(solver, weight)
        self._weight = self.padded(weight.detach().float())
        self._hessian = HessianSum(self.K_pad, solver.device)

    @property
    def nsamples(self) -> int:
        return self._hessian.rows

    def accumulate(self, x: torch.Tensor) -> None:
        self._hessian.add(x)

    def adopt(self, leader: OwnGPTQTask) -> None:
        self._hessian = leader._hessian  # shared, never added to again: each solve takes its own 2/n·XᵀX

    def solve(self) -> QuantResult:
        s = self.solver
        codes, scales, zeros, _damp = gptq_solve.solve(self._weight, self._hessian.matrix(), s.bits, s.group_size,
                                                       s.sym, s.damp)
        self._weight = None
        return s.own_result(codes, scales, zeros, self.K, self._hessian.rows)


def rtn(weight: torch.Tensor, bits: int, group_size: int, sym: bool = True) -> QuantResult:
    """Round-to-nearest with the same grid (the baseline GPTQ has to beat)."""
    packed = quantize_rtn(weight.detach().float(), bits, group_size, sym=sym)
    codes, zeros, scales, g = unpack_gptq_v1(packed)
    return QuantResult(codes[:, : weight.shape[1]].contiguous(), zeros, scales, g, "rtn")


@dataclass
class ErrorSums:
    """Sums for a pooled relative Frobenius error ||X(W_q - W)^T|| / ||X W^T|| over many matrices."""

    err_sq: float = 0.0
    ref_sq: float = 0.0
    rows: int = 0

    def add(self, other: ErrorSums) -> None:
        self.err_sq += other.err_sq
        self.ref_sq += other.ref_sq
        self.rows += other.rows

    @property
    def relative(self) -> float | None:
        return (self.err_sq / self.ref_sq) ** 0.5 if self.ref_sq > 0 else None


def output_error(x: torch.Tensor, weight: torch.Tensor, approx: torch.Tensor) -> ErrorSums:
    """Squared output error of `approx` against `weight` on inputs x [rows, K], in float32."""
    if x.numel() == 0:
        return ErrorSums()
    x = x.reshape(-1, weight.shape[1]).float()
    w = weight.float().to(x.device)
    ref = x @ w.t()
    err = x @ (approx.float().to(x.device) - w).t()
    return ErrorSums(float(err.pow(2).sum()), float(ref.pow(2).sum()), x.shape[0])
