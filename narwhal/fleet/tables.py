"""The spec's two tables and the hold rules, as literal data.

``FAILURE_ACTIONS`` is the spec's "Failure evidence" table (class -> action when
a streak reaches ``recovery.eject_after``); ``EVIDENCE_CLEARED`` is its
"Clearing failure evidence" table (successful response -> evidence cleared).
The state machine reads these dicts and nothing else to decide; the tests walk
them row by row.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final, Literal

from narwhal.errors import FailureClass, SuccessKind
from narwhal.fleet.model import ActionKind, HoldKind

__all__ = [
    "ACTION_POOL",
    "DRAIN_HOLDS",
    "EVIDENCE_CLEARED",
    "FAILURE_ACTIONS",
    "INFERENCE_FAILURES",
    "LIVENESS",
    "PAUSING_HOLDS",
    "PROBE_LEG_INCONCLUSIVE",
    "PROBE_PARTNER_HOLDS",
    "PROTECTED_HOLDS",
    "QUARANTINE_CLEARED_BY_HEALTH",
    "READMISSION_CLEARS",
    "Evidence",
    "drained",
]

# The liveness miss counter, named alongside the failure classes in the
# clearing table ("Health 200 clears ... and liveness").
LIVENESS: Final = "liveness"
Evidence = FailureClass | Literal["liveness"]

# Failure evidence: when a class's streak reaches recovery.eject_after.
# INFERENCE_PROBE means "pause new requests and probe prefill/decode": the
# fleet applies the inference-verification hold before asking for the probe.
FAILURE_ACTIONS: Final[dict[FailureClass, ActionKind]] = {
    FailureClass.CONNECTION: ActionKind.EJECT,
    FailureClass.TIMEOUT: ActionKind.HEALTH_PROBE,
    FailureClass.STREAM: ActionKind.INFERENCE_PROBE,
    FailureClass.OVERLOAD: ActionKind.HEALTH_PROBE,
    FailureClass.INFERENCE_STATUS: ActionKind.INFERENCE_PROBE,
    FailureClass.KV_HANDOFF: ActionKind.INFERENCE_PROBE,
}

# Clearing failure evidence: each successful response clears exactly these.
EVIDENCE_CLEARED: Final[dict[SuccessKind, tuple[Evidence, ...]]] = {
    # 4xx response other than 408 or 429
    SuccessKind.CLIENT_4XX: (FailureClass.CONNECTION, FailureClass.INFERENCE_STATUS),
    # Health 200
    SuccessKind.HEALTH_200: (FailureClass.CONNECTION, FailureClass.TIMEOUT,
                             FailureClass.OVERLOAD, LIVENESS),
    # Prefill with an extracted handoff
    SuccessKind.PREFILL_HANDOFF: (FailureClass.CONNECTION, FailureClass.INFERENCE_STATUS,
                                  FailureClass.KV_HANDOFF),
    # Decode stream reaching its terminal marker
    SuccessKind.DECODE_TERMINAL: (FailureClass.CONNECTION, FailureClass.INFERENCE_STATUS,
                                  FailureClass.STREAM),
}

# "Recorded inference failures": the classes an inference probe verifies, and
# so the ones a successful inference probe clears.
INFERENCE_FAILURES: Final[tuple[FailureClass, ...]] = tuple(
    cls for cls, action in FAILURE_ACTIONS.items() if action is ActionKind.INFERENCE_PROBE)

# Failure quarantine ("unless a successful health or inference check clears
# the hold first"), read with the clearing table: a health 200 clears a
# quarantine only when the evidence that caused it is on the health row
# (connection, timeout, overload, liveness). A quarantine caused by stream,
# inference_status or kv_handoff evidence says the engine failed inference,
# which a health 200 says nothing about: only a successful inference probe or
# the deadline ends it. A quarantine of unknown cause (an older handoff) is
# treated the same way, the cautious reading.
QUARANTINE_CLEARED_BY_HEALTH: Final[frozenset[Evidence]] = frozenset(EVIDENCE_CLEARED[SuccessKind.HEALTH_200])

# A verification-probe leg that fails with one of these classes is
# inconclusive, never a failed leg: an overloaded (408/429) engine, or a
# control call that timed out, says nothing about whether it can serve. The
# hold stays and another probe is scheduled.
PROBE_LEG_INCONCLUSIVE: Final[frozenset[FailureClass]] = frozenset(
    {FailureClass.OVERLOAD, FailureClass.TIMEOUT})

# Probes never deadlock: when no engine of the partner role is eligible, a
# probe may pair the suspect with a peer held only by these (never an ejected
# engine, nor one an operator drains). A failed partner leg is inconclusive for
# the suspect, so a held partner can never eject it.
PROBE_PARTNER_HOLDS: Final[frozenset[HoldKind]] = frozenset(
    {HoldKind.INFERENCE_VERIFICATION, HoldKind.FAILURE_QUARANTINE, HoldKind.PERFORMANCE_DRIFT})

# Which pool the shell runs each action's I/O on ("Connection pools"): suspect
# verification is control-pool work, so a saturated data pool cannot starve it.
# An ejection is bookkeeping, not a call.
ACTION_POOL: Final[dict[ActionKind, Literal["control"] | None]] = {
    ActionKind.EJECT: None,
    ActionKind.HEALTH_PROBE: "control",
    ActionKind.INFERENCE_PROBE: "control",
}

# Every hold kind pauses new requests to its engine.
PAUSING_HOLDS: Final[frozenset[HoldKind]] = frozenset(HoldKind)

# Last-engine protection: these holds never remove the last eligible engine of
# a role. A failure_quarantine hold on an ejected engine is moot here (the
# ejection already removed it), so in effect only temporary quarantines count.
PROTECTED_HOLDS: Final[frozenset[HoldKind]] = frozenset(
    {HoldKind.PERFORMANCE_DRIFT, HoldKind.FAILURE_QUARANTINE})

# The operator's holds: an engine under one is draining, and only readmission clears it.
DRAIN_HOLDS: Final[frozenset[HoldKind]] = frozenset({HoldKind.OPERATOR_DRAIN, HoldKind.MAINTENANCE})


def drained(holds: Iterable[HoldKind], in_flight: int) -> bool:
    """An engine is *drained* when a drain hold stands and nothing is left in flight on it."""
    return in_flight == 0 and any(kind in DRAIN_HOLDS for kind in holds)


# What a successful readmission chain clears besides the ejection itself.
READMISSION_CLEARS: Final[tuple[HoldKind, ...]] = (
    HoldKind.OPERATOR_DRAIN, HoldKind.MAINTENANCE,
    HoldKind.FAILURE_QUARANTINE, HoldKind.INFERENCE_VERIFICATION)
