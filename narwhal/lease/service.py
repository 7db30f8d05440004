"""The lease service: this router's role (active, standby, fenced) and everything it does about it.

Every ``renew_interval_s`` the service either renews (active) or stands by:
reads the shared record, takes the lease if the backend says it is free,
otherwise follows the holder's handoff warm and polls the holder's ``/ready``
toward a takeover request. A separate task fences at the term's deadline, so
the log and ``/ready`` say "fenced" on time; admission does not depend on it,
because ``Admission.refusal`` compares the same deadline on every request.

Events (JSON lines): ``lease_acquired``, ``lease_renew_failed``, ``fenced``,
``takeover_requested``, ``takeover_refused``, ``lease_released``,
``standby_following``, ``lease_backend_unreachable``, ``lease_backend_reachable``.
The events that bound a serving interval carry monotonic timestamps
(``serving_from_mono``, ``serving_until_mono``: ``time.monotonic()``, one
clock for every process on the host).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import httpx
import msgspec
import trio

from narwhal.clocks import to_monotonic
from narwhal.config import Config
from narwhal.fleet import EngineRecord
from narwhal.fleet.admission import FENCED_REASON, Admission
from narwhal.lease.backend import LeaseBackend, LeaseBackendError
from narwhal.lease.rules import LeaseHolding, LeaseRecord, Role, TakeoverCounter, TakeoverRequest, standby_reason
from narwhal.obs.logs import flush_logs, log_event
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.stages.persistence import PersistenceStage
from narwhal.state.handoff import HandoffError, LeaseOwnership, decode_document
from narwhal.state.resume import apply_resume, plan_document

__all__ = ["LeaseService", "LeaseView"]


class _Restorable(Protocol):
    """The fleet's writer, as far as following a handoff needs it."""

    def restore(self, records: Sequence[EngineRecord], now: float, wall_now: float) -> None: ...


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
    ttl_s: float | None = None
    renew_interval_s: float | None = None
    fence_margin_s: float | None = None


class LeaseService:
    """Owns the lease for one router: acquisition, renewal, fencing, following, takeover."""

    def __init__(self, *, config: Config, router_id: str, backend: LeaseBackend, admission: Admission,
                 persistence: PersistenceStage, fleet: _Restorable, metrics: RouterMetrics,
                 own_readiness: Callable[[], str | None], http: httpx.AsyncClient | None = None,
                 clock: Callable[[], float] = trio.current_time,
                 wall_clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        """``clock`` is trio's (deadlines, sleeps); ``monotonic`` is the host's, for logs and threads."""
        lease = config.lease
        self.config = config
        self.router_id = router_id
        self.backend = backend
        self.admission = admission
        self.persistence = persistence
        self.fleet = fleet
        self.metrics = metrics
        self.own_readiness = own_readiness
        self.clock = clock
        self.wall_clock = wall_clock
        self.monotonic = monotonic
        self.renew_interval_s = lease.renew_interval_s
        self.ttl_s = lease.ttl_s
        # No single backend call may outlast a renewal interval.
        self.call_timeout_s = lease.renew_interval_s
        self.holding = LeaseHolding(router_id=router_id, ttl_s=lease.ttl_s, fence_margin_s=lease.fence_margin_s,
                                    clock=clock)
        self.counter = TakeoverCounter(lease.takeover_ready_failures)
        self.advertise_url = lease.advertise_url or ""
        self.record: LeaseRecord | None = None
        self.backend_problem: str | None = None
        self.stopping = False
        # A router that yielded does not take the lease straight back from the one it yielded to.
        self._no_acquire_until = -math.inf
        self._released_term_epoch = 0
        self._http = http or httpx.AsyncClient(timeout=min(lease.renew_interval_s, 2.0))
        self._changed = trio.Event()
        # The fencing deadline on time.monotonic(), for the handoff writer's thread.
        self._deadline_mono = -math.inf
        # Handoff following.
        self._last_handoff: bytes | None = None
        self.applied_epoch = 0
        self.applied_pass: int | None = None
        self._following: tuple[str, int] | None = None
        self._fenced_at_mono: float | None = None
        persistence.paused = True
        persistence.lease_valid = self.valid_threadsafe
        self._standby_text("")
        self._register_gauges()

    def __repr__(self) -> str:
        return f"<LeaseService {self.backend.name} {self.holding!r}>"

    # -- plain values for the router (and, later, its workers) ----------------------------

    @property
    def admission_deadline(self) -> float:
        """Monotonic (trio clock) time from which this router must not admit; -inf unless active."""
        return self.holding.admission_deadline

    @property
    def role(self) -> Role:
        return self.holding.role

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
        return LeaseView(
            router_id=self.router_id, backend=self.backend.name, role=str(self.holding.role),
            holder=self.holding.holder, epoch=self.holding.epoch, advertise_url=self.advertise_url,
            record=self.record,
            fencing_deadline_in_s=(term.deadline - now) if active and term is not None else None,
            last_renew_sent_s_ago=(now - term.last_renew_sent) if active and term is not None else None,
            fenced_reason=self.holding.fenced_reason, backend_problem=self.backend_problem,
            holder_ready_failures=self.counter.failures, takeover_ready_failures=self.counter.threshold,
            holder_last_not_ready=self.counter.last_reason,
            handoff_applied_epoch=self.applied_epoch, handoff_applied_pass=self.applied_pass,
            ttl_s=self.ttl_s, renew_interval_s=self.renew_interval_s,
            fence_margin_s=self.holding.fence_margin_s)

    def _register_gauges(self) -> None:
        m = self.metrics
        m.add_gauge("narwhal_lease_holder", "1 while this router holds a valid lease.", (),
                    lambda: {(): float(self.holding.valid())})
        m.add_gauge("narwhal_lease_epoch", "The lease epoch held (active) or last seen (standby).", (),
                    lambda: {(): float(self.holding.epoch)})

    # -- admission and the writer, per role ------------------------------------------------

    def _suffix(self) -> str:
        return f" ({self.backend_problem})" if self.backend_problem else ""

    def _standby_text(self, holder: str) -> None:
        self.admission.close("lease", standby_reason(holder) + self._suffix())

    def _changed_now(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _set_deadline(self) -> None:
        deadline = self.holding.admission_deadline
        self.admission.lease_deadline = deadline
        self._deadline_mono = self._mono(deadline) if math.isfinite(deadline) else -math.inf
        self._changed_now()

    def _on_fenced(self) -> None:
        """The term ended without our consent: stop admitting and writing, and say so."""
        term = self.holding.term
        now = self.clock()
        self.persistence.paused = True
        self.admission.close("lease", FENCED_REASON + self._suffix())
        deadline = term.deadline if term is not None else now
        until = min(now, deadline)
        self._set_deadline()
        self._fenced_at_mono = self._mono(until)
        log_event("fenced", level=logging.WARNING, holder=self.router_id, epoch=self.holding.epoch,
                  reason=self.holding.fenced_reason,
                  serving_until_mono=self._mono(until),
                  last_renew_sent_mono=self._mono(term.last_renew_sent) if term is not None else None,
                  mono=self.monotonic())
        flush_logs()

    # -- the loops -----------------------------------------------------------------------

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Tick every ``renew_interval_s`` on an absolute schedule; fence on time in a sibling task."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._fence_timer)
                task_status.started()
                t0 = self.clock()
                slot = 0
                while True:
                    await self.tick()
                    slot = max(slot + 1, math.floor((self.clock() - t0) / self.renew_interval_s))
                    await trio.sleep_until(t0 + slot * self.renew_interval_s)
        finally:
            with trio.CancelScope(shield=True):
                await self._http.aclose()
                await self.backend.aclose()

    async def _fence_timer(self) -> None:
        while True:
            changed = self._changed
            deadline = self.holding.admission_deadline if self.holding.role is Role.ACTIVE else math.inf
            with trio.move_on_at(deadline):
                await changed.wait()
            if self.holding.deadline_passed():
                self._on_fenced()

    async def tick(self) -> None:
        """One round: renew when active, else try to acquire, follow and watch the holder."""
        if self.holding.role is Role.ACTIVE:
            await self._renew()
        else:
            await self._stand_by()

    async def _call(self, what: str, call: Callable[[], Any]) -> Any:
        """One backend call, bounded by ``call_timeout_s``; a LeaseBackendError on failure."""
        with trio.move_on_after(self.call_timeout_s):
            return await call()
        raise LeaseBackendError(f"{self.backend.name} did not answer {what} within {self.call_timeout_s:g} s")

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

    async def release(self, reason: str) -> None:
        """Stop admitting and writing now, then give the lease up in the backend."""
        if self.holding.role is not Role.ACTIVE:
            return
        record = self.record
        epoch = self.holding.epoch
        now = self.clock()
        self.holding.released()
        self.persistence.paused = True
        self._standby_text("")
        self._set_deadline()
        log_event("lease_released", level=logging.WARNING, holder=self.router_id, epoch=epoch, reason=reason,
                  serving_until_mono=self._mono(now), mono=self.monotonic())
        flush_logs()
        if record is not None:
            self._released_term_epoch = epoch
            try:
                await self._call("a release", lambda: self.backend.release(record))
            except LeaseBackendError as exc:
                self._backend_failed(str(exc))

    async def release_for_shutdown(self) -> None:
        """On SIGTERM: never acquire again; hand the lease over at once instead of at expiry."""
        self.stopping = True
        await self.release("shutdown")

    # -- standby and fenced ----------------------------------------------------------------

    async def _stand_by(self) -> None:
        if self.holding.role is Role.FENCED and self.record is not None \
                and self._released_term_epoch != self.holding.epoch:
            # Hand the lease back early when the backend still knows us as holder.
            self._released_term_epoch = self.holding.epoch
            stale = self.record
            try:
                await self._call("a release", lambda: self.backend.release(stale))
            except LeaseBackendError:
                pass  # unreachable: it expires by itself
        may_acquire = (not self.stopping and self.clock() >= self._no_acquire_until
                       and self.admission.held_by("monitor") is None)
        try:
            if may_acquire:
                sent_at = self.clock()
                acquisition = await self._call(
                    "an acquisition", lambda: self.backend.acquire(self.router_id, self.advertise_url))
                if acquisition.acquired and acquisition.record is not None:
                    self._backend_ok()
                    await self._become_active(acquisition.record, sent_at)
                    return
                record = acquisition.record
            else:
                record = await self._call("a read", self.backend.read)
        except LeaseBackendError as exc:
            self._backend_failed(str(exc))
            self._refresh_refusal()
            return
        self._backend_ok()
        self.holding.observed(record)
        if record is not None and record.holder and record.holder != self.router_id:
            self.record = record
        self._refresh_refusal()
        await self.follow_handoff()
        await self._watch_holder(record)

    def _refresh_refusal(self) -> None:
        if self.holding.role is Role.FENCED:
            self.admission.close("lease", FENCED_REASON + self._suffix())
        else:
            self._standby_text(self.holding.holder)

    async def _become_active(self, record: LeaseRecord, sent_at: float) -> None:
        previous = self.holding.holder
        # The last handoff the previous holder wrote, before anything is admitted.
        await self.follow_handoff()
        self.holding.acquired(record.epoch, sent_at)
        self.record = record
        self.counter = TakeoverCounter(self.counter.threshold)
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
        """Apply the holder's latest handoff when it changed and is not from an older epoch."""
        try:
            data = await self._call("a handoff read", self.backend.read_handoff)
        except LeaseBackendError as exc:
            self._backend_failed(str(exc))
            return
        if data is None or data == self._last_handoff:
            return
        self._last_handoff = data
        where = f"{self.backend.name} handoff"
        try:
            document = decode_document(data)
        except HandoffError as exc:
            log_event("handoff_not_applied", level=logging.WARNING, path=where,
                      reason=f"handoff not applied: {exc}")
            return
        if document.lease.epoch < self.applied_epoch:
            return  # a fenced writer's late document: its successor's state stands
        plan = plan_document(document, self.config, where)
        if not plan.applied:
            log_event("handoff_not_applied", level=logging.WARNING, **plan.event_fields())
            return
        apply_resume(plan, self.fleet, self.clock(), self.wall_clock())
        self.applied_epoch = document.lease.epoch
        self.applied_pass = document.pass_number
        following = (document.lease.holder, document.lease.epoch)
        if following != self._following:
            self._following = following
            log_event("standby_following", holder=document.lease.holder, epoch=document.lease.epoch,
                      reason="applied the holder's handoff", writer=document.router_id,
                      **{"pass": document.pass_number})

    async def _watch_holder(self, record: LeaseRecord | None) -> None:
        """Poll the holder's /ready; at the threshold of consecutive 503s, request a takeover."""
        if record is None or not record.holder or record.holder == self.router_id or not record.advertise_url:
            return
        status: int | None = None
        text: str | None = None
        with trio.move_on_after(self.call_timeout_s):
            try:
                response = await self._http.get(f"{record.advertise_url.rstrip('/')}/ready")
                status = response.status_code
                text = response.text.strip()[:300]
            except httpx.HTTPError:
                pass  # unreachable: that holder is left to its lease's expiry
        if not self.counter.observe(record.epoch, status, text):
            return
        own = self.own_readiness()
        if own is not None or self.admission.held_by("monitor") is not None:
            return  # no healthier than the holder: taking over would not help
        request = TakeoverRequest(requested_by=self.router_id, epoch=record.epoch, reason=text or "",
                                  at=self.wall_clock())
        try:
            recorded = await self._call("a takeover request", lambda: self.backend.request_takeover(request))
        except LeaseBackendError as exc:
            self._backend_failed(str(exc))
            return
        log_event("takeover_requested", level=logging.WARNING, holder=record.holder, epoch=record.epoch,
                  reason=text, failures=self.counter.threshold, recorded=recorded, requested_by=self.router_id)
