"""The engine state machine (pure: no I/O, no clock, no logging) and its vocabulary.

``Fleet`` decides which engines may take new work from the evidence the shell
reports; ``machine`` holds every transition and its theory of operation,
``tables`` the spec's two tables as data, ``model`` the structs at the boundary.
"""

from narwhal.fleet.machine import Fleet
from narwhal.fleet.model import (
    ROLES,
    Action,
    ActionKind,
    EjectionCause,
    EngineCounters,
    EngineRecord,
    EngineState,
    EngineView,
    FleetEvent,
    FleetEventKind,
    Hold,
    HoldKind,
    HoldRecord,
    ProbeOutcome,
    state_name,
)
from narwhal.fleet.tables import (
    ACTION_POOL,
    DRAIN_HOLDS,
    EVIDENCE_CLEARED,
    FAILURE_ACTIONS,
    INFERENCE_FAILURES,
    LIVENESS,
    PROTECTED_HOLDS,
    QUARANTINE_CLEARED_BY_HEALTH,
)

__all__ = [
    "ACTION_POOL",
    "DRAIN_HOLDS",
    "EVIDENCE_CLEARED",
    "FAILURE_ACTIONS",
    "INFERENCE_FAILURES",
    "LIVENESS",
    "PROTECTED_HOLDS",
    "QUARANTINE_CLEARED_BY_HEALTH",
    "ROLES",
    "Action",
    "ActionKind",
    "EjectionCause",
    "EngineCounters",
    "EngineRecord",
    "EngineState",
    "EngineView",
    "Fleet",
    "FleetEvent",
    "FleetEventKind",
    "Hold",
    "HoldKind",
    "HoldRecord",
    "ProbeOutcome",
    "state_name",
]
