"""End to end, one test per failure class: the mock misbehaves, the router reacts as the spec's tables say.

Each test runs the real router and mock engines as processes, injects a fault
over the mock's HTTP API, and checks the outcome through /admin/engines, the
router's JSON log and what clients receive.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from tests.e2e.waiting import wait_until

pytestmark = pytest.mark.e2e

FAST: dict[str, dict[str, Any]] = {
    "serving": {"count_tokens": False},
    "engine": {"connect_timeout_s": 0.5, "request_timeout_s": 0.6, "first_token_deadline_s": 2.0,
               "stream_silence_s": 0.5, "health_timeout_s": 0.3},
    "controller": {"monitor_interval_s": 0.2, "stage_timeout_s": 1.5},
    "recovery": {"eject_after": 2, "liveness_misses": 3, "probe_interval_s": 0.5},
}
# The monitor's routine sweep also clears timeout and overload evidence (health 200 row);
# with a slow monitor, only the probe the streak asked for can clear it.
SLOW_MONITOR = {**FAST, "controller": {"monitor_interval_s": 60.0, "stage_timeout_s": 1.5}}
REQUEST = {"model": "mock-model", "prompt": "hello", "max_tokens": 4, "stream": True}


async def engines(fleet) -> dict[str, dict[str, Any]]:
    response = await fleet.client.get(f"{fleet.url}/admin/engines")
    return {engine["name"]: engine for engine in response.json()["engines"]}


async def complete(fleet) -> tuple[int, str]:
    response = await fleet.client.post(f"{fleet.url}/v1/completions", json=REQUEST)
    return response.status_code, response.text


def events(fleet, name: str, **match: Any) -> list[dict[str, Any]]:
    return fleet.router.events(name, **match)


async def logged(fleet, name: str, **match: Any) -> list[dict[str, Any]]:
    """Matching log lines, waiting for them: the router batches its log writes."""
    return await fleet.router.wait_event(name, **match)


async def test_connection_failures_eject_and_peers_keep_serving(start_fleet):
    fleet = await start_fleet(decode=2, sections=FAST)
    await fleet.engines["d2"].stop()

    async def ejected() -> bool:
        return (await engines(fleet))["d2"]["ejected"]

    await wait_until(ejected, what="d2 ejected")
    view = (await engines(fleet))["d2"]
    assert not view["eligible"]
    assert await logged(fleet, "engine_ejected", engine="d2")
    for _ in range(10):
        status, text = await complete(fleet)
        assert status == 200 and text.rstrip().endswith("data: [DONE]")
    assert (await fleet.engine_stats("d1"))["decode"] >= 10


def ended_with_done(text: str) -> bool:
    return "data: [DONE]" in text.split("\n")


async def test_timeout_streak_runs_a_health_probe_that_clears_it(start_fleet):
    fleet = await start_fleet(sections=SLOW_MONITOR)
    await fleet.set_fault("d1", "hang", count=2, legs=["decode"])
    assert (await complete(fleet))[0] == 504
    assert (await engines(fleet))["d1"]["evidence"]["timeout"] == 1
    assert (await complete(fleet))[0] == 504

    async def probed() -> bool:
        return bool(events(fleet, "probe_result", engine="d1", probe="health", outcome="success"))

    await wait_until(probed, what="health probe of d1")
    view = (await engines(fleet))["d1"]
    assert view["evidence"]["timeout"] == 0 and view["eligible"] and not view["ejected"]
    assert (await complete(fleet))[0] == 200


async def test_overload_streak_runs_a_health_probe_that_clears_it(start_fleet):
    fleet = await start_fleet(sections=SLOW_MONITOR)
    await fleet.set_fault("d1", "status_429", count=2, legs=["decode"])
    assert (await complete(fleet))[0] == 502
    assert (await engines(fleet))["d1"]["evidence"]["overload"] == 1
    assert (await complete(fleet))[0] == 502

    async def cleared() -> bool:
        return (await engines(fleet))["d1"]["evidence"]["overload"] == 0

    await wait_until(cleared, what="overload evidence cleared by health 200")
    assert await logged(fleet, "probe_result", engine="d1", probe="health")
    assert (await complete(fleet))[0] == 200


@pytest.mark.parametrize("mode", ["status_5xx", "no_done", "stall"])
async def test_inference_failures_pause_then_a_passing_probe_clears(start_fleet, mode):
    fleet = await start_fleet(sections=FAST)
    await fleet.set_fault("d1", mode, count=2, legs=["decode"])
    for _ in range(2):
        status, text = await complete(fleet)
        if mode == "status_5xx":
            assert status == 502
        else:
            # Tokens already went out: the stream ends with an SSE error event, never [DONE].
            assert status == 200 and '"error"' in text and not ended_with_done(text)

    async def probed() -> bool:
        return bool(events(fleet, "probe_result", engine="d1", probe="inference"))

    await wait_until(probed, what="inference probe of d1")
    assert await logged(fleet, "engine_hold_added", engine="d1", hold_kind="inference_verification")
    assert await logged(fleet, "probe_result", engine="d1", probe="inference", outcome="success")
    view = (await engines(fleet))["d1"]
    assert view["eligible"] and not view["holds"]
    assert view["evidence"]["stream"] == 0 and view["evidence"]["inference_status"] == 0
    assert (await complete(fleet))[0] == 200


async def served_by(fleet, name: str) -> int:
    stats = await fleet.engine_stats(name)
    return stats["prefill"] if name.startswith("p") else stats["decode"]


async def recover_and_serve_again(fleet, name: str) -> None:
    """Clear the engine's faults; readmission must return it, and placement must use it again."""
    await fleet.clear_faults(name)

    async def eligible() -> bool:
        return (await engines(fleet))[name]["eligible"]

    await wait_until(eligible, what=f"{name} readmitted")
    assert await logged(fleet, "readmission", engine=name, outcome="readmitted")
    before = await served_by(fleet, name)
    for _ in range(12):
        assert (await complete(fleet))[0] == 200
    assert await served_by(fleet, name) > before


@pytest.mark.parametrize(("mode", "engine"), [("status_5xx", "d2"), ("no_done", "d2"), ("stall", "d2"),
                                              ("bad_kv", "p2")])
async def test_persistent_failure_ejects_peers_keep_serving_and_the_recovered_engine_serves_again(
        start_fleet, mode, engine):
    fleet = await start_fleet(prefill=2, decode=2, sections=FAST)
    await fleet.set_fault(engine, mode)
    # Send until the engine is out; placement spreads requests over both engines of the role.
    for _ in range(40):
        await complete(fleet)
        if (await engines(fleet))[engine]["ejected"]:
            break
        await trio.sleep(0.02)

    async def ejected() -> bool:
        return (await engines(fleet))[engine]["ejected"]

    await wait_until(ejected, what=f"{engine} ejected after its probe leg failed")
    assert await logged(fleet, "probe_result", engine=engine, probe="inference", outcome="failed")
    # While it is out, every request succeeds on the peers.
    for _ in range(8):
        status, text = await complete(fleet)
        assert status == 200 and ended_with_done(text)
    await recover_and_serve_again(fleet, engine)


async def test_unreadable_handoff_is_blamed_on_prefill_and_never_sent_to_decode(start_fleet):
    fleet = await start_fleet(sections=SLOW_MONITOR)
    await fleet.set_fault("p1", "bad_kv", count=2)
    statuses = [(await complete(fleet))[0] for _ in range(2)]
    assert statuses == [502, 502]

    async def both_logged() -> bool:
        return len(events(fleet, "engine_failure", **{"class": "kv_handoff"})) == 2

    await wait_until(both_logged, what="two kv_handoff failures logged")
    failures = events(fleet, "engine_failure", **{"class": "kv_handoff"})
    assert [(e["engine"], e["stage"]) for e in failures] == [("p1", "prefill")] * 2
    # The two bad handoffs never reached decode. d1 may have served one decode since: the
    # inference probe the kv_handoff streak asked for, carrying a good handoff from p1.
    stats = await fleet.engine_stats("d1")
    assert stats["decode"] <= 1
    if stats["decode"]:
        handoff = stats["last_kv_transfer_params"]
        assert handoff["remote_engine_id"] == "p1" and isinstance(handoff["remote_block_ids"], list)
        assert await logged(fleet, "probe_result", engine="p1", probe="inference")


async def test_liveness_misses_eject_an_engine_that_stops_answering_health(start_fleet):
    fleet = await start_fleet(decode=2, sections=FAST)
    # Silent: no HTTP answer within the timeout (an engine that answers 503 is not silent).
    await fleet.set_fault("d2", "hang", legs=["health"])

    async def ejected() -> bool:
        return (await engines(fleet))["d2"]["ejected"]

    await wait_until(ejected, what="liveness ejection of d2")
    assert "liveness" in json.dumps((await engines(fleet))["d2"]["ejected_reason"])


async def test_capacity_exhausted_then_serving_resumes_by_itself(start_fleet):
    fleet = await start_fleet(sections=FAST)
    await fleet.set_fault("d1", "status_5xx", legs=["decode"])
    assert [(await complete(fleet))[0] for _ in range(2)] == [502, 502]

    async def exhausted() -> bool:
        return (await fleet.client.get(f"{fleet.url}/ready")).status_code == 503

    # The probe's decode leg fails too: a confirmed failure may remove the last decode engine.
    await wait_until(exhausted, what="capacity exhausted")
    ready = await fleet.client.get(f"{fleet.url}/ready")
    assert ready.text.strip() == "serving capacity exhausted: no eligible decode engine"
    response = await fleet.client.post(f"{fleet.url}/v1/completions", json=REQUEST)
    assert response.status_code == 503
    assert response.json()["error"]["message"] == "serving capacity exhausted: no eligible decode engine"
    await fleet.clear_faults("d1")

    async def serving() -> bool:
        return (await fleet.client.get(f"{fleet.url}/ready")).status_code == 200

    # Recovery keeps probing: the engine is readmitted and serving resumes without an operator.
    await wait_until(serving, what="readiness restored")
    assert (await complete(fleet))[0] == 200
