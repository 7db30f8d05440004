"""The controller's worker processes: start them, keep them running, stop them gracefully.

The router binds the serving socket once and every worker inherits it, so
the kernel spreads new connections over the workers that wait in accept(), a
port of 0 works, and "address in use" is reported once, by the controller.
Each worker gets one end of a socket pair as its control link.

A worker that exits is logged (``worker_exited``) and started again
(``worker_started``) after a backoff that doubles up to ``_MAX_BACKOFF_S`` and
resets once a worker has stayed up for ``_STABLE_S``. Its streams in flight end
with it; the others continue.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import trio

from narwhal.config import Config
from narwhal.http1.asgi import ASGIApp, call_asgi
from narwhal.http1.server import Request
from narwhal.http1.target import InvalidTarget
from narwhal.obs.logs import log_event
from narwhal.serving.front import admin_elsewhere_body, admin_url, is_admin_path
from narwhal.wire import error_json
from narwhal.workers.hub import WorkerHub
from narwhal.workers.link import LinkClosed, StreamLink
from narwhal.workers.protocol import (
    CONTROL_APP_TIMEOUT_S,
    Forward,
    ForwardReply,
    Hello,
    ReloadTLS,
    Stop,
    TLSReloaded,
    Welcome,
    WorkerMessage,
)

__all__ = ["WorkerSet"]

_FIRST_BACKOFF_S = 0.1
_MAX_BACKOFF_S = 5.0
_STABLE_S = 30.0
# A forwarded control-app answer larger than this is a bug of ours, not something to relay.
_MAX_FORWARD_BODY = 32 * 1024 * 1024
# Extra time, beyond the grace period, that a stopping worker gets before it is killed.
_KILL_MARGIN_S = 5.0
# How long a TLS reload waits for every worker's answer; a worker that has not answered by then failed it.
TLS_RELOAD_TIMEOUT_S = 10.0


_JSON = ((b"content-type", b"application/json"),)


class _CollectingResponder:
    """A responder for the control app's answer to a forwarded request: gathers it whole."""

    def __init__(self, secure: bool, peer_certified: bool = False) -> None:
        self.secure = secure
        self.peer_certified = peer_certified
        self.started = False
        self.finished = False
        self.client_disconnected = False
        self.status = 500
        self.headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []
        self._size = 0

    def _take(self, data: bytes) -> None:
        self._size += len(data)
        if self._size > _MAX_FORWARD_BODY:
            raise RuntimeError(f"forwarded response over {_MAX_FORWARD_BODY} bytes")
        self._body.append(data)

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.started = self.finished = True
        self.status, self.headers = status, headers
        self._take(body)

    async def start_stream(self, status: int, headers: list[tuple[bytes, bytes]], first: bytes = b"") -> None:
        self.started = True
        self.status, self.headers = status, headers
        self._take(first)

    async def write(self, data: bytes) -> None:
        self._take(data)

    async def end_stream(self, last: bytes = b"") -> None:
        self.finished = True
        self._take(last)

    @property
    def body(self) -> bytes:
        return b"".join(self._body)


class _TLSRound:
    """One ``ReloadTLS`` sent to the running workers, and their answers as they come."""

    def __init__(self, round_id: int, expected: set[int]) -> None:
        self.id = round_id
        self.waiting = set(expected)
        self.failures: dict[int, str] = {}
        self.done = trio.Event()

    def answer(self, worker: int, error: str | None) -> None:
        if worker not in self.waiting:
            return
        self.waiting.discard(worker)
        if error is not None:
            self.failures[worker] = error
        if not self.waiting:
            self.done.set()


class WorkerSet:
    """N worker processes on one inherited listening socket, supervised by the controller."""

    def __init__(self, *, count: int, config: Config, config_dir: Path | None, hub: WorkerHub, app: ASGIApp,
                 via_token: str, python: str = sys.executable) -> None:
        self.count = count
        self.config = config
        self.config_dir = None if config_dir is None else str(config_dir.resolve())
        self.hub = hub
        self.app = app
        self.via_token = via_token
        self.python = python
        self.pids: dict[int, int] = {}
        self.restarts: dict[int, int] = {i: 0 for i in range(count)}
        self._links: dict[int, StreamLink] = {}
        self._stopping = False
        self._stop_requested = trio.Event()
        self._grace_s = config.serving.shutdown_grace_s
        self._listen_fds: list[int] = []
        self._tls_rounds = 0
        self._tls_round: _TLSRound | None = None

    def __repr__(self) -> str:
        return f"<WorkerSet [{len(self.pids)}/{self.count} running | restarts {sum(self.restarts.values())}]>"

    async def run(self, listeners: list[trio.SocketListener], *,
                  task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Start every worker on ``listeners`` (bound by the router), report the port; return once all stopped."""
        self._listen_fds = [listener.socket.fileno() for listener in listeners]
        bound_port = listeners[0].socket.getsockname()[1]
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.hub.run_publisher)
                async with trio.open_nursery() as workers:
                    for index in range(self.count):
                        await workers.start(self._keep_worker, index)
                    task_status.started(bound_port)
                nursery.cancel_scope.cancel()
        finally:
            for listener in listeners:
                listener.socket.close()

    async def reload_tls(self, timeout_s: float = TLS_RELOAD_TIMEOUT_S) -> dict[int, str]:
        """Tell every worker to read its certificates and keys again; those that did not, each with why.

        A worker that answers with an error, exits, or does not answer within
        ``timeout_s`` failed (it keeps serving with its previous contexts).
        """
        self._tls_rounds += 1
        links = dict(self._links)
        tls_round = _TLSRound(self._tls_rounds, set(links))
        self._tls_round = tls_round
        try:
            for index, link in links.items():
                try:
                    link.send(ReloadTLS(id=tls_round.id))
                except LinkClosed:
                    tls_round.answer(index, "its control link is closed")
            if tls_round.waiting:
                with trio.move_on_after(timeout_s):
                    await tls_round.done.wait()
            for index in tls_round.waiting:
                tls_round.failures[index] = f"no answer within {timeout_s:g} s"
            return tls_round.failures
        finally:
            if self._tls_round is tls_round:
                self._tls_round = None

    def _tls_answer(self, worker: int, message: TLSReloaded) -> None:
        tls_round = self._tls_round
        if tls_round is not None and message.id == tls_round.id:
            tls_round.answer(worker, message.error)

    def shutdown(self, grace_s: float | None = None) -> None:
        """Stop every worker gracefully: no new connections, streams in flight get ``grace_s``."""
        self._stopping = True
        self._stop_requested.set()
        if grace_s is not None:
            self._grace_s = grace_s
        for link in list(self._links.values()):
            try:
                link.send(Stop(grace_s=self._grace_s))
            except LinkClosed:
                pass

    async def _keep_worker(self, index: int, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        backoff = _FIRST_BACKOFF_S
        first = True
        while not self._stopping:
            started_at = trio.current_time()
            returncode = await self._run_worker(index, task_status if first else trio.TASK_STATUS_IGNORED)
            first = False
            uptime = trio.current_time() - started_at
            log_event("worker_exited", level=logging.INFO if self._stopping else logging.WARNING, worker=index,
                      returncode=returncode, uptime_s=round(uptime, 3), restarting=not self._stopping)
            if self._stopping:
                return
            if uptime >= _STABLE_S:
                backoff = _FIRST_BACKOFF_S
            self.restarts[index] += 1
            await trio.sleep(backoff)
            backoff = min(backoff * 2, _MAX_BACKOFF_S)
        if first:
            task_status.started()

    async def _run_worker(self, index: int, task_status: Any) -> int:
        ours, theirs = socket.socketpair()
        command = [self.python, "-m", "narwhal", "worker", "--index", str(index),
                   "--control-fd", str(theirs.fileno())]
        for fd in self._listen_fds:
            command += ["--listen-fd", str(fd)]
        try:
            process = await trio.lowlevel.open_process(command, pass_fds=(*self._listen_fds, theirs.fileno()),
                                                       stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        self.pids[index] = process.pid
        link = StreamLink(trio.SocketStream(trio.socket.from_stdlib_socket(ours)), WorkerMessage)
        self._links[index] = link
        log_event("worker_started", worker=index, pid=process.pid)
        task_status.started()
        try:
            async with trio.open_nursery() as nursery:

                def on_message(message: object) -> None:
                    if isinstance(message, Forward):
                        nursery.start_soon(self._answer_forward, link, message)
                    elif isinstance(message, Hello):
                        link.send(Welcome(worker=index, config=self.config, config_dir=self.config_dir,
                                          via_token=self.via_token))
                        self.hub.attach(index, link.send)
                        self.hub.publish(force_to=index)
                        if self._stopping:
                            link.send(Stop(grace_s=self._grace_s))
                    elif isinstance(message, TLSReloaded):
                        self._tls_answer(index, message)
                    else:
                        self.hub.receive(index, message)

                nursery.start_soon(link.run, on_message)
                nursery.start_soon(self._kill_when_overdue, process)
                returncode = await process.wait()
                nursery.cancel_scope.cancel()
        finally:
            self._links.pop(index, None)
            self.pids.pop(index, None)
            if self._tls_round is not None:
                # Its replacement reads the files as it starts, but this worker did not reload.
                self._tls_round.answer(index, "it exited before it answered")
            self.hub.detach(index)
            if process.returncode is None:
                process.kill()
                with trio.CancelScope(shield=True):
                    await process.wait()
        return returncode

    async def _kill_when_overdue(self, process: trio.Process) -> None:
        # Once stopping, a worker gets the grace period and a margin; then it is killed.
        await self._stop_requested.wait()
        await trio.sleep(self._grace_s + _KILL_MARGIN_S)
        if process.returncode is None:
            log_event("worker_killed", level=logging.WARNING, pid=process.pid, reason="did not stop in time")
            process.kill()

    async def _answer_forward(self, link: StreamLink, message: Forward) -> None:
        responder = _CollectingResponder(message.secure, message.peer_cert)
        try:
            # The same path derivation as the worker's front (absolute form reduced), checked again here:
            # a forwarded request never reaches the admin API while [admin] listen has it.
            request = Request(message.method, message.target, headers=message.headers, body=message.body,
                              http_version=message.http_version, client=message.client)
        except InvalidTarget as exc:
            _send_reply(link, ForwardReply(id=message.id, status=400, headers=list(_JSON),
                                          body=error_json(str(exc), "invalid_request_error",
                                                          "invalid_request_target")))
            return
        admin_address = admin_url(self.config)
        if admin_address is not None and is_admin_path(request):
            _send_reply(link, ForwardReply(id=message.id, status=404, headers=list(_JSON),
                                          body=admin_elsewhere_body(request, admin_address)))
            return
        try:
            with trio.fail_after(CONTROL_APP_TIMEOUT_S):
                await call_asgi(self.app, request, responder)
            reply = ForwardReply(id=message.id, status=responder.status, headers=responder.headers,
                                 body=responder.body)
        except Exception as exc:
            log_event("worker_forward_failed", level=logging.ERROR, path=request.path,
                      **{"class": type(exc).__name__}, message=str(exc))
            reply = ForwardReply(id=message.id, status=500, headers=[(b"content-type", b"application/json")],
                                 body=b'{"error":{"message":"the control app failed","type":"server_error",'
                                      b'"code":"internal_error"}}')
        _send_reply(link, reply)


def _send_reply(link: StreamLink, reply: ForwardReply) -> None:
    """Send a forward's reply; a worker that has gone takes no reply."""
    try:
        link.send(reply)
    except LinkClosed:
        pass
