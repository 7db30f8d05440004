"""The fault scenario's restart figures: the router's share (from the engine's first health 200) apart from start-up."""

from __future__ import annotations

import json

import msgspec

from narwhal.tools.bench.report import BenchReport, FaultReport, format_report
from tests.test_bench import _run_report


def test_the_report_gives_eligible_after_its_health_returned_apart_from_after_restart() -> None:
    faults = FaultReport(
        killed_engine="d1", failing_engine="d2", failing_status=500, timeline=[], goodput=1.0,
        requests_lost=0, lost_by_kind={}, streams_cut=0, cut_with_error_event=0, cut_silently=0,
        attempts_on_dead_engine=1, dead_engine_last_attempt_s=0.01, dead_engine_ineligible_s=0.02,
        restarted_engine_eligible_s=0.52, restarted_engine_first_served_s=0.6,
        failing_engine_requests_during_fault=4, failing_engine_last_request_s=0.1,
        failing_engine_ineligible_s=0.1, restarted_engine_health_s=0.4,
        restarted_engine_eligible_after_health_s=0.12, restarted_engine_first_served_after_health_s=0.2)
    report = BenchReport(settings={}, run=_run_report("narwhal"), faults=faults)
    text = format_report(report)
    assert "restarted engine: health 200 after restart 0.40 s" in text
    assert "restarted engine: eligible after restart  0.52 s" in text
    assert "restarted engine: eligible after its health returned 0.12 s" in text
    assert "restarted engine: first served after its health returned 0.20 s" in text
    figures = json.loads(msgspec.json.encode(report))["faults"]
    assert figures["restarted_engine_eligible_after_health_s"] == 0.12


def test_figures_not_seen_say_so() -> None:
    faults = FaultReport(
        killed_engine="d1", failing_engine="d2", failing_status=500, timeline=[], goodput=1.0,
        requests_lost=0, lost_by_kind={}, streams_cut=0, cut_with_error_event=0, cut_silently=0,
        attempts_on_dead_engine=None, dead_engine_last_attempt_s=None, dead_engine_ineligible_s=None,
        restarted_engine_eligible_s=None, restarted_engine_first_served_s=None,
        failing_engine_requests_during_fault=None, failing_engine_last_request_s=None,
        failing_engine_ineligible_s=None)
    text = format_report(BenchReport(settings={}, run=_run_report("vllm-router"), faults=faults))
    assert "restarted engine: eligible after its health returned not seen" in text
