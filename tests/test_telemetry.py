"""Telemetry intervals: what the request path records, how rollover closes, how many are kept."""

from __future__ import annotations

import msgspec
import pytest

from narwhal.fleet.telemetry import EngineInterval, Telemetry, percentile

ENGINES = [("p1", "prefill"), ("p2", "prefill"), ("d1", "decode")]


def make(keep: int = 3, interval_s: float = 10.0) -> Telemetry:
    return Telemetry(ENGINES, interval_s=interval_s, keep_intervals=keep, clock=lambda: 123.0)


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([], 0.5) is None
    assert percentile([4.0], 0.9) == 4.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0.5) == 3.0
    assert percentile([float(n) for n in range(11)], 0.9) == 9.0


def test_a_request_is_charged_to_its_prefill_and_decode_engines() -> None:
    telemetry = make()
    telemetry.roll(0.0)
    for ttft, gap in ((0.1, 0.01), (0.3, 0.03), (0.2, 0.02)):
        telemetry.record_request(prefill="p1", decode="d1", ttft_s=ttft, inter_token_s=gap, error_engine=None)
    # A failed decode: both engines saw the request, the decode engine the error, no latency.
    telemetry.record_request(prefill="p2", decode="d1", ttft_s=None, inter_token_s=None, error_engine="d1")
    # Placement failed before any engine; unknown names are ignored rather than raising.
    telemetry.record_request(prefill=None, decode=None, ttft_s=None, inter_token_s=None, error_engine=None)
    telemetry.record_request(prefill="gone", decode="d9", ttft_s=1.0, inter_token_s=1.0, error_engine="x")
    assert telemetry.roll(10.0)
    [interval] = telemetry.closed_intervals()
    assert (interval.index, interval.start, interval.end) == (0, 0.0, 10.0)
    assert interval.engines["p1"] == EngineInterval(
        role="prefill", requests=3, errors=0, ttft_samples=3, ttft_p50_s=0.2, ttft_p90_s=pytest.approx(0.28),
        inter_token_samples=0, inter_token_p50_s=None, inter_token_p90_s=None)
    assert interval.engines["p2"] == EngineInterval(
        role="prefill", requests=1, errors=0, ttft_samples=0, ttft_p50_s=None, ttft_p90_s=None,
        inter_token_samples=0, inter_token_p50_s=None, inter_token_p90_s=None)
    d1 = interval.engines["d1"]
    assert (d1.role, d1.requests, d1.errors, d1.inter_token_samples, d1.inter_token_p50_s, d1.ttft_samples) == (
        "decode", 4, 1, 3, 0.02, 0)
    assert d1.inter_token_p90_s == pytest.approx(0.028)


def test_roll_closes_only_once_interval_s_has_passed() -> None:
    telemetry = make()
    assert telemetry.roll(5.0) is False          # the first roll opens the first interval
    assert telemetry.latest() is None
    telemetry.record_request(prefill="p1", decode="d1", ttft_s=0.1, inter_token_s=0.01, error_engine=None)
    assert telemetry.roll(14.999) is False
    assert telemetry.closed_intervals() == []
    assert telemetry.roll(15.0) is True
    assert telemetry.roll(15.5) is False
    # A late roll closes at the time it runs, covering exactly what was recorded.
    telemetry.record_request(prefill="p1", decode="d1", ttft_s=0.2, inter_token_s=0.02, error_engine=None)
    assert telemetry.roll(28.0) is True
    first, second = telemetry.closed_intervals()
    assert (first.start, first.end, second.start, second.end) == (5.0, 15.0, 15.0, 28.0)
    assert first.engines["p1"].ttft_p50_s == 0.1 and second.engines["p1"].ttft_p50_s == 0.2
    assert telemetry.latest() is second


def test_requests_recorded_before_the_first_roll_land_in_the_first_interval() -> None:
    telemetry = make()
    telemetry.record_request(prefill="p1", decode="d1", ttft_s=0.1, inter_token_s=0.01, error_engine=None)
    telemetry.roll(0.0)
    telemetry.roll(10.0)
    assert telemetry.latest().engines["p1"].requests == 1


def test_a_new_interval_starts_empty() -> None:
    telemetry = make()
    telemetry.roll(0.0)
    telemetry.record_request(prefill="p1", decode="d1", ttft_s=0.1, inter_token_s=0.01, error_engine="p1")
    telemetry.roll(10.0)
    telemetry.roll(20.0)
    empty = telemetry.latest().engines
    assert all(figures.requests == figures.errors == figures.ttft_samples == 0 for figures in empty.values())


def test_only_the_last_keep_intervals_are_kept() -> None:
    telemetry = make(keep=3)
    telemetry.roll(0.0)
    for k in range(1, 6):
        telemetry.record_request(prefill="p1", decode="d1", ttft_s=float(k), inter_token_s=None, error_engine=None)
        assert telemetry.roll(10.0 * k)
    kept = telemetry.closed_intervals()
    assert [i.index for i in kept] == [2, 3, 4]
    assert [i.engines["p1"].ttft_p50_s for i in kept] == [3.0, 4.0, 5.0]
    assert [(i.start, i.end) for i in kept] == [(20.0, 30.0), (30.0, 40.0), (40.0, 50.0)]


def test_roll_without_now_reads_the_clock() -> None:
    times = iter([0.0, 10.0])
    telemetry = Telemetry(ENGINES, interval_s=10.0, keep_intervals=2, clock=lambda: next(times))
    assert telemetry.roll() is False
    assert telemetry.roll() is True


def test_as_json_is_plain_json_for_the_admin_api() -> None:
    telemetry = make(keep=2)
    telemetry.roll(0.0)
    telemetry.record_request(prefill="p1", decode="d1", ttft_s=0.1, inter_token_s=0.01, error_engine=None)
    telemetry.roll(10.0)
    telemetry.record_request(prefill="p2", decode="d1", ttft_s=0.1, inter_token_s=0.01, error_engine=None)
    body = msgspec.json.decode(msgspec.json.encode(telemetry.as_json()))
    assert body["interval_s"] == 10.0 and body["keep_intervals"] == 2
    assert body["current"] == {"opened_at": 10.0, "now": 123.0, "requests": {"p1": 0, "p2": 1, "d1": 1}}
    [interval] = body["intervals"]
    assert interval["index"] == 0 and interval["start"] == 0.0 and interval["end"] == 10.0
    assert interval["engines"]["p1"]["ttft_p50_s"] == 0.1
    assert interval["engines"]["d1"]["inter_token_p50_s"] == 0.01


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        Telemetry(ENGINES, interval_s=0.0, keep_intervals=1, clock=lambda: 0.0)
    with pytest.raises(ValueError):
        Telemetry(ENGINES, interval_s=1.0, keep_intervals=0, clock=lambda: 0.0)
