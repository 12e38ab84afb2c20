"""GPTQ in plain torch: the solver quantize uses where GPTQModel does not install (an aarch64 board: its wheels
need a `pypcre` build and torchao), and a check on the one it uses where it does.

The algorithm is GPTQ as GPTQModel 7.6.0 runs it for orin-omni's settings (natural column order, no
activation-aware grouping, per-group min/max scales, no MSE grid search), column by column in its eager order, so
the two agree to float rounding (tests/test_quantize_solver.py compares them): the Hessian 2/n·XᵀX in float32;
dead columns (a zero diagonal) forced to zero; damping `damp`·mean(diag) added, raised by 0.01 steps while the
Cholesky factorisation or its inverse fails; the upper Cholesky factor of H⁻¹; then per block of 128 columns each
column quantized on its group's grid (found from the weights as updated by the blocks before, at the group's
first column), its error spread over the block's later columns, and the block's errors over the later blocks.

`solve_batched` runs it for a batch of matrices of one shape (a MoE layer's experts) at once: the column loop
is a Python loop of ~10 small kernels per column, so one matrix at a time leaves a GPU idle on launches (97 s a
thinker layer on an H200, 384 solves); batched, each launch covers the whole batch. Every matrix keeps its own
grid, dead columns and damping (a matrix whose factorisation fails gets more damping alone), so each result is
what `solve` gives for that matrix alone, to float rounding (the batched matmul may sum in another order).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from orin.errors import InputError

BLOCK = 128
DAMP_STEP = 0.01  # GPTQModel's damp_auto_increment
# The default budget of one batched solve's working set (working_bytes × its matrices); quantize/memory.py
# plans the GPTQ stage with it.
BATCH_BYTES = 1 << 30


class HessianSum:
    """Σ XᵀX over a Linear's calibration inputs, in float32, and the rows seen; shared by Linears that read the
    same inputs (q/k/v, gate/up). `out`, a zeroed [K, K] float32 tensor, holds the sum instead of a new one (a
    slice of a batch's stacked Hessians)."""

    def __init__(self, columns: int, device: torch.device, out: torch.Tensor | None = None):
        self.xtx = out if out is not None else torch.zeros((columns, columns), dtype=torch.float32, device=device)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, self.xtx.shape[0]).to(self.xtx.device, torch.float32)
        self.xtx.addmm_(x.t(), x)
        self.rows += x.shape[0]

    def matrix(self) -> torch.Tensor:
        """GPTQ's H = 2/n·XᵀX (a new tensor: the sum stays for the Linears that share it)."""
        return self.xtx * (2.0 / self.rows)


def working_bytes(N: int, K: int, group_size: int, block: int = BLOCK) -> int:
    """What one [N, K] matrix takes at most in solve_batched, its inputs included (float32 unless said): its
    Hessian, its factor and the factorisation's two transients (4·K²: the first try's, or beside the batch's
    factors a retry's); its weight as read (BF16), as given and as updated, and the blocks' update of the later
    columns (N·K each); a block's working copy, codes, errors and rank-1 update (N·block each); the scales and
    zero points; the codes (uint8)."""
    return 4 * (4 * K * K + 3 * N * K + 4 * N * min(block, K) + 2 * N * (K // group_size)) + 3 * N * K


def batch_size(N: int, K: int, group_size: int, max_bytes: int, block: int = BLOCK) -> int:
    """How many [N, K] matrices one solve_batched call takes within max_bytes (at least one)."""
    return max(1, max_bytes // working_bytes(N, K, group_size, block))


def batch_bytes(N: int, K: int, group_size: int, count: int, max_bytes: int = BATCH_BYTES) -> int:
    """The working set of `count` [N, K] matrices solved in batches within max_bytes: one batch's, the largest
    (more than max_bytes only where one matrix alone takes more)."""
    return min(count, batch_size(N, K, group_size, max_bytes)) * working_bytes(N, K, group_size)


def _group_grid(w: torch.Tensor, maxq: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) per row of a group's columns w [..., N, g], GPTQ's min/max grid."""
    zero_ = torch.zeros(w.shape[:-1], device=w.device)
    xmin = torch.minimum(w.amin(-1), zero_)
    xmax = torch.maximum(w.amax(-1), zero_)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    empty = (xmin == 0) & (xmax == 0)
    xmin = torch.where(empty, -1.0, xmin)
    xmax = torch.where(empty, 1.0, xmax)
    scale = (xmax - xmin) / maxq
    zero = torch.full_like(scale, (maxq + 1) / 2) if sym else torch.round(-xmin / scale)
    return scale, zero


def _damped_factors(H: torch.Tensor, base: torch.Tensor, mean: torch.Tensor,
                    damps: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """One try of each matrix of H [B, K, K] at its own damp: the upper Cholesky factors of the damped inverses,
    and which exist. H's diagonal is overwritten with base + damp·mean."""
    d = torch.tensor(damps, dtype=torch.float32, device=H.device)
    H.diagonal(dim1=-2, dim2=-1).copy_(base + (d * mean).unsqueeze(1))
    L, info = torch.linalg.cholesky_ex(H)
    ok = info == 0
    if not bool(ok.all()):
        # a failed factor may have a zero on its diagonal, on which cholesky_inverse raises for the whole
        # batch: those are tried again anyway
        L[~ok] = torch.eye(H.shape[-1], dtype=L.dtype, device=L.device)
    inverse = torch.cholesky_inverse(L)
    del L
    U, info_u = torch.linalg.cholesky_ex(inverse, upper=True)
    return U, ok & (info_u == 0)


def _inverse_factors(H: torch.Tensor, damp: float) -> tuple[torch.Tensor, list[float]]:
    """The upper Cholesky factors of (H + damping)⁻¹ for H [B, K, K] (consumed), and each matrix's damp that made
    its factor exist: all are tried at `damp` together, then each that failed alone, with more, in place (a
    copy of several Hessians beside the batch's would outgrow the working set the plan counts)."""
    if damp >= 1.0:
        raise _degenerate()
    diag = H.diagonal(dim1=-2, dim2=-1)
    base = diag.clone()
    mean = base.mean(-1)
    damps = [damp] * H.shape[0]
    factors, ok = _damped_factors(H, base, mean, damps)
    for b, good in enumerate(ok.tolist()):
        while not good:
            damps[b] += DAMP_STEP
            if damps[b] >= 1.0:
                raise _degenerate()
            U, good_b = _damped_factors(H[b:b + 1], base[b:b + 1], mean[b:b + 1], damps[b:b + 1])
            good = bool(good_b)
            if good:
                factors[b] = U[0]
    return factors, damps


def _degenerate() -> InputError:
    return InputError("the Hessian is not positive definite at any damping below 1.0: the calibration inputs of "
                      "this layer are degenerate; use more or more varied calibration samples")


def _quantize_columns(W: torch.Tensor, Hinv: torch.Tensor, maxq: int, group_size: int, sym: bool,
                      block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ's column loop over W [B, N, K] (updated in place) with the factors Hinv [B, K, K]: codes uint8
    [B, N, K], scales and zeros [B, N, G]."""
    B, N, K = W.shape
    codes = torch.empty((B, N, K), dtype=torch.uint8, device=W.device)
    scales, zeros = [], []
    scale = zero = None
    for i1 in range(0, K, block):
        i2 = min(i1 + block, K)
        W1 = W[:, :, i1:i2].clone()
        Q1 = torch.empty_like(W1)  # the block's codes, converted once per block
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[:, i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % group_size == 0:  # read from W, as GPTQ does: the block's own updates are not in it yet
                scale, zero = _group_grid(W[:, :, col:col + group_size], maxq, sym)
                scales.append(scale)
                zeros.append(zero)
            w = W1[:, :, i]
            q = torch.clamp(torch.round(w / scale) + zero, 0, maxq)
            Q1[:, :, i] = q
            err = (w - scale * (q - zero)) / Hinv1[:, i, i].unsqueeze(1)
            W1[:, :, i:] -= err.unsqueeze(2) * Hinv1[:, i, i:].unsqueeze(1)
            Err1[:, :, i] = err
        codes[:, :, i1:i2] = Q1.to(torch.uint8)
        W[:, :, i2:] -= torch.matmul(Err1, Hinv[:, i1:i2, i2:])
    return codes, torch.stack(scales, -1), torch.stack(zeros, -1)


def _solve_chunk(weights: torch.Tensor, H: torch.Tensor, maxq: int, group_size: int, sym: bool, damp: float,
                 block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[float]]:
    W = weights.to(H.device, torch.float32).clone()
    diag = H.diagonal(dim1=-2, dim2=-1)
    dead = diag == 0
    diag.masked_fill_(dead, 1)
    W.masked_fill_(dead.unsqueeze(1), 0)
    del diag
    Hinv, damps = _inverse_factors(H, damp)
    codes, scales, zeros = _quantize_columns(W, Hinv, maxq, group_size, sym, block)
    return codes, scales, zeros, damps


@torch.no_grad()
def solve_batched(weights: torch.Tensor, H: torch.Tensor, bits: int, group_size: int, sym: bool, damp: float,
                  block: int = BLOCK, max_bytes: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[float]]:
    """GPTQ of B matrices weights [B, N, K] (K a multiple of group_size) with their Hessians H [B, K, K]
    (consumed), `max_bytes` (None: no limit) of working set at a time (batch_size). Returns (codes uint8
    [B, N, K], scales float32 [B, N, G], zeros float32 [B, N, G], each matrix's damp)."""
    B, N, K = weights.shape
    if tuple(H.shape) != (B, K, K) or K % group_size:
        raise ValueError(f"solve_batched: weights {tuple(weights.shape)} and Hessians {tuple(H.shape)} do not "
                         f"match, or K is not a multiple of the group size {group_size}")
    maxq = (1 << bits) - 1
    step = B if max_bytes is None else batch_size(N, K, group_size, max_bytes, block)
    if step >= B:
        return _solve_chunk(weights, H, maxq, group_size, sym, damp, block)
    parts = [_solve_chunk(weights[s:s + step], H[s:s + step], maxq, group_size, sym, damp, block)
             for s in range(0, B, step)]
    codes, scales, zeros, damps = zip(*parts, strict=True)
    return torch.cat(codes), torch.cat(scales), torch.cat(zeros), [d for ds in damps for d in ds]


def solve(weight: torch.Tensor, H: torch.Tensor, bits: int, group_size: int, sym: bool, damp: float,
          block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """GPTQ of weight [N, K] (K a multiple of group_size) with Hessian H [K, K] (consumed).
    Returns (codes uint8 [N, K], scales float32 [N, G], zeros float32 [N, G], the damp used)."""
    codes, scales, zeros, damps = solve_batched(weight.unsqueeze(0), H.unsqueeze(0), bits, group_size, sym, damp,
                                                block)
    return codes[0], scales[0], zeros[0], damps[0]


__all__ = ["BATCH_BYTES", "BLOCK", "HessianSum", "batch_bytes", "batch_size", "solve", "solve_batched", "working_bytes"]
