"""The router process: builds every part from the config and runs them under one nursery.

Ownership: ``Router.run`` opens the nursery that owns the supervisor (probes),
the monitor, the optional hypercorn admin listener and the data-plane server.
``shutdown`` closes admission, stops accepting, lets in-flight requests finish
within the grace period, then cancels the rest.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

import trio

from narwhal.app.admin_routes import register_admin_routes
from narwhal.app.control_app import create_app
from narwhal.config import Config, parse_listen
from narwhal.control.monitor import Monitor
from narwhal.control.readmission import Readmitter
from narwhal.control.supervisor import Supervisor
from narwhal.fleet import Fleet
from narwhal.fleet.admission import Admission
from narwhal.fleet.placement import InFlight
from narwhal.fleet.telemetry import Telemetry
from narwhal.http1.asgi import ASGILifespan, call_asgi
from narwhal.http1.server import HTTPServer, Request, Responder
from narwhal.lease import EtcdLeaseBackend, build_backend
from narwhal.lease.service import LeaseService
from narwhal.obs.logs import flush_logs, log_event
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.pools.control import ControlPool
from narwhal.pools.data import DataPool
from narwhal.serving.request_core import COMPLETION_ROUTES, RequestCore
from narwhal.stages import build_stages
from narwhal.stages.persistence import PersistenceStage
from narwhal.state.resume import apply_resume, plan_resume
from narwhal.wire import error_json

__all__ = ["Router"]


def _advertise_url(host: str, port: int) -> str:
    """Where a standby reaches this router's /ready when lease.advertise_url is not set."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

_NOT_ALLOWED = error_json("completion routes accept POST only", "invalid_request_error", "method_not_allowed")


class Router:
    """One Narwhal router: data plane, control app and control plane over one fleet."""

    def __init__(self, config: Config, *, listen: str | None = None, resume: bool = False,
                 config_dir: Path | None = None) -> None:
        self.config = config
        self.listen = listen or config.serving.listen
        self.resume = resume
        self.router_id = config.lease.router_id or f"{socket.gethostname()}-{os.getpid()}"
        self.metrics = RouterMetrics()
        self.admission = Admission()
        names = [spec.name for spec in config.engines]
        self.in_flight = InFlight(names)
        recovery = config.recovery
        self.fleet = Fleet(
            [(spec.name, spec.role) for spec in config.engines],
            eject_after=recovery.eject_after,
            liveness_misses=recovery.liveness_misses,
            failure_quarantine_s=recovery.failure_quarantine_s,
            probe_interval_s=recovery.probe_interval_s,
        )
        # Only bounded serving may queue; the default policy reports saturation at once.
        self.data_pool = DataPool(max_connections=config.serving.max_connections, engine_config=config.engine,
                                  wait_for_slot=config.serving.policy == "bounded")
        self.control_pool = ControlPool(control_connections=config.engine.control_connections,
                                        engine_config=config.engine)
        self.supervisor = Supervisor(config=config, fleet=self.fleet, control_pool=self.control_pool,
                                     metrics=self.metrics)
        roles = [(spec.name, spec.role) for spec in config.engines]
        self.telemetry = Telemetry(roles, clock=trio.current_time, interval_s=config.telemetry.interval_s,
                                   keep_intervals=config.telemetry.keep_intervals)
        self.core = RequestCore(config=config, supervisor=self.supervisor, data_pool=self.data_pool,
                                in_flight=self.in_flight, admission=self.admission, metrics=self.metrics,
                                telemetry=self.telemetry)
        self.persistence = PersistenceStage(path=config.handoff.path, router_id=self.router_id,
                                            fleet=self.fleet, config=config)
        self.readmitter = Readmitter(config=config, fleet=self.fleet, control_pool=self.control_pool,
                                     in_flight=self.in_flight, metrics=self.metrics,
                                     attestation_key=config.attestation_key_bytes(config_dir),
                                     inference_check=self.supervisor.inference_probe)
        self.stages = build_stages(config=config, supervisor=self.supervisor, control_pool=self.control_pool,
                                   telemetry=self.telemetry, in_flight=self.in_flight,
                                   persistence_stage=self.persistence, readmission=self.readmitter)
        self.controller = self.stages.controller
        self.drain = self.stages.drain
        self.persistence.extra = self._handoff_extra
        backend = build_backend(config)
        # With a lease backend every router starts as a standby (the service closes admission).
        self.lease: LeaseService | None = None
        if backend is not None:
            self.lease = LeaseService(config=config, router_id=self.router_id, backend=backend,
                                      admission=self.admission, persistence=self.persistence, fleet=self.fleet,
                                      metrics=self.metrics, own_readiness=self.own_readiness)
            if isinstance(backend, EtcdLeaseBackend):
                etcd = backend

                async def publish(data: bytes) -> bool:
                    lease = self.lease
                    record = lease.record if lease is not None else None
                    if lease is None or record is None or not lease.valid_threadsafe():
                        return False
                    return await etcd.write_handoff(data, record)

                self.persistence.publish = publish
        controller = config.controller
        self.monitor = Monitor(self.stages.in_spec_order(), interval_s=controller.monitor_interval_s,
                               stage_timeout_s=controller.stage_timeout_s,
                               failure_limit=controller.monitor_failure_limit,
                               admission=self.admission, metrics=self.metrics)
        self.app = create_app(self)
        register_admin_routes(self.app, self)
        serving = config.serving
        self.server = HTTPServer(self.handle, max_header_bytes=serving.max_header_bytes,
                                 max_body_bytes=serving.max_body_bytes, idle_timeout_s=serving.idle_timeout_s)
        self.bound_port: int | None = None
        self._nursery: trio.Nursery | None = None
        self._register_gauges()

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

    def lease_view(self) -> dict[str, Any]:
        """What /admin/lease shows: the lease record and this router's role."""
        if self.lease is None:
            return {"router_id": self.router_id, "backend": "none", "role": "active", "record": None}
        return self.lease.view()

    def _handoff_extra(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"consolidation_risk": self.controller.consolidation_risk(),
                                 "drained": sorted(self.drain.drained)}
        if self.lease is not None:
            extra["lease"] = self.lease.ownership()
        return extra

    def engines_view(self) -> dict[str, Any]:
        now = trio.current_time()
        engines = []
        for view in self.fleet.views(now):
            spec = self.config.engine_spec(view.name)
            engines.append({
                "name": view.name,
                "role": view.role,
                "url": spec.url,
                "eligible": view.eligible,
                "ejected": view.ejected,
                "ejected_reason": view.ejected_reason,
                "holds": [{"kind": str(hold.kind), "reason": hold.reason, "since": hold.since,
                           "deadline": hold.deadline, "deferred": hold.deferred} for hold in view.holds],
                "evidence": {str(k): v for k, v in view.evidence.items()},
                "liveness_misses": view.liveness_misses,
                "in_flight": self.in_flight[view.name],
                "next_probe_at": view.next_probe_at,
                "counters": {"ejections": view.counters.ejections, "probes": dict(view.counters.probes),
                             "failures": {str(k): v for k, v in view.counters.failures.items()}},
            })
            engines[-1].update(self.readmitter.engine_extras(view.name))
        return {"engines": engines, "consolidation_risk": self.controller.consolidation_risk(),
                "monitor": {"failure_streak": self.monitor.failure_streak,
                            "degraded": self.monitor.degraded_reason, "passes": self.monitor.passes}}

    def _register_gauges(self) -> None:
        m = self.metrics
        m.add_gauge("narwhal_requests_in_flight", "Requests in flight per engine.", ("engine",),
                    lambda: {(name,): float(n) for name, n in self.in_flight.counts.items()})

        def pools() -> dict[tuple[str, ...], float]:
            data = self.data_pool.statistics()
            control = self.control_pool.statistics()
            return {("data", "in_use"): float(data.in_use), ("data", "capacity"): float(data.max_connections),
                    ("data", "waiting"): float(data.waiting),
                    ("control", "in_use"): float(control.in_use),
                    ("control", "capacity"): float(control.control_connections)}

        m.add_gauge("narwhal_pool_connections", "Connection pool occupancy.", ("pool", "state"), pools)

        def eligibility() -> dict[tuple[str, ...], float]:
            now = trio.current_time()
            return {(v.name, v.role): float(v.eligible) for v in self.fleet.views(now)}

        m.add_gauge("narwhal_engine_eligible", "1 when the engine may take new requests.",
                    ("engine", "role"), eligibility)
        m.add_gauge("narwhal_ready", "1 when /ready answers 200.", (),
                    lambda: {(): float(self.readiness() is None)})

    # -- the front ---------------------------------------------------------------------

    async def handle(self, request: Request, responder: Responder) -> None:
        """The data-plane front: completion routes to the core, the rest to the app."""
        if request.path in COMPLETION_ROUTES:
            if request.method == b"POST":
                await self.core.handle(request.path, request.body, request.get_header(b"x-request-id"),
                                       responder)
            else:
                await responder.respond(405, [(b"content-type", b"application/json"), (b"allow", b"POST")],
                                        _NOT_ALLOWED)
            return
        await call_asgi(self.app, request, responder)

    # -- lifetime ----------------------------------------------------------------------

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until ``shutdown`` completes; ``task_status.started(port)`` once listening."""
        host, port = parse_listen(self.listen)
        try:
            async with ASGILifespan(self.app), trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._flush_logs_periodically)
                await nursery.start(self.supervisor.run)
                if self.resume:
                    self._resume()
                await nursery.start(self.readmitter.run)
                await nursery.start(self.monitor.run)
                if self.config.admin.listen:
                    await nursery.start(self._serve_admin, self.config.admin.listen)
                self.bound_port = await nursery.start(self._serve_then_stop, nursery, host, port)
                if self.lease is not None:
                    if not self.lease.advertise_url:
                        self.lease.advertise_url = _advertise_url(host, self.bound_port)
                    await nursery.start(self.lease.run)
                log_event("router_started", router_id=self.router_id, listen=f"{host}:{self.bound_port}",
                          engines=len(self.config.engines), pid=os.getpid())
                task_status.started(self.bound_port)
        finally:
            # Close sockets even when cancelled: leaked engine connections outlive the router.
            with trio.CancelScope(shield=True):
                await self.data_pool.aclose()
                await self.control_pool.aclose()
            log_event("router_stopped", router_id=self.router_id)
            flush_logs()

    async def _flush_logs_periodically(self) -> None:
        # Log lines are batched for the hot path; none waits more than about 100 ms.
        while True:
            await trio.sleep(0.1)
            flush_logs(only_if_due=True)

    def _resume(self) -> None:
        """Apply the saved handoff when its schema and engine set match; say plainly when not."""
        plan = plan_resume(self.config.handoff.path, self.config)
        if plan.applied:
            apply_resume(plan, self.fleet, trio.current_time(), time.time())
            log_event("handoff_applied", **plan.event_fields())
        else:
            log_event("handoff_not_applied", **plan.event_fields())

    async def _serve_then_stop(self, nursery: trio.Nursery, host: str, port: int, *,
                               task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        # The server returns once shutdown has drained it; everything else stops with it.
        await self.server.serve(host, port, task_status=task_status)
        nursery.cancel_scope.cancel()

    def shutdown(self, grace_s: float | None = None) -> None:
        """Stop taking requests; in-flight ones get ``grace_s`` to finish."""
        grace = self.config.serving.shutdown_grace_s if grace_s is None else grace_s
        self.admission.close("shutdown", "shutting down")
        log_event("router_shutdown", grace_s=grace)
        if self.lease is not None and self._nursery is not None:
            # Hand the lease over now: the standby need not wait for it to expire.
            self._nursery.start_soon(self.lease.release_for_shutdown)
        self.server.shutdown(grace)

    async def _serve_admin(self, admin_listen: str, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        from hypercorn.config import Config as HypercornConfig
        from hypercorn.trio import serve

        hconfig = HypercornConfig()
        hconfig.bind = [admin_listen]
        hconfig.accesslog = None
        hconfig.errorlog = None
        task_status.started()
        await serve(self.app, hconfig, mode="asgi")
