"""The control pool: health checks, suspect verification and readmission calls.

Bounded by ``engine.control_connections`` through its own CapacityLimiter, apart
from the data pool, so a saturated data path never starves health checks. It
uses httpx: control calls are rare, so convenience beats the data pool's CPU
budget. Every status comes back to the caller; transport errors become
``EngineFailure`` through ``classify``.
"""

from __future__ import annotations

import ssl

import httpx
import msgspec
import trio

from narwhal.config import EngineConfig, EngineSpec
from narwhal.pools import classify

__all__ = ["ControlPool", "ControlPoolStatistics", "ControlResponse"]

_JSON_HEADERS = {"content-type": "application/json"}


class ControlResponse(msgspec.Struct, frozen=True):
    """An engine's answer to a control call, whatever its status."""

    status: int
    body: bytes


class ControlPoolStatistics(msgspec.Struct, frozen=True, kw_only=True):
    """A snapshot of the control pool's occupancy."""

    control_connections: int
    in_use: int
    waiting: int


class ControlPool:
    """httpx-based engine calls for the control plane, bounded apart from the data pool."""

    def __init__(self, *, control_connections: int, engine_config: EngineConfig,
                 transport: httpx.AsyncBaseTransport | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        """``ssl_context`` verifies ``https://`` engines: the data pool's context, so both trust alike."""
        self._config = engine_config
        self._transport = transport
        self._limiter = trio.CapacityLimiter(control_connections)
        self._limits = httpx.Limits(max_connections=control_connections,
                                    max_keepalive_connections=control_connections,
                                    keepalive_expiry=engine_config.pool_idle_s)
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
        self._client = self._new_client(context)
        self._calls[self._client] = 0
        if not self._calls.get(old):
            self._calls.pop(old, None)
            await old.aclose()

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
        headers = _JSON_HEADERS if body is not None else None
        async with classify.pool_slot(self._limiter, "control"):
            client = self._client
            self._calls[client] += 1
            try:
                # httpx times each read; this bounds the whole call, so a slow drip cannot stretch it.
                with trio.move_on_after(timeout_s) as scope:
                    try:
                        response = await client.request(method, engine.base_url + path, content=body,
                                                        headers=headers, timeout=timeout)
                    except httpx.HTTPError as exc:
                        raise classify.httpx_failure(engine.name, exc) from exc
            finally:
                self._calls[client] -= 1
                if client is not self._client and not self._calls[client]:
                    del self._calls[client]
                    with trio.CancelScope(shield=True):
                        await client.aclose()
            if scope.cancelled_caught:
                raise classify.call_timeout(engine.name, timeout_s)
        return ControlResponse(status=response.status_code, body=response.content)
