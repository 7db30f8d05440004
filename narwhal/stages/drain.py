"""Drain settlement: an engine under an operator drain or maintenance hold is drained at zero in flight.

The hold already keeps new requests away; this stage notices when the last
request in flight has finished, logs ``engine_drained`` once, and keeps the
engine in ``drained`` until its hold goes away (readmission clears it).
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from narwhal.control.fleet_writer import FleetWriter
from narwhal.fleet import DRAIN_HOLDS
from narwhal.fleet.placement import InFlightCounts
from narwhal.fleet.tables import drained
from narwhal.obs.logs import log_event

__all__ = ["DrainStage"]


class DrainStage:
    """Tracks which drained engines have no request left in flight."""

    name = "drain"

    def __init__(self, *, fleet: FleetWriter, in_flight: InFlightCounts,
                 clock: Callable[[], float] = trio.current_time) -> None:
        self.fleet = fleet
        self.in_flight = in_flight
        self.clock = clock
        self.drained: set[str] = set()

    def __repr__(self) -> str:
        return f"<DrainStage [drained: {sorted(self.drained)}]>"

    async def run(self, pass_number: int) -> None:
        """Settle drains at the current time."""
        self.run_now(pass_number)

    def run_now(self, pass_number: int) -> None:
        """The same, as a plain call (it never waits): the monitor's pass calls it in its own task."""
        self.settle(self.clock())

    def settle(self, now: float) -> list[str]:
        """Mark engines whose drain just completed; forget engines no longer draining."""
        newly: list[str] = []
        draining: set[str] = set()
        for view in self.fleet.views_of_unsettled(now):
            holds = sorted(str(hold.kind) for hold in view.holds if hold.kind in DRAIN_HOLDS)
            if not holds:
                continue
            draining.add(view.name)
            if view.name in self.drained or not drained((hold.kind for hold in view.holds),
                                                        self.in_flight[view.name]):
                continue
            self.drained.add(view.name)
            newly.append(view.name)
            log_event("engine_drained", engine=view.name, holds=holds, model=view.model)
        self.drained.intersection_update(draining)
        return newly
