"""Health stage: one ``GET /health`` sweep per pass over the control pool, all engines at once.

Each check is bounded by ``check_timeout_s``. A 200 clears the health row of
the evidence table at once; a failure is recorded as evidence of its class
(connection, timeout, overload, inference_status). The sweep's results wait in
``sweep`` for the liveness stage, which turns silence into liveness misses.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import msgspec
import trio

from narwhal.config import EngineSpec
from narwhal.errors import EngineFailure, FailureClass, PoolSaturated, SuccessKind
from narwhal.obs.logs import log_event
from narwhal.pools.control import ControlCalls

__all__ = ["HealthStage", "HealthSweep", "health_failure_class"]


class _Supervisor(Protocol):
    def record_failure(self, engine: str, failure_class: FailureClass) -> None: ...
    def record_success(self, engine: str, kind: SuccessKind) -> None: ...


class HealthSweep(msgspec.Struct, frozen=True, kw_only=True):
    """One complete sweep: engine name -> True when it answered 200."""

    pass_number: int
    results: dict[str, bool]
    # Engines not checked because our own control pool had no slot: no verdict either way.
    unchecked: frozenset[str] = frozenset()


def health_failure_class(status: int) -> FailureClass | None:
    """The evidence a non-200 health answer is: overload for 408/429, inference_status for 5xx."""
    if status in (408, 429):
        return FailureClass.OVERLOAD
    if status >= 500:
        return FailureClass.INFERENCE_STATUS
    # Any other answer is no success (a liveness miss) but matches no failure row.
    return None


class HealthStage:
    """Sweeps every engine's /health concurrently and reports each result to the supervisor."""

    name = "health"

    def __init__(self, *, supervisor: _Supervisor, control_pool: ControlCalls, engines: Sequence[EngineSpec],
                 check_timeout_s: float) -> None:
        self.supervisor = supervisor
        self.control_pool = control_pool
        self.engines = list(engines)
        self.check_timeout_s = check_timeout_s
        self.sweep: HealthSweep | None = None

    def __repr__(self) -> str:
        last = None if self.sweep is None else self.sweep.pass_number
        return f"<HealthStage [{len(self.engines)} engines | last sweep: pass {last}]>"

    async def run(self, pass_number: int) -> None:
        """Check every engine; publish the sweep only when all checks finished."""
        results: dict[str, bool] = {}
        unchecked: set[str] = set()
        async with trio.open_nursery() as nursery:
            for spec in self.engines:
                nursery.start_soon(self._check, spec, results, unchecked)
        self.sweep = HealthSweep(pass_number=pass_number, results=results, unchecked=frozenset(unchecked))

    async def _check(self, spec: EngineSpec, results: dict[str, bool], unchecked: set[str]) -> None:
        failure: FailureClass | None = None
        healthy = False
        detail = ""
        with trio.move_on_after(self.check_timeout_s) as scope:
            try:
                response = await self.control_pool.get(spec, "/health", timeout_s=self.check_timeout_s)
            except EngineFailure as exc:
                failure, detail = exc.failure_class, exc.message
            except PoolSaturated as exc:
                # Our own pool had no slot: no evidence against the engine, and no liveness miss.
                unchecked.add(spec.name)
                log_event("health_check_skipped", level=logging.WARNING, engine=spec.name, reason=str(exc))
                return
            else:
                healthy = response.status == 200
                if not healthy:
                    failure, detail = health_failure_class(response.status), f"HTTP {response.status}"
        if scope.cancelled_caught:
            failure, detail = FailureClass.TIMEOUT, f"no health answer within {self.check_timeout_s:g} s"
        results[spec.name] = healthy
        if healthy:
            self.supervisor.record_success(spec.name, SuccessKind.HEALTH_200)
            return
        if failure is not None:
            self.supervisor.record_failure(spec.name, failure)
        log_event("health_check_failed", level=logging.WARNING, engine=spec.name,
                  failure_class=None if failure is None else str(failure), reason=detail)
