"""When a watchdog next wakes, and how a new deadline wakes it sooner.

A watchdog keeps the deadlines of many waits from one task (no cancel scope
per wait). It sleeps until the earliest deadline it knows of, not on a fixed
tick: under load a tick woke it a few times a second whatever the deadlines
were, and at the rates a real engine serves that was several wake-ups a
request. Whoever sets a deadline calls ``due(deadline)``; the watchdog is
woken only when that deadline comes before the time it sleeps to, which a
deadline set from a timeout counted from now rarely does.
"""

from __future__ import annotations

import trio

__all__ = ["Alarm"]

_INF = float("inf")
# The shortest sleep: a deadline that did not take (a watchdog's bug) must not make it spin.
_MIN_SLEEP_S = 0.001


class Alarm:
    """One watchdog's wake-up time (``at``): -inf while it is awake, +inf while nothing is due."""

    __slots__ = ("_woken", "at", "wakeups")

    def __init__(self) -> None:
        # -inf while the watchdog is awake (or not running): it reads every deadline before it sleeps again.
        self.at = -_INF
        self._woken = trio.Event()
        # Times the watchdog woke, at its time or sooner (statistics).
        self.wakeups = 0

    def due(self, deadline: float) -> None:
        """A deadline was set: wake the watchdog now if it would sleep past it."""
        if deadline < self.at:
            self.wake()

    def wake(self) -> None:
        self.at = -_INF
        self._woken.set()

    @property
    def sleeping(self) -> bool:
        return self.at != -_INF

    async def sleep_until(self, at: float) -> None:
        """Until ``at`` (trio time; +inf: until woken), at least a millisecond, or until a deadline before it
        is ``due``."""
        self._woken = trio.Event()
        self.at = at
        try:
            if at == _INF:
                await self._woken.wait()
            else:
                with trio.move_on_at(max(at, trio.current_time() + _MIN_SLEEP_S)):
                    await self._woken.wait()
        finally:
            self.at = -_INF
            self.wakeups += 1
