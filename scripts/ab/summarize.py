"""Before/after table from the bench JSONs one drive.sh command wrote: NAME-A.json (before, .base = 272f6af) and
NAME-B.json (after, the repo root), same card, same command.

  python3 scripts/ab/summarize.py OUT_DIR [> OUT_DIR/summary.txt]

Needs nothing but the standard library (runs on the device after the benches, or here on fetched files).
Columns: before, after, after/before - 1 (for times and peaks lower is better; for rates higher is better).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GiB = 1 << 30


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _fmt(v, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "GiB":
        return f"{v / GiB:.2f}"
    if unit == "s":
        return f"{v:.3f}"
    if unit == "ms":
        return f"{v * 1e3:.1f}"
    if isinstance(v, float):
        return f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def _row(label: str, a, b, unit: str = "") -> str:
    delta = ""
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a:
        delta = f"{(b / a - 1) * 100:+.1f}%"
    return f"| {label} | {_fmt(a, unit)} | {_fmt(b, unit)} | {delta} |"


def _get(d: dict | None, *path):
    for key in path:
        if not isinstance(d, dict):
            return None
        d = d.get(key)
    return d


STANDARD = [("TTFT s", "ttft_s", "s"), ("TTFT median of 4 s", "ttft_median_s", "s"),
            ("first audio s", "first_audio_s", "s"), ("thinker tok/s", "decode_tokens_per_s", ""),
            ("decode incl. talker tok/s", "decode_e2e_tokens_per_s", ""), ("talker frames/s", "talker_frames_per_s", ""),
            ("energy J", "energy_j", ""), ("peak GiB", "peak_bytes", "GiB"), ("total s", "total_s", "s"),
            ("load s", "load_s", "s"), ("warm-up s", "warmup_s", "s")]


def standard(a: dict, b: dict, key: str) -> list[str]:
    ra, rb = _get(a, "runs", key), _get(b, "runs", key)
    if not ra and not rb:
        return []
    out = [f"\n### {key} (the standard request)\n", "| figure | before | after | change |", "|---|---|---|---|"]
    out += [_row(label, _get(ra, k), _get(rb, k), unit) for label, k, unit in STANDARD]
    for side, r in (("before", ra), ("after", rb)):
        st = _get(r, "stages_s") or {}
        if st:
            out.append(f"\n{side} stages s: " + ", ".join(f"{k} {v:.3f}" for k, v in st.items()))
    return out


def kernels(a: dict, b: dict) -> list[str]:
    out = []
    for key in sorted(set((_get(a, "kernel_timings") or {}) | (_get(b, "kernel_timings") or {}))):
        if not key.startswith("decode_"):
            continue
        ta, tb = _get(a, "kernel_timings", key, "thinker_step"), _get(b, "kernel_timings", key, "thinker_step")
        if ta or tb:
            out.append(_row(f"{key}: thinker step wall ms (kernel timings)", _get(ta, "median_ms"), _get(tb, "median_ms")))
            out.append(_row(f"{key}: thinker step device ms", _get(ta, "device_ms_per_call"),
                            _get(tb, "device_ms_per_call")))
    return (["\n### kernel timings\n", "| figure | before | after | change |", "|---|---|---|---|"] + out) if out else []


def sliced(a: dict, b: dict) -> list[str]:
    def by_budget(d):
        out = {}
        for k, r in (_get(d, "runs") or {}).items():
            if "time_sliced" in k and isinstance(r, dict) and r.get("budget_bytes"):
                out[r["budget_bytes"]] = r
        return out

    ba, bb = by_budget(a), by_budget(b)
    out = []
    for budget in sorted(set(ba) | set(bb)):
        ra, rb = ba.get(budget), bb.get(budget)
        out += [f"\n### time-sliced, budget {budget / GiB:g} GiB (steady state = 3rd request)\n",
                "| figure | before | after | change |", "|---|---|---|---|"]
        for label, k, unit in (("TTFT s", "ttft_s", "s"), ("first audio s", "first_audio_s", "s"),
                               ("total s", "total_s", "s"), ("peak (allocator) GiB", "peak_bytes", "GiB"),
                               ("held from driver GiB", "peak_device_used_bytes", "GiB"),
                               ("reserved+mapped GiB", "peak_reserved_bytes", "GiB"),
                               ("swap-in GB/s", "swap_in_gb_s", ""),
                               ("swap-in foreground GB/s", "swap_in_foreground_gb_s", ""),
                               ("swapped in GB", "swap_in_bytes", "")):
            va, vb = _get(ra, k), _get(rb, k)
            if k == "swap_in_bytes":
                va, vb = (va / 1e9 if va else va), (vb / 1e9 if vb else vb)
            out.append(_row(label, va, vb, unit))
        out.append(_row("thinker tok/s", _get(ra, "decode_tokens_per_s"), _get(rb, "decode_tokens_per_s")))
        for which in ("first_request", "second_request"):
            out.append(_row(f"{which} TTFT s", _get(ra, which, "ttft_s"), _get(rb, which, "ttft_s"), "s"))
            out.append(_row(f"{which} first audio s", _get(ra, which, "first_audio_s"), _get(rb, which, "first_audio_s"),
                            "s"))
        for side, r in (("before", ra), ("after", rb)):
            if r:
                held = r.get("peak_device_used_bytes") or 0
                out.append(f"\n{side}: budget held: allocator peak {'yes' if (r.get('peak_bytes') or 0) <= budget else 'NO'}"
                           f", from the driver {'yes' if held <= budget else 'NO'}; steady captures "
                           f"{r.get('steady_captures')}")
    return out


def realtime(a: dict, b: dict) -> list[str]:
    ra, rb = _get(a, "realtime"), _get(b, "realtime")
    if not ra and not rb:
        return []
    out = ["\n### Realtime (per measured turn: engine TTFT, engine first audio, server time, prefill route)\n",
           "| turn | prompt tokens before/after | engine TTFT s before | after | first audio s before | after | "
           "server s before | after | prefill before | after |", "|---|---|---|---|---|---|---|---|---|---|"]
    ta, tb = (_get(ra, "turns") or []), (_get(rb, "turns") or [])
    for i in range(max(len(ta), len(tb))):
        x = ta[i] if i < len(ta) else {}
        y = tb[i] if i < len(tb) else {}
        out.append(f"| {i + 1} | {x.get('prompt_tokens')}/{y.get('prompt_tokens')} | {_fmt(x.get('engine_ttft_s'), 's')} | "
                   f"{_fmt(y.get('engine_ttft_s'), 's')} | {_fmt(x.get('engine_first_audio_s'), 's')} | "
                   f"{_fmt(y.get('engine_first_audio_s'), 's')} | {_fmt(x.get('server_s'), 's')} | "
                   f"{_fmt(y.get('server_s'), 's')} | {x.get('prefill_path')} | {y.get('prefill_path')} |")
    out += ["", "| figure | before | after | change |", "|---|---|---|---|",
            _row("server s median", _get(ra, "server_s_median"), _get(rb, "server_s_median"), "s"),
            _row("server s max", _get(ra, "server_s_max"), _get(rb, "server_s_max"), "s"),
            _row("voice to voice s median", _get(ra, "voice_to_voice_s_median"), _get(rb, "voice_to_voice_s_median"), "s"),
            _row("barge-in to done s", _get(ra, "barge_in", "to_done_s"), _get(rb, "barge_in", "to_done_s"), "s"),
            _row("audio encoder alone s", _get(ra, "audio_encoder_alone_s"), _get(rb, "audio_encoder_alone_s"), "s")]
    return out


def video(a: dict, b: dict) -> list[str]:
    ca, cb = _get(a, "video", "cases") or {}, _get(b, "video", "cases") or {}
    out = []
    for case in sorted(set(ca) | set(cb), reverse=True):  # video_2fps first
        ra, rb = _get(ca, case, "orin"), _get(cb, case, "orin")
        out += [f"\n### {case} (120 s at 448², one image + clip with soundtrack)\n", "| figure | before | after | change |",
                "|---|---|---|---|"]
        for label, k, unit in (("prompt tokens", "prompt_tokens", ""), ("TTFT s (best of 2)", "ttft_s", "s"),
                               ("first audio s", "first_audio_s", "s"), ("peak GiB", "peak_bytes", "GiB"),
                               ("encode s", "encode_s", "s"), ("thinker prefill s", "prefill_s", "s"),
                               ("talker prefill s", "talker_prefill_s", "s"), ("total s", "total_s", "s"),
                               ("energy J", "energy_j", "")):
            out.append(_row(label, _get(ra, k), _get(rb, k), unit))
        fa = (_get(ra, "first_audio_s") or 0) - (_get(ra, "ttft_s") or 0) if ra else None
        fb = (_get(rb, "first_audio_s") or 0) - (_get(rb, "ttft_s") or 0) if rb else None
        out.append(_row("first audio - TTFT s", fa, fb, "s"))
        out.append(f"\nTTFT both runs: before {_get(ra, 'ttft_s_both')}, after {_get(rb, 'ttft_s_both')}")
    return out


def main(out_dir: str) -> int:
    root = Path(out_dir)
    names = sorted({p.stem[:-2] for p in root.glob("*-[AB].json")})
    if not names:
        print(f"no NAME-A.json / NAME-B.json in {root}")
        return 1
    for name in names:
        a, b = _load(root / f"{name}-A.json") or {}, _load(root / f"{name}-B.json") or {}
        print(f"\n## {name}: before = A (.base, 272f6af), after = B (repo root)")
        gpu = _get(a, "meta", "gpu", "name") or _get(b, "meta", "gpu", "name")
        print(f"GPU {gpu}; torch {_get(a, 'meta', 'torch')}/{_get(b, 'meta', 'torch')}; "
              f"bench_s {_fmt(_get(a, 'bench_s'), '')}/{_fmt(_get(b, 'bench_s'), '')}")
        lines = []
        for key in ("orin_compiled", "orin_graph"):
            lines += standard(a, b, key)
        lines += realtime(a, b) + sliced(a, b) + video(a, b) + kernels(a, b)
        print("\n".join(lines))
        for side, d in (("before", a), ("after", b)):
            errs = _get(d, "errors")
            if errs:
                print(f"\n{side} ERRORS: {json.dumps(errs)[:1500]}")
            if not d:
                print(f"\n{side}: no JSON (the run did not start or was cut before its first part)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
