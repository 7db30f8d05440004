"""Carrying protocol messages between two processes over a local stream socket.

``send`` never blocks and never yields: the request path calls it from its hot
path (evidence after each leg). Frames are appended to one buffer that a
writer task flushes in a single write whenever it wakes, so a burst of
evidence costs one syscall. The buffer is bounded: a peer that stops reading
for that long is treated as gone.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import trio

from narwhal.errors import NarwhalError
from narwhal.workers.protocol import FrameDecoder, FrameError, encode_frame

__all__ = ["LinkClosed", "StreamLink"]

_READ_BYTES = 256 * 1024
# A peer that leaves this much unread is not reading at all.
_MAX_PENDING_BYTES = 64 * 1024 * 1024


class LinkClosed(NarwhalError):
    """The other end is gone (EOF, a broken pipe, or it stopped reading)."""


class StreamLink:
    """A framed, message-typed duplex over one trio stream."""

    def __init__(self, stream: trio.abc.Stream, message_type: object, *,
                 max_pending_bytes: int = _MAX_PENDING_BYTES) -> None:
        self._stream = stream
        self._decoder = FrameDecoder(message_type)
        self._pending = bytearray()
        self._max_pending = max_pending_bytes
        self._wake = trio.Event()
        self._writing = False
        self._idle = trio.lowlevel.ParkingLot()
        self.closed = False
        self.close_reason: str | None = None

    def __repr__(self) -> str:
        state = f"closed: {self.close_reason}" if self.closed else "open"
        return f"<StreamLink [{state} | {len(self._pending)} bytes pending]>"

    def send(self, message: msgspec.Struct) -> None:
        """Queue ``message``; raises ``LinkClosed`` once the link is down."""
        if self.closed:
            raise LinkClosed(self.close_reason or "link closed")
        self._pending += encode_frame(message)
        if len(self._pending) > self._max_pending:
            self._close(f"peer left more than {self._max_pending} bytes unread")
            raise LinkClosed(self.close_reason or "link closed")
        self._wake.set()

    async def run(self, on_message: Callable[[Any], Awaitable[None] | None], *,
                  task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Read and write until the peer goes away; each message goes to ``on_message`` in order.

        The link owns its stream and closes it when it returns.
        """
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._write_loop)
                task_status.started()
                try:
                    await self._read_loop(on_message)
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            self._close(self.close_reason or "link stopped")
            await trio.aclose_forcefully(self._stream)

    async def _read_loop(self, on_message: Callable[[Any], Awaitable[None] | None]) -> None:
        try:
            while True:
                try:
                    data = await self._stream.receive_some(_READ_BYTES)
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                    self._close(f"read failed: {type(exc).__name__}")
                    return
                if not data:
                    self._close("peer closed the link")
                    return
                try:
                    messages = self._decoder.feed(data)
                except FrameError as exc:
                    self._close(f"protocol error: {exc}")
                    return
                for message in messages:
                    result = on_message(message)
                    if result is not None:
                        await result
        finally:
            self.closed = True

    async def _write_loop(self) -> None:
        while not self.closed:
            await self._wake.wait()
            self._wake = trio.Event()
            if not self._pending:
                continue
            data, self._pending = bytes(self._pending), bytearray()
            self._writing = True
            try:
                await self._stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                self._close(f"write failed: {type(exc).__name__}")
                return
            finally:
                self._writing = False
                if not self._pending:
                    self._idle.unpark_all()

    async def flush(self) -> None:
        """Wait until everything queued so far has been handed to the socket (bounded by the caller)."""
        while (self._pending or self._writing) and not self.closed:
            await self._idle.park()

    def _close(self, reason: str) -> None:
        if not self.closed:
            self.closed = True
            self.close_reason = reason
        self._wake.set()
        self._idle.unpark_all()
