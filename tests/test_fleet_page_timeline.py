"""The fleet page reads the timeline's whole window once, then only the seconds since (``?seconds=``), and lays
them over what it holds: the result must be the whole window the router would have sent.

The page's own ``mergeTimeline`` runs under Node over views the real ``Timeline`` makes; skips when ``node`` is
not installed.
"""

from __future__ import annotations

from typing import Any

import msgspec

from narwhal.obs.timeline import Timeline
from tests.fleet_page_script import run_page

WINDOW = 20
# Where the router's clock (trio's, which starts at a random offset) and the wall clock stand at second 0.
CLOCK0, WALL0 = 51_000.0, 1_780_000_000.0


def merge(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[dict[str, Any] | None]:
    return run_page("console.log(JSON.stringify(PAIRS.map(([c, f]) => mergeTimeline(c, f))));\n", PAIRS=pairs)


def view(timeline: Timeline, second: float, seconds: int | None = None, clock0: float = CLOCK0) -> dict[str, Any]:
    return msgspec.to_builtins(timeline.view(clock0 + second, WALL0 + second, seconds))


def busy_timeline(clock0: float = CLOCK0) -> dict[int, list[dict[str, Any]]]:
    """The page's reads at each second (the whole window, the last three seconds) of a timeline fed second by
    second: requests, failures of classes that come and go, recoveries, an engine a reload adds at second 30."""
    timeline = Timeline(["p1", "d1"], window_s=WINDOW)
    reads: dict[int, list[dict[str, Any]]] = {}
    for second in range(0, 60):
        at = clock0 + second + 0.25
        for i in range(second % 4):
            timeline.record(at, status=200, error_class=None, ttft_s=0.01 * (i + 1))
        if 5 <= second < 9:
            timeline.record(at, status=502, error_class="upstream_5xx", ttft_s=None)
        if second in (12, 33):
            timeline.record(at, status=200, error_class="connect", ttft_s=0.02)
        if second >= 40:
            timeline.record(at, status=504, error_class="timeout", ttft_s=None)
        state = {"p1": "eligible", "d1": "held" if 20 <= second < 25 else "eligible"}
        if second >= 30:
            state["d2"] = "eligible"
        if second % 7:  # some seconds have no sample: nulls in the state and in-flight series
            timeline.sample(at, in_flight={"d1": second % 3}, state=state)
        reads[second] = [view(timeline, second + 0.5, clock0=clock0), view(timeline, second + 0.5, 3, clock0)]
    return reads


def test_the_seconds_since_laid_over_the_window_held_are_the_whole_window() -> None:
    reads = busy_timeline()
    pairs = []
    expected = []
    # From the first read on, one refresh a second; then refreshes a few seconds apart (the page asks for
    # the seconds since its last read plus two, at most the window).
    held = reads[3][0]
    for second in range(4, 60):
        pairs.append((held, reads[second][1]))
        expected.append(reads[second][0])
        held = reads[second][0]
    for before, after in [(10, 12), (29, 31), (38, 40), (44, 45)]:
        pairs.append((reads[before][0], reads[after][1]))
        expected.append(reads[after][0])
    got = merge(pairs)
    for i, (merged, whole) in enumerate(zip(got, expected, strict=True)):
        assert merged is not None, i
        for field in ("engines", "requests", "errors", "recovered", "ttft_p50_ms", "ttft_p99_ms", "in_flight",
                      "state", "start", "start_unix", "now", "now_unix", "window_s", "bucket_s"):
            assert merged[field] == whole[field], (i, field)


def test_a_gap_or_another_routers_clock_does_not_join() -> None:
    reads = busy_timeline()
    other = busy_timeline(clock0=CLOCK0 + 7_000.0)  # another router process: its clock starts elsewhere
    # The tab slept past what it asked for: seconds are missing between the window held and the fresh ones.
    gap = (reads[10][0], reads[20][1])
    # Behind a load balancer the next read came from another router.
    another = (reads[10][0], other[11][1])
    earlier = (reads[30][0], other[31][1])
    smaller_window = (reads[10][0], {**reads[11][1], "window_s": WINDOW - 1})
    assert merge([gap, another, earlier, smaller_window]) == [None, None, None, None]
