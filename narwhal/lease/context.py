"""What the lease's jobs share: its settings, the holding and record, the published deadline, backend calls.

``LeaseContext`` is read and written by the term keeper (acquire, renew), the
fence and the handover alike; each job keeps its own state beside it. Events
(JSON lines): ``lease_backend_unreachable``, ``lease_backend_reachable``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from narwhal.clocks import to_monotonic
from narwhal.config import Config
from narwhal.fleet.admission import FENCED_REASON, Admission
from narwhal.lease.backend import LeaseBackend, LeaseBackendError
from narwhal.lease.follower import Restorable
from narwhal.lease.rules import LeaseHolding, LeaseRecord, Role, standby_reason
from narwhal.obs.logs import log_event
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.stages.persistence import PersistenceStage

__all__ = ["LeaseClocks", "LeaseContext", "ServingParts"]


@dataclasses.dataclass(frozen=True)
class LeaseClocks:
    """The lease's clocks: trio's (deadlines, sleeps), unix seconds, the host's monotonic (logs, threads)."""

    clock: Callable[[], float] = trio.current_time
    wall_clock: Callable[[], float] = time.time
    monotonic: Callable[[], float] = time.monotonic

    def mono(self, at: float) -> float:
        """A time on ``clock``, as time.monotonic() (shared by the processes on a host)."""
        return to_monotonic(at, clock=self.clock, monotonic=self.monotonic)


@dataclasses.dataclass(frozen=True)
class ServingParts:
    """What the lease governs in its router: admission, the handoff writer, the fleet a standby keeps warm,
    and the router's own readiness (weighed against a takeover)."""

    admission: Admission
    persistence: PersistenceStage
    fleet: Restorable
    own_readiness: Callable[[], str | None]


class LeaseContext:
    """One router's lease facts, shared by its jobs; the backend reached only through ``call``."""

    def __init__(self, *, config: Config, router_id: str, backend: LeaseBackend, serving: ServingParts,
                 metrics: RouterMetrics, clocks: LeaseClocks,
                 advertise_url: Callable[[], str] | None = None) -> None:
        self.config = config
        self.router_id = router_id
        self.backend = backend
        self.serving = serving
        self.admission = serving.admission
        self.metrics = metrics
        self.clocks = clocks
        lease = config.lease
        self.holding = LeaseHolding(router_id=router_id, ttl_s=lease.ttl_s, fence_margin_s=lease.fence_margin_s,
                                    clock=clocks.clock)
        self._configured_url = lease.advertise_url or ""
        self._own_url = advertise_url
        self.record: LeaseRecord | None = None
        self.backend_problem: str | None = None
        self.stopping = False
        # Set (and replaced) whenever the deadline changes: the fence's timer re-reads it.
        self.deadline_changed = trio.Event()
        # The fencing deadline on time.monotonic(), for the handoff writer's thread.
        self._deadline_mono = -math.inf

    @property
    def advertise_url(self) -> str:
        """Where a standby reaches this router's /ready: ``lease.advertise_url``, else the router's own."""
        if self._configured_url or self._own_url is None:
            return self._configured_url
        return self._own_url()

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

    # -- the backend ---------------------------------------------------------------------

    async def call(self, what: str, call: Callable[[], Awaitable[Any]]) -> Any:
        """One backend call, bounded by ``call_timeout_s``; a LeaseBackendError on failure."""
        timeout_s = self.call_timeout_s
        with trio.move_on_after(timeout_s):
            return await call()
        raise LeaseBackendError(f"{self.backend.name} did not answer {what} within {timeout_s:g} s")

    def backend_ok(self) -> None:
        if self.backend_problem is not None:
            log_event("lease_backend_reachable", backend=self.backend.name, role=str(self.holding.role))
            self.backend_problem = None

    def backend_failed(self, problem: str) -> None:
        if self.backend_problem != problem:
            log_event("lease_backend_unreachable", level=logging.WARNING, backend=self.backend.name,
                      role=str(self.holding.role), holder=self.holding.holder, epoch=self.holding.epoch,
                      reason=problem)
        self.backend_problem = problem

    # -- what the router sees ------------------------------------------------------------

    def suffix(self) -> str:
        return f" ({self.backend_problem})" if self.backend_problem else ""

    @property
    def serves_without_lease(self) -> bool:
        """``mode = "replicas"``: every router serves; the lease only says who decides."""
        return self.config.lease.mode == "replicas"

    def standby_text(self, holder: str | None) -> None:
        if self.serves_without_lease:
            self.admission.open("lease")
        else:
            self.admission.close("lease", standby_reason(holder) + self.suffix())

    def fenced_text(self) -> None:
        """Fenced: a standby router stops admitting; a replica-mode router serves on as a replica."""
        if self.serves_without_lease:
            self.admission.open("lease")
        else:
            self.admission.close("lease", FENCED_REASON + self.suffix())

    def publish_deadline(self) -> None:
        """Hand the holding's admission deadline to admission and the writer's thread; wake the fence."""
        deadline = self.holding.admission_deadline
        # In replicas mode admission does not hang on the lease (a replica's own deadline is its view's age).
        self.admission.lease_deadline = None if self.serves_without_lease else deadline
        self._deadline_mono = self.clocks.mono(deadline) if math.isfinite(deadline) else -math.inf
        self.deadline_changed.set()
        self.deadline_changed = trio.Event()

    def valid_threadsafe(self) -> bool:
        """Whether the term is still valid, on time.monotonic(): callable from any thread."""
        return self.holding.role is Role.ACTIVE and self.clocks.monotonic() < self._deadline_mono

    def fit_to_serve(self) -> bool:
        """Whether this router could serve better than a failing holder: its own readiness and monitor pass."""
        return self.serving.own_readiness() is None and self.admission.held_by("monitor") is None
