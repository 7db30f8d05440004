"""Whether the router accepts new requests, and why not when it does not.

Several owners can close admission independently (the monitor when degraded,
the lease when fenced or standing by, shutdown); each holds its own reason, and
admission is open only when none is held. Requests already admitted are never
affected: closing admission only refuses new ones.

The lease is the one owner whose closure is a time, not an event: a router
may admit only before its fencing deadline, and a background task cannot be
trusted to close admission on time (a process stopped and woken past its
lease runs the accept loop before any timer). So ``lease_deadline`` is a plain
number that ``refusal(now)`` compares on every admission.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["FENCED_REASON", "Admission"]

# /ready and the 503 body once the lease deadline has passed (the interface text).
FENCED_REASON = "fenced: lease not renewed"

# Order in which reasons are reported when several hold at once: the one an
# operator must act on first comes first.
_PRIORITY = ("shutdown", "lease", "monitor")


class Admission:
    """A set of named closures; ``reason()`` is None when admission is open."""

    def __init__(self, clock: Callable[[], float] | None = None, *,
                 on_change: Callable[[], None] | None = None,
                 view_reason: Callable[[float], str] | None = None) -> None:
        """``clock`` (the request path's) lets ``reason()`` compare the lease deadline itself."""
        self._clock = clock
        self._closed: dict[str, str] = {}
        self._reason: str | None = None
        self._lease_deadline: float | None = None
        # A replica's: from this instant its view of the fleet is too old to serve on (None: no such limit).
        self._view_deadline: float | None = None
        # The text past the view deadline, given the time (it says how old the view is).
        self.view_reason = view_reason or (lambda now: "replica: fleet view too old")
        # Called after every change (worker processes get a new snapshot).
        self.on_change = on_change

    @property
    def lease_deadline(self) -> float | None:
        """Monotonic time (the request path's clock) from which new requests are refused for
        want of a valid lease; None when no lease is configured."""
        return self._lease_deadline

    @lease_deadline.setter
    def lease_deadline(self, deadline: float | None) -> None:
        self._lease_deadline = deadline
        if self.on_change is not None:
            self.on_change()

    @property
    def view_deadline(self) -> float | None:
        """Monotonic time (the request path's clock) from which a replica refuses new requests for want of a
        current view of the fleet (``[lease] replica_stale_s`` after etcd last answered); None: no limit."""
        return self._view_deadline

    @view_deadline.setter
    def view_deadline(self, deadline: float | None) -> None:
        self._view_deadline = deadline
        if self.on_change is not None:
            self.on_change()

    def close(self, owner: str, reason: str) -> None:
        """Close admission on behalf of ``owner`` ('monitor', 'lease', 'shutdown')."""
        self._closed[owner] = reason
        self._recompute()

    def open(self, owner: str) -> None:
        """Withdraw ``owner``'s closure; admission reopens when no owner holds one."""
        if self._closed.pop(owner, None) is not None:
            self._recompute()

    def reason(self) -> str | None:
        """Why new requests are refused now, or None when admission is open (see ``refusal``)."""
        if self._clock is None or (self.lease_deadline is None and self._view_deadline is None):
            return self._reason
        return self.refusal(self._clock())

    def refusal(self, now: float) -> str | None:
        """Why a request arriving at ``now`` is refused, or None: the closures, then the lease deadline."""
        reason = self._reason
        deadline = self.lease_deadline
        if deadline is not None and now >= deadline and "shutdown" not in self._closed \
                and "lease" not in self._closed:
            return FENCED_REASON
        view_deadline = self._view_deadline
        if reason is None and view_deadline is not None and now >= view_deadline:
            return self.view_reason(now)
        return reason

    def held_by(self, owner: str) -> str | None:
        return self._closed.get(owner)

    def _recompute(self) -> None:
        self._reason = self._first_reason()
        if self.on_change is not None:
            self.on_change()

    def _first_reason(self) -> str | None:
        for owner in _PRIORITY:
            if owner in self._closed:
                return self._closed[owner]
        return next(iter(self._closed.values()), None)
