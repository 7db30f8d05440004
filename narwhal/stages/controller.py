"""Controller stage: performance-drift holds and consolidation risk, from closed telemetry intervals.

Each interval that rollover closed is judged by ``narwhal.fleet.drift``: an engine
slower than ``drift_factor`` x its role's peers for ``drift_intervals``
consecutive intervals gets a ``performance_drift`` hold, lifted after as many
intervals back within bounds. The fleet defers a drift hold on the last
eligible engine of a role; on top of that, no new drift hold is applied while
the engine's role is at ``critical`` consolidation risk.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import trio

from narwhal.config import RunningConfig
from narwhal.control.fleet_writer import FleetWriter
from narwhal.fleet import ROLES, HoldKind
from narwhal.fleet.drift import DriftDecision, DriftTracker, Risk, consolidation_risk
from narwhal.fleet.telemetry import Interval, Telemetry
from narwhal.obs.logs import log_event
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.state.handoff import ConsolidationRisk

__all__ = ["ControllerStage", "RISK_LEVEL"]

# The value of the narwhal_consolidation_risk gauge for each risk.
RISK_LEVEL: dict[Risk, float] = {Risk.NONE: 0.0, Risk.ELEVATED: 1.0, Risk.CRITICAL: 2.0}
# The words the handoff and /admin/engines use for each risk.
RISK_NAME: dict[Risk, ConsolidationRisk] = {Risk.NONE: "none", Risk.ELEVATED: "elevated", Risk.CRITICAL: "critical"}


class ControllerStage:
    """Applies and lifts drift holds; answers consolidation risk per role."""

    name = "controller"

    def __init__(self, *, fleet: FleetWriter, telemetry: Telemetry, drift_factor: float, drift_intervals: int,
                 metrics: RouterMetrics | None = None, clock: Callable[[], float] = trio.current_time) -> None:
        self.fleet = fleet
        self.telemetry = telemetry
        self.clock = clock
        self.tracker = DriftTracker(drift_factor=drift_factor, drift_intervals=drift_intervals)
        # Index of the last interval judged: each closed interval counts exactly once.
        self.last_interval: int | None = None
        self._totals: dict[str, int] | None = None
        if metrics is not None:
            metrics.add_gauge("narwhal_consolidation_risk",
                              "Consolidation risk per role: 0 none, 1 elevated, 2 critical.", ("role",),
                              lambda: {(role,): RISK_LEVEL[Risk(risk)]
                                       for role, risk in self.consolidation_risk().items()})

    def configure(self, running: RunningConfig) -> None:
        """A reload: read at each closed interval, the next one is judged by the new drift values."""
        controller = running.config.controller
        self.tracker.drift_factor = controller.drift_factor
        self.tracker.drift_intervals = controller.drift_intervals

    def __repr__(self) -> str:
        return f"<ControllerStage [last interval judged: {self.last_interval}]>"

    async def run(self, pass_number: int) -> None:
        """Judge every interval closed since the last pass."""
        self.step(self.clock())

    def step(self, now: float) -> list[DriftDecision]:
        """Judge the new closed intervals, oldest first; return the decisions carried out."""
        done: list[DriftDecision] = []
        for interval in self.telemetry.closed_intervals():
            if self.last_interval is not None and interval.index <= self.last_interval:
                continue
            self.last_interval = interval.index
            done += self.judge(interval, now)
        return done

    def judge(self, interval: Interval, now: float) -> list[DriftDecision]:
        """Count one interval and carry out its decisions, except new holds at critical risk."""
        held: set[str] = set()
        pausing: set[str] = set()
        roles: dict[str, str] = {}
        for view in self.fleet.views(now):
            roles[view.name] = view.role
            for hold in view.holds:
                if hold.kind is HoldKind.PERFORMANCE_DRIFT:
                    held.add(view.name)
                    if not hold.deferred:
                        pausing.add(view.name)
        done: list[DriftDecision] = []
        for decision in self.tracker.observe(interval, held=held, pausing=pausing):
            if decision.engine not in roles:
                continue  # an interval recorded before a reload removed the engine
            if decision.hold:
                role = roles[decision.engine]
                risk = self.consolidation_risk(now)[role]
                if risk == Risk.CRITICAL:
                    log_event("drift_hold_skipped", level=logging.WARNING, engine=decision.engine,
                              role=role, risk=risk, reason=decision.reason, interval=interval.index)
                    continue
                self.fleet.add_hold(decision.engine, HoldKind.PERFORMANCE_DRIFT, decision.reason, now)
            else:
                self.fleet.clear_hold(decision.engine, HoldKind.PERFORMANCE_DRIFT, now)
            self.tracker.applied(decision)
            log_event("drift_hold_applied" if decision.hold else "drift_hold_lifted",
                      engine=decision.engine, reason=decision.reason, interval=interval.index)
            done.append(decision)
        return done

    def engines_changed(self, removed: Iterable[str] = ()) -> None:
        """The engine set changed (a config reload): recount totals, forget the drift counts of ``removed``."""
        self._totals = None
        for name in removed:
            self.tracker.forget(name)

    def consolidation_risk(self, now: float | None = None) -> dict[str, ConsolidationRisk]:
        """{role: "none" | "elevated" | "critical"} from eligible vs configured engines now."""
        if now is None:
            now = self.clock()
        if self._totals is None:
            self._totals = {role: 0 for role in ROLES}
            for view in self.fleet.views(now):
                self._totals[view.role] += 1
        return {role: RISK_NAME[consolidation_risk(len(self.fleet.eligible(role, now)), total)]
                for role, total in self._totals.items()}
