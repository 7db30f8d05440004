"""A small HTTP/1.1 server on trio streams, parsed by httptools.

Theory of operation: each connection is served by one task, a thin socket
loop around the connection's ``HTTP1Protocol`` (``narwhal/http1/protocol.py``:
parsing, limits, deadlines and response framing, with no I/O; tested with
bytes in and bytes out).

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
import os
import resource
import select
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from email.utils import formatdate
from typing import Any, Protocol

import msgspec
import trio

from narwhal.errors import ClientGone
from narwhal.http1.protocol import (
    CHUNK_TERMINATOR,
    CHUNKED_HEADER,
    CLOSE_HEADER,
    STATUS_LINES,
    HTTP1Protocol,
    Limits,
    Request,
    error_response,
    response_head,
)
from narwhal.http1.readiness import Readiness
from narwhal.http1.sockets import socket_of
from narwhal.obs.logs import log_event
from narwhal.tls import tls_reason
from narwhal.wire import error_json

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

_RECEIVE_SIZE = 65536
# A connection closed after a protocol error keeps reading (and discarding) for
# a moment, so the error response is not lost to a TCP reset caused by unread
# request bytes.
_LINGER_S = 1.0
_LINGER_MAX_BYTES = 256 * 1024
# accept() errors that mean "out of resources right now", as in trio.serve_listeners.
_ACCEPT_CAPACITY_ERRNOS = frozenset(
    code for code in (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS) if code is not None
)
_ACCEPT_BACKOFF_S = 0.1
# After an early 413 the rest of the upload is read and dropped, up to this many
# times max_body_bytes and within body_timeout_s, so that the client reads the
# 413 instead of a reset caused by unread bytes.
_DRAIN_413_FACTOR = 4
# Connections accepted past max_client_connections that may still ask for /health.
OVERFLOW_CONNECTIONS = 16
# With ``yield_at_cap``: how long a connection waits in the backlog for a sibling below its cap.
AT_CAP_HANDOFF_S = 0.05
# The file descriptors kept for everything but client connections (listeners,
# the admin listener, logs, handoff writes) when the cap is sized from the fd limit.
_FD_HEADROOM = 64
# How often, at most, the watchdog looks for writes to clients that stopped reading.
_WATCHDOG_MAX_TICK_S = 1.0


class Listener(Protocol):
    """What the server accepts from: trio's ``SocketListener`` or a wrapper closed through its ``socket``."""

    socket: trio.socket.SocketType

    async def accept(self) -> trio.SocketStream: ...

_JSON_HEADERS = [(b"content-type", b"application/json")]
_TOO_MANY_CONNECTIONS = error_json("too many client connections; only /health is served now",
                                   type_="service_unavailable", code="too_many_connections")
# The peer closed or reset: what the disconnect watch waits for (not EPOLLIN: pipelined bytes stay unread).
_GONE_EVENTS = select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR
# With half-close: a FIN is not "gone", only a reset or a full hang-up is.
_RESET_EVENTS = select.EPOLLHUP | select.EPOLLERR
_INF = math.inf
# The raw send syscall of the fast path; a module-level name so tests can count or limit writes.
_write = os.write


class ClientDisconnected(ClientGone):
    """The client closed or reset the connection (or stopped reading) before the response was written."""


class ServerStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of the server's load."""

    connections_open: int
    requests_in_flight: int
    requests_total: int
    connections_refused: int = 0
    clients_stalled: int = 0


Handler = Callable[[Request, "Responder"], Awaitable[None]]


class Responder:
    """Writes the response to one request; handed to the handler with it.

    Handlers must not pass ``content-length``, ``transfer-encoding`` or
    ``connection`` headers: the responder frames the body itself. Besides
    ``started``, ``finished`` says the whole response went out and
    ``client_disconnected`` that the client is known to be gone.
    """

    __slots__ = ("_chunked", "_closes", "_conn", "_request", "finished", "started")

    def __init__(self, conn: _Connection, request: Request) -> None:
        self._conn = conn
        self._request = request
        self._chunked = False
        self._closes = False
        self.started = False
        self.finished = False

    @property
    def client_disconnected(self) -> bool:
        """True once the client is known to be gone."""
        return self._conn.disconnected

    @property
    def secure(self) -> bool:
        """True when the request came over TLS."""
        return isinstance(self._conn.stream, trio.SSLStream)

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """Send a complete response (head and body in one write)."""
        self._begin()
        framing = b"content-length: %d\r\n" % len(body)
        if status < 200 or status in (204, 304):
            framing, body = b"", b""
        elif self._request.method == b"HEAD":
            body = b""
        self.finished = True
        await self._conn.send(self._head(status, headers, framing, body))

    async def start_stream(self, status: int, headers: list[tuple[bytes, bytes]], first: bytes = b"",
                           end: bool = False) -> None:
        """Send the head of a streamed response, with ``first`` as its first chunk, in one write.

        ``end=True``: ``first`` is the whole body; the terminator goes in the same write.
        """
        self._begin()
        if end:
            self.finished = True
        if self._request.http_version == "1.1":
            self._chunked = True
            chunk = b"%x\r\n%b\r\n" % (len(first), first) if first else b""
            if end:
                chunk += CHUNK_TERMINATOR
            head = self._head(status, headers, CHUNKED_HEADER, chunk)
        else:
            # HTTP/1.0 has no chunked coding: the body ends when the connection closes.
            self._closes = True
            head = self._head(status, headers, b"", first)
        await self._conn.send(head)

    async def write(self, data: bytes) -> None:
        """Send one chunk of a streamed response in one socket write."""
        if not data:
            return
        if not self.started or self.finished:
            raise RuntimeError("write() needs a started, unfinished stream")
        if self._chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        await self._conn.send(data)

    async def end_stream(self, last: bytes = b"") -> None:
        """Send the last chunk (if any) and the terminator in one socket write."""
        if not self.started or self.finished:
            raise RuntimeError("end_stream() needs a started, unfinished stream")
        self.finished = True
        if self._chunked:
            data = b"%x\r\n%b\r\n0\r\n\r\n" % (len(last), last) if last else CHUNK_TERMINATOR
        else:
            data = last
        if data:
            await self._conn.send(data)

    def direct(self) -> tuple[_Connection, bool] | None:
        """For the relay pump: (connection, chunk-framed) of a started stream on a plain socket, else None."""
        conn = self._conn
        if conn._fd < 0 or not self.started or self.finished or conn.disconnected:
            return None
        return conn, self._chunked

    def _begin(self) -> None:
        if self.started:
            raise RuntimeError("the response has already started")
        if self._conn.disconnected:
            raise self._conn.gone_error()
        self.started = True

    def _head(self, status: int, headers: list[tuple[bytes, bytes]], framing: bytes, payload: bytes) -> bytes:
        """The response head followed by ``payload``, joined into one buffer for one write."""
        conn = self._conn
        if not self._request.keep_alive or conn.server._closing:
            self._closes = True
        return response_head(self._request, status, headers, conn.server._common_head_lines(), framing, payload,
                             closes=self._closes)


class _Connection:
    """The socket loop of one client connection: drives its ``HTTP1Protocol``, runs the handler, writes."""

    __slots__ = (
        "_drained",
        "_fd",
        "_gone_reason",
        "_handler_scope",
        "_idle",
        "_scope",
        "_watch",
        "_client",
        "disconnected",
        "on_stall",
        "overflow",
        "protocol",
        "server",
        "sock",
        "stream",
        "write_since",
    )

    def __init__(self, server: HTTPServer, stream: trio.abc.Stream, *, overflow: bool = False,
                 accepted_at: float | None = None) -> None:
        self.server = server
        self.stream = stream
        # None for a stream with no socket under it (tests' memory streams).
        self.sock: trio.socket.SocketType | None = _socket_or_none(stream)
        # Plain sockets get the syscall fast path; any other trio Stream (TLS) the generic one.
        self._fd = self.sock.fileno() if isinstance(stream, trio.SocketStream) and self.sock else -1
        # In the server's readiness set for the connection's whole life: it wakes this task when
        # bytes arrive, and sees the client go away mid-request (any stream: the TCP socket under it).
        self._watch = (server._readiness.watch(self.sock.fileno(), self.client_gone, server._gone_events)
                       if self.sock is not None else None)
        # Past the connection cap: only the overflow paths are served, one request.
        self.overflow = overflow
        self._gone_reason = "client_disconnected"
        # When the pending write to the client began (inf: none pending); the watchdog reads it.
        self.write_since = _INF
        # Set by the relay pump while it holds a write to this client that has to wait: called
        # before a stalled client's stream closes, so that write fails with client_stalled too.
        self.on_stall: Callable[[], None] | None = None
        # Bytes to requests and responses to bytes; the first head is timed from the accept
        # (a TLS handshake included).
        self.protocol = HTTP1Protocol(server._limits, trio.current_time, started_at=accepted_at, owner=self)
        self._client: tuple[str, int] | None = None
        self.disconnected = False
        self._handler_scope: trio.CancelScope | None = None
        # The connection's scope: its deadline is the idle timeout while idle, +inf while handling.
        self._scope: trio.CancelScope | None = None
        self._idle = False
        # A new connection's request is usually there already: read before waiting.
        self._drained = False

    @property
    def fd(self) -> int:
        """The plain socket's descriptor (-1 for TLS and socketless streams)."""
        return self._fd

    def peer(self) -> tuple[str, int] | None:
        """The client's (host, port), or None when the socket cannot say."""
        if self._client is None and self.sock is not None:
            try:
                peer = self.sock.getpeername()
            except OSError:
                return None
            self._client = (peer[0], peer[1])
        return self._client

    # ---- the connection task ----

    async def run(self) -> None:
        """Read and answer requests in order until the connection should close."""
        protocol = self.protocol
        with trio.CancelScope() as scope:
            self._scope = scope
            await self._serve_requests(scope)
        if (scope.cancel_called and protocol.in_message and protocol.error is None and not self.disconnected
                and not self.server._closing and protocol.deadline() <= trio.current_time()):
            # A head or body too slow: answered outside the scope its deadline cancelled.
            protocol.error = protocol.timeout_error()
            await self._send_error()

    async def _serve_requests(self, scope: trio.CancelScope) -> None:
        server = self.server
        protocol = self.protocol
        queue = protocol.requests
        while True:
            while not queue:
                if self.disconnected:
                    return
                if protocol.error is not None:
                    scope.deadline = _INF
                    await self._send_error()
                    return
                if server._closing and not protocol.in_message:
                    return
                interim = protocol.interim_response()
                if interim is not None:
                    # Only now: the interim response may not overtake responses due ahead of it.
                    await self._send_interim(interim)
                    continue
                phase_deadline = protocol.deadline()
                scope.deadline = (phase_deadline if phase_deadline != _INF
                                  else trio.current_time() + server._idle_timeout_s)
                self._idle = True
                data = await self._receive()
                self._idle = False
                if scope.cancel_called:
                    # Idle too long, a head or body too slow (answered by run()), or shut
                    # down, even if bytes arrived at that moment.
                    return
                if not data:
                    self.disconnected = True
                    return
                protocol.receive_data(data)
            scope.deadline = _INF
            request = queue.popleft()
            if not await self._handle(request):
                return
            protocol.response_sent()
            # The response just went out: the client's next request comes later, so wait first.
            self._drained = True

    async def _receive(self) -> bytes:
        """The next bytes from the client; b"" on EOF or a reset."""
        fd = self._fd
        if fd < 0:
            try:
                return bytes(await self.stream.receive_some(_RECEIVE_SIZE))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return b""
        watch = self._watch
        while True:
            if self._drained:
                if watch is not None:
                    await self.server._readiness.wait(watch)
                else:
                    await trio.lowlevel.wait_readable(fd)
            try:
                data = os.read(fd, _RECEIVE_SIZE)
            except BlockingIOError:
                self._drained = True
                continue
            except OSError:
                return b""
            self._drained = len(data) < _RECEIVE_SIZE
            return data

    def wake_for_shutdown(self) -> None:
        """Close now if idle; a connection handling a request closes after its response."""
        if self._idle and self._scope is not None:
            self._scope.cancel()

    async def _send_interim(self, interim: bytes) -> None:
        try:
            await self.send(interim)
        except ClientDisconnected:
            pass

    def forget_watch(self) -> None:
        """Out of the readiness set; before the socket closes, so its fd number is never confused."""
        if self._watch is not None:
            self.server._readiness.forget(self._watch)
            self._watch = None

    def client_gone(self) -> None:
        """The client closed or reset: cancel the handler (if any); the connection ends."""
        self.disconnected = True
        if self._handler_scope is not None:
            self._handler_scope.cancel()

    async def stalled(self) -> None:
        """The watchdog's verdict: the client stopped reading; close its stream to fail the pending write."""
        self._gone_reason = "client_stalled"
        self.server._clients_stalled += 1
        peer = self.peer()
        log_event("http_client_stalled", level=logging.WARNING,
                  client=None if peer is None else f"{peer[0]}:{peer[1]}",
                  timeout_s=self.server._client_write_timeout_s)
        self.disconnected = True
        self.forget_watch()
        on_stall, self.on_stall = self.on_stall, None
        if on_stall is not None:
            on_stall()
        # Closing wakes the blocked send with ClosedResourceError (trio's notify_closing),
        # so the handler sees ClientDisconnected with this reason rather than a bare cancel.
        await trio.aclose_forcefully(self.stream)
        self.client_gone()

    def gone_error(self) -> ClientDisconnected:
        """The exception for a write to a client known to be gone, carrying why it is gone."""
        if self._gone_reason == "client_stalled":
            return ClientDisconnected("the client stopped reading its response", reason="client_stalled")
        return ClientDisconnected("the client has gone")

    # ---- sending (the connection task and responders) ----

    async def send(self, data: bytes) -> None:
        """One socket write, the slow part watched by the write timeout; ClientDisconnected if the client is gone."""
        if self.disconnected:
            raise self.gone_error()
        fd = self._fd
        rest: bytes | memoryview = data
        if fd >= 0:
            # The kernel takes the bytes at once unless the socket buffer is full: then no
            # trip through the scheduler at all (P2 in docs/benchmarks.md).
            try:
                sent = _write(fd, data)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                self.client_gone()
                raise self.gone_error() from exc
            if sent == len(data):
                return
            rest = memoryview(data)[sent:]
        # Only a write that has to wait is watched (one clock read); the fast path above is not.
        self.write_since = trio.current_time()
        try:
            await self.stream.send_all(rest)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self.client_gone()
            raise self.gone_error() from exc
        except BaseException:
            # Cut mid-write (cancelled): part of a response may be out, so nothing more may follow.
            self.disconnected = True
            raise
        finally:
            self.write_since = _INF

    async def _handle(self, request: Request) -> bool:
        """Run the handler for one request; True when the connection may go on."""
        server = self.server
        if self._watch is not None and self._watch.gone:
            # The client left before its request got here (the readiness set saw it).
            self.disconnected = True
        if self.disconnected:
            return False
        responder = Responder(self, request)
        if self.overflow:
            # Past the connection cap: one request, and only a health check is served.
            request.keep_alive = False
            if request.path not in server._overflow_paths:
                try:
                    await responder.respond(503, _JSON_HEADERS, _TOO_MANY_CONNECTIONS)
                except ClientDisconnected:
                    pass
                return False
        server._requests_in_flight += 1
        server._requests_total += 1
        failure: Exception | None = None
        # Not in the readiness set (it could not take the socket): watch for the client leaving only now.
        watching = self._watch is None and server._watch(self)
        try:
            with trio.CancelScope() as scope:
                self._handler_scope = scope
                await server._handler(request, responder)
        except* Exception as group:
            # except* lets a Cancelled that travels in the same group (the
            # shutdown deadline) go on while the handler's own errors stop here.
            failure = _unwrap(group)
        finally:
            if watching:
                server._unwatch(self)
            self._handler_scope = None
            server._requests_in_flight -= 1
        if self.disconnected:
            if failure is not None and not _is_disconnect(failure):
                _log_handler_error(request, failure)
            return False
        if failure is not None:
            _log_handler_error(request, failure)
        elif not responder.finished:
            failure = RuntimeError(
                "the handler returned without responding" if not responder.started
                else "the handler returned without ending its stream"
            )
            _log_handler_error(request, failure, "IncompleteResponse")
        if failure is not None:
            if responder.started:
                # Never terminate a chunked stream cleanly after an error.
                return responder.finished and not responder._closes
            try:
                await responder.respond(
                    500, _JSON_HEADERS, error_json("internal server error", type_="server_error", code="internal_error")
                )
            except ClientDisconnected:
                return False
        return not responder._closes

    async def _send_error(self) -> None:
        """Answer a protocol error with a JSON body, then close gracefully."""
        error = self.protocol.error
        assert error is not None
        status = error[0]
        try:
            await self.send(error_response(error, self.server._common_head_lines()))
            if isinstance(self.stream, trio.abc.HalfCloseableStream):
                await self.stream.send_eof()
        except (ClientDisconnected, trio.BrokenResourceError, trio.ClosedResourceError):
            return
        linger_s, linger_bytes = _LINGER_S, _LINGER_MAX_BYTES
        if status == 413:
            # Read the rest of an oversized upload (bounded), so the client sees the 413, not a
            # reset; a client that stops sending for _LINGER_S is done.
            server = self.server
            linger_s = server._body_timeout_s
            linger_bytes = max(_LINGER_MAX_BYTES, _DRAIN_413_FACTOR * server._max_body_bytes)
        with trio.move_on_after(linger_s):
            drained = 0
            while drained < linger_bytes:
                data: bytes | bytearray = b""
                with trio.move_on_after(_LINGER_S):
                    try:
                        data = await self.stream.receive_some(_RECEIVE_SIZE)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        return
                if not data:
                    return
                drained += len(data)


async def _send_alert(stream: trio.SSLStream[trio.SocketStream], raw: trio.SocketStream) -> None:
    """Send the TLS alert OpenSSL wrote for a failed handshake, then close gently.

    trio marks the stream broken without sending it; without the alert a client
    refused for its certificate sees only a reset and cannot tell why. The
    attribute is trio's private outgoing buffer, hence the guard. The linger
    keeps unread client bytes from turning the close into a reset that would
    destroy the alert.
    """
    outgoing = getattr(stream, "_outgoing", None)
    alert = outgoing.read() if isinstance(outgoing, ssl.MemoryBIO) else b""
    if not alert:
        return
    with trio.move_on_after(_LINGER_S):
        try:
            await raw.send_all(alert)
            await raw.send_eof()
            drained = 0
            while drained < _LINGER_MAX_BYTES:
                data = await raw.receive_some(_RECEIVE_SIZE)
                if not data:
                    return
                drained += len(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return


def _socket_or_none(stream: trio.abc.Stream) -> trio.socket.SocketType | None:
    try:
        return socket_of(stream)
    except AttributeError:
        return None


def _peer(raw: trio.SocketStream) -> tuple[str, int] | None:
    try:
        peer = raw.socket.getpeername()
    except OSError:
        return None
    return (peer[0], peer[1])


def _unwrap(group: ExceptionGroup) -> Exception:
    """The one exception that except* wrapped, or the group when there are several."""
    return group.exceptions[0] if len(group.exceptions) == 1 else group


def _is_disconnect(exc: BaseException) -> bool:
    if isinstance(exc, ClientDisconnected):
        return True
    if isinstance(exc, BaseExceptionGroup):
        return all(_is_disconnect(inner) for inner in exc.exceptions)
    return False


def _log_handler_error(request: Request, exc: Exception, class_name: str | None = None) -> None:
    log_event(
        "http_handler_error",
        level=logging.ERROR,
        path=request.path,
        **{"class": class_name or type(exc).__name__},
        message=str(exc),
    )


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
        server_name: bytes = b"narwhal",
        ssl_context: ssl.SSLContext | None = None,
        yield_at_cap: bool = False,
    ) -> None:
        self._handler = handler
        # A worker process shares its listening socket with siblings: at its cap it stops
        # accepting and leaves new connections to them (see ``_wait_below_cap``).
        self._yield_at_cap = yield_at_cap
        self._slot_freed = trio.Event()
        self._starting = 0
        self._header_timeout_s = header_timeout_s
        self._body_timeout_s = body_timeout_s
        self._client_write_timeout_s = client_write_timeout_s
        self._max_client_connections = max_client_connections
        self._overflow_paths = overflow_paths
        self._gone_events = _RESET_EVENTS if half_close else _GONE_EVENTS
        # Every connection from its accept (TLS handshakes included), and those past the cap.
        self._accepted = 0
        self._overflow_open = 0
        self._connections_refused = 0
        self._clients_stalled = 0
        self._refusals_logged_at = -math.inf
        # Read once per accepted connection: assigning a new context (a TLS reload)
        # changes new handshakes only.
        self.ssl_context = ssl_context
        self._max_header_bytes = max_header_bytes
        self._max_body_bytes = max_body_bytes
        # What every connection's protocol enforces.
        self._limits = Limits(max_header_bytes=max_header_bytes, max_body_bytes=max_body_bytes,
                              header_timeout_s=header_timeout_s, body_timeout_s=body_timeout_s)
        self._idle_timeout_s = idle_timeout_s
        self._server_header = b"server: " + server_name + b"\r\n"
        self._common_head = b""
        self._common_head_second = -1
        self._closing = False
        self._shutdown_deadline = float("inf")
        self._accept_scope: trio.CancelScope | None = None
        self._connections_scope: trio.CancelScope | None = None
        self._connections: set[_Connection] = set()
        self._requests_in_flight = 0
        self._requests_total = 0
        # Every connection's socket, for the task that reads it and to see clients leave mid-request.
        self._readiness = Readiness()
        # The fallback disconnect watch, for connections the readiness set could not take.
        self._epoll: select.epoll | None = None
        self._watched: dict[int, _Connection] = {}

    def __repr__(self) -> str:
        state = "closing" if self._closing else "serving"
        return (
            f"<HTTPServer [{state} | Connections: {len(self._connections)} open | "
            f"Requests: {self._requests_in_flight} in flight, {self._requests_total} total]>"
        )

    def statistics(self) -> ServerStatistics:
        """Open connections and requests in flight and served so far."""
        return ServerStatistics(
            connections_open=len(self._connections),
            requests_in_flight=self._requests_in_flight,
            requests_total=self._requests_total,
            connections_refused=self._connections_refused,
            clients_stalled=self._clients_stalled,
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
        self._closing = True
        if self._accept_scope is not None:
            self._accept_scope.cancel()
        if self._connections_scope is not None:
            self._connections_scope.deadline = self._shutdown_deadline
        for conn in self._connections:
            conn.wake_for_shutdown()

    async def _serve(self, listeners: Sequence[Listener], started: Callable[[], None]) -> None:
        epoll = self._epoll = select.epoll()
        try:
            async with trio.open_nursery() as watcher:
                # The disconnect watch outlives every connection and stops after the last one.
                watcher.start_soon(self._watch_disconnects, epoll)
                watcher.start_soon(self._watchdog)
                await watcher.start(self._readiness.run)
                async with trio.open_nursery() as connections:
                    self._connections_scope = connections.cancel_scope
                    connections.cancel_scope.deadline = self._shutdown_deadline
                    async with trio.open_nursery() as accepting:
                        self._accept_scope = accepting.cancel_scope
                        if self._closing:
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
            self._watched.clear()
            self._epoll = None
            epoll.close()

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
        """Close the streams of clients whose pending write outlived ``client_write_timeout_s``.

        One coarse tick for all connections instead of a cancel scope per write:
        the hot path pays nothing unless a write has to wait.
        """
        timeout_s = self._client_write_timeout_s
        tick_s = min(_WATCHDOG_MAX_TICK_S, timeout_s / 10)
        while True:
            await trio.sleep(tick_s)
            expired_before = trio.current_time() - timeout_s
            for conn in list(self._connections):
                if conn.write_since <= expired_before and not conn.disconnected:
                    await conn.stalled()

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
            secure = await self._handshake(stream, context, accepted_at + self._header_timeout_s)
            if secure is None:
                return
            stream = secure
        conn = _Connection(self, stream, overflow=overflow, accepted_at=accepted_at)
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
            body = _TOO_MANY_CONNECTIONS
            response = b"".join([STATUS_LINES[503], b"content-type: application/json\r\n",
                                 self._common_head_lines(), b"content-length: %d\r\n" % len(body), CLOSE_HEADER,
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

    async def _handshake(self, raw: trio.SocketStream, context: ssl.SSLContext,
                         deadline: float) -> trio.SSLStream | None:
        """The TLS stream once its handshake is done by ``deadline``; None (closed) otherwise.

        The deadline is the head's (``header_timeout_s`` from the accept): a silent or
        half-sent ClientHello holds a connection slot no longer than a slow head does.
        """
        stream = trio.SSLStream(raw, context, server_side=True, https_compatible=True)
        failure: BaseException | None = None
        done = False
        try:
            with trio.move_on_at(deadline):
                try:
                    await stream.do_handshake()
                    done = True
                except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                    failure = exc
            if done:
                return stream
            peer = _peer(raw)
            # Plain HTTP, an untrusted client certificate or a silent client: closed, never served.
            log_event("tls_handshake_failed", level=logging.WARNING,
                      client=f"{peer[0]}:{peer[1]}" if peer else None,
                      reason=(tls_reason(failure) or str(failure) or type(failure).__name__) if failure
                      else f"no handshake within {self._header_timeout_s:g} s (the head timeout)")
            if failure is not None:
                await _send_alert(stream, raw)
            return None
        finally:
            if not done:
                # Also when cancelled (shutdown): the socket must not outlive the task.
                raw.socket.close()

    def _watch(self, conn: _Connection) -> bool:
        """Put a connection's socket in the disconnect watch while its request is in flight."""
        epoll = self._epoll
        if epoll is None or conn.sock is None:
            return False
        fd = conn.sock.fileno()
        try:
            epoll.register(fd, self._gone_events)
        except OSError:
            return False
        self._watched[fd] = conn
        return True

    def _unwatch(self, conn: _Connection) -> None:
        if conn.sock is None:
            return
        fd = conn.sock.fileno()
        if self._watched.pop(fd, None) is not None and self._epoll is not None:
            try:
                self._epoll.unregister(fd)
            except OSError:
                pass

    async def _watch_disconnects(self, epoll: select.epoll) -> None:
        """The one task that sees clients go away mid-request, for every connection at once."""
        watched = self._watched
        while True:
            await trio.lowlevel.wait_readable(epoll.fileno())
            for fd, _events in epoll.poll(0):
                conn = watched.pop(fd, None)
                try:
                    epoll.unregister(fd)
                except OSError:
                    pass
                if conn is not None:
                    conn.client_gone()

    def _common_head_lines(self) -> bytes:
        """The server and date headers; the date is formatted at most once a second."""
        now = int(time.time())
        if now != self._common_head_second:
            self._common_head_second = now
            self._common_head = self._server_header + b"date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
        return self._common_head


def client_connection_budget(other_fds: int) -> int:
    """A default for ``max_client_connections``: the fd limit less ``other_fds`` and a headroom.

    Each client connection holds one descriptor; ``other_fds`` is what the
    engine pools may hold. The overflow connections for /health come on top.
    """
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, soft - other_fds - _FD_HEADROOM - OVERFLOW_CONNECTIONS)
