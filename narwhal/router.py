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
from narwhal.control.engine_view import EngineViewer
from narwhal.control.monitor import Monitor
from narwhal.control.readmission import Readmitter
from narwhal.control.supervisor import Supervisor
from narwhal.fleet import Fleet
from narwhal.fleet.admission import Admission
from narwhal.fleet.placement import InFlight
from narwhal.fleet.telemetry import Telemetry
from narwhal.http1.asgi import ASGILifespan
from narwhal.http1.server import HTTPServer
from narwhal.obs.logs import flush_logs, log_event
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.pools.control import ControlPool
from narwhal.pools.data import DataPool
from narwhal.serving.front import Front
from narwhal.serving.request_core import RequestCore
from narwhal.stages import build_stages
from narwhal.stages.persistence import PersistenceStage
from narwhal.state.resume import apply_resume, plan_resume

__all__ = ["Router"]


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
        controller = config.controller
        self.monitor = Monitor(self.stages.in_spec_order(), interval_s=controller.monitor_interval_s,
                               stage_timeout_s=controller.stage_timeout_s,
                               failure_limit=controller.monitor_failure_limit,
                               admission=self.admission, metrics=self.metrics)
        self.engine_view = EngineViewer(config=config, fleet=self.fleet, in_flight=self.in_flight,
                                        readmitter=self.readmitter, controller=self.controller, monitor=self.monitor)
        self.app = create_app(self)
        register_admin_routes(self.app, self)
        serving = config.serving
        self.front = Front(self.core, self.app)
        self.server = HTTPServer(self.front.handle, max_header_bytes=serving.max_header_bytes,
                                 max_body_bytes=serving.max_body_bytes, idle_timeout_s=serving.idle_timeout_s)
        self.bound_port: int | None = None
        self._nursery: trio.Nursery | None = None
        self._register_gauges()

    # -- state views -----------------------------------------------------------------

    def readiness(self) -> str | None:
        """None when this router should get traffic, else the one-line reason."""
        reason = self.admission.reason()
        if reason is not None:
            return reason
        return self.supervisor.capacity_problem()

    def _handoff_extra(self) -> dict[str, Any]:
        return {"consolidation_risk": self.controller.consolidation_risk(), "drained": sorted(self.drain.drained)}

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
