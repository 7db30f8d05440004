"""Polling with a deadline, for end-to-end tests that watch a live router: the one shared ``wait_until``.

Tests wait for a condition or for the router's monitor to have run a number of
passes (``GET /admin/engines`` -> ``monitor.passes``), never for a fixed time.
The real-vLLM tier imports this module too (``watch_restart``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import httpx
import trio

T = TypeVar("T")

POLL_S = 0.05


async def wait_until(predicate: Callable[[], Awaitable[T]], timeout_s: float = 10.0,
                     what: str = "condition", *, poll_s: float = POLL_S) -> T:
    """Poll ``predicate`` every ``poll_s`` until it returns something truthy; return that; fail after ``timeout_s``."""
    with trio.move_on_after(timeout_s):
        while not (result := await predicate()):
            await trio.sleep(poll_s)
        return result
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


async def watch_restart(restart: Callable[[], Awaitable[T]], health_url: str, eligible: Callable[[], Awaitable[bool]],
                        *, poll_s: float, timeout_s: float) -> tuple[T, float, float]:
    """Run ``restart`` while polling ``health_url`` and ``eligible``, each every ``poll_s``.

    Returns what ``restart`` returned, then ``trio.current_time()`` when the health
    first answered 200 and when ``eligible()`` first held; fails after ``timeout_s``.
    The old process must be dead: any 200 on that URL is the new one's.
    """
    seen: dict[str, float] = {}

    async def health_200(client: httpx.AsyncClient) -> bool:
        try:
            return (await client.get(health_url)).status_code == 200
        except httpx.HTTPError:
            return False

    async def watch(key: str, what: str, predicate: Callable[[], Awaitable[bool]]) -> None:
        await wait_until(predicate, timeout_s=timeout_s, what=what, poll_s=poll_s)
        seen[key] = trio.current_time()

    async with httpx.AsyncClient(timeout=1.0) as client, trio.open_nursery() as watchers:
        watchers.start_soon(watch, "health", f"{health_url} answering 200", lambda: health_200(client))
        watchers.start_soon(watch, "eligible", "the engine eligible again", eligible)
        result = await restart()
    return result, seen["health"], seen["eligible"]


async def engines_body(client: httpx.AsyncClient, url: str,
                       headers: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The router's ``GET /admin/engines`` answer."""
    response = await client.get(f"{url}/admin/engines", headers=headers)
    assert response.status_code == 200, response.text
    return response.json()


async def monitor_passes(client: httpx.AsyncClient, url: str, headers: Mapping[str, str] | None = None) -> int:
    """How many monitor passes the router has started."""
    return int((await engines_body(client, url, headers))["monitor"]["passes"])


async def wait_for_passes(client: httpx.AsyncClient, url: str, count: int = 3, *,
                          headers: Mapping[str, str] | None = None, timeout_s: float = 20.0) -> int:
    """Return once ``count`` whole monitor passes have run after this call began; the latest pass number."""
    # ``passes`` counts passes started, one after another: once pass start + count + 1
    # has begun, passes start + 1 ... start + count have all finished.
    target = await monitor_passes(client, url, headers) + count + 1

    async def done() -> int:
        passes = await monitor_passes(client, url, headers)
        return passes if passes >= target else 0

    return await wait_until(done, timeout_s=timeout_s, what=f"{count} monitor passes at {url}")


async def wait_for_in_flight(client: httpx.AsyncClient, url: str, *, timeout_s: float = 10.0) -> int:
    """Wait until the router has a request in flight on some engine; the total in flight."""

    async def busy() -> int:
        return sum(engine["in_flight"] for engine in (await engines_body(client, url))["engines"])

    return await wait_until(busy, timeout_s=timeout_s, what=f"a request in flight at {url}")
