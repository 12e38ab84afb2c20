"""orin-omni's own GPTQ solver (quantize/gptq_solve.py, for where GPTQModel does not install) against GPTQModel
7.6.0's on the same weights and inputs, and a whole quantize run on it."""

from __future__ import annotations

import json

import pytest
import torch
from fixture_checkpoints import TINY_QUANTIZE

from quantize.gptq import GPTQSolver, output_error, resolve_solver, rtn
from quantize.pipeline import QuantConfig, run_quantize


def _problem(N: int, K: int, rows: int, seed: int, dead: int = 0):
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(K, K, generator=gen) / K**0.5  # correlated inputs, as a layer's are
    x = torch.randn(rows, K, generator=gen) @ (torch.eye(K) + mix)
    if dead:
        x[:, -dead:] = 0  # columns no calibration token reaches: GPTQ zeroes their weights
    return torch.randn(N, K, generator=gen) * 0.05, x


def _solve(solver: str, w, x, group_size: int, sym: bool, shared: bool = False):
    s = GPTQSolver(4, group_size, 0.05, "cpu", sym, solver)
    task = s.task(w)
    if shared:  # gate/up: the second task takes the first one's Hessian
        leader = s.task(torch.zeros_like(w))
        for part in x.split(100):
            leader.add(part)
        task.adopt(leader)
    else:
        for part in x.split(100):
            task.add(part)
    return task.solve()


@pytest.mark.parametrize(("N", "K", "group_size", "sym", "dead", "shared"), [
    (64, 256, 128, True, 0, False),  # two blocks, a group each
    (48, 192, 64, True, 0, True),  # groups inside a block; a block of 64 at the end; an adopted Hessian
    (32, 200, 128, False, 0, False),  # K padded to 256; asymmetric
    (40, 256, 128, True, 7, False),  # dead input columns
])
def test_own_solver_matches_gptqmodel(N, K, group_size, sym, dead, shared):
    pytest.importorskip("gptqmodel")
    w, x = _problem(N, K, 700, seed=N + K, dead=dead)
    own, ref = _solve("own", w, x, group_size, sym, shared), _solve("gptqmodel", w, x, group_size, sym, shared)
    assert own.method == ref.method == "gptq" and own.nsamples == ref.nsamples == 700
    assert own.codes.shape == ref.codes.shape == (N, K) and own.group_size == ref.group_size
    assert torch.equal(own.zeros, ref.zeros)
    torch.testing.assert_close(own.scales.float(), ref.scales.float(), rtol=1e-3, atol=0)
    # the same algorithm in another float order: a code may round the other way where a value sits on a boundary
    assert (own.codes == ref.codes).float().mean() > 0.995
    if dead:
        assert torch.equal(own.dequantize()[:, -dead:], torch.zeros(N, dead))
    e_own, e_ref = output_error(x, w, own.dequantize()).relative, output_error(x, w, ref.dequantize()).relative
    e_rtn = output_error(x, w, rtn(w, 4, group_size, sym).dequantize()).relative
    assert e_own == pytest.approx(e_ref, rel=0.02) and e_own < 0.9 * e_rtn


def test_solver_choice_is_checked():
    from orin.errors import UsageError

    with pytest.raises(UsageError, match="--solver 'fast'"):
        resolve_solver("fast")
    assert resolve_solver("own") == "own"
    assert resolve_solver("auto") in ("gptqmodel", "own")


def test_quantize_runs_on_the_own_solver(tiny_model_dir, tmp_path):
    """The whole run (both segments) without GPTQModel's solver: the manifest names the solver, and the report's
    error ratios are GPTQ's (under round-to-nearest's on held-out inputs)."""
    out = tmp_path / "q"
    manifest = run_quantize(QuantConfig(model=tiny_model_dir, out=str(out), solver="own", **TINY_QUANTIZE))
    assert manifest.complete
    assert manifest.quantization["quantizer"].startswith("orin-omni ") and "gptq" in manifest.quantization["quantizer"]
    report = json.loads((out / "report.json").read_text())
    types = [t for seg in report["segments"].values() for t in seg["layer_types"].values()
             if t.get("gptq_error") is not None and t.get("rtn_error")]
    assert len(types) > 5
    assert sum(t["gptq_error"] for t in types) < sum(t["rtn_error"] for t in types)
