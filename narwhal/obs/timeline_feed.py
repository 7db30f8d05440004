"""What fills the controller's ``Timeline``: every finished request, and a once-a-second fleet sample.

``TimelineFeed`` stands where the request path's telemetry sink stood: each
finished request goes to the drift telemetry as before and to the timeline.
With ``serving.workers > 1`` the workers' reports carry their requests to the
controller, which feeds the same object, so the one timeline sees every
request (charged to the second the controller learned of it). ``run`` samples
requests in flight and each engine's state once a second on an absolute
schedule.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import trio

from narwhal.obs.timeline import Timeline, TimelineView

__all__ = ["TimelineFeed"]

SAMPLE_INTERVAL_S = 1.0


class _Telemetry(Protocol):
    def record_request(self, *, prefill: str | None, decode: str | None, ttft_s: float | None,
                       inter_token_s: float | None, error_engine: str | None, status: int = 0,
                       error_class: str | None = None, failed: bool = False) -> None: ...


class TimelineFeed:
    """The request path's telemetry sink in the controller, teeing into ``timeline``."""

    def __init__(self, timeline: Timeline, telemetry: _Telemetry, *, in_flight: Callable[[], Mapping[str, int]],
                 states: Callable[[float], Mapping[str, str]], clock: Callable[[], float] = trio.current_time,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.timeline = timeline
        self.telemetry = telemetry
        self._in_flight = in_flight
        # Each engine's state name now (the fleet answers without building a view per engine).
        self._states = states
        self.clock = clock
        self.wall_clock = wall_clock

    def record_request(self, *, prefill: str | None, decode: str | None, ttft_s: float | None,
                       inter_token_s: float | None, error_engine: str | None, status: int = 0,
                       error_class: str | None = None, failed: bool = False) -> None:
        """Charge one finished request to the drift telemetry and to the timeline."""
        self.telemetry.record_request(prefill=prefill, decode=decode, ttft_s=ttft_s, inter_token_s=inter_token_s,
                                      error_engine=error_engine, status=status, error_class=error_class,
                                      failed=failed)
        self.timeline.record(self.clock(), status=status, error_class=error_class, ttft_s=ttft_s, failed=failed)

    def sample(self) -> None:
        """Record requests in flight and every engine's state for the current second."""
        now = self.clock()
        self.timeline.sample(now, in_flight=self._in_flight(), state=self._states(now))

    def view(self, seconds: int | None = None) -> TimelineView:
        """The timeline now, for ``GET /admin/timeline``."""
        return self.timeline.view(self.clock(), self.wall_clock(), seconds)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Sample once a second until cancelled; the schedule is absolute, so an overrun does not drift it."""
        if self.clock is trio.current_time:
            # Read at its source from now on (every finished request reads it): the same time, two calls fewer.
            self.clock = trio.lowlevel.current_clock().current_time
        next_at = self.clock()
        task_status.started()
        while True:
            self.sample()
            next_at += SAMPLE_INTERVAL_S
            await trio.sleep_until(next_at)
