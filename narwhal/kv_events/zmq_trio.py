"""pyzmq sockets waited on by trio: non-blocking calls, and trio waits on the socket's file descriptor.

ZeroMQ's descriptor is edge-triggered: it signals that the socket's state may have changed, not that a
message is there. So every wait first asks ``zmq.EVENTS`` (which also runs ZeroMQ's pending commands)
and sleeps on the descriptor only when the answer is "nothing ready".
"""

from __future__ import annotations

from collections.abc import Sequence

import trio
import zmq

__all__ = ["TrioSocket"]


class TrioSocket:
    """One pyzmq socket used from trio tasks; ``close`` wakes any task waiting on it (ClosedResourceError)."""

    def __init__(self, socket: zmq.Socket[bytes]) -> None:
        self.socket = socket
        self._fd = int(socket.getsockopt(zmq.FD))  # an int for FD
        self._closed = False

    @classmethod
    def open(cls, context: zmq.Context[zmq.Socket[bytes]], kind: int) -> TrioSocket:
        """A new socket of ``kind`` that never lingers on close (a router stopping must not wait for a peer)."""
        socket = context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        return cls(socket)

    async def _wait(self, flag: int) -> None:
        while True:
            if self._closed:
                raise trio.ClosedResourceError("the socket is closed")
            if int(self.socket.getsockopt(zmq.EVENTS)) & flag:  # an int for EVENTS
                return
            await trio.lowlevel.wait_readable(self._fd)

    async def recv_multipart(self) -> list[bytes]:
        """The next message, whole (ZeroMQ delivers a message's frames together or not at all)."""
        while True:
            await self._wait(zmq.POLLIN)
            try:
                frames: list[bytes] = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            # A peer that sends without pause must not starve the other tasks.
            await trio.lowlevel.checkpoint()
            return frames

    def try_recv_multipart(self) -> list[bytes] | None:
        """A message if one is ready now, else None (never waits)."""
        try:
            frames: list[bytes] = self.socket.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None
        return frames

    async def send_multipart(self, frames: Sequence[bytes]) -> None:
        """Send a message, waiting while the socket cannot take it."""
        while True:
            await self._wait(zmq.POLLOUT)
            try:
                self.socket.send_multipart(frames, zmq.NOBLOCK)
            except zmq.Again:
                continue
            await trio.lowlevel.checkpoint()
            return

    def send_multipart_nowait(self, frames: Sequence[bytes]) -> bool:
        """Send if the socket can take it now; False when it cannot (a PUB socket past its high-water mark drops)."""
        try:
            self.socket.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def close(self) -> None:
        """Close the socket; a task waiting on it gets trio.ClosedResourceError."""
        if self._closed:
            return
        self._closed = True
        trio.lowlevel.notify_closing(self._fd)
        self.socket.close(linger=0)
