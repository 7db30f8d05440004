"""The monitor's stages, one module each, and ``build_stages`` that wires them from the config.

``build_stages`` returns ``MonitorStages``: each stage by name, and
``in_spec_order()`` for the monitor (controller, health, drain, rollover,
readmission, liveness, telemetry, persistence). ``narwhal.control.monitor``
decides which of them wait for which within a pass (``RUNS_AFTER``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Protocol

import msgspec

from narwhal.config import Config
from narwhal.control.fleet_writer import FleetWriter
from narwhal.control.monitor import STAGE_NAMES, Stage
from narwhal.errors import FailureClass, SuccessKind
from narwhal.fleet.placement import InFlightCounts
from narwhal.fleet.telemetry import Telemetry
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.pools.control import ControlCalls
from narwhal.stages.controller import ControllerStage
from narwhal.stages.drain import DrainStage
from narwhal.stages.health import HEALTH_SHARE_OF_STAGE_TIMEOUT, HealthObserver, HealthStage, health_check_timeout_s
from narwhal.stages.liveness import LivenessStage
from narwhal.stages.readmission import Readmission, ReadmissionStage
from narwhal.stages.rollover import RolloverStage
from narwhal.stages.telemetry import TelemetryStage

__all__ = ["HEALTH_SHARE_OF_STAGE_TIMEOUT", "MonitorStages", "StageSupervisor", "build_stages",
           "health_check_timeout_s"]

class StageSupervisor(Protocol):
    """What the stages need of ``narwhal.control.supervisor.Supervisor``."""

    fleet: FleetWriter
    metrics: RouterMetrics
    clock: Callable[[], float]

    def record_failure(self, engine: str, failure_class: FailureClass) -> None: ...
    def record_success(self, engine: str, kind: SuccessKind) -> None: ...
    def record_health_sweep(self, results: Mapping[str, bool], *, unchecked: Collection[str] = (),
                            answered: Collection[str] = ()) -> None: ...
    def start_due_probes(self) -> None: ...


class MonitorStages(msgspec.Struct, frozen=True, kw_only=True):
    """The eight stages by name; ``in_spec_order()`` is the list the monitor runs."""

    controller: ControllerStage
    health: HealthStage
    drain: DrainStage
    rollover: RolloverStage
    readmission: ReadmissionStage
    liveness: LivenessStage
    telemetry: TelemetryStage
    persistence: Stage

    def in_spec_order(self) -> list[Stage]:
        """The stages in the spec's order (``STAGE_NAMES``)."""
        return [getattr(self, name) for name in STAGE_NAMES]


def build_stages(*, config: Config, supervisor: StageSupervisor, control_pool: ControlCalls, telemetry: Telemetry,
                 in_flight: InFlightCounts, persistence_stage: Stage,
                 readmission: Readmission | None = None,
                 health_observer: HealthObserver | None = None) -> MonitorStages:
    """The eight stages, wired from the config over the supervisor's fleet and clock.

    ``health_observer`` (the readmitter) hears every health answer of the sweep as it arrives.
    """
    fleet = supervisor.fleet
    clock = supervisor.clock
    controller = config.controller
    health = HealthStage(supervisor=supervisor, control_pool=control_pool, engines=config.engines,
                         check_timeout_s=health_check_timeout_s(config), observer=health_observer,
                         parallel=config.engine.control_connections)
    return MonitorStages(
        controller=ControllerStage(fleet=fleet, telemetry=telemetry, drift_factor=controller.drift_factor,
                                   drift_intervals=controller.drift_intervals, metrics=supervisor.metrics,
                                   clock=clock),
        health=health,
        drain=DrainStage(fleet=fleet, in_flight=in_flight, clock=clock),
        rollover=RolloverStage(telemetry=telemetry, clock=clock),
        readmission=ReadmissionStage(supervisor=supervisor, readmission=readmission),
        liveness=LivenessStage(supervisor=supervisor, health=health),
        telemetry=TelemetryStage(telemetry=telemetry, metrics=supervisor.metrics, model_of=fleet.model_of),
        persistence=persistence_stage,
    )
