"""The monitor: one pass of the control-plane stages per interval, on an absolute schedule.

A pass runs the eight stages the spec lists (controller logic, health checks,
drain settlement, interval rollover, readmission, liveness, telemetry, handoff
persistence) under one nursery, each that waits in its own task and cancel
scope bounded by ``stage_timeout_s`` (the others are plain calls: below). A
stage's exception, or its timeout (recorded with the
class ``TimeoutError``), is caught, counted in
``narwhal_monitor_stage_errors_total{stage,class}``, logged as one
``stage_error`` JSON line, and never stops the other stages. Only ``Exception``
is caught: cancellation of the router passes straight through.

Stage order. Stages start together unless they read what another stage
produces in the same pass (``RUNS_AFTER``):

- health, drain, rollover and readmission start at once;
- controller waits for rollover (it judges the interval rollover just closed)
  and health (its consolidation risk reads eligibility after this sweep);
- liveness waits for health (it feeds that sweep's results to the fleet);
- telemetry waits for rollover (it publishes the interval just closed);
- persistence waits for all seven, so the handoff holds the state they produced.

A stage waits for its predecessors to finish, successfully or not; its own
timeout starts when it starts. A dependency on a stage that is not in the
monitor's list is ignored, so tests can run any subset.

Stages that never wait (controller, drain, rollover, liveness, telemetry:
they read and write in-memory state) offer ``run_now``, a plain call: the
pass calls it in its own task once the stage's predecessors are done, each
call guarded like a task's run, instead of starting a task and a cancel scope
for it (trio's work around a task was most of an idle pass's Python). Nothing
can cut a call that does not wait, so ``stage_timeout_s`` bounds only the
stages that wait (health, readmission, persistence).

Failure streak. A pass with at least one stage error adds one to
``failure_streak``; at ``failure_limit`` admission closes with
``monitoring degraded: <stage> <class>`` (the first error in stage order of
the latest failing pass) and ``monitor_degraded`` is logged once. Passes go on
while degraded; one pass without errors clears the streak, reopens admission
and logs ``monitor_recovered``. The streak lives in this object only, so a
restarted router starts at zero.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import msgspec
import trio

from narwhal.config import RunningConfig
from narwhal.fleet.admission import Admission
from narwhal.obs.logs import log_event
from narwhal.obs.router_metrics import RouterMetrics

__all__ = ["RUNS_AFTER", "STAGE_NAMES", "STAGE_TIMEOUT_CLASS", "Monitor", "PassResult", "Stage", "StageError"]

# The spec's stage list, in its order; errors of one pass are reported in this order.
STAGE_NAMES: tuple[str, ...] = ("controller", "health", "drain", "rollover", "readmission",
                                "liveness", "telemetry", "persistence")

# Which stages must have finished (in this pass) before a stage starts.
RUNS_AFTER: dict[str, tuple[str, ...]] = {
    "controller": ("rollover", "health"),
    "liveness": ("health",),
    "telemetry": ("rollover",),
    "persistence": ("controller", "health", "drain", "rollover", "readmission", "liveness", "telemetry"),
}

# The class recorded when a stage is cut at stage_timeout_s (stable: operators alert on it).
STAGE_TIMEOUT_CLASS = "TimeoutError"


class Stage(Protocol):
    """One monitor stage: a name from ``STAGE_NAMES`` and one async job per pass.

    A stage that never waits may also have ``run_now(pass_number)``, the same job as a plain call, which the
    pass calls instead of starting a task for ``run``."""

    name: str

    async def run(self, pass_number: int) -> None: ...


class StageError(msgspec.Struct, frozen=True, kw_only=True):
    """A stage that raised or timed out in pass ``pass_number``, at monotonic time ``at``."""

    stage: str
    error_class: str
    message: str
    pass_number: int
    at: float


class PassResult(msgspec.Struct, frozen=True, kw_only=True):
    """What one pass did: its number, when it ran, and its stage errors in stage order."""

    number: int
    started_at: float
    finished_at: float
    errors: list[StageError]

    @property
    def ok(self) -> bool:
        return not self.errors


def _leaf(exc: BaseException) -> BaseException:
    """A group holding exactly one exception reports that exception (a stage's inner nursery)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


class _Progress:
    """A pass's stage tasks still running, and the event the next one to end sets."""

    __slots__ = ("ended", "running")

    def __init__(self) -> None:
        self.running = 0
        self.ended = trio.Event()


class Monitor:
    """Runs the stages once per ``interval_s`` and closes admission when passes keep failing."""

    def __init__(self, stages: Sequence[Stage], *, interval_s: float, stage_timeout_s: float,
                 failure_limit: int, admission: Admission, metrics: RouterMetrics,
                 clock: Callable[[], float] = trio.current_time, acting: Callable[[], bool] | None = None,
                 passive: frozenset[str] = frozenset({"telemetry"})) -> None:
        """``clock`` must be trio's clock (or share its time base): passes ``sleep_until`` on it.

        ``acting()`` False (a replica): a pass runs only the ``passive`` stages, which decide nothing."""
        self._acting = acting
        self._passive = passive
        names = [stage.name for stage in stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names must be unique, got {names}")
        if interval_s <= 0 or stage_timeout_s <= 0 or failure_limit < 1:
            raise ValueError("interval_s and stage_timeout_s must be > 0, failure_limit >= 1")
        self.stages = list(stages)
        self.interval_s = interval_s
        self.stage_timeout_s = stage_timeout_s
        self.failure_limit = failure_limit
        self.admission = admission
        self.metrics = metrics
        self.clock = clock
        self._position = {name: index for index, name in enumerate(names)}
        self._after = {name: tuple(dep for dep in RUNS_AFTER.get(name, ()) if dep in self._position)
                       for name in names}
        self.failure_streak = 0
        self.degraded_reason: str | None = None
        self.passes = 0
        self.last_errors: list[StageError] = []
        self.last_pass: PassResult | None = None
        self._register_gauges()

    def configure(self, running: RunningConfig) -> None:
        """A reload: the next pass is timed, bounded and counted by the new ``[controller]`` values."""
        controller = running.config.controller
        self.interval_s = controller.monitor_interval_s
        self.stage_timeout_s = controller.stage_timeout_s
        self.failure_limit = controller.monitor_failure_limit

    def __repr__(self) -> str:
        state = f"degraded: {self.degraded_reason}" if self.degraded_reason else "ok"
        return (f"<Monitor [{len(self.stages)} stages | pass {self.passes} | "
                f"streak {self.failure_streak}/{self.failure_limit} | {state}]>")

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Run passes at t0 + k * interval_s until cancelled; an overrun starts the next pass at once."""
        t0 = self.clock()
        slot = 0
        interval = self.interval_s
        task_status.started()
        while True:
            await trio.sleep_until(t0 + slot * interval)
            await self.run_pass()
            slot += 1
            if self.interval_s != interval:
                # A config reload changed the period: a new grid from the pass just run.
                t0, slot, interval = t0 + (slot - 1) * interval, 1, self.interval_s
            # Overran past the next slot: take the latest slot already due (so the
            # next pass starts now) and skip the missed ones; the grid stays put.
            due = math.floor((self.clock() - t0) / interval)
            slot = max(slot, due)

    async def run_pass(self) -> PassResult:
        """Run every stage once, settle the failure streak, and return what happened."""
        self.passes += 1
        number = self.passes
        started_at = self.clock()
        errors: list[StageError] = []
        acting = self._acting is None or self._acting()
        # Stages finished in this pass (or not run by a replica), and those still to start.
        done: set[str] = set()
        waiting: list[Stage] = []
        for stage in self.stages:
            if acting or stage.name in self._passive:
                waiting.append(stage)
            else:
                done.add(stage.name)
        progress = _Progress()
        async with trio.open_nursery() as nursery:
            while waiting:
                blocked: list[Stage] = []
                called = False
                for stage in waiting:
                    if not done.issuperset(self._after[stage.name]):
                        blocked.append(stage)
                        continue
                    run_now = getattr(stage, "run_now", None)
                    if run_now is None and not progress.running and len(done) + 1 == len(self.stages):
                        # The pass's last stage (persistence, unless a replica's): no task to start for it.
                        self._record(await self._guarded(stage, number), errors)
                        done.add(stage.name)
                        called = True
                        continue
                    if run_now is None:
                        progress.running += 1
                        nursery.start_soon(self._run_stage, stage, number, done, errors, progress,
                                           name=f"monitor stage {stage.name}")
                        continue
                    try:
                        run_now(number)
                    except Exception as exc:  # noqa: BLE001 - one stage's failure must not stop its siblings
                        self._record(self._stage_error(stage, exc, number), errors)
                    done.add(stage.name)
                    called = True
                waiting = blocked
                if waiting and not called:
                    if not progress.running:
                        raise RuntimeError(f"monitor stages wait for each other: {[s.name for s in waiting]}")
                    # Until a stage task ends (a plain call may have let stages later in the list start at once).
                    await progress.ended.wait()
                    progress.ended = trio.Event()
        errors.sort(key=lambda error: self._position[error.stage])
        result = PassResult(number=number, started_at=started_at, finished_at=self.clock(), errors=errors)
        self.last_pass = result
        self.last_errors = errors
        self._settle(result)
        return result

    async def _run_stage(self, stage: Stage, number: int, done: set[str], errors: list[StageError],
                         progress: _Progress) -> None:
        try:
            self._record(await self._guarded(stage, number), errors)
        finally:
            done.add(stage.name)
            progress.running -= 1
            progress.ended.set()

    def _record(self, error: StageError | None, errors: list[StageError]) -> None:
        if error is not None:
            errors.append(error)
            self._report(error)

    def _stage_error(self, stage: Stage, exc: Exception, number: int) -> StageError:
        leaf = _leaf(exc)
        return StageError(stage=stage.name, error_class=type(leaf).__name__,
                          message=str(leaf) or type(leaf).__name__, pass_number=number, at=self.clock())

    async def _guarded(self, stage: Stage, number: int) -> StageError | None:
        """Run one stage in its own cancel scope; its exception or timeout becomes a StageError."""
        try:
            with trio.move_on_after(self.stage_timeout_s) as scope:
                await stage.run(number)
        except Exception as exc:  # noqa: BLE001 - one stage's failure must not stop its siblings
            return self._stage_error(stage, exc, number)
        if scope.cancelled_caught:
            return StageError(stage=stage.name, error_class=STAGE_TIMEOUT_CLASS,
                              message=f"stage did not finish within stage_timeout_s ({self.stage_timeout_s:g} s)",
                              pass_number=number, at=self.clock())
        return None

    def _report(self, error: StageError) -> None:
        self.metrics.stage_errors.inc(error.stage, error.error_class)
        log_event("stage_error", level=logging.ERROR, stage=error.stage, message=error.message,
                  **{"class": error.error_class, "pass": error.pass_number})

    def _settle(self, result: PassResult) -> None:
        """Advance or clear the failure streak, closing or reopening admission at the limit."""
        if result.errors:
            self.failure_streak += 1
            first = result.errors[0]
            if self.failure_streak < self.failure_limit:
                return
            reason = f"monitoring degraded: {first.stage} {first.error_class}"
            newly_degraded = self.degraded_reason is None
            if reason != self.degraded_reason:
                # The text follows the latest failing pass while degraded.
                self.admission.close("monitor", reason)
                self.degraded_reason = reason
            if newly_degraded:
                log_event("monitor_degraded", level=logging.ERROR, reason=reason, stage=first.stage,
                          streak=self.failure_streak, failure_limit=self.failure_limit,
                          **{"class": first.error_class, "pass": result.number})
            return
        if not self.failure_streak:
            return
        reopened = self.degraded_reason is not None
        if reopened:
            self.admission.open("monitor")
            self.degraded_reason = None
        log_event("monitor_recovered", failed_passes=self.failure_streak, admission_reopened=reopened,
                  **{"pass": result.number})
        self.failure_streak = 0

    def _register_gauges(self) -> None:
        m = self.metrics
        m.add_gauge("narwhal_monitor_failure_streak", "Consecutive monitor passes with a stage error.", (),
                    lambda: {(): float(self.failure_streak)})
        m.add_gauge("narwhal_monitor_degraded", "1 while the monitor keeps admission closed.", (),
                    lambda: {(): float(self.degraded_reason is not None)})
        m.add_gauge("narwhal_monitor_passes", "Monitor passes run since this router started.", (),
                    lambda: {(): float(self.passes)})

        def last_duration() -> dict[tuple[str, ...], float]:
            last = self.last_pass
            return {} if last is None else {(): last.finished_at - last.started_at}

        m.add_gauge("narwhal_monitor_last_pass_seconds", "Duration of the latest monitor pass.", (),
                    last_duration)
