"""The quality report: OUT/report.json and the table `orin-omni quantize` prints.

Per layer type (thinker.attn.q_proj, thinker.experts.down_proj, vision.mlp.linear_fc2, talker.shared_expert.
down_proj, ...): the relative Frobenius error ||X W_q^T - X W^T|| / ||X W^T|| of the layer's outputs against BF16
on HELD-OUT calibration inputs (conversations that fed no Hessian), for GPTQ and for round-to-nearest on the same
inputs, pooled over every module of that type. The inputs are those the layer sees in the model quantized up to
that point (GPTQ runs layer by layer), so both numbers are what that layer adds.

Per segment, end to end on the held-out conversations, teacher-forced: the thinker's logits cosine and top-1
agreement against BF16, the talker's greedy codec-token agreement (its inputs built by BF16 generate()), and
the cosine of the vision (and, if quantized, audio) encoder outputs. Starved experts are listed with their
calibration token counts and how they were quantized. Each segment's "calibration" entry says which
conversations calibrated and were held out (planned, then per pass) and lists the skipped ones ("skipped": origin,
pass, reason; "skipped_counts" per pass).
"""

from __future__ import annotations

from pathlib import Path

import torch

from orin.fsutil import atomic_write_json

from .writer import read_json

REPORT_NAME = "report.json"


# ---------------------------------------------------------------------- metrics


def _cosine_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


LOGIT_ROWS = 1024  # positions compared at a time: a long conversation's logits in float32 are gigabytes


class LogitsAgreement:
    """Per-position cosine and top-1 agreement of thinker logits, added one conversation at a time."""

    def __init__(self):
        self.cos, self.agree, self.positions, self.conversations = 0.0, 0, 0, 0

    def add(self, ref: torch.Tensor, now: torch.Tensor) -> None:
        for r in range(0, ref.shape[0], LOGIT_ROWS):
            a, b = ref[r:r + LOGIT_ROWS], now[r:r + LOGIT_ROWS]
            self.cos += float(_cosine_rows(a, b).sum())
            self.agree += int((a.float().argmax(-1) == b.float().argmax(-1)).sum())
        self.positions += ref.shape[0]
        self.conversations += 1

    def to_json(self) -> dict:
        if not self.positions:
            return {}
        return {"logits_cosine": self.cos / self.positions, "top1_agreement": self.agree / self.positions,
                "positions": self.positions, "conversations": self.conversations}


def logits_metrics(reference: dict, current: dict) -> dict:
    """Mean per-position cosine and top-1 agreement of thinker logits over the held-out conversations."""
    agreement = LogitsAgreement()
    for name, ref in reference.items():
        agreement.add(ref.logits, current[name].logits)
    return agreement.to_json()


def encoder_metric(reference: dict, current: dict, attr: str) -> dict:
    """Mean per-token cosine and relative error ||out - ref|| / ||ref|| of an encoder's output (vision or audio)
    over the held-out conversations that use it."""
    cos, tokens, err_sq, ref_sq = 0.0, 0, 0.0, 0.0
    for name, ref in reference.items():
        a, b = getattr(ref, attr), getattr(current[name], attr)
        if a is None or b is None:
            continue
        cos += float(_cosine_rows(a, b).sum())
        err_sq += float((b.float() - a.float()).pow(2).sum())
        ref_sq += float(a.float().pow(2).sum())
        tokens += a.shape[0]
    if not tokens:
        return {}
    return {f"{attr}_cosine": cos / tokens, f"{attr}_relative_error": (err_sq / ref_sq) ** 0.5 if ref_sq else None,
            f"{attr}_tokens": tokens}


def codec_metrics(reference: dict, current: dict) -> dict:
    """Greedy codec-token agreement of the talker (teacher-forced on the BF16 talker inputs)."""
    agree, positions = 0, 0
    for name, ref in reference.items():
        now = current[name]
        agree += int((ref == now).sum())
        positions += ref.numel()
    return {"codec_token_agreement": agree / positions, "codec_positions": positions,
            "conversations": len(reference)} if positions else {}


# ---------------------------------------------------------------------- report.json


def segment_report(types: dict, starved: list[dict], metrics: dict, calibration: dict) -> dict:
    return {
        "layer_types": {name: stats.to_json() for name, stats in sorted(types.items())},
        "metrics": metrics,
        "starved_experts": starved,
        "calibration": calibration,
    }


def load_report(out: str | Path) -> dict | None:
    data = read_json(Path(out) / REPORT_NAME)
    return data if isinstance(data, dict) and isinstance(data.get("segments"), dict) else None


def update_report(out: str | Path, segment: str, entry: dict, header: dict) -> dict:
    """Add (or replace) one segment's entry in OUT/report.json, atomically; other segments' entries stay."""
    report = load_report(out) or {"segments": {}}
    report.update(header)
    report["segments"][segment] = entry
    atomic_write_json(Path(out) / REPORT_NAME, report)
    return report


def update_run(out: str | Path, figures: dict) -> None:
    """Record the last run's figures (memory plan, wall time per stage, memory peaks) in OUT/report.json."""
    report = load_report(out) or {"segments": {}}
    report["run"] = figures
    atomic_write_json(Path(out) / REPORT_NAME, report)


def drop_segments(out: str | Path, keep: set[str]) -> None:
    report = load_report(out)
    if report is not None:
        report["segments"] = {k: v for k, v in report["segments"].items() if k in keep}
        atomic_write_json(Path(out) / REPORT_NAME, report)


# ---------------------------------------------------------------------- the printed table


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.4f}"


def render_report(report: dict) -> str:
    sym = report.get("quantization", {}).get("sym")
    other = "RTN asym" if sym else "RTN sym"
    lines = [f"{'layer type':<36}{'modules':>8}{'GPTQ err':>10}{'RTN err':>10}{'GPTQ/RTN':>10}{other:>10}  (held-out "
             f"output error vs BF16; {'symmetric' if sym else 'asymmetric'}, the last column with the other symmetry)"]
    lines.append("-" * len(lines[0]))
    starved_all = []
    for seg, entry in report.get("segments", {}).items():
        for name, t in entry.get("layer_types", {}).items():
            g, r = t.get("gptq_error"), t.get("rtn_error")
            ratio = f"{g / r:.2f}" if g is not None and r else "-"
            lines.append(f"{name:<36}{t.get('modules', 0):>8}{_fmt(g):>10}{_fmt(r):>10}{ratio:>10}"
                         f"{_fmt(t.get('rtn_other_sym_error')):>10}")
        starved_all += [dict(s, segment=seg) for s in entry.get("starved_experts", [])]
    lines.append("")
    for seg, entry in report.get("segments", {}).items():
        m = entry.get("metrics", {})
        parts = []
        if "logits_cosine" in m:
            parts.append(f"thinker logits cosine {m['logits_cosine']:.4f}, top-1 agreement "
                         f"{100 * m['top1_agreement']:.1f}% ({m['positions']} positions)")
        if "codec_token_agreement" in m:
            parts.append(f"talker codec-token agreement {100 * m['codec_token_agreement']:.1f}% "
                         f"({m['codec_positions']} positions)")
        for enc in ("vision", "audio"):
            if f"{enc}_cosine" in m:
                parts.append(f"{enc} encoder output cosine {m[f'{enc}_cosine']:.5f} (relative error "
                             f"{_fmt(m.get(f'{enc}_relative_error'))})")
        lines.append(f"segment {seg}: " + ("; ".join(parts) if parts else "no end-to-end metric"))
    skipped = {(k["origin"], k["pass"]): k["reason"] for entry in report.get("segments", {}).values()
               for k in entry.get("calibration", {}).get("skipped", [])}
    if skipped:
        lines.append("")
        lines.append(f"skipped calibration conversations: {len(skipped)}")
        for (origin, stage), reason in list(skipped.items())[:10]:
            lines.append(f"  {origin} ({stage}): {reason}")
        if len(skipped) > 10:
            lines.append(f"  ... and {len(skipped) - 10} more (see report.json)")
    if starved_all:
        lines.append("")
        lines.append(f"starved experts (fewer calibration tokens than the threshold): {len(starved_all)}")
        for s in starved_all[:20]:
            lines.append(f"  {s['module']} expert {s['expert']}: {s['tokens']} tokens -> {s['handled']}")
        if len(starved_all) > 20:
            lines.append(f"  ... and {len(starved_all) - 20} more (see report.json)")
    return "\n".join(lines)
