"""The lease service: this router's role (active, standby, fenced), composed from one part per job.

Every ``renew_interval_s``, on an absolute schedule, the ``TermKeeper``
renews (active) or stands by (``term``: acquire and renew); the
``HandoffFollower`` and ``HolderWatcher`` follow the holder (``follower``,
``watcher``); the ``Fence`` fences at the term's deadline, in a sibling task
(``fence``); the ``Handover`` gives the lease up and retries its release
(``handover``). They share one ``LeaseContext`` (``context``); the decisions
are the pure rules of ``rules``. On shutdown the service does not return
before a pending release landed or a short deadline passed.

The events that bound a serving interval carry monotonic timestamps
(``serving_from_mono``, ``serving_until_mono``: ``time.monotonic()``, one
clock for every process on the host).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import msgspec
import trio

from narwhal.config import Config, EngineSpec, RunningConfig
from narwhal.lease.backend import LeaseBackend
from narwhal.lease.context import LeaseClocks, LeaseContext, ServingParts
from narwhal.lease.fence import Fence
from narwhal.lease.follower import HandoffFollower
from narwhal.lease.handover import Handover
from narwhal.lease.rules import LeaseHolding, LeaseRecord, Role
from narwhal.lease.term import TermKeeper
from narwhal.lease.watcher import HolderWatcher
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.state.handoff import LeaseOwnership

__all__ = ["LeaseClocks", "LeaseService", "LeaseView", "ServingParts"]


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


class LeaseService:
    """Owns the lease for one router: composes acquire and renew, follow, fence and handover."""

    def __init__(self, *, config: Config, router_id: str, backend: LeaseBackend, serving: ServingParts,
                 metrics: RouterMetrics, http: httpx.AsyncClient | None = None,
                 clocks: LeaseClocks | None = None, advertise_url: Callable[[], str] | None = None,
                 engines: Callable[[], Sequence[EngineSpec]] | None = None) -> None:
        """``advertise_url()``: where this router's /ready is when ``lease.advertise_url`` is not
        set, asked at each use (the serving port is bound before the lease runs)."""
        clocks = clocks or LeaseClocks()
        lease = config.lease
        ctx = self._ctx = LeaseContext(config=config, router_id=router_id, backend=backend, serving=serving,
                                       metrics=metrics, clocks=clocks,
                                       advertise_url=advertise_url)
        self._http = http or httpx.AsyncClient(timeout=min(lease.renew_interval_s, 2.0))
        self.follower = HandoffFollower(config=config, fleet=serving.fleet, router_id=router_id,
                                        where=f"{backend.name} handoff",
                                        clock=clocks.clock, wall_clock=clocks.wall_clock, engines=engines)
        self.watcher = HolderWatcher(router_id=router_id, threshold=lease.takeover_ready_failures,
                                     http=self._http, timeout_s=lambda: ctx.call_timeout_s,
                                     fit=ctx.fit_to_serve, wall_clock=clocks.wall_clock)
        self.handover = Handover(ctx)
        self.fence = Fence(ctx, self.handover)
        self.term = TermKeeper(ctx, fence=self.fence, handover=self.handover, follower=self.follower,
                               watcher=self.watcher)
        serving.persistence.paused = True
        ctx.standby_text(None)
        self._register_gauges()

    def __repr__(self) -> str:
        return f"<LeaseService {self._ctx.backend.name} {self._ctx.holding!r}>"

    # -- settings the router may change ------------------------------------------------------

    @property
    def config(self) -> Config:
        return self._ctx.config

    @config.setter
    def config(self, config: Config) -> None:
        """A reload: timing is read from the config at each use (the follower is told apart)."""
        self._ctx.config = config

    def configure(self, running: RunningConfig) -> None:
        """A reload: timing is read from the new config; a standby plans the active's handoff against
        its own (reloaded) engine set."""
        self.config = running.config
        self.follower.use_config(running.config)

    @property
    def advertise_url(self) -> str:
        """Where a standby reaches this router's /ready (written into the record at acquisition)."""
        return self._ctx.advertise_url

    @property
    def renew_interval_s(self) -> float:
        return self._ctx.renew_interval_s

    @property
    def shutdown_release_s(self) -> float:
        """How long shutdown waits for the release to land: short, and never past a renewal interval."""
        return min(self._ctx.config.lease.renew_interval_s, 2.0)

    # -- plain values for the router (and its workers) ------------------------------------

    @property
    def holding(self) -> LeaseHolding:
        return self._ctx.holding

    @property
    def record(self) -> LeaseRecord | None:
        """The lease record as last read or written (ours while active)."""
        return self._ctx.record

    @property
    def backend_problem(self) -> str | None:
        return self._ctx.backend_problem

    @property
    def admission_deadline(self) -> float:
        """Monotonic (trio clock) time from which this router must not admit; -inf unless active."""
        return self._ctx.holding.admission_deadline

    @property
    def role(self) -> Role:
        return self._ctx.holding.role

    @property
    def applied_epoch(self) -> int:
        return self.follower.applied_epoch

    @property
    def applied_pass(self) -> int | None:
        return self.follower.applied_pass

    def valid_threadsafe(self) -> bool:
        """Whether the term is still valid, on time.monotonic(): callable from any thread."""
        return self._ctx.valid_threadsafe()

    def ownership(self) -> LeaseOwnership:
        """The handoff's ``lease`` entry: ours while active."""
        holding = self._ctx.holding
        if holding.role is Role.ACTIVE:
            return LeaseOwnership(holder=self._ctx.router_id, epoch=holding.epoch)
        return LeaseOwnership()

    def view(self) -> LeaseView:
        """What /admin/lease shows."""
        ctx = self._ctx
        holding = ctx.holding
        now = ctx.clocks.clock()
        term = holding.term
        active = holding.role is Role.ACTIVE and term is not None
        counter = self.watcher.counter
        lease = ctx.config.lease
        return LeaseView(
            router_id=ctx.router_id, backend=ctx.backend.name, role=str(holding.role),
            holder=holding.holder, epoch=holding.epoch, advertise_url=ctx.advertise_url,
            record=ctx.record,
            fencing_deadline_in_s=(term.deadline - now) if active and term is not None else None,
            last_renew_sent_s_ago=(now - term.last_renew_sent) if active and term is not None else None,
            fenced_reason=holding.fenced_reason, backend_problem=ctx.backend_problem,
            holder_ready_failures=counter.failures, takeover_ready_failures=counter.threshold,
            holder_last_not_ready=counter.last_reason,
            handoff_applied_epoch=self.follower.applied_epoch, handoff_applied_pass=self.follower.applied_pass,
            engine_set_differs=None if active else self.follower.engine_set_differs,
            ttl_s=lease.ttl_s, renew_interval_s=lease.renew_interval_s, fence_margin_s=lease.fence_margin_s)

    def _register_gauges(self) -> None:
        m = self._ctx.metrics
        holding = self._ctx.holding
        m.add_gauge("narwhal_lease_holder", "1 while this router holds a valid lease.", (),
                    lambda: {(): float(holding.valid())})
        m.add_gauge("narwhal_lease_epoch", "The lease epoch held (active) or last seen (standby).", (),
                    lambda: {(): float(holding.epoch)})

    # -- the loop ------------------------------------------------------------------------

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Tick every ``renew_interval_s`` on an absolute schedule; fence on time in a sibling task.

        On the way out (cancelled after a shutdown), a pending release is finished
        first, within ``shutdown_release_s``: the standby need not wait for expiry.
        """
        clock = self._ctx.clocks.clock
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.fence.run)
                task_status.started()
                t0 = clock()
                slot = 0
                while True:
                    await self.term.tick()
                    interval = self._ctx.renew_interval_s
                    slot = max(slot + 1, math.floor((clock() - t0) / interval))
                    await self.handover.wait_for_tick(t0 + slot * interval)
        finally:
            with trio.CancelScope(shield=True) as scope:
                scope.deadline = clock() + self.shutdown_release_s
                await self.handover.finish()
            with trio.CancelScope(shield=True):
                await self._http.aclose()
                await self._ctx.backend.aclose()

    async def tick(self) -> None:
        """One round: renew when active, else hand back what we must, try to acquire, follow and watch."""
        await self.term.tick()

    async def follow_handoff(self) -> None:
        """Apply the followed holder's latest handoff when it changed (see ``HandoffFollower``)."""
        await self.term.follow_handoff()

    async def release(self, reason: str) -> None:
        """Stop admitting and writing now, then give the lease up in the backend (retried until it lands)."""
        await self.handover.release(reason)

    def begin_shutdown(self) -> None:
        """On SIGTERM: never acquire again; stop serving at once and hand the lease over now.

        The release itself runs in ``run`` (woken at once) and is finished before ``run`` returns.
        """
        self.handover.begin_shutdown()
