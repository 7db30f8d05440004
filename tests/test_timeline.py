"""The timeline ring buffer (one-second buckets, bounded memory), its feed, and the routes that serve it.

Pure tests pass ``now``; the feed's sampler runs on trio's MockClock; the
routes go through the real app of a real Router (``test_admin_api``'s harness).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import trio
import trio.testing
from test_admin_api import TOKEN, harness  # noqa: F401  (the fixture)

from narwhal.control.model_view import engine_state
from narwhal.fleet.placement import InFlight
from narwhal.obs.timeline import OTHER_ERROR_CLASS, Timeline, error_class_of
from narwhal.obs.timeline_feed import TimelineFeed
from narwhal.workers.protocol import RequestSample


def test_a_request_counts_in_the_second_it_finished_and_the_open_second_is_not_shown() -> None:
    t = Timeline(["p1", "d1"], window_s=10)
    t.record(100.2, status=200, error_class=None, ttft_s=0.010)
    t.record(100.9, status=200, error_class=None, ttft_s=0.030)
    t.record(101.5, status=502, error_class="connection", ttft_s=None)
    v = t.view(101.7, now_unix=1_000_001.7, seconds=3)
    # Seconds 98, 99, 100: second 101 is still open.
    assert (v.start, v.start_unix, v.requests) == (98.0, 1_000_000.0 - 2, [0, 0, 2])
    assert v.errors == {}
    assert v.ttft_p50_ms == [None, None, 20.0]
    assert v.ttft_p99_ms[-1] == pytest.approx(29.8)
    v = t.view(102.0, now_unix=0.0, seconds=2)
    assert v.requests == [2, 1]
    assert v.errors == {"connection": [0, 1]}


def test_errors_are_counted_by_class_and_a_bare_error_status_by_its_code() -> None:
    assert error_class_of(503, None) == "http_503"
    assert error_class_of(499, "client_disconnected") == "client_disconnected"
    t = Timeline([], window_s=5, max_error_classes=2)
    for klass in ("timeout", "timeout", "connection", "stream", "deadline"):
        t.record(7.5, status=504, error_class=klass, ttft_s=None)
    t.record(7.6, status=400, error_class=None, ttft_s=None)
    v = t.view(8.0, 0.0, seconds=1)
    # Two classes kept per bucket; the rest count under "other", so hostile variety cannot grow memory.
    assert v.errors == {"timeout": [2], "connection": [1], OTHER_ERROR_CLASS: [3]}
    assert v.requests == [6] and v.recovered == {}


def test_a_request_that_recovered_from_an_engine_failure_is_not_an_error() -> None:
    t = Timeline([], window_s=5)
    # A retry on another engine answered: status 200, the failed attempt's class kept.
    t.record(1.2, status=200, error_class="connection", ttft_s=0.01, failed=False)
    # A stream that began and then ended with an SSE error event: 200, but the client saw the failure.
    t.record(1.3, status=200, error_class="stream", ttft_s=0.01, failed=True)
    t.record(1.4, status=200, error_class=None, ttft_s=0.01, failed=False)
    v = t.view(2.0, 0.0, seconds=1)
    assert (v.requests, v.errors, v.recovered) == ([3], {"stream": [1]}, {"connection": [1]})


def test_the_ring_forgets_what_is_older_than_the_window() -> None:
    t = Timeline(["e"], window_s=4)
    for second in range(10):
        t.record(second + 0.5, status=200, error_class=None, ttft_s=None)
        t.record(second + 0.6, status=200, error_class=None, ttft_s=None) if second == 2 else None
    v = t.view(10.0, 0.0)
    assert (v.start, v.requests) == (6.0, [1, 1, 1, 1])
    assert len(t._ring) == 5  # the window's complete seconds and the open one
    # A gap of more than the window: every slot is stale and shows as empty, not as old data.
    v = t.view(30.0, 0.0)
    assert v.requests == [0, 0, 0, 0] and v.ttft_p50_ms == [None] * 4


def test_a_view_taken_while_a_second_is_open_shows_the_oldest_complete_second() -> None:
    # The open second has a slot of its own: it once took the oldest complete second's, which read as empty.
    t = Timeline(["e"], window_s=4)
    for second in range(10):
        t.record(second + 0.5, status=200, error_class=None, ttft_s=0.01)
    v = t.view(9.7, 0.0)
    assert (v.start, v.requests, v.ttft_p50_ms) == (5.0, [1, 1, 1, 1], [10.0] * 4)


def test_ttft_samples_per_second_are_a_bounded_reservoir_reduced_when_the_second_closes() -> None:
    t = Timeline([], window_s=3, max_ttft_samples=50, rng=random.Random(1))
    for i in range(10_000):
        t.record(5.0 + i / 20_000, status=200, error_class=None, ttft_s=(i % 100) / 1000)
    bucket = t._open
    assert bucket is not None and bucket.ttft is not None and len(bucket.ttft) == 50
    t.record(6.1, status=200, error_class=None, ttft_s=0.5)
    # The closed second kept numbers only.
    assert t._ring[5 % 4].ttft is None  # type: ignore[union-attr]
    v = t.view(7.0, 0.0, seconds=2)
    assert v.requests == [10_000, 1]
    p50 = v.ttft_p50_ms[0]
    assert p50 is not None and 30 <= p50 <= 70  # the uniform 0..99 ms spread, sampled
    assert v.ttft_p50_ms[1] == 500.0 and v.ttft_p99_ms[1] == 500.0


def test_late_news_is_charged_to_the_open_second_never_rewriting_a_closed_one() -> None:
    t = Timeline([], window_s=5)
    t.record(3.5, status=200, error_class=None, ttft_s=None)
    t.record(2.9, status=200, error_class=None, ttft_s=None)
    assert t.view(4.0, 0.0, seconds=2).requests == [0, 2]


def test_samples_keep_the_last_in_flight_and_state_per_engine() -> None:
    t = Timeline(["p1", "d1"], window_s=5)
    t.sample(1.1, in_flight={"p1": 3, "d1": 1}, state={"p1": "eligible", "d1": "eligible"})
    t.sample(1.9, in_flight={"p1": 4}, state={"p1": "ejected", "d1": "held"})
    v = t.view(3.0, 0.0, seconds=3)
    assert v.in_flight == {"p1": [None, 4, None], "d1": [None, 0, None]}
    assert v.state == {"p1": [None, "ejected", None], "d1": [None, "held", None]}


def test_an_engine_added_by_a_reload_gets_its_series_from_its_first_sample() -> None:
    t = Timeline(["p1"], window_s=5, max_engines=2)
    t.sample(1.5, in_flight={"p1": 1}, state={"p1": "eligible"})
    t.sample(2.5, in_flight={"p1": 1, "d9": 2}, state={"p1": "eligible", "d9": "held", "x": "held"})
    v = t.view(3.0, 0.0, seconds=2)
    # d9 is new; "x" is past max_engines and is not tracked (memory stays bounded).
    assert v.engines == ["p1", "d9"]
    assert v.state == {"p1": ["eligible", "eligible"], "d9": [None, "held"]}
    assert v.in_flight == {"p1": [1, 1], "d9": [None, 2]}
    # Later samples add nobody again, and "x" stays out however often it comes (names equal, not the same object).
    t.sample(3.5, in_flight={}, state={"".join(["p", "1"]): "eligible", "d9": "held", "x": "held"})
    assert t.view(4.0, 0.0, seconds=1).engines == ["p1", "d9"]


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError):
        Timeline([], window_s=0)


class _View:
    def __init__(self, name: str, eligible: bool, ejected: bool) -> None:
        self.name, self.eligible, self.ejected = name, eligible, ejected


def test_engine_state_names() -> None:
    assert engine_state(_View("a", True, False)) == "eligible"
    assert engine_state(_View("a", False, False)) == "held"
    assert engine_state(_View("a", False, True)) == "ejected"


class _Telemetry:
    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def record_request(self, **kwargs: Any) -> None:
        self.calls.append(kwargs)


def test_the_feed_tees_requests_and_samples_every_second_on_an_absolute_schedule() -> None:
    clock = trio.testing.MockClock(autojump_threshold=0)
    in_flight = InFlight(["p1", "d1"])
    down = {"d1": False}
    telemetry = _Telemetry()

    def states(now: float) -> dict[str, str]:
        return {view.name: engine_state(view)
                for view in (_View("p1", True, False), _View("d1", not down["d1"], down["d1"]))}

    async def main() -> None:
        feed = TimelineFeed(Timeline(["p1", "d1"], window_s=900), telemetry, in_flight=lambda: in_flight.counts,
                            states=states, clock=trio.current_time, wall_clock=lambda: 5000.0)
        in_flight.acquire("p1")
        async with trio.open_nursery() as nursery:
            await nursery.start(feed.run)
            feed.record_request(prefill="p1", decode="d1", ttft_s=0.02, inter_token_s=0.001, error_engine=None,
                                status=200, error_class=None)
            await trio.sleep(1.5)
            down["d1"] = True
            feed.record_request(prefill="p1", decode="d1", ttft_s=None, inter_token_s=None, error_engine="d1",
                                status=502, error_class="connection", failed=True)
            await trio.sleep(2.0)
            v = feed.view()
            nursery.cancel_scope.cancel()
        assert trio.current_time() == 3.5
        assert (v.now, v.now_unix, len(v.requests)) == (3.5, 5000.0, 900)
        # Seconds 0, 1, 2: the samples at 0.0, 1.0 and 2.0 (d1 went down at 1.5).
        assert v.requests[-3:] == [1, 1, 0]
        assert v.errors["connection"][-3:] == [0, 1, 0]
        assert v.state["d1"][-3:] == ["eligible", "eligible", "ejected"]
        assert v.in_flight["p1"][-3:] == [1, 1, 1]
        assert v.state["d1"][-4] is None  # before the router started
        # The drift telemetry still gets every request, status and class included.
        assert [c["error_engine"] for c in telemetry.calls] == [None, "d1"]

    trio.run(main, clock=clock)


def test_a_workers_sample_carries_status_and_class_and_old_samples_still_decode() -> None:
    import msgspec

    sample = RequestSample("p1", "d1", 0.1, 0.01, None, 502, "connection", True)
    assert msgspec.json.decode(msgspec.json.encode(sample), type=RequestSample) == sample
    old = msgspec.json.decode(b'["p1","d1",0.1,0.01,null]', type=RequestSample)
    assert (old.status, old.error_class, old.failed) == (0, None, False)


async def test_timeline_router_and_ui_routes_through_the_real_app(harness) -> None:  # noqa: F811
    h = await harness(token=TOKEN)
    auth = {"authorization": f"Bearer {TOKEN}"}
    # The page's HTML holds no state: it loads without the token, with a strict CSP.
    response = await h.client.get("/admin/ui")
    assert response.status_code == 200
    page = await response.get_data()
    assert b"Narwhal fleet" in page and b"http://" not in page.replace(b"http://www.w3.org/2000/svg", b"")
    assert "default-src 'none'" in response.headers["content-security-policy"]
    # The data is behind the token.
    for path in ("/admin/timeline", "/admin/router"):
        assert (await h.client.get(path)).status_code == 401
    h.router.timeline.timeline.record(trio.current_time() - 1.5, status=200, error_class=None, ttft_s=0.004)
    status, body = await h.get("/admin/timeline?seconds=5", headers=auth)
    assert status == 200
    assert body["bucket_s"] == 1 and body["window_s"] == 900 and len(body["requests"]) == 5
    assert sum(body["requests"]) == 1 and body["engines"] == ["p1", "d1", "d2"]
    status, body = await h.get("/admin/timeline?seconds=abc", headers=auth)
    assert status == 400 and body["error"]["code"] == "invalid_seconds"
    status, body = await h.get("/admin/router", headers=auth)
    assert status == 200
    assert body["lease"]["role"] == "active" and body["workers"] == []
    assert [s["name"] for s in body["monitor"]["stages"]] == [
        "controller", "health", "drain", "rollover", "readmission", "liveness", "telemetry", "persistence"]
    assert {s["last_result"] for s in body["monitor"]["stages"]} == {"pending"}
    assert body["ready"] is (body["ready_reason"] is None)
