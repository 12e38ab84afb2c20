"""GPTQ of one weight matrix in plain torch: the solver quantize uses where GPTQModel does not install (an aarch64
board: its wheels need a `pypcre` build and torchao), and a check on the one it uses where it does.

The algorithm is GPTQ as GPTQModel 7.6.0 runs it for orin-omni's settings (natural column order, no
activation-aware grouping, per-group min/max scales, no MSE grid search), column by column in its eager order, so
the two agree to float rounding (tests/test_quantize_solver.py compares them): the Hessian 2/n·XᵀX in float32;
dead columns (a zero diagonal) forced to zero; damping `damp`·mean(diag) added, raised by 0.01 steps while the
Cholesky factorisation or its inverse fails; the upper Cholesky factor of H⁻¹; then per block of 128 columns each
column quantized on its group's grid (found from the weights as updated by the blocks before, at the group's
first column), its error spread over the block's later columns, and the block's errors over the later blocks.
"""

from __future__ import annotations

import torch

BLOCK = 128
DAMP_STEP = 0.01  # GPTQModel's damp_auto_increment


class HessianSum:
    """Σ XᵀX over a Linear's calibration inputs, in float32, and the rows seen; shared by Linears that read the
    same inputs (q/k/v, gate/up)."""

    def __init__(self, columns: int, device: torch.device):
        self.xtx = torch.zeros((columns, columns), dtype=torch.float32, device=device)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, self.xtx.shape[0]).to(self.xtx.device, torch.float32)
        self.xtx.addmm_(x.t(), x)
        self.rows += x.shape[0]

    def matrix(self) -> torch.Tensor:
        """GPTQ's H = 2/n·XᵀX (a new tensor: the sum stays for the Linears that share it)."""
        return self.xtx * (2.0 / self.rows)


def _group_grid(w: torch.Tensor, maxq: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) per row of a group's columns w [N, g], GPTQ's min/max grid."""
    zero_ = torch.zeros(w.shape[0], device=w.device)
    xmin = torch.minimum(w.min(1)[0], zero_)
    xmax = torch.maximum(w.max(1)[0], zero_)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    empty = (xmin == 0) & (xmax == 0)
    xmin = torch.where(empty, -1.0, xmin)
    xmax = torch.where(empty, 1.0, xmax)
    scale = (xmax - xmin) / maxq
    zero = torch.full_like(scale, (maxq + 1) / 2) if sym else torch.round(-xmin / scale)
    return scale, zero


def _inverse_factor(H: torch.Tensor, damp: float) -> tuple[torch.Tensor, float]:
    """The upper Cholesky factor of (H + damping)⁻¹ and the damp that made it exist."""
    diag = H.diagonal()
    base = diag.clone()
    mean = torch.mean(base)
    while damp < 1.0:
        diag.add_(damp * mean)
        try:
            L, info = torch.linalg.cholesky_ex(H)
            if int(info) == 0:
                return torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True), damp
        except torch._C._LinAlgError:  # the inverse's factorisation failed: more damping, as for the first
            pass
        finally:
            diag.copy_(base)
        damp += DAMP_STEP
    raise ValueError("the Hessian is not positive definite at any damping below 1.0: the calibration inputs of "
                     "this layer are degenerate; use more or more varied calibration samples")


@torch.no_grad()
def solve(weight: torch.Tensor, H: torch.Tensor, bits: int, group_size: int, sym: bool, damp: float,
          block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """GPTQ of weight [N, K] (K a multiple of group_size) with Hessian H [K, K] (consumed).
    Returns (codes uint8 [N, K], scales float32 [N, G], zeros float32 [N, G], the damp used)."""
    maxq = (1 << bits) - 1
    W = weight.to(H.device, torch.float32).clone()
    N, K = W.shape
    dead = H.diagonal() == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    Hinv, used = _inverse_factor(H, damp)
    del H
    codes = torch.zeros((N, K), dtype=torch.uint8, device=W.device)
    scales, zeros = [], []
    scale = zero = None
    for i1 in range(0, K, block):
        i2 = min(i1 + block, K)
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            if col % group_size == 0:  # read from W, as GPTQ does: the block's own updates are not in it yet
                scale, zero = _group_grid(W[:, col:col + group_size], maxq, sym)
                scales.append(scale)
                zeros.append(zero)
            w = W1[:, i]
            q = torch.clamp(torch.round(w / scale) + zero, 0, maxq)
            codes[:, col] = q.to(torch.uint8)
            err = (w - scale * (q - zero)) / Hinv1[i, i]
            W1[:, i:] -= err.unsqueeze(1) * Hinv1[i, i:]
            Err1[:, i] = err
        W[:, i2:] -= Err1.matmul(Hinv[i1:i2, i2:])
    return codes, torch.stack(scales, 1), torch.stack(zeros, 1), used


__all__ = ["BLOCK", "HessianSum", "solve"]
