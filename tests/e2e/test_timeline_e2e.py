"""``GET /admin/timeline`` and ``/admin/router`` with ``serving.workers = 2``: the controller sees every request.

The workers serve the requests; their reports carry each finished request to
the controller, whose one timeline counts them all, failures by class included.
"""

from __future__ import annotations

import socket

import httpx
import pytest
import trio

from tests.e2e.waiting import wait_until

pytestmark = pytest.mark.e2e

SECTIONS = {"serving": {"workers": 2, "shutdown_grace_s": 5.0}}
REQUEST = {"model": "mock-model", "prompt": "hello", "max_tokens": 4}


async def test_the_controllers_timeline_counts_the_requests_of_every_worker(start_fleet) -> None:
    fleet = await start_fleet(prefill=1, decode=1, sections=SECTIONS)

    async def both_workers_up() -> bool:
        # /ready answers 200 once one worker serves; its sibling may still be starting on a loaded machine (then
        # the first takes every request, and the status below would catch the sibling before its hello).
        status = (await fleet.client.get(f"{fleet.url}/admin/router")).json()
        return [w["up"] for w in status["workers"]] == [True, True]

    await wait_until(both_workers_up, timeout_s=30, what="both workers up")

    async def send(n: int) -> None:
        # A new connection per request: the workers take turns accepting them.
        async with httpx.AsyncClient(timeout=10.0, limits=httpx.Limits(max_keepalive_connections=0)) as client:
            for _ in range(n):
                response = await client.post(f"{fleet.url}/v1/completions", json=REQUEST)
                assert response.status_code == 200, response.text

    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(send, 5)
    bad = await fleet.client.post(f"{fleet.url}/v1/completions", json={"model": "mock-model"})
    assert bad.status_code == 400

    async def counted() -> dict | None:
        body = (await fleet.client.get(f"{fleet.url}/admin/timeline?seconds=120")).json()
        return body if sum(body["requests"]) == 21 else None

    body = await wait_until(counted, timeout_s=15, what="21 requests in the controller's timeline")
    assert sum(body["errors"].get("http_400", [])) == 1
    assert body["engines"] == ["p1", "d1"]
    assert "eligible" in body["state"]["d1"]
    status = (await fleet.client.get(f"{fleet.url}/admin/router")).json()
    assert [w["index"] for w in status["workers"]] == [0, 1]
    assert all(w["up"] for w in status["workers"])
    assert status["ready"] is True and status["ready_reason"] is None


async def test_with_admin_listen_the_page_and_its_data_are_on_the_admin_port(start_fleet) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        admin_port = probe.getsockname()[1]
    fleet = await start_fleet(sections={"admin": {"listen": f"127.0.0.1:{admin_port}", "token": "s3cret"}})
    admin = f"http://127.0.0.1:{admin_port}"

    async def page() -> httpx.Response | None:
        try:
            return await fleet.client.get(f"{admin}/admin/ui")
        except httpx.ConnectError:
            return None

    response = await wait_until(page, timeout_s=10, what="the admin listener")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    assert b"Narwhal fleet" in response.content
    assert (await fleet.client.get(f"{admin}/admin/timeline")).status_code == 401
    timeline = await fleet.client.get(f"{admin}/admin/timeline", headers={"authorization": "Bearer s3cret"})
    assert timeline.status_code == 200 and timeline.json()["window_s"] == 900
