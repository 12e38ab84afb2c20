"""The long prefill's attention at the real widths on the lent GPU: which SDPA kernel serves a video prompt's
causal attention fastest, and whether it computes what the engine's path computes.

A 2 fps, 120 s clip is a ~25k-token prompt; its attention is half the thinker prefill's FLOPs (32 query heads
over 4 KV heads, head_dim 128). The engine (orin.runtime.attention._attend_after) runs it 4,096 queries at a time on
flash-attention 2 (lower-right causal over the cache's prefix); transformers' reference runs it in one call on
cuDNN's Hopper kernel. For each variant this prints ms per layer, the error against float32 math on a sample of
rows, and (cuDNN) the first call's time on a new shape, the plan it builds. JSON to stdout.

    python3 scripts/bench_long_attention.py [--tokens 25159] [--chunk 4096] [--heads 32 --kv-heads 4]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, n: int = 5) -> tuple[float, float, object]:
    """(first call ms, median ms of n more, last result)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    first = (time.perf_counter() - t0) * 1e3
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return first, sorted(times)[len(times) // 2], out


def reference_rows(q, k, v, rows: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 causal attention of the given query rows: [heads, len(rows), hd]."""
    rep = q.shape[0] // k.shape[0]
    kf, vf = k.float().repeat_interleave(rep, 0), v.float().repeat_interleave(rep, 0)
    s = torch.einsum("htd,hsd->hts", q[:, rows].float(), kf) * scale
    keep = torch.arange(k.shape[1], device=q.device)[None, :] <= rows[:, None]
    s = s.masked_fill(~keep[None], float("-inf"))
    return torch.einsum("hts,hsd->htd", s.softmax(-1), vf)


def lse_merge(o1, l1, o2, l2):
    """Two partial attentions over disjoint keys (outputs [.., T, hd], log-sum-exps [.., T]) into one."""
    m = torch.maximum(l1, l2)
    w1, w2 = (l1 - m).exp(), (l2 - m).exp()
    return ((o1.float() * w1[..., None] + o2.float() * w2[..., None]) / (w1 + w2)[..., None]).to(o1.dtype)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=25159)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    a = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    T, H, KV, D, C = a.tokens, a.heads, a.kv_heads, a.head_dim, a.chunk
    scale = D ** -0.5
    q = torch.randn(H, T, D, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(KV, T, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(KV, T, D, device=dev, dtype=torch.bfloat16, generator=g)
    rows = torch.tensor(sorted({0, 1, C - 1, C, C + 1, T // 2, T - 2, T - 1}), device=dev)
    want = reference_rows(q, k, v, rows, scale)
    out: dict = {"tokens": T, "chunk": C, "heads": H, "kv_heads": KV, "head_dim": D,
                 "torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "variants": {}}

    def record(name, fn, to_rows):
        try:
            first, ms, res = timed(fn)
            err = (to_rows(res)[:, rows].float() - want).abs().max().item()
            out["variants"][name] = {"first_ms": round(first, 2), "ms": round(ms, 2), "max_abs_err": err}
        except Exception as exc:  # noqa: BLE001 - a variant the build does not run is a finding
            out["variants"][name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        torch.cuda.empty_cache()

    kc, vc = k.unsqueeze(0), v.unsqueeze(0)

    def flash_chunked():  # the engine's path today
        res = torch.empty(T, H, D, device=dev, dtype=q.dtype)
        for s in range(0, T, C):
            e = min(T, s + C)
            res[s:e] = torch.ops.aten._flash_attention_forward(
                q[:, s:e].transpose(0, 1).unsqueeze(0), kc[:, :, :e].transpose(1, 2), vc[:, :, :e].transpose(1, 2),
                None, None, e - s, e, 0.0, True, False, scale=scale)[0][0]
        return res

    record("flash2_chunked_lower_right", flash_chunked, lambda r: r.transpose(0, 1))

    def sdpa_whole(backend, gqa):
        def run():
            kk, vv = (kc, vc) if gqa else (kc.repeat_interleave(H // KV, 1), vc.repeat_interleave(H // KV, 1))
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q.unsqueeze(0), kk, vv, is_causal=True, scale=scale,
                                                      enable_gqa=gqa)[0]
        return run

    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        for gqa in (True, False):
            record(f"sdpa_whole_{backend.name.lower()}_{'gqa' if gqa else 'repeated_kv'}", sdpa_whole(backend, gqa),
                   lambda r: r)

    def cudnn_chunked_is_causal(gqa):
        """cuDNN per chunk with is_causal over the keys so far: right only if its causal mask is lower-right."""
        def run():
            res = torch.empty(H, T, D, device=dev, dtype=q.dtype)
            for s in range(0, T, C):
                e = min(T, s + C)
                kk, vv = kc[:, :, :e], vc[:, :, :e]
                if not gqa:
                    kk, vv = kk.repeat_interleave(H // KV, 1), vv.repeat_interleave(H // KV, 1)
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    res[:, s:e] = F.scaled_dot_product_attention(q[:, s:e].unsqueeze(0), kk, vv, is_causal=True,
                                                                 scale=scale, enable_gqa=gqa)[0]
            return res
        return run

    record("cudnn_chunked_is_causal_gqa", cudnn_chunked_is_causal(True), lambda r: r)

    def cudnn_split_lse():
        """Per chunk: its own keys causally (square: no alignment question) and the prefix's keys unmasked, each
        with its log-sum-exp from aten's cuDNN op, merged. Shapes: the chunk, and multiples of it."""
        op = torch.ops.aten._scaled_dot_product_cudnn_attention
        res = torch.empty(H, T, D, device=dev, dtype=q.dtype)
        rep = H // KV
        for s in range(0, T, C):
            e = min(T, s + C)
            qs = q[:, s:e].unsqueeze(0)
            own = op(qs, kc[:, :, s:e].repeat_interleave(rep, 1), vc[:, :, s:e].repeat_interleave(rep, 1), None,
                     True, 0.0, True, False, scale=scale)
            if s == 0:
                res[:, s:e] = own[0][0]
                continue
            pre = op(qs, kc[:, :, :s].repeat_interleave(rep, 1), vc[:, :, :s].repeat_interleave(rep, 1), None,
                     True, 0.0, False, False, scale=scale)
            l1, l2 = own[1].reshape(1, H, e - s), pre[1].reshape(1, H, e - s)
            res[:, s:e] = lse_merge(own[0], l1, pre[0], l2)[0]
        return res

    record("cudnn_split_lse_repeated_kv", cudnn_split_lse, lambda r: r)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
