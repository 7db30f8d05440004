"""The monitor's stages, one module each, and ``build_stages`` that wires them from the config.

Order of the returned list is the spec's: controller, health, drain, rollover,
readmission, liveness, telemetry, persistence. ``narwhal.control.monitor`` decides which
of them wait for which within a pass (``RUNS_AFTER``).
"""

from __future__ import annotations

from typing import Any

from narwhal.config import Config
from narwhal.control.monitor import Stage
from narwhal.fleet.placement import InFlight
from narwhal.stages.controller import ControllerStage
from narwhal.stages.drain import DrainStage
from narwhal.stages.health import HealthStage
from narwhal.stages.liveness import LivenessStage
from narwhal.stages.readmission import ReadmissionStage
from narwhal.stages.rollover import RolloverStage
from narwhal.stages.telemetry import TelemetryStage
from narwhal.fleet.telemetry import Telemetry

__all__ = ["HEALTH_SHARE_OF_STAGE_TIMEOUT", "build_stages", "health_check_timeout_s"]

# A sweep must end inside its stage's timeout even when an engine hangs, so a
# hanging engine is that engine's timeout evidence and not a health-stage error
# (which, repeated, would close admission for the whole router).
HEALTH_SHARE_OF_STAGE_TIMEOUT = 0.8


def health_check_timeout_s(config: Config) -> float:
    """``engine.health_timeout_s``, capped to leave the health stage inside ``stage_timeout_s``."""
    return min(config.engine.health_timeout_s,
               config.controller.stage_timeout_s * HEALTH_SHARE_OF_STAGE_TIMEOUT)


def build_stages(*, config: Config, supervisor: Any, control_pool: Any, telemetry: Telemetry,
                 in_flight: InFlight, persistence_stage: Stage, readmission: Any = None) -> list[Stage]:
    """The eight stages in spec order; ``supervisor`` is a ``narwhal.control.supervisor.Supervisor``."""
    fleet = supervisor.fleet
    clock = supervisor.clock
    controller = config.controller
    health = HealthStage(supervisor=supervisor, control_pool=control_pool, engines=config.engines,
                         check_timeout_s=health_check_timeout_s(config))
    return [
        ControllerStage(fleet=fleet, telemetry=telemetry, drift_factor=controller.drift_factor,
                        drift_intervals=controller.drift_intervals, metrics=supervisor.metrics, clock=clock),
        health,
        DrainStage(fleet=fleet, in_flight=in_flight, clock=clock),
        RolloverStage(telemetry=telemetry, clock=clock),
        ReadmissionStage(supervisor=supervisor, readmission=readmission),
        LivenessStage(supervisor=supervisor, health=health),
        TelemetryStage(telemetry=telemetry, metrics=supervisor.metrics),
        persistence_stage,
    ]
