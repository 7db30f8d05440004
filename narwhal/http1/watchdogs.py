"""The front's two watchdogs: clients that stopped reading, and clients that left mid-request.

The write watchdog's tick also keeps the head, body and idle deadlines of the
connections that wait in the server's readiness set (``Readiness.expire``);
any other connection keeps them in its own cancel scope
(``HTTP1Protocol.deadline``). These two watch every connection at once, from
one task each, so that the hot path pays nothing for them.
"""

from __future__ import annotations

import select
from collections.abc import Awaitable, Callable, Collection
from typing import Protocol

import trio

from narwhal.http1.readiness import Readiness

__all__ = ["DisconnectWatch", "WriteTimed", "watch_writes"]

# How often, at most, the write watchdog looks for writes to clients that stopped reading.
WATCHDOG_MAX_TICK_S = 1.0
# And at least: tiny test timeouts must not make it spin.
_MIN_TICK_S = 0.001


class WriteTimed(Protocol):
    """A connection whose pending write the watchdog times (``narwhal.http1.connection.Connection``)."""

    @property
    def write_since(self) -> float:
        """When the pending write to the client began; +inf when none is pending."""
        ...
    @property
    def disconnected(self) -> bool: ...
    async def stalled(self) -> None:
        """The client stopped reading: close its stream, failing the pending write."""
        ...


async def watch_writes(connections: Collection[WriteTimed], timeout_s: float, *,
                       connection_arrives: Callable[[], Awaitable[None]] | None = None,
                       readiness: Readiness | None = None, deadlines_s: Collection[float] = ()) -> None:
    """Close the streams of clients whose pending write outlived ``timeout_s``.

    One coarse tick for all connections instead of a cancel scope per write:
    the hot path pays nothing unless a write has to wait. With no connection
    open it sleeps in ``connection_arrives()`` (when given) instead of ticking.
    With ``readiness`` it also fails that set's waits whose deadline passed, at
    most a twentieth of the smallest of ``deadlines_s`` late (the head, body
    and idle timeouts), and sleeps only when no such wait is pending either.
    """
    tick_s = min(WATCHDOG_MAX_TICK_S, timeout_s / 10, *(deadline / 20 for deadline in deadlines_s))
    tick_s = max(tick_s, _MIN_TICK_S)
    while True:
        if not connections and connection_arrives is not None and (readiness is None or not readiness.timed_waits):
            await connection_arrives()
        await trio.sleep(tick_s)
        now = trio.current_time()
        if readiness is not None:
            readiness.expire(now)
        expired_before = now - timeout_s
        for conn in list(connections):
            if conn.write_since <= expired_before and not conn.disconnected:
                await conn.stalled()


class Watched(Protocol):
    """A connection in the fallback disconnect watch."""

    @property
    def sock(self) -> trio.socket.SocketType | None: ...
    def client_gone(self) -> None: ...


class DisconnectWatch:
    """The fallback disconnect watch, for connections the readiness set could not take.

    Their sockets are in one epoll set only while a request is in flight, and
    one task (``run``) tells each connection whose client went away.
    """

    def __init__(self, gone_events: int) -> None:
        self._gone_events = gone_events
        self._epoll: select.epoll | None = None
        self._watched: dict[int, Watched] = {}

    def open(self) -> None:
        """The epoll set, for the server's life (``close`` ends it)."""
        self._epoll = select.epoll()

    def close(self) -> None:
        epoll, self._epoll = self._epoll, None
        self._watched.clear()
        if epoll is not None:
            epoll.close()

    def watch(self, conn: Watched) -> bool:
        """Put a connection's socket in the watch while its request is in flight."""
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

    def unwatch(self, conn: Watched) -> None:
        if conn.sock is None:
            return
        fd = conn.sock.fileno()
        if self._watched.pop(fd, None) is not None and self._epoll is not None:
            try:
                self._epoll.unregister(fd)
            except OSError:
                pass

    async def run(self) -> None:
        """The one task that sees clients go away mid-request, for every watched connection at once."""
        epoll = self._epoll
        assert epoll is not None, "open() first"
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
