"""A keep-alive HTTP/1.1 engine client on trio streams, parsed with httptools.

The data pool's transport: one request at a time per connection, responses
framed by content-length, chunked encoding or connection close, and a LIFO
stack of idle connections per (host, port). It is deliberately small: on the
hot path every layer costs CPU per request (see perf-notes.md).

Every socket and parser problem leaves this module as one of its own errors;
``classify.py`` turns them into failure classes::

    HTTPTransportError
    +-- ConnectFailed        refused, unreachable, DNS
    +-- ConnectTimeout       no connection within connect_timeout_s
    +-- WriteTimeout         sending the request took longer than its timeout
    +-- ReadTimeout          one read took longer than the per-read timeout
    +-- DeadlineExpired      the caller's response deadline passed (first token, silence)
    +-- ConnectionClosed     EOF or reset; ``response_started`` says whether any
    |                        response byte had arrived
    +-- MalformedResponse    the engine's bytes are not HTTP/1.1
"""

from __future__ import annotations

import math
import select

import httptools
import msgspec
import trio

from narwhal.errors import NarwhalError

__all__ = [
    "ConnectFailed",
    "ConnectTimeout",
    "ConnectionClosed",
    "DeadlineExpired",
    "EngineConnection",
    "EngineConnections",
    "HTTPResponseHead",
    "HTTPTransportError",
    "MalformedResponse",
    "ReadTimeout",
    "WriteTimeout",
]

# Idle connections younger than this are reused without a liveness poll (see _take_idle).
_RECENTLY_IDLE_S = 1.0

_READ_SIZE = 65536
_INF = math.inf


class HTTPTransportError(NarwhalError):
    """A transport problem on an engine connection; ``cause`` names the original error."""

    def __init__(self, message: str, *, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


class ConnectFailed(HTTPTransportError):
    """The TCP connection could not be opened (refused, unreachable, DNS)."""


class ConnectTimeout(HTTPTransportError):
    """The TCP connection was not open within the connect timeout."""


class WriteTimeout(HTTPTransportError):
    """Sending the request did not finish within its timeout."""


class ReadTimeout(HTTPTransportError):
    """One read waited longer than the per-read timeout."""


class DeadlineExpired(HTTPTransportError):
    """The caller's absolute deadline for the next response bytes passed."""


class ConnectionClosed(HTTPTransportError):
    """The engine closed or reset the connection before the response was complete."""

    def __init__(self, message: str, *, cause: str, response_started: bool) -> None:
        super().__init__(message, cause=cause)
        self.response_started = response_started


class MalformedResponse(HTTPTransportError):
    """The engine sent bytes that do not parse as an HTTP/1.1 response."""


class HTTPResponseHead(msgspec.Struct, frozen=True):
    """Status and headers of a response; header names are lower-case."""

    status: int
    headers: list[tuple[bytes, bytes]]


def _cause_name(exc: BaseException) -> str:
    # trio wraps socket errors in BrokenResourceError; the OSError beneath says more.
    return type(exc.__cause__ or exc).__name__


def _first_attempt_error(exc: OSError) -> BaseException:
    # trio raises a generic OSError "all attempts ... failed" caused by a group of the
    # per-address errors; the first of those (ConnectionRefusedError, ...) says what happened.
    group = exc.__cause__
    if isinstance(group, BaseExceptionGroup) and group.exceptions:
        return group.exceptions[0]
    return exc


class EngineConnection:
    """One TCP connection to an engine and the response currently being read on it.

    It is also the httptools protocol object: the parser calls its ``on_*`` methods.
    """

    def __init__(self, stream: trio.SocketStream, key: tuple[str, int]) -> None:
        self.key = key
        self.idle_since = 0.0
        self.sent_at = 0.0
        self._stream = stream
        self._parser: httptools.HttpResponseParser | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._head: HTTPResponseHead | None = None
        self._body: list[bytes] = []
        self._response_started = False
        self._complete = False
        self._keep_alive = False
        self._broken = False

    # httptools callbacks -------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        assert self._parser is not None
        self._head = HTTPResponseHead(status=self._parser.get_status_code(), headers=self._headers)

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        assert self._parser is not None
        self._complete = True
        # should_keep_alive() is only meaningful inside this callback (perf-notes.md).
        self._keep_alive = self._parser.should_keep_alive()

    # state ------------------------------------------------------------------
    @property
    def reusable(self) -> bool:
        """The last response was read to its end and the engine keeps the connection open."""
        return self._complete and self._keep_alive and not self._broken

    def close(self) -> None:
        """Close the socket now; synchronous so release paths need no checkpoint."""
        self._broken = True
        self._parser = None
        self._stream.socket.close()

    def dropped_while_idle(self) -> bool:
        """True when an idle connection has something to read: EOF, a reset, or stray bytes."""
        poller = select.poll()
        poller.register(self._stream.socket.fileno(), select.POLLIN)
        return bool(poller.poll(0))

    # I/O ------------------------------------------------------------------
    async def send_request(self, request: bytes, *, timeout_s: float) -> None:
        """Send one complete request and get ready to parse its response."""
        self._parser = httptools.HttpResponseParser(self)
        self._headers = []
        self._head = None
        self._body = []
        self._response_started = self._complete = self._keep_alive = False
        with trio.move_on_after(timeout_s) as scope:
            try:
                await self._stream.send_all(request)
            except trio.BrokenResourceError as exc:
                self._broken = True
                raise ConnectionClosed("connection closed while sending the request",
                                       cause=_cause_name(exc), response_started=False) from exc
        if scope.cancelled_caught:
            self._broken = True
            raise WriteTimeout(f"request not sent within {timeout_s:g} s", cause="WriteTimeout")
        self.sent_at = trio.current_time()

    async def read_head(self, *, read_timeout_s: float, deadline: float = _INF,
                        deadline_message: str = "") -> HTTPResponseHead:
        """Read until the status line and headers are parsed."""
        while self._head is None:
            await self._receive(read_timeout_s, deadline, deadline_message)
        return self._head

    async def read_body(self, *, read_timeout_s: float = _INF, deadline: float = _INF,
                        deadline_message: str = "") -> bytes:
        """The body bytes of the next socket read(s) that carry any; b"" at the end of the body."""
        while not self._body:
            if self._complete:
                return b""
            await self._receive(read_timeout_s, deadline, deadline_message)
        data = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body.clear()
        return data

    async def read_body_to_end(self, *, read_timeout_s: float) -> bytes:
        """The whole remaining body."""
        parts = []
        while data := await self.read_body(read_timeout_s=read_timeout_s):
            parts.append(data)
        return b"".join(parts)

    async def _receive(self, read_timeout_s: float, deadline: float, deadline_message: str) -> None:
        read_by = trio.current_time() + read_timeout_s
        data = b""
        with trio.move_on_at(min(read_by, deadline)) as scope:
            try:
                data = await self._stream.receive_some(_READ_SIZE)
            except trio.BrokenResourceError as exc:
                self._broken = True
                raise ConnectionClosed("connection reset by the engine", cause=_cause_name(exc),
                                       response_started=self._response_started) from exc
        if scope.cancelled_caught:
            self._broken = True
            if deadline <= read_by:
                raise DeadlineExpired(deadline_message or "response deadline passed",
                                      cause="DeadlineExpired")
            raise ReadTimeout(f"no response bytes within {read_timeout_s:g} s", cause="ReadTimeout")
        if not data:
            self._end_of_file()
            return
        self._response_started = True
        assert self._parser is not None
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._broken = True
            if self._complete:
                # Our response is whole; the junk after it only makes the connection unusable.
                return
            raise MalformedResponse(f"malformed HTTP response: {exc}", cause=type(exc).__name__) from exc

    def _end_of_file(self) -> None:
        self._broken = True
        if self._head is None:
            where = "mid-status" if self._response_started else "before any response byte"
            raise ConnectionClosed(f"connection closed {where}", cause="EOF",
                                   response_started=self._response_started)
        if not self._complete:
            if not self._delimited_by_close():
                raise ConnectionClosed("connection closed mid-body", cause="EOF", response_started=True)
            # httptools has no finish(): a body framed by connection close ends here.
            self._complete = True
            self._keep_alive = False

    def _delimited_by_close(self) -> bool:
        for name, value in self._headers:
            if name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value.lower()):
                return False
        return True


class EngineConnections:
    """Idle keep-alive connections to engines: one LIFO stack per (host, port).

    Idle connections live ``idle_s`` (shorter than the engine's own keep-alive,
    vLLM/uvicorn's 5 s, so it never closes them under us). A reused connection
    that turns out closed before any response byte arrived is retried once on a
    fresh connection: the engine closed it between requests and never saw ours.
    """

    def __init__(self, *, idle_s: float = 4.0, connect_timeout_s: float = 2.0,
                 write_timeout_s: float = 60.0) -> None:
        self.idle_s = idle_s
        self.connect_timeout_s = connect_timeout_s
        self.write_timeout_s = write_timeout_s
        self.connections_opened = 0
        self._idle: dict[tuple[str, int], list[EngineConnection]] = {}
        self._closed = False

    @property
    def idle_connections(self) -> int:
        return sum(len(stack) for stack in self._idle.values())

    async def request(self, host: str, port: int, request: bytes, *, read_timeout_s: float,
                      head_deadline_s: float = _INF,
                      head_deadline_message: str = "") -> tuple[EngineConnection, HTTPResponseHead]:
        """Send ``request`` and read the response head; the caller must ``release`` the connection.

        ``head_deadline_s`` bounds the wait for the head, counted from when the
        request was sent; each read is also bounded by ``read_timeout_s``.
        """
        key = (host, port)
        conn = self._take_idle(key)
        if conn is not None:
            try:
                head = await self._exchange(conn, request, read_timeout_s, head_deadline_s,
                                            head_deadline_message)
            except ConnectionClosed as exc:
                if exc.response_started:
                    raise
                # Closed before any response byte: the engine dropped the idle
                # connection as we reused it. Fall through to one fresh attempt.
            else:
                return conn, head
        conn = await self._open(key)
        head = await self._exchange(conn, request, read_timeout_s, head_deadline_s, head_deadline_message)
        return conn, head

    def release(self, conn: EngineConnection) -> None:
        """Keep a connection whose response ended cleanly with keep-alive; close any other."""
        if self._closed or not conn.reusable:
            conn.close()
            return
        now = trio.current_time()
        conn.idle_since = now
        self._idle.setdefault(conn.key, []).append(conn)
        self._close_expired(now)

    async def aclose(self) -> None:
        """Close every idle connection; connections in use close when released."""
        self._closed = True
        for stack in self._idle.values():
            for conn in stack:
                conn.close()
        self._idle.clear()
        await trio.lowlevel.checkpoint()

    async def _exchange(self, conn: EngineConnection, request: bytes, read_timeout_s: float,
                        head_deadline_s: float, head_deadline_message: str) -> HTTPResponseHead:
        done = False
        try:
            await conn.send_request(request, timeout_s=self.write_timeout_s)
            head = await conn.read_head(read_timeout_s=read_timeout_s, deadline=conn.sent_at + head_deadline_s,
                                        deadline_message=head_deadline_message)
            done = True
            return head
        finally:
            if not done:
                conn.close()

    def _take_idle(self, key: tuple[str, int]) -> EngineConnection | None:
        stack = self._idle.get(key)
        if not stack:
            return None
        now = trio.current_time()
        cutoff = now - self.idle_s
        while stack:
            conn = stack.pop()
            if conn.idle_since <= cutoff:
                # LIFO: everything beneath is older still.
                conn.close()
                for older in stack:
                    older.close()
                stack.clear()
                return None
            # A connection idle for under a second is almost never closed by the engine;
            # the poll(2) is skipped for it, and the retry-once-on-a-fresh-connection covers the rare case.
            if now - conn.idle_since < _RECENTLY_IDLE_S or not conn.dropped_while_idle():
                return conn
            conn.close()
        return None

    def _close_expired(self, now: float) -> None:
        cutoff = now - self.idle_s
        for stack in self._idle.values():
            expired = 0
            while expired < len(stack) and stack[expired].idle_since <= cutoff:
                stack[expired].close()
                expired += 1
            if expired:
                del stack[:expired]

    async def _open(self, key: tuple[str, int]) -> EngineConnection:
        host, port = key
        with trio.move_on_after(self.connect_timeout_s) as scope:
            try:
                stream = await trio.open_tcp_stream(host, port)
            except OSError as exc:
                first = _first_attempt_error(exc)
                raise ConnectFailed(f"cannot connect to {host}:{port}: {first}", cause=type(first).__name__) from exc
        if scope.cancelled_caught:
            raise ConnectTimeout(f"no connection to {host}:{port} within {self.connect_timeout_s:g} s",
                                 cause="ConnectTimeout")
        self.connections_opened += 1
        return EngineConnection(stream, key)
