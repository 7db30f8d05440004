"""Admission to the data plane's capacity by priority class: the trio shell over ``gate_state``.

The core decides; this shell parks each waiter on a trio Event and sets the events of the waiters
each decision settles. Entering with a slot free is a few dict and int operations and no checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import trio

from narwhal.auth.gate_state import GateState, RefusalCode, Ticket, Waiter
from narwhal.errors import NarwhalError

__all__ = ["GateRefused", "PriorityGate", "Ticket"]

# Capacity frees as requests end: a client may try again soon (the retry-after header, in seconds).
RETRY_AFTER_S = 1.0


class GateRefused(NarwhalError):
    """No capacity for this request (503): ``code`` says why, ``retry_after_s`` when to try again."""

    def __init__(self, code: RefusalCode, retry_after_s: float = RETRY_AFTER_S) -> None:
        super().__init__(f"refused for capacity: {code}")
        self.code: RefusalCode = code
        self.retry_after_s = retry_after_s


class PriorityGate:
    """Admission to the data plane's capacity by priority class, fair between tenants within a class."""

    def __init__(self, *, capacity: int, reserve_high: float, max_queue: int,
                 clock: Callable[[], float] = trio.current_time) -> None:
        self._state = GateState(capacity=capacity, reserve_high=reserve_high, max_queue=max_queue)
        self._clock = clock
        self._events: dict[Waiter, trio.Event] = {}

    @property
    def state(self) -> GateState:
        """The pure core (for views and tests; change it only through the gate)."""
        return self._state

    def reconfigure(self, *, capacity: int, reserve_high: float, max_queue: int) -> None:
        """New limits, live: requests in flight are kept; waiters are admitted or shed as the new limits say."""
        self._wake(self._state.configure(capacity=capacity, reserve_high=reserve_high, max_queue=max_queue))

    def try_enter(self, tenant: str, priority: str) -> Ticket:
        """Saturate policy: a slot at once, or GateRefused ("overloaded" or "pool_saturated")."""
        got = self._state.try_enter(tenant, priority)
        if got.__class__ is Ticket:
            return got
        raise GateRefused(got)  # type: ignore[arg-type]

    async def enter(self, tenant: str, priority: str, deadline: float) -> tuple[Ticket, float]:
        """Bounded policy: a slot, waiting for one in the queue if need be; returns (ticket, seconds waited).

        GateRefused when the queue has no room for this request or it is shed from the queue
        ("queue_full"); trio.TooSlowError at ``deadline`` (trio time). With a slot free it returns
        at once, without a checkpoint (the request path checkpoints soon after, at its first I/O).
        """
        since = self._clock()
        got = self._state.arrive(tenant, priority, since)
        if isinstance(got, Ticket):
            return got, 0.0
        if isinstance(got, str):
            raise GateRefused(got)
        waiter, shed = got
        if shed is not None:
            self._wake((shed,))
        event = self._events[waiter] = trio.Event()
        try:
            with trio.fail_at(deadline):
                await event.wait()
        except BaseException:
            # Deadline or cancellation: out of the queue, or a slot granted at this very moment passed on.
            self._events.pop(waiter, None)
            self._wake(self._state.abandon(waiter))
            raise
        if waiter.ticket is not None:
            return waiter.ticket, self._clock() - since
        assert waiter.refusal is not None
        raise GateRefused(waiter.refusal)

    def leave(self, ticket: Ticket) -> None:
        """The request ended: its slot to the next waiter; a second leave of one ticket raises ValueError."""
        admitted = self._state.leave(ticket)
        if admitted:
            self._wake(admitted)

    def stats(self) -> dict[str, dict[str, int]]:
        """{"high": {"in_use": n, "waiting": m}, "normal": ..., "low": ...}."""
        return self._state.stats()

    def tenants(self) -> dict[str, int]:
        """Each tenant's requests in flight."""
        return self._state.tenants()

    def _wake(self, settled: Iterable[Waiter]) -> None:
        for waiter in settled:
            event = self._events.pop(waiter, None)
            if event is not None:
                event.set()
