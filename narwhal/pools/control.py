"""The control pool: health checks, suspect verification and readmission calls.

Bounded by ``engine.control_connections`` through its own CapacityLimiter, apart
from the data pool, so a saturated data path never starves health checks. It
uses httpx: control calls are rare, so convenience beats the data pool's CPU
budget. Every status comes back to the caller; transport errors become
``EngineFailure`` through ``classify``. Bodies are read as a stream and bounded
by ``engine.max_response_bytes``; past it the connection is dropped and the
call fails as a bad answer (``inference_status``).
"""

from __future__ import annotations

import ssl
from typing import Protocol

import httpx
import msgspec
import trio

from narwhal.config import EngineConfig, EngineSpec
from narwhal.pools import classify

__all__ = ["ControlCalls", "ControlPool", "ControlPoolStatistics", "ControlResponse"]

# identity: a compressed body would expand in memory before the bound could see it.
_GET_HEADERS = {"accept-encoding": "identity"}
_JSON_HEADERS = {"content-type": "application/json", "accept-encoding": "identity"}


class ControlResponse(msgspec.Struct, frozen=True):
    """An engine's answer to a control call, whatever its status."""

    status: int
    body: bytes


class ControlCalls(Protocol):
    """The control pool's calls, as the control plane makes them (tests pass fakes)."""

    async def get(self, engine: EngineSpec, path: str, *, timeout_s: float | None = None) -> ControlResponse: ...

    async def post_json(self, engine: EngineSpec, path: str, body: bytes, *,
                        timeout_s: float | None = None) -> ControlResponse: ...


class ControlPoolStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of the control pool's occupancy."""

    control_connections: int
    in_use: int
    waiting: int


class ControlPool:
    """httpx-based engine calls for the control plane, bounded apart from the data pool."""

    def __init__(self, *, control_connections: int, engine_config: EngineConfig,
                 transport: httpx.AsyncBaseTransport | None = None, via: str | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        """``via``, when given, is sent as the ``via`` header of every call (loop detection).

        ``ssl_context`` verifies ``https://`` engines: the data pool's context, so both trust alike.
        """
        self._config = engine_config
        self._transport = transport
        extra = {"via": via} if via is not None else {}
        self._get_headers = {**_GET_HEADERS, **extra}
        self._json_headers = {**_JSON_HEADERS, **extra}
        self._limiter = trio.CapacityLimiter(control_connections)
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
        """Use ``context`` for new calls; calls in progress finish on the client they began on."""
        old = self._client
        self._ssl_context = context
        self._client = self._new_client(context)
        self._calls[self._client] = 0
        if not self._calls.get(old):
            self._calls.pop(old, None)
            await old.aclose()

    async def set_timeouts(self, engine_config: EngineConfig) -> None:
        """A config reload: calls from now use ``engine_config``'s timeouts (and its keep-alive, on a new client).

        The pool's size and its memory bound stay as built.
        """
        idle_changed = engine_config.pool_idle_s != self._config.pool_idle_s
        self._config = self._config.with_timeouts_of(engine_config)
        if idle_changed:
            # httpx fixes the keep-alive expiry per client.
            self._limits = httpx.Limits(max_connections=self._limits.max_connections,
                                        max_keepalive_connections=self._limits.max_keepalive_connections,
                                        keepalive_expiry=engine_config.pool_idle_s)
            await self.set_ssl_context(self._ssl_context)

    async def get(self, engine: EngineSpec, path: str, *, timeout_s: float | None = None) -> ControlResponse:
        """GET ``path`` on the engine; default timeout ``engine.health_timeout_s``."""
        return await self._call("GET", engine, path, None, timeout_s)

    async def post_json(self, engine: EngineSpec, path: str, body: bytes, *,
                        timeout_s: float | None = None) -> ControlResponse:
        """POST a JSON body to ``path`` on the engine; default timeout ``engine.health_timeout_s``."""
        return await self._call("POST", engine, path, body, timeout_s)

    def statistics(self) -> ControlPoolStatistics:
        """Slots in use and callers waiting for one."""
        limiter = self._limiter.statistics()
        return ControlPoolStatistics(control_connections=int(limiter.total_tokens),
                                     in_use=limiter.borrowed_tokens, waiting=limiter.tasks_waiting)

    def __repr__(self) -> str:
        s = self.statistics()
        return f"<ControlPool [in use {s.in_use}/{s.control_connections} | waiting {s.waiting}]>"

    async def aclose(self) -> None:
        """Close the underlying httpx clients and their connections."""
        for client in {*self._calls, self._client}:
            await client.aclose()
        self._calls.clear()

    async def _call(self, method: str, engine: EngineSpec, path: str, body: bytes | None,
                    timeout_s: float | None) -> ControlResponse:
        if timeout_s is None:
            timeout_s = self._config.health_timeout_s
        timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, self._config.connect_timeout_s))
        headers = self._json_headers if body is not None else self._get_headers
        response: httpx.Response | None = None
        content: bytes | None = b""
        async with classify.pool_slot(self._limiter, "control"):
            client = self._client
            request = client.build_request(method, engine.base_url + path, content=body, headers=headers,
                                           timeout=timeout)
            self._calls[client] += 1
            try:
                # httpx times each read; this bounds the whole call, so a slow drip cannot stretch it.
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
