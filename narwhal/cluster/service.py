"""One router's part in a cluster of routers (``[lease] mode = "replicas"``): its role, membership and view.

The lease holder is the controller; every other router is a replica. The
service watches the lease's role (every ``poll_s``, as discovery does) and:

- registers this router under ``<key>/routers/<router_id>`` on an etcd lease of
  its own, kept alive every ``keepalive_s`` and rewritten when its role or
  applied revision changes (``membership``);
- follows ``<key>/fleet/`` with discovery's list-then-watch code and, while a
  replica, hands each change to ``apply_fleet`` (the router applies the engine
  set and restores the records);
- keeps the replica's admission deadline: ``replica_stale_s`` after etcd last
  answered both the watch and the membership (``cluster_view_stale`` once when
  it passes, ``cluster_view_current`` when etcd answers again);
- ends an outage promptly: the membership's keepalive, which never backs off,
  is the probe; its first success after a failure ends the fleet watch's and
  the publisher's backoffs (up to 5 s each) at once, so a router serves and
  publishes again within about a keepalive of etcd's return;
- runs the controller's publisher and the replica's evidence sender.

Events (JSON lines): ``cluster_role``, ``cluster_view_stale``, ``cluster_view_current``,
``cluster_membership_failed``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence

import msgspec
import trio

from narwhal.cluster.fleet_view import FleetRecordsView
from narwhal.cluster.link import EvidenceSender
from narwhal.cluster.publisher import FleetPublisher
from narwhal.cluster.records import ClusterRouter, ClusterView, ControllerRef, FleetEntry, RouterEntry
from narwhal.cluster.store import ClusterStore
from narwhal.config import Config
from narwhal.discovery.etcd_http import EtcdUnavailable
from narwhal.discovery.etcd_watch import EtcdWatcher, ViewUpdate
from narwhal.fleet.admission import Admission
from narwhal.obs.logs import log_event

__all__ = ["ClusterService"]

CONTROLLER = "controller"
REPLICA = "replica"


class ClusterService:
    """This router's role, its key in the cluster, its copy of the controller's fleet and its freshness."""

    def __init__(self, *, config: Config, router_id: str, store: ClusterStore, publisher: FleetPublisher,
                 sender: EvidenceSender, admission: Admission, is_controller: Callable[[], bool],
                 apply_fleet: Callable[[dict[str, FleetEntry], Sequence[str], Sequence[str], Sequence[str]], None],
                 became_controller: Callable[[dict[str, FleetEntry]], None],
                 advertise_url: Callable[[], str], cluster_url: Callable[[], str],
                 clock: Callable[[], float] = trio.current_time, wall_clock: Callable[[], float] = time.time,
                 poll_s: float = 0.2, watcher: EtcdWatcher | None = None,
                 on_routers: Callable[[], None] | None = None) -> None:
        """``apply_fleet(entries, changed, fresh, ejected)``: a replica takes the controller's fleet (``fresh``:
        engines that are a newer process, ``ejected``: newly ejected); ``became_controller(entries)``: the
        records this router followed, applied once more when it takes over."""
        lease = config.lease
        self.config = config
        self.router_id = router_id
        self.store = store
        self.publisher = publisher
        self.sender = sender
        self.admission = admission
        self._is_controller = is_controller
        self._apply_fleet = apply_fleet
        self._became_controller = became_controller
        self._advertise_url = advertise_url
        self._cluster_url = cluster_url
        self.clock = clock
        self.wall_clock = wall_clock
        self.poll_s = poll_s
        self.stale_s = lease.replica_stale_s
        self.ttl_s = max(1, math.ceil(lease.ttl_s))
        # Keepalives often enough that a missed one or two never lets the key expire, and that the view's
        # age is known to within a second.
        self.keepalive_s = min(1.0, lease.ttl_s / 4, self.stale_s / 4)
        self.view = FleetRecordsView(store.fleet_prefix)
        self.watcher = watcher or EtcdWatcher(lease.endpoints, prefix=store.fleet_prefix, view=self.view,
                                              timeout_s=min(2.0, lease.renew_interval_s), idle_s=30.0)
        self.role = REPLICA
        self.started_at = wall_clock()
        # When this service started (trio clock): the age of a view never read is counted from it.
        self._start_clock = 0.0
        # The trio-clock time etcd last answered both the watch and the membership (None: never yet).
        self.fresh_at: float | None = None
        self._membership_ok = False
        self.stale_logged = False
        self._role_changed = trio.Event()
        self.membership_problem: str | None = None
        # The other routers as last listed (for the controller's address).
        self._routers: dict[str, RouterEntry] = {}
        self._routers_listed_at = -math.inf
        # Told when the routers serving change in number (each router's share of a client's limits follows).
        self._on_routers = on_routers
        # What this replica last applied of each engine (a newer process or an ejection is seen against it).
        self.applied: dict[str, FleetEntry] = {}

    # -- what the router asks ------------------------------------------------------------

    @property
    def is_replica(self) -> bool:
        return self.role == REPLICA

    def view_age(self, now: float) -> float | None:
        """Seconds since the view was last known current (None on the controller, or before the first read)."""
        if self.role == CONTROLLER or self.fresh_at is None:
            return None
        return max(0.0, now - self.fresh_at)

    def stale_reason(self, now: float) -> str:
        """The /ready and 503 text of a replica past ``replica_stale_s``."""
        base = self.fresh_at if self.fresh_at is not None else self._start_clock
        return f"replica: fleet view {int(now - base)} s old"

    def serving_routers(self) -> int:
        """How many routers serve, as the cluster's keys last said (this one at least): limits are shared."""
        others = sum(1 for entry in self._routers.values() if entry.router_id != self.router_id)
        return 1 + others

    def controller_ref(self) -> ControllerRef | None:
        """None while this router is the controller; else who is (as last listed)."""
        if self.role == CONTROLLER:
            return None
        for entry in self._routers.values():
            if entry.role == CONTROLLER and entry.router_id != self.router_id:
                return ControllerRef(router_id=entry.router_id, cluster_url=entry.cluster_url)
        return ControllerRef(router_id="", cluster_url="")

    def entry(self) -> RouterEntry:
        return RouterEntry(router_id=self.router_id, role=self.role, advertise_url=self._advertise_url(),
                           cluster_url=self._cluster_url(), fleet_revision=self.view.revision,
                           view_at=self.wall_clock(), started_at=self.started_at)

    async def cluster_view(self) -> ClusterView:
        """``GET /admin/cluster``: every registered router, read from etcd now (this router's own when it cannot)."""
        now, wall = self.clock(), self.wall_clock()
        routers = dict(self._routers)
        newest = self.view.revision
        written: list[tuple[int, float]] = []
        try:
            with trio.fail_after(2.0):
                routers = {entry.router_id: entry for entry in await self.store.routers()}
                keys, _ = await self.store.fleet_keys()
            written = sorted((key.mod_revision, key.written_at) for key in keys)
            if written:
                newest = max(newest, written[-1][0])
        except (EtcdUnavailable, trio.TooSlowError):
            pass  # etcd does not answer: the routers as last listed, and this router's own view (its lag unknown)
        routers[self.router_id] = self.entry()
        rows = []
        for entry in sorted(routers.values(), key=lambda e: (e.role != CONTROLLER, e.router_id)):
            # Lag: how long ago the oldest change it has not applied was written (0 when it has them all).
            behind = [at for revision, at in written if revision > entry.fleet_revision]
            lag = max(0.0, wall - min(behind)) if behind and entry.role != CONTROLLER else 0.0
            rows.append(ClusterRouter(router_id=entry.router_id, role=entry.role, advertise_url=entry.advertise_url,
                                      fleet_revision=entry.fleet_revision, lag_s=round(lag, 3),
                                      cluster_url=entry.cluster_url, is_self=entry.router_id == self.router_id))
        controller = next((row.router_id for row in rows if row.role == CONTROLLER), None)
        age = self.view_age(now)
        return ClusterView(mode="replicas", router_id=self.router_id, role=self.role, controller=controller,
                           fleet_revision=newest, view_age_s=None if age is None else round(age, 3),
                           stale=self.admission.view_deadline is not None and now >= self.admission.view_deadline,
                           routers=rows)

    # -- the loops -----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._start_clock = self.clock()
        # Until etcd first answers, a replica serves nothing older than replica_stale_s from its start.
        self.admission.view_deadline = self._start_clock + self.stale_s
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.watcher.run, self._on_update)
                nursery.start_soon(self._membership)
                nursery.start_soon(self._watch_role)
                nursery.start_soon(self._watch_staleness)
                await nursery.start(self.publisher.run)
                await nursery.start(self.sender.run)
                task_status.started()
        finally:
            with trio.CancelScope(shield=True):
                await self.watcher.aclose()
                await self.sender.aclose()

    def _on_update(self, update: ViewUpdate) -> None:
        if update.reason in ("listed", "events", "recovered"):
            self._contact()
        change = update.change
        if update.reason in ("listed", "events") and self.role == REPLICA and change.engines_changed:
            self._apply((*change.added, *change.changed, *change.removed))

    def _apply(self, changed: Sequence[str]) -> None:
        """Hand the replica's router what changed since it last applied (nothing while none was published)."""
        entries = dict(self.view.entries)
        if not entries:
            return  # nothing published yet (no controller so far): the file's engines stand
        fresh, ejected = [], []
        for name in changed:
            entry, last = entries.get(name), self.applied.get(name)
            if entry is None:
                self.applied.pop(name, None)
                continue
            if last is not None and entry.process_started_at is not None \
                    and last.process_started_at != entry.process_started_at:
                fresh.append(name)
            elif entry.record.ejected and (last is None or not last.record.ejected):
                ejected.append(name)
            self.applied[name] = entry
        self._apply_fleet(entries, changed, fresh, ejected)

    def _contact(self) -> None:
        """etcd answered: the view is current now, if the watch and the membership both stand."""
        status = self.watcher.status
        if not self._membership_ok or status.degraded is not None or not status.listed:
            return
        now = self.clock()
        self.fresh_at = now
        if self.role == REPLICA:
            self.admission.view_deadline = now + self.stale_s
        if self.stale_logged:
            self.stale_logged = False
            log_event("cluster_view_current", router_id=self.router_id, revision=self.view.revision)

    async def _watch_staleness(self) -> None:
        """Say once when the view passes ``replica_stale_s`` (admission compares the deadline itself)."""
        while True:
            deadline = self.admission.view_deadline
            if deadline is None:
                await trio.sleep(self.poll_s)
                continue
            await trio.sleep_until(deadline)
            if self.admission.view_deadline == deadline and not self.stale_logged and self.role == REPLICA:
                self.stale_logged = True
                now = self.clock()
                log_event("cluster_view_stale", level=logging.WARNING, router_id=self.router_id,
                          age_s=round(now - (self.fresh_at if self.fresh_at is not None else self._start_clock), 3),
                          replica_stale_s=self.stale_s, revision=self.view.revision,
                          reason=self.watcher.status.degraded or self.membership_problem or "no answer from etcd")
            await trio.sleep(self.poll_s)

    async def _watch_role(self) -> None:
        while True:
            role = CONTROLLER if self._is_controller() else REPLICA
            if role != self.role:
                self.role = role
                if role == CONTROLLER:
                    self.admission.view_deadline = None
                    self._became_controller(dict(self.view.entries))
                    self.publisher.new_term()
                else:
                    now = self.clock()
                    self.fresh_at = now if self._membership_ok else self.fresh_at
                    self.admission.view_deadline = (self.fresh_at if self.fresh_at is not None else now) + self.stale_s
                    self._apply(tuple(self.view.entries))
                log_event("cluster_role", level=logging.WARNING, router_id=self.router_id, role=role,
                          controller=self.router_id if role == CONTROLLER else None)
                self._role_changed.set()
            await trio.sleep(self.poll_s)

    async def _membership(self) -> None:
        lease_id = 0
        written: RouterEntry | None = None
        try:
            while True:
                try:
                    with trio.fail_after(max(self.keepalive_s, 1.0)):
                        if lease_id and not await self.store.keepalive(lease_id):
                            lease_id, written = 0, None
                        if not lease_id:
                            lease_id = await self.store.grant(self.ttl_s)
                        entry = self.entry()
                        if written is None or msgspec.structs.replace(entry, view_at=0.0) != written:
                            await self.store.put_router(entry, lease_id)
                            written = msgspec.structs.replace(entry, view_at=0.0)
                        # Every 5 s, and at once while the link to the controller fails (a new one?).
                        if self.clock() - self._routers_listed_at >= 5.0 or (
                                self.role == REPLICA and self.sender.problem is not None):
                            before = self.serving_routers()
                            self._routers = {e.router_id: e for e in await self.store.routers()}
                            self._routers_listed_at = self.clock()
                            if self.serving_routers() != before and self._on_routers is not None:
                                self._on_routers()
                    if self.membership_problem is not None:
                        log_event("cluster_membership_restored", router_id=self.router_id)
                        # etcd answers again: the watch and the publisher, backing off from the outage (up
                        # to 5 s), try now; the view is current again as soon as the watch is back.
                        self.watcher.retry_now()
                        self.publisher.retry_now()
                    self.membership_problem = None
                    self._membership_ok = True
                    self._contact()
                except (EtcdUnavailable, trio.TooSlowError) as exc:
                    problem = str(exc) or "etcd did not answer in time"
                    if self.membership_problem is None:
                        log_event("cluster_membership_failed", level=logging.WARNING, router_id=self.router_id,
                                  **{"class": type(exc).__name__}, message=problem)
                    self.membership_problem = problem
                    self._membership_ok = False
                with trio.move_on_after(self.keepalive_s):
                    await self._role_changed.wait()
                    self._role_changed = trio.Event()
        finally:
            if lease_id:
                with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                    try:
                        await self.store.revoke(lease_id)
                    except EtcdUnavailable:
                        pass  # it expires within ttl_s
