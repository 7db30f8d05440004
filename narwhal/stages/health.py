"""Health stage: one ``GET /health`` sweep per pass over the control pool, all engines at once.

Each check is bounded by ``check_timeout_s`` from the sweep's start. At most ``parallel`` checks (the control
pool's connections) are in flight: that many tasks take the engines in turn, instead of a task per engine parked
on the pool's limiter (at 256 engines and 16 connections, 240 parked tasks a pass). An engine whose turn has not
come by the deadline, less the pool's saturation margin, is unchecked: our own pool was busy, no evidence.

The answer is classified by the one status table (``narwhal.pools.classify.health_answer``): a 2xx clears the
health row of the evidence table at once, another 4xx is the 4xx row, anything
else is evidence of its class (overload, inference_status). No HTTP answer
within the timeout (refused, reset, timed out) is a silent check: evidence of
its class and, for the liveness stage, a miss. The sweep's results wait in
``sweep`` for the liveness stage.

Each answer also goes, as it arrives and after the fleet has recorded it, to
the optional ``observer`` (the readmitter's ``health_observed``): an ejected
engine seen answering a success starts its readmission chain in this pass,
not at the next readmission tick.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Protocol

import msgspec
import trio

from narwhal.config import Config, EngineSpec, RunningConfig
from narwhal.errors import EngineFailure, FailureClass, LocalResourceExhausted, PoolSaturated, SuccessKind
from narwhal.obs.logs import log_event
from narwhal.pools.classify import SATURATION_MARGIN_S, health_answer
from narwhal.pools.control import ControlCalls

__all__ = ["HEALTH_SHARE_OF_STAGE_TIMEOUT", "HealthObserver", "HealthStage", "HealthSweep", "health_check_timeout_s"]

# A sweep must end inside its stage's timeout even when an engine hangs, so a
# hanging engine is that engine's timeout evidence and not a health-stage error
# (which, repeated, would close admission for the whole router).
HEALTH_SHARE_OF_STAGE_TIMEOUT = 0.8


def health_check_timeout_s(config: Config) -> float:
    """``engine.health_timeout_s``, capped to leave the health stage inside ``stage_timeout_s``."""
    return min(config.engine.health_timeout_s,
               config.controller.stage_timeout_s * HEALTH_SHARE_OF_STAGE_TIMEOUT)


class _Supervisor(Protocol):
    def record_failure(self, engine: str, failure_class: FailureClass) -> None: ...
    def record_success(self, engine: str, kind: SuccessKind) -> None: ...


class HealthObserver(Protocol):
    """Told of every health answer of a sweep (``ok``: a success), as it arrives."""

    def health_observed(self, name: str, ok: bool) -> None: ...


class HealthSweep(msgspec.Struct, frozen=True, kw_only=True):
    """One complete sweep: engine name -> True when its health answer was a success."""

    pass_number: int
    results: dict[str, bool]
    # Engines not checked because our own control pool had no slot: no verdict either way.
    unchecked: frozenset[str] = frozenset()
    # Engines that gave an HTTP answer other than a success: not silent, so no liveness miss.
    answered: frozenset[str] = frozenset()


class HealthStage:
    """Sweeps every engine's /health concurrently and reports each result to the supervisor."""

    name = "health"

    def __init__(self, *, supervisor: _Supervisor, control_pool: ControlCalls, engines: Sequence[EngineSpec],
                 check_timeout_s: float, observer: HealthObserver | None = None, parallel: int | None = None) -> None:
        """``parallel``: checks in flight at most (None: every engine at once)."""
        self.supervisor = supervisor
        self.observer = observer
        self.control_pool = control_pool
        self.engines = list(engines)
        self.check_timeout_s = check_timeout_s
        self.parallel = parallel
        self.sweep: HealthSweep | None = None

    def configure(self, running: RunningConfig) -> None:
        """A reload: the next sweep's checks are bounded by the new timeouts."""
        # ``parallel`` stays: the control pool's connections are not reloaded (the pool keeps its limiter as built).
        self.check_timeout_s = health_check_timeout_s(running.config)

    def __repr__(self) -> str:
        last = None if self.sweep is None else self.sweep.pass_number
        return f"<HealthStage [{len(self.engines)} engines | last sweep: pass {last}]>"

    async def run(self, pass_number: int) -> None:
        """Check every engine; publish the sweep only when all checks finished."""
        results: dict[str, bool] = {}
        unchecked: set[str] = set()
        answered: set[str] = set()
        # The engines as the pass starts (an engine set change appends to the list while checks are in flight).
        engines = tuple(self.engines)
        turns = iter(engines)
        deadline = trio.current_time() + self.check_timeout_s
        checkers = len(engines) if self.parallel is None else max(1, min(len(engines), self.parallel))
        async with trio.open_nursery() as nursery:
            for _ in range(checkers):
                nursery.start_soon(self._check_in_turn, turns, deadline, results, unchecked, answered)
        for spec in turns:
            # As a check parked on the pool's limiter gives up (``classify.pool_slot``): no slot in time.
            self._skipped(spec, PoolSaturated("no free control pool connection before the request deadline"),
                          unchecked)
        self.sweep = HealthSweep(pass_number=pass_number, results=results, unchecked=frozenset(unchecked),
                                 answered=frozenset(answered))

    async def _check_in_turn(self, turns: Iterator[EngineSpec], deadline: float, results: dict[str, bool],
                             unchecked: set[str], answered: set[str]) -> None:
        """Check the engines whose turn comes (shared with the sweep's other checkers) until none is left or the
        deadline is too near to start one."""
        last_start = deadline - SATURATION_MARGIN_S
        while trio.current_time() < last_start:
            spec = next(turns, None)
            if spec is None:
                return
            await self._check(spec, deadline, results, unchecked, answered)

    async def _check(self, spec: EngineSpec, deadline: float, results: dict[str, bool], unchecked: set[str],
                     answered: set[str]) -> None:
        answer: SuccessKind | EngineFailure | None = None
        status: int | None = None
        with trio.move_on_at(deadline) as scope:
            try:
                response = await self.control_pool.get(spec, "/health", timeout_s=self.check_timeout_s,
                                                       caller_deadline=deadline)
            except EngineFailure as exc:
                answer = exc  # no HTTP answer: silent
            except PoolSaturated as exc:
                self._skipped(spec, exc, unchecked)
                return
            else:
                status = response.status
                answer = health_answer(spec.name, status)
        if scope.cancelled_caught or answer is None:
            answer = EngineFailure(spec.name, FailureClass.TIMEOUT,
                                   f"no health answer within {self.check_timeout_s:g} s")
        ok = results[spec.name] = answer is SuccessKind.HEALTH_200
        if status is not None and not ok:
            answered.add(spec.name)
        if isinstance(answer, SuccessKind):
            self.supervisor.record_success(spec.name, answer)
            self._observed(spec.name, ok)
            if ok:
                return
            failure_class, detail = None, f"HTTP {status}"
        else:
            self.supervisor.record_failure(spec.name, answer.failure_class)
            self._observed(spec.name, ok)
            failure_class, detail = answer.failure_class, answer.message
        log_event("health_check_failed", level=logging.WARNING, engine=spec.name,
                  failure_class=None if failure_class is None else str(failure_class), reason=detail,
                  silent=status is None, model=spec.model or "")

    @staticmethod
    def _skipped(spec: EngineSpec, exc: PoolSaturated, unchecked: set[str]) -> None:
        """Our own pool had no slot (or our process no fd): no evidence against the engine, and no liveness
        miss."""
        unchecked.add(spec.name)
        if isinstance(exc, LocalResourceExhausted):
            log_event("local_resource_exhausted", level=logging.ERROR, engine=spec.name, stage="health",
                      errno=exc.errno_name, message=str(exc))
        log_event("health_check_skipped", level=logging.WARNING, engine=spec.name, reason=str(exc),
                  model=spec.model or "")

    def _observed(self, name: str, ok: bool) -> None:
        if self.observer is None:
            return
        try:
            self.observer.health_observed(name, ok)
        except Exception as exc:  # noqa: BLE001 - the sweep's verdicts stand whatever the observer does
            log_event("health_observer_error", level=logging.ERROR, engine=name, stage="health",
                      **{"class": type(exc).__name__}, message=str(exc))
