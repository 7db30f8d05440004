"""The lease shell: this router's role (active, standby, fenced) and the backend calls that change it.

Every ``renew_interval_s`` the service either renews (active) or stands by:
reads the shared record, takes the lease if the backend says it is free,
otherwise lets the ``HandoffFollower`` keep the holder's state warm and the
``HolderWatcher`` poll the holder's ``/ready`` toward a takeover request. A
separate task fences at the term's deadline, so the log and ``/ready`` say
"fenced" on time; admission does not depend on it, because
``Admission.refusal`` compares the same deadline on every request.

Serving intervals never overlap, even when the record is deleted or changed
under the holder: a holder whose renewal finds its record gone or changed
fences at once; a standby that saw a holder's record and then finds no record
waits until that holder's fencing deadline has surely passed (``ttl_s`` after
it first found the record missing) unless the backend proves the term over
(etcd: the holder's lease is gone and the epoch counter intact); and an
acquisition never hands out an epoch at or below one already seen.

A release (shutdown, takeover, or a fenced holder handing its record back) is
retried every tick until it lands or the lease would have expired anyway; on
shutdown the service does not return before it landed or a short deadline
passed.

Events (JSON lines): ``lease_acquired``, ``lease_renew_failed``, ``fenced``,
``takeover_refused``, ``lease_released``, ``lease_release_failed``,
``lease_record_missing``, ``lease_backend_unreachable``,
``lease_backend_reachable`` (and the follower's and watcher's). The events
that bound a serving interval carry monotonic timestamps
(``serving_from_mono``, ``serving_until_mono``: ``time.monotonic()``, one
clock for every process on the host).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import httpx
import msgspec
import trio

from narwhal.clocks import to_monotonic
from narwhal.config import Config
from narwhal.fleet.admission import FENCED_REASON, Admission
from narwhal.lease.backend import LeaseBackend, LeaseBackendError
from narwhal.lease.follower import HandoffFollower, Restorable
from narwhal.lease.rules import LeaseHolding, LeaseRecord, Role, TakeoverRequest, standby_reason
from narwhal.lease.watcher import HolderWatcher
from narwhal.obs.logs import flush_logs, log_event
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.stages.persistence import PersistenceStage
from narwhal.state.handoff import LeaseOwnership

__all__ = ["LeaseService", "LeaseView"]


class LeaseView(msgspec.Struct, frozen=True, kw_only=True):
    """``GET /admin/lease``: this router's role and the shared record as it last saw it."""

    router_id: str
    backend: str
    # "active", "standby" or "fenced" ("active" always without a lease backend).
    role: str
    holder: str = ""
    epoch: int = 0
    advertise_url: str = ""
    record: LeaseRecord | None = None
    fencing_deadline_in_s: float | None = None
    last_renew_sent_s_ago: float | None = None
    fenced_reason: str | None = None
    backend_problem: str | None = None
    # A standby's count of consecutive 503s from the holder's /ready, and the threshold.
    holder_ready_failures: int = 0
    takeover_ready_failures: int = 0
    holder_last_not_ready: str | None = None
    handoff_applied_epoch: int = 0
    handoff_applied_pass: int | None = None
    # A standby: how its engine set differs from the active router's handoff (None: it matches).
    engine_set_differs: str | None = None
    ttl_s: float | None = None
    renew_interval_s: float | None = None
    fence_margin_s: float | None = None


class _PendingRelease(msgspec.Struct, kw_only=True):
    """A record of ours to hand back, and when trying stops (the lease has expired by then anyway)."""

    record: LeaseRecord
    give_up_at: float
    why: str


class LeaseService:
    """Owns the lease for one router: acquisition, renewal, fencing and release; following and watching."""

    def __init__(self, *, config: Config, router_id: str, backend: LeaseBackend, admission: Admission,
                 persistence: PersistenceStage, fleet: Restorable, metrics: RouterMetrics,
                 own_readiness: Callable[[], str | None], http: httpx.AsyncClient | None = None,
                 clock: Callable[[], float] = trio.current_time,
                 wall_clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        """``clock`` is trio's (deadlines, sleeps); ``monotonic`` is the host's, for logs and threads."""
        self.config = config
        self.router_id = router_id
        self.backend = backend
        self.admission = admission
        self.persistence = persistence
        self.metrics = metrics
        self.own_readiness = own_readiness
        self.clock = clock
        self.wall_clock = wall_clock
        self.monotonic = monotonic
        lease = config.lease
        self.holding = LeaseHolding(router_id=router_id, ttl_s=lease.ttl_s, fence_margin_s=lease.fence_margin_s,
                                    clock=clock)
        self.advertise_url = lease.advertise_url or ""
        self.record: LeaseRecord | None = None
        self.backend_problem: str | None = None
        self.stopping = False
        # A router that yielded does not take the lease straight back from the one it yielded to.
        self._no_acquire_until = -math.inf
        self._released_term_epoch = 0
        self._pending_release: _PendingRelease | None = None
        # The last record held by another router, and when we first found no record after it.
        self._last_held: LeaseRecord | None = None
        self._missing_since: float | None = None
        # The highest epoch seen anywhere: the next acquisition's epoch is above it.
        self._highest_epoch = 0
        # An acquisition we stopped waiting for: its write may still name us later.
        self._acquire_abandoned = False
        self._http = http or httpx.AsyncClient(timeout=min(lease.renew_interval_s, 2.0))
        self._changed = trio.Event()
        self._wake = trio.Event()
        # The fencing deadline on time.monotonic(), for the handoff writer's thread.
        self._deadline_mono = -math.inf
        self.follower = HandoffFollower(config=config, fleet=fleet, router_id=router_id,
                                        where=f"{backend.name} handoff",
                                        clock=clock, wall_clock=wall_clock)
        self.watcher = HolderWatcher(router_id=router_id, threshold=lease.takeover_ready_failures,
                                     http=self._http, timeout_s=lambda: self.call_timeout_s,
                                     fit=self._fit_to_serve, wall_clock=wall_clock)
        self._releases = metrics.registry.counter(
            "narwhal_lease_releases", "Lease releases by result (ok, gone: no longer ours, failed).", ("result",))
        persistence.paused = True
        persistence.lease_valid = self.valid_threadsafe
        # Until the first read, "held by nobody" would be a guess: /ready says the lease was not read yet.
        self._lease_read = False
        self._standby_text(None)
        self._register_gauges()

    def __repr__(self) -> str:
        return f"<LeaseService {self.backend.name} {self.holding!r}>"

    # -- timing, read from the config (never copied) --------------------------------------

    @property
    def renew_interval_s(self) -> float:
        return self.config.lease.renew_interval_s

    @property
    def ttl_s(self) -> float:
        return self.config.lease.ttl_s

    @property
    def call_timeout_s(self) -> float:
        """No single backend call may outlast a renewal interval."""
        return self.config.lease.renew_interval_s

    @property
    def shutdown_release_s(self) -> float:
        """How long shutdown waits for the release to land: short, and never past a renewal interval."""
        return min(self.config.lease.renew_interval_s, 2.0)

    # -- plain values for the router (and its workers) ------------------------------------

    @property
    def admission_deadline(self) -> float:
        """Monotonic (trio clock) time from which this router must not admit; -inf unless active."""
        return self.holding.admission_deadline

    @property
    def role(self) -> Role:
        return self.holding.role

    @property
    def applied_epoch(self) -> int:
        return self.follower.applied_epoch

    @property
    def applied_pass(self) -> int | None:
        return self.follower.applied_pass

    def valid_threadsafe(self) -> bool:
        """Whether the term is still valid, on time.monotonic(): callable from any thread."""
        return self.holding.role is Role.ACTIVE and self.monotonic() < self._deadline_mono

    def ownership(self) -> LeaseOwnership:
        """The handoff's ``lease`` entry: ours while active."""
        if self.holding.role is Role.ACTIVE:
            return LeaseOwnership(holder=self.router_id, epoch=self.holding.epoch)
        return LeaseOwnership()

    def _mono(self, at: float) -> float:
        """A time on our clock, as time.monotonic() (shared by the processes on a host)."""
        return to_monotonic(at, clock=self.clock, monotonic=self.monotonic)

    def view(self) -> LeaseView:
        """What /admin/lease shows."""
        now = self.clock()
        term = self.holding.term
        active = self.holding.role is Role.ACTIVE and term is not None
        counter = self.watcher.counter
        lease = self.config.lease
        return LeaseView(
            router_id=self.router_id, backend=self.backend.name, role=str(self.holding.role),
            holder=self.holding.holder, epoch=self.holding.epoch, advertise_url=self.advertise_url,
            record=self.record,
            fencing_deadline_in_s=(term.deadline - now) if active and term is not None else None,
            last_renew_sent_s_ago=(now - term.last_renew_sent) if active and term is not None else None,
            fenced_reason=self.holding.fenced_reason, backend_problem=self.backend_problem,
            holder_ready_failures=counter.failures, takeover_ready_failures=counter.threshold,
            holder_last_not_ready=counter.last_reason,
            handoff_applied_epoch=self.follower.applied_epoch, handoff_applied_pass=self.follower.applied_pass,
            engine_set_differs=None if active else self.follower.engine_set_differs,
            ttl_s=lease.ttl_s, renew_interval_s=lease.renew_interval_s, fence_margin_s=lease.fence_margin_s)

    def _register_gauges(self) -> None:
        m = self.metrics
        m.add_gauge("narwhal_lease_holder", "1 while this router holds a valid lease.", (),
                    lambda: {(): float(self.holding.valid())})
        m.add_gauge("narwhal_lease_epoch", "The lease epoch held (active) or last seen (standby).", (),
                    lambda: {(): float(self.holding.epoch)})

    # -- admission and the writer, per role ------------------------------------------------

    def _suffix(self) -> str:
        return f" ({self.backend_problem})" if self.backend_problem else ""

    def _standby_text(self, holder: str | None) -> None:
        self.admission.close("lease", standby_reason(holder) + self._suffix())

    def _changed_now(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _set_deadline(self) -> None:
        deadline = self.holding.admission_deadline
        self.admission.lease_deadline = deadline
        self._deadline_mono = self._mono(deadline) if math.isfinite(deadline) else -math.inf
        self._changed_now()

    def _fit_to_serve(self) -> bool:
        """Whether this router could serve better than a failing holder: its own readiness and monitor pass."""
        return self.own_readiness() is None and self.admission.held_by("monitor") is None

    def _on_fenced(self) -> None:
        """The term ended without our consent: stop admitting and writing, say so, hand the record back."""
        term = self.holding.term
        now = self.clock()
        self.persistence.paused = True
        self.admission.close("lease", FENCED_REASON + self._suffix())
        deadline = term.deadline if term is not None else now
        until = min(now, deadline)
        self._set_deadline()
        log_event("fenced", level=logging.WARNING, holder=self.router_id, epoch=self.holding.epoch,
                  reason=self.holding.fenced_reason,
                  serving_until_mono=self._mono(until),
                  last_renew_sent_mono=self._mono(term.last_renew_sent) if term is not None else None,
                  mono=self.monotonic())
        flush_logs()
        record = self.record
        if record is not None and record.holder == self.router_id and term is not None:
            # Hand the lease back early when the backend still knows us as holder; by the
            # backend's expiry there is nothing left to hand back.
            self._queue_release(record, term.last_renew_sent + self.ttl_s, "fenced")

    def _queue_release(self, record: LeaseRecord, give_up_at: float, why: str) -> None:
        self._released_term_epoch = record.epoch
        self._pending_release = _PendingRelease(record=record, give_up_at=give_up_at, why=why)
        self._wake.set()

    # -- the loops -----------------------------------------------------------------------

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Tick every ``renew_interval_s`` on an absolute schedule; fence on time in a sibling task.

        On the way out (cancelled after a shutdown), a pending release is finished
        first, within ``shutdown_release_s``: the standby need not wait for expiry.
        """
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._fence_timer)
                task_status.started()
                t0 = self.clock()
                slot = 0
                while True:
                    await self.tick()
                    interval = self.renew_interval_s
                    slot = max(slot + 1, math.floor((self.clock() - t0) / interval))
                    await self._between_ticks(t0 + slot * interval)
        finally:
            with trio.CancelScope(shield=True) as scope:
                scope.deadline = self.clock() + self.shutdown_release_s
                await self._finish_release()
            with trio.CancelScope(shield=True):
                await self._http.aclose()
                await self.backend.aclose()

    async def _between_ticks(self, next_tick: float) -> None:
        """Wait for the next tick; a wake-up (shutdown, fencing) ends the wait early.

        A pending release is retried four times per interval meanwhile: it must
        land before the lease would expire by itself, which may be sooner than
        the next tick.
        """
        while True:
            woken = self._wake
            retry_at = self.clock() + self.renew_interval_s / 4 if self._pending_release is not None else math.inf
            with trio.move_on_at(min(next_tick, retry_at)):
                await woken.wait()
            if woken.is_set():
                self._wake = trio.Event()
                return
            if self.clock() >= next_tick:
                return
            await self._try_release()

    async def _finish_release(self) -> None:
        """Retry a pending release until it lands (or the caller's deadline passes)."""
        while self._pending_release is not None and self.stopping:
            if await self._try_release():
                return
            await trio.sleep(min(0.1, self.renew_interval_s / 4))

    async def _fence_timer(self) -> None:
        while True:
            changed = self._changed
            deadline = self.holding.admission_deadline if self.holding.role is Role.ACTIVE else math.inf
            with trio.move_on_at(deadline):
                await changed.wait()
            if self.holding.deadline_passed():
                self._on_fenced()

    async def tick(self) -> None:
        """One round: renew when active, else hand back what we must, try to acquire, follow and watch."""
        if self.holding.role is Role.ACTIVE:
            await self._renew()
        else:
            await self._try_release()
            await self._stand_by()

    async def _call(self, what: str, call: Callable[[], Any]) -> Any:
        """One backend call, bounded by ``call_timeout_s``; a LeaseBackendError on failure."""
        timeout_s = self.call_timeout_s
        with trio.move_on_after(timeout_s):
            return await call()
        raise LeaseBackendError(f"{self.backend.name} did not answer {what} within {timeout_s:g} s")

    def _backend_ok(self) -> None:
        if self.backend_problem is not None:
            log_event("lease_backend_reachable", backend=self.backend.name, role=str(self.holding.role))
            self.backend_problem = None

    def _backend_failed(self, problem: str) -> None:
        if self.backend_problem != problem:
            log_event("lease_backend_unreachable", level=logging.WARNING, backend=self.backend.name,
                      role=str(self.holding.role), holder=self.holding.holder, epoch=self.holding.epoch,
                      reason=problem)
        self.backend_problem = problem

    # -- active ----------------------------------------------------------------------------

    async def _renew(self) -> None:
        record = self.record
        assert record is not None
        sent_at = self.clock()
        renewal = None
        problem: str | None = None
        # Waiting for an answer past the fencing deadline is pointless: it could not count.
        with trio.move_on_at(self.holding.admission_deadline):
            try:
                renewal = await self._call("a renewal", lambda: self.backend.renew(record))
            except LeaseBackendError as exc:
                problem = str(exc)
        if self.holding.role is not Role.ACTIVE:
            return  # fenced meanwhile, by the timer
        if renewal is None:
            problem = problem or "no answer before the fencing deadline"
            self.metrics.lease_renewals.inc("failed")
            self._backend_failed(problem)
            log_event("lease_renew_failed", level=logging.WARNING, holder=self.router_id,
                      epoch=self.holding.epoch, reason=problem,
                      fencing_deadline_in_s=round(self.holding.admission_deadline - self.clock(), 3))
            return
        self._backend_ok()
        if renewal.lost:
            # The record is gone or names another term: whoever reads it may take the lease now.
            self.metrics.lease_renewals.inc("lost")
            log_event("lease_renew_failed", level=logging.WARNING, holder=self.router_id,
                      epoch=self.holding.epoch, reason=f"lease lost: {renewal.reason}",
                      fencing_deadline_in_s=round(self.holding.admission_deadline - self.clock(), 3))
            self.holding.fence(f"lease lost: {renewal.reason}")
            self._on_fenced()
            return
        if not self.holding.renewal_succeeded(sent_at):
            self.metrics.lease_renewals.inc("late")
            self._on_fenced()
            return
        self.metrics.lease_renewals.inc("ok")
        self._set_deadline()
        takeover = renewal.takeover
        if takeover is not None and takeover.epoch == self.holding.epoch:
            await self._consider_takeover(takeover)

    async def _consider_takeover(self, request: TakeoverRequest) -> None:
        """Yield when our own readiness is failing; a healthy holder refuses."""
        own = self.own_readiness()
        if own is None:
            log_event("takeover_refused", holder=self.router_id, epoch=self.holding.epoch,
                      requested_by=request.requested_by, reason=request.reason)
            record = self.record
            if record is not None:
                try:
                    await self._call("clearing a takeover request", lambda: self.backend.clear_takeover(record))
                except LeaseBackendError as exc:
                    self._backend_failed(str(exc))
            return
        await self.release(f"takeover requested by {request.requested_by}; own readiness: {own}")
        # Leave the lease to the requester for a while: it is healthy, we are not.
        self._no_acquire_until = self.clock() + self.ttl_s

    def _stop_serving(self, reason: str) -> LeaseRecord | None:
        """Stop admitting and writing now (no I/O); queue the record's release; the record, if any."""
        record = self.record
        epoch = self.holding.epoch
        term = self.holding.term
        now = self.clock()
        self.holding.released()
        self.persistence.paused = True
        self._standby_text("")
        self._set_deadline()
        log_event("lease_released", level=logging.WARNING, holder=self.router_id, epoch=epoch, reason=reason,
                  serving_until_mono=self._mono(now), mono=self.monotonic())
        flush_logs()
        if record is not None:
            expires = (term.last_renew_sent if term is not None else now) + self.ttl_s
            self._queue_release(record, expires, reason)
        return record

    async def release(self, reason: str) -> None:
        """Stop admitting and writing now, then give the lease up in the backend (retried until it lands)."""
        if self.holding.role is not Role.ACTIVE:
            return
        self._stop_serving(reason)
        await self._try_release()

    def begin_shutdown(self) -> None:
        """On SIGTERM: never acquire again; stop serving at once and hand the lease over now.

        The release itself runs in ``run`` (woken at once) and is finished before ``run`` returns.
        """
        self.stopping = True
        if self.holding.role is Role.ACTIVE:
            self._stop_serving("shutdown")
        self._wake.set()

    async def _try_release(self) -> bool:
        """One attempt at the pending release; True when nothing is left pending."""
        pending = self._pending_release
        if pending is None:
            return True
        try:
            released = await self._call("a release", lambda: self.backend.release(pending.record))
        except LeaseBackendError as exc:
            self._backend_failed(str(exc))
            self._releases.inc("failed")
            retry = self.clock() < pending.give_up_at
            log_event("lease_release_failed", level=logging.WARNING, holder=self.router_id,
                      epoch=pending.record.epoch, reason=str(exc), why=pending.why, will_retry=retry,
                      expires_in_s=round(pending.give_up_at - self.clock(), 3))
            if not retry:
                self._pending_release = None
            return not retry
        self._backend_ok()
        self._releases.inc("ok" if released else "gone")
        self._pending_release = None
        return True

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
        now = self.clock()
        first_look = self._missing_since is None
        if self._missing_since is None:
            self._missing_since = now
        if now >= self._missing_since + self.ttl_s:
            return True
        try:
            if await self._call("a term check", lambda: self.backend.term_over(last)):
                return True  # an expiry or a release: the holder stopped serving
        except LeaseBackendError as exc:
            self._backend_failed(str(exc))
        if first_look:
            log_event("lease_record_missing", level=logging.WARNING, holder=last.holder, epoch=last.epoch,
                      reason="the lease record vanished while its holder may still be serving",
                      wait_s=round(self._missing_since + self.ttl_s - now, 3))
        return False

    async def _stand_by(self) -> None:
        may_acquire = (not self.stopping and self.clock() >= self._no_acquire_until
                       and self.admission.held_by("monitor") is None)
        try:
            record = await self._call("a read", self.backend.read)
            self._note_epoch(record)
            if may_acquire and await self._record_surely_free(record):
                sent_at = self.clock()
                try:
                    acquisition = await self._call(
                        "an acquisition", lambda: self.backend.acquire(
                            self.router_id, self.advertise_url, after_epoch=self._highest_epoch,
                            # A record that vanished since the read is judged at the next tick.
                            take_missing=record is None))
                except LeaseBackendError:
                    self._acquire_abandoned = True
                    raise
                if acquisition.acquired and acquisition.record is not None:
                    self._backend_ok()
                    await self._become_active(acquisition.record, sent_at)
                    return
                record = acquisition.record
                self._note_epoch(record)
        except LeaseBackendError as exc:
            self._backend_failed(str(exc))
            self._refresh_refusal()
            return
        self._backend_ok()
        self._lease_read = True
        if record is not None and record.holder == self.router_id and self._acquire_abandoned \
                and self._released_term_epoch != record.epoch:
            # An acquisition we gave up on was written after all: we never served under it.
            self._queue_release(record, self.clock() + self.ttl_s, "an abandoned acquisition landed late")
            await self._try_release()
        self.holding.observed(record)
        if record is not None and record.holder and (
                record.holder != self.router_id or record.epoch not in self.follower.own_terms):
            # Another router's term; or ours from before a restart, which this process never held.
            if record.holder != self.router_id:
                self.record = record
            self._last_held = record
            self.follower.follow(record.holder, record.epoch)
        self._refresh_refusal()
        await self.follow_handoff()
        await self.watcher.poll(record, self._request_takeover)

    def _refresh_refusal(self) -> None:
        if self.holding.role is Role.FENCED:
            self.admission.close("lease", FENCED_REASON + self._suffix())
        else:
            self._standby_text(self.holding.holder if self._lease_read else None)

    async def _request_takeover(self, request: TakeoverRequest) -> bool:
        try:
            return bool(await self._call("a takeover request", lambda: self.backend.request_takeover(request)))
        except LeaseBackendError as exc:
            self._backend_failed(str(exc))
            return False

    async def _become_active(self, record: LeaseRecord, sent_at: float) -> None:
        previous = self.holding.holder or (self._last_held.holder if self._last_held is not None else "")
        # The last handoff the previous holder wrote, before anything is admitted.
        await self.follow_handoff()
        self.holding.acquired(record.epoch, sent_at)
        self.follower.own_terms.add(record.epoch)
        self.record = record
        self._note_epoch(record)
        self._last_held = None
        self._missing_since = None
        self._acquire_abandoned = False
        # Our older record is gone (we could not have acquired otherwise): nothing left to hand back.
        self._pending_release = None
        self.watcher.reset()
        if not self.holding.valid():
            # Acquiring took the whole term: the lease may already be someone else's.
            self.holding.fence("acquisition answered after the fencing deadline")
            self._on_fenced()
            return
        self._set_deadline()
        self.persistence.paused = False
        self.admission.open("lease")
        now = self.clock()
        log_event("lease_acquired", level=logging.WARNING, holder=self.router_id, epoch=record.epoch,
                  previous_holder=previous or None, advertise_url=record.advertise_url,
                  reason="lease free" if not previous or previous == self.router_id else f"lease of {previous} ended",
                  serving_from_mono=self._mono(now),
                  fencing_deadline_mono=self._mono(self.holding.admission_deadline), mono=self.monotonic())
        flush_logs()

    async def follow_handoff(self) -> None:
        """Apply the followed holder's latest handoff when it changed (see ``HandoffFollower``)."""
        try:
            await self.follower.refresh(lambda: self._call("a handoff read", self.backend.read_handoff))
        except LeaseBackendError as exc:
            self._backend_failed(str(exc))
