"""The fleet's vocabulary: what it asks the shell to do, what it reports, what it saves.

Every struct here is frozen data crossing the boundary between the pure state
machine (``narwhal.fleet.machine``) and its shell: actions to perform, events to
log and count, per-engine views for the admin API, and records for the handoff.
"""

from __future__ import annotations

import enum
from typing import Literal

import msgspec

from narwhal.errors import FailureClass

__all__ = [
    "ROLES",
    "Cause",
    "Action",
    "ActionKind",
    "EngineCounters",
    "EngineRecord",
    "EngineState",
    "EjectionCause",
    "EngineView",
    "FleetEvent",
    "FleetEventKind",
    "Hold",
    "HoldKind",
    "HoldRecord",
    "ProbeOutcome",
    "state_name",
]

ROLES: tuple[str, ...] = ("prefill", "decode")

ProbeOutcome = Literal["success", "failed", "inconclusive"]

# An engine's state in one word, as the fleet page, the timeline and /v1/models show it.
EngineState = Literal["eligible", "held", "ejected"]


def state_name(ejected: bool, eligible: bool) -> EngineState:
    """``ejected``, ``eligible`` or ``held`` (out of placement for a hold, a drain included)."""
    if ejected:
        return "ejected"
    return "eligible" if eligible else "held"

# What caused a failure_quarantine hold: a failure class, or the liveness miss
# counter (the evidence names of the clearing table).
Cause = FailureClass | Literal["liveness"]
PROBE_OUTCOMES: tuple[ProbeOutcome, ...] = ("success", "failed", "inconclusive")


class EjectionCause(enum.StrEnum):
    """Why an engine was ejected, as a bounded label (metrics, admin view); the free-text reason is for people."""

    CONNECTION = "connection"
    TIMEOUT = "timeout"
    STREAM = "stream"
    OVERLOAD = "overload"
    INFERENCE_STATUS = "inference_status"
    KV_HANDOFF = "kv_handoff"
    LIVENESS = "liveness"
    PROBE = "probe"
    # Not a failure: an engine added by a config reload is out until its first readmission.
    ADDED = "added"
    # Not a failure: its first identity read after startup named another model than the engine's own.
    MODEL = "model"
    OTHER = "other"

    @classmethod
    def of(cls, failure_class: FailureClass) -> EjectionCause:
        """The cause of an ejection the failure table ordered for ``failure_class``."""
        return cls(failure_class.value)


class ActionKind(enum.StrEnum):
    """What the shell must do for an engine (the 'Action' column of the failure table)."""

    EJECT = "eject"
    HEALTH_PROBE = "health_probe"
    INFERENCE_PROBE = "inference_probe"


class HoldKind(enum.StrEnum):
    """Why an engine is held out of placement; every kind pauses new requests."""

    INFERENCE_VERIFICATION = "inference_verification"
    FAILURE_QUARANTINE = "failure_quarantine"
    PERFORMANCE_DRIFT = "performance_drift"
    OPERATOR_DRAIN = "operator_drain"
    MAINTENANCE = "maintenance"


class Action(msgspec.Struct, frozen=True):
    """One piece of I/O the shell owes an engine; state changes are already applied.

    ``EJECT`` reports an ejection the fleet has recorded; the probe kinds ask the
    shell to start that probe now, on the control pool, and report its result.
    """

    kind: ActionKind
    engine: str
    failure_class: FailureClass | None
    reason: str


class Hold(msgspec.Struct, frozen=True):
    """A hold on one engine; ``deferred`` means recorded but not pausing (last engine)."""

    kind: HoldKind
    reason: str
    since: float
    deadline: float | None = None
    deferred: bool = False
    # failure_quarantine only: the evidence that caused it, which decides what may clear it.
    cause: Cause | None = None
    # The wall clock (unix seconds) when the hold began, where it was read then (an operator's hold, or
    # one restored from a handoff); None: converted from ``since`` when needed. Kept because the two
    # clocks drift apart (a VM paused, the wall clock stepped), and a maintenance start is compared
    # with an engine's process start to the second.
    since_wall: float | None = None


class FleetEventKind(enum.StrEnum):
    """What happened inside the fleet, for the shell to log and count."""

    EJECTED = "ejected"
    READMITTED = "readmitted"
    HOLD_ADDED = "hold_added"
    HOLD_CLEARED = "hold_cleared"
    HOLD_DEFERRED = "hold_deferred"
    PROBE_RESULT = "probe_result"
    EVIDENCE_CLEARED = "evidence_cleared"
    # The engine set changed (a config reload): a new engine, one leaving, one gone.
    ADDED = "added"
    REMOVING = "removing"
    REMOVED = "removed"
    # The same engine (name, url, role) came back before its removal finished.
    REMOVAL_CANCELLED = "removal_cancelled"


class FleetEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One transition: which engine, what kind, why, and when (monotonic seconds).

    ``failure_class`` is set for ejections caused by a streak and for cleared
    streaks (``None`` on an ``evidence_cleared`` event means the liveness
    counter); ``hold_kind`` for hold events; ``outcome`` and ``leg`` for probes.
    """

    kind: FleetEventKind
    engine: str
    reason: str
    at: float
    failure_class: FailureClass | None = None
    # Set on ``ejected`` events only.
    ejection_cause: EjectionCause | None = None
    hold_kind: HoldKind | None = None
    outcome: str | None = None
    leg: str | None = None
    # Set on ``readmitted`` events when known: seconds from the engine's first health
    # success since its ejection to its return to placement.
    health_to_eligible_s: float | None = None
    # The engine's model ("" in a fleet built without model names): logged and counted with the event.
    model: str = ""


class EngineCounters(msgspec.Struct, frozen=True, kw_only=True):
    """Monotonic totals for one engine: ejections, probes by outcome, failures by class."""

    ejections: int = 0
    probes: dict[str, int] = {}
    failures: dict[FailureClass, int] = {}


class EngineView(msgspec.Struct, frozen=True, kw_only=True):
    """Everything an operator needs to see why an engine is in or out of placement."""

    name: str
    role: str
    # The model the engine serves ("" in a fleet built without model names).
    model: str = ""
    eligible: bool
    ejected: bool
    ejected_reason: str | None
    ejected_cause: EjectionCause | None
    ejected_at: float | None
    holds: list[Hold]
    # Current consecutive-failure streak for every failure class.
    evidence: dict[FailureClass, int]
    liveness_misses: int
    # When the next inference re-probe is due; None when none is scheduled.
    next_probe_at: float | None
    probe_in_flight: bool
    readmission_allowed: bool
    counters: EngineCounters
    # Removed from the config: no new requests; it leaves the fleet once its requests finish.
    removing: bool = False


class HoldRecord(msgspec.Struct, frozen=True, kw_only=True):
    """A hold as saved in the handoff, with wall-clock times."""

    kind: HoldKind
    reason: str
    since_wall: float
    deadline_wall: float | None = None
    deferred: bool = False
    # The hold's ``cause`` by name; a name this version does not know reads as None.
    cause: str | None = None


class EngineRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One engine's durable state for the handoff; times are wall-clock seconds.

    Every field but the name and role has a default, so a handoff written by an
    older version (with fewer fields) still decodes.
    """

    name: str
    role: str
    # The engine's model; "" in a handoff written before models were named (it fits any).
    model: str = ""
    ejected: bool = False
    ejected_reason: str | None = None
    ejected_cause: EjectionCause | None = None
    ejected_at_wall: float | None = None
    holds: list[HoldRecord] = []
    streaks: dict[FailureClass, int] = {}
    liveness_misses: int = 0
    next_probe_at_wall: float | None = None
    counters: EngineCounters = EngineCounters()
