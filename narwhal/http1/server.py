"""A small HTTP/1.1 server on trio streams, parsed by httptools.

Theory of operation: each connection is served by one task, a thin socket
loop around the connection's ``HTTP1Protocol`` (``narwhal/http1/protocol.py``:
parsing, limits, deadlines and response framing, with no I/O; tested with
bytes in and bytes out). The parts live in their own modules: the socket
loop in ``connection.py`` (``Connection``, which sees the server only through
its ``ServerContext``), each response's framing in ``responder.py``, the TLS
handshake in ``tls_handshake.py``, the write watchdog and the fallback
disconnect watch in ``watchdogs.py``; this module accepts, caps and shuts down.

- While no request is being handled, the connection task owns every receive:
  it feeds bytes to the protocol, which queues ``Request`` objects (pipelined
  requests in order) or records a protocol error, and it sends the interim
  ``100 Continue`` when the protocol says one is due. It waits at most
  ``idle_timeout_s`` for the next bytes, or until the protocol's deadline for
  the head or body being received.
- It then takes requests off the queue one at a time, runs the handler in its
  own cancel scope, makes sure a response went out, and decides whether the
  connection goes on. Nothing is read while a handler runs: later pipelined
  requests wait in the socket buffer.
- Every connection's socket is in the server's readiness set
  (``narwhal/http1/readiness.py``): one task owns an edge-triggered epoll set
  of all of them, wakes the connection task when bytes arrive (no
  ``epoll_ctl`` per wait), and calls ``client_gone`` when the client goes
  away (see ``half_close`` below for which events mean that), which cancels a
  running handler's scope. So a client leaving mid-request is seen at once,
  with no reader task and no ``epoll_ctl`` per request. (Should the set refuse
  a socket, that connection falls back to trio's waits and a per-request
  disconnect watch.)

Sends to plain sockets are a non-blocking ``write`` first; only what the
kernel did not take goes through trio's ``send_all`` (which waits until the
socket is writable). Any other trio Stream (TLS) uses the stream's methods.

With an ``ssl_context`` every accepted connection is wrapped in a
``trio.SSLStream`` and must finish its handshake within ``header_timeout_s`` of
the accept (the first request's head shares that window); a
plain-HTTP client on that port fails the handshake and is closed unanswered
(after the TLS alert, if OpenSSL wrote one). The wrapped stream is not a
``SocketStream``, so it never takes the plain-socket fast paths.

Bounds against hostile clients: a request's head must arrive within
``header_timeout_s`` of its first byte (of the accept, for a connection's first
request) and its body within ``body_timeout_s`` of the head, however slowly the
bytes trickle in (answered 408). A write that the kernel does not take at once
is watched: a watchdog task closes the stream of a client whose write waited
``client_write_timeout_s``, which fails that write with ``ClientDisconnected``
(reason ``client_stalled``). Past ``max_client_connections``, a few more
connections are accepted that may only ask for the ``overflow_paths``
(``/health``); all else gets 503 and close. ``Upgrade`` and ``CONNECT`` are
refused (400) so that bytes after a head are never parsed as another request.

A client's FIN is read as a half-close (``half_close=True``): the disconnect
watches then wait only for a reset or a hang-up (not EPOLLRDHUP), so the
requests it sent are still answered; a client that really went away is noticed
when a write to it fails. With ``half_close=False`` (the mock engine, like
uvicorn) a FIN cancels the running handler at once.

The server's ``shutdown()`` stops the accept loops, wakes idle connections so
they close, and puts a deadline on the nursery that holds the connections, so
requests in flight may finish within the grace period and are cut after it.
"""

from __future__ import annotations

import errno
import logging
import math
import resource
import select
import ssl
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import msgspec
import trio

from narwhal.http1.connection import (
    TOO_MANY_CONNECTIONS,
    ClientDisconnected,
    Connection,
    Handler,
    ServerContext,
)
from narwhal.http1.protocol import CLOSE_HEADER, STATUS_LINES, Limits, Request
from narwhal.http1.responder import Responder
from narwhal.http1.tls_handshake import handshake
from narwhal.http1.watchdogs import watch_writes
from narwhal.obs.logs import log_event

__all__ = [
    "ClientDisconnected",
    "HTTPServer",
    "Handler",
    "Listener",
    "Request",
    "Responder",
    "ServerStatistics",
    "client_connection_budget",
]

# accept() errors that mean "out of resources right now", as in trio.serve_listeners.
_ACCEPT_CAPACITY_ERRNOS = frozenset(
    code for code in (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS) if code is not None
)
_ACCEPT_BACKOFF_S = 0.1
# Connections accepted past max_client_connections that may still ask for /health.
OVERFLOW_CONNECTIONS = 16
# With ``yield_at_cap``: how long a connection waits in the backlog for a sibling below its cap.
AT_CAP_HANDOFF_S = 0.05
# The file descriptors kept for everything but client connections (listeners,
# the admin listener, logs, handoff writes) when the cap is sized from the fd limit.
_FD_HEADROOM = 64
# The peer closed or reset: what the disconnect watch waits for (not EPOLLIN: pipelined bytes stay unread).
_GONE_EVENTS = select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR
# With half-close: a FIN is not "gone", only a reset or a full hang-up is.
_RESET_EVENTS = select.EPOLLHUP | select.EPOLLERR


class Listener(Protocol):
    """What the server accepts from: trio's ``SocketListener`` or a wrapper closed through its ``socket``."""

    socket: trio.socket.SocketType

    async def accept(self) -> trio.SocketStream: ...


class ServerStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of the server's load."""

    connections_open: int
    requests_in_flight: int
    requests_total: int
    connections_refused: int = 0
    clients_stalled: int = 0


class HTTPServer:
    """Serves HTTP/1.1 on trio listeners, handing each request to one handler."""

    def __init__(
        self,
        handler: Handler,
        *,
        max_header_bytes: int = 16384,
        max_body_bytes: int = 4 * 1024 * 1024,
        idle_timeout_s: float = 60.0,
        header_timeout_s: float = 10.0,
        body_timeout_s: float = 30.0,
        client_write_timeout_s: float = 30.0,
        max_client_connections: int | None = None,
        overflow_paths: frozenset[str] = frozenset({"/health"}),
        half_close: bool = True,
        early_rounds: bool = True,
        server_name: bytes = b"narwhal",
        ssl_context: ssl.SSLContext | None = None,
        yield_at_cap: bool = False,
    ) -> None:
        # A worker process shares its listening socket with siblings: at its cap it stops
        # accepting and leaves new connections to them (see ``_wait_below_cap``).
        self._yield_at_cap = yield_at_cap
        self._slot_freed = trio.Event()
        self._starting = 0
        self._header_timeout_s = header_timeout_s
        self._client_write_timeout_s = client_write_timeout_s
        self._max_client_connections = max_client_connections
        # Every connection from its accept (TLS handshakes included), and those past the cap.
        self._accepted = 0
        self._overflow_open = 0
        self._connections_refused = 0
        self._refusals_logged_at = -math.inf
        # Read once per accepted connection: assigning a new context (a TLS reload)
        # changes new handshakes only.
        self.ssl_context = ssl_context
        # All that the connections see of the server.
        self._context = ServerContext(
            handler,
            limits=Limits(max_header_bytes=max_header_bytes, max_body_bytes=max_body_bytes,
                          header_timeout_s=header_timeout_s, body_timeout_s=body_timeout_s),
            idle_timeout_s=idle_timeout_s, client_write_timeout_s=client_write_timeout_s,
            overflow_paths=overflow_paths, gone_events=_RESET_EVENTS if half_close else _GONE_EVENTS,
            server_name=server_name, early_rounds=early_rounds)
        self._shutdown_deadline = float("inf")
        self._accept_scope: trio.CancelScope | None = None
        self._connections_scope: trio.CancelScope | None = None
        self._connections: set[Connection] = set()

    def __repr__(self) -> str:
        context = self._context
        state = "closing" if context.closing else "serving"
        return (
            f"<HTTPServer [{state} | Connections: {len(self._connections)} open | "
            f"Requests: {context.requests_in_flight} in flight, {context.requests_total} total]>"
        )

    def statistics(self) -> ServerStatistics:
        """Open connections and requests in flight and served so far."""
        context = self._context
        return ServerStatistics(
            connections_open=len(self._connections),
            requests_in_flight=context.requests_in_flight,
            requests_total=context.requests_total,
            connections_refused=self._connections_refused,
            clients_stalled=context.clients_stalled,
        )

    async def serve(self, host: str, port: int, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Bind ``host:port``, report the bound port via ``task_status``, serve until shut down."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        bound_port = listeners[0].socket.getsockname()[1]
        await self._serve(listeners, lambda: task_status.started(bound_port))

    async def serve_listeners(
        self, listeners: Sequence[Listener], *, task_status: Any = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve on listeners the caller opened; ``task_status`` reports them back."""
        await self._serve(listeners, lambda: task_status.started(listeners))

    def shutdown(self, grace_s: float) -> None:
        """Stop accepting now; let requests in flight finish within ``grace_s``, then cut them."""
        deadline = trio.current_time() + grace_s
        self._shutdown_deadline = min(self._shutdown_deadline, deadline)
        self._context.closing = True
        if self._accept_scope is not None:
            self._accept_scope.cancel()
        if self._connections_scope is not None:
            self._connections_scope.deadline = self._shutdown_deadline
        for conn in self._connections:
            conn.wake_for_shutdown()

    async def _serve(self, listeners: Sequence[Listener], started: Callable[[], None]) -> None:
        context = self._context
        context.disconnects.open()
        try:
            async with trio.open_nursery() as watcher:
                # The disconnect watch outlives every connection and stops after the last one.
                watcher.start_soon(context.disconnects.run)
                watcher.start_soon(self._watchdog)
                await watcher.start(context.readiness.run)
                async with trio.open_nursery() as connections:
                    self._connections_scope = connections.cancel_scope
                    connections.cancel_scope.deadline = self._shutdown_deadline
                    async with trio.open_nursery() as accepting:
                        self._accept_scope = accepting.cancel_scope
                        if context.closing:
                            accepting.cancel_scope.cancel()
                        for listener in listeners:
                            accepting.start_soon(self._accept_loop, listener, connections)
                        started()
                    # Close at once so that new connects are refused while requests drain.
                    for listener in listeners:
                        listener.socket.close()
                watcher.cancel_scope.cancel()
        finally:
            for listener in listeners:
                listener.socket.close()
            self._accept_scope = None
            self._connections_scope = None
            context.disconnects.close()

    async def _accept_loop(self, listener: Listener, connections: trio.Nursery) -> None:
        while True:
            if self._yield_at_cap:
                await self._wait_below_cap(listener)
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in _ACCEPT_CAPACITY_ERRNOS:
                    raise
                log_event("http_accept_error", level=logging.ERROR, message=str(exc), errno=exc.errno)
                await trio.sleep(_ACCEPT_BACKOFF_S)
                continue
            # Counted at once: the connection's task has not run yet when the loop looks at the cap again.
            self._starting += 1
            connections.start_soon(self._serve_connection, stream)

    def _at_cap(self) -> bool:
        cap = self._max_client_connections
        return cap is not None and self._accepted + self._starting - self._overflow_open >= cap

    async def _wait_below_cap(self, listener: Listener) -> None:
        """At the cap, do not accept: a sibling process waiting in accept() takes the connection.

        Only when a connection stays in the backlog over two looks ``AT_CAP_HANDOFF_S``
        apart (every process is at its cap) is it accepted here, for the overflow
        slots and the 503. The look is one non-blocking poll, made only while at the cap.
        """
        seen_pending = False
        while self._at_cap():
            freed = self._slot_freed
            with trio.move_on_after(AT_CAP_HANDOFF_S):
                await freed.wait()
            if freed.is_set():
                seen_pending = False
                continue
            pending = bool(select.select([listener.socket.fileno()], [], [], 0)[0])
            if pending and seen_pending:
                return
            seen_pending = pending

    async def serve_stream(self, stream: trio.abc.Stream) -> None:
        """Serve one accepted stream until it closes (tests drive the front over memory streams this way)."""
        await self._serve_connection(stream)

    async def run_watchdog(self) -> None:
        """The client write timeout's watchdog, for callers of ``serve_stream``; ``serve`` runs its own."""
        await self._watchdog()

    async def _watchdog(self) -> None:
        """Close the streams of clients whose pending write outlived ``client_write_timeout_s``; expire the
        head, body and idle deadlines of the connections waiting in the readiness set."""
        context = self._context
        readiness = context.readiness
        readiness.alarm = context.watchdog_alarm
        try:
            await watch_writes(self._connections, self._client_write_timeout_s, context.watchdog_alarm,
                               readiness=readiness)
        finally:
            readiness.alarm = None

    async def _serve_connection(self, stream: trio.abc.Stream) -> None:
        # trio sets TCP_NODELAY on accepted sockets (the hot path depends on it; a test checks it).
        self._starting = max(0, self._starting - 1)
        cap = self._max_client_connections
        overflow = cap is not None and self._accepted - self._overflow_open >= cap
        if overflow and self._overflow_open >= OVERFLOW_CONNECTIONS:
            await self._refuse(stream)
            return
        self._accepted += 1
        if overflow:
            self._overflow_open += 1
            self._note_refusal()
        try:
            await self._serve_accepted(stream, overflow)
        finally:
            self._accepted -= 1
            if overflow:
                self._overflow_open -= 1
            if self._yield_at_cap:
                self._slot_freed.set()
                self._slot_freed = trio.Event()

    async def _serve_accepted(self, stream: trio.abc.Stream, overflow: bool) -> None:
        accepted_at = trio.current_time()
        context = self.ssl_context
        if context is not None and isinstance(stream, trio.SocketStream):
            secure = await handshake(stream, context, accepted_at + self._header_timeout_s,
                                     header_timeout_s=self._header_timeout_s)
            if secure is None:
                return
            stream = secure
        conn = Connection(self._context, stream, overflow=overflow, accepted_at=accepted_at)
        self._connections.add(conn)
        try:
            await conn.run()
        except Exception as exc:
            log_event(
                "http_connection_error", level=logging.ERROR, **{"class": type(exc).__name__}, message=str(exc)
            )
        finally:
            self._connections.discard(conn)
            conn.forget_watch()
            if conn.sock is not None:
                # Synchronous: no checkpoint (and no nursery) to close a connection.
                conn.sock.close()
            else:
                await trio.aclose_forcefully(stream)

    async def _refuse(self, stream: trio.abc.Stream) -> None:
        """Past the cap and its overflow: 503 without reading (plain HTTP only), then close."""
        self._note_refusal()
        if self.ssl_context is None:
            body = TOO_MANY_CONNECTIONS
            response = b"".join([STATUS_LINES[503], b"content-type: application/json\r\n",
                                 self._context.common_head_lines(), b"content-length: %d\r\n" % len(body), CLOSE_HEADER,
                                 b"\r\n", body])
            with trio.move_on_after(1.0):
                try:
                    await stream.send_all(response)
                    if isinstance(stream, trio.abc.HalfCloseableStream):
                        await stream.send_eof()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
        await trio.aclose_forcefully(stream)

    def _note_refusal(self) -> None:
        """Count a connection past the cap; log at most one event per 10 s, not one per connection."""
        self._connections_refused += 1
        now = trio.current_time()
        if now - self._refusals_logged_at >= 10.0:
            self._refusals_logged_at = now
            log_event("http_connections_capped", level=logging.WARNING, cap=self._max_client_connections,
                      open=self._accepted, refused_total=self._connections_refused)


def client_connection_budget(other_fds: int) -> int:
    """A default for ``max_client_connections``: the fd limit less ``other_fds`` and a headroom.

    Each client connection holds one descriptor; ``other_fds`` is what the
    engine pools may hold. The overflow connections for /health come on top.
    """
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, soft - other_fds - _FD_HEADROOM - OVERFLOW_CONNECTIONS)
