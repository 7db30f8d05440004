"""The router process: the composition root that builds every part from the config and runs them.

The data plane is one ``DataPlane`` (``narwhal/serving/data_plane.py``),
served in this process or by worker processes; the control plane, the control
app and the lease are built once either way. Ownership: ``Router.run`` opens
the nursery that owns the supervisor (probes), the monitor, the optional
admin listener (the same HTTP/1.1 server, with its own bounds), the data
plane and the lease. ``shutdown`` closes admission, stops accepting, lets
in-flight requests finish within the grace period, then cancels the rest.
``reload`` (SIGHUP, ``POST /admin/reload``) is the one reload path: the config
file (its reloadable keys, ``narwhal.config_diff``; the engine set applied by
``narwhal.control.engine_set``, whose tables follow the engine registry), then ``reload_tls``: this
process's contexts (the admin listener's too), then the data plane's (each
worker's), and ``tls_reloaded`` only once every part reloaded. The engine set
reaches worker processes in the hub's snapshots.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import operator
import os
import secrets
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec
import trio

from narwhal.app.admin_routes import register_admin_routes
from narwhal.app.cluster_routes import register_cluster_routes
from narwhal.app.control_app import create_app
from narwhal.app.router_status import RouterStatus, router_status
from narwhal.app.ui_routes import register_ui_routes
from narwhal.auth.client_auth import AuthSettings, read_client_keys
from narwhal.auth.keys import KeyEntry
from narwhal.clocks import to_monotonic
from narwhal.cluster.control import ClusterControl
from narwhal.cluster.link import EvidenceReceiver, EvidenceSender, PlacementRelay, link_ssl_context
from narwhal.cluster.publisher import FleetPublisher
from narwhal.cluster.records import (
    ClusterRouter,
    ClusterView,
    ControllerRef,
    EvidenceItem,
    FleetEntry,
    PlacedPrompt,
    decisions_of,
    with_decisions,
)
from narwhal.cluster.service import ClusterService
from narwhal.cluster.store import ClusterStore
from narwhal.config import (
    Config,
    ConfigError,
    EngineConfig,
    EngineSpec,
    PlacementConfig,
    Reconfigurable,
    RunningConfig,
    join_listen,
    load_config,
    parse_listen,
)
from narwhal.config_diff import diff_configs, merge_reloadable
from narwhal.control.discovery import DiscoveryService, DiscoveryView
from narwhal.control.engine_set import (
    EngineSet,
    EngineSetListener,
    FleetFollower,
    InFlightFollower,
    PrefixIndexFollower,
    SetFollower,
    TablesFollower,
)
from narwhal.control.engine_view import EngineViewer
from narwhal.control.fleet_writer import FleetWriter
from narwhal.control.model_lengths import ModelLengths
from narwhal.control.model_view import ModelViewer
from narwhal.control.monitor import Monitor
from narwhal.control.placement_view import PlacementView, placement_view
from narwhal.control.readmission import Readmitter
from narwhal.control.reload import ReloadError, ReloadOutcome, split_config_error
from narwhal.control.supervisor import Supervisor
from narwhal.errors import FailureClass, StartupError, SuccessKind
from narwhal.fleet import EngineRecord, Fleet, FleetEvent, FleetEventKind, HoldKind
from narwhal.fleet.admission import Admission
from narwhal.fleet.placement import IndexRecord, SharedIndex
from narwhal.fleet.registry import EngineEntry, EngineRegistry, entries_from_config
from narwhal.fleet.telemetry import Telemetry
from narwhal.http1.asgi import ASGILifespan, call_asgi
from narwhal.http1.server import HTTPServer
from narwhal.kv_events.service import KvEvents
from narwhal.kv_events.sources import KvPublishers, feed_sources
from narwhal.lease import EtcdLeaseBackend, Role, build_backend
from narwhal.lease.backend import LeaseBackend
from narwhal.lease.service import LeaseService, LeaseView, ServingParts
from narwhal.native_parts import native_parts
from narwhal.obs.logs import flush_logs, log_event, run_log_flusher
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.obs.timeline import Timeline
from narwhal.obs.timeline_feed import TimelineFeed
from narwhal.pools.control import ControlPool
from narwhal.serving.data_plane import DataPlane, LocalDataPlane
from narwhal.serving.front import build_admin_server
from narwhal.serving.placement import FollowedIndex, RequestPlacement, build_index, build_placer
from narwhal.stages import build_stages
from narwhal.stages.persistence import HandoffExtra, PersistenceStage
from narwhal.state.handoff import LeaseOwnership
from narwhal.state.resume import apply_resume, operator_holds, plan_resume
from narwhal.tls import ExpiryWatch, TLSContexts
from narwhal.wire import error_json
from narwhal.workers.hub import Poke, WorkerHub
from narwhal.workers.plane import WorkerDataPlane
from narwhal.workers.process import WorkerSet
from narwhal.workers.protocol import Evidence
from narwhal.workers.view import WorkerView

__all__ = ["Router"]


_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})
_LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def _default_advertise_url(host: str, port: int, tls: bool) -> str:
    """Where a standby reaches this router's /ready when lease.advertise_url is not set."""
    if host in _WILDCARD_HOSTS:
        host = socket.gethostname()
    scheme = "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def _same_address(a: tuple[str, int], b: tuple[str, int]) -> bool:
    """Would a connection to ``b`` reach a listener on ``a``? Port 0 (any free port) matches nothing."""
    (host_a, port_a), (host_b, port_b) = a, b
    if port_a == 0 or port_a != port_b:
        return False
    if host_a == host_b or host_a in _WILDCARD_HOSTS or host_b in _WILDCARD_HOSTS:
        return True
    return host_a in _LOOPBACK_HOSTS and host_b in _LOOPBACK_HOSTS


def preflight(config: Config, listen: str, handoff_path: Path | None = None) -> None:
    """Refuse to start, with one line naming the cause, on what would fail later or loop.

    The admin listener on the serving address, an engine URL that is this
    router, and a handoff directory that is missing or not writable (every
    monitor pass would fail and /ready answer 503 for good). The default state
    directory is created; a configured path's directory must exist already (a
    typo should not create a tree). ``handoff_path`` defaults to
    ``config.handoff_path()``.
    """
    serving = parse_listen(listen)
    if config.admin.listen is not None and _same_address(serving, parse_listen(config.admin.listen)):
        raise StartupError(f"admin.listen {config.admin.listen} is the serving address {listen}: "
                           "give the admin API a port of its own")
    for spec in config.engines:
        if _same_address(serving, (spec.host, spec.port)):
            raise StartupError(f"engine {json.dumps(spec.name)}: url {spec.url} is this router's own serving "
                               f"address {listen}: requests would loop back into the router")
    path = config.handoff_path(listen=listen) if handoff_path is None else handoff_path
    key = f"handoff.path {config.handoff.path}" if config.handoff.path is not None else f"handoff (default {path})"
    directory = path.parent
    if config.handoff.path is None:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StartupError(f"{key}: cannot create the state directory {str(directory)!r}: "
                               f"{exc.strerror or exc}") from None
    if not directory.is_dir():
        raise StartupError(f"{key}: directory {str(directory)!r} does not exist")
    probe = directory / f".narwhal-write-check.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise StartupError(f"{key}: directory {str(directory)!r} is not writable: "
                           f"{exc.strerror or exc}") from None
    os.close(fd)
    os.unlink(probe)


class Router:
    """One Narwhal router: the composition root of the data plane, the control app and the control plane.

    The data plane is one ``DataPlane``: this process's own (``serving.workers
    = 1``) or worker processes'; nothing else here depends on which.
    """

    def __init__(self, config: Config, *, listen: str | None = None, resume: bool = False,
                 config_dir: Path | None = None, config_path: Path | None = None) -> None:
        self.config = config
        # The file a reload (SIGHUP, POST /admin/reload) reads again; None: reloads only TLS.
        self.config_path = config_path
        if config_dir is None and config_path is not None:
            config_dir = config_path.parent
        self.config_dir = config_dir
        # One reload at a time: SIGHUP and POST /admin/reload may come together.
        self._reload_lock = trio.Lock()
        self.listen = listen or config.serving.listen
        self.resume = resume
        self.router_id = config.lease.router_id or f"{socket.gethostname()}-{os.getpid()}"
        self.metrics = RouterMetrics()
        # Client keys ([auth] keys_file), read here: a bad file stops the start naming the problem.
        self._keys = read_client_keys(config, config_dir)
        # [lease] mode = "replicas": every router serves, the lease holder decides (narwhal.cluster).
        self.replicas = config.lease.mode == "replicas"
        self.lease: LeaseService | None = None
        self.cluster: ClusterService | None = None
        # Parts are built in dependency order and given their collaborators; none is wired afterwards.
        # Where two parts need each other, one of them gets a callable resolved when called: a
        # method of this router reading a part built later (self._forget_on_fleet_event, ...).
        # The publisher's wake-up: admission and the fleet writer poke it, the hub waits on it.
        poke = Poke()
        self.admission = Admission(clock=trio.current_time, on_change=poke, view_reason=self._stale_reason)
        # The engine set every per-engine table follows (self.engine_set tells them of its changes).
        self.registry = EngineRegistry(entries_from_config(config), grace_s=config.serving.shutdown_grace_s)
        engines = self.registry.entries()
        # Cache-aware placement's prefix index: the request path's own in one process; with workers,
        # the union of what they placed, relayed between them by the hub (narwhal.workers.index_relay).
        self.prefix_index = SharedIndex(build_index(config))
        # The prefill engines' own KV events: this process's subscriptions (each worker has its own too),
        # at the publishers the engines' config or identities give.
        self.kv_events = KvEvents(config.placement, [entry.name for entry in engines if entry.role == "prefill"])
        self.kv_publishers = KvPublishers(on_change=self._kv_sources_changed)
        recovery = config.recovery
        # The one writer: every part that changes the fleet gets this, never the bare Fleet.
        fleet = Fleet(
            [(entry.name, entry.role, entry.model) for entry in engines],
            eject_after=recovery.eject_after,
            liveness_misses=recovery.liveness_misses,
            failure_quarantine_s=recovery.failure_quarantine_s,
            probe_interval_s=recovery.probe_interval_s,
        )
        self.fleet = FleetWriter(fleet, self.metrics, listeners=[self._forget_on_fleet_event],
                                 on_change=self._fleet_changed(poke), decides=self._decides if self.replicas else None)
        # Every engine request says it came from this router: one arriving back here is a loop.
        self.via_token = f"narwhal-{secrets.token_hex(8)}"
        # Certificates are read here: a problem is a ConfigError naming the key.
        self.tls = TLSContexts(config, config_dir)
        # Warns before the serving certificate expires; feeds narwhal_tls_cert_expiry_seconds.
        self.cert_expiry = ExpiryWatch(self.tls)
        self.control_pool = ControlPool(control_connections=config.engine.control_connections,
                                        engine_config=config.engine, via=f"1.1 {self.via_token}",
                                        ssl_context=self.tls.engine)
        self.supervisor = Supervisor(config=config, fleet=self.fleet, control_pool=self.control_pool,
                                     metrics=self.metrics)
        self.telemetry = Telemetry([(entry.name, entry.role) for entry in engines], clock=trio.current_time,
                                   interval_s=config.telemetry.interval_s,
                                   keep_intervals=config.telemetry.keep_intervals)
        # /admin/timeline: fed with every finished request (the workers' via their reports) and sampled each second.
        self.timeline = TimelineFeed(Timeline([entry.name for entry in engines]), self.telemetry,
                                     in_flight=self._in_flight_counts, states=self.fleet.states)
        # The app reads this router's state as it answers: built here, the data plane hands it other routes.
        self.app = create_app(self)
        self.worker_count = config.serving.workers
        # Workers place on the registry's engine set (engines being removed included) and the running
        # config's placement and engine timeouts, from their snapshots.
        # A replica's request path: the controller's eligibility less what this router cannot reach, its
        # evidence reported to the controller (narwhal.cluster.control).
        self.cluster_control = ClusterControl(
            self.supervisor, replica=self._is_replica, report=self._report_evidence, clock=trio.current_time,
            hold_s=lambda: self.config.recovery.probe_interval_s) if self.replicas else None
        self.hub = WorkerHub(self.cluster_control or self.supervisor, self.admission,
                             engines=[entry.name for entry in engines],
                             clock=trio.current_time,
                             to_link_clock=None if self.worker_count == 1
                             else functools.partial(to_monotonic, clock=trio.current_time),
                             record_sample=self.timeline.record_request, share_in_flight=self.worker_count > 1,
                             engine_specs=self.registry.spec_list, running_config=lambda: self.config,
                             poke=poke, index=self.prefix_index if self.worker_count > 1 else None,
                             admit_until=self._admit_until, kv_sources=lambda: self.kv_events.sources,
                             admit_until_reason=self._admit_until_reason if self.replicas else None,
                             on_placed=self._placed_by_workers if self.replicas else None,
                             auth=self._auth_settings,
                             # A replica's eligibility is also the controller's word: no shortcut there.
                             fleet_mutations=None if self.replicas else functools.partial(
                                 operator.attrgetter("mutations"), fleet),
                             # Nor for its evidence, which goes to the controller whatever this fleet holds.
                             success_clears=None if self.replicas else fleet.success_clears)
        self.index_relay = self.hub.index_relay
        self.data_plane = self._build_data_plane(config_dir)
        self.in_flight = self.data_plane.in_flight
        self.handoff_path = config.handoff_path(config_dir, listen=self.listen)
        backend = build_backend(config, self.handoff_path, config_dir)
        # With a lease, the handoff writer asks the lease (it pauses the writer) before it writes.
        self.persistence = PersistenceStage(
            path=self.handoff_path, router_id=self.router_id, fleet=self.fleet, config=config,
            extra=self._handoff_extra, lease_valid=self._lease_valid if backend is not None else None,
            publish=functools.partial(self._publish_handoff, backend)
            if isinstance(backend, EtcdLeaseBackend) else None, on_written=self.metrics.handoff_written)
        # Each engine's max_model_len from its own /v1/models: /v1/models and /admin/models show each model's smallest.
        self.model_lengths = ModelLengths()
        self.readmitter = Readmitter(config=config, fleet=self.fleet, control_pool=self.control_pool,
                                     in_flight=self.in_flight, metrics=self.metrics,
                                     attestation_key=config.attestation_key_bytes(config_dir),
                                     inference_check=self.supervisor.inference_probe,
                                     # A drained engine restarted by its operator comes back with an empty
                                     # cache: readmission sees the new process.
                                     on_newer_process=self._newer_process,
                                     model_lengths=self.model_lengths, kv_publishers=self.kv_publishers,
                                     acting=self._decides if self.replicas else None)
        self.stages = build_stages(config=config, supervisor=self.supervisor, control_pool=self.control_pool,
                                   telemetry=self.telemetry, in_flight=self.in_flight,
                                   persistence_stage=self.persistence, readmission=self.readmitter,
                                   health_observer=self.readmitter)
        self.controller = self.stages.controller
        self.drain = self.stages.drain
        self.lease = self._build_lease(backend)
        self.cluster = self._build_cluster(backend, config_dir)
        controller = config.controller
        self.monitor = Monitor(self.stages.in_spec_order(), interval_s=controller.monitor_interval_s,
                               stage_timeout_s=controller.stage_timeout_s,
                               failure_limit=controller.monitor_failure_limit,
                               admission=self.admission, metrics=self.metrics,
                               acting=self._decides if self.replicas else None)
        self.engine_view = EngineViewer(config=config, fleet=self.fleet, in_flight=self.in_flight,
                                        readmitter=self.readmitter, controller=self.controller, monitor=self.monitor,
                                        prefix_index=self.prefix_index.index, specs=self.registry.specs,
                                        source_of=self.registry.source_of)
        # The cards' `created` is this router's start: stable while it runs.
        self.model_view = ModelViewer(config=config, fleet=self.fleet, lengths=self.model_lengths,
                                      created=int(time.time()),
                                      refusal=lambda: self.admission.refusal(trio.current_time()),
                                      specs=self.registry.spec_list)
        register_admin_routes(self.app, self)
        register_cluster_routes(self.app, self)
        # The [admin] listen server while it runs.
        self.admin_server: HTTPServer | None = None
        register_ui_routes(self.app, self)
        self.engine_set = EngineSet(self.registry, self._engine_tables(), in_flight=self.in_flight)
        # Engines that register themselves ([discovery]): applied with the file's through the engine set.
        self.discovery = DiscoveryService(config=config, file_entries=lambda: entries_from_config(self.config),
                                          apply=self._apply_engine_set, is_active=self._acts,
                                          on_view=self._discovered_view_changed, problem=self._loops_to_self,
                                          role_changes=self.lease is not None)
        # Every part that reads a reloadable key, in the order a reload hands it the new config.
        self._reconfigurable = self._reconfigurable_parts()
        self.bound_port: int | None = None
        # The admin listener's port once bound (it may be 0 in the config).
        self._admin_port: int | None = None
        # Where a standby reaches this router, once the serving port is bound (lease.advertise_url unset).
        self._own_url: str | None = None
        self._register_gauges()

    def _engine_tables(self) -> list[EngineSetListener]:
        """Every table kept per engine, in the order each hears of a change (the fleet logs it first)."""
        tables: list[EngineSetListener] = [
            FleetFollower(self.fleet, self.in_flight, grace_s=self.config.serving.shutdown_grace_s),
            TablesFollower(supervisor=self.supervisor, health=self.stages.health, readmitter=self.readmitter,
                           drain=self.drain, controller=self.controller)]
        if isinstance(self.data_plane, LocalDataPlane):
            # With workers the hub's in-flight sums follow its engine set (SetFollower).
            tables.append(InFlightFollower(self.data_plane.in_flight.forget))
        tables.append(PrefixIndexFollower(self.registry, self.prefix_index,
                                          self.index_relay if self.index_relay is not None else self.prefix_index))
        tables.append(SetFollower(self.registry, telemetry=self.telemetry, persistence=self.persistence,
                                  hub=self.hub))
        return tables

    def _reconfigurable_parts(self) -> tuple[Reconfigurable, ...]:
        """Every part that reads a reloadable key (``RELOADABLE_KEYS``), in the order a reload tells them."""
        parts: list[Reconfigurable] = []
        if self.index_relay is not None:
            # The workers place on their own indexes; the copy here, which relays between them, follows too.
            parts.append(FollowedIndex(self.prefix_index.index, self.config.placement))
        parts += [self.stages.health, self.fleet, self.readmitter, self.supervisor, self.engine_view, self.model_view]
        if self.lease is not None:
            parts.append(self.lease)
        parts += [self.monitor, self.controller, self.telemetry, self.discovery]
        return tuple(parts)

    def _build_data_plane(self, config_dir: Path | None) -> DataPlane:
        """This process serves the data plane itself, or leaves it to ``serving.workers`` processes."""
        config, hub = self.config, self.hub
        if self.worker_count > 1:
            # /metrics shows the controller's own series plus the sums over workers.
            hub.metrics.attach_to(self.metrics.registry)
            return WorkerDataPlane(WorkerSet(count=self.worker_count, config=config, config_dir=config_dir,
                                             hub=hub, app=self.app, via_token=self.via_token), hub)

        # The view and the data plane need each other: the view tells the plane (built next) of a
        # snapshot's engine set and settings, and the plane reads its snapshots through the view.
        def engines_changed(specs: list[EngineSpec]) -> None:
            plane.core.set_engines(specs)

        def settings_changed(placement: PlacementConfig, engine: EngineConfig) -> None:
            plane.configure(placement, engine)

        # The request path reads snapshots and sends evidence as messages, here
        # by a function call, from worker processes over a socket: one code path
        # (here a success, two a request, skips the message: the hub takes it as a call).
        view = WorkerView(lambda message: hub.receive(0, message), clock=trio.current_time,
                          refresh=hub.refresh_if_fleet_changed, record_success=hub.record_success,
                          success_clears=hub.success_clears,
                          on_engines=engines_changed,
                          on_settings=settings_changed, on_fleet=lambda fleet: plane.core.set_fleet(fleet),
                          on_auth=lambda settings: plane.configure_auth(settings),
                          on_tracing=lambda tracing: plane.configure_tracing(tracing))
        hub.attach(0, view.apply)
        # In one process admission and telemetry are the controller's own, not reported.
        plane = LocalDataPlane(config, tls=self.tls, via_token=self.via_token, supervisor=view,
                               admission=self.admission, metrics=self.metrics, telemetry=self.timeline,
                               serve_rest=functools.partial(call_asgi, self.app),
                               placement=RequestPlacement(config, self.metrics,
                                                          build_placer(config, self.prefix_index.index,
                                                                       on_record=self._placed_locally
                                                                       if self.replicas else None),
                                                          kv=self.kv_events),
                               auth=self._auth_settings())
        return plane

    def _build_lease(self, backend: LeaseBackend | None) -> LeaseService | None:
        """With a lease backend every router starts as a standby (the service closes admission)."""
        if backend is None:
            return None
        return LeaseService(config=self.config, router_id=self.router_id, backend=backend, metrics=self.metrics,
                            serving=ServingParts(admission=self.admission, persistence=self.persistence,
                                                 fleet=self.fleet, own_readiness=self.own_readiness),
                            advertise_url=self._advertise_url, engines=self._followed_engines)

    def _build_cluster(self, backend: LeaseBackend | None, config_dir: Path | None) -> ClusterService | None:
        """With ``[lease] mode = "replicas"``: membership, the fleet's records, the link (narwhal.cluster)."""
        if not self.replicas:
            return None
        assert isinstance(backend, EtcdLeaseBackend)  # the config requires etcd for replicas
        config = self.config
        lease = config.lease
        token = config.cluster_token(config_dir)
        store = ClusterStore(lease.endpoints, key=lease.key, timeout_s=min(2.0, lease.renew_interval_s))
        publisher = FleetPublisher(prefix=store.fleet_prefix, entries=self._fleet_entries,
                                   write=functools.partial(self._write_fleet, backend),
                                   published_names=self._published_names, acting=self._decides)
        relay_placements = config.placement.policy == "cache_aware"
        sender = EvidenceSender(router_id=self.router_id, controller=self._controller_ref, token=token,
                                apply_placements=self._apply_placed if relay_placements else None,
                                ssl_context=link_ssl_context(config, config_dir))
        self.cluster_receiver: EvidenceReceiver = EvidenceReceiver(
            router_id=self.router_id, token=token, mutual_tls=config.serving.tls_client_ca_file is not None,
            controller_ref=self._controller_ref, apply_evidence=self._apply_remote_evidence,
            apply_placements=self._apply_placed, relay=PlacementRelay())
        return ClusterService(config=config, router_id=self.router_id, store=store, publisher=publisher,
                              sender=sender, admission=self.admission, is_controller=self._decides,
                              apply_fleet=self._apply_fleet, became_controller=self._became_controller,
                              advertise_url=lambda: self.lease.advertise_url if self.lease is not None else "",
                              cluster_url=self._cluster_url, on_routers=self.hub.poke)

    # -- what parts built earlier ask of parts built later -----------------------------

    def _lease_valid(self) -> bool:
        """Whether this router's lease term is still valid (thread-safe: the handoff writer's thread asks)."""
        return self.lease is not None and self.lease.valid_threadsafe()

    async def _publish_handoff(self, etcd: EtcdLeaseBackend, data: bytes) -> bool:
        """The handoff written to etcd under this router's lease; False when the lease is no longer ours."""
        lease = self.lease
        record = None if lease is None else lease.record
        if lease is None or record is None or not lease.valid_threadsafe():
            return False
        return await etcd.write_handoff(data, record)

    def _auth_settings(self) -> AuthSettings | None:
        """Client auth as the data plane applies it: the keys, the reserve, the queue bound and this process's share
        of every limit (1 / worker processes, x 1 / routers serving in replicas mode)."""
        if self._keys is None:
            return None
        routers = self.cluster.serving_routers() if self.cluster is not None else 1
        return AuthSettings(keys=self._keys, reserve_high=self.config.auth.reserve_high,
                            max_queue=self.config.serving.max_queue, share=1.0 / (self.worker_count * max(1, routers)))

    def _decides(self) -> bool:
        """Whether this router decides for the fleet: always, but a replica (mode replicas, lease not held)."""
        return not self.replicas or (self.lease is not None and self.lease.role is Role.ACTIVE)

    def _is_replica(self) -> bool:
        return not self._decides()

    def _fleet_changed(self, poke: Poke) -> Callable[[], None]:
        """What the fleet writer calls after every mutation: the hub's poke, and the controller's publisher."""
        if not self.replicas:
            return poke

        def changed() -> None:
            poke()
            if self.cluster is not None:
                self.cluster.publisher.poke()
        return changed

    def _stale_reason(self, now: float) -> str:
        return self.cluster.stale_reason(now) if self.cluster is not None else "replica: fleet view too old"

    def _admit_until_reason(self) -> str:
        """What a worker says past its replica's view deadline."""
        deadline = self.admission.view_deadline
        return self._stale_reason(deadline if deadline is not None else trio.current_time())

    def _report_evidence(self, item: EvidenceItem) -> None:
        if self.cluster is not None:
            self.cluster.sender.report(item)

    def _controller_ref(self) -> ControllerRef | None:
        return self.cluster.controller_ref() if self.cluster is not None else None

    def _apply_remote_evidence(self, engine: str, failure: FailureClass | None, success: SuccessKind | None) -> None:
        """A replica's evidence, applied as a worker's (in arrival order, to the one fleet)."""
        self.hub.receive(-1, Evidence(engine=engine, failure_class=None if failure is None else failure.value,
                                      success_kind=None if success is None else success.value))

    def _placed_locally(self, engine: str, blocks: Sequence[int], at: float) -> None:
        """This process placed a prompt (replicas mode): the other routers learn it over the link, unless the
        engine publishes its KV events (every router reads those itself)."""
        if not self.kv_events.live(engine):
            self._share_placement([PlacedPrompt(engine, list(blocks))])

    def _placed_by_workers(self, records: list[IndexRecord]) -> None:
        live = self.kv_events.live
        prompts = [PlacedPrompt(record.engine, record.blocks) for record in records if not live(record.engine)]
        if prompts:
            self._share_placement(prompts)

    def _share_placement(self, prompts: list[PlacedPrompt]) -> None:
        cluster = self.cluster
        if cluster is None:
            return
        if cluster.is_replica:
            for prompt in prompts:
                cluster.sender.placed(prompt.engine, prompt.blocks)
        else:
            self.cluster_receiver.placed_here(prompts)

    def _apply_placed(self, prompts: list[PlacedPrompt]) -> None:
        """Other routers' placements, into this router's prefix index (and its workers')."""
        shared = self.prefix_index
        at = time.monotonic()
        live, known = self.kv_events.live, self.prefix_index.index.engines
        records = [IndexRecord(prompt.engine, shared.epochs.get(prompt.engine, 0), prompt.blocks, at)
                   for prompt in prompts if prompt.engine in known and not live(prompt.engine)]
        if not records:
            return
        if self.index_relay is not None:
            self.index_relay.apply_external(records)
        else:
            shared.apply(records)

    def _fleet_entries(self) -> list[FleetEntry]:
        """What the controller publishes: each engine, its state and its publisher, stamped with the term."""
        now, wall = trio.current_time(), time.time()
        records = {record.name: record for record in self.fleet.snapshot(now, wall)}
        sources = self.kv_events.sources
        epoch = self.lease.holding.epoch if self.lease is not None else 0
        return [FleetEntry(entry=entry, record=decisions_of(records[entry.name]),
                           eligible=self.fleet.is_eligible(entry.name, now),
                           kv_source=sources.get(entry.name),
                           process_started_at=self.readmitter.process_started(entry.name),
                           controller=self.router_id, epoch=epoch)
                for entry in self.registry.entries() if entry.name in records]

    async def _write_fleet(self, etcd: EtcdLeaseBackend, puts: Sequence[tuple[str, bytes]],
                           deletes: Sequence[str]) -> bool:
        lease = self.lease
        record = None if lease is None else lease.record
        if lease is None or record is None or not lease.valid_threadsafe():
            return False
        return await etcd.write_guarded(puts, deletes, record)

    async def _published_names(self) -> list[str]:
        assert self.cluster is not None
        keys, _ = await self.cluster.store.fleet_keys()
        return [key.name for key in keys]

    def _apply_fleet(self, entries: dict[str, FleetEntry], changed: Sequence[str], fresh: Sequence[str],
                     ejected: Sequence[str]) -> None:
        """A replica takes the controller's fleet: its engine set, then each changed engine's record; an engine
        that is a newer process (``fresh``) or newly ejected has an empty cache (its prefixes are forgotten)."""
        wanted = {entry.entry.name: entry.entry for entry in entries.values()}
        if wanted != {entry.name: entry for entry in self.registry.entries()}:
            self.engine_set.apply(list(wanted.values()))
        now, wall = trio.current_time(), time.time()
        records = self._with_decisions({name: entries[name] for name in changed if name in entries}, now, wall)
        try:
            self.fleet.restore(records, now, wall)
        except ValueError as exc:
            log_event("cluster_fleet_not_applied", level=logging.WARNING, router_id=self.router_id, reason=str(exc))
            return
        if self.cluster_control is not None:
            for name in changed:
                self.cluster_control.exclusions.clear(name)  # the controller decided since: its word stands
        for name in fresh:
            self._newer_process(name)
        for name in ejected:
            self._forget_prefixes(name, "ejected")
        self._kv_sources_changed()

    def _became_controller(self, entries: dict[str, FleetEntry]) -> None:
        """This router took the lease: the records it followed are fresher than the handoff it just read."""
        now, wall = trio.current_time(), time.time()
        records = self._with_decisions(entries, now, wall)
        try:
            self.fleet.restore(records, now, wall)
        except ValueError as exc:
            log_event("cluster_fleet_not_applied", level=logging.WARNING, router_id=self.router_id, reason=str(exc))
        if self.cluster_control is not None:
            for name in list(entries):
                self.cluster_control.exclusions.clear(name)

    def _with_decisions(self, entries: Mapping[str, FleetEntry], now: float, wall: float) -> list[EngineRecord]:
        """This router's records of ``entries``' engines, with the controller's decisions in them (its own
        evidence counts and totals kept)."""
        current = {record.name: record for record in self.fleet.snapshot(now, wall)}
        return [with_decisions(current[name], entry.record) for name, entry in entries.items() if name in current]

    def _cluster_url(self) -> str:
        """Where the other routers reach this one's /cluster/evidence and /admin: [admin] listen, else advertised."""
        listen = self.config.admin.listen
        if listen is None:
            return self.lease.advertise_url if self.lease is not None else ""
        host, port = parse_listen(listen)
        return _default_advertise_url(host, self._admin_port or port, self.tls.server is not None)

    def _acts(self) -> bool:
        """Whether this router acts on what it sees (discovery): always without a lease, else while it holds it."""
        return self.lease is None or self.lease.role is Role.ACTIVE

    def _apply_engine_set(self, entries: list[EngineEntry]) -> None:
        """The engine set discovery asks for, applied as a reload applies it (a reload recomputes the same union)."""
        self.engine_set.apply(entries)
        self._kv_sources_changed()

    def _kv_sources_changed(self) -> None:
        """The engine set or an identity moved a KV event publisher: subscribe where they say now (workers too)."""
        specs = self.registry.spec_list()
        self.kv_events.set_engines(spec.name for spec in specs if spec.role == "prefill")
        sources = feed_sources(specs, self.kv_publishers.reported())
        if self.cluster is not None and self.cluster.is_replica:
            # The publishers the controller resolved (from identities this replica never read) come first.
            prefill = {spec.name for spec in specs if spec.role == "prefill"}
            resolved = {name: entry.kv_source for name, entry in self.cluster.applied.items()
                        if entry.kv_source is not None and name in prefill}
            sources = {**sources, **resolved}
        self.kv_events.set_sources(sources)
        if self.cluster is not None:
            self.cluster.publisher.poke()
        if self.worker_count > 1:
            self.hub.publish()

    def _newer_process(self, engine: str) -> None:
        """Readmission saw a new process of ``engine``: its caches are empty (the index and its feed start over)."""
        self._forget_prefixes(engine, reason="newer_process")
        self.kv_events.new_process(engine)
        if self.cluster is not None:
            self.cluster.publisher.poke()

    def _loops_to_self(self, spec: EngineSpec) -> str | None:
        """A discovered engine whose url is this router's serving address (the file's engines are refused so)."""
        host, port = parse_listen(self.listen)
        serving = (host, self.bound_port if self.bound_port is not None else port)
        if _same_address(serving, (spec.host, spec.port)):
            return f"{spec.url} is this router's own serving address: requests would loop back into the router"
        return None

    def _followed_engines(self) -> list[EngineSpec]:
        """What a standby compares the holder's handoff with: the file's engines plus those it sees discovered."""
        return [entry.spec() for entry in self.discovery.watched_entries()]

    def _discovered_view_changed(self) -> None:
        # A standby's engine set to compare with moved: the handoff it skipped may match now.
        if self.lease is not None:
            self.lease.follower.engines_changed()

    def _admit_until(self) -> float | None:
        """The lease-derived admission deadline (control clock) worker processes check on their own clocks."""
        lease = self.lease
        if self.replicas:
            return self.admission.view_deadline  # a replica's view age; None on the controller
        if lease is None:
            return None
        return lease.admission_deadline if math.isfinite(lease.admission_deadline) else None

    def _advertise_url(self) -> str:
        """Where a standby reaches this router's /ready when ``lease.advertise_url`` is not set: known once
        the serving port is bound (before the lease runs); empty until then."""
        if self._own_url is None and self.bound_port is not None:
            host, _ = parse_listen(self.listen)
            self._own_url = _default_advertise_url(host, self.bound_port, self.tls.server is not None)
        return self._own_url or ""

    # -- state views -----------------------------------------------------------------

    def readiness(self) -> str | None:
        """None when this router should get traffic, else the one-line reason."""
        reason = self.admission.refusal(trio.current_time())
        if reason is not None:
            return reason
        return self.supervisor.capacity_problem()

    def own_readiness(self) -> str | None:
        """Readiness apart from the lease: what a takeover decision weighs (monitor, capacity)."""
        return self.admission.held_by("monitor") or self.supervisor.capacity_problem()

    def placement_view(self) -> PlacementView:
        """What /admin/placement shows: each prefill engine's prefix index and KV event feed."""
        return placement_view(policy=self.config.placement.policy, index=self.prefix_index.index,
                              kv=self.kv_events, model_of=self._engine_model)

    def discovery_view(self) -> DiscoveryView:
        """What /admin/discovery shows: the backend, the watch's state and the discovered engines."""
        return self.discovery.view()

    def lease_view(self) -> LeaseView:
        """What /admin/lease shows: the lease record and this router's role."""
        if self.lease is None:
            return LeaseView(router_id=self.router_id, backend="none", role="active")
        return self.lease.view()

    async def cluster_view(self) -> ClusterView:
        """What /admin/cluster shows: the routers, their roles, the fleet revision each applied and its lag."""
        if self.cluster is not None:
            return await self.cluster.cluster_view()
        role = "controller" if self._acts() else "standby"
        url = self.config.lease.advertise_url or self._advertise_url()
        me = ClusterRouter(router_id=self.router_id, role=role, advertise_url=url, fleet_revision=0, lag_s=0.0,
                           cluster_url=self._cluster_url() or url, is_self=True)
        return ClusterView(mode=self.config.lease.mode, router_id=self.router_id, role=role,
                           controller=self.router_id if role == "controller" else None, fleet_revision=0,
                           view_age_s=None, stale=False, routers=[me])

    def controller_redirect(self) -> ControllerRef | None:
        """None when this router may act on an admin change (it decides); else the controller to send it to."""
        return self._controller_ref() if self.replicas and not self._decides() else None

    def cluster_evidence(self, body: bytes, *, authorization: str | None, peer_cert: bool,
                         peer: str = "") -> tuple[int, bytes]:
        """``POST /cluster/evidence``: a replica's evidence and placements (the controller applies them)."""
        if self.cluster is None:
            return 404, error_json("this router is not in replicas mode",
                                   "invalid_request_error", "not_found")
        return self.cluster_receiver.handle(body, authorization=authorization, peer_cert=peer_cert, peer=peer)

    def _in_flight_counts(self) -> Mapping[str, int]:
        return self.in_flight.counts

    def router_status(self) -> RouterStatus:
        """What /admin/router shows: readiness, the lease, the monitor's stages and the workers."""
        monitor = self.monitor
        workers = self.data_plane.workers if isinstance(self.data_plane, WorkerDataPlane) else None
        return router_status(router_id=self.router_id, now=trio.current_time(), readiness=self.readiness(),
                             lease=self.lease_view(), stage_names=[stage.name for stage in monitor.stages],
                             passes=monitor.passes, failure_streak=monitor.failure_streak,
                             degraded=monitor.degraded_reason, last_pass=monitor.last_pass,
                             stage_errors=self.metrics.stage_errors.values, worker_count=self.worker_count,
                             workers=self.hub.workers, restarts=workers.restarts if workers is not None else {})

    def _handoff_extra(self) -> HandoffExtra:
        return HandoffExtra(consolidation_risk=self.controller.consolidation_risk(),
                            drained=sorted(self.drain.drained),
                            lease=self.lease.ownership() if self.lease is not None else LeaseOwnership())

    def _forget_on_fleet_event(self, event: FleetEvent) -> None:
        # An ejected engine may have crashed, and one under maintenance comes back only as a newer
        # process: either way its prefix cache is empty when it returns. (One a reload removed is
        # forgotten by the engine set's PrefixIndexFollower.)
        maintenance = event.kind is FleetEventKind.HOLD_ADDED and event.hold_kind is HoldKind.MAINTENANCE
        if event.kind is not FleetEventKind.EJECTED and not maintenance:
            return
        self._forget_prefixes(event.engine, str(event.kind if not maintenance else HoldKind.MAINTENANCE))

    def _forget_prefixes(self, engine: str, reason: str) -> None:
        """Drop ``engine``'s prefix-index entries in every process, and say so."""
        if engine not in self.prefix_index.index.engines:
            return
        if self.index_relay is not None:
            self.index_relay.forget(engine)
        else:
            self.prefix_index.forget(engine)
        log_event("prefix_index_forgotten", engine=engine, reason=reason, model=self._engine_model(engine))

    def _engine_model(self, name: str) -> str:
        """The model of engine ``name``, a gauge's last label ("" for one a reload removed meanwhile)."""
        fleet = self.fleet
        return fleet.model_of(name) if name in fleet else ""

    def _register_gauges(self) -> None:
        m = self.metrics
        index = self.prefix_index.index
        model = self._engine_model
        m.add_gauge("narwhal_placement_index_bytes", "Prefix index size per prefill engine, by its accounting "
                    "(bounded by placement.max_index_mb in all).", ("engine", "model"),
                    lambda: {(name, model(name)): float(index.bytes(name)) for name in index.engines})
        m.add_gauge("narwhal_placement_index_entries", "Block hashes the prefix index holds per prefill engine.",
                    ("engine", "model"),
                    lambda: {(name, model(name)): float(index.entries(name)) for name in index.engines})
        kv = self.kv_events

        def feeds(field: str) -> dict[tuple[str, ...], float]:
            return {(name, model(name)): float(getattr(stats, field) or 0)
                    for name, stats in kv.stats().items() if stats.state != "off"}

        m.add_gauge("narwhal_kv_events_state", "Each prefill engine's KV event feed: 1 for its state (live, "
                    "resyncing, down, off).", ("engine", "model", "state"),
                    lambda: {(name, model(name), stats.state): 1.0 for name, stats in kv.stats().items()})
        for field, help_text in (
                ("last_seq", "The last KV event batch sequence number applied per prefill engine."),
                ("blocks", "Blocks each prefill engine's KV events say it holds."),
                ("events_per_s", "KV events applied per second per prefill engine (recent rate)."),
                ("resyncs", "KV event feed resyncs per prefill engine (a gap replay could not cover), "
                            "since the router started."),
                ("dropped", "KV event messages dropped per prefill engine (over the size bound, unreadable, "
                            "past the rate budget), since the router started.")):
            metric = "events_per_second" if field == "events_per_s" else field
            m.add_gauge(f"narwhal_kv_events_{metric}", help_text, ("engine", "model"),
                        functools.partial(feeds, field))
        m.add_gauge("narwhal_requests_in_flight", "Requests in flight per engine.", ("engine", "model"),
                    lambda: {(name, model(name)): float(n) for name, n in self.in_flight.counts.items()})

        def pools() -> dict[tuple[str, ...], float]:
            data = self.data_plane.pool_usage()
            control = self.control_pool.statistics()
            return {("data", "in_use"): float(data.in_use), ("data", "capacity"): float(data.capacity),
                    ("data", "waiting"): float(data.waiting), ("control", "in_use"): float(control.in_use),
                    ("control", "capacity"): float(control.control_connections)}

        m.add_gauge("narwhal_pool_connections", "Connection pool occupancy.", ("pool", "state"), pools)

        def eligibility() -> dict[tuple[str, ...], float]:
            now = trio.current_time()
            return {(v.name, v.role, v.model): float(v.eligible) for v in self.fleet.views(now)}

        m.add_gauge("narwhal_engine_eligible", "1 when the engine may take new requests.",
                    ("engine", "role", "model"), eligibility)
        m.add_gauge("narwhal_tls_cert_expiry_seconds", "Seconds until the serving certificate expires "
                    "(negative once it has); no sample without TLS.", (), self.cert_expiry.gauge)
        m.add_gauge("narwhal_ready", "1 when /ready answers 200.", (),
                    lambda: {(): float(self.readiness() is None)})
        if isinstance(self.data_plane, WorkerDataPlane):
            self._register_worker_gauges(self.data_plane.workers)

    def _register_worker_gauges(self, workers: WorkerSet) -> None:
        m = self.metrics
        hub = self.hub

        def up() -> dict[tuple[str, ...], float]:
            live = set(hub.workers)
            return {(str(i),): float(i in live) for i in range(self.worker_count)}

        m.add_gauge("narwhal_worker_up", "1 while the worker process is connected to the controller.",
                    ("worker",), up)
        m.add_gauge("narwhal_worker_restarts", "Times the controller restarted the worker.", ("worker",),
                    lambda: {(str(i),): float(n) for i, n in workers.restarts.items()})
        m.add_gauge("narwhal_worker_requests_in_flight", "Client requests in flight per worker.", ("worker",),
                    lambda: {(str(i),): float(s.requests_in_flight) for i, s in hub.workers.items()})
        m.add_gauge("narwhal_worker_requests_finished", "Client requests each live worker finished since it started.",
                    ("worker",), lambda: {(str(i),): n for i, n in hub.metrics.per_worker("narwhal_requests")})

    # -- lifetime ----------------------------------------------------------------------

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until ``shutdown`` completes; ``task_status.started(port)`` once listening."""
        host, port = parse_listen(self.listen)
        listeners: list[trio.SocketListener] = []
        admin_fd: int | None = None
        # A router that never started does not report stopping: its failure is the CLI's router_failed.
        started = False
        try:
            preflight(self.config, self.listen, self.handoff_path)
            # Bound before anything starts: a taken port is a one-line startup error, not a failed task.
            listeners = await self._bind(host, port)
            admin_fd = self._bind_admin() if self.config.admin.listen else None
            async with ASGILifespan(self.app), trio.open_nursery() as nursery:
                # Removals a reload starts wait for their engines' requests in here.
                await nursery.start(self.engine_set.run)
                self._kv_sources_changed()
                await nursery.start(self.kv_events.run)
                nursery.start_soon(self._flush_logs_periodically)
                await nursery.start(self.supervisor.run)
                # With discovery the handoff's engine set holds discovered engines too: resume after the first list.
                discovering = self.config.discovery.enabled
                if self.resume and not discovering:
                    self._resume()
                elif not self.resume and self.lease is None:
                    # (With a lease the handoff is the pair's: a standby follows it, drains included.)
                    self._warn_if_drains_dropped()
                await nursery.start(self.readmitter.run)
                # The first list of the store is in (or failed) before serving; a name clash stops the start.
                await nursery.start(self.discovery.run)
                if self.resume and discovering:
                    self._resume(self._followed_engines())
                # Before serving: an engine that answers for another model never gets a request.
                await self.readmitter.first_identity_read()
                await nursery.start(self.monitor.run)
                await nursery.start(self.timeline.run)
                if admin_fd is not None:
                    await nursery.start(self._serve_admin, admin_fd)
                    admin_fd = None
                self.bound_port = await nursery.start(self._serve_then_stop, nursery, listeners)
                listeners = []
                if self.lease is not None:
                    await nursery.start(self.lease.run)
                if self.cluster is not None:
                    await nursery.start(self.cluster.run)
                if self._keys is None:
                    log_event("client_auth_off", router_id=self.router_id,
                              reason="no [auth] keys_file: the completion routes take every caller")
                log_event("router_started", router_id=self.router_id, listen=join_listen(host, self.bound_port),
                          engines=len(self.config.engines), pid=os.getpid(), handoff=str(self.handoff_path),
                          tls=self.tls.server is not None, workers=self.worker_count, native=native_parts())
                started = True
                self._warn_if_admin_open(join_listen(host, self.bound_port))
                self.cert_expiry.check(force=True)
                nursery.start_soon(self.cert_expiry.run)
                task_status.started(self.bound_port)
        finally:
            for listener in listeners:
                listener.socket.close()
            if admin_fd is not None:
                os.close(admin_fd)
            # Close sockets even when cancelled: leaked engine connections outlive the router.
            with trio.CancelScope(shield=True):
                await self.control_pool.aclose()
            if started:
                log_event("router_stopped", router_id=self.router_id)
            flush_logs()

    async def _flush_logs_periodically(self) -> None:
        # Log lines are batched for the hot path; none waits more than about 100 ms (asleep while none waits).
        await run_log_flusher(0.1)

    def _resume(self, engines: list[EngineSpec] | None = None) -> None:
        """Apply the saved handoff when its schema and engine set match (``engines``: the file's and the discovered
        ones; default the file's); say plainly when not."""
        plan = plan_resume(self.handoff_path, self.config, engines)
        if plan.applied:
            apply_resume(plan, self.fleet, trio.current_time(), time.time())
            log_event("handoff_applied", **plan.event_fields())
        else:
            log_event("handoff_not_applied", **plan.event_fields())

    def _warn_if_drains_dropped(self) -> None:
        """A start without --resume forgets the handoff's drains and maintenance: say so, naming them."""
        held = operator_holds(self.handoff_path, self.config)
        if held:
            log_event("handoff_drains_dropped", level=logging.WARNING, path=str(self.handoff_path),
                      engines=list(held), holds=held,
                      message=f"started without --resume: the handoff's drains and maintenance of "
                              f"{', '.join(held)} are not applied and these engines take requests; restart "
                              "with --resume to keep them, or drain them again")

    async def _bind(self, host: str, port: int) -> list[trio.SocketListener]:
        try:
            return await trio.open_tcp_listeners(port, host=host)
        except OSError as exc:
            raise StartupError(f"serving.listen: cannot listen on {join_listen(host, port)}: "
                               f"{exc.strerror or exc}") from None

    def _bind_admin(self) -> int:
        """The admin listener's socket, bound and listening (before the router reports started)."""
        address = self.config.admin.listen
        assert address is not None
        host, port = parse_listen(address)
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(128)
            self._admin_port = sock.getsockname()[1]
        except OSError as exc:
            sock.close()
            raise StartupError(f"admin.listen: cannot listen on {address}: {exc.strerror or exc}") from None
        return sock.detach()

    def _warn_if_admin_open(self, serving: str) -> None:
        if self.config.admin.token is not None:
            return
        where = self.config.admin.listen or f"the serving address {serving}"
        log_event("admin_unauthenticated", level=logging.WARNING, listen=where,
                  message=f"the admin API on {where} has no [admin] token: anyone who can reach it can drain, "
                          "put into maintenance and readmit engines; set [admin] token (and [admin] listen "
                          "on a private address)")

    async def _serve_then_stop(self, nursery: trio.Nursery, listeners: list[trio.SocketListener], *,
                               task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        # The data plane returns once shutdown has drained it; everything else stops with it.
        await self.data_plane.run(listeners, task_status=task_status)
        nursery.cancel_scope.cancel()

    async def reload(self) -> ReloadOutcome:
        """SIGHUP and ``POST /admin/reload``: read the config file again, apply what may change, reload TLS.

        A file that fails to load or validate changes nothing (TLS included):
        one ``config_reload_failed`` event names the file, the key and the
        problem. Otherwise the reloadable keys (``narwhal.config_diff``) take
        effect, the others keep their running values, and ``config_reloaded``
        lists both; then the TLS files are read again as before.
        """
        async with self._reload_lock:
            if self.config_path is None:
                tls, tls_error = await self._reload_tls_outcome()
                return ReloadOutcome(file="", reloaded=False, tls=tls, tls_error=tls_error,
                                     error=ReloadError(file="", key=None, problem="no config file to read again"))
            file = str(self.config_path)
            try:
                # Off the event loop: file reads (the config, the fleet key) must not stall streams.
                new, key, keys = await trio.to_thread.run_sync(self._read_config_file, self.config_path)
            except ConfigError as exc:
                return self._reload_failed(split_config_error(str(exc), file))
            except OSError as exc:
                return self._reload_failed(ReloadError(file=file, key="fleet.attestation_key_file",
                                                       problem=exc.strerror or str(exc)))
            problem = self._loops_back(new) or self._opens_admin(new)
            if problem is not None:
                return self._reload_failed(problem)
            changes = diff_configs(self.config, new)
            self._apply_config(merge_reloadable(self.config, new), key)
            # Keys added are admitted, keys removed refused, from the next request on (every worker's snapshot).
            self._keys = keys
            # The new engine set (an engine that moved to another model: a removal and an addition), applied.
            if self._decides():
                self._apply_engine_set(self.discovery.apply_entries())
            await self.control_pool.set_timeouts(self.config.engine)
            # The data plane (each worker's) takes placement, the engine timeouts and the engine set now.
            self.hub.publish()
            log_event("config_reloaded", level=logging.WARNING if changes.keys_needing_restart else logging.INFO,
                      file=file, **msgspec.structs.asdict(changes))
            self._warn_if_admin_open(self._serving_address())
            tls, tls_error = await self._reload_tls_outcome()
            return ReloadOutcome(file=file, reloaded=True, changes=changes, tls=tls, tls_error=tls_error)

    def _read_config_file(self, path: Path) -> tuple[Config, bytes | None, list[KeyEntry] | None]:
        """The config file, the fleet key and the client keys it names, read and checked (blocking: a thread)."""
        new = load_config(path)
        return new, new.attestation_key_bytes(self.config_dir), read_client_keys(new, self.config_dir)

    @staticmethod
    def _reload_failed(error: ReloadError) -> ReloadOutcome:
        """Nothing changed: say why, once."""
        log_event("config_reload_failed", level=logging.ERROR, file=error.file, key=error.key, problem=error.problem)
        return ReloadOutcome(file=error.file, reloaded=False, error=error)

    def _opens_admin(self, new: Config) -> ReloadError | None:
        """A reload that would take the admin token away without ``[admin] allow_unauthenticated = true``."""
        if self.config.admin.token is None or new.admin.token is not None or new.admin.allow_unauthenticated:
            return None
        return ReloadError(file=str(self.config_path), key="admin.token",
                           problem="the file has no token: the reload would open the admin API to anyone who "
                                   "can reach it; set [admin] allow_unauthenticated = true to mean that, or keep "
                                   "the token")

    def _serving_address(self) -> str:
        host, port = parse_listen(self.listen)
        return f"{host}:{self.bound_port if self.bound_port is not None else port}"

    def _loops_back(self, new: Config) -> ReloadError | None:
        """An engine URL in ``new`` that is this router's own serving address (as ``preflight`` refuses)."""
        host, port = parse_listen(self.listen)
        serving = (host, self.bound_port if self.bound_port is not None else port)
        for i, spec in enumerate(new.engines):
            if _same_address(serving, (spec.host, spec.port)):
                return ReloadError(file=str(self.config_path), key=f"engines[{i}].url",
                                   problem=f"{spec.url} is this router's own serving address: requests would "
                                           "loop back into the router")
        return None

    def _apply_config(self, config: Config, attestation_key: bytes | None) -> None:
        """Hand every part that reads a reloadable key the merged config (see ``RELOADABLE_KEYS``).

        The data plane (this process's or each worker's) takes ``[placement]`` and the
        engine timeouts from the next snapshot; the control pool in ``reload``.
        """
        self.config = config
        running = RunningConfig(config=config, attestation_key=attestation_key)
        for part in self._reconfigurable:
            part.configure(running)
        # [placement] kv_events and max_index_mb (a no-op when the data plane's placement already took them).
        self.kv_events.configure(config.placement)

    async def reload_tls(self) -> bool:
        """``_reload_tls_outcome``: True when every part reloaded."""
        return (await self._reload_tls_outcome())[0] == "reloaded"

    async def _reload_tls_outcome(self) -> tuple[Literal["reloaded", "failed", "skipped"], str | None]:
        """Read every certificate and key again and swap them in; connections open stay as they are.

        ``tls_reloaded`` is logged only once every part uses the new files: this
        process's listeners and pools, and each worker process. On a problem
        here the old contexts stay in use and ``tls_reload_failed`` names the
        key; a worker that failed is named with its reason (it keeps its old
        contexts, the other parts use the new ones).
        """
        if not self.tls.configured:
            log_event("tls_reload_skipped", reason="no TLS configured")
            return "skipped", None
        try:
            # Off the event loop, bounded: a FIFO or a huge file at a certificate path never stalls streams.
            await self.tls.reload()
        except ConfigError as exc:
            log_event("tls_reload_failed", level=logging.ERROR, message=str(exc))
            return "failed", str(exc)
        if self.admin_server is not None:
            self.admin_server.ssl_context = self.tls.server
        await self.control_pool.set_ssl_context(self.tls.engine)
        failures = await self.data_plane.reload_tls(self.tls)
        if failures:
            message = "; ".join(f"{part}: {reason}" for part, reason in sorted(failures.items()))
            log_event("tls_reload_failed", level=logging.ERROR, parts=sorted(failures), message=message)
            return "failed", message
        log_event("tls_reloaded", server=self.tls.server is not None, engines=self.tls.engine is not None,
                  workers=self.worker_count)
        self.cert_expiry.check(force=True)
        return "reloaded", None

    def shutdown(self, grace_s: float | None = None) -> None:
        """Stop taking requests; in-flight ones get ``grace_s`` to finish."""
        grace = self.config.serving.shutdown_grace_s if grace_s is None else grace_s
        self.admission.close("shutdown", "shutting down")
        log_event("router_shutdown", grace_s=grace)
        if self.lease is not None:
            # Hand the lease over now: the standby need not wait for it to expire. The lease
            # service finishes the release (bounded) before it returns, so it lands before exit.
            self.lease.begin_shutdown()
        self.data_plane.shutdown(grace)

    async def _serve_admin(self, fd: int, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        # The control app on its own listener, with its own bounds (build_admin_server).
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(socket.socket(fileno=fd)))
        server = self.admin_server = build_admin_server(self.config, functools.partial(call_asgi, self.app),
                                                        self.tls.server)
        try:
            await server.serve_listeners([listener], task_status=task_status)
        finally:
            self.admin_server = None
