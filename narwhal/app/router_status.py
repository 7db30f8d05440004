"""``GET /admin/router``: the router as one document (readiness, lease, monitor stages, workers).

The fleet page reads it once a second beside ``/admin/engines``; so can any
operator's script. Built from the parts at the time of the call; it changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import msgspec

from narwhal.lease.service import LeaseView

__all__ = ["MonitorStatus", "RouterStatus", "StageStatus", "WorkerStatus", "router_status"]


class StageStatus(msgspec.Struct, frozen=True, kw_only=True):
    """One monitor stage: its result in the last finished pass and its errors since the router started."""

    name: str
    # "ok", "error", or "pending" before the first pass finished.
    last_result: str
    last_error_class: str | None = None
    last_error: str | None = None
    errors_total: int = 0


class MonitorStatus(msgspec.Struct, frozen=True, kw_only=True):
    passes: int
    failure_streak: int
    degraded: str | None
    last_pass_number: int | None
    last_pass_finished_at: float | None
    stages: list[StageStatus]


class WorkerStatus(msgspec.Struct, frozen=True, kw_only=True):
    """One worker process (``serving.workers > 1``) as its last report told the controller."""

    index: int
    up: bool
    requests_in_flight: int = 0
    snapshot_seq: int = 0
    restarts: int = 0


class RouterStatus(msgspec.Struct, frozen=True, kw_only=True):
    router_id: str
    # The router's monotonic clock now: the clock of every ``since``/``deadline`` in /admin/engines.
    now: float
    ready: bool
    ready_reason: str | None
    lease: LeaseView
    monitor: MonitorStatus
    workers: list[WorkerStatus]


class _StageError(Protocol):
    @property
    def stage(self) -> str: ...
    @property
    def error_class(self) -> str: ...
    @property
    def message(self) -> str: ...


class _Pass(Protocol):
    @property
    def number(self) -> int: ...
    @property
    def finished_at(self) -> float: ...
    @property
    def errors(self) -> Sequence[_StageError]: ...


class _Worker(Protocol):
    @property
    def requests_in_flight(self) -> int: ...
    @property
    def snapshot_seq(self) -> int: ...


def router_status(*, router_id: str, now: float, readiness: str | None, lease: LeaseView,
                  stage_names: Sequence[str], passes: int, failure_streak: int, degraded: str | None,
                  last_pass: _Pass | None, stage_errors: Mapping[tuple[str, ...], float],
                  worker_count: int, workers: Mapping[int, _Worker],
                  restarts: Mapping[int, int]) -> RouterStatus:
    """Join the parts' state into one ``RouterStatus``; ``stage_errors`` is keyed (stage, class)."""
    totals: dict[str, int] = {}
    for labels, count in stage_errors.items():
        totals[labels[0]] = totals.get(labels[0], 0) + int(count)
    last_errors = {error.stage: error for error in last_pass.errors} if last_pass is not None else {}
    stages = []
    for name in stage_names:
        error = last_errors.get(name)
        result = "pending" if last_pass is None else ("error" if error is not None else "ok")
        stages.append(StageStatus(name=name, last_result=result,
                                  last_error_class=None if error is None else error.error_class,
                                  last_error=None if error is None else error.message,
                                  errors_total=totals.get(name, 0)))
    monitor = MonitorStatus(passes=passes, failure_streak=failure_streak, degraded=degraded,
                            last_pass_number=None if last_pass is None else last_pass.number,
                            last_pass_finished_at=None if last_pass is None else last_pass.finished_at,
                            stages=stages)
    worker_list = []
    if worker_count > 1:
        for index in range(worker_count):
            state = workers.get(index)
            worker_list.append(WorkerStatus(
                index=index, up=state is not None, restarts=restarts.get(index, 0),
                requests_in_flight=0 if state is None else state.requests_in_flight,
                snapshot_seq=0 if state is None else state.snapshot_seq))
    return RouterStatus(router_id=router_id, now=now, ready=readiness is None, ready_reason=readiness,
                        lease=lease, monitor=monitor, workers=worker_list)
