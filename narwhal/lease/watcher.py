"""A standby's watch on the holder: poll its ``/ready`` and, at the threshold, request a takeover.

Only consecutive 503s count (``TakeoverCounter``): an unreachable holder is
left to its lease's expiry. A standby asks only when it is itself fit to
serve: neither its own readiness (monitor, capacity) nor its monitor fails.

Events (JSON lines): ``takeover_requested``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import httpx
import trio

from narwhal.lease.rules import LeaseRecord, TakeoverCounter, TakeoverRequest
from narwhal.obs.logs import log_event

__all__ = ["HolderWatcher"]


class HolderWatcher:
    """Counts the holder's readiness failures and asks it to yield when this router is the healthier."""

    def __init__(self, *, router_id: str, threshold: int, http: httpx.AsyncClient,
                 timeout_s: Callable[[], float], fit: Callable[[], bool],
                 wall_clock: Callable[[], float]) -> None:
        self.router_id = router_id
        self.counter = TakeoverCounter(threshold)
        self.http = http
        self.timeout_s = timeout_s
        self.fit = fit
        self.wall_clock = wall_clock

    def reset(self) -> None:
        """A new term of ours: the count toward a takeover starts over."""
        self.counter = TakeoverCounter(self.counter.threshold)

    async def poll(self, record: LeaseRecord | None,
                   request: Callable[[TakeoverRequest], Awaitable[bool]]) -> None:
        """Ask the holder of ``record`` for /ready once; at the threshold, ``request`` a takeover."""
        if record is None or not record.holder or record.holder == self.router_id or not record.advertise_url:
            return
        status: int | None = None
        text: str | None = None
        with trio.move_on_after(self.timeout_s()):
            try:
                response = await self.http.get(f"{record.advertise_url.rstrip('/')}/ready")
                status = response.status_code
                text = response.text.strip()[:300]
            except httpx.HTTPError:
                pass  # unreachable: that holder is left to its lease's expiry
        if not self.counter.observe(record.epoch, status, text):
            return
        if not self.fit():
            return  # no healthier than the holder: taking over would not help
        takeover = TakeoverRequest(requested_by=self.router_id, epoch=record.epoch, reason=text or "",
                                   at=self.wall_clock())
        recorded = await request(takeover)
        log_event("takeover_requested", level=logging.WARNING, holder=record.holder, epoch=record.epoch,
                  reason=text, failures=self.counter.threshold, recorded=recorded, requested_by=self.router_id)
