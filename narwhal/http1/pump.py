"""The relay pump: one per process, it reads every live decode stream and writes each to its client.

Without it, each upstream read wakes the stream's request task (one trip
through trio's scheduler per token per stream). With it, the request task
hands its stream over after the first bytes and sleeps until the stream ends;
the data pool's readiness hub (``narwhal/http1/readiness.py``), woken by trio
once per batch of ready engine sockets (or its pump set served from trio's own
waits: ``idle_rounds.py``), calls the pump for each of them, and
the pump reads the socket, passes the bytes through the caller's ``on_chunk``
(token counting, KV stripping, continuation rewriting: synchronous, per read)
and writes the result to the client with one non-blocking ``write``.

- A client whose socket is full parks only its own stream: the rest of the
  bytes wait for ``EPOLLOUT`` (an edge-triggered watch in the same set, for
  as long as it is full), and that stream's engine is not read meanwhile.
  Its pending write is visible to the front's client write watchdog
  (``ClientSocket.write_waits``), as a blocked ``send`` is, and a client it
  gives up on ends the stream with the same ``client_stalled`` error.
- A stream whose engine socket never runs dry is read once per round: the hub
  yields to the scheduler before reading it again, so others progress.
- The request task keeps its cancel scope: the request deadline, the client
  leaving or a shutdown cancels it, which takes its stream out of the pump at
  once. The data pool's watchdog (first token, silence) ends a stream through
  its engine connection instead (``EngineConnection.interrupt``): the pump's
  next read raises the failure, and it is handed over as any read's error.
  The silence watchdog sees when the stream began waiting for its engine
  (``waiting_since``); never while its client is full.
- Whatever goes wrong in a read, in ``on_chunk`` or in a write is handed to
  the request task and raised there, as its own read or write would have.
- The stream goes back to the request task when ``on_chunk`` declines a read
  (returns None: the read carrying ``[DONE]``, which the caller writes with the
  chunked terminator) or when the body ends.

Plain sockets on Linux only: a TLS engine or client, or no running hub, keeps
the request task's own relay loop (``Pump.can_relay``).

The usual read (one whole SSE event, the body's chunk framing only, a ``RelayBook``
or any ``on_chunk``) runs in C where the optional ``_relay_native`` module was built
(``RELAY_NATIVE``): the same steps as ``_Stream.on_engine``, which stays the reference
and takes every other read (an error, the body's end, a client that is full).
"""

from __future__ import annotations

import math
import os
from bisect import bisect_left
from collections.abc import Callable
from typing import Any, Protocol, TypeGuard

import msgspec
import outcome
import trio

from narwhal.compiled import optional_module
from narwhal.http1.readiness import HUB_STOPPED, Readiness, Watch

__all__ = ["RELAY_NATIVE", "ClientSocket", "OnChunk", "Pump", "PumpUpstream", "RelayBook", "RelayConnection",
           "RelayParts", "RelayWatched"]

_INF = math.inf
# The raw send syscall; a module-level name so tests can limit what the kernel takes.
_write = os.write
_CRLF = b"\r\n"
# Chunk-size lines of the usual reads' sizes, made once (formatting one per write costs more than the join).
_SIZE_LINES = tuple(b"%x\r\n" % size for size in range(4096))


class RelayWatched(Protocol):
    """A decode stream that says whether the pump can own its engine socket."""

    @property
    def relay_watch(self) -> Watch | None:
        """The engine socket's watch in the pump's readiness set; None when no pump can own it (TLS, a fake)."""
        ...


class RelayConnection(Protocol):
    """The engine connection under a pumped stream: whether it is drained, and the silence watchdog's mark."""

    # While the relay waits for the engine: since when (+inf: it does not), for the silence watchdog.
    waiting_since: float

    @property
    def drained(self) -> bool:
        """Nothing is left to read until the socket's next edge."""
        ...


class RelayParts(msgspec.Struct, frozen=True):
    """What the C relay reads and writes of a stream's engine side (``PumpUpstream.relay_parts``).

    ``connection`` is an ``EngineConnection`` and ``sse`` its stream's ``SSEWatch``: the C twin reads and
    writes their fields at their slots, as their own methods do by name.
    """

    connection: object
    feed: Callable[[bytes], object]  # the response parser's feed_data
    body: list[bytes]  # where the parser puts the body's bytes
    sse: object
    read_size: int
    engine_fd: int


class PumpUpstream(RelayWatched, Protocol):
    """A decode stream the pump can read without waiting (``narwhal.pools.data.UpstreamStream``)."""

    @property
    def relay_connection(self) -> RelayConnection: ...
    def read_ready(self, readable: bool) -> bytes | None: ...
    def relay_parts(self) -> RelayParts | None:
        """Its parts for the C relay; None when it cannot take this stream (the Python path reads it)."""
        ...


class ClientSocket(Protocol):
    """The client connection a stream is written to (the front's ``Connection``): all the pump touches of it."""

    @property
    def fd(self) -> int:
        """The plain socket the pump writes to."""
        ...
    @property
    def disconnected(self) -> bool:
        """The client is known to be gone: nothing more may be written."""
        ...
    def write_waits(self, on_stall: Callable[[], None]) -> None:
        """A write has to wait from now: the front's write watchdog times it, and calls ``on_stall`` before it
        closes a client that stopped reading."""
        ...
    def write_done(self) -> None:
        """The write that waited went out (or was given up): no longer timed."""
        ...
    def cut_mid_write(self) -> None:
        """Part of a chunk went out and the rest never will: nothing more may follow on this connection."""
        ...
    def client_gone(self) -> None: ...
    def gone_error(self) -> Exception: ...


OnChunk = Callable[[bytes, float], "bytes | None"]


class RelayBook:
    """The plain relay's ``on_chunk``: the inter-token histogram, ``marker``'s field stripped, the read that
    carries ``[DONE]`` held back (``held``) and declined. The C relay does this work itself for this exact type."""

    __slots__ = ("bounds", "counts", "held", "last_at", "marker", "strip", "total", "upstream")

    def __init__(self, upstream: Any, bounds: tuple[float, ...], counts: list[int], total: list[float], *,
                 last_at: float, marker: bytes, strip: Callable[[bytes], bytes]) -> None:
        self.upstream = upstream  # its ``saw_terminal`` says the read carried [DONE]
        # One histogram cell (``Histogram.cell``): observed inline, ``Histogram.observe``'s work without its call.
        self.bounds = bounds
        self.counts = counts
        self.total = total
        self.last_at = last_at
        self.marker = marker
        self.strip = strip
        self.held = b""

    def __call__(self, chunk: bytes, now: float) -> bytes | None:
        gap = now - self.last_at
        self.counts[bisect_left(self.bounds, gap)] += 1
        self.total[0] += gap
        self.last_at = now
        if chunk.find(self.marker) >= 0:
            chunk = self.strip(chunk)
        if self.upstream.saw_terminal:
            self.held = chunk
            return None
        return chunk


def _native_step() -> Any:
    _relay_native = optional_module("narwhal.http1._relay_native")
    if _relay_native is None:  # on_engine alone, which behaves the same
        return None
    import httptools

    _relay_native.bind(RelayBook, (httptools.HttpParserError, httptools.HttpParserUpgrade))
    return _relay_native.Step


_Step = _native_step()
# Whether the C relay runs (CI fails when its install did not build it).
RELAY_NATIVE = _Step is not None


def _system_clock() -> type | None:
    """trio's own clock: its time is ``offset + perf_counter()``, which the C relay reads without a call."""
    try:
        from trio._core._run import SystemClock
    except ImportError:  # pragma: no cover - a trio that moved it: the C relay calls the clock
        return None
    return SystemClock


_SYSTEM_CLOCK = _system_clock()
_os_write = os.write


def _detached(events: int) -> None:
    """A stream's handler once it left the pump (nothing calls it then)."""


class Pump:
    """The pump over one readiness hub (the data pool's): ``relay`` hands it a stream until it ends."""

    def __init__(self, readiness: Readiness) -> None:
        self.readiness = readiness

    @property
    def streams(self) -> int:
        """Streams in the pump right now (the hub counts them: while any, its rounds may run inline)."""
        return self.readiness.pumped

    def can_relay(self, upstream: RelayWatched) -> TypeGuard[PumpUpstream]:
        """True when ``upstream``'s engine socket can be pumped (plain socket, hub running).

        Only the data pool's streams have a relay watch, and they are ``PumpUpstream``s.
        """
        if not self.readiness.running:
            return False
        watch = upstream.relay_watch
        return watch is not None and watch.handler is None

    async def relay(self, upstream: PumpUpstream, client: ClientSocket, chunked: bool, on_chunk: OnChunk, *,
                    clock: Callable[[], float] = trio.current_time) -> bytes:
        """Relay ``upstream`` into ``client`` until ``on_chunk`` declines a read (that read is returned) or
        the body ends (b""). ``on_chunk(read, now)`` returns the bytes to write (maybe none)."""
        watch = upstream.relay_watch
        assert watch is not None
        stream = _Stream(self, upstream, watch, client, chunked, on_chunk, clock)
        readiness = self.readiness
        readiness.pumped += 1
        try:
            watch.handler = stream.handler
            # Bytes that came before the handover get no new edge: read what is there now.
            readable, watch.ready = watch.ready or watch.closed, False
            stream.pull(readable)
            if not stream.done:
                # Into the pump set, if the data pool runs one (served from trio's waits: idle_rounds.py).
                readiness.pump_in(watch)
            while not stream.done:
                if stream.again and stream.pending is None:
                    # A socket that did not run dry: yield, then read on (the hub may too, harmlessly).
                    stream.again = False
                    await trio.lowlevel.checkpoint()
                    if not stream.done and stream.pending is None:
                        stream.pull(False)
                    continue
                stream.task = trio.lowlevel.current_task()
                await trio.lowlevel.wait_task_rescheduled(stream.abort)
        finally:
            readiness.pumped -= 1
            if not stream.done:
                # Cancelled: the stream leaves the pump; the caller's scope ends it.
                stream.detach()
        if stream.error is not None:
            raise stream.error
        return stream.result


class _Stream:
    """One decode stream in the pump: its engine socket, its client, and a write that had to wait."""

    __slots__ = ("again", "chunked", "client", "clock", "conn", "done", "error", "fd", "handler", "on_chunk", "pending",
                 "pump", "result", "same_clock", "task", "trio_now", "upstream", "watch", "writable")

    def __init__(self, pump: Pump, upstream: PumpUpstream, watch: Watch, client: ClientSocket, chunked: bool,
                 on_chunk: OnChunk, clock: Callable[[], float]) -> None:
        self.pump = pump
        self.upstream = upstream
        self.conn = upstream.relay_connection
        self.watch = watch
        self.client = client
        self.fd = client.fd
        self.chunked = chunked
        self.on_chunk = on_chunk
        # trio's clock read at its source (``trio.current_time`` is three calls deep); the same time.
        self.trio_now = trio.lowlevel.current_clock().current_time
        # The silence watchdog reads trio's clock; the caller's clock serves for it when it is trio's (the function,
        # or the running clock's own method, as the request core binds it: bound methods of one clock are equal).
        self.same_clock = clock is trio.current_time or clock == self.trio_now
        self.clock = self.trio_now if self.same_clock else clock
        self.done = False
        self.result = b""
        self.error: Exception | None = None
        self.task: trio.lowlevel.Task | None = None
        # The stream stopped with bytes still to read (no edge will come for them).
        self.again = False
        # What the client's full socket did not take; the stream waits for EPOLLOUT.
        self.pending: memoryview | None = None
        self.writable: Watch | None = None
        # What the hub calls: the C relay (which hands every read but the usual one to on_engine), or on_engine.
        self.handler: Callable[[int], None] = self._native() or self.on_engine

    def _native(self) -> Callable[[int], None] | None:
        """The C relay for this stream, when the module was built and every part is the one it knows."""
        if _Step is None or _write is not _os_write:  # (a test's stand-in for the kernel's write: Python)
            return None
        parts = self.upstream.relay_parts()
        if parts is None:
            return None
        clock = trio.lowlevel.current_clock()
        offset = getattr(clock, "offset", None) if type(clock) is _SYSTEM_CLOCK else None
        step: Callable[[int], None] = _Step(
            self, self.upstream, parts.connection, parts.feed, parts.body, parts.sse, self.watch, self.client,
            self.on_chunk, None if self.same_clock else self.clock, self.trio_now, offset,
            self.pump.readiness.later, parts.read_size, parts.engine_fd, self.fd, self.chunked)
        return step

    # -- called by the hub --------------------------------------------------------

    def on_engine(self, events: int) -> None:
        """Read once, pass it through ``on_chunk``, write it; errors end the stream with them.

        The per-token path: one call from the hub, the write inline (``_park`` only when it waits).
        """
        if events == HUB_STOPPED:
            self._end(b"", trio.ClosedResourceError("the relay pump stopped"))
            return
        if self.pending is not None:
            # While the client is full the engine waits (its edges are not lost: the flush reads on).
            return
        try:
            upstream = self.upstream
            # After the engine's close no edge comes again: the EOF (or error) waits to be read.
            closed = self.watch.closed
            chunk = upstream.read_ready(events != 0 or closed)
            while chunk is None and closed:
                # Bytes that carried no body (chunk framing) before the close: read on to the EOF.
                chunk = upstream.read_ready(True)
            if chunk is None:
                self.conn.waiting_since = self.trio_now()
                return
            if not chunk:
                self._end(b"", None)
                return
            now = self.clock()
            out = self.on_chunk(chunk, now)
            if out is None:
                self._end(chunk, None)
                return
            if out:
                client = self.client
                if client.disconnected:
                    self._end(b"", client.gone_error())
                    return
                if self.chunked:
                    size = len(out)
                    out = (b"".join((_SIZE_LINES[size], out, _CRLF)) if size < 4096
                           else b"%x\r\n%b\r\n" % (size, out))
                try:
                    sent = _write(self.fd, out)
                except BlockingIOError:
                    sent = 0
                except OSError as exc:
                    self._client_failed(exc)
                    return
                if sent != len(out):
                    self._park(out, sent)
                    return
            conn = self.conn
            if conn.drained and not closed:
                conn.waiting_since = now if self.same_clock else self.trio_now()
            else:
                conn.waiting_since = _INF
                self.again = True
                self.pump.readiness.later(self.watch)
        except Exception as exc:  # handed to the request task, never raised into the hub
            self._end(b"", exc)

    def on_client(self, events: int) -> None:
        if events == HUB_STOPPED:
            self._end(b"", trio.ClosedResourceError("the relay pump stopped"))
            return
        try:
            self._flush()
        except Exception as exc:  # handed to the request task, never raised into the hub
            self._end(b"", exc)

    # -- the relay ----------------------------------------------------------------------

    def pull(self, readable: bool) -> None:
        """Read once, as at an edge (``readable``) or not; errors end the stream with them."""
        self.handler(1 if readable else 0)

    def _park(self, data: bytes, sent: int) -> None:
        """The client's socket took only ``sent`` bytes of ``data``: the rest waits for EPOLLOUT."""
        self.pending = memoryview(data)[sent:]
        # Visible to the front's write watchdog, like a send that waits; never engine silence.
        self.client.write_waits(self.on_stall)
        self.conn.waiting_since = _INF
        self.writable = self.pump.readiness.watch_writable(self.fd, self.on_client)

    def on_stall(self) -> None:
        """The front's watchdog gave up on this client (client_stalled): end with its error."""
        self._end(b"", self.client.gone_error())

    def _flush(self) -> None:
        client = self.client
        if client.disconnected:
            self._end(b"", client.gone_error())
            return
        pending = self.pending
        assert pending is not None
        try:
            sent = _write(self.fd, pending)
        except BlockingIOError:
            return
        except OSError as exc:
            self._client_failed(exc)
            return
        if sent < len(pending):
            self.pending = pending[sent:]
            return
        self.pending = None
        self._unpark()
        # The engine may have sent more while the client was full: read on.
        self.pull(True)

    def _client_failed(self, exc: OSError) -> None:
        """The write failed (reset, broken pipe): the stream ends with the front's ClientDisconnected."""
        client = self.client
        error = client.gone_error()
        error.__cause__ = exc
        self._end(b"", error)
        # After the hand-over, so the request task raises the disconnect rather than a bare cancel.
        client.client_gone()

    def _unpark(self) -> None:
        if self.writable is not None:
            self.pump.readiness.forget(self.writable)
            self.writable = None
            self.client.write_done()

    def _end(self, result: bytes, error: Exception | None) -> None:
        if self.done:
            return
        self.result = result
        self.error = error
        self.detach()
        task, self.task = self.task, None
        if task is not None:
            trio.lowlevel.reschedule(task, outcome.Value(None))

    def detach(self) -> None:
        """Out of the pump: no more calls from the hub; the request task takes the stream back."""
        self.done = True
        watch = self.watch
        watch.handler = None
        # The C relay holds this stream: without it here, the two would wait for the collector.
        self.handler = _detached
        self.pump.readiness.pump_out(watch)
        self.conn.waiting_since = _INF
        if self.pending is not None:
            self.client.cut_mid_write()
            self.pending = None
        self._unpark()

    def abort(self, _: Any) -> trio.lowlevel.Abort:
        self.task = None
        self.detach()
        return trio.lowlevel.Abort.SUCCEEDED
