"""Liveness stage: this pass's health sweep becomes liveness evidence in the fleet.

Any 200 resets an engine's miss counter; a silent engine (no HTTP answer within
the check timeout) gets a miss, one that answered otherwise gets none, and
``recovery.liveness_misses`` consecutive silent sweeps eject it (the fleet
decides). A pass whose sweep did not complete (the health stage failed or was
cut) gives no liveness evidence: the silence is ours, not the engines'.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Protocol

from narwhal.obs.logs import log_event
from narwhal.stages.health import HealthStage

__all__ = ["LivenessStage"]


class _Supervisor(Protocol):
    def record_health_sweep(self, results: Mapping[str, bool], *, unchecked: Collection[str] = (),
                            answered: Collection[str] = ()) -> None: ...


class LivenessStage:
    """Feeds the health stage's sweep of the same pass to ``supervisor.record_health_sweep``."""

    name = "liveness"

    def __init__(self, *, supervisor: _Supervisor, health: HealthStage) -> None:
        self.supervisor = supervisor
        self.health = health
        self.sweeps_applied = 0
        self.sweeps_skipped = 0

    def __repr__(self) -> str:
        return f"<LivenessStage [applied {self.sweeps_applied} | skipped {self.sweeps_skipped}]>"

    async def run(self, pass_number: int) -> None:
        """Apply the sweep the health stage completed in this pass, if it did."""
        self.run_now(pass_number)

    def run_now(self, pass_number: int) -> None:
        """The same, as a plain call (it never waits): the monitor's pass calls it in its own task."""
        sweep = self.health.sweep
        if sweep is None or sweep.pass_number != pass_number:
            self.sweeps_skipped += 1
            log_event("liveness_skipped", level=logging.WARNING, reason="no complete health sweep in this pass",
                      **{"pass": pass_number})
            return
        self.supervisor.record_health_sweep(sweep.results, unchecked=sweep.unchecked, answered=sweep.answered)
        self.sweeps_applied += 1
