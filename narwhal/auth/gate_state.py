"""The priority gate's decisions, pure: who takes a slot, who waits, who is shed (no I/O, no clock).

Slots are granted at the moment they free: a waiter the core admits already holds its slot when its
task wakes, so an arrival can never take a slot freed for someone waiting (no overtaking), and the
invariant "nobody waits while a slot is free for its class" holds after every call. The trio shell
(``narwhal.auth.priority``) parks waiters and wakes the ones each call returns.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Literal, NamedTuple

__all__ = ["PRIORITY_ORDER", "GateState", "Queued", "RefusalCode", "Ticket", "Waiter", "reserved_slots"]

RefusalCode = Literal["overloaded", "pool_saturated", "queue_full"]

# Order of service; a class's rank is its index (0 is served first).
PRIORITY_ORDER: tuple[str, ...] = ("high", "normal", "low")
_RANKS = {name: rank for rank, name in enumerate(PRIORITY_ORDER)}
_HIGH = 0
# Returned when nothing changed: the common path allocates nothing.
_NOBODY: tuple[Waiter, ...] = ()


def reserved_slots(capacity: int, reserve_high: float) -> int:
    """Slots only high may use: floor(capacity * reserve_high), at least 1 when above 0, at most capacity - 1."""
    if reserve_high <= 0:
        return 0
    # The epsilon keeps a share written in decimal whole (100 * 0.29 is 28.999999999999996 in binary).
    reserved = max(1, math.floor(capacity * reserve_high + 1e-9))
    if capacity > 1:
        reserved = min(reserved, capacity - 1)
    return reserved


class Ticket:
    """One held slot; opaque to callers, released exactly once."""

    __slots__ = ("live", "rank", "tenant")

    def __init__(self, tenant: str, rank: int) -> None:
        self.tenant = tenant
        self.rank = rank
        self.live = True


class Waiter:
    """One request waiting for a slot; settled by the core with a ticket or a refusal."""

    __slots__ = ("gone", "rank", "refusal", "seq", "since", "tenant", "ticket")

    def __init__(self, tenant: str, rank: int, seq: int, since: float) -> None:
        self.tenant = tenant
        self.rank = rank
        self.seq = seq          # arrival order: ties between tenants and "newest" when shedding
        self.since = since
        self.ticket: Ticket | None = None
        self.refusal: RefusalCode | None = None
        self.gone = False       # its task gave up while it waited

    @property
    def settled(self) -> bool:
        """True once it holds a ticket or was refused (shed from the queue)."""
        return self.ticket is not None or self.refusal is not None


class Queued(NamedTuple):
    """An arrival that waits, and the waiter it shed from a full queue (it was refused "queue_full")."""

    waiter: Waiter
    shed: Waiter | None


def _rank(priority: str) -> int:
    try:
        return _RANKS[priority]
    except KeyError:
        raise ValueError(f"priority must be one of {', '.join(PRIORITY_ORDER)}, got {priority!r}") from None


class GateState:
    """Capacity by priority class: high may use every slot, normal and low share capacity - reserved."""

    def __init__(self, *, capacity: int, reserve_high: float, max_queue: int) -> None:
        self._in_use = [0, 0, 0]
        self._total = 0
        self._shared = 0        # normal + low in use: what the reserve is kept from
        # Per class, each tenant's requests in flight (fairness) and its waiters in arrival order.
        self._flight: tuple[dict[str, int], ...] = ({}, {}, {})
        self._queues: tuple[dict[str, deque[Waiter]], ...] = ({}, {}, {})
        self._waiting = [0, 0, 0]
        self._waiting_total = 0
        self._seq = 0
        # Per class, when each tenant was last granted a slot (a count of grants): ties in flight go to the
        # tenant served longest ago, so a tenant with ten times the waiters does not win every tie by having the
        # oldest one. Bounded by the keys file's tenants.
        self._grants = 0
        self._last_grant: tuple[dict[str, int], ...] = ({}, {}, {})
        self._capacity = self._share = self._reserved = self._max_queue = 0
        self.configure(capacity=capacity, reserve_high=reserve_high, max_queue=max_queue)

    # -- configuration and views --------------------------------------------------------------------

    def configure(self, *, capacity: int, reserve_high: float, max_queue: int) -> list[Waiter]:
        """New limits, live; returns the waiters settled by the change (admitted, or shed from a shorter queue).

        Requests in flight are never cut: under a smaller capacity nobody is admitted until in_use is below it.
        """
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if not 0 <= reserve_high < 1:
            raise ValueError(f"reserve_high must be in [0, 1), got {reserve_high}")
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self._capacity = capacity
        self._reserved = reserved_slots(capacity, reserve_high)
        self._share = capacity - self._reserved
        self._max_queue = max_queue
        # Admit first, so a queue that both grows capacity and shrinks sheds only what still waits.
        settled = self._dispatch()
        while self._waiting_total > max_queue:
            settled.append(self._shed_newest(self._lowest_waiting()))
        return settled

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def reserved(self) -> int:
        """Slots kept for high priority."""
        return self._reserved

    @property
    def max_queue(self) -> int:
        return self._max_queue

    def stats(self) -> dict[str, dict[str, int]]:
        """Per class: slots in use and requests waiting."""
        return {name: {"in_use": self._in_use[rank], "waiting": self._waiting[rank]}
                for rank, name in enumerate(PRIORITY_ORDER)}

    def tenants(self) -> dict[str, int]:
        """Each tenant's requests in flight, every class together."""
        total: dict[str, int] = {}
        for flight in self._flight:
            for tenant, n in flight.items():
                total[tenant] = total.get(tenant, 0) + n
        return total

    def waiting_tenants(self, priority: str) -> dict[str, int]:
        """Each tenant's requests waiting in this class."""
        return {tenant: len(queue) for tenant, queue in self._queues[_rank(priority)].items()}

    def free_for(self, priority: str) -> bool:
        """Whether a slot is free for this class (ignoring who waits)."""
        return self._free(_rank(priority))

    # -- admission ----------------------------------------------------------------------------------

    def try_enter(self, tenant: str, priority: str) -> Ticket | RefusalCode:
        """A slot now, or why not: "overloaded" when only the reserve is free, else "pool_saturated"."""
        rank = _RANKS.get(priority)
        if rank is None:
            rank = _rank(priority)  # raises, naming the classes
        # ``_free``, inline: this runs for every request under the saturate policy.
        if (self._total < self._capacity and (rank == _HIGH or self._shared < self._share)
                and (self._waiting_total == 0 or not self._waiting_ahead(rank))):
            return self._grant(tenant, rank)
        # Normal or low with slots free that only high may take: the class is over its share.
        return "overloaded" if self._total < self._capacity else "pool_saturated"

    def arrive(self, tenant: str, priority: str, now: float) -> Ticket | Queued | RefusalCode:
        """A slot now, a place in the queue (possibly shedding a lower waiter), or a refusal."""
        rank = _rank(priority)
        if self._free(rank) and (self._waiting_total == 0 or not self._waiting_ahead(rank)):
            return self._grant(tenant, rank)
        shed = None
        if self._waiting_total >= self._max_queue:
            lowest = self._lowest_waiting()
            if lowest is None or lowest == rank:
                return "queue_full"
            if lowest < rank:
                # Everyone waiting outranks this request: its class is over its share.
                return "overloaded"
            shed = self._shed_newest(lowest)
        self._seq += 1
        waiter = Waiter(tenant, rank, self._seq, now)
        queue = self._queues[rank].get(tenant)
        if queue is None:
            queue = self._queues[rank][tenant] = deque()
        queue.append(waiter)
        self._waiting[rank] += 1
        self._waiting_total += 1
        return Queued(waiter, shed)

    def leave(self, ticket: Ticket) -> Sequence[Waiter]:
        """Free the ticket's slot; returns the waiters admitted into it (at most one)."""
        if not ticket.live:
            raise ValueError(f"ticket of {ticket.tenant!r} left twice")
        ticket.live = False
        rank = ticket.rank
        self._in_use[rank] -= 1
        self._total -= 1
        if rank != _HIGH:
            self._shared -= 1
        flight = self._flight[rank]
        left = flight[ticket.tenant] - 1
        if left:
            flight[ticket.tenant] = left
        else:
            del flight[ticket.tenant]
        if self._waiting_total == 0:
            return _NOBODY
        return self._dispatch()

    def abandon(self, waiter: Waiter) -> Sequence[Waiter]:
        """A waiter's task gave up (deadline, cancellation): out of the queue, or its granted slot passed on."""
        if waiter.ticket is not None:
            # Granted at the moment it was cancelled: the slot goes to the next waiter, never lost.
            return self.leave(waiter.ticket) if waiter.ticket.live else _NOBODY
        if waiter.refusal is not None or waiter.gone:
            return _NOBODY
        self._unqueue(waiter)
        waiter.gone = True
        # Removing a waiter frees no slot: nobody is admitted.
        return _NOBODY

    # -- internals ----------------------------------------------------------------------------------

    def _free(self, rank: int) -> bool:
        if self._total >= self._capacity:
            return False
        return rank == _HIGH or self._shared < self._share

    def _waiting_ahead(self, rank: int) -> bool:
        """Whether anyone of this class or a higher one waits (an arrival must not overtake them)."""
        waiting = self._waiting
        return bool(waiting[0] or (rank >= 1 and waiting[1]) or (rank == 2 and waiting[2]))

    def _lowest_waiting(self) -> int | None:
        for rank in (2, 1, 0):
            if self._waiting[rank]:
                return rank
        return None

    def _grant(self, tenant: str, rank: int) -> Ticket:
        self._in_use[rank] += 1
        self._total += 1
        if rank != _HIGH:
            self._shared += 1
        flight = self._flight[rank]
        flight[tenant] = flight.get(tenant, 0) + 1
        self._grants += 1
        self._last_grant[rank][tenant] = self._grants
        return Ticket(tenant, rank)

    def _dispatch(self) -> list[Waiter]:
        """Admit waiters into free slots: high, then normal, then low; the fairest tenant within a class."""
        admitted: list[Waiter] = []
        while self._waiting_total and self._total < self._capacity:
            if self._waiting[_HIGH]:
                rank = _HIGH
            elif self._shared < self._share:
                rank = 1 if self._waiting[1] else 2
            else:
                break
            waiter = self._pop_fairest(rank)
            waiter.ticket = self._grant(waiter.tenant, rank)
            admitted.append(waiter)
        return admitted

    def _pop_fairest(self, rank: int) -> Waiter:
        """The class's tenant with the fewest requests in flight in it (ties: the one served longest ago, then
        earliest arrival) gives its first."""
        flight, last = self._flight[rank], self._last_grant[rank]
        best: deque[Waiter] | None = None
        best_key = (0, 0, 0)
        for tenant, queue in self._queues[rank].items():
            key = (flight.get(tenant, 0), last.get(tenant, 0), queue[0].seq)
            if best is None or key < best_key:
                best, best_key = queue, key
        assert best is not None
        waiter = best.popleft()
        self._forget_if_empty(waiter, best)
        return waiter

    def _shed_newest(self, rank: int | None) -> Waiter:
        assert rank is not None
        newest = max(self._queues[rank].values(), key=lambda queue: queue[-1].seq)
        waiter = newest.pop()
        self._forget_if_empty(waiter, newest)
        waiter.refusal = "queue_full"
        return waiter

    def _unqueue(self, waiter: Waiter) -> None:
        queue = self._queues[waiter.rank][waiter.tenant]
        queue.remove(waiter)
        self._forget_if_empty(waiter, queue)

    def _forget_if_empty(self, waiter: Waiter, queue: deque[Waiter]) -> None:
        """Count the waiter out; a tenant with nobody waiting leaves the class's table (it stays small)."""
        if not queue:
            del self._queues[waiter.rank][waiter.tenant]
        self._waiting[waiter.rank] -= 1
        self._waiting_total -= 1
