"""What the fast paths of the front and the engine client share about trio streams."""

from __future__ import annotations

import trio

__all__ = ["socket_of"]


def socket_of(stream: trio.abc.Stream) -> trio.socket.SocketType:
    """The TCP socket under ``stream`` (a SocketStream, or a wrapper such as SSLStream over one)."""
    while not isinstance(stream, trio.SocketStream):
        stream = stream.transport_stream  # type: ignore[attr-defined]
    return stream.socket
