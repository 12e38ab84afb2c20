"""Prometheus text rendering from engine reports."""

from __future__ import annotations

import re

from orin.metrics import Metrics, escape_label, format_value, parse_metrics, process_rss_bytes

REPORT = {
    "ttft_s": 0.3, "first_audio_s": 0.9, "tokens_per_s": 12.5, "prompt_tokens": 40, "completion_tokens": 8,
    "audio_seconds": 1.5, "peak_bytes": 3 << 30, "cancelled": False,
    "swaps": [{"component": "talker", "direction": "in", "bytes": 100, "seconds": 0.5},
              {"component": "talker", "direction": "in", "bytes": 50, "seconds": 0.25},
              {"component": "thinker_text", "direction": "out", "bytes": 7, "seconds": 0.1}],
    "energy": {"backend": "jtop", "joules": 12.0, "mean_w": 20.0, "peak_w": 31.5,
               "by_stage": {"thinker_decode": {"joules": 8.0}, "talker": {"joules": 4.0}}},
}

# One sample line of the 0.0.4 text format: name, optional labels, a number.
SAMPLE = re.compile(r'^[a-zA-Z_:][a-zA-Z0-9_:]*(\{([a-zA-Z_][a-zA-Z0-9_]*="([^"\\]|\\.)*",?)*\})? '
                    r'(-?[0-9.e+-]+|NaN|[+-]Inf)$')


def _render(m: Metrics) -> str:
    return m.render(model="tiny", ready=True, in_flight=1, queued=2,
                    memory={"resident_bytes": 1000, "allocated_bytes": 1500, "budget": 4096}, rss_bytes=123)


def test_every_line_is_valid_exposition_format():
    m = Metrics()
    m.request("/v1/chat/completions", 200)
    m.generation(REPORT, 2.0)
    text = _render(m)
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        assert SAMPLE.match(line), line


def test_values_from_reports():
    m = Metrics()
    m.request("/v1/chat/completions", 200)
    m.request("/v1/chat/completions", 200)
    m.request("/v1/chat/completions", 400)
    m.queue_full()
    m.generation(REPORT, 2.0)
    m.generation({**REPORT, "cancelled": True, "energy": {"backend": "none", "joules": None}}, 1.0)
    s = parse_metrics(_render(m))
    assert s['orin_requests_total{endpoint="/v1/chat/completions",status="200"}'] == 2
    assert s['orin_requests_total{endpoint="/v1/chat/completions",status="400"}'] == 1
    assert s["orin_requests_rejected_queue_full_total"] == 1
    assert s["orin_requests_cancelled_total"] == 1
    assert s["orin_ttft_seconds_count"] == 2
    assert s['orin_ttft_seconds_bucket{le="0.25"}'] == 0
    assert s['orin_ttft_seconds_bucket{le="0.5"}'] == 2
    assert s['orin_ttft_seconds_bucket{le="+Inf"}'] == 2
    assert abs(s["orin_ttft_seconds_sum"] - 0.6) < 1e-9
    assert s["orin_completion_tokens_total"] == 16
    assert s["orin_last_decode_tokens_per_second"] == 12.5
    assert s['orin_swaps_total{component="talker",direction="in"}'] == 4
    assert s['orin_swap_bytes_total{component="talker",direction="in"}'] == 300
    assert s['orin_energy_joules_total{backend="jtop"}'] == 12
    assert 'orin_energy_joules_total{backend="none"}' not in s  # unmeasured is absent, never zero
    assert s['orin_stage_energy_joules_total{stage="talker"}'] == 4
    assert s['orin_power_watts{backend="jtop"}'] == 20
    assert s['orin_power_peak_watts{backend="jtop"}'] == 31.5
    assert s["orin_memory_resident_bytes"] == 1000
    assert s["orin_memory_budget_bytes"] == 4096
    assert s["orin_memory_peak_bytes"] == 3 << 30
    assert s["orin_process_resident_memory_bytes"] == 123
    assert s["orin_requests_in_flight"] == 1 and s["orin_queue_depth"] == 2
    assert s['orin_up{model="tiny"}'] == 1


def test_missing_report_fields_are_tolerated():
    m = Metrics()
    m.generation({}, 0.5)
    s = parse_metrics(m.render(model="x", ready=False, in_flight=0, queued=0, memory=None, rss_bytes=None))
    assert s["orin_ttft_seconds_count"] == 0
    assert s["orin_generation_seconds_count"] == 1
    assert "orin_memory_resident_bytes" not in s
    assert s['orin_up{model="x"}'] == 0


def test_formatting_helpers():
    assert escape_label('a"b\\c\nd') == 'a\\"b\\\\c\\nd'
    assert format_value(3.0) == "3" and format_value(0.25) == "0.25"
    assert format_value(float("inf")) == "+Inf" and format_value(float("nan")) == "NaN"


def test_rss_reads_proc(tmp_path):
    assert (process_rss_bytes() or 0) > 0
    assert process_rss_bytes(str(tmp_path)) is None
