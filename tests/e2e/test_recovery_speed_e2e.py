"""End to end: a killed and restarted engine is back in placement soon after its /health answers again.

The real router and mock engines run as processes. The readmission tick
(``recovery.probe_interval_s``) is set to a minute, so only the immediate start
(the recheck of out engines seeing the restarted engine's health) can bring it
back within the test. The bound asserted is a sanity bound for a loaded
machine; the target figure is measured by ``python -m narwhal bench --scenario
faults`` (docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from narwhal.tools.local_fleet import start_mock_engine
from tests.e2e.waiting import wait_until, watch_restart

pytestmark = pytest.mark.e2e

SECTIONS: dict[str, dict[str, Any]] = {
    "serving": {"count_tokens": False},
    "engine": {"connect_timeout_s": 0.5, "health_timeout_s": 0.5},
    "controller": {"monitor_interval_s": 0.5, "stage_timeout_s": 1.5},
    "recovery": {"liveness_misses": 2, "probe_interval_s": 60.0},
}
SANITY_BOUND_S = 5.0
POLL_S = 0.01


async def engine_state(fleet, name: str) -> dict[str, Any]:
    response = await fleet.client.get(f"{fleet.url}/admin/engines/{name}")
    assert response.status_code == 200, response.text
    return response.json()["engine"]


async def test_a_restarted_engine_is_eligible_soon_after_its_health_returns(start_fleet, nursery) -> None:
    fleet = await start_fleet(decode=2, sections=SECTIONS)
    old = fleet.engines["d2"]
    old.kill()

    async def ejected() -> bool:
        return (await engine_state(fleet, "d2"))["ejected"]

    await wait_until(ejected, what="d2 ejected after it was killed")

    async def eligible() -> bool:
        return (await engine_state(fleet, "d2"))["eligible"]

    restarted, health_at, eligible_at = await watch_restart(
        lambda: start_mock_engine(nursery, "decode", engine_id="d2", port=old.port),
        f"http://127.0.0.1:{old.port}/health", eligible, poll_s=POLL_S, timeout_s=30.0)
    try:
        await check_back_in_placement(fleet, health_at, eligible_at)
    finally:
        with trio.CancelScope(shield=True):
            await restarted.stop(grace_s=5.0)


async def check_back_in_placement(fleet, health_at: float, eligible_at: float) -> None:
    waited = eligible_at - health_at
    assert waited < SANITY_BOUND_S, f"eligible {waited:.2f} s after its health returned"
    # The router says the same: an automatic readmission, with its own health-to-eligible figure.
    [readmitted] = await fleet.router.wait_event("engine_readmitted", engine="d2")
    assert 0 <= readmitted["health_to_eligible_s"] < SANITY_BOUND_S
    [attempt] = await fleet.router.wait_event("readmission", engine="d2", outcome="readmitted")
    assert attempt["operator"] is False
    metrics = (await fleet.client.get(f"{fleet.url}/metrics")).text
    assert 'narwhal_readmission_health_to_eligible_seconds_count{engine="d2",model="mock-model"} 1' in metrics
    # And it serves again.
    response = await fleet.client.post(f"{fleet.url}/v1/completions",
                                       json={"model": "mock-model", "prompt": "hi", "max_tokens": 2})
    assert response.status_code == 200
