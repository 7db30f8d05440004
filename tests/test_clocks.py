"""The one conversion from trio's clock to CLOCK_MONOTONIC (lease deadlines, worker snapshots, log fields)."""

import time

import trio

from narwhal.clocks import to_monotonic


def test_an_instant_keeps_its_distance_from_now_on_the_other_clock() -> None:
    assert to_monotonic(5.0, clock=lambda: 3.0, monotonic=lambda: 100.0) == 102.0
    assert to_monotonic(1.0, clock=lambda: 3.0, monotonic=lambda: 100.0) == 98.0


async def test_trio_deadlines_become_host_monotonic_times() -> None:
    deadline = trio.current_time() + 30.0
    converted = to_monotonic(deadline, clock=trio.current_time)
    assert abs(converted - (time.monotonic() + 30.0)) < 1.0
