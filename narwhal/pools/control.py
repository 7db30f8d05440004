"""The control pool: health checks, suspect verification and readmission calls.

Bounded by ``engine.control_connections`` through its own CapacityLimiter, apart
from the data pool, so a saturated data path never starves health checks. Calls
go over the same small HTTP/1.1 client as the data pool (``narwhal.http1.client``)
but on connections of their own, kept alive between passes (one idle per
engine, closed after ``engine.pool_idle_s``): a health check is a few hundred
microseconds of CPU, where an httpx call on a new connection cost several times
that, on every pass, for every engine. Every status comes back to the caller;
transport errors become ``EngineFailure`` through ``classify``. Bodies are bounded
by ``engine.max_response_bytes``; past it the connection is dropped and the call
fails as a bad answer (``inference_status``). An in-process ``httpx`` transport
(``transport=``, as tests and tools use to fake engines) is called through httpx.
"""

from __future__ import annotations

import ssl
from typing import Protocol

import httpx
import msgspec
import trio

from narwhal.config import EngineConfig, EngineSpec, engine_endpoint
from narwhal.http1.client import (
    EngineConnection,
    EngineConnections,
    HTTPResponseHead,
    HTTPTransportError,
    ResponseTooLarge,
    via_line,
)
from narwhal.pools import classify

__all__ = ["ControlCalls", "ControlPool", "ControlPoolStatistics", "ControlResponse"]

# identity: a compressed body would expand in memory before the bound could see it.
_GET_HEADERS = {"accept-encoding": "identity"}
_JSON_HEADERS = {"content-type": "application/json", "accept-encoding": "identity"}
_INF = float("inf")
# GET requests kept built (per engine and path): a few paths for each of up to thousands of engines.
_MAX_KEPT_REQUESTS = 4096


class ControlResponse(msgspec.Struct, frozen=True):
    """An engine's answer to a control call, whatever its status."""

    status: int
    body: bytes


class ControlCalls(Protocol):
    """The control pool's calls, as the control plane makes them (tests pass fakes)."""

    async def get(self, engine: EngineSpec, path: str, *, timeout_s: float | None = None,
                  caller_deadline: float = ...) -> ControlResponse: ...

    async def post_json(self, engine: EngineSpec, path: str, body: bytes, *,
                        timeout_s: float | None = None) -> ControlResponse: ...


class ControlPoolStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of the control pool's occupancy."""

    control_connections: int
    in_use: int
    waiting: int


class _ControlConnections(EngineConnections):
    """Engine connections that keep at most one idle connection per engine.

    A sweep needs one per engine; a second (a probe beside a check) would only
    hold a descriptor. So the pool holds at most ``control_connections`` sockets
    in use plus one idle per engine, which the front's fd budget counts.
    """

    def release(self, conn: EngineConnection) -> None:
        if self._idle.get(conn.key):
            conn.close()
            return
        super().release(conn)


class ControlPool:
    """Engine calls for the control plane on kept-alive connections, bounded apart from the data pool."""

    def __init__(self, *, control_connections: int, engine_config: EngineConfig,
                 transport: httpx.AsyncBaseTransport | None = None, via: str | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        """``via``, when given, is sent as the ``via`` header of every call (loop detection).

        ``ssl_context`` verifies ``https://`` engines: the data pool's context, so both trust alike.
        ``transport``: an in-process httpx transport that stands in for every engine.
        """
        self._config = engine_config
        self._via = via_line(via)
        self._limiter = trio.CapacityLimiter(control_connections)
        self._connections = _ControlConnections(
            idle_s=engine_config.pool_idle_s,
            connect_timeout_s=engine_config.connect_timeout_s, write_timeout_s=engine_config.request_timeout_s,
            max_head_bytes=engine_config.max_response_header_bytes, ssl_context=ssl_context)
        # Per (engine URL, path): the engine's address and the GET request, as _get_target built them.
        self._get_requests: dict[tuple[str, str], tuple[str, int, bool, bytes]] = {}
        self._httpx = None if transport is None else _HttpxCalls(transport, control_connections, engine_config,
                                                                   via, ssl_context)

    async def set_ssl_context(self, context: ssl.SSLContext | None) -> None:
        """Use ``context`` for new connections; connections already open keep theirs."""
        self._connections.ssl_context = context
        if self._httpx is not None:
            await self._httpx.set_ssl_context(context)

    async def set_timeouts(self, engine_config: EngineConfig) -> None:
        """A config reload: calls from now use ``engine_config``'s timeouts and keep-alive.

        The pool's size and its memory bounds stay as built.
        """
        self._config = self._config.with_timeouts_of(engine_config)
        self._connections.idle_s = self._config.pool_idle_s
        self._connections.connect_timeout_s = self._config.connect_timeout_s
        self._connections.write_timeout_s = self._config.request_timeout_s
        if self._httpx is not None:
            await self._httpx.set_timeouts(self._config)

    async def get(self, engine: EngineSpec, path: str, *, timeout_s: float | None = None,
                  caller_deadline: float = _INF) -> ControlResponse:
        """GET ``path`` on the engine; default timeout ``engine.health_timeout_s``.

        ``caller_deadline``: when the caller's own cancel scope ends the call (a health sweep's); when that comes
        before the timeout, the pool opens no scope of its own (one would never fire) and the caller's reports."""
        return await self._call("GET", engine, path, None, timeout_s, caller_deadline)

    async def post_json(self, engine: EngineSpec, path: str, body: bytes, *,
                        timeout_s: float | None = None) -> ControlResponse:
        """POST a JSON body to ``path`` on the engine; default timeout ``engine.health_timeout_s``."""
        return await self._call("POST", engine, path, body, timeout_s, _INF)

    def statistics(self) -> ControlPoolStatistics:
        """Slots in use and callers waiting for one."""
        limiter = self._limiter.statistics()
        return ControlPoolStatistics(control_connections=int(limiter.total_tokens),
                                     in_use=limiter.borrowed_tokens, waiting=limiter.tasks_waiting)

    @property
    def idle_connections(self) -> int:
        """Kept-alive connections waiting for the next call."""
        return self._connections.idle_connections

    def __repr__(self) -> str:
        s = self.statistics()
        return f"<ControlPool [in use {s.in_use}/{s.control_connections} | waiting {s.waiting}]>"

    async def aclose(self) -> None:
        """Close every idle connection (and the httpx client, if any); calls in progress close theirs."""
        await self._connections.aclose()
        if self._httpx is not None:
            await self._httpx.aclose()

    async def _call(self, method: str, engine: EngineSpec, path: str, body: bytes | None,
                    timeout_s: float | None, caller_deadline: float) -> ControlResponse:
        if timeout_s is None:
            timeout_s = self._config.health_timeout_s
        async with classify.pool_slot(self._limiter, "control"):
            if self._httpx is not None:
                return await self._httpx.call(method, engine, path, body, timeout_s)
            return await self._http1_call(method, engine, path, body, timeout_s, caller_deadline)

    async def _http1_call(self, method: str, engine: EngineSpec, path: str, body: bytes | None,
                          timeout_s: float, caller_deadline: float) -> ControlResponse:
        if body is None and method == "GET":
            # A GET's request is the same every time for an engine and path (a health check each pass).
            target = self._get_requests.get((engine.url, path))
            if target is None:
                target = self._get_target(engine.url, path)
            host, port, tls, request = target
        else:
            host, port, host_header, tls = engine_endpoint(engine.url)
            request = _request(method, path, host_header, body, self._via)
        connections = self._connections
        clock = connections.clock
        if clock is trio.current_time:
            # The running clock's own method: trio's public function is three calls deep (release and take too).
            connections.clock = clock = trio.lowlevel.current_clock().current_time
        if tls and connections.ssl_context is None:
            # No context given: the system's trust store, as httpx's verify=True (built once, when needed).
            connections.ssl_context = ssl.create_default_context()
        max_bytes = self._config.max_response_bytes
        heads: list[HTTPResponseHead] = []
        try:
            if caller_deadline < clock() + timeout_s:
                # The caller's scope ends the call first (a health sweep's) and reports the timeout; one of ours
                # would never fire, and a cancel scope costs about a fifth of a kept-alive check.
                content = await self._call_whole(host, port, request, tls, max_bytes, heads)
                return ControlResponse(status=heads[0].status, body=content)
            # This bounds the whole call, so a slow drip cannot stretch it (its reads need no bound of their own).
            with trio.move_on_after(timeout_s) as scope:
                content = await self._call_whole(host, port, request, tls, max_bytes, heads)
        except ResponseTooLarge as exc:
            if not heads:
                raise classify.transport_failure(engine.name, exc) from exc  # the head itself
            raise classify.response_too_large(engine.name, f"{method} {path} response body", max_bytes) from exc
        except HTTPTransportError as exc:
            raise classify.transport_failure(engine.name, exc) from exc
        if scope.cancelled_caught:
            raise classify.call_timeout(engine.name, timeout_s, response_started=bool(heads))
        return ControlResponse(status=heads[0].status, body=content)

    def _get_target(self, url: str, path: str) -> tuple[str, int, bool, bytes]:
        """An engine's address and the GET of ``path`` on it, built once and kept (bounded)."""
        host, port, host_header, tls = engine_endpoint(url)
        target = (host, port, tls, _request("GET", path, host_header, None, self._via))
        if len(self._get_requests) >= _MAX_KEPT_REQUESTS:
            # Engines that came and went (discovery): start afresh rather than keep every one ever seen.
            self._get_requests.clear()
        self._get_requests[url, path] = target
        return target

    async def _call_whole(self, host: str, port: int, request: bytes, tls: bool, max_bytes: float,
                          heads: list[HTTPResponseHead]) -> bytes:
        """Send ``request`` and read its answer to the end (its head appended to ``heads``), with no deadline:
        the caller's scope bounds it."""
        connections = self._connections
        conn, head = await connections.request(host, port, request, read_timeout_s=_INF, tls=tls)
        heads.append(head)
        try:
            return await conn.read_body_to_end(read_timeout_s=_INF, max_bytes=max_bytes)
        finally:
            connections.release(conn)


def _request(method: str, path: str, host_header: bytes, body: bytes | None, via: bytes) -> bytes:
    """One control request; identity encoding: a compressed body would expand before the bound sees it."""
    if not path.startswith("/") or any(c in path for c in " \r\n"):
        raise ValueError(f"unsafe request path: {path!r}")
    if body is None:
        return b"".join((method.encode("ascii"), b" ", path.encode("ascii"), b" HTTP/1.1\r\nhost: ", host_header,
                         b"\r\naccept-encoding: identity", via, b"\r\n\r\n"))
    return b"".join((method.encode("ascii"), b" ", path.encode("ascii"), b" HTTP/1.1\r\nhost: ", host_header,
                     b"\r\ncontent-type: application/json\r\naccept-encoding: identity\r\ncontent-length: ",
                     str(len(body)).encode("ascii"), via, b"\r\n\r\n", body))


class _HttpxCalls:
    """Calls through an httpx client over an in-process transport (engines faked in tests and tools)."""

    def __init__(self, transport: httpx.AsyncBaseTransport, control_connections: int,
                 engine_config: EngineConfig, via: str | None, ssl_context: ssl.SSLContext | None) -> None:
        self._config = engine_config
        self._transport = transport
        extra = {"via": via} if via is not None else {}
        self._get_headers = {**_GET_HEADERS, **extra}
        self._json_headers = {**_JSON_HEADERS, **extra}
        self._limits = httpx.Limits(max_connections=control_connections,
                                    max_keepalive_connections=control_connections,
                                    keepalive_expiry=engine_config.pool_idle_s)
        self._ssl_context = ssl_context
        self._client = self._new_client(ssl_context)
        # Calls in progress per client: a client replaced by a reload closes when its last call ends.
        self._calls: dict[httpx.AsyncClient, int] = {self._client: 0}

    def _new_client(self, ssl_context: ssl.SSLContext | None) -> httpx.AsyncClient:
        # trust_env=False: engines are reached directly, never through an env proxy.
        verify: ssl.SSLContext | bool = ssl_context if ssl_context is not None else True
        return httpx.AsyncClient(transport=self._transport, limits=self._limits, trust_env=False,
                                 follow_redirects=False, verify=verify)

    async def set_ssl_context(self, context: ssl.SSLContext | None) -> None:
        old = self._client
        self._ssl_context = context
        self._client = self._new_client(context)
        self._calls[self._client] = 0
        if not self._calls.get(old):
            self._calls.pop(old, None)
            await old.aclose()

    async def set_timeouts(self, engine_config: EngineConfig) -> None:
        idle_changed = engine_config.pool_idle_s != self._config.pool_idle_s
        self._config = engine_config
        if idle_changed:
            # httpx fixes the keep-alive expiry per client.
            self._limits = httpx.Limits(max_connections=self._limits.max_connections,
                                        max_keepalive_connections=self._limits.max_keepalive_connections,
                                        keepalive_expiry=engine_config.pool_idle_s)
            await self.set_ssl_context(self._ssl_context)

    async def aclose(self) -> None:
        for client in {*self._calls, self._client}:
            await client.aclose()
        self._calls.clear()

    async def call(self, method: str, engine: EngineSpec, path: str, body: bytes | None,
                   timeout_s: float) -> ControlResponse:
        timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, self._config.connect_timeout_s))
        headers = self._json_headers if body is not None else self._get_headers
        response: httpx.Response | None = None
        content: bytes | None = b""
        client = self._client
        request = client.build_request(method, engine.base_url + path, content=body, headers=headers,
                                       timeout=timeout)
        self._calls[client] += 1
        try:
            with trio.move_on_after(timeout_s) as scope:
                try:
                    response = await client.send(request, stream=True)
                    try:
                        content = await _read_bounded(response, self._config.max_response_bytes)
                    finally:
                        await response.aclose()
                except httpx.HTTPError as exc:
                    # Once the status line arrived, silence or a cut is the body's (stream), as on the
                    # data path.
                    raise classify.httpx_failure(engine.name, exc,
                                                 response_started=response is not None) from exc
        finally:
            self._calls[client] -= 1
            if client is not self._client and not self._calls[client]:
                del self._calls[client]
                with trio.CancelScope(shield=True):
                    await client.aclose()
        if scope.cancelled_caught:
            raise classify.call_timeout(engine.name, timeout_s, response_started=response is not None)
        assert response is not None
        if content is None:
            raise classify.response_too_large(engine.name, f"{method} {path} response body",
                                              self._config.max_response_bytes)
        return ControlResponse(status=response.status_code, body=content)


async def _read_bounded(response: httpx.Response, max_bytes: int) -> bytes | None:
    """The whole body, or None (with the connection closed) once it passes ``max_bytes``."""
    parts: list[bytes] = []
    size = 0
    too_large = False
    try:
        async for chunk in response.aiter_bytes():
            if too_large:
                continue
            size += len(chunk)
            if size > max_bytes:
                # Close the connection, then let httpx's generators end on their own
                # (breaking out would leave them unfinished to the garbage collector).
                too_large = True
                await response.aclose()
            else:
                parts.append(chunk)
    except httpx.HTTPError:
        if not too_large:
            raise
    return None if too_large else b"".join(parts)
