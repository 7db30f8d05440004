"""The recheck: a faster ``GET /health`` of the engines that are out, so a restart is noticed at once.

Every ``recovery.recheck_interval_s`` the loop asks ``targets(now)`` which
engines are out (the readmitter's answer: ejected and not drained, or held by a
failure quarantine) and starts one health check for each that has none in
flight; engines in placement are never checked here, so healthy engines get no
more probes than the monitor's sweep gives them. When a tick finds nothing out
and no check running, the loop sleeps until ``wake()`` (the readmitter calls it
on every fleet event and when a readmission attempt ends) and then takes the
next tick of its grid: an idle router does not wake ten times a second for it,
and an engine that goes out is checked at the same instants as before.

Each check runs on the control pool, bounded by ``timeout_s``, and reports
``on_health(name, ok)``: ``ok`` is a successful health answer by the one status
table. A recheck is not a monitor sweep: a silent engine gets no liveness miss
and a failure adds no evidence (the engine is already out; the monitor's
sweep still records both), and a full control pool is no verdict at all.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import trio

from narwhal.config import EngineSpec
from narwhal.errors import EngineFailure, PoolSaturated, SuccessKind
from narwhal.obs.logs import log_event
from narwhal.pools.classify import health_answer
from narwhal.pools.control import ControlCalls

__all__ = ["Rechecker"]


class Rechecker:
    """Checks the health of the engines ``targets`` names, every ``interval_s``, one check per engine at a time."""

    def __init__(self, *, engines: Mapping[str, EngineSpec], control_pool: ControlCalls,
                 targets: Callable[[float], list[str]], on_health: Callable[[str, bool], None],
                 interval_s: float, timeout_s: float, clock: Callable[[], float] = trio.current_time) -> None:
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError("interval_s and timeout_s must be > 0")
        self.engines = dict(engines)
        self.control_pool = control_pool
        self.targets = targets
        self.on_health = on_health
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.clock = clock
        self.checks = 0
        self._running: set[str] = set()
        self._wake = trio.Event()
        # Whether the latest tick found nothing to watch (no target, no check running).
        self.idle = False
        # False: tick on even while idle (no one would call wake()).
        self.sleeps_when_idle = True

    def __repr__(self) -> str:
        return (f"<Rechecker [every {self.interval_s:g} s | {self.checks} checks | "
                f"running: {', '.join(sorted(self._running)) or '-'}]>")

    def wake(self) -> None:
        """Something may have gone out: an idle loop takes its next tick (cheap; call it freely)."""
        self._wake.set()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Tick at t0 + k * interval_s until cancelled, sleeping while idle; checks run in this task's nursery."""
        async with trio.open_nursery() as nursery:
            task_status.started()
            t0 = self.clock()
            slot = 0
            interval = self.interval_s
            while True:
                if self.interval_s != interval:
                    # A config reload changed the period: a new grid from the last tick.
                    t0, slot, interval = t0 + slot * interval, 0, self.interval_s
                slot += 1
                await trio.sleep_until(t0 + slot * interval)
                # A wake from now on is news to this tick.
                self._wake = trio.Event()
                try:
                    self.tick(nursery)
                except Exception as exc:  # noqa: BLE001 - one bad tick must not end the rechecks
                    self.idle = False
                    log_event("recheck_error", level=logging.ERROR, engine=None,
                              **{"class": type(exc).__name__}, message=str(exc))
                if self.idle and self.sleeps_when_idle:
                    await self._wake.wait()
                # A stalled event loop skips the ticks it missed instead of firing them all at once.
                slot = max(slot, int((self.clock() - t0) // interval))

    def tick(self, nursery: trio.Nursery) -> list[str]:
        """Start a check for every target with none in flight; returns the engines started."""
        started = []
        targets = self.targets(self.clock())
        self.idle = not targets and not self._running
        for name in targets:
            if name in self._running or name not in self.engines:
                continue
            self._running.add(name)
            nursery.start_soon(self._check, name, name=f"recheck {name}")
            started.append(name)
        return started

    async def _check(self, name: str) -> None:
        try:
            ok: bool | None = None
            with trio.move_on_after(self.timeout_s):
                try:
                    response = await self.control_pool.get(self.engines[name], "/health", timeout_s=self.timeout_s)
                except EngineFailure:
                    ok = False
                except PoolSaturated:
                    return  # our own pool was full: no verdict on the engine
                else:
                    ok = health_answer(name, response.status) is SuccessKind.HEALTH_200
            self.checks += 1
            self.on_health(name, bool(ok))
        except Exception as exc:  # noqa: BLE001 - a broken report must not end the loop for every engine
            log_event("recheck_error", level=logging.ERROR, engine=name, **{"class": type(exc).__name__},
                      message=str(exc))
        finally:
            self._running.discard(name)
