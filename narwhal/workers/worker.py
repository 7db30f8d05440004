"""One data-plane worker process: the front and the data pool, serving from the controller's snapshots.

It accepts on the listening socket it inherited from the controller, serves
the two completion routes itself, answers ``/health`` and ``/ready`` from its
snapshot, and forwards every other route to the controller. It exits when
told to stop, or by itself when the controller goes away: a worker without a
controller would place requests on a fleet nobody watches.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import trio

from narwhal.config import ConfigError, EngineConfig, EngineSpec, PlacementConfig
from narwhal.fleet.placement import SharedIndex
from narwhal.http1.server import Request, Responder
from narwhal.kv_events.service import KvEvents
from narwhal.model_ready import query_model, ready_answer
from narwhal.obs.logs import flush_logs, log_event, set_log_fields
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.serving.data_plane import LocalDataPlane
from narwhal.serving.placement import RequestPlacement, build_index, build_placer
from narwhal.tls import TLSContexts
from narwhal.wire import error_json
from narwhal.workers.link import LinkClosed, StreamLink
from narwhal.workers.metrics_sum import export_state
from narwhal.workers.protocol import (
    FORWARD_TIMEOUT_S,
    ControllerMessage,
    Evidence,
    Forward,
    ForwardReply,
    Hello,
    IndexUpdate,
    ReloadTLS,
    Report,
    Snapshot,
    Stop,
    TLSReloaded,
    Welcome,
)
from narwhal.workers.view import TelemetryRelay, WorkerView

__all__ = ["run_worker"]

# How often a worker reports in-flight counts, metrics and telemetry; at most
# this late, a drain settles or /metrics shows a finished request.
REPORT_INTERVAL_S = 0.1
# A worker that hears nothing of its controller this long after starting gives up.
WELCOME_TIMEOUT_S = 30.0
_JSON = [(b"content-type", b"application/json")]
_TEXT = [(b"content-type", b"text/plain; charset=utf-8")]
_CONTROLLER_GONE = error_json("the router's controller is not answering", "server_error", "controller_unavailable")


class Worker:
    """The parts of one worker, built once the controller's ``Welcome`` arrived."""

    def __init__(self, index: int, welcome: Welcome, link: StreamLink) -> None:
        config = welcome.config
        self.index = index
        self.config = config
        self.link = link
        self.view = WorkerView(self._send, on_engines=self._engines_changed, on_settings=self._settings_changed,
                               on_fleet=lambda fleet: self.plane.core.set_fleet(fleet),
                               on_auth=lambda settings: self.plane.configure_auth(settings),
                               on_tracing=lambda tracing: self.plane.configure_tracing(tracing))
        self.metrics = RouterMetrics()
        self.telemetry = TelemetryRelay()
        # The controller read these files a moment ago; a worker reads its own copies.
        self.tls = TLSContexts(config, None if welcome.config_dir is None else Path(welcome.config_dir))
        # This worker's prefix index; its placements go to the others through the controller.
        self.prefix_index = SharedIndex(build_index(config))
        # This worker's own subscriptions to the prefill engines' KV events (the controller says where).
        self.kv_events = KvEvents(config.placement, [spec.name for spec in config.engines if spec.role == "prefill"])
        placement = RequestPlacement(config, self.metrics, build_placer(
            config, self.prefix_index.index, on_record=self.prefix_index.recorded), kv=self.kv_events)
        self.plane = LocalDataPlane(config, tls=self.tls, via_token=welcome.via_token, supervisor=self.view,
                                    admission=self.view, metrics=self.metrics, telemetry=self.telemetry,
                                    serve_rest=self._serve_rest,
                                    # Siblings share the listening socket: at its cap this one leaves
                                    # connections to them.
                                    yield_at_cap=True, placement=placement)
        self._reported_in_flight: dict[str, int] = {}
        self._forward_ids = itertools.count(1)
        self._forwards: dict[int, tuple[trio.Event, list[ForwardReply]]] = {}
        self._stopping = False
        # Evidence lost because the controller link closed (said on the first, counted on worker_stopped).
        self.evidence_dropped = 0

    def _engines_changed(self, specs: list[EngineSpec]) -> None:
        """A snapshot changed the engine set: the request core places on it, the prefix index follows it."""
        self.plane.core.set_engines(specs)
        prefill = [spec.name for spec in specs if spec.role == "prefill"]
        self.prefix_index.index.set_engines(prefill)
        self.kv_events.set_engines(prefill)

    def _settings_changed(self, placement: PlacementConfig, engine: EngineConfig) -> None:
        """A snapshot changed the reloadable settings: the data plane takes them."""
        self.plane.configure(placement, engine)

    def _send(self, message: Any) -> None:
        # Evidence and answers to the controller.
        try:
            self.link.send(message)
        except LinkClosed:
            if not isinstance(message, Evidence):
                return  # an answer nobody waits for any more
            # The controller is gone (the worker is closing admission): the evidence cannot
            # count toward any ejection. Say so once, count every one.
            self.evidence_dropped += 1
            if self.evidence_dropped == 1:
                log_event("worker_evidence_dropped", level=logging.WARNING, engine=message.engine,
                          reason=f"controller link closed: {self.link.close_reason}")

    # -- messages from the controller -------------------------------------------------------

    def on_message(self, message: object) -> None:
        if isinstance(message, Snapshot):
            self.view.apply(message)
            if message.kv_sources != self.kv_events.sources:
                self.kv_events.set_sources(message.kv_sources)
            self.plane.in_flight.elsewhere = others_in_flight(message.in_flight, self._reported_in_flight)
            if message.published_at is not None:
                self.metrics.snapshot_lag.observe(max(0.0, time.monotonic() - message.published_at))
        elif isinstance(message, IndexUpdate):
            self.prefix_index.sync(message.epochs)
            self.prefix_index.apply(message.records)
        elif isinstance(message, ForwardReply):
            waiter = self._forwards.get(message.id)
            if waiter is not None:
                waiter[1].append(message)
                waiter[0].set()
        elif isinstance(message, Stop):
            self.stop("shutting down", message.grace_s)
        elif isinstance(message, ReloadTLS):
            self.reload_tls(message.id)

    def reload_tls(self, round_id: int) -> None:
        """Read certificates and keys again and tell the controller (which logs ``tls_reloaded`` once all did).

        On a problem the old ones stay in use.
        """
        try:
            self.tls.reload_blocking()
        except ConfigError as exc:
            log_event("tls_reload_failed", level=logging.ERROR, message=str(exc))
            self._send(TLSReloaded(id=round_id, error=str(exc)))
            return
        self.plane.use_tls(self.tls)
        self._send(TLSReloaded(id=round_id))

    def stop(self, reason: str, grace_s: float) -> None:
        """Refuse new requests, let those in flight finish within ``grace_s``."""
        self.view.close_locally(reason)
        if not self._stopping:
            self._stopping = True
            log_event("worker_stopping", reason=reason, grace_s=grace_s)
        self.plane.shutdown(grace_s)

    # -- the front ----------------------------------------------------------------------------

    async def _serve_rest(self, request: Request, responder: Responder) -> None:
        # /health and /ready from the snapshot (the text the controller would give); the rest from the controller.
        if request.method in (b"GET", b"HEAD"):
            if request.path == "/health":
                await responder.respond(200, _JSON, b'{"status":"ok"}')
                return
            if request.path == "/ready":
                view = self.view
                answer = ready_answer(query_model(request.query.decode("latin-1")), refusal=view.reason(),
                                      capacity_problem=view.capacity_problem(),
                                      capacity_problems=view.capacity_problems(), served=self.plane.core.models)
                await responder.respond(answer.status, [(b"content-type", answer.content_type.encode())],
                                        answer.body)
                return
        await self._forward(request, responder)

    async def _forward(self, request: Request, responder: Responder) -> None:
        forward_id = next(self._forward_ids)
        waiter: tuple[trio.Event, list[ForwardReply]] = (trio.Event(), [])
        self._forwards[forward_id] = waiter
        try:
            self.link.send(Forward(id=forward_id, method=request.method, target=request.target,
                                   headers=request.headers, body=request.body, client=request.client,
                                   secure=responder.secure, http_version=request.http_version,
                                   peer_cert=responder.secure and responder.peer_certified))
            with trio.move_on_after(FORWARD_TIMEOUT_S):
                await waiter[0].wait()
        except LinkClosed:
            pass
        finally:
            del self._forwards[forward_id]
        if not waiter[1]:
            await responder.respond(503, _JSON, _CONTROLLER_GONE)
            return
        reply = waiter[1][0]
        await responder.respond(reply.status, reply.headers, reply.body)

    # -- reports --------------------------------------------------------------------------------

    async def report_loop(self) -> None:
        """Send in-flight counts, metrics and samples; often while busy, once a second when idle."""
        last_requests = -1.0
        quiet = 0
        while True:
            await trio.sleep(REPORT_INTERVAL_S)
            requests = sum(self.metrics.requests.values.values())
            # A count that fell to zero after the last report is news too (with nothing in flight now, the
            # last report differs from now when it counted anything): without it the other workers and the
            # controller would keep counting that request for up to a second.
            busy = self.plane.in_flight.total() > 0 or requests != last_requests or bool(self._reported_in_flight)
            quiet = 0 if busy else quiet + 1
            if not busy and quiet % 10:
                continue
            last_requests = requests
            if self.telemetry.dropped:
                log_event("worker_samples_dropped", level=logging.WARNING, dropped=self.telemetry.dropped,
                          reason="telemetry samples over the bound between two reports")
                self.telemetry.dropped = 0
            try:
                self.send_report()
            except LinkClosed:
                return
            flush_logs(only_if_due=True)

    def send_report(self) -> None:
        """One report of in-flight counts, metrics and samples; remembers the counts it sent."""
        pool = self.plane.data_pool.statistics()
        self._reported_in_flight = {name: n for name, n in self.plane.in_flight.counts.items() if n}
        self.link.send(Report(snapshot_seq=self.view.snapshot.seq, in_flight=self._reported_in_flight,
                              requests_in_flight=self.plane.server.statistics().requests_in_flight,
                              metrics=export_state(self.metrics.registry), samples=self.telemetry.take(),
                              data_in_use=pool.in_use, data_waiting=pool.waiting,
                              placements=self.prefix_index.take()))


def others_in_flight(totals: dict[str, int], own_reported: dict[str, int]) -> dict[str, int]:
    """The other workers' share: the router-wide totals less what this worker itself reported.

    The totals already include this worker's last report; counting it again
    would make its own engines look busier than they are.
    """
    return {name: total - own_reported.get(name, 0) for name, total in totals.items()
            if total > own_reported.get(name, 0)}


async def _stop_on_signal(current: Any) -> None:
    # Ctrl-C reaches the whole process group: a worker drains like its controller, never dies mid-stream.
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            worker = current()
            log_event("signal", signal=signal.Signals(signum).name)
            if worker is not None:
                worker.stop("shutting down", worker.config.serving.shutdown_grace_s)


async def run_worker(index: int, control_fd: int, listen_fds: list[int]) -> None:
    """Serve as worker ``index`` until stopped or orphaned."""
    set_log_fields(worker=index)
    # SIGHUP to the process group (a closing terminal, kill -HUP -- -PGID) must not cut the streams:
    # the controller reloads on SIGHUP and tells the workers what to do.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    control = trio.SocketStream(trio.socket.from_stdlib_socket(socket.socket(fileno=control_fd)))
    listeners = [trio.SocketListener(trio.socket.from_stdlib_socket(socket.socket(fileno=fd))) for fd in listen_fds]
    welcome: list[Welcome] = []
    welcomed = trio.Event()
    worker: Worker | None = None
    link = StreamLink(control, ControllerMessage)

    early: list[object] = []

    def on_message(message: object) -> None:
        if worker is not None:
            worker.on_message(message)
        elif isinstance(message, Welcome):
            welcome.append(message)
            welcomed.set()
        else:
            # The first snapshot follows the welcome at once, before the worker is built.
            early.append(message)

    async with trio.open_nursery() as nursery:

        async def control_link() -> None:
            await link.run(on_message)
            # The controller is gone: stop taking requests and leave within the grace period.
            log_event("worker_orphaned", level=logging.WARNING, reason=link.close_reason)
            if worker is None:
                nursery.cancel_scope.cancel()
            else:
                worker.stop("controller gone", worker.config.serving.shutdown_grace_s)

        nursery.start_soon(control_link)
        nursery.start_soon(_stop_on_signal, lambda: worker)
        link.send(Hello(worker=index, pid=os.getpid()))
        with trio.move_on_after(WELCOME_TIMEOUT_S):
            await welcomed.wait()
        if not welcome:
            log_event("worker_failed", level=logging.ERROR, reason="no welcome from the controller")
            nursery.cancel_scope.cancel()
            return
        try:
            worker = Worker(index, welcome[0], link)
        except ConfigError as exc:
            # A certificate that changed under the controller: exit, and the controller retries with backoff.
            log_event("worker_failed", level=logging.ERROR, reason=str(exc))
            nursery.cancel_scope.cancel()
            return
        for message in early:
            worker.on_message(message)
        early.clear()
        nursery.start_soon(worker.report_loop)
        await nursery.start(worker.kv_events.run)
        try:
            await worker.plane.run(listeners)
        finally:
            with trio.CancelScope(shield=True):
                # A last report, so the controller counts what this worker finished.
                try:
                    link.send(Report(snapshot_seq=worker.view.snapshot.seq, in_flight={}, requests_in_flight=0,
                                     metrics=export_state(worker.metrics.registry), samples=worker.telemetry.take()))
                    with trio.move_on_after(1.0):
                        await link.flush()
                except LinkClosed:
                    pass
            log_event("worker_stopped", evidence_dropped=worker.evidence_dropped)
            flush_logs()
            nursery.cancel_scope.cancel()
