"""A readiness hub's round run from trio's loop right after its I/O wait, so the tasks it wakes run in that batch.

When a socket in a hub's set (``readiness.py``) becomes ready, trio's
``epoll_wait`` returns the hub's set and trio reschedules the hub task; the
hub task's round, a step later, reschedules the task waiting for the socket,
which runs only in trio's *next* batch: two trips through trio's loop for one
engine answer or one client request (a loop trip is about 70 Python calls of
trio's before any task runs). Here a trio instrument's ``after_io_wait``,
which trio calls after it has taken its I/O events and before it takes its
batch, runs the hub's round itself when it sees the hub task rescheduled: the
tasks the round wakes join the same batch, and the hub task, stepping in it,
takes the round's outcome instead of polling again.

One instrument per trio run serves every hub running in it (the front's and
the data pool's). It reads one attribute of trio's task that is not public
API (``Task._next_send_fn``: set while the task is scheduled to run);
``EarlyRounds.join`` checks it is there and otherwise leaves the hub to its
task's own rounds.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from narwhal.http1.readiness import Readiness

__all__ = ["EarlyRounds", "usable"]

_INSTRUMENT: trio.lowlevel.RunVar[EarlyRounds | None] = trio.lowlevel.RunVar("narwhal_early_rounds", default=None)


def usable() -> bool:
    """The current task shows the part of trio's run this needs (a trio release may not)."""
    return hasattr(trio.lowlevel.current_task(), "_next_send_fn")


class EarlyRounds(trio.abc.Instrument):
    """The instrument: the round of each joined hub whose task trio has just scheduled."""

    def __init__(self) -> None:
        self._hubs: list[Readiness] = []

    @classmethod
    def join(cls, hub: Readiness) -> bool:
        """Serve ``hub`` (its task is the current one) from this run's instrument; False when trio lacks what it
        reads."""
        if not usable():
            return False
        instrument = _INSTRUMENT.get()
        if instrument is None:
            instrument = cls()
            _INSTRUMENT.set(instrument)
            trio.lowlevel.add_instrument(instrument)
        instrument._hubs.append(hub)
        return True

    @staticmethod
    def leave(hub: Readiness) -> None:
        """No more early rounds for ``hub``; the instrument goes with the last hub."""
        instrument = _INSTRUMENT.get()
        if instrument is None or hub not in instrument._hubs:
            return
        instrument._hubs.remove(hub)
        if not instrument._hubs:
            _INSTRUMENT.set(None)
            # KeyError: trio removed it already (it raised).
            with contextlib.suppress(KeyError):
                trio.lowlevel.remove_instrument(instrument)

    def after_io_wait(self, timeout: float) -> None:
        """trio took its I/O events and is about to run its batch: a hub task it scheduled has its round now."""
        for hub in self._hubs:
            task = hub.task
            if task is not None and task._next_send_fn is not None and not hub.early_pending:
                hub.early_round()
