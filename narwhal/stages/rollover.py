"""Interval rollover: close the open telemetry interval once ``telemetry.interval_s`` has passed."""

from __future__ import annotations

from collections.abc import Callable

import trio

from narwhal.fleet.telemetry import Telemetry

__all__ = ["RolloverStage"]


class RolloverStage:
    """Calls ``telemetry.roll(now)`` once per pass."""

    name = "rollover"

    def __init__(self, *, telemetry: Telemetry, clock: Callable[[], float] = trio.current_time) -> None:
        self.telemetry = telemetry
        self.clock = clock

    async def run(self, pass_number: int) -> None:
        """Close the interval if it is due (the controller and telemetry stages read it next)."""
        self.run_now(pass_number)

    def run_now(self, pass_number: int) -> None:
        """The same, as a plain call (it never waits): the monitor's pass calls it in its own task."""
        self.telemetry.roll(self.clock())
