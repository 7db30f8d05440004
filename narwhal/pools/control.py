"""The control pool: health checks, suspect verification and readmission calls.

Bounded by ``engine.control_connections`` through its own CapacityLimiter, apart
from the data pool, so a saturated data path never starves health checks. It
uses httpx: control calls are rare, so convenience beats the data pool's CPU
budget. Every status comes back to the caller; transport errors become
``EngineFailure`` through ``classify``.
"""

from __future__ import annotations

from typing import Protocol

import httpx
import msgspec
import trio

from narwhal.config import EngineConfig, EngineSpec
from narwhal.pools import classify

__all__ = ["ControlCalls", "ControlPool", "ControlPoolStatistics", "ControlResponse"]

_JSON_HEADERS = {"content-type": "application/json"}


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
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._config = engine_config
        self._limiter = trio.CapacityLimiter(control_connections)
        limits = httpx.Limits(max_connections=control_connections,
                              max_keepalive_connections=control_connections,
                              keepalive_expiry=engine_config.pool_idle_s)
        # trust_env=False: engines are reached directly, never through an env proxy.
        self._client = httpx.AsyncClient(transport=transport, limits=limits, trust_env=False,
                                         follow_redirects=False)

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
        """Close the underlying httpx client and its connections."""
        await self._client.aclose()

    async def _call(self, method: str, engine: EngineSpec, path: str, body: bytes | None,
                    timeout_s: float | None) -> ControlResponse:
        if timeout_s is None:
            timeout_s = self._config.health_timeout_s
        timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, self._config.connect_timeout_s))
        headers = _JSON_HEADERS if body is not None else None
        request = self._client.build_request(method, engine.base_url + path, content=body, headers=headers,
                                             timeout=timeout)
        response: httpx.Response | None = None
        async with classify.pool_slot(self._limiter, "control"):
            # httpx times each read; this bounds the whole call, so a slow drip cannot stretch it.
            with trio.move_on_after(timeout_s) as scope:
                try:
                    response = await self._client.send(request, stream=True)
                    try:
                        content = await response.aread()
                    finally:
                        await response.aclose()
                except httpx.HTTPError as exc:
                    # Once the status line arrived, silence or a cut is the body's (stream), as on the data path.
                    raise classify.httpx_failure(engine.name, exc, response_started=response is not None) from exc
            if scope.cancelled_caught:
                raise classify.call_timeout(engine.name, timeout_s, response_started=response is not None)
        assert response is not None
        return ControlResponse(status=response.status_code, body=content)
