"""Controller stage: performance-drift holds and consolidation risk, from closed telemetry intervals.

Each interval that rollover closed is judged by ``narwhal.fleet.drift``: an engine
slower than ``drift_factor`` x its peers (same model, same role) for ``drift_intervals``
consecutive intervals gets a ``performance_drift`` hold, lifted after as many
intervals back within bounds. The fleet defers a drift hold on the last
eligible engine of a model's role; on top of that, no new drift hold is applied while
the engine's model and role are at ``critical`` consolidation risk.
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

# Worse first: a role's risk over several models is its worst model's.
_RISK_ORDER: dict[ConsolidationRisk, int] = {"none": 0, "elevated": 1, "critical": 2}

# The value of the narwhal_consolidation_risk gauge for each risk.
RISK_LEVEL: dict[Risk, float] = {Risk.NONE: 0.0, Risk.ELEVATED: 1.0, Risk.CRITICAL: 2.0}
# The words the handoff and /admin/engines use for each risk.
RISK_NAME: dict[Risk, ConsolidationRisk] = {Risk.NONE: "none", Risk.ELEVATED: "elevated", Risk.CRITICAL: "critical"}


class ControllerStage:
    """Applies and lifts drift holds; answers consolidation risk per model and role."""

    name = "controller"

    def __init__(self, *, fleet: FleetWriter, telemetry: Telemetry, drift_factor: float, drift_intervals: int,
                 metrics: RouterMetrics | None = None, clock: Callable[[], float] = trio.current_time) -> None:
        self.fleet = fleet
        self.telemetry = telemetry
        self.clock = clock
        self.tracker = DriftTracker(drift_factor=drift_factor, drift_intervals=drift_intervals)
        # Index of the last interval judged: each closed interval counts exactly once.
        self.last_interval: int | None = None
        # Configured engines per (model, role): recounted after a reload.
        self._totals: dict[tuple[str, str], int] | None = None
        if metrics is not None:
            metrics.add_gauge("narwhal_consolidation_risk",
                              "Consolidation risk per model and role: 0 none, 1 elevated, 2 critical.",
                              ("role", "model"),
                              lambda: {(role, model): RISK_LEVEL[Risk(risk)]
                                       for model, roles in self.consolidation_risks().items()
                                       for role, risk in roles.items()})

    def configure(self, running: RunningConfig) -> None:
        """A reload: read at each closed interval, the next one is judged by the new drift values."""
        controller = running.config.controller
        self.tracker.drift_factor = controller.drift_factor
        self.tracker.drift_intervals = controller.drift_intervals

    def __repr__(self) -> str:
        return f"<ControllerStage [last interval judged: {self.last_interval}]>"

    async def run(self, pass_number: int) -> None:
        """Judge every interval closed since the last pass."""
        self.run_now(pass_number)

    def run_now(self, pass_number: int) -> None:
        """The same, as a plain call (it never waits): the monitor's pass calls it in its own task."""
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
        models: dict[str, str] = {}
        for view in self.fleet.views(now):
            roles[view.name] = view.role
            models[view.name] = view.model
            for hold in view.holds:
                if hold.kind is HoldKind.PERFORMANCE_DRIFT:
                    held.add(view.name)
                    if not hold.deferred:
                        pausing.add(view.name)
        done: list[DriftDecision] = []
        for decision in self.tracker.observe(interval, held=held, pausing=pausing, models=models):
            if decision.engine not in roles:
                continue  # an interval recorded before a reload removed the engine
            if decision.hold:
                role, model = roles[decision.engine], models[decision.engine]
                risk = self.consolidation_risks(now)[model][role]
                if risk == Risk.CRITICAL:
                    log_event("drift_hold_skipped", level=logging.WARNING, engine=decision.engine,
                              role=role, risk=risk, reason=decision.reason, interval=interval.index, model=model)
                    continue
                self.fleet.add_hold(decision.engine, HoldKind.PERFORMANCE_DRIFT, decision.reason, now)
            else:
                self.fleet.clear_hold(decision.engine, HoldKind.PERFORMANCE_DRIFT, now)
            self.tracker.applied(decision)
            log_event("drift_hold_applied" if decision.hold else "drift_hold_lifted",
                      engine=decision.engine, reason=decision.reason, interval=interval.index,
                      model=models[decision.engine])
            done.append(decision)
        return done

    def engines_changed(self, removed: Iterable[str] = ()) -> None:
        """The engine set changed (a config reload): recount totals, forget the drift counts of ``removed``."""
        self._totals = None
        for name in removed:
            self.tracker.forget(name)

    def consolidation_risk(self, now: float | None = None) -> dict[str, ConsolidationRisk]:
        """{role: "none" | "elevated" | "critical"}: each role's worst over the models
        (``consolidation_risks`` per model)."""
        risks = self.consolidation_risks(now)
        # No engine at all: no role can serve.
        worst: dict[str, ConsolidationRisk] = {role: "none" if risks else "critical" for role in ROLES}
        for roles in risks.values():
            for role, risk in roles.items():
                if _RISK_ORDER[risk] > _RISK_ORDER[worst[role]]:
                    worst[role] = risk
        return worst

    def consolidation_risks(self, now: float | None = None) -> dict[str, dict[str, ConsolidationRisk]]:
        """{model: {role: risk}} from each model's eligible vs configured engines of the role now."""
        if now is None:
            now = self.clock()
        if self._totals is None:
            totals: dict[tuple[str, str], int] = {}
            for view in self.fleet.views(now):
                for role in ROLES:
                    totals.setdefault((view.model, role), 0)
                totals[(view.model, view.role)] += 1
            self._totals = totals
        risks: dict[str, dict[str, ConsolidationRisk]] = {}
        for (model, role), total in self._totals.items():
            eligible = len(self.fleet.eligible(role, now, model))
            risks.setdefault(model, {})[role] = RISK_NAME[consolidation_risk(eligible, total)]
        return risks
