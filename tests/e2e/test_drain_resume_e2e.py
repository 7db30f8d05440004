"""End to end: an operator drain survives a router restart with --resume, and only readmission clears it."""

from __future__ import annotations

import json

import pytest

from narwhal.tools.local_fleet import start_router
from tests.e2e.waiting import wait_for_passes, wait_until

pytestmark = pytest.mark.e2e

FAST = {"controller": {"monitor_interval_s": 0.2}, "engine": {"health_timeout_s": 0.5}}


async def views(client, url: str) -> dict[str, dict]:
    body = (await client.get(f"{url}/admin/engines")).json()
    return {engine["name"]: engine for engine in body["engines"]}


async def test_drain_survives_health_successes_and_resume_until_readmitted(start_fleet, nursery):
    fleet = await start_fleet(decode=2, sections=FAST)
    response = await fleet.client.post(f"{fleet.url}/admin/engines/d2/drain")
    assert response.status_code == 200, response.text

    async def drained_and_saved() -> bool:
        view = (await views(fleet.client, fleet.url))["d2"]
        return view["drained"] and fleet.router.events("engine_drained") != []

    await wait_until(drained_and_saved, what="d2 drained")
    # Several monitor passes of health 200 later, the drain still holds.
    await wait_for_passes(fleet.client, fleet.url, 3)
    view = (await views(fleet.client, fleet.url))["d2"]
    assert not view["eligible"] and any(h["kind"] == "operator_drain" for h in view["holds"])

    handoff = json.loads((fleet.config_path.parent / "handoff.json").read_bytes())
    assert handoff["drained"] == ["d2"]
    # d2 drained: 1 of 2 decode engines eligible is "critical" (one or none).
    assert handoff["consolidation_risk"] == {"prefill": "critical", "decode": "critical"}
    record = {r["name"]: r for r in handoff["engines"]}["d2"]
    assert [h["kind"] for h in record["holds"]] == ["operator_drain"]
    assert await fleet.router.stop() == 0
    resumed = await start_router(nursery, str(fleet.config_path), args=["--resume"])
    try:
        assert resumed.events("handoff_applied")
        view = (await views(fleet.client, resumed.url))["d2"]
        assert not view["eligible"] and any(h["kind"] == "operator_drain" for h in view["holds"])
        # Monitor-failure counters start fresh after a restart, even with --resume.
        body = (await fleet.client.get(f"{resumed.url}/admin/engines")).json()
        assert body["monitor"]["failure_streak"] == 0
        for _ in range(5):
            response = await fleet.client.post(f"{resumed.url}/v1/completions",
                                               json={"model": "mock-model", "prompt": "x", "max_tokens": 2})
            assert response.status_code == 200
        assert (await fleet.engine_stats("d2"))["decode"] == 0
        readmit = await fleet.client.post(f"{resumed.url}/admin/engines/d2/readmit")
        assert readmit.status_code == 200, readmit.text
        view = (await views(fleet.client, resumed.url))["d2"]
        assert view["eligible"] and not view["holds"]
    finally:
        await resumed.stop()


async def test_a_maintenance_start_survives_resume_as_it_was_read(start_fleet, nursery):
    # The start is compared with an engine's process start to the second; a start converted again at each
    # write and at the resume moved with every drift between the router's two clocks.
    fleet = await start_fleet(decode=2, sections=FAST)
    response = await fleet.client.post(f"{fleet.url}/admin/engines/d2/maintenance")
    assert response.status_code == 200, response.text
    started_at = response.json()["maintenance_started_at"]
    handoff_path = fleet.config_path.parent / "handoff.json"

    def saved_start() -> float | None:
        if not handoff_path.exists():
            return None
        record = {r["name"]: r for r in json.loads(handoff_path.read_bytes())["engines"]}["d2"]
        return next((h["since_wall"] for h in record["holds"] if h["kind"] == "maintenance"), None)

    async def saved() -> bool:
        return saved_start() is not None

    await wait_until(saved, what="the maintenance hold in the handoff")
    await wait_for_passes(fleet.client, fleet.url, 3)
    assert saved_start() == started_at  # every pass writes it as it was read
    assert await fleet.router.stop() == 0
    resumed = await start_router(nursery, str(fleet.config_path), args=["--resume"])
    try:
        view = (await views(fleet.client, resumed.url))["d2"]
        assert view["maintenance_started_at"] == started_at
        # The engine was not restarted: its process is older than the maintenance, and stays out.
        readmit = await fleet.client.post(f"{resumed.url}/admin/engines/d2/readmit")
        assert readmit.status_code == 409 and "newer_process" in readmit.text, readmit.text
        await wait_for_passes(fleet.client, resumed.url, 2)
        assert saved_start() == started_at
    finally:
        await resumed.stop()
