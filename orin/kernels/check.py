"""orin's Triton kernels against their torch references on a tiny problem, once per device, before any of them
is chosen: the MoE's "triton" backend (orin.int4.moe) is built only where every kernel it and its layer run
compiles here and computes what the torch ops do. A kernel that fails is never switched off halfway through a
request: its backend is simply not chosen (one log line), and the torch backend runs from the start.

Import only on a CUDA device with Triton installed (orin.device.capabilities.triton_installed).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger("orin.kernels")

# The problem's widths: 8 inner k-tiles (K a multiple of 128: the grouped GEMM's layout, as at every real layer),
# the real checkpoints' group, the thinker's 128 experts and top-8, its head_dim: the check mostly compiles the
# specialisations the model then runs (Triton keeps them on disk), on a few rows.
_E, _K, _N, _GROUP, _ROWS, _TOL = 4, 256, 64, 128, 24, 2e-2
_EXPERTS, _TOP_K, _HEAD_DIM = 128, 8, 128

_PASSED: dict[int, bool] = {}


def passes(device: torch.device) -> bool:
    """Whether orin's Triton kernels compile and compute their torch references on `device`: run once per device
    (the result is kept for the process), a failure logged once."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _PASSED:
        try:
            run(torch.device("cuda", index))
            _PASSED[index] = True
        except Exception as exc:  # noqa: BLE001 - a kernel that cannot build or is wrong must not stop the engine
            log.warning("orin's Triton kernels failed their start-up check on cuda:%d (%s: %s); the torch "
                        "backend runs instead", index, type(exc).__name__, exc)
            _PASSED[index] = False
    return _PASSED[index]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _same(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    err = _rel(got, want)
    if not err <= _TOL:
        raise RuntimeError(f"{name} differs from its torch reference (relative error {err:.3g})")


def _packed(device, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """_E random experts [N, K] in torch's CUDA int4pack layout, and their scales and zeros."""
    from ..int4.pack import _inner_k_tiles

    codes = torch.randint(0, 256, (_E, _N, _K // 2), generator=gen, device=device, dtype=torch.int32)
    tiles = _inner_k_tiles(_K)
    packed = torch.stack([torch.ops.aten._convert_weight_to_int4pack(c.to(torch.uint8).contiguous(), tiles)
                          for c in codes])
    scales = torch.rand((_E, _K // _GROUP, _N), generator=gen, device=device) * 0.01 + 0.001
    zeros = (torch.rand((_E, _K // _GROUP, _N), generator=gen, device=device) - 0.5) * 0.02
    return packed, torch.stack([scales, zeros], dim=-1).to(torch.bfloat16)


def run(device: torch.device) -> None:
    """Each kernel once against its reference; raises where one fails to build or differs."""
    from ..int4.pack import _dequantize, check_cuda_layout, int4_mm
    from . import int4_gemm, moe_combine, norm_rope, router, silu_mul

    gen = torch.Generator(device=device).manual_seed(0)
    packed, sz = _packed(device, gen)
    check_cuda_layout(packed)
    dense = _dequantize(packed, sz, _GROUP)
    _same("the INT4 dequantization", int4_gemm.dequantize(packed, sz, _GROUP), dense)

    counts = [9, 0, 11, 4]
    x = torch.randn((_ROWS, _K), generator=gen, device=device).to(torch.bfloat16)
    ends = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    want, start = [], 0
    for e, c in enumerate(counts):
        if c:
            want.append(int4_mm(x[start:start + c].contiguous(), packed[e], _GROUP, sz[e]))
            start += c
    _same("the grouped INT4 GEMM", int4_gemm.grouped_int4_mm(x, packed, sz, _GROUP, ends)[:start], torch.cat(want))

    sel = torch.tensor([3, 0], device=device)
    got = torch.ops.orin.int4_moe_gemv(x[:1], packed, sz, sel, _GROUP).sum(0)
    _same("the MoE GEMV", got, torch.cat([int4_mm(x[:1].contiguous(), packed[e], _GROUP, sz[e]) for e in (3, 0)]))

    # distinct logits (ties pick the lowest id here, any in torch.topk), exact in the layer's dtype
    logits = torch.stack([torch.randperm(_EXPERTS, generator=gen, device=device) for _ in range(5)]) / 16
    logits = logits.to(torch.bfloat16)
    top_w, top_i = router.softmax_topk(logits, _TOP_K)
    want_w, want_i = torch.topk(torch.softmax(logits.float(), dim=-1), _TOP_K, dim=-1)
    if not torch.equal(top_i, want_i):
        raise RuntimeError("the router's top-k picks other experts than torch.topk")
    _same("the router's softmax", top_w, want_w)

    gate_up = torch.randn((_ROWS, 2 * 48), generator=gen, device=device).to(torch.bfloat16)
    _same("the MoE activation", silu_mul.silu_mul(gate_up, 48, 64),
          F.pad(F.silu(gate_up[:, :48]) * gate_up[:, 48:], (0, 16)))

    T, k = 3, _TOP_K  # every token's k rows, in a random sort
    order = torch.randperm(T * k, generator=gen, device=device)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(T * k, device=device)
    out = torch.randn((T * k, _N), generator=gen, device=device).to(torch.bfloat16)
    weights = torch.rand(T * k, generator=gen, device=device).to(torch.bfloat16)
    into = torch.zeros((T, _N), device=device, dtype=torch.bfloat16)
    want = torch.zeros((T, _N), device=device).index_add_(0, order // k, out.float() * weights.float()[:, None])
    _same("the MoE combine", moe_combine.combine_block(into, out, weights, inv, 0, k), want)

    hd, half = _HEAD_DIM, _HEAD_DIM // 2
    y = torch.randn((T, 4, hd), generator=gen, device=device).to(torch.bfloat16)
    weight = torch.randn(hd, generator=gen, device=device).to(torch.bfloat16)
    angles = torch.rand((T, half), generator=gen, device=device)
    cos, sin = (torch.cat([f(angles)] * 2, -1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
    normed = (weight * F.rms_norm(y, (hd,), None, 1e-6)).transpose(0, 1)
    rotated = normed * cos + torch.cat((-normed[..., half:], normed[..., :half]), dim=-1) * sin
    _same("the query/key norm and rotary embedding",
          norm_rope.norm_rope_into(torch.empty((4, T, hd), device=device, dtype=torch.bfloat16), y, weight, 1e-6,
                                   cos, sin), rotated)
