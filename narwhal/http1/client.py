"""A keep-alive HTTP/1.1 engine client on trio streams, parsed with httptools.

The data pool's transport: one request at a time per connection, responses
framed by content-length, chunked encoding or connection close, and a LIFO
stack of idle connections per (host, port). It is deliberately small: on the
hot path every layer costs CPU per request (docs/stack.md).

Every socket and parser problem leaves this module as one of its own errors;
``classify.py`` turns them into failure classes::

    HTTPTransportError
    +-- ConnectFailed        refused, unreachable, DNS
    +-- ConnectTimeout       no connection (TCP and TLS handshake) within connect_timeout_s
    +-- TLSFailed            the TLS handshake failed: untrusted or expired certificate,
    |                        wrong host name, handshake refused
    +-- WriteTimeout         sending the request took longer than its timeout
    +-- ReadTimeout          one read took longer than the per-read timeout
    +-- DeadlineExpired      the caller's response deadline passed (first token, silence)
    +-- ConnectionClosed     EOF or reset (or a TLS alert after the handshake, as
    |                        when an engine rejects our client certificate under
    |                        TLS 1.3); ``response_started`` says whether any
    |                        response byte had arrived
    +-- MalformedResponse    the engine's bytes are not HTTP/1.1
    +-- ResponseTooLarge     the head or a buffered body passed its bound
    +-- LocalResourceError   our own process ran out of fds, memory or buffers
                             while connecting (EMFILE, ENFILE, ENOMEM, ENOBUFS)
"""

from __future__ import annotations

import collections
import errno
import math
import os
import select
import ssl
from collections.abc import Callable
from typing import NoReturn

import httptools
import msgspec
import trio

from narwhal.errors import NarwhalError
from narwhal.http1.readiness import Readiness, WaitExpired, Watch
from narwhal.http1.sockets import socket_of
from narwhal.tls import tls_reason

__all__ = [
    "ConnectFailed",
    "ConnectTimeout",
    "ConnectionClosed",
    "DeadlineExpired",
    "EngineConnection",
    "EngineConnections",
    "HTTPResponseHead",
    "HTTPTransportError",
    "LocalResourceError",
    "MalformedResponse",
    "ReadTimeout",
    "ResponseTooLarge",
    "TLSFailed",
    "WriteTimeout",
    "local_errno_name",
    "via_line",
]

# Idle connections younger than this are reused without a liveness poll (see _take_idle).
_RECENTLY_IDLE_S = 1.0

_READ_SIZE = 65536
_INF = math.inf
# A relay whose reads never block yields to the scheduler after this many reads in a row.
_UNBLOCKED_READS_PER_CHECKPOINT = 16
# Module-level names for the raw syscalls: the fast path's only I/O, and what tests replace.
_read = os.read
_os_read = os.read
_write = os.write
# Default bound on a response's status line and headers (engine.max_response_header_bytes).
DEFAULT_MAX_HEAD_BYTES = 64 * 1024
# Errors of our own process, not of the engine we were connecting to.
_LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})


def via_line(via: str | None) -> bytes:
    """The ``via`` header line (``b"\\r\\nvia: ..."``) every engine request carries, or b"" without one."""
    if via is None:
        return b""
    if not via.isascii() or any(c in via for c in "\r\n"):
        raise ValueError(f"unsafe via header: {via!r}")
    return b"\r\nvia: " + via.encode("ascii")


class HTTPTransportError(NarwhalError):
    """A transport problem on an engine connection; ``cause`` names the original error."""

    def __init__(self, message: str, *, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


class ConnectFailed(HTTPTransportError):
    """The TCP connection could not be opened (refused, unreachable, DNS)."""


class ConnectTimeout(HTTPTransportError):
    """The TCP connection was not open within the connect timeout."""


class TLSFailed(HTTPTransportError):
    """The TLS handshake with the engine failed; the message carries the TLS reason."""


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


class ResponseTooLarge(HTTPTransportError):
    """The response head or a body the caller buffers passed its size bound; the connection is dropped."""


class LocalResourceError(HTTPTransportError):
    """Connecting failed for lack of our own resources; ``errno_name`` says which (EMFILE, ...)."""

    def __init__(self, message: str, *, cause: str, errno_name: str) -> None:
        super().__init__(message, cause=cause)
        self.errno_name = errno_name


class HTTPResponseHead(msgspec.Struct, frozen=True):
    """Status and headers of a response; header names are lower-case."""

    status: int
    headers: list[tuple[bytes, bytes]]


def _cause_name(exc: BaseException) -> str:
    # trio wraps socket errors in BrokenResourceError; the OSError beneath says more.
    return type(exc.__cause__ or exc).__name__


def _closed_message(plain: str, exc: BaseException) -> str:
    """``plain``, or with the TLS reason when the engine ended the connection with a TLS alert."""
    reason = tls_reason(exc)
    return f"{plain} (TLS: {reason})" if reason else plain


def _first_attempt_error(exc: OSError) -> BaseException:
    # trio raises a generic OSError "all attempts ... failed" caused by a group of the
    # per-address errors; the first of those (ConnectionRefusedError, ...) says what happened.
    group = exc.__cause__
    if isinstance(group, BaseExceptionGroup) and group.exceptions:
        return group.exceptions[0]
    return exc


def local_errno_name(exc: BaseException) -> str | None:
    """EMFILE, ENFILE, ENOMEM or ENOBUFS when ``exc`` is our own process running short, else None."""
    seen: BaseException | None = exc
    # Through wrappers (httpx, httpcore, trio's "all attempts failed" and its group); bounded.
    for _ in range(16):
        if seen is None:
            return None
        if isinstance(seen, OSError) and seen.errno in _LOCAL_ERRNOS:
            return errno.errorcode[seen.errno]
        if isinstance(seen, BaseExceptionGroup) and seen.exceptions:
            seen = seen.exceptions[0]
        else:
            seen = seen.__cause__ or seen.__context__
    return None


class EngineConnection:
    """One TCP connection to an engine and the response currently being read on it.

    It is also the httptools protocol object: the parser calls its ``on_*`` methods.
    """

    # Slots: the relay pump's C twin reads and writes the relay's fields at their offsets.
    __slots__ = ("_body", "_broken", "_complete", "_drained", "_fd", "_head", "_headers", "_interrupted", "_keep_alive",
                 "_now", "_parser", "_readiness", "_received", "_response_started", "_stream", "_unblocked", "_watch",
                 "_wire_limit", "idle_seq", "idle_since", "key", "max_head_bytes", "on_body", "sent_at",
                 "waiting_since")

    def __init__(self, stream: trio.abc.Stream, key: tuple[str, int], *,
                 max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES, readiness: Readiness | None = None) -> None:
        self.key = key
        self.max_head_bytes = max_head_bytes
        self.idle_since = 0.0
        # Which release put it in the idle pool (0: not idle), so a stale expiry entry is skipped.
        self.idle_seq = 0
        self.sent_at = 0.0
        # While the relay waits for the engine: when that wait began (for the silence watchdog).
        self.waiting_since = _INF
        # trio's clock read at its source (``trio.current_time`` is three calls deep): the same time.
        self._now = trio.lowlevel.current_clock().current_time
        self._stream = stream
        # Plain sockets get the syscall fast path; any other trio Stream (TLS) the generic one.
        self._fd = stream.socket.fileno() if isinstance(stream, trio.SocketStream) else -1
        # True when the last read was short: the socket is drained, so wait before reading again.
        self._drained = True
        self._unblocked = 0
        # Plain sockets wait through the pool's readiness set when it runs (no epoll_ctl per wait).
        self._readiness = readiness
        self._watch = readiness.watch(self._fd) if readiness is not None and self._fd >= 0 else None
        self._parser: httptools.HttpResponseParser | None = None
        self._headers: list[tuple[bytes, bytes]] = []
        self._head: HTTPResponseHead | None = None
        # One list for the connection's life (cleared, never replaced): httptools looks its callbacks up once
        # per parser, and the list's own append as ``on_body`` is a C call per body chunk, with no Python frame
        # (an unpaced answer's read brings a chunk per token).
        self._body: list[bytes] = []
        self.on_body = self._body.append
        self._response_started = False
        self._complete = False
        self._keep_alive = False
        self._broken = False
        # Bytes received for the current response: the head bound reads it before the head is parsed.
        self._received = 0
        self._wire_limit: float = _INF
        # A watchdog's failure for the relay's reads (``interrupt``): every later relay read raises it.
        self._interrupted: HTTPTransportError | None = None

    # httptools callbacks -------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        # Trailers (after the head) are dropped: nothing reads them, and they must not grow a list.
        if self._head is None:
            self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        assert self._parser is not None
        self._head = HTTPResponseHead(status=self._parser.get_status_code(), headers=self._headers)

    def on_message_complete(self) -> None:
        assert self._parser is not None
        self._complete = True
        # should_keep_alive() is only meaningful inside this callback (docs/stack.md, "Traps").
        self._keep_alive = self._parser.should_keep_alive()

    # state ------------------------------------------------------------------
    @property
    def ended(self) -> bool:
        """The response was read to its end and every body byte handed out: nothing is left to read for it."""
        return self._complete and not self._body

    @property
    def reusable(self) -> bool:
        """The last response was read to its end and the engine keeps the connection open."""
        return self._complete and self._keep_alive and not self._broken

    def close(self) -> None:
        """Close the socket now; synchronous so release paths need no checkpoint."""
        self._broken = True
        self._parser = None
        self._fd = -1
        if self._watch is not None:
            assert self._readiness is not None
            self._readiness.forget(self._watch)
            self._watch = None
        socket_of(self._stream).close()

    @property
    def closed_by_engine(self) -> bool:
        """The engine closed or reset the connection (seen by the readiness set; False without one)."""
        return self._watch is not None and self._watch.gone

    async def _wait_readable(self, deadline: float = _INF) -> None:
        if self._watch is not None:
            assert self._readiness is not None
            await self._readiness.wait(self._watch, deadline)
        else:
            await trio.lowlevel.wait_readable(self._fd)

    def interrupt(self, error: HTTPTransportError) -> bool:
        """End the relay's reads with ``error`` (a stream deadline passed): raised at once in a task waiting in
        ``read_relay_body``, through the relay pump's next read when the pump owns the socket, else at the next
        relay read. False off the readiness set (TLS): only a cancel scope reaches a wait inside trio.
        """
        watch = self._watch
        if watch is None or self._fd < 0:
            return False
        self._interrupted = error
        self._broken = True
        assert self._readiness is not None
        if not self._readiness.interrupt(watch, error) and watch.handler is not None:
            # The pump owns the socket: the read it makes now raises the error and hands it to the request task.
            watch.handler(0)
        return True

    def dropped_while_idle(self) -> bool:
        """True when an idle connection has something to read: EOF, a reset, or stray bytes."""
        poller = select.poll()
        poller.register(socket_of(self._stream).fileno(), select.POLLIN)
        return bool(poller.poll(0))

    # I/O ------------------------------------------------------------------
    async def send_request(self, request: bytes, *, timeout_s: float) -> None:
        """Send one complete request and get ready to parse its response."""
        self._parser = httptools.HttpResponseParser(self)
        self._headers = []
        self._head = None
        self._body.clear()
        self._received = 0
        self._response_started = self._complete = self._keep_alive = False
        # Nothing of the response can be there yet: the first read waits for it.
        self._drained = True
        rest: bytes | memoryview = request
        fd = self._fd
        if fd >= 0:
            # The kernel almost always takes a whole request at once: then no scope and no trip
            # through the scheduler (P2 in docs/benchmarks.md).
            try:
                sent = _write(fd, request)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                self._broken = True
                # The engine may have answered before closing (413 for a body over its limit).
                self.sent_at = self._now()
                raise ConnectionClosed("connection closed while sending the request",
                                       cause=type(exc).__name__, response_started=False) from exc
            rest = memoryview(request)[sent:] if sent else request
        if rest:
            answered = False
            with trio.move_on_after(timeout_s) as scope:
                if fd >= 0:
                    answered = await self._send_unless_answered(rest)
                else:
                    # TLS: the socket turns readable for the protocol's own records (session
                    # tickets), which are no answer; a refused upload there waits for the timeout.
                    await self._send_all_or_closed(rest)
            if scope.cancelled_caught:
                self._broken = True
                raise WriteTimeout(f"request not sent within {timeout_s:g} s", cause="WriteTimeout")
            if answered:
                # The caller reads that answer (_early_response); the unsent rest makes the connection unusable.
                self._broken = True
                self.sent_at = self._now()
                raise ConnectionClosed("the engine answered or closed before the request was sent",
                                       cause="AnsweredEarly", response_started=False)
        self.sent_at = self._now()

    async def _send_unless_answered(self, data: bytes | memoryview) -> bool:
        """Send ``data``; True if the engine answered (or closed) first and the sending stopped.

        Only requests the kernel did not take at once come here (large bodies): an
        engine that refuses one (413) and then neither reads nor closes would
        otherwise hold us until the write timeout and look like a slow engine.
        """
        answered = sent = False
        failure: trio.BrokenResourceError | None = None
        async with trio.open_nursery() as race:

            async def watch() -> None:
                nonlocal answered
                await trio.lowlevel.wait_readable(socket_of(self._stream))
                answered = True
                race.cancel_scope.cancel()

            race.start_soon(watch)
            try:
                await self._stream.send_all(data)
                sent = True
            except trio.BrokenResourceError as exc:
                failure = exc
            race.cancel_scope.cancel()
        if failure is not None:
            self._closed_while_sending(failure)
        return answered and not sent

    async def _send_all_or_closed(self, data: bytes | memoryview) -> None:
        try:
            await self._stream.send_all(data)
        except trio.BrokenResourceError as exc:
            self._closed_while_sending(exc)

    def _closed_while_sending(self, exc: trio.BrokenResourceError) -> NoReturn:
        self._broken = True
        # The engine may have answered before closing (413 for a body over its limit).
        self.sent_at = self._now()
        raise ConnectionClosed(_closed_message("connection closed while sending the request", exc),
                               cause=_cause_name(exc), response_started=False) from exc

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

    async def read_body_to_end(self, *, read_timeout_s: float, max_bytes: float = _INF) -> bytes:
        """The whole remaining body; ResponseTooLarge (connection dropped) past ``max_bytes``.

        A declared content-length over the bound fails before any body byte is read;
        chunked and close-delimited bodies fail at the read that crosses it. The
        wire bytes are bounded too (8x the body bound), so endless trailers or
        one-byte chunks cannot run on under a small body.
        """
        declared = self.content_length()
        if declared is not None and declared > max_bytes:
            self.close()
            raise ResponseTooLarge(f"response body of {declared} bytes is over the {max_bytes} byte bound",
                                   cause="ResponseTooLarge")
        # Checked by _receive: trailers and chunk framing carry no body bytes to count here.
        self._wire_limit = self._received + 8 * max_bytes + self.max_head_bytes
        parts = []
        size = 0
        try:
            while data := await self.read_body(read_timeout_s=read_timeout_s):
                size += len(data)
                if size > max_bytes:
                    self.close()
                    raise ResponseTooLarge(f"response body over the {max_bytes} byte bound",
                                           cause="ResponseTooLarge")
                parts.append(data)
        finally:
            self._wire_limit = _INF
        return b"".join(parts)

    def content_length(self) -> int | None:
        """The response's declared content-length, if any."""
        for name, value in self._headers:
            if name == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return None
        return None

    async def read_relay_body(self) -> bytes:
        """The body bytes of the next read(s), b"" at its end; for a relay whose deadlines a watchdog keeps.

        No cancel scope and no deadline per read: a watchdog ends the wait from
        outside when the engine is silent too long (``waiting_since`` says since
        when it has been waited for): ``interrupt`` on a plain socket, a cancel of
        the caller's scope on TLS. The socket is read first and waited for only
        after a short read; every few reads that did not wait, it yields.
        """
        body = self._body
        fd = self._fd
        while not body:
            if self._complete:
                return b""
            if self._interrupted is not None:
                raise self._interrupted
            if fd < 0:
                self.waiting_since = self._now()
                try:
                    await self._receive(_INF, _INF, "")
                finally:
                    self.waiting_since = _INF
                continue
            if self._drained:
                self.waiting_since = self._now()
                try:
                    await self._wait_readable()
                finally:
                    self.waiting_since = _INF
                self._unblocked = 0
            else:
                self._unblocked += 1
                if self._unblocked >= _UNBLOCKED_READS_PER_CHECKPOINT:
                    self._unblocked = 0
                    await trio.lowlevel.checkpoint()
            data = self._read_now()
            if data is not None:
                self._parse(data)
        data = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        return data

    @property
    def relay_watch(self) -> Watch | None:
        """The socket's place in the readiness set, for a relay pump to own; None off the fast path (TLS)."""
        return self._watch if self._fd >= 0 else None

    def relay_body_ready(self, readable: bool) -> bytes | None:
        """``read_relay_body`` without waiting: the next body bytes, b"" at the end, None if it would wait.

        ``readable``: an edge just said the socket has bytes, so it is read even after
        a short read. At most one read that finds nothing; never a wait. The usual
        read (body bytes, the head long parsed, no wire bound) is read and parsed here,
        with no call of its own: this is the relay pump's per-token path.
        """
        body = self._body
        if readable:
            self._drained = False
        while not body:
            if self._complete:
                return b""
            if self._interrupted is not None:
                raise self._interrupted
            if self._drained:
                return None
            try:
                data = _read(self._fd, _READ_SIZE)
            except BlockingIOError:
                self._drained = True
                return None
            except OSError as exc:
                self.relay_failed(exc)
            size = len(data)
            self._drained = size < _READ_SIZE
            if size and self._wire_limit == _INF and self._head is not None:
                # _parse's work for a read that no bound can refuse: only httptools can.
                self._received += size
                assert self._parser is not None
                try:
                    self._parser.feed_data(data)
                except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
                    self.relay_failed(exc)
            else:
                self._parse(data)
        data = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        return data

    def relay_failed(self, exc: Exception) -> None:
        """A plain read's ``OSError`` (ConnectionClosed) or its parse's httptools error (MalformedResponse,
        unless the response is whole: the junk after it only makes the connection unusable), raised as ours."""
        self._broken = True
        if isinstance(exc, OSError):
            raise ConnectionClosed("connection reset by the engine", cause=type(exc).__name__,
                                   response_started=self._response_started) from exc
        if not self._complete:
            raise MalformedResponse(f"malformed HTTP response: {exc}", cause=type(exc).__name__) from exc

    def relay_parts(self) -> tuple[Callable[[bytes], object], list[bytes], int, int] | None:
        """The parser's feed, the body list, the read size and the socket, for the C relay's reads of the
        body (``relay_body_ready``'s usual read); None off that path (TLS, a test's stand-in for ``read``)."""
        if self._fd < 0 or self._parser is None or _read is not _os_read:
            return None
        return self._parser.feed_data, self._body, _READ_SIZE, self._fd

    @property
    def drained(self) -> bool:
        """The last read was short and the body goes on: nothing to do until the socket's next edge.

        A body that ended in that read (its last bytes and the chunked terminator together) is never
        drained: no edge comes for an end already read, so the relay must take it now.
        """
        return self._drained and not self._body and not self._complete

    def _read_now(self) -> bytes | None:
        """One non-blocking read; None when there was nothing to read after all."""
        try:
            data = _read(self._fd, _READ_SIZE)
        except BlockingIOError:
            self._drained = True
            return None
        except OSError as exc:
            self.relay_failed(exc)
        self._drained = len(data) < _READ_SIZE
        return data

    async def _receive(self, read_timeout_s: float, deadline: float, deadline_message: str) -> None:
        fd = self._fd
        data: bytes | None = None
        if fd >= 0 and not self._drained:
            data = self._read_now()
        if data is None:
            read_by = self._now() + read_timeout_s if read_timeout_s < _INF else _INF
            if read_by == deadline == _INF:
                # Only the caller's scope bounds it (the control pool's, around the whole call): no scope of its own.
                data = await self._wait_data(fd)
            elif self._watch is not None and self._readiness is not None and self._readiness.expires_waits:
                # The readiness set keeps the deadline (its timer's tick): no scope of its own either.
                expires = min(read_by, deadline)
                try:
                    data = await self._wait_data(fd, expires)
                except WaitExpired:
                    self._broken = True
                    raise self._expired(read_timeout_s, read_by, deadline, deadline_message) from None
            else:
                with trio.move_on_at(min(read_by, deadline)) as scope:
                    data = await self._wait_data(fd)
                if scope.cancelled_caught:
                    self._broken = True
                    raise self._expired(read_timeout_s, read_by, deadline, deadline_message)
        assert data is not None
        self._parse(data)

    @staticmethod
    def _expired(read_timeout_s: float, read_by: float, deadline: float, deadline_message: str) -> HTTPTransportError:
        """The failure of a read whose time ran out: the caller's deadline, or the per-read timeout."""
        if deadline <= read_by:
            return DeadlineExpired(deadline_message or "response deadline passed", cause="DeadlineExpired")
        return ReadTimeout(f"no response bytes within {read_timeout_s:g} s", cause="ReadTimeout")

    async def _wait_data(self, fd: int, deadline: float = _INF) -> bytes:
        """The next bytes the engine sends (b"" at its end of file); ``deadline`` only through the readiness set."""
        try:
            if fd >= 0:
                while True:
                    await self._wait_readable(deadline)
                    data = self._read_now()
                    if data is not None:
                        return data
            return bytes(await self._stream.receive_some(_READ_SIZE))
        except trio.BrokenResourceError as exc:
            self._broken = True
            raise ConnectionClosed(_closed_message("connection reset by the engine", exc),
                                   cause=_cause_name(exc), response_started=self._response_started) from exc

    def _parse(self, data: bytes) -> None:
        if not data:
            self._end_of_file()
            return
        self._response_started = True
        self._received += len(data)
        assert self._parser is not None
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._broken = True
            if self._complete:
                # Our response is whole; the junk after it only makes the connection unusable.
                return
            raise MalformedResponse(f"malformed HTTP response: {exc}", cause=type(exc).__name__) from exc
        if self._received > self._wire_limit:
            self.close()
            raise ResponseTooLarge(f"response (trailers, chunk framing) over its {self._wire_limit:g} byte wire bound",
                                   cause="ResponseTooLarge")
        if self._head is None and self._received > self.max_head_bytes:
            # Every byte so far belongs to the head; httptools would buffer an endless one.
            self.close()
            raise ResponseTooLarge(f"response head over the {self.max_head_bytes} byte bound",
                                   cause="ResponseTooLarge")

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
                 write_timeout_s: float = 60.0, max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES,
                 ssl_context: ssl.SSLContext | None = None, readiness: Readiness | None = None) -> None:
        self.readiness = readiness
        self.idle_s = idle_s
        # For ``tls=True`` requests; read at each new connection, so assigning a new
        # context (a reload) changes new handshakes only.
        self.ssl_context = ssl_context
        self.max_head_bytes = max_head_bytes
        self.connect_timeout_s = connect_timeout_s
        self.write_timeout_s = write_timeout_s
        self.connections_opened = 0
        # trio.current_time, or the running clock's own method once the pool runs (``DataPool.run``).
        self.clock: Callable[[], float] = trio.current_time
        self._idle: dict[tuple[str, int], list[EngineConnection]] = {}
        # Every release in order, oldest first (idle_since, idle_seq, connection): expiry reads only the
        # expired end, not one stack per engine. Bounded by the releases of one idle_s; stale entries
        # (taken or closed since) are skipped as they come up.
        self._expiry: collections.deque[tuple[float, int, EngineConnection]] = collections.deque()
        self._releases = 0
        self._closed = False

    @property
    def idle_connections(self) -> int:
        return sum(len(stack) for stack in self._idle.values())

    async def request(self, host: str, port: int, request: bytes, *, read_timeout_s: float,
                      head_deadline_s: float = _INF, head_deadline_message: str = "",
                      tls: bool = False) -> tuple[EngineConnection, HTTPResponseHead]:
        """Send ``request`` and read the response head; the caller must ``release`` the connection.

        ``head_deadline_s`` bounds the wait for the head, counted from when the
        request was sent; each read is also bounded by ``read_timeout_s``. With
        ``tls`` a new connection is TLS, verified against ``host``.
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
        conn = await self._open(key, tls)
        head = await self._exchange(conn, request, read_timeout_s, head_deadline_s, head_deadline_message)
        return conn, head

    def release(self, conn: EngineConnection) -> None:
        """Keep a connection whose response ended cleanly with keep-alive; close any other."""
        if self._closed or not conn.reusable:
            conn.close()
            return
        now = self.clock()
        conn.idle_since = now
        self._releases += 1
        conn.idle_seq = self._releases
        self._idle.setdefault(conn.key, []).append(conn)
        self._expiry.append((now, self._releases, conn))
        self._close_expired(now)

    async def aclose(self) -> None:
        """Close every idle connection; connections in use close when released."""
        self._closed = True
        for stack in self._idle.values():
            for conn in stack:
                conn.idle_seq = 0
                conn.close()
        self._idle.clear()
        self._expiry.clear()
        await trio.lowlevel.checkpoint()

    async def _exchange(self, conn: EngineConnection, request: bytes, read_timeout_s: float,
                        head_deadline_s: float, head_deadline_message: str) -> HTTPResponseHead:
        done = False
        try:
            try:
                await conn.send_request(request, timeout_s=self.write_timeout_s)
            except ConnectionClosed:
                head = await self._early_response(conn, read_timeout_s)
                if head is None:
                    raise
                # The engine refused the request before reading it all: its answer is what counts.
                done = True
                return head
            head = await conn.read_head(read_timeout_s=read_timeout_s, deadline=conn.sent_at + head_deadline_s,
                                        deadline_message=head_deadline_message)
            done = True
            return head
        finally:
            if not done:
                conn.close()

    @staticmethod
    async def _early_response(conn: EngineConnection, read_timeout_s: float) -> HTTPResponseHead | None:
        """After a failed write: the head of a response the engine sent first, or None.

        The kernel keeps bytes that arrived before a reset, so the answer (often a
        413 sent before closing) is still readable; no answer leaves the write
        error to stand, with its retry-on-a-fresh-connection rule.
        """
        try:
            return await conn.read_head(read_timeout_s=read_timeout_s)
        except HTTPTransportError:
            return None

    def _take_idle(self, key: tuple[str, int]) -> EngineConnection | None:
        stack = self._idle.get(key)
        if not stack:
            return None
        now = self.clock()
        cutoff = now - self.idle_s
        while stack:
            conn = stack.pop()
            conn.idle_seq = 0
            if conn.idle_since <= cutoff:
                # LIFO: everything beneath is older still.
                conn.close()
                for older in stack:
                    older.idle_seq = 0
                    older.close()
                stack.clear()
                return None
            # The readiness set, when it runs, has already seen an engine's close: no syscall.
            # A connection idle for under a second is almost never closed by the engine;
            # the poll(2) is skipped for it, and the retry-once-on-a-fresh-connection covers the rare case.
            if not conn.closed_by_engine and (now - conn.idle_since < _RECENTLY_IDLE_S
                                              or not conn.dropped_while_idle()):
                return conn
            conn.close()
        return None

    def _close_expired(self, now: float) -> None:
        """Close every idle connection idle since ``now - idle_s`` or earlier: O(expired), not O(engines)."""
        cutoff = now - self.idle_s
        expiry = self._expiry
        while expiry and expiry[0][0] <= cutoff:
            _, seq, conn = expiry.popleft()
            if conn.idle_seq != seq:
                continue  # taken (or closed) since this release
            conn.idle_seq = 0
            conn.close()
            stack = self._idle[conn.key]
            # Releases come in time order and takes pop the newest: the expired one is its stack's oldest.
            if stack[0] is conn:
                del stack[0]
            else:
                stack.remove(conn)

    async def _open(self, key: tuple[str, int], tls: bool = False) -> EngineConnection:
        host, port = key
        stream: trio.SocketStream | None = None
        secure: trio.SSLStream[trio.SocketStream] | None = None
        # One deadline for the TCP connect and the TLS handshake together.
        with trio.move_on_after(self.connect_timeout_s) as scope:
            try:
                stream = await trio.open_tcp_stream(host, port)
            except OSError as exc:
                first = _first_attempt_error(exc)
                local = local_errno_name(first)
                if local is not None:
                    raise LocalResourceError(f"cannot open a connection to {host}:{port}: {first}",
                                             cause=type(first).__name__, errno_name=local) from exc
                raise ConnectFailed(f"cannot connect to {host}:{port}: {first}", cause=type(first).__name__) from exc
            if tls:
                secure = await self._handshake(stream, host, port)
        if scope.cancelled_caught:
            if stream is not None:
                stream.socket.close()
            what = "TLS handshake" if stream is not None and tls else "connection"
            raise ConnectTimeout(f"no {what} with {host}:{port} within {self.connect_timeout_s:g} s",
                                 cause="ConnectTimeout")
        assert stream is not None
        self.connections_opened += 1
        # A TLS connection is an SSLStream: EngineConnection keeps it off the plain-socket fast path.
        return EngineConnection(secure if secure is not None else stream, key, max_head_bytes=self.max_head_bytes,
                                readiness=self.readiness)

    async def _handshake(self, stream: trio.SocketStream, host: str, port: int) -> trio.SSLStream[trio.SocketStream]:
        context = self.ssl_context
        if context is None:
            stream.socket.close()
            raise TLSFailed(f"no TLS context for https://{host}:{port}", cause="NoTLSContext")
        # server_hostname is the URL's host: check_hostname verifies the certificate against it.
        secure = trio.SSLStream(stream, context, server_hostname=host, https_compatible=True)
        try:
            await secure.do_handshake()
        except trio.BrokenResourceError as exc:
            stream.socket.close()
            reason = tls_reason(exc) or str(exc.__cause__ or exc)
            raise TLSFailed(f"TLS handshake with {host}:{port} failed: {reason}",
                            cause=_cause_name(exc)) from exc
        except BaseException:
            stream.socket.close()
            raise
        return secure
