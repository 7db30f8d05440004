"""Acquiring and renewing the lease: one tick of the lease loop.

Active, the tick renews. Otherwise it hands back what it must, reads the
shared record, takes the lease if the backend says it is free, and lets the
``HandoffFollower`` keep the holder's state warm and the ``HolderWatcher``
poll the holder's ``/ready`` toward a takeover request.

Serving intervals never overlap, even when the record is deleted or changed
under the holder: a holder whose renewal finds its record gone or changed
fences at once; a standby that saw a holder's record and then finds no record
waits until that holder's fencing deadline has surely passed (``ttl_s`` after
it first found the record missing) unless the backend proves the term over
(etcd: the holder's lease is gone and the epoch counter intact); and an
acquisition never hands out an epoch at or below one already seen. A new
holder reads the last handoff before it admits anything.

Events (JSON lines): ``lease_acquired`` (with ``serving_from_mono``), ``lease_renew_failed``,
``lease_record_missing``.
"""

from __future__ import annotations

import logging

import trio

from narwhal.lease.backend import LeaseBackendError
from narwhal.lease.context import LeaseContext
from narwhal.lease.fence import Fence
from narwhal.lease.follower import HandoffFollower
from narwhal.lease.handover import Handover
from narwhal.lease.rules import LeaseRecord, Role, TakeoverRequest
from narwhal.lease.watcher import HolderWatcher
from narwhal.obs.logs import flush_logs, log_event

__all__ = ["TermKeeper"]


class TermKeeper:
    """Renews this router's term while active; stands by, follows and acquires otherwise."""

    def __init__(self, ctx: LeaseContext, *, fence: Fence, handover: Handover, follower: HandoffFollower,
                 watcher: HolderWatcher) -> None:
        self.ctx = ctx
        self.fence = fence
        self.handover = handover
        self.follower = follower
        self.watcher = watcher
        # The last record held by another router, and when we first found no record after it.
        self._last_held: LeaseRecord | None = None
        self._missing_since: float | None = None
        # The highest epoch seen anywhere: the next acquisition's epoch is above it.
        self._highest_epoch = 0
        # An acquisition we stopped waiting for: its write may still name us later.
        self._acquire_abandoned = False
        # Until the first read, "held by nobody" would be a guess: /ready says the lease was not read yet.
        self._lease_read = False

    async def tick(self) -> None:
        """One round: renew when active, else hand back what we must, try to acquire, follow and watch."""
        if self.ctx.holding.role is Role.ACTIVE:
            await self._renew()
        else:
            await self.handover.try_release()
            await self._stand_by()

    async def follow_handoff(self, *, acquiring: int | None = None) -> None:
        """Apply the followed holder's latest handoff when it changed (see ``HandoffFollower``).

        ``acquiring``: the epoch this router takes; the last term's handoff is applied whoever wrote it.
        """
        ctx = self.ctx
        try:
            await self.follower.refresh(lambda: ctx.call("a handoff read", ctx.backend.read_handoff),
                                        acquiring=acquiring)
        except LeaseBackendError as exc:
            ctx.backend_failed(str(exc))

    # -- active ----------------------------------------------------------------------------

    async def _renew(self) -> None:
        ctx = self.ctx
        holding = ctx.holding
        clock = ctx.clocks.clock
        record = ctx.record
        assert record is not None
        sent_at = clock()
        renewal = None
        problem: str | None = None
        # Waiting for an answer past the fencing deadline is pointless: it could not count.
        with trio.move_on_at(holding.admission_deadline):
            try:
                renewal = await ctx.call("a renewal", lambda: ctx.backend.renew(record))
            except LeaseBackendError as exc:
                problem = str(exc)
        if holding.role is not Role.ACTIVE:
            return  # fenced meanwhile, by the timer
        if renewal is None:
            problem = problem or "no answer before the fencing deadline"
            ctx.metrics.lease_renewals.inc("failed")
            ctx.backend_failed(problem)
            log_event("lease_renew_failed", level=logging.WARNING, holder=ctx.router_id,
                      epoch=holding.epoch, reason=problem,
                      fencing_deadline_in_s=round(holding.admission_deadline - clock(), 3))
            return
        ctx.backend_ok()
        if renewal.lost:
            # The record is gone or names another term: whoever reads it may take the lease now.
            ctx.metrics.lease_renewals.inc("lost")
            log_event("lease_renew_failed", level=logging.WARNING, holder=ctx.router_id,
                      epoch=holding.epoch, reason=f"lease lost: {renewal.reason}",
                      fencing_deadline_in_s=round(holding.admission_deadline - clock(), 3))
            holding.fence(f"lease lost: {renewal.reason}")
            self.fence.fenced()
            return
        if not holding.renewal_succeeded(sent_at):
            ctx.metrics.lease_renewals.inc("late")
            self.fence.fenced()
            return
        ctx.metrics.lease_renewals.inc("ok")
        ctx.publish_deadline()
        takeover = renewal.takeover
        if takeover is not None and takeover.epoch == holding.epoch:
            await self.handover.answer_takeover(takeover)

    # -- standby and fenced ----------------------------------------------------------------

    def _note_epoch(self, record: LeaseRecord | None) -> None:
        if record is not None:
            self._highest_epoch = max(self._highest_epoch, record.epoch)

    async def _record_surely_free(self, record: LeaseRecord | None) -> bool:
        """False while a record we saw held vanished too recently for its holder to have fenced."""
        if record is not None:
            self._missing_since = None
            return True
        last = self._last_held
        if last is None:
            return True  # nobody was seen holding it: a fresh start
        ctx = self.ctx
        now = ctx.clocks.clock()
        first_look = self._missing_since is None
        if self._missing_since is None:
            self._missing_since = now
        if now >= self._missing_since + ctx.ttl_s:
            return True
        try:
            if await ctx.call("a term check", lambda: ctx.backend.term_over(last)):
                return True  # an expiry or a release: the holder stopped serving
        except LeaseBackendError as exc:
            ctx.backend_failed(str(exc))
        if first_look:
            log_event("lease_record_missing", level=logging.WARNING, holder=last.holder, epoch=last.epoch,
                      reason="the lease record vanished while its holder may still be serving",
                      wait_s=round(self._missing_since + ctx.ttl_s - now, 3))
        return False

    async def _stand_by(self) -> None:
        ctx = self.ctx
        clock = ctx.clocks.clock
        may_acquire = (not ctx.stopping and clock() >= self.handover.no_acquire_until
                       and ctx.admission.held_by("monitor") is None)
        try:
            record = await ctx.call("a read", ctx.backend.read)
            self._note_epoch(record)
            if may_acquire and await self._record_surely_free(record):
                sent_at = clock()
                try:
                    acquisition = await ctx.call(
                        "an acquisition", lambda: ctx.backend.acquire(
                            ctx.router_id, ctx.advertise_url, after_epoch=self._highest_epoch,
                            # A record that vanished since the read is judged at the next tick.
                            take_missing=record is None))
                except LeaseBackendError:
                    self._acquire_abandoned = True
                    raise
                if acquisition.acquired and acquisition.record is not None:
                    ctx.backend_ok()
                    await self._become_active(acquisition.record, sent_at)
                    return
                record = acquisition.record
                self._note_epoch(record)
        except LeaseBackendError as exc:
            ctx.backend_failed(str(exc))
            self.refresh_refusal()
            return
        ctx.backend_ok()
        self._lease_read = True
        if record is not None and record.holder == ctx.router_id and self._acquire_abandoned \
                and self.handover.released_term_epoch != record.epoch:
            # An acquisition we gave up on was written after all: we never served under it.
            self.handover.queue(record, clock() + ctx.ttl_s, "an abandoned acquisition landed late")
            await self.handover.try_release()
        ctx.holding.observed(record)
        if record is not None and record.holder and (
                record.holder != ctx.router_id or record.epoch not in self.follower.own_terms):
            # Another router's term; or ours from before a restart, which this process never held.
            if record.holder != ctx.router_id:
                ctx.record = record
            self._last_held = record
            self.follower.follow(record.holder, record.epoch)
        self.refresh_refusal()
        if not ctx.serves_without_lease:
            # A replica follows the controller's per-engine records (narwhal.cluster), fresher than a handoff
            # written each monitor pass; it reads the handoff once, when it takes the lease.
            await self.follow_handoff()
        await self.watcher.poll(record, self._request_takeover)

    def refresh_refusal(self) -> None:
        """Say why admission is closed: fenced, or standing by (for whom, once the record was read)."""
        ctx = self.ctx
        if ctx.holding.role is Role.FENCED:
            ctx.fenced_text()
        else:
            ctx.standby_text(ctx.holding.holder if self._lease_read else None)

    async def _request_takeover(self, request: TakeoverRequest) -> bool:
        ctx = self.ctx
        try:
            return bool(await ctx.call("a takeover request", lambda: ctx.backend.request_takeover(request)))
        except LeaseBackendError as exc:
            ctx.backend_failed(str(exc))
            return False

    async def _become_active(self, record: LeaseRecord, sent_at: float) -> None:
        ctx = self.ctx
        holding = ctx.holding
        previous = holding.holder or (self._last_held.holder if self._last_held is not None else "")
        # The last handoff the previous holder wrote, before anything is admitted.
        await self.follow_handoff(acquiring=record.epoch)
        holding.acquired(record.epoch, sent_at)
        self.follower.own_terms.add(record.epoch)
        ctx.record = record
        self._note_epoch(record)
        self._last_held = None
        self._missing_since = None
        self._acquire_abandoned = False
        # Our older record is gone (we could not have acquired otherwise): nothing left to hand back.
        self.handover.pending = None
        self.watcher.reset()
        if not holding.valid():
            # Acquiring took the whole term: the lease may already be someone else's.
            holding.fence("acquisition answered after the fencing deadline")
            self.fence.fenced()
            return
        ctx.publish_deadline()
        ctx.serving.persistence.paused = False
        ctx.admission.open("lease")
        now = ctx.clocks.clock()
        log_event("lease_acquired", level=logging.WARNING, holder=ctx.router_id, epoch=record.epoch,
                  previous_holder=previous or None, advertise_url=record.advertise_url,
                  reason="lease free" if not previous or previous == ctx.router_id else f"lease of {previous} ended",
                  serving_from_mono=ctx.clocks.mono(now),
                  fencing_deadline_mono=ctx.clocks.mono(holding.admission_deadline), mono=ctx.clocks.monotonic())
        flush_logs()
