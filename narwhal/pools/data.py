"""The data pool: prefill, decode and token counting on keep-alive engine connections.

Bounded by ``serving.max_connections`` through its own CapacityLimiter; a slot
is held for a whole ``post_json`` call or a whole ``stream`` context. The hot
path is the decode relay, so a stream yields raw de-chunked reads as they
arrive (one item per socket read) and only watches the bytes cheaply for SSE
shape and the terminal marker.
"""

from __future__ import annotations

import contextlib
import functools
import urllib.parse
from collections.abc import AsyncIterator

import msgspec
import trio

from narwhal.config import EngineConfig, EngineSpec
from narwhal.http1.client import (
    ConnectionClosed,
    EngineConnection,
    EngineConnections,
    HTTPResponseHead,
    HTTPTransportError,
)
from narwhal.pools import classify

__all__ = ["DataPool", "DataPoolStatistics", "UpstreamStream"]

_NO_DONE = "stream ended without data: [DONE]"


class DataPoolStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of the data pool's occupancy."""

    max_connections: int
    in_use: int
    waiting: int
    connections_opened: int
    idle_connections: int


@functools.lru_cache(maxsize=1024)
def _endpoint(url: str) -> tuple[str, int, bytes]:
    """(host, port, Host header) of an engine URL, parsed once, not on every request."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or 80
    shown = f"[{host}]" if ":" in host else host
    return host, port, f"{shown}:{port}".encode("ascii")


def _post_request(engine: EngineSpec, path: str, body: bytes, request_id: str, accept: bytes) -> bytes:
    if any(c in request_id for c in "\r\n") or not path.startswith("/") or " " in path:
        raise ValueError(f"unsafe request line or request id: {path!r} {request_id!r}")
    return b"".join((
        b"POST ", path.encode("ascii"), b" HTTP/1.1\r\nhost: ", _endpoint(engine.url)[2],
        b"\r\ncontent-type: application/json\r\naccept: ", accept,
        b"\r\ncontent-length: ", str(len(body)).encode("ascii"),
        b"\r\nx-request-id: ", request_id.encode("latin-1"), b"\r\n\r\n", body,
    ))


def _first_token_message(first_token_s: float) -> str:
    return f"no first token within {first_token_s:g} s"


def _is_event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        if name == b"content-type":
            return value.lower().startswith(b"text/event-stream")
    return True  # no content type: the body watch decides


class UpstreamStream:
    """The body of a decode stream, as an async iterator of raw de-chunked reads.

    Enforces the first-token deadline before the first item and the silence
    limit between items; at the end of the body it raises a ``stream``
    failure unless the last event was ``data: [DONE]``.
    """

    def __init__(self, engine: str, conn: EngineConnection, head: HTTPResponseHead, *,
                 first_token_s: float, silence_s: float) -> None:
        self.status = head.status
        self.headers = head.headers
        self.saw_terminal = False
        self._engine = engine
        self._conn = conn
        # The first-token deadline runs from when the request was sent.
        self._first_token_at = conn.sent_at + first_token_s
        self._silence_s = silence_s
        self._started = False
        self._finished = False
        self._watch = classify.SSEWatch()
        self._first_token_message = _first_token_message(first_token_s)
        self._silence_message = f"stream silent for more than {silence_s:g} s"

    def __aiter__(self) -> UpstreamStream:
        return self

    async def __anext__(self) -> bytes:
        if self._finished:
            raise StopAsyncIteration
        if self._started:
            deadline = trio.current_time() + self._silence_s
            message = self._silence_message
        else:
            deadline = self._first_token_at
            message = self._first_token_message
        try:
            data = await self._conn.read_body(deadline=deadline, deadline_message=message)
        except ConnectionClosed as exc:
            # Cut off after the terminal marker (e.g. before the chunked terminator):
            # every token arrived, so the client's stream is whole.
            if not exc.response_started or not self._watch.finish():
                raise classify.stream_failure(self._engine, f"{_NO_DONE} ({exc})", cause=exc.cause) from exc
            data = b""
        except HTTPTransportError as exc:
            raise classify.transport_failure(self._engine, exc) from exc
        if not data:
            self._finished = True
            self.saw_terminal = self._watch.finish()
            if not self.saw_terminal:
                raise classify.stream_failure(self._engine, _NO_DONE)
            raise StopAsyncIteration
        if not self._watch.feed(data):
            raise classify.stream_failure(self._engine, "response body is not a server-sent event stream")
        self.saw_terminal = self._watch.saw_terminal
        self._started = True
        return data


class DataPool:
    """Keep-alive engine connections for prefill, decode and token counting."""

    def __init__(self, *, max_connections: int, engine_config: EngineConfig, wait_for_slot: bool = True) -> None:
        """``wait_for_slot=False``: a full pool raises PoolSaturated at once instead of queueing."""
        self._config = engine_config
        self._wait = wait_for_slot
        self._limiter = trio.CapacityLimiter(max_connections)
        self._connections = EngineConnections(idle_s=engine_config.pool_idle_s,
                                              connect_timeout_s=engine_config.connect_timeout_s,
                                              write_timeout_s=engine_config.request_timeout_s)

    async def post_json(self, engine: EngineSpec, path: str, body: bytes, *,
                        request_id: str) -> tuple[int, bytes]:
        """POST a JSON body; (status, body) for 2xx, otherwise the classified failure is raised."""
        request = _post_request(engine, path, body, request_id, b"application/json")
        read_timeout_s = self._config.request_timeout_s
        async with classify.pool_slot(self._limiter, "data", wait=self._wait):
            conn, head = await self._request(engine, request)
            try:
                response_body = await conn.read_body_to_end(read_timeout_s=read_timeout_s)
            except HTTPTransportError as exc:
                raise classify.transport_failure(engine.name, exc) from exc
            finally:
                self._connections.release(conn)
        classify.raise_for_status(engine.name, head.status, response_body)
        return head.status, response_body

    @contextlib.asynccontextmanager
    async def stream(self, engine: EngineSpec, path: str, body: bytes, *,
                     request_id: str) -> AsyncIterator[UpstreamStream]:
        """POST expecting text/event-stream; entering sends the request and reads the head.

        A non-2xx answer raises as ``post_json`` does, after its body is read. The
        connection goes back to the pool only if the response was read to its end.
        """
        request = _post_request(engine, path, body, request_id, b"text/event-stream")
        first_token_s = self._config.first_token_deadline_s
        async with classify.pool_slot(self._limiter, "data", wait=self._wait):
            conn, head = await self._request(engine, request, head_deadline_s=first_token_s,
                                             head_deadline_message=_first_token_message(first_token_s))
            try:
                if not 200 <= head.status < 300:
                    try:
                        error_body = await conn.read_body_to_end(read_timeout_s=self._config.request_timeout_s)
                    except HTTPTransportError as exc:
                        raise classify.transport_failure(engine.name, exc) from exc
                    classify.raise_for_status(engine.name, head.status, error_body)
                if not _is_event_stream(head.headers):
                    raise classify.stream_failure(engine.name, "response is not text/event-stream")
                yield UpstreamStream(engine.name, conn, head, first_token_s=first_token_s,
                                     silence_s=self._config.stream_silence_s)
            finally:
                # Exited early (client gone, cancelled): the body is unread, so release closes it.
                self._connections.release(conn)

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
        host, port, _ = _endpoint(engine.url)
        try:
            return await self._connections.request(host, port, request,
                                                   read_timeout_s=self._config.request_timeout_s,
                                                   head_deadline_s=head_deadline_s,
                                                   head_deadline_message=head_deadline_message)
        except HTTPTransportError as exc:
            raise classify.transport_failure(engine.name, exc) from exc
