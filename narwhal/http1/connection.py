"""One client connection's socket loop: it drives the connection's ``HTTP1Protocol``, runs the handler, writes.

The parsing, limits and deadlines are the protocol's (``protocol.py``, no
I/O); the framing of each response is its ``Responder``'s (``responder.py``).
Here is the socket I/O around them: receiving (a non-blocking ``read`` woken
by the server's readiness set, or trio's stream methods for TLS), sending (a
non-blocking ``write`` first, only the rest through ``send_all``), the 100
Continue, the handler's cancel scope, and the linger after a protocol error.
A connection sees its server only through its ``ServerContext``: the settings,
the shared state (shutting down, the readiness set) and the counters.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from email.utils import formatdate

import trio

from narwhal.errors import ClientGone
from narwhal.http1.alarm import Alarm
from narwhal.http1.protocol import HTTP1Protocol, Limits, Request, error_response
from narwhal.http1.readiness import Readiness, WaitExpired
from narwhal.http1.responder import Responder
from narwhal.http1.sockets import socket_of
from narwhal.http1.watchdogs import DisconnectWatch
from narwhal.obs.logs import log_event
from narwhal.wire import error_json

__all__ = ["ClientDisconnected", "Connection", "Handler", "ServerContext"]

RECEIVE_SIZE = 65536
# A connection closed after a protocol error keeps reading (and discarding) for
# a moment, so the error response is not lost to a TCP reset caused by unread
# request bytes.
LINGER_S = 1.0
LINGER_MAX_BYTES = 256 * 1024
# After an early 413 the rest of the upload is read and dropped, up to this many
# times max_body_bytes and within body_timeout_s, so that the client reads the
# 413 instead of a reset caused by unread bytes.
_DRAIN_413_FACTOR = 4
JSON_HEADERS = [(b"content-type", b"application/json")]
TOO_MANY_CONNECTIONS = error_json("too many client connections; only /health is served now",
                                  type_="service_unavailable", code="too_many_connections")
_INF = math.inf
# The raw send syscall of the fast path; a module-level name so tests can count or limit writes.
_write = os.write


class ClientDisconnected(ClientGone):
    """The client closed or reset the connection (or stopped reading) before the response was written."""


Handler = Callable[[Request, Responder], Awaitable[None]]


class ServerContext:
    """What a server shares with its connections: settings, state and counters, and nothing else of it."""

    __slots__ = ("_common_head", "_common_head_second", "_server_header", "client_write_timeout_s", "clients_stalled",
                 "closing", "disconnects", "gone_events", "handler", "idle_timeout_s", "limits", "overflow_paths",
                 "readiness", "requests_in_flight", "requests_total", "watchdog_alarm")

    def __init__(self, handler: Handler, *, limits: Limits, idle_timeout_s: float, client_write_timeout_s: float,
                 overflow_paths: frozenset[str], gone_events: int, server_name: bytes,
                 early_rounds: bool = True) -> None:
        self.handler = handler
        # What every connection's protocol enforces.
        self.limits = limits
        self.idle_timeout_s = idle_timeout_s
        self.client_write_timeout_s = client_write_timeout_s
        self.overflow_paths = overflow_paths
        # What the disconnect watches take for the client being gone (a FIN or not: ``half_close``).
        self.gone_events = gone_events
        # Every connection's socket, for the task that reads it and to see clients leave mid-request.
        self.readiness = Readiness(early_rounds=early_rounds)
        # When the write watchdog wakes next; a write that starts to wait may wake it sooner.
        self.watchdog_alarm = Alarm()
        # The fallback disconnect watch, for connections the readiness set could not take.
        self.disconnects = DisconnectWatch(gone_events)
        # Shutting down: idle connections close, responses say ``connection: close``.
        self.closing = False
        self.requests_in_flight = 0
        self.requests_total = 0
        self.clients_stalled = 0
        self._server_header = b"server: " + server_name + b"\r\n"
        self._common_head = b""
        self._common_head_second = -1

    def common_head_lines(self) -> bytes:
        """The server and date headers; the date is formatted at most once a second."""
        now = int(time.time())
        if now != self._common_head_second:
            self._common_head_second = now
            self._common_head = self._server_header + b"date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
        return self._common_head


class Connection:
    """The socket loop of one client connection: drives its ``HTTP1Protocol``, runs the handler, writes."""

    __slots__ = (
        "_client",
        "_drained",
        "_gone_reason",
        "_handling",
        "_idle",
        "_now",
        "_scope",
        "_watch",
        "context",
        "disconnected",
        "fd",
        "memo",
        "on_stall",
        "overflow",
        "protocol",
        "sock",
        "stream",
        "write_since",
    )

    def __init__(self, context: ServerContext, stream: trio.abc.Stream, *, overflow: bool = False,
                 accepted_at: float | None = None) -> None:
        self.context = context
        self.stream = stream
        # None for a stream with no socket under it (tests' memory streams).
        self.sock: trio.socket.SocketType | None = _socket_or_none(stream)
        # The plain socket's descriptor, for the syscall fast path; -1 (TLS, socketless streams) takes
        # the generic stream methods.
        self.fd = self.sock.fileno() if isinstance(stream, trio.SocketStream) and self.sock else -1
        # In the server's readiness set for the connection's whole life: it wakes this task when
        # bytes arrive, and sees the client go away mid-request (any stream: the TCP socket under it).
        self._watch = (context.readiness.watch(self.sock.fileno(), self.client_gone, context.gone_events)
                       if self.sock is not None else None)
        # Past the connection cap: only the overflow paths are served, one request.
        self.overflow = overflow
        self._gone_reason = "client_disconnected"
        # When the pending write to the client began (inf: none pending); the watchdog reads it.
        self.write_since = _INF
        # Set while the relay pump holds a write to this client that has to wait (``write_waits``):
        # called before a stalled client's stream closes, so that write fails with client_stalled too.
        self.on_stall: Callable[[], None] | None = None
        # Bytes to requests and responses to bytes; the first head is timed from the accept
        # (a TLS handshake included).
        # trio's clock read at its source (``trio.current_time`` is three calls deep): the same time.
        self._now = now = trio.lowlevel.current_clock().current_time
        self.protocol = HTTP1Protocol(context.limits, now, started_at=accepted_at, owner=self)
        self._client: tuple[str, int] | None = None
        self.disconnected = False
        # A handler is running: it runs in the connection's scope, which a client that leaves cancels.
        self._handling = False
        # The connection's scope: its deadline is the idle timeout while idle, +inf while handling.
        self._scope: trio.CancelScope | None = None
        self._idle = False
        # A new connection's request is usually there already: read before waiting.
        self._drained = False
        # The handler's memory of this connection between its requests (``Request.memo``): the front keeps
        # the client key it verified last, so a kept-alive client's next requests are not hashed again.
        self.memo: object = None

    @property
    def secure(self) -> bool:
        """The connection is TLS."""
        return isinstance(self.stream, trio.SSLStream)

    @property
    def peer_certified(self) -> bool:
        """The TLS peer presented a client certificate. Verified whenever presented: a server context asks
        for one only with ``serving.tls_client_ca_file``, and then requires it to verify (``CERT_REQUIRED``)."""
        stream = self.stream
        if not isinstance(stream, trio.SSLStream):
            return False
        try:
            return stream.getpeercert(binary_form=True) is not None
        except ValueError:
            # Before the handshake (never here: the server hands over only handshaken streams).
            return False

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
                and not self.context.closing and protocol.deadline() <= self._now()):
            # A head or body too slow: answered outside the scope its deadline cancelled.
            protocol.error = protocol.timeout_error()
            await self._send_error()

    async def _serve_requests(self, scope: trio.CancelScope) -> None:
        context = self.context
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
                if context.closing and not protocol.in_message:
                    return
                interim = protocol.interim_response()
                if interim is not None:
                    # Only now: the interim response may not overtake responses due ahead of it.
                    await self._send_interim(interim)
                    continue
                phase_deadline = protocol.deadline()
                wait_until = (phase_deadline if phase_deadline != _INF
                              else self._now() + context.idle_timeout_s)
                self._idle = True
                if self.fd >= 0 and self._watch is not None and context.readiness.expires_waits:
                    # The readiness set keeps the deadline (the server's watchdog expires it at its tick):
                    # no scope deadline to set and take back, two moves of trio's deadline heap a request.
                    try:
                        data = await self._receive(wait_until)
                    except WaitExpired:
                        scope.cancel()
                        data = b""
                else:
                    scope.deadline = wait_until
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
            if scope.deadline != _INF:
                scope.deadline = _INF
            request = queue.popleft()
            if not await self._handle(request):
                return
            protocol.response_sent()
            # The response just went out: the client's next request comes later, so wait first.
            self._drained = True

    async def _receive(self, deadline: float = _INF) -> bytes:
        """The next bytes from the client; b"" on EOF or a reset. ``deadline`` only through the readiness set."""
        fd = self.fd
        if fd < 0:
            try:
                return bytes(await self.stream.receive_some(RECEIVE_SIZE))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return b""
        watch = self._watch
        while True:
            if self._drained:
                if watch is not None:
                    await self.context.readiness.wait(watch, deadline)
                else:
                    await trio.lowlevel.wait_readable(fd)
            try:
                data = os.read(fd, RECEIVE_SIZE)
            except BlockingIOError:
                self._drained = True
                continue
            except OSError:
                return b""
            self._drained = len(data) < RECEIVE_SIZE
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
            self.context.readiness.forget(self._watch)
            self._watch = None

    def client_gone(self) -> None:
        """The client closed or reset: cancel the handler (if any); the connection ends."""
        self.disconnected = True
        if self._handling and self._scope is not None:
            self._scope.cancel()

    async def stalled(self) -> None:
        """The watchdog's verdict: the client stopped reading; close its stream to fail the pending write."""
        self._gone_reason = "client_stalled"
        context = self.context
        context.clients_stalled += 1
        peer = self.peer()
        log_event("http_client_stalled", level=logging.WARNING,
                  client=None if peer is None else f"{peer[0]}:{peer[1]}",
                  timeout_s=context.client_write_timeout_s)
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

    # ---- for the relay pump (``narwhal.http1.pump.ClientSocket``) ----

    def write_waits(self, on_stall: Callable[[], None]) -> None:
        """The pump holds a write that has to wait: the watchdog times it from now, like a blocked ``send``."""
        self._write_starts_to_wait()
        self.on_stall = on_stall

    def _write_starts_to_wait(self) -> None:
        """The watchdog times the pending write from now."""
        since = self.write_since = self._now()
        context = self.context
        context.watchdog_alarm.due(since + context.client_write_timeout_s)

    def write_done(self) -> None:
        """The pump's write that waited went out or was given up."""
        self.write_since = _INF
        self.on_stall = None

    def cut_mid_write(self) -> None:
        """Part of a chunk is out and the rest never will be: nothing more may follow on this connection."""
        self.disconnected = True

    # ---- sending (the connection task and responders) ----

    async def send(self, data: bytes) -> None:
        """One socket write, the slow part watched by the write timeout; ClientDisconnected if the client is gone."""
        if self.disconnected:
            raise self.gone_error()
        fd = self.fd
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
        self._write_starts_to_wait()
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
        context = self.context
        if self._watch is not None and self._watch.gone:
            # The client left before its request got here (the readiness set saw it).
            self.disconnected = True
        if self.disconnected:
            return False
        responder = Responder(self, request)
        if self.overflow:
            # Past the connection cap: one request, and only a health check is served.
            request.keep_alive = False
            if request.path not in context.overflow_paths:
                try:
                    await responder.respond(503, JSON_HEADERS, TOO_MANY_CONNECTIONS)
                except ClientDisconnected:
                    pass
                return False
        context.requests_in_flight += 1
        context.requests_total += 1
        failure: Exception | None = None
        # Not in the readiness set (it could not take the socket): watch for the client leaving only now.
        watching = self._watch is None and context.disconnects.watch(self)
        # No cancel scope of its own per request: the handler runs in the connection's scope, which
        # client_gone cancels while it runs; the Cancelled ends the connection in run().
        self._handling = True
        try:
            try:
                await context.handler(request, responder)
            except* Exception as group:
                # except* lets a Cancelled that travels in the same group (the client gone,
                # the shutdown deadline) go on while the handler's own errors stop here.
                failure = _unwrap(group)
        except BaseException:
            if self.disconnected and failure is not None and not _is_disconnect(failure):
                # The client left while the handler failed: that failure is logged all the same.
                _log_handler_error(request, failure)
            raise
        finally:
            self._handling = False
            if watching:
                context.disconnects.unwatch(self)
            context.requests_in_flight -= 1
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
                return responder.finished and not responder.closes
            try:
                await responder.respond(
                    500, JSON_HEADERS, error_json("internal server error", type_="server_error", code="internal_error")
                )
            except ClientDisconnected:
                return False
        return not responder.closes

    async def _send_error(self) -> None:
        """Answer a protocol error with a JSON body, then close gracefully."""
        error = self.protocol.error
        assert error is not None
        status = error[0]
        try:
            await self.send(error_response(error, self.context.common_head_lines()))
            if isinstance(self.stream, trio.abc.HalfCloseableStream):
                await self.stream.send_eof()
        except (ClientDisconnected, trio.BrokenResourceError, trio.ClosedResourceError):
            return
        linger_s, linger_bytes = LINGER_S, LINGER_MAX_BYTES
        if status == 413:
            # Read the rest of an oversized upload (bounded), so the client sees the 413, not a
            # reset; a client that stops sending for LINGER_S is done.
            limits = self.context.limits
            linger_s = limits.body_timeout_s
            linger_bytes = max(LINGER_MAX_BYTES, _DRAIN_413_FACTOR * limits.max_body_bytes)
        with trio.move_on_after(linger_s):
            drained = 0
            while drained < linger_bytes:
                data: bytes | bytearray = b""
                with trio.move_on_after(LINGER_S):
                    try:
                        data = await self.stream.receive_some(RECEIVE_SIZE)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        return
                if not data:
                    return
                drained += len(data)


def _socket_or_none(stream: trio.abc.Stream) -> trio.socket.SocketType | None:
    try:
        return socket_of(stream)
    except AttributeError:
        return None


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
