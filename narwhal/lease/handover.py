"""Handing the lease over: stop serving at once, then release the record in the backend.

A release (shutdown, a takeover the holder grants, or a fenced holder handing
its record back) is retried until it lands or the lease would have expired
anyway; between ticks four times per interval, on shutdown until a short
deadline. A holder asked to yield does so only when its own readiness fails.

Events (JSON lines): ``lease_released``, ``lease_release_failed``, ``takeover_refused``.
"""

from __future__ import annotations

import logging
import math

import msgspec
import trio

from narwhal.lease.backend import LeaseBackendError
from narwhal.lease.context import LeaseContext
from narwhal.lease.rules import LeaseRecord, Role, TakeoverRequest
from narwhal.obs.logs import flush_logs, log_event

__all__ = ["Handover"]


class _PendingRelease(msgspec.Struct, kw_only=True):
    """A record of ours to hand back, and when trying stops (the lease has expired by then anyway)."""

    record: LeaseRecord
    give_up_at: float
    why: str


class Handover:
    """Gives the lease up: stops serving, queues the record's release and retries it until it lands."""

    def __init__(self, ctx: LeaseContext) -> None:
        self.ctx = ctx
        # A router that yielded does not take the lease straight back from the one it yielded to.
        self.no_acquire_until = -math.inf
        self.released_term_epoch = 0
        self.pending: _PendingRelease | None = None
        self._wake = trio.Event()
        self._releases = ctx.metrics.registry.counter(
            "narwhal_lease_releases", "Lease releases by result (ok, gone: no longer ours, failed).", ("result",))

    def queue(self, record: LeaseRecord, give_up_at: float, why: str) -> None:
        """Hand ``record`` back as soon as possible, trying until ``give_up_at``."""
        self.released_term_epoch = record.epoch
        self.pending = _PendingRelease(record=record, give_up_at=give_up_at, why=why)
        self._wake.set()

    def stop_serving(self, reason: str) -> LeaseRecord | None:
        """Stop admitting and writing now (no I/O); queue the record's release; the record, if any."""
        ctx = self.ctx
        holding = ctx.holding
        record = ctx.record
        epoch = holding.epoch
        term = holding.term
        now = ctx.clocks.clock()
        holding.released()
        ctx.serving.persistence.paused = True
        ctx.standby_text("")
        ctx.publish_deadline()
        log_event("lease_released", level=logging.WARNING, holder=ctx.router_id, epoch=epoch, reason=reason,
                  serving_until_mono=ctx.clocks.mono(now), mono=ctx.clocks.monotonic())
        flush_logs()
        if record is not None:
            expires = (term.last_renew_sent if term is not None else now) + ctx.ttl_s
            self.queue(record, expires, reason)
        return record

    async def release(self, reason: str) -> None:
        """Stop admitting and writing now, then give the lease up in the backend (retried until it lands)."""
        if self.ctx.holding.role is not Role.ACTIVE:
            return
        self.stop_serving(reason)
        await self.try_release()

    def begin_shutdown(self) -> None:
        """Never acquire again; stop serving at once and wake the loop to hand the lease over now."""
        self.ctx.stopping = True
        if self.ctx.holding.role is Role.ACTIVE:
            self.stop_serving("shutdown")
        self._wake.set()

    async def answer_takeover(self, request: TakeoverRequest) -> None:
        """Yield when our own readiness is failing; a healthy holder refuses."""
        ctx = self.ctx
        own = ctx.serving.own_readiness()
        if own is None:
            log_event("takeover_refused", holder=ctx.router_id, epoch=ctx.holding.epoch,
                      requested_by=request.requested_by, reason=request.reason)
            record = ctx.record
            if record is not None:
                try:
                    await ctx.call("clearing a takeover request", lambda: ctx.backend.clear_takeover(record))
                except LeaseBackendError as exc:
                    ctx.backend_failed(str(exc))
            return
        await self.release(f"takeover requested by {request.requested_by}; own readiness: {own}")
        # Leave the lease to the requester for a while: it is healthy, we are not.
        self.no_acquire_until = ctx.clocks.clock() + ctx.ttl_s

    async def try_release(self) -> bool:
        """One attempt at the pending release; True when nothing is left pending."""
        pending = self.pending
        if pending is None:
            return True
        ctx = self.ctx
        try:
            released = await ctx.call("a release", lambda: ctx.backend.release(pending.record))
        except LeaseBackendError as exc:
            ctx.backend_failed(str(exc))
            self._releases.inc("failed")
            retry = ctx.clocks.clock() < pending.give_up_at
            log_event("lease_release_failed", level=logging.WARNING, holder=ctx.router_id,
                      epoch=pending.record.epoch, reason=str(exc), why=pending.why, will_retry=retry,
                      expires_in_s=round(pending.give_up_at - ctx.clocks.clock(), 3))
            if not retry:
                self.pending = None
            return not retry
        ctx.backend_ok()
        self._releases.inc("ok" if released else "gone")
        self.pending = None
        return True

    async def wait_for_tick(self, next_tick: float) -> None:
        """Wait for the next tick; a wake-up (shutdown, fencing) ends the wait early.

        A pending release is retried four times per interval meanwhile: it must
        land before the lease would expire by itself, which may be sooner than
        the next tick.
        """
        clock = self.ctx.clocks.clock
        while True:
            woken = self._wake
            retry_at = clock() + self.ctx.renew_interval_s / 4 if self.pending is not None else math.inf
            with trio.move_on_at(min(next_tick, retry_at)):
                await woken.wait()
            if woken.is_set():
                self._wake = trio.Event()
                return
            if clock() >= next_tick:
                return
            await self.try_release()

    async def finish(self) -> None:
        """On shutdown: retry a pending release until it lands (or the caller's deadline passes)."""
        while self.pending is not None and self.ctx.stopping:
            if await self.try_release():
                return
            await trio.sleep(min(0.1, self.ctx.renew_interval_s / 4))
