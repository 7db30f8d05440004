"""The lease's rules, with no I/O: roles, the fencing deadline, takeover counting.

Theory of operation. A router holds the serving lease for one *term*, which
begins when the backend's atomic operation gives it a new ``epoch``. The term
is valid until its fencing deadline::

    deadline = last_renew_sent + ttl_s - fence_margin_s

on the holder's own monotonic clock, where ``last_renew_sent`` is when the
latest *successful* renewal (or the acquisition) was sent: the backend counts
the TTL from when it received the request, which is never earlier, so the
holder's deadline always falls ``fence_margin_s`` before the backend's expiry.
Once the deadline passes the term is over for good: a renewal that succeeds
afterwards does not revive it, and only a fresh acquisition (a new epoch)
makes the router active again.

``LeaseHolding`` owns every role transition; the lease service's parts
(``narwhal.lease.term``, ``fence``, ``handover``) do the I/O and ask it what to do. It takes its
clock as an argument and imports neither trio nor time.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable

import msgspec

__all__ = [
    "LeaseHolding",
    "LeaseRecord",
    "Role",
    "TakeoverCounter",
    "TakeoverRequest",
    "Term",
    "standby_reason",
    "timing_problem",
]


class Role(enum.StrEnum):
    STANDBY = "standby"
    ACTIVE = "active"
    FENCED = "fenced"


def standby_reason(holder: str | None) -> str:
    """The /ready text of a standby (the interface text); ``None``: the lease has not been read yet."""
    if holder is None:
        return "standby: lease not read yet"
    return f"standby: lease held by {holder or 'nobody'}"


def timing_problem(ttl_s: float, renew_interval_s: float, fence_margin_s: float) -> str | None:
    """Why these timings leave no room for two failed renewals before fencing, or None."""
    if ttl_s > fence_margin_s + 2 * renew_interval_s:
        return None
    return (f"ttl_s ({ttl_s:g}) must be > fence_margin_s ({fence_margin_s:g}) "
            f"+ 2 x renew_interval_s ({renew_interval_s:g})")


class TakeoverRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A standby's request that the holder of ``epoch`` yield, because its /ready kept failing."""

    requested_by: str
    epoch: int
    reason: str
    # Wall-clock unix seconds.
    at: float


class LeaseRecord(msgspec.Struct, frozen=True, kw_only=True):
    """The shared record: who holds the lease, in which epoch, and where to ask it /ready.

    ``holder`` is "" when nobody holds it (released, or never taken). The file
    backend keeps the expiry itself in ``expires_at`` (wall clock); in etcd the
    key's lease expires it and ``revision`` is the key's create_revision.
    """

    holder: str = ""
    epoch: int = 0
    advertise_url: str = ""
    # Wall-clock unix seconds.
    acquired_at: float = 0.0
    expires_at: float = 0.0
    revision: int = 0
    # etcd: the lease the key is attached to (0: none, a record nobody renews).
    lease_id: int = 0
    takeover: TakeoverRequest | None = None

    def free_at(self, wall_now: float) -> bool:
        """True when a standby may take the lease (file backend: released or past its expiry)."""
        return not self.holder or wall_now >= self.expires_at


class Term:
    """One holding of the lease: its epoch and its fencing deadline."""

    __slots__ = ("epoch", "fence_margin_s", "last_renew_sent", "ttl_s", "deadline", "over")

    def __init__(self, *, epoch: int, sent_at: float, ttl_s: float, fence_margin_s: float) -> None:
        self.epoch = epoch
        self.ttl_s = ttl_s
        self.fence_margin_s = fence_margin_s
        self.last_renew_sent = sent_at
        self.deadline = sent_at + ttl_s - fence_margin_s
        self.over = False

    def valid(self, now: float) -> bool:
        return not self.over and now < self.deadline

    def renewed(self, sent_at: float, now: float) -> bool:
        """A renewal sent at ``sent_at`` succeeded at ``now``; False (and the term ends) if too late."""
        if not self.valid(now):
            self.over = True
            return False
        if sent_at > self.last_renew_sent:
            self.last_renew_sent = sent_at
            self.deadline = sent_at + self.ttl_s - self.fence_margin_s
        return True


class LeaseHolding:
    """This router's role and, while active, its term; every transition goes through here."""

    def __init__(self, *, router_id: str, ttl_s: float, fence_margin_s: float,
                 clock: Callable[[], float]) -> None:
        problem = timing_problem(ttl_s, 0.0, fence_margin_s)
        if problem is not None or fence_margin_s < 0:
            raise ValueError(problem or "fence_margin_s must be >= 0")
        self.router_id = router_id
        self.ttl_s = ttl_s
        self.fence_margin_s = fence_margin_s
        self.clock = clock
        self.role = Role.STANDBY
        self.term: Term | None = None
        # The holder and epoch last seen in the shared record (ours while active).
        self.holder = ""
        self.epoch = 0
        self.fenced_reason: str | None = None

    def __repr__(self) -> str:
        return f"<LeaseHolding {self.router_id} [{self.role} | holder {self.holder or '-'} | epoch {self.epoch}]>"

    @property
    def admission_deadline(self) -> float:
        """The monotonic time from which this router must not admit: the term's deadline, or -inf."""
        term = self.term
        if self.role is Role.ACTIVE and term is not None and not term.over:
            return term.deadline
        return -math.inf

    def valid(self) -> bool:
        """True while this router is active and before its fencing deadline."""
        return self.clock() < self.admission_deadline

    def acquired(self, epoch: int, sent_at: float) -> None:
        """The backend's atomic operation, sent at ``sent_at``, gave us ``epoch``."""
        self.role = Role.ACTIVE
        self.term = Term(epoch=epoch, sent_at=sent_at, ttl_s=self.ttl_s, fence_margin_s=self.fence_margin_s)
        self.holder = self.router_id
        self.epoch = epoch
        self.fenced_reason = None

    def renewal_succeeded(self, sent_at: float) -> bool:
        """Extend the term; False, and fenced, when the answer came after the deadline."""
        term = self.term
        if self.role is not Role.ACTIVE or term is None:
            return False
        if term.renewed(sent_at, self.clock()):
            return True
        self.fence("renewal succeeded after the fencing deadline")
        return False

    def deadline_passed(self) -> bool:
        """Fence if active past the deadline; True when this call fenced."""
        if self.role is Role.ACTIVE and not self.valid():
            self.fence("lease not renewed before the fencing deadline")
            return True
        return False

    def fence(self, reason: str) -> None:
        """End the term: no admission, no handoff writes, until a fresh acquisition."""
        if self.term is not None:
            self.term.over = True
        self.role = Role.FENCED
        self.fenced_reason = reason

    def released(self) -> None:
        """We gave the lease up (takeover or shutdown): a standby from now on."""
        if self.term is not None:
            self.term.over = True
        self.role = Role.STANDBY
        self.holder = ""

    def observed(self, record: LeaseRecord | None) -> None:
        """A standby or fenced router read the shared record; another holder makes it a standby."""
        if self.role is Role.ACTIVE:
            return
        holder = record.holder if record is not None else ""
        if holder and holder != self.router_id or self.role is Role.STANDBY:
            self.role = Role.STANDBY
        self.holder = holder
        if record is not None:
            # The record's term, as it is now: an epoch counter reset to a lower number is shown too.
            self.epoch = record.epoch


class TakeoverCounter:
    """Consecutive 503s from the holder's /ready, per holder epoch, toward the takeover threshold.

    A 200 or an unreachable holder resets the count (the failures must be
    consecutive readiness failures; a holder that cannot be reached is left to
    its lease's expiry); so does a new holder epoch.
    """

    def __init__(self, threshold: int) -> None:
        if threshold < 1:
            raise ValueError("threshold must be >= 1")
        self.threshold = threshold
        self.epoch = -1
        self.failures = 0
        self.last_reason: str | None = None

    def observe(self, epoch: int, status: int | None, reason: str | None = None) -> bool:
        """Record one poll of the holder of ``epoch`` (``status`` None: unreachable); True at the threshold."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.failures = 0
        if status == 503:
            self.failures += 1
            self.last_reason = reason
        else:
            self.failures = 0
            self.last_reason = None
        if self.failures >= self.threshold:
            self.failures = 0
            return True
        return False
