"""The data pool: prefill, decode and token counting on keep-alive engine connections.

Bounded by ``serving.max_connections`` through its own CapacityLimiter; a slot
is held for a whole ``post_json`` call or a whole ``stream`` context. The hot
path is the decode relay, so a stream yields raw de-chunked reads as they
arrive (one item per socket read) and only watches the bytes cheaply for SSE
shape and the terminal marker.
"""

from __future__ import annotations

import logging
import ssl
from types import TracebackType
from typing import Any

import msgspec
import trio

from narwhal.config import EngineConfig, EngineSpec, engine_endpoint
from narwhal.http1.alarm import Alarm
from narwhal.http1.client import (
    ConnectionClosed,
    DeadlineExpired,
    EngineConnection,
    EngineConnections,
    HTTPResponseHead,
    HTTPTransportError,
    via_line,
)
from narwhal.http1.idle_rounds import IdleRounds
from narwhal.http1.pump import Pump, RelayParts
from narwhal.http1.readiness import Readiness, Watch
from narwhal.obs.logs import log_event
from narwhal.pools import classify

__all__ = ["DataPool", "DataPoolStatistics", "StreamCall", "UpstreamStream"]

# The terminal event whole, as vLLM writes it; an event after it in the same read ends the answer too.
_DONE_EVENT = b"data: [DONE]\n\n"
_NO_DONE = "stream ended without data: [DONE]"
# What is read after data: [DONE] while waiting for the body's end (a conforming engine sends nothing).
_AFTER_TERMINAL_BYTES = 64 * 1024
_INF = float("inf")


class DataPoolStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of the data pool's occupancy."""

    max_connections: int
    in_use: int
    waiting: int
    connections_opened: int
    idle_connections: int


def _post_request(engine: EngineSpec, path: str, body: bytes, request_id: str, accept: bytes,
                  via: bytes = b"", trace: bytes = b"") -> bytes:
    """``via`` is a whole header line (``b"\\r\\nvia: ..."``) or empty; ``trace`` whole lines too (traceparent,
    tracestate: ``narwhal.tracing.spans.RequestTrace.engine_headers``) or empty."""
    if "\r" in request_id or "\n" in request_id or not path.startswith("/") or " " in path:
        raise ValueError(f"unsafe request line or request id: {path!r} {request_id!r}")
    return b"".join((
        b"POST ", path.encode("ascii"), b" HTTP/1.1\r\nhost: ", engine_endpoint(engine.url)[2],
        b"\r\ncontent-type: application/json\r\naccept: ", accept,
        b"\r\ncontent-length: ", str(len(body)).encode("ascii"),
        b"\r\nx-request-id: ", request_id.encode("latin-1"), via, trace, b"\r\n\r\n", body,
    ))


def _first_token_message(first_token_s: float) -> str:
    return f"no first token within {first_token_s:g} s"


def _is_event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        if name == b"content-type":
            return value.lower().startswith(b"text/event-stream")
    return True  # no content type: the body watch decides


class UpstreamStream:
    """The body of a decode stream: ``read()`` returns raw de-chunked reads, b"" at the end.

    The first-token deadline (before the first bytes) and the silence limit
    (between reads) are kept by the pool's watchdog, not by a scope per read:
    it ends the engine read with ``DeadlineExpired`` (``EngineConnection.interrupt``;
    on TLS it cancels the stream's scope) and ``expired`` says why. At the end of the
    body ``read()`` raises a ``stream`` failure unless the last event was
    ``data: [DONE]``; after that event, what the engine does (more bytes, a close,
    silence) is no failure. It is also an async iterator of the same reads.
    It can also be read without waiting (``read_ready``), by the relay pump.
    """

    __slots__ = ("_conn", "_engine", "_finished", "_first_token_at", "_first_token_s", "_scope", "_silence_s",
                 "_started", "_watch", "expired", "first_due", "headers", "saw_terminal", "status")

    def __init__(self, engine: str, conn: EngineConnection, head: HTTPResponseHead, scope: trio.CancelScope | None,
                 *, first_token_s: float, silence_s: float) -> None:
        """``scope``: the one the watchdog cancels when the connection cannot be interrupted (TLS), else None."""
        self.status = head.status
        self.headers = head.headers
        self.saw_terminal = False
        # Set by the watchdog, with the message of the deadline that passed, just before it ends the read.
        self.expired: str | None = None
        self._engine = engine
        self._conn = conn
        self._scope = scope
        # The first-token deadline runs from when the request was sent.
        first_token_at = self._first_token_at = conn.sent_at + first_token_s
        # The earliest a deadline of this stream can pass (for the watchdog's alarm): its first token's,
        # or its silence's if it starts and then waits (the request was sent before either).
        silent_at = conn.sent_at + silence_s
        self.first_due = first_token_at if first_token_at < silent_at else silent_at
        self._first_token_s = first_token_s
        self._silence_s = silence_s
        self._started = False
        self._finished = False
        self._watch = classify.SSEWatch()

    @property
    def data_events(self) -> int:
        """The ``data:`` events read so far (each one a token, less [DONE] and the answer's other non-tokens):
        counted by the SSE check as it ends each event, so the relay need not scan the reads again."""
        return self._watch.data_events

    def check_deadline(self, now: float) -> float:
        """The watchdog's look: cancel the stream if its engine has kept it waiting too long; else the
        earliest time its next look is due (inf: never)."""
        if self._finished or self.expired is not None:
            return _INF
        if not self._started:
            if now < self._first_token_at:
                # Once started, it may wait from then on: its silence can be due before its first-token deadline.
                return min(self._first_token_at, now + self._silence_s)
            # The messages are formatted only here, when a deadline passed: not for every stream.
            self.expired = _first_token_message(self._first_token_s)
        else:
            # waiting_since is +inf unless the relay is waiting for the engine right now: a slow
            # client holding up the relay is not the engine's silence. A wait that starts after
            # this look is silent no sooner than now + silence_s: no read has to wake the watchdog.
            waiting_since = self._conn.waiting_since
            if now - waiting_since < self._silence_s:
                return (now if waiting_since == _INF else waiting_since) + self._silence_s
            self.expired = f"stream silent for more than {self._silence_s:g} s"
        if self._scope is not None:
            self._scope.cancel()
        else:
            self._conn.interrupt(DeadlineExpired(self.expired, cause="DeadlineExpired"))
        return _INF

    def __aiter__(self) -> UpstreamStream:
        return self

    async def __anext__(self) -> bytes:
        data = await self.read()
        if not data:
            raise StopAsyncIteration
        return data

    async def read(self) -> bytes:
        """The next de-chunked body bytes, as read; b"" once the stream ended with ``data: [DONE]``.

        After the read that carried ``data: [DONE]`` the answer is whole: the next read only waits for
        the body's end (so the connection can be reused) and returns b"" whatever comes instead.
        """
        if self._finished:
            return b""
        if self.saw_terminal:
            await self._after_terminal()
            return b""
        try:
            data = await self._conn.read_relay_body()
        except HTTPTransportError as exc:
            data = self._failed(exc)
        return self._took(data)

    async def _after_terminal(self) -> None:
        """Read on to the body's end; more bytes, a close or ``stream_silence_s`` of silence only close the
        connection (``release`` finds the body unfinished): they are no evidence against the engine."""
        # The watchdog leaves the stream alone from here: this wait has its own deadline and no failure.
        self._finished = True
        if self._conn.ended:
            # The body's end came with [DONE] (the usual case): nothing to wait for, and no scope.
            return
        seen = 0
        with trio.move_on_after(self._silence_s):
            try:
                while seen <= _AFTER_TERMINAL_BYTES:
                    data = await self._conn.read_relay_body()
                    if not data:
                        return
                    seen += len(data)
            except HTTPTransportError:
                pass

    # -- for the relay pump (narwhal/http1/pump.py) ------------------------------

    @property
    def relay_watch(self) -> Watch | None:
        """The engine socket's watch in the pool's readiness set; None when a pump cannot own it (TLS)."""
        return None if self._finished else self._conn.relay_watch

    @property
    def relay_connection(self) -> EngineConnection:
        """The engine connection: whether it is drained, and when the relay began waiting for it."""
        return self._conn

    def read_ready(self, readable: bool) -> bytes | None:
        """``read`` without waiting: the next bytes, b"" at the end, None when it would wait."""
        if self._finished:
            return b""
        try:
            data = self._conn.relay_body_ready(readable)
        except HTTPTransportError as exc:
            data = self._failed(exc)
        if data is None:
            return None
        return self._took(data)

    def relay_parts(self) -> RelayParts | None:
        """Its parts for the pump's C relay; None when the connection's reads are off its path (TLS)."""
        parts = None if self._finished else self._conn.relay_parts()
        if parts is None or type(self._watch) is not classify.SSEWatch:
            return None
        feed, body, read_size, fd = parts
        return RelayParts(self._conn, feed, body, self._watch, read_size, fd)

    def relay_failed(self, exc: Exception) -> bytes | None:
        """``read_ready``'s outcome when the C relay's read (an OSError) or parse (httptools) raised ``exc``:
        b"", or the stream's failure raised; None when the read goes on (junk after a whole response)."""
        try:
            self._conn.relay_failed(exc)
        except HTTPTransportError as failure:
            return self._took(self._failed(failure))
        return None

    def _failed(self, exc: HTTPTransportError) -> bytes:
        if isinstance(exc, ConnectionClosed):
            # Cut off after the terminal marker (e.g. before the chunked terminator):
            # every token arrived, so the client's stream is whole.
            if not exc.response_started or not self._watch.finish():
                raise classify.stream_failure(self._engine, f"{_NO_DONE} ({exc})", cause=exc.cause) from exc
            return b""
        raise classify.transport_failure(self._engine, exc) from exc

    def _took(self, data: bytes) -> bytes:
        """One read checked (SSE, [DONE]) and counted; b"" (or a stream failure) at the body's end."""
        if not data:
            self._finished = True
            self.saw_terminal = self._watch.finish()
            if not self.saw_terminal:
                raise classify.stream_failure(self._engine, _NO_DONE)
            return b""
        watch = self._watch
        # The usual read is one whole event: no [DONE] to cut at (``one_event``); else the general check.
        if not watch.one_event(data):
            # A read that ends with the marker (the last of a batch of events) has nothing after it to cut:
            # the search of the whole read is left out (one holding an earlier marker too, which no engine
            # sends, goes to the client whole: OpenAI's clients stop at the first).
            if not data.endswith(_DONE_EVENT):
                done_at = data.find(_DONE_EVENT)
                if done_at >= 0:
                    data = self._cut_at_done(data, done_at)
            if not watch.feed(data):
                raise classify.stream_failure(self._engine, "response body is not a server-sent event stream")
        self.saw_terminal = watch.saw_terminal
        self._started = True
        return data

    def _cut_at_done(self, data: bytes, at: int) -> bytes:
        """``data`` up to the end of a ``data: [DONE]`` event that more follows in the same read.

        The answer ended there: what follows is not relayed, not checked and no evidence, as in a later
        read. Only a marker that starts an event counts (a token's text may say ``data: [DONE]``).
        """
        while at >= 0:
            if (self._watch.between_events if at == 0 else data[at - 2:at] == b"\n\n"):
                return data[:at + len(_DONE_EVENT)]
            at = data.find(_DONE_EVENT, at + 1)
        return data


class DataPool:
    """Keep-alive engine connections for prefill, decode and token counting."""

    def __init__(self, *, max_connections: int, engine_config: EngineConfig, wait_for_slot: bool = True,
                 via: str | None = None, ssl_context: ssl.SSLContext | None = None,
                 relay_inline: bool = True) -> None:
        """``wait_for_slot=False``: a full pool raises PoolSaturated at once instead of queueing.

        ``via``, when given, is sent as the ``via`` header of every request (loop detection).
        ``ssl_context`` verifies ``https://`` engines (and holds the client certificate).
        ``relay_inline``: the readiness hub's rounds may run from trio's idle wait while pump streams are live.
        """
        self._config = engine_config
        self._first_token_message = _first_token_message(engine_config.first_token_deadline_s)
        self._via = via_line(via)
        self._wait = wait_for_slot
        # Live decode streams, for the deadline watchdog (``run``).
        self._streams: set[UpstreamStream] = set()
        # When the watchdog wakes next: the earliest deadline of a stream or a timed read (``Alarm``).
        self.alarm = Alarm()
        self._watchdog_running = False
        self._limiter = trio.CapacityLimiter(max_connections)
        # The engine sockets' readiness set; it runs (with the watchdog) in ``run``.
        self._readiness = Readiness(early_rounds=relay_inline)
        self._relay_inline = relay_inline
        # Runs the hub's rounds from trio's idle wait while pump streams are live (``run``; None: it does not).
        self.idle_rounds: IdleRounds | None = None
        self._connections = EngineConnections(readiness=self._readiness, idle_s=engine_config.pool_idle_s,
                                              connect_timeout_s=engine_config.connect_timeout_s,
                                              write_timeout_s=engine_config.request_timeout_s,
                                              max_head_bytes=engine_config.max_response_header_bytes,
                                              ssl_context=ssl_context)
        # Reads every live decode stream and writes it to its client, from inside the readiness hub.
        self.pump = Pump(self._readiness)
        # Every body this pool buffers (prefill, token count, non-streamed decode, errors) is bounded.
        self._max_body = engine_config.max_response_bytes

    def set_ssl_context(self, context: ssl.SSLContext | None) -> None:
        """Use ``context`` for new engine connections; pooled ones keep theirs until they expire."""
        self._connections.ssl_context = context

    def set_timeouts(self, engine_config: EngineConfig) -> None:
        """A config reload: calls and streams that start from now use ``engine_config``'s timeouts.

        Streams already relaying keep the deadlines they started with. The pool's
        size and its memory bounds stay as built.
        """
        self._config = self._config.with_timeouts_of(engine_config)
        self._first_token_message = _first_token_message(self._config.first_token_deadline_s)
        connections = self._connections
        connections.idle_s = engine_config.pool_idle_s
        connections.connect_timeout_s = engine_config.connect_timeout_s
        connections.write_timeout_s = engine_config.request_timeout_s

    async def post_json(self, engine: EngineSpec, path: str, body: bytes, *,
                        request_id: str, trace: bytes = b"") -> tuple[int, bytes]:
        """POST a JSON body; (status, body) for 2xx, otherwise the classified failure is raised.

        ``trace``: the request's trace context header lines (empty without tracing)."""
        request = _post_request(engine, path, body, request_id, b"application/json", self._via, trace)
        read_timeout_s = self._config.request_timeout_s
        async with classify.pool_slot(self._limiter, "data", wait=self._wait):
            conn, head = await self._request(engine, request)
            try:
                response_body = await conn.read_body_to_end(read_timeout_s=read_timeout_s,
                                                            max_bytes=self._max_body)
            except HTTPTransportError as exc:
                raise classify.transport_failure(engine.name, exc, head.status) from exc
            finally:
                self._connections.release(conn)
        classify.raise_for_status(engine.name, head.status, response_body)
        return head.status, response_body

    def stream(self, engine: EngineSpec, path: str, body: bytes, *,
               request_id: str, trace: bytes = b"") -> StreamCall:
        """POST expecting text/event-stream: ``async with pool.stream(...) as upstream``; entering sends the
        request and reads the head.

        A non-2xx answer raises as ``post_json`` does, after its body is read. The
        connection goes back to the pool only if the response was read to its end.
        """
        if not self._watchdog_running:
            raise RuntimeError("DataPool.run() is not running: stream deadlines would never fire")
        return StreamCall(self, engine, _post_request(engine, path, body, request_id, b"text/event-stream",
                                                      self._via, trace))

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """The pool's two tasks: the engine sockets' readiness set, and the stream deadline watchdog."""
        # The same time as trio.current_time, read in one call instead of three.
        self._connections.clock = trio.lowlevel.current_clock().current_time
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self._readiness.run)
                if self._relay_inline:
                    self.idle_rounds, unavailable = IdleRounds.attach(self._readiness)
                    if unavailable is not None:
                        log_event("relay_inline_unavailable", level=logging.WARNING, reason=unavailable)
                await nursery.start(self._watchdog)
                task_status.started()
        finally:
            if self.idle_rounds is not None:
                self.idle_rounds.detach()
                self.idle_rounds = None

    async def _watchdog(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Cancel the streams whose engine kept them waiting too long, and fail the engine reads (heads,
        buffered bodies) whose timeout passed (a read opens no cancel scope of its own); asleep until the
        earliest of those deadlines, or until a new one comes before it."""
        readiness = self._readiness
        alarm = self.alarm
        readiness.alarm = alarm
        self._watchdog_running = True
        try:
            task_status.started()
            while True:
                now = trio.current_time()
                wake_at = readiness.expire(now)
                for upstream in list(self._streams):
                    due = upstream.check_deadline(now)
                    if due < wake_at:
                        wake_at = due
                await alarm.sleep_until(wake_at)
        finally:
            self._watchdog_running = False
            readiness.alarm = None

    def statistics(self) -> DataPoolStatistics:
        """Slots in use and waiting, connections opened so far, idle connections."""
        limiter = self._limiter.statistics()
        return DataPoolStatistics(max_connections=int(limiter.total_tokens), in_use=limiter.borrowed_tokens,
                                  waiting=limiter.tasks_waiting,
                                  connections_opened=self._connections.connections_opened,
                                  idle_connections=self._connections.idle_connections)

    def __repr__(self) -> str:
        s = self.statistics()
        return (f"<DataPool [in use {s.in_use}/{s.max_connections} | waiting {s.waiting}"
                f" | opened {s.connections_opened} | idle {s.idle_connections}]>")

    async def aclose(self) -> None:
        """Close idle connections; connections still in use close when their call ends."""
        await self._connections.aclose()

    async def _request(self, engine: EngineSpec, request: bytes, *, head_deadline_s: float = float("inf"),
                       head_deadline_message: str = "") -> tuple[EngineConnection, HTTPResponseHead]:
        host, port, _, tls = engine_endpoint(engine.url)
        try:
            return await self._connections.request(host, port, request,
                                                   read_timeout_s=self._config.request_timeout_s,
                                                   head_deadline_s=head_deadline_s,
                                                   head_deadline_message=head_deadline_message,
                                                   tls=tls)
        except HTTPTransportError as exc:
            raise classify.transport_failure(engine.name, exc) from exc


class StreamCall:
    """One ``DataPool.stream`` call: its pool slot, its engine connection, and the stream while it is read.

    A class, not an ``asynccontextmanager``: one is entered per streamed request, and the generator's
    machinery costs about a microsecond more.
    """

    __slots__ = ("_conn", "_engine", "_pool", "_request", "_scope", "_slot", "_upstream")

    def __init__(self, pool: DataPool, engine: EngineSpec, request: bytes) -> None:
        self._pool = pool
        self._engine = engine
        self._request = request
        self._slot = classify.pool_slot(pool._limiter, "data", wait=pool._wait)
        self._conn: EngineConnection | None = None
        self._upstream: UpstreamStream | None = None
        self._scope: trio.CancelScope | None = None

    async def __aenter__(self) -> UpstreamStream:
        pool, engine, slot = self._pool, self._engine, self._slot
        config = pool._config
        first_token_s = config.first_token_deadline_s
        await slot.__aenter__()
        try:
            conn, head = await pool._request(engine, self._request, head_deadline_s=first_token_s,
                                             head_deadline_message=pool._first_token_message)
            try:
                if not 200 <= head.status < 300:
                    try:
                        error_body = await conn.read_body_to_end(read_timeout_s=config.request_timeout_s,
                                                                 max_bytes=pool._max_body)
                    except HTTPTransportError as exc:
                        raise classify.transport_failure(engine.name, exc) from exc
                    classify.raise_for_status(engine.name, head.status, error_body)
                if not _is_event_stream(head.headers):
                    raise classify.stream_failure(engine.name, "response is not text/event-stream")
            except BaseException:
                pool._connections.release(conn)
                raise
        except BaseException:
            slot.release()
            raise
        # No scope or deadline per read: when a deadline passes, the watchdog ends the engine read with the
        # failure (a plain socket: no scope at all, a scope costing as much as a leg's other bookkeeping), or
        # cancels one scope around the caller's relay loop (TLS: its reads wait inside trio, where only a
        # cancel reaches them).
        scope = None if conn.relay_watch is not None else trio.CancelScope()
        upstream = UpstreamStream(engine.name, conn, head, scope, first_token_s=first_token_s,
                                  silence_s=config.stream_silence_s)
        pool._streams.add(upstream)
        alarm = pool.alarm
        if upstream.first_due < alarm.at:
            alarm.wake()
        self._conn, self._upstream, self._scope = conn, upstream, scope
        if scope is not None:
            scope.__enter__()
        return upstream

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool:
        pool, upstream, scope, conn = self._pool, self._upstream, self._scope, self._conn
        assert upstream is not None and conn is not None
        try:
            pool._streams.discard(upstream)
            if scope is None:
                return False
            swallowed = bool(scope.__exit__(exc_type, exc, tb))
            if swallowed and upstream.expired is not None and scope.cancelled_caught:
                raise classify.transport_failure(self._engine.name, DeadlineExpired(
                    upstream.expired, cause="DeadlineExpired")) from None
            return swallowed
        finally:
            # Exited early (client gone, cancelled): the body is unread, so release closes it.
            pool._connections.release(conn)
            self._slot.release()
