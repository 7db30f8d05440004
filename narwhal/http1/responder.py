"""The response to one request, framed for its connection: whole, or streamed in chunks.

No socket here: the ``Responder`` writes bytes to a ``Wire`` (the front's
``Connection``; a list of writes in ``tests/test_http1_connection.py``) and
decides the framing (content-length, chunked, HTTP/1.0's close-delimited body)
and whether the connection goes on after the response.
"""

from __future__ import annotations

from typing import Protocol

from narwhal.http1.protocol import CHUNK_TERMINATOR, CHUNKED_HEADER, Request, response_head
from narwhal.http1.pump import ClientSocket

__all__ = ["HeadContext", "Responder", "Wire"]


class HeadContext(Protocol):
    """What every response head of a server shares."""

    @property
    def closing(self) -> bool:
        """The server is shutting down: every response closes its connection."""
        ...
    def common_head_lines(self) -> bytes:
        """The server and date header lines."""
        ...


class Wire(ClientSocket, Protocol):
    """The connection a responder writes to; the relay pump may write to it too (``Responder.direct``)."""

    @property
    def context(self) -> HeadContext: ...
    @property
    def secure(self) -> bool:
        """The connection is TLS."""
        ...
    @property
    def peer_certified(self) -> bool:
        """The TLS peer presented a client certificate the handshake verified."""
        ...
    async def send(self, data: bytes) -> None:
        """One write; ``ClientDisconnected`` if the client is gone."""
        ...


class Responder:
    """Writes the response to one request; handed to the handler with it.

    Handlers must not pass ``content-length``, ``transfer-encoding`` or
    ``connection`` headers: the responder frames the body itself. Besides
    ``started``, ``finished`` says the whole response went out,
    ``client_disconnected`` that the client is known to be gone and ``closes``
    that the connection ends after this response.
    """

    __slots__ = ("_chunked", "_conn", "_request", "closes", "finished", "started")

    def __init__(self, conn: Wire, request: Request) -> None:
        self._conn = conn
        self._request = request
        self._chunked = False
        # The connection ends after this response (``connection: close``, or an HTTP/1.0 stream).
        self.closes = False
        self.started = False
        self.finished = False

    @property
    def client_disconnected(self) -> bool:
        """True once the client is known to be gone."""
        return self._conn.disconnected

    @property
    def secure(self) -> bool:
        """True when the request came over TLS."""
        return self._conn.secure

    @property
    def peer_certified(self) -> bool:
        """True when the TLS peer presented a client certificate the handshake verified."""
        return self._conn.peer_certified

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

    async def start_stream(self, status: int, headers: list[tuple[bytes, bytes]], first: bytes = b"",
                           end: bool = False) -> None:
        """Send the head of a streamed response, with ``first`` as its first chunk, in one write.

        ``end=True``: ``first`` is the whole body; the terminator goes in the same write.
        """
        self._begin()
        if end:
            self.finished = True
        if self._request.http_version == "1.1":
            self._chunked = True
            chunk = b"%x\r\n%b\r\n" % (len(first), first) if first else b""
            if end:
                chunk += CHUNK_TERMINATOR
            head = self._head(status, headers, CHUNKED_HEADER, chunk)
        else:
            # HTTP/1.0 has no chunked coding: the body ends when the connection closes.
            self.closes = True
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
            data = b"%x\r\n%b\r\n0\r\n\r\n" % (len(last), last) if last else CHUNK_TERMINATOR
        else:
            data = last
        if data:
            await self._conn.send(data)

    def direct(self) -> tuple[ClientSocket, bool] | None:
        """For the relay pump: (connection, chunk-framed) of a started stream on a plain socket, else None."""
        conn = self._conn
        if conn.fd < 0 or not self.started or self.finished or conn.disconnected:
            return None
        return conn, self._chunked

    def _begin(self) -> None:
        if self.started:
            raise RuntimeError("the response has already started")
        if self._conn.disconnected:
            raise self._conn.gone_error()
        self.started = True

    def _head(self, status: int, headers: list[tuple[bytes, bytes]], framing: bytes, payload: bytes) -> bytes:
        """The response head followed by ``payload``, joined into one buffer for one write."""
        context = self._conn.context
        if not self._request.keep_alive or context.closing:
            self.closes = True
        return response_head(self._request, status, headers, context.common_head_lines(), framing, payload,
                             closes=self.closes)
