"""A small HTTP/1.1 server on trio streams, parsed by httptools.

Theory of operation: each connection runs two tasks in one nursery.

- The *reader* owns every receive on the socket. It feeds bytes to the
  httptools parser, whose callbacks build ``Request`` objects into a queue
  (pipelined requests queue up in order). It keeps reading while a handler
  runs, so a client that goes away (EOF or reset) is seen at once: the reader
  cancels the running handler's cancel scope. It stops reading while more than
  one request is queued (then it only watches for EOF), and it stops for good
  at the first protocol error, which it records for the dispatcher to answer.
- The *dispatcher* owns every send, except the interim ``100 Continue`` that
  the reader sends while the dispatcher is idle. It takes requests off the
  queue one at a time, runs the handler in its own cancel scope, makes sure a
  response went out, and decides whether the connection goes on.

The server's ``shutdown()`` stops the accept loops, wakes idle connections so
they close, and puts a deadline on the nursery that holds the connections, so
requests in flight may finish within the grace period and are cut after it.
"""

from __future__ import annotations

import errno
import http
import logging
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from email.utils import formatdate
from typing import Any, Protocol

import httptools
import msgspec
import trio

from narwhal.obs.logs import log_event
from narwhal.wire import error_json

__all__ = [
    "ClientDisconnected",
    "HTTPServer",
    "Handler",
    "Listener",
    "Request",
    "Responder",
    "ServerStatistics",
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


class Listener(Protocol):
    """What the server accepts from: trio's ``SocketListener`` or a wrapper closed through its ``socket``."""

    socket: trio.socket.SocketType

    async def accept(self) -> trio.SocketStream: ...

_STATUS_LINES = {
    status.value: b"HTTP/1.1 %d %b\r\n" % (status.value, status.phrase.encode("latin-1"))
    for status in http.HTTPStatus
}
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_CLOSE_HEADER = b"connection: close\r\n"
_KEEP_ALIVE_HEADER = b"connection: keep-alive\r\n"
_CHUNKED_HEADER = b"transfer-encoding: chunked\r\n"
_JSON_HEADERS = [(b"content-type", b"application/json")]
_CHUNK_TERMINATOR = b"0\r\n\r\n"


class ClientDisconnected(Exception):
    """The client closed or reset the connection before the response was written."""


class ServerStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of the server's load."""

    connections_open: int
    requests_in_flight: int
    requests_total: int


class Request:
    """One parsed request with its complete body."""

    __slots__ = (
        "body",
        "client",
        "headers",
        "http_version",
        "keep_alive",
        "method",
        "path",
        "query",
        "target",
    )

    def __init__(
        self,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]] | None = None,
        body: bytes = b"",
        http_version: str = "1.1",
        keep_alive: bool = True,
        client: tuple[str, int] | None = None,
    ) -> None:
        self.method = method
        self.target = target
        path, _, self.query = target.partition(b"?")
        self.path = path.decode("latin-1")
        self.headers = headers if headers is not None else []
        self.body = body
        self.http_version = http_version
        self.keep_alive = keep_alive
        self.client = client

    def get_header(self, name: bytes) -> bytes | None:
        """The value of the first header called ``name`` (lower-case), or None."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def __repr__(self) -> str:
        return f"<Request {self.method.decode()} {self.target.decode('latin-1')} HTTP/{self.http_version}>"


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

    async def start_stream(self, status: int, headers: list[tuple[bytes, bytes]], first: bytes = b"") -> None:
        """Send the head of a streamed response, with ``first`` as its first chunk, in one write."""
        self._begin()
        if self._request.http_version == "1.1":
            self._chunked = True
            chunk = b"%x\r\n%b\r\n" % (len(first), first) if first else b""
            head = self._head(status, headers, _CHUNKED_HEADER, chunk)
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
            data = b"%x\r\n%b\r\n0\r\n\r\n" % (len(last), last) if last else _CHUNK_TERMINATOR
        else:
            data = last
        if data:
            await self._conn.send(data)

    def _begin(self) -> None:
        if self.started:
            raise RuntimeError("the response has already started")
        if self._conn.disconnected:
            raise ClientDisconnected("the client has gone")
        self.started = True

    def _head(self, status: int, headers: list[tuple[bytes, bytes]], framing: bytes, payload: bytes) -> bytes:
        """The response head followed by ``payload``, joined into one buffer for one write."""
        conn = self._conn
        request = self._request
        if not request.keep_alive or conn.server._closing:
            self._closes = True
        if self._closes:
            connection = _CLOSE_HEADER
        elif request.http_version == "1.0":
            connection = _KEEP_ALIVE_HEADER
        else:
            connection = b""
        status_line = _STATUS_LINES.get(status) or b"HTTP/1.1 %d Unknown\r\n" % status
        lines = [status_line]
        for name, value in headers:
            lines.append(b"%b: %b\r\n" % (name, value))
        lines.append(conn.server._common_head_lines())
        lines.append(framing)
        lines.append(connection)
        lines.append(b"\r\n")
        lines.append(payload)
        return b"".join(lines)


class _ProtocolViolation(Exception):
    """Raised inside a parser callback to stop parsing; the reason is on the connection."""


class _Connection:
    """One client connection: the parser's callbacks, the reader and the dispatcher."""

    __slots__ = (
        "_body_parts",
        "_body_size",
        "_content_length",
        "_continue_pending",
        "_dispatcher_idle",
        "_dispatcher_lot",
        "_expect_continue",
        "_fatal",
        "_handler_scope",
        "_head_bytes",
        "_head_fed",
        "_headers",
        "_idle_scope",
        "_in_head",
        "_in_message",
        "_messages_begun",
        "_parser",
        "_queue",
        "_reader_lot",
        "_url",
        "client",
        "disconnected",
        "server",
        "stream",
    )

    def __init__(self, server: HTTPServer, stream: trio.SocketStream) -> None:
        self.server = server
        self.stream = stream
        try:
            peer = stream.socket.getpeername()
            self.client: tuple[str, int] | None = (peer[0], peer[1])
        except OSError:
            self.client = None
        self.disconnected = False
        self._parser = httptools.HttpRequestParser(self)
        self._queue: deque[Request] = deque()
        self._fatal: tuple[int, str, str] | None = None
        self._handler_scope: trio.CancelScope | None = None
        self._idle_scope: trio.CancelScope | None = None
        self._dispatcher_idle = False
        self._dispatcher_lot = trio.lowlevel.ParkingLot()
        self._reader_lot = trio.lowlevel.ParkingLot()
        self._continue_pending = False
        self._in_message = False
        self._in_head = False
        self._messages_begun = 0
        self._head_bytes = 0
        self._head_fed = 0
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body_parts: list[bytes] = []
        self._body_size = 0
        self._content_length: bytes | None = None
        self._expect_continue = False

    # ---- httptools callbacks: synchronous, called from feed_data ----

    def on_message_begin(self) -> None:
        self._in_message = True
        self._in_head = True
        self._messages_begun += 1
        self._head_bytes = 0
        self._head_fed = 0
        self._url = b""
        self._headers = []
        self._body_parts = []
        self._body_size = 0
        self._content_length = None
        self._expect_continue = False

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)
        if self._head_bytes > self.server._max_header_bytes:
            self._violation(431, "request header fields too large", "request_header_fields_too_large")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > self.server._max_header_bytes:
            self._violation(431, "request header fields too large", "request_header_fields_too_large")
        name = name.lower()
        self._headers.append((name, value))
        if name == b"content-length":
            self._content_length = value
        elif name == b"expect":
            self._expect_continue = value.lower() == b"100-continue"

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._expect_continue and self._parser.get_http_version() != "1.1":
            self._expect_continue = False  # HTTP/1.0 clients never get an interim response
        # llhttp has already rejected a malformed or duplicated content-length.
        if self._content_length is not None and int(self._content_length) > self.server._max_body_bytes:
            self._violation(413, "request body too large", "request_too_large")

    def on_body(self, body: bytes) -> None:
        self._body_size += len(body)
        if self._body_size > self.server._max_body_bytes:
            self._violation(413, "request body too large", "request_too_large")
        self._body_parts.append(body)

    def on_message_complete(self) -> None:
        parser = self._parser
        parts = self._body_parts
        body = parts[0] if len(parts) == 1 else b"".join(parts)
        # should_keep_alive() is only valid inside this callback.
        self._queue.append(
            Request(
                parser.get_method(),
                self._url,
                self._headers,
                body,
                parser.get_http_version(),
                parser.should_keep_alive(),
                self.client,
            )
        )
        self._in_message = False
        self._in_head = False
        # The client sent the body without waiting: no interim response is due.
        self._expect_continue = False
        self._continue_pending = False

    def _violation(self, status: int, message: str, code: str) -> None:
        self._fatal = (status, message, code)
        raise _ProtocolViolation(message)

    def _feed(self, data: bytes) -> None:
        """Parse ``data``; on a protocol error, record it in ``_fatal``."""
        begun = self._messages_begun
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            # Upgrades are not supported: the request was an ordinary one, and
            # whatever follows it is parsed as the next request.
            self._feed(data[upgrade.args[0] :])
            return
        except httptools.HttpParserError as exc:
            if self._fatal is None:
                self._fatal = (400, f"malformed HTTP request: {exc}", "malformed_request")
            return
        if self._in_head and self._messages_begun == begun:
            # The whole chunk belonged to one unfinished head; this also bounds a
            # single endless header line, which the callbacks never see.
            self._head_fed += len(data)
            if self._head_fed > self.server._max_header_bytes:
                self._fatal = (431, "request header fields too large", "request_header_fields_too_large")

    # ---- the reader task ----

    async def read_loop(self) -> None:
        """Receive and parse until EOF, a protocol error, or cancellation."""
        receive_some = self.stream.receive_some
        server = self.server
        while True:
            if len(self._queue) > 1:
                await self._wait_for_queue_space()
                if self.disconnected:
                    return
                continue
            try:
                data = await receive_some(_RECEIVE_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                self._client_gone()
                return
            if self._idle_scope is not None:
                self._idle_scope.deadline = trio.current_time() + server._idle_timeout_s
            self._feed(data)
            if self._fatal is not None:
                self._dispatcher_lot.unpark()
                return
            if self._queue:
                self._dispatcher_lot.unpark()
            if self._expect_continue and self._in_message:
                self._expect_continue = False
                # Only an idle connection may send the interim response now; else
                # the dispatcher sends it once the responses ahead of it are out.
                if self._dispatcher_idle and not self._queue:
                    await self._send_continue()
                else:
                    self._continue_pending = True

    async def _wait_for_queue_space(self) -> None:
        """Read nothing more while requests are queued, but notice EOF if it is next."""
        sock = self.stream.socket
        try:
            await trio.lowlevel.wait_readable(sock)
            if len(self._queue) <= 1:
                return
            peeked = await sock.recv(1, socket.MSG_PEEK)
        except OSError:
            peeked = b""
        if not peeked:
            self._client_gone()
            return
        # Unread requests sit before any EOF: wait until the dispatcher catches up.
        await self._reader_lot.park()

    async def _send_continue(self) -> None:
        try:
            await self.stream.send_all(_CONTINUE)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self._client_gone()

    def _client_gone(self) -> None:
        self.disconnected = True
        if self._handler_scope is not None:
            self._handler_scope.cancel()
        self._dispatcher_lot.unpark()

    # ---- sending (dispatcher and responders) ----

    async def send(self, data: bytes) -> None:
        """One socket write; ClientDisconnected if the client is gone."""
        if self.disconnected:
            raise ClientDisconnected("the client has gone")
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._client_gone()
            raise ClientDisconnected("the client has gone") from exc

    # ---- the dispatcher ----

    async def dispatch_loop(self) -> None:
        """Answer queued requests in order until the connection should close."""
        server = self.server
        queue = self._queue
        while True:
            while not queue:
                if self.disconnected:
                    return
                if self._fatal is not None:
                    await self._send_fatal()
                    return
                if server._closing and not self._in_message:
                    return
                if self._continue_pending:
                    self._continue_pending = False
                    await self._send_continue()
                    continue
                self._dispatcher_idle = True
                with trio.move_on_after(server._idle_timeout_s) as idle_scope:
                    self._idle_scope = idle_scope
                    await self._dispatcher_lot.park()
                self._idle_scope = None
                self._dispatcher_idle = False
                if idle_scope.cancelled_caught:
                    return
            if self.disconnected:
                return
            request = queue.popleft()
            self._reader_lot.unpark()
            if not await self._handle(request):
                return

    async def _handle(self, request: Request) -> bool:
        """Run the handler for one request; True when the connection may go on."""
        server = self.server
        responder = Responder(self, request)
        server._requests_in_flight += 1
        server._requests_total += 1
        failure: Exception | None = None
        try:
            with trio.CancelScope() as scope:
                self._handler_scope = scope
                await server._handler(request, responder)
        except* Exception as group:
            # except* lets a Cancelled that travels in the same group (the
            # shutdown deadline) go on while the handler's own errors stop here.
            failure = _unwrap(group)
        finally:
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

    async def _send_fatal(self) -> None:
        """Answer a protocol error with a JSON body, then close gracefully."""
        assert self._fatal is not None
        status, message, code = self._fatal
        body = error_json(message, type_="invalid_request_error", code=code)
        head = b"".join(
            [
                _STATUS_LINES[status],
                b"content-type: application/json\r\n",
                self.server._common_head_lines(),
                b"content-length: %d\r\n" % len(body),
                _CLOSE_HEADER,
                b"\r\n",
            ]
        )
        try:
            await self.stream.send_all(head + body)
            await self.stream.send_eof()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        with trio.move_on_after(_LINGER_S):
            drained = 0
            while drained < _LINGER_MAX_BYTES:
                try:
                    data = await self.stream.receive_some(_RECEIVE_SIZE)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return
                if not data:
                    return
                drained += len(data)

    def wake_for_shutdown(self) -> None:
        self._dispatcher_lot.unpark()


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
        server_name: bytes = b"narwhal",
    ) -> None:
        self._handler = handler
        self._max_header_bytes = max_header_bytes
        self._max_body_bytes = max_body_bytes
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
        try:
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
        finally:
            for listener in listeners:
                listener.socket.close()
            self._accept_scope = None
            self._connections_scope = None

    async def _accept_loop(self, listener: Listener, connections: trio.Nursery) -> None:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in _ACCEPT_CAPACITY_ERRNOS:
                    raise
                log_event("http_accept_error", level=logging.ERROR, message=str(exc), errno=exc.errno)
                await trio.sleep(_ACCEPT_BACKOFF_S)
                continue
            connections.start_soon(self._serve_connection, stream)

    async def _serve_connection(self, stream: trio.SocketStream) -> None:
        # trio already sets TCP_NODELAY on accepted streams; say so explicitly, the
        # hot path depends on it.
        try:
            stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, True)
        except OSError:
            pass
        conn = _Connection(self, stream)
        self._connections.add(conn)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(conn.read_loop)
                await conn.dispatch_loop()
                nursery.cancel_scope.cancel()
        except* Exception as group:
            exc = _unwrap(group)
            log_event(
                "http_connection_error", level=logging.ERROR, **{"class": type(exc).__name__}, message=str(exc)
            )
        finally:
            self._connections.discard(conn)
            await trio.aclose_forcefully(stream)

    def _common_head_lines(self) -> bytes:
        """The server and date headers; the date is formatted at most once a second."""
        now = int(time.time())
        if now != self._common_head_second:
            self._common_head_second = now
            self._common_head = self._server_header + b"date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
        return self._common_head
