"""The one writer of the fleet: every mutation of ``Fleet`` goes through here.

The supervisor (evidence and probe results), the readmitter (drains,
maintenance, readmission), the controller stage (drift holds) and resume (the
restored handoff) all change the same state machine. Each change is made here,
so that every ``FleetEvent`` it reports is logged and counted at once, by one
code path, and every ``Action`` it returns is carried out: handed to the
action runner (the supervisor) or, before one is attached, queued until it is.
Reads go straight through; a read that expires a hold (candidate selection)
has its event logged on the spot as well.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Protocol

import msgspec

from narwhal.config import RunningConfig
from narwhal.errors import FailureClass, SuccessKind
from narwhal.fleet import (
    Action,
    ActionKind,
    EjectionCause,
    EngineRecord,
    EngineState,
    EngineView,
    Fleet,
    FleetEvent,
    FleetEventKind,
    HoldKind,
    ProbeOutcome,
)
from narwhal.obs.logs import log_event
from narwhal.obs.router_metrics import RouterMetrics

__all__ = ["ActionRunner", "FleetWriter"]


class ActionRunner(Protocol):
    """Carries out one action the fleet returned (the supervisor)."""

    def run_action(self, action: Action) -> None: ...


class FleetWriter:
    """Owns the ``Fleet``: mutations log their events when they happen and never drop an action."""

    def __init__(self, fleet: Fleet, metrics: RouterMetrics, *,
                 listeners: Sequence[Callable[[FleetEvent], None]] = (),
                 on_change: Callable[[], None] | None = None, decides: Callable[[], bool] | None = None) -> None:
        """``decides()``: False on a replica (``[lease] mode = "replicas"``), whose fleet is the controller's,
        restored from its records: evidence, probes, holds, ejections and readmissions then change nothing."""
        self._fleet = fleet
        self._decides = decides
        self.metrics = metrics
        self._runner: ActionRunner | None = None
        # Actions returned before a runner was attached (e.g. by resume): run on attach.
        self._pending: list[Action] = []
        self._events_dropped_seen = 0
        # Told of every event after it is logged (cache-aware placement forgets ejected engines).
        self.listeners: list[Callable[[FleetEvent], None]] = list(listeners)
        # Called after every mutation (worker processes get a new snapshot if placement changed).
        self.on_change = on_change

    def __repr__(self) -> str:
        runner = "attached" if self._runner is not None else f"none, {len(self._pending)} actions queued"
        return f"<FleetWriter {self._fleet!r} [runner: {runner}]>"

    def attach(self, runner: ActionRunner | None) -> None:
        """Set (or, with None, detach) the action runner; queued actions run now."""
        self._runner = runner
        if runner is not None:
            pending, self._pending = self._pending, []
            self._execute(pending)

    # ----- reads (a read may expire holds: their events are logged too) -----

    def eligible(self, role: str, now: float, model: str | None = None) -> list[str]:
        """``Fleet.eligible``."""
        names = self._fleet.eligible(role, now, model)
        if self._fleet.has_events:
            self._publish()
        return names

    def is_eligible(self, name: str, now: float) -> bool:
        """``Fleet.is_eligible``."""
        eligible = self._fleet.is_eligible(name, now)
        if self._fleet.has_events:
            self._publish()
        return eligible

    def capacity_problem(self, now: float, model: str | None = None) -> str | None:
        """``Fleet.capacity_problem``."""
        problem = self._fleet.capacity_problem(now, model)
        if self._fleet.has_events:
            self._publish()
        return problem

    def capacity_problems(self, now: float) -> dict[str, str]:
        """``Fleet.capacity_problems``."""
        problems = self._fleet.capacity_problems(now)
        if self._fleet.has_events:
            self._publish()
        return problems

    def eligible_pools(self, now: float) -> dict[str, dict[str, list[str]]]:
        """``Fleet.eligible_pools``."""
        pools = self._fleet.eligible_pools(now)
        if self._fleet.has_events:
            self._publish()
        return pools

    def models(self) -> list[str]:
        """``Fleet.models``."""
        return self._fleet.models()

    def model_of(self, name: str) -> str:
        """``Fleet.model_of``."""
        return self._fleet.model_of(name)

    def eligibility_version(self, now: float) -> int:
        """``Fleet.eligibility_version``."""
        version = self._fleet.eligibility_version(now)
        if self._fleet.has_events:
            self._publish()
        return version

    def next_deadline(self, now: float) -> float | None:
        """``Fleet.next_deadline``."""
        deadline = self._fleet.next_deadline(now)
        if self._fleet.has_events:
            self._publish()
        return deadline

    def view(self, name: str, now: float) -> EngineView:
        """``Fleet.view``."""
        view = self._fleet.view(name, now)
        self._publish_if_changed()
        return view

    def views(self, now: float) -> list[EngineView]:
        """``Fleet.views``."""
        views = self._fleet.views(now)
        self._publish_if_changed()
        return views

    def views_of_unsettled(self, now: float) -> list[EngineView]:
        """``Fleet.views_of_unsettled``."""
        views = self._fleet.views_of_unsettled(now)
        self._publish_if_changed()
        return views

    def states(self, now: float) -> dict[str, EngineState]:
        """``Fleet.states``."""
        states = self._fleet.states(now)
        self._publish_if_changed()
        return states

    def snapshot(self, now: float, wall_now: float) -> list[EngineRecord]:
        """``Fleet.snapshot``."""
        records = self._fleet.snapshot(now, wall_now)
        self._publish_if_changed()
        return records

    def readmission_allowed(self, name: str, now: float) -> bool:
        """``Fleet.readmission_allowed``."""
        return self._fleet.readmission_allowed(name, now)

    def quarantine_needs_inference_check(self, name: str, now: float) -> bool:
        """``Fleet.quarantine_needs_inference_check``."""
        return self._fleet.quarantine_needs_inference_check(name, now)

    def probe_partners(self, role: str, now: float, *, exclude: str) -> list[str]:
        """``Fleet.probe_partners``."""
        partners = self._fleet.probe_partners(role, now, exclude=exclude)
        self._publish_if_changed()
        return partners

    # ----- mutations -----

    def knows(self, name: str) -> bool:
        """Whether the fleet tracks ``name`` (an engine removed by a reload is not)."""
        return name in self._fleet

    def __contains__(self, name: object) -> bool:
        return name in self._fleet

    def record_failure(self, name: str, failure_class: FailureClass, now: float) -> list[Action]:
        """``Fleet.record_failure``, its events logged and its actions run.

        Evidence about an engine a reload removed (a request or probe that
        outlived it) is dropped here: the fleet no longer has a row for it.
        """
        if self._decides is not None and not self._decides():
            return []
        if name not in self._fleet:
            return []
        return self._done(self._fleet.record_failure(name, failure_class, now))

    def record_success(self, name: str, kind: SuccessKind, now: float) -> list[Action]:
        """``Fleet.record_success``; the request path's common case costs one check."""
        if self._decides is not None and not self._decides():
            return []
        if name not in self._fleet:
            return []
        actions = self._fleet.record_success(name, kind, now)
        if actions or self._fleet.has_events:
            self._done(actions)
        return actions

    def record_health_sweep(self, results: Mapping[str, bool], now: float, *,
                            unchecked: Collection[str] = (), answered: Collection[str] = ()) -> list[Action]:
        """``Fleet.record_health_sweep`` (engines a reload removed meanwhile left out)."""
        if self._decides is not None and not self._decides():
            return []
        known = self._fleet
        if any(name not in known for name in (*results, *unchecked, *answered)):
            results = {name: ok for name, ok in results.items() if name in known}
            unchecked = [name for name in unchecked if name in known]
            answered = [name for name in answered if name in known]
        return self._done(self._fleet.record_health_sweep(results, now, unchecked=unchecked, answered=answered))

    def record_probe(self, name: str, outcome: ProbeOutcome, now: float, *, leg: str | None = None,
                     reason: str = "", failure_class: FailureClass | None = None) -> list[Action]:
        """``Fleet.record_probe`` (dropped for an engine a reload removed)."""
        if self._decides is not None and not self._decides():
            return []
        if name not in self._fleet:
            return []
        return self._done(self._fleet.record_probe(name, outcome, now, leg=leg, reason=reason,
                                                   failure_class=failure_class))

    def start_due_probes(self, now: float) -> list[Action]:
        """Hand every re-probe the fleet scheduled for ``now`` or earlier to the runner."""
        if self._decides is not None and not self._decides():
            return []
        actions = [Action(ActionKind.INFERENCE_PROBE, name, None, "scheduled re-probe after an inconclusive one")
                   for name in self._fleet.probes_due(now)]
        return self._done(actions)

    def add_hold(self, name: str, kind: HoldKind, reason: str, now: float,
                 deadline: float | None = None, *, wall: float | None = None) -> list[Action]:
        """``Fleet.add_hold`` (an inference-verification hold asks for a probe: run); none on a removed engine."""
        if self._decides is not None and not self._decides():
            return []
        if name not in self._fleet:
            return []
        return self._done(self._fleet.add_hold(name, kind, reason, now, deadline, wall=wall))

    def clear_hold(self, name: str, kind: HoldKind, now: float) -> bool:
        """``Fleet.clear_hold``; False for an engine a reload removed."""
        if self._decides is not None and not self._decides():
            return False
        if name not in self._fleet:
            return False
        cleared = self._fleet.clear_hold(name, kind, now)
        self._publish()
        return cleared

    def eject(self, name: str, reason: str, now: float, failure_class: FailureClass | None = None, *,
              label: EjectionCause | None = None) -> list[Action]:
        """``Fleet.eject`` (nothing for an engine a reload removed)."""
        if self._decides is not None and not self._decides():
            return []
        if name not in self._fleet:
            return []
        return self._done(self._fleet.eject(name, reason, now, failure_class, label=label))

    def readmit(self, name: str, now: float, *, health_to_eligible_s: float | None = None) -> None:
        """``Fleet.readmit``."""
        if self._decides is not None and not self._decides():
            return
        self._fleet.readmit(name, now, health_to_eligible_s=health_to_eligible_s)
        self._publish()

    def configure(self, running: RunningConfig) -> None:
        """A reload: the fleet takes the new ``[recovery]`` rules."""
        recovery = running.config.recovery
        self.reconfigure(eject_after=recovery.eject_after, liveness_misses=recovery.liveness_misses,
                         failure_quarantine_s=recovery.failure_quarantine_s,
                         probe_interval_s=recovery.probe_interval_s)

    def reconfigure(self, *, eject_after: int, liveness_misses: int, failure_quarantine_s: float | None,
                    probe_interval_s: float) -> None:
        """``Fleet.reconfigure`` (no event: the reload logs ``config_reloaded``)."""
        self._fleet.reconfigure(eject_after=eject_after, liveness_misses=liveness_misses,
                                failure_quarantine_s=failure_quarantine_s, probe_interval_s=probe_interval_s)

    def add_engine(self, name: str, role: str, now: float, reason: str, model: str = "") -> None:
        """``Fleet.add_engine`` (logged as ``engine_added``)."""
        self._fleet.add_engine(name, role, now, reason, model)
        self._publish()

    def start_removal(self, name: str, now: float, reason: str) -> None:
        """``Fleet.start_removal`` (logged as ``engine_removing``)."""
        self._fleet.start_removal(name, now, reason)
        self._publish()

    def cancel_removal(self, name: str, now: float, reason: str) -> None:
        """``Fleet.cancel_removal`` (logged as ``engine_removal_cancelled``)."""
        self._fleet.cancel_removal(name, now, reason)
        self._publish()

    def remove_engine(self, name: str, now: float, reason: str) -> None:
        """``Fleet.remove_engine`` (logged as ``engine_removed``)."""
        self._fleet.remove_engine(name, now, reason)
        self._publish()

    def restore(self, records: Sequence[EngineRecord], now: float, wall_now: float) -> None:
        """``Fleet.restore``; verification holds whose probe was in flight are probed again at once."""
        self._fleet.restore(records, now, wall_now)
        self._publish()
        self.start_due_probes(now)

    # ----- the one place events are logged and actions carried out -----

    def _done(self, actions: list[Action]) -> list[Action]:
        self._publish_if_changed()
        self._execute(actions)
        return actions

    def _publish_if_changed(self) -> None:
        """``_publish`` when the fleet has events to report (every change of what placement sees is one).

        Reads and evidence that changed nothing (a streak counted, a healthy engine's
        health answer) do not wake the snapshot publisher: at hundreds of engines it
        rebuilt every engine's placement view after each of them.
        """
        if self._fleet.has_events or self._fleet.events_dropped > self._events_dropped_seen:
            self._publish()

    def _execute(self, actions: list[Action]) -> None:
        for action in actions:
            if action.kind is ActionKind.EJECT:
                continue  # bookkeeping, already applied; its event was logged
            if self._runner is None:
                self._pending.append(action)
            else:
                self._runner.run_action(action)

    def _publish(self) -> None:
        for event in self._fleet.drain_events():
            self._log(event)
            for listener in self.listeners:
                listener(event)
        dropped = self._fleet.events_dropped
        if dropped > self._events_dropped_seen:
            log_event("fleet_events_dropped", level=logging.ERROR, dropped=dropped - self._events_dropped_seen)
            self._events_dropped_seen = dropped
        if self.on_change is not None:
            self.on_change()

    def _log(self, event: FleetEvent) -> None:
        if event.kind is FleetEventKind.PROBE_RESULT:
            return  # logged by the probe itself, with the probe's kind
        self._count(event)
        fields = msgspec.structs.asdict(event)
        kind = fields.pop("kind").value
        level = logging.WARNING if event.kind is FleetEventKind.EJECTED else logging.INFO
        # "at" is monotonic (meaningless to operators; "ts" says when), and nulls are noise.
        log_event(f"engine_{kind}", level=level,
                  **{k: getattr(v, "value", v) for k, v in fields.items() if v is not None and k != "at"})

    def _count(self, event: FleetEvent) -> None:
        if event.kind is FleetEventKind.EJECTED:
            self.metrics.engine_ejections.inc(event.engine, str(event.ejection_cause or EjectionCause.OTHER),
                                              event.model)
        elif event.kind is FleetEventKind.HOLD_ADDED and event.hold_kind is not None:
            self.metrics.holds_applied.inc(event.engine, str(event.hold_kind), event.model)

