"""Readmission's vocabulary: the chain's checks in order, one attempt's result, what ``/admin/engines`` shows."""

from __future__ import annotations

import enum
from typing import Literal

import msgspec

__all__ = ["CHAIN", "Check", "ReadmissionResult", "ReadmissionState"]


class Check(enum.StrEnum):
    """One step of the readmission chain (the ``check`` label of logs and metrics)."""

    HEALTH = "health"
    ATTESTATION = "attestation"
    NEWER_PROCESS = "newer_process"
    MODEL = "model"
    GENERATION = "generation"
    KV_ROLE = "kv_role"
    FINAL_HEALTH = "final_health"
    INFERENCE = "inference"
    # Not a step: an operator drain or maintenance began while the chain ran,
    # and a readmission must not clear a hold the operator asked for after it.
    OPERATOR_HOLD = "operator_hold"


# The chain in order; NEWER_PROCESS runs only for an engine under maintenance.
CHAIN: tuple[Check, ...] = (Check.HEALTH, Check.ATTESTATION, Check.NEWER_PROCESS, Check.MODEL,
                            Check.GENERATION, Check.KV_ROLE, Check.FINAL_HEALTH, Check.INFERENCE)


class ReadmissionResult(msgspec.Struct, frozen=True, kw_only=True):
    """One readmission attempt: who, whether it passed, and which check refused it and why."""

    engine: str
    outcome: Literal["readmitted", "refused"]
    # The check that failed; None when readmitted.
    check: str | None
    reason: str
    operator: bool
    passed: list[str]
    # Wall-clock unix seconds when the attempt began, and how long it took.
    at: float
    duration_s: float
    # Readmitted: seconds from the engine's first health success since its ejection to
    # its return to placement; None when refused or no such answer was seen.
    health_to_eligible_s: float | None = None

    @property
    def readmitted(self) -> bool:
        return self.outcome == "readmitted"


class ReadmissionState(msgspec.Struct, frozen=True, kw_only=True):
    """What the readmitter knows of one engine: drain settled, maintenance start, the latest attempt."""

    drained: bool
    maintenance_started_at: float | None
    readmission_running: bool
    last_readmission: ReadmissionResult | None
    # Out engines: when a health check first saw it answer since its ejection (monotonic),
    # the backoff its refusals or flaps have earned, and its next automatic attempt
    # (monotonic; None when none is scheduled, e.g. drained or in placement).
    health_answered_at: float | None = None
    readmission_backoff_s: float = 0.0
    next_readmission_at: float | None = None
