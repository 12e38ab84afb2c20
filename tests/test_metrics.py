"""Prometheus text rendering from engine reports."""

from __future__ import annotations

import re
from dataclasses import replace

from orin.contract import Report, Swap
from orin.power.energy import Energy, EnergyReport
from orin.serve.metrics import Metrics, escape_label, format_value, parse_metrics, process_rss_bytes


def _energy(joules, mean_w=None, peak_w=None) -> Energy:
    return Energy(joules, mean_w, peak_w, 1.0, covered_seconds=1.0 if joules is not None else 0.0)


def _report(**overrides) -> Report:
    fields = dict(text="x", prompt_tokens=40, completion_tokens=8, token_ids=tuple(range(8)), ttft_s=0.3,
                  first_audio_s=0.9, tokens_per_s=12.5, total_s=2.0, talker_frames=19, talker_s=0.5,
                  audio_seconds=1.5, peak_bytes=3 << 30, budget_bytes=None, device="cpu", schedule=(),
                  streaming_speech=True, swaps=(), resident_after=(), cancelled=False, finish_reason="stop",
                  energy=EnergyReport("request", "none", ("none",), _energy(None)))
    return Report(**{**fields, **overrides})


REPORT = _report(
    swaps=(Swap("talker", "in", 100, 0.5), Swap("talker", "in", 50, 0.25), Swap("thinker_text", "out", 7, 0.1)),
    energy=EnergyReport("request", "jtop", ("jtop",), _energy(12.0, 20.0, 31.5),
                        by_stage={"thinker_decode": _energy(8.0), "talker": _energy(4.0)}),
)

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
    m.generation(replace(REPORT, cancelled=True, finish_reason="cancelled", energy=_report().energy), 1.0)
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


def test_out_of_memory_answers_are_counted_by_when():
    """Both kinds are always exposed (a dashboard's rate() needs the zero): allocations that failed while a request
    ran, and requests admission refused until more memory is free."""
    m = Metrics()
    s = parse_metrics(_render(m))
    assert s['orin_out_of_memory_total{when="running"}'] == 0 and s['orin_out_of_memory_total{when="admission"}'] == 0
    m.out_of_memory(tried=True)
    m.out_of_memory(tried=True)
    m.out_of_memory(tried=False)
    text = _render(m)
    assert "# TYPE orin_out_of_memory_total counter" in text
    s = parse_metrics(text)
    assert s['orin_out_of_memory_total{when="running"}'] == 2 and s['orin_out_of_memory_total{when="admission"}'] == 1


def test_unmeasured_report_fields_are_left_out():
    m = Metrics()
    m.generation(_report(ttft_s=None, first_audio_s=None, tokens_per_s=None), 0.5)
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


def test_a_response_is_counted_once_its_last_byte_is_sent():
    """The access log counts a request when its last body message goes out, not when the app returns (a
    streamed answer's app may still be winding down its engine run): a client holding its whole answer finds
    it in /metrics. A request whose app returns without a body is counted at its end."""
    import asyncio
    from types import SimpleNamespace

    from orin.serve.routes import AccessLog

    metrics = Metrics()
    seen_after_last_byte: list[dict] = []
    release = asyncio.Event()

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"audio", "more_body": False})
        await release.wait()

    async def send(message):
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            seen_after_last_byte.append(dict(metrics.requests))

    async def main():
        log = AccessLog(app, SimpleNamespace(metrics=metrics))
        scope = {"type": "http", "method": "POST", "path": "/v1/audio/speech", "client": ("127.0.0.1", 1)}
        task = asyncio.ensure_future(log(scope, None, send))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        release.set()
        await task

    asyncio.run(main())
    assert seen_after_last_byte == [{("/v1/audio/speech", 200): 1}]
    assert metrics.requests == {("/v1/audio/speech", 200): 1}  # once, not again when the app returns
