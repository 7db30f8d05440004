"""The front's two watchdogs: clients that stopped reading, and clients that left mid-request.

The write watchdog also keeps the head, body and idle deadlines of the
connections that wait in the server's readiness set (``Readiness.expire``);
any other connection keeps them in its own cancel scope
(``HTTP1Protocol.deadline``). These two watch every connection at once, from
one task each, so that the hot path pays nothing for them. The write
watchdog sleeps until the earliest deadline it keeps (``Alarm``), not on a tick.
"""

from __future__ import annotations

import select
from collections.abc import Collection
from typing import Protocol

import trio

from narwhal.http1.alarm import Alarm
from narwhal.http1.readiness import Readiness

__all__ = ["DisconnectWatch", "WriteTimed", "watch_writes"]

_INF = float("inf")


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


async def watch_writes(connections: Collection[WriteTimed], timeout_s: float, alarm: Alarm, *,
                       readiness: Readiness | None = None) -> None:
    """Close the streams of clients whose pending write outlived ``timeout_s``.

    One task for all connections instead of a cancel scope per write: the hot
    path pays nothing unless a write has to wait, and a write that starts to
    wait calls ``alarm.due``. With ``readiness`` it also fails that set's waits
    whose deadline passed (the head, body and idle timeouts). It sleeps until
    the earliest of these deadlines, and while there is none until one is due.
    """
    while True:
        expired_before = trio.current_time() - timeout_s
        for conn in list(connections):
            if conn.write_since <= expired_before and not conn.disconnected:
                await conn.stalled()
        # Read after the awaits above: a deadline set meanwhile is in what follows.
        now = trio.current_time()
        wake_at = _INF if readiness is None else readiness.expire(now)
        for conn in connections:
            since = conn.write_since
            if since + timeout_s < wake_at and not conn.disconnected:
                wake_at = since + timeout_s
        await alarm.sleep_until(wake_at)


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
