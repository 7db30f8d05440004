"""The data plane: the front, the request core and the data pool that serve the two completion routes.

``LocalDataPlane`` builds them from the config; it is the one place that does,
whether the router serves in its own process or each worker process serves
its share (``narwhal/workers/worker.py``). The router drives either shape
through ``DataPlane``: this process's ``LocalDataPlane``, or the worker
processes' ``WorkerDataPlane`` (``narwhal/workers/plane.py``). What differs
between them is only what the request core reads and reports to (its
supervisor, admission and telemetry) and where the other routes go.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec
import trio

from narwhal.auth.client_auth import AuthSettings, ClientAuth
from narwhal.config import Config, EngineConfig, PlacementConfig, TracingConfig
from narwhal.fleet.placement import InFlight, InFlightCounts
from narwhal.http1.server import Request, Responder
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.pools.data import DataPool
from narwhal.serving.front import Front, admin_url, build_front_server
from narwhal.serving.placement import RequestPlacement
from narwhal.serving.request_core import AdmissionGate, RequestCore, Supervisor, TelemetrySink
from narwhal.tls import TLSContexts
from narwhal.tracing.service import TracingService

__all__ = ["DataPlane", "DataPoolUsage", "EngineInFlight", "LocalDataPlane"]

Handler = Callable[[Request, Responder], Awaitable[None]]


class DataPoolUsage(msgspec.Struct, frozen=True, kw_only=True):
    """Data connections in use, requests waiting for one, and the bound: over every data pool."""

    in_use: int
    waiting: int
    capacity: int


class EngineInFlight(InFlightCounts, Protocol):
    """The data plane's in-flight counts, which follow the engine set."""

    def forget(self, name: str) -> None:
        """``name`` left the fleet: drop its entry (once its last request in flight has ended)."""
        ...


class DataPlane(Protocol):
    """The data plane as the router drives it, in this process or in worker processes."""

    @property
    def in_flight(self) -> EngineInFlight:
        """Requests in flight per engine, for drains, readmission and the admin views."""
        ...

    async def run(self, listeners: list[trio.SocketListener], *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Serve on ``listeners`` (bound by the router); ``started(port)``; return once drained by ``shutdown``."""
        ...

    def shutdown(self, grace_s: float) -> None:
        """Stop accepting; requests in flight get ``grace_s`` to finish."""
        ...

    async def reload_tls(self, tls: TLSContexts) -> dict[str, str]:
        """Use the contexts just reloaded into ``tls``; the parts that could not, each with why (empty: all did)."""
        ...

    def pool_usage(self) -> DataPoolUsage:
        """The data pools' occupancy, summed when there are several."""
        ...


# At shutdown, the spans still queued get this long to reach the collector.
_TRACE_FLUSH_S = 2.0


class LocalDataPlane:
    """The data plane of this process: data pool, request core, front and its HTTP/1.1 server."""

    def __init__(self, config: Config, *, tls: TLSContexts, via_token: str, supervisor: Supervisor,
                 admission: AdmissionGate, metrics: RouterMetrics, telemetry: TelemetrySink,
                 serve_rest: Handler, yield_at_cap: bool = False,
                 placement: RequestPlacement | None = None, auth: AuthSettings | None = None) -> None:
        """``serve_rest`` answers every route but the completions (the control app, or a worker's forwarder).

        ``yield_at_cap``: a worker process at its connection cap leaves new connections to its siblings.
        ``placement`` chooses engines over a prefix index the caller owns (a new one when None).
        """
        self.in_flight = InFlight([spec.name for spec in config.engines])
        # Only bounded serving may queue; the default policy reports saturation at once.
        self.data_pool = DataPool(max_connections=config.serving.max_connections, engine_config=config.engine,
                                  wait_for_slot=config.serving.policy == "bounded", via=f"1.1 {via_token}",
                                  ssl_context=tls.engine, relay_inline=config.serving.relay_inline)
        # Client keys, limits and the priority gate, when [auth] names a keys file (the snapshot brings them).
        self._capacity = config.serving.max_connections
        self._bounded = config.serving.policy == "bounded"
        # Traces ([tracing]): this process's tracer and exporter; the core holds None while tracing is off.
        self.tracing = TracingService(config.tracing, metrics.trace_spans_dropped)
        self.core = RequestCore(config=config, supervisor=supervisor, data_pool=self.data_pool,
                                in_flight=self.in_flight, admission=admission, metrics=metrics, telemetry=telemetry,
                                placement=placement, auth=self._client_auth(auth), tracer=self.tracing.tracer)
        # With [admin] listen the admin API is off the traffic port entirely.
        self.front = Front(self.core, serve_rest, via_token=via_token,
                           admin_elsewhere=admin_url(config))
        self.server = build_front_server(config, self.front, tls.server, yield_at_cap=yield_at_cap)

    async def run(self, listeners: list[trio.SocketListener], *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Serve on ``listeners`` until ``shutdown`` has drained the server; ``started(port)`` once accepting."""
        bound_port = listeners[0].socket.getsockname()[1]
        if self.core.clock is trio.current_time:
            # Read at its source once trio runs (trio.current_time is three calls deep, a few a request): the same time.
            self.core.clock = trio.lowlevel.current_clock().current_time
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.data_pool.run)
                # Exporting runs beside the server, off the request path, until the server has drained.
                await nursery.start(self.tracing.run)
                await self.server.serve_listeners(listeners, task_status=_Reported(task_status, bound_port))
                # Drained: the last requests' spans go out (bounded), then the exporter stops with the pool.
                await self.tracing.flush(_TRACE_FLUSH_S)
                nursery.cancel_scope.cancel()
        finally:
            # Close engine sockets even when cancelled: leaked connections outlive the process.
            with trio.CancelScope(shield=True):
                await self.data_pool.aclose()

    def shutdown(self, grace_s: float) -> None:
        """Stop accepting; requests in flight get ``grace_s`` to finish."""
        self.server.shutdown(grace_s)

    def _client_auth(self, settings: AuthSettings | None) -> ClientAuth | None:
        if settings is None or settings.keys is None:
            return None
        return ClientAuth(settings, capacity=self._capacity, bounded=self._bounded)

    def configure_auth(self, settings: AuthSettings | None) -> None:
        """The keys file was read again (or the router's share changed): new requests see it at once."""
        core = self.core
        if settings is None or settings.keys is None:
            core.auth = None
        elif core.auth is None:
            core.auth = self._client_auth(settings)
        else:
            core.auth.configure(settings)

    def configure_tracing(self, tracing: TracingConfig) -> None:
        """A reload changed [tracing]: new requests are traced (or not) by it, the next export goes by it."""
        self.tracing.configure(tracing)
        self.core.tracer = self.tracing.tracer

    def configure(self, placement: PlacementConfig, engine_config: EngineConfig) -> None:
        """A config reload (through the snapshot): placement and the engine timeouts of new calls follow it."""
        self.core.placement.configure(placement)
        self.data_pool.set_timeouts(engine_config)

    def use_tls(self, tls: TLSContexts) -> None:
        """New connections (client and engine side) use ``tls``'s contexts; open ones keep theirs."""
        self.server.ssl_context = tls.server
        self.data_pool.set_ssl_context(tls.engine)

    async def reload_tls(self, tls: TLSContexts) -> dict[str, str]:
        """As ``use_tls``: one process swaps its contexts by assignment, which cannot fail."""
        self.use_tls(tls)
        return {}

    def pool_usage(self) -> DataPoolUsage:
        """This process's data pool."""
        stats = self.data_pool.statistics()
        return DataPoolUsage(in_use=stats.in_use, waiting=stats.waiting, capacity=stats.max_connections)


class _Reported:
    """Passes ``started(value)`` on to ``task_status`` as ``started(report)``: the port, not the listeners."""

    def __init__(self, task_status: Any, report: Any) -> None:
        self._task_status = task_status
        self._report = report

    def started(self, value: Any = None) -> None:
        self._task_status.started(self._report)
