"""The own GPTQ solver's batches (quantize/gptq_solve.py: solve_batched), which a MoE layer's experts go through:
each matrix of a batch comes out as `solve` gives it alone (its own grid, dead columns and damping), within the
working set the memory plan counts; and a MoE layer quantized batch by batch (quantize/sequential.py) writes what
the per-expert path writes, starved and token-less experts included. CPU, float32, seconds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from allocations import Allocations

from orin.checkpoint.targets import Target
from orin.errors import InputError
from quantize import adapters as A
from quantize import gptq_solve
from quantize.gptq import GPTQSolver, QuantResult
from quantize.sequential import StackOptions, StackQuantizer

pytestmark = pytest.mark.usefixtures("single_torch_thread")


def _hessian(K: int, rows: int, gen: torch.Generator, dead: tuple[int, ...] = ()) -> torch.Tensor:
    """2/n·XᵀX of correlated random inputs, as a layer's are; `dead` columns no input reaches."""
    x = torch.randn(rows, K, generator=gen) @ (torch.eye(K) + torch.randn(K, K, generator=gen) / K**0.5)
    x[:, list(dead)] = 0
    return x.t() @ x * (2.0 / rows)


def _indefinite(H: torch.Tensor, low: float) -> torch.Tensor:
    """H with its smallest eigenvalue moved to `low`·mean(diag): its factorisation needs more damping."""
    values, vectors = torch.linalg.eigh(H)
    values[0] = low * H.diagonal().mean()
    H = (vectors * values) @ vectors.t()
    return (H + H.t()) / 2


def _batch(B: int, N: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """B weights and Hessians: one with dead columns, one that needs more damping than the rest, one with no
    input at all (every column dead)."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.randn(B, N, K, generator=gen) * 0.05
    H = torch.stack([_hessian(K, 200 + 40 * b, gen, dead=(3, K - 1) if b == 1 else ()) for b in range(B)])
    H[2] = _indefinite(H[2], -0.08)
    H[3] = 0
    return weights, H


def _dequantized(codes, scales, zeros, group_size: int) -> torch.Tensor:
    group = torch.arange(codes.shape[-1]) // group_size
    return (codes.float() - zeros[..., group]) * scales[..., group]


@pytest.mark.parametrize(("N", "K", "group_size", "sym", "block"), [
    (24, 256, 64, True, 128),  # groups inside a block
    (16, 192, 32, False, 64),  # asymmetric; three blocks of two groups
    (8, 96, 32, True, 128),  # one block shorter than BLOCK
])
def test_a_batch_is_each_matrix_solved_alone(N, K, group_size, sym, block):
    weights, H = _batch(5, N, K, seed=N + K)
    codes, scales, zeros, damps = gptq_solve.solve_batched(weights, H.clone(), 4, group_size, sym, 0.05, block)
    assert codes.dtype == torch.uint8 and codes.shape == (5, N, K)
    assert scales.shape == zeros.shape == (5, N, K // group_size) and scales.dtype == torch.float32
    for b in range(5):
        c, s, z, d = gptq_solve.solve(weights[b], H[b].clone(), 4, group_size, sym, 0.05, block)
        assert d == damps[b]
        # the same float operations, but the batched matmul may sum in another order: a code on a rounding
        # boundary may go the other way
        assert (codes[b] == c).float().mean() >= 0.999
        torch.testing.assert_close(scales[b], s)
        torch.testing.assert_close(zeros[b], z)
        torch.testing.assert_close(_dequantized(codes[b], scales[b], zeros[b], group_size),
                                   _dequantized(c, s, z, group_size), atol=1e-3, rtol=0)
    # each matrix its own damping: only the indefinite one got more
    assert damps[2] > 0.05 and damps[:2] + damps[3:] == [0.05] * 4
    assert torch.equal(codes[1][:, [3, K - 1]], zeros[1][:, [3 // group_size, (K - 1) // group_size]].to(torch.uint8))
    assert torch.equal(_dequantized(codes[3], scales[3], zeros[3], group_size), torch.zeros(N, K))


def test_a_byte_limit_splits_the_batch_without_changing_it():
    weights, H = _batch(5, 16, 128, seed=1)
    whole = gptq_solve.solve_batched(weights, H.clone(), 4, 32, True, 0.05)
    limit = 2 * gptq_solve.working_bytes(16, 128, 32)
    assert gptq_solve.batch_size(16, 128, 32, limit) == 2
    split = gptq_solve.solve_batched(weights, H.clone(), 4, 32, True, 0.05, max_bytes=limit)
    for a, b in zip(whole[:3], split[:3], strict=True):
        assert torch.equal(a, b)
    assert whole[3] == split[3]
    assert gptq_solve.batch_size(16, 128, 32, 1) == 1  # one matrix over the limit is still solved


def test_a_hessian_no_damping_makes_definite_fails_clearly():
    weights, H = _batch(4, 8, 64, seed=2)
    H[1] = _indefinite(H[1], -2.0)
    with pytest.raises(InputError, match="not positive definite at any damping below 1.0"):
        gptq_solve.solve_batched(weights, H, 4, 32, True, 0.05)


@pytest.mark.parametrize(("N", "K"), [(96, 64), (32, 256)])
def test_the_working_set_is_what_the_plan_counts(N, K):
    """A batch's peak beside its inputs (the weights as given and the Hessians are the caller's: working_bytes
    counts them, and the BF16 read of the weights before) stays within batch_size x working_bytes."""
    B, g = 4, 32
    weights, H = _batch(B, N, K, seed=3)
    limit = 3 * gptq_solve.working_bytes(N, K, g)
    given = weights.nbytes + H.nbytes + B * N * K * 2
    peak = Allocations()
    with peak.mode():
        gptq_solve.solve_batched(weights, H, 4, g, True, 0.05, max_bytes=limit)
    assert gptq_solve.batch_size(N, K, g, limit) == 3
    assert 0 < peak.peak + given * 3 // B <= limit


# ---------------------------------------------------------------------- a MoE layer, per expert and in batches

E, HIDDEN, INTER, TOP_K = 8, 64, 32, 2
TARGET = Target("thinker.model.layers.0.mlp.experts", "thinker_text", "experts", HIDDEN, HIDDEN, False, E, INTER)


class _Experts(torch.nn.Module):
    """A fused experts module as transformers lays it out: [gate; up] stacked, not transposed, no bias."""

    def __init__(self, gen: torch.Generator):
        super().__init__()
        gate_up = torch.randn(E, 2 * INTER, HIDDEN, generator=gen) * 0.05
        gate_up[2, 5] = 0  # expert 2's unit 5 never fires: a dead column of its down_proj's Hessian
        self.gate_up_proj = torch.nn.Parameter(gate_up.to(torch.bfloat16), requires_grad=False)
        self.down_proj = torch.nn.Parameter((torch.randn(E, HIDDEN, INTER, generator=gen) * 0.05).to(torch.bfloat16),
                                            requires_grad=False)
        self.act_fn = F.silu


def _calls(gen: torch.Generator, tokens: int) -> list:
    """Calls of the experts module: hidden states and each token's TOP_K experts. The router never picks expert
    0 and picks expert 1 for 4 tokens only; hidden unit 7 is always zero (a dead column of gate/up)."""
    calls = []
    for rows in (tokens // 2, tokens - tokens // 2):
        hidden = torch.randn(rows, HIDDEN, generator=gen)
        hidden[:, 7] = 0
        scores = torch.rand(rows, E, generator=gen)
        scores[:, 0] = -1
        scores[:, 1] = -1
        index = scores.topk(TOP_K, dim=-1).indices
        calls.append((hidden.to(torch.bfloat16), index))
    calls[0][1][:4, 1] = 1
    return calls


class _Bar:
    def __init__(self):
        self.n = 0

    def update(self, n: int) -> None:
        self.n += n


def _quantize_layer(batch_bytes: int, starved: str, min_tokens: int, calibrated: bool, monkeypatch
                    ) -> tuple[StackQuantizer, _Experts, list[int]]:
    gen = torch.Generator().manual_seed(5)
    module = _Experts(gen)
    calib, heldout = _calls(gen, 300), _calls(gen, 120)
    batches: list[int] = []
    real = gptq_solve.solve_batched

    def counted(weights, *args, **kwargs):
        batches.append(weights.shape[0])
        return real(weights, *args, **kwargs)

    monkeypatch.setattr(gptq_solve, "solve_batched", counted)
    solver = GPTQSolver(4, 32, 0.05, "cpu", True, "own", batch_bytes=batch_bytes)
    q = StackQuantizer(None, A.STACK_OF["thinker_text"], solver, StackOptions(4, 32, min_tokens, starved, True),
                       None)
    for kind in ("experts_gate_up", "experts_down"):  # down calibrated on the quantized gate and up
        bar = _Bar()
        q._experts(module, A.Member("mlp.experts", kind, TARGET), calib if calibrated else [], heldout, bar)
        assert bar.n == E
    return q, module, batches


def _result(q: StackQuantizer, key: str) -> QuantResult:
    K = INTER if key.endswith("down_proj") else HIDDEN
    return QuantResult.unpack({k.rpartition(".")[2]: v for k, v in q.result.tensors.items()
                               if k.rpartition(".")[0] == key}, K)


def _assert_same_layer(q: StackQuantizer, module: _Experts, one: StackQuantizer, one_module: _Experts) -> None:
    """The same report entries, tensors stored in the same order, codes but for rounding ties, written weights."""
    assert q.result.starved == one.result.starved and q.result.quantized == one.result.quantized
    assert list(q.result.tensors) == list(one.result.tensors)
    for name, a in one.result.tensors.items():
        assert a.dtype == q.result.tensors[name].dtype and a.shape == q.result.tensors[name].shape
    for key in {k.rpartition(".")[0] for k in one.result.tensors}:
        a, b = _result(one, key), _result(q, key)
        assert (a.codes == b.codes).float().mean() >= 0.999
        assert torch.equal(a.zeros, b.zeros)
        torch.testing.assert_close(a.scales, b.scales)
    for name in ("gate_up_proj", "down_proj"):
        assert (getattr(module, name) == getattr(one_module, name)).float().mean() >= 0.999
    assert q.result.types.keys() == one.result.types.keys()
    for name, want in one.result.types.items():
        got = q.result.types[name]
        assert (got.modules, got.rtn_modules, got.calib_rows) == (want.modules, want.rtn_modules, want.calib_rows)
        assert got.gptq.relative == pytest.approx(want.gptq.relative, rel=1e-3)
        assert (got.rtn.relative, got.rtn_other.relative) == (want.rtn.relative, want.rtn_other.relative)


@pytest.mark.parametrize(("starved", "min_tokens", "calibrated", "solved"), [
    ("all-tokens", 20, True, 8),  # experts 0 and 1 starved, calibrated on all 300 tokens (one shared Hessian)
    ("rtn", 20, True, 6),  # ... or rounded to nearest
    ("all-tokens", 0, True, 7),  # none starved: expert 1 on its 4 tokens, expert 0 on none (RTN)
    ("all-tokens", 20, False, 0),  # no calibration call reached the layer: every expert RTN
])
def test_a_moe_layer_in_batches_writes_what_one_expert_at_a_time_writes(starved, min_tokens, calibrated, solved,
                                                                         monkeypatch):
    one, one_module, one_batches = _quantize_layer(0, starved, min_tokens, calibrated, monkeypatch)
    assert set(one_batches) <= {1} and len(one_batches) == 3 * solved  # today's path: a task per matrix
    assert one.result.types["thinker.experts.gate_proj"].rtn_modules == E - solved
    assert [s["expert"] for s in one.result.starved] == ([] if not min_tokens else [0, 1] if calibrated
                                                          else list(range(E)))
    pair = 2 * gptq_solve.working_bytes(2 * INTER, HIDDEN, 32)  # two experts' gate and up a batch, four downs
    for batch_bytes, sizes in ((gptq_solve.BATCH_BYTES, (E, E)), (pair, (2, 4))):
        q, module, batches = _quantize_layer(batch_bytes, starved, min_tokens, calibrated, monkeypatch)
        assert batches == [min(size, solved - i) for size in sizes for i in range(0, solved, size)]
        _assert_same_layer(q, module, one, one_module)
