"""End to end: the monitor degrades readiness on real stage failures and recovers; drift holds."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from narwhal.tools.local_fleet import start_router
from tests.e2e.waiting import wait_for_in_flight, wait_until

pytestmark = pytest.mark.e2e

REQUEST = {"model": "mock-model", "prompt": "hello", "max_tokens": 4, "stream": True}


async def test_persistence_failure_degrades_readiness_and_one_clean_pass_recovers(start_fleet, tmp_path):
    handoff_dir = tmp_path / "state"
    handoff_dir.mkdir()
    fleet = await start_fleet(
        mock_args=["--tokens", "60", "--token-delay-s", "0.05"],
        sections={"handoff": {"path": str(handoff_dir / "handoff.json")},
                  "controller": {"monitor_interval_s": 0.2, "monitor_failure_limit": 2, "stage_timeout_s": 1.5}})

    async def ready_status() -> tuple[int, str]:
        response = await fleet.client.get(f"{fleet.url}/ready")
        return response.status_code, response.text.strip()

    async def written() -> bool:
        return (handoff_dir / "handoff.json").exists()

    await wait_until(written, what="first handoff write")
    assert (await ready_status())[0] == 200

    in_flight: list[httpx.Response] = []
    async with trio.open_nursery() as nursery:

        async def long_stream() -> None:
            in_flight.append(await fleet.client.post(f"{fleet.url}/v1/completions",
                                                     json={**REQUEST, "max_tokens": 60}))

        nursery.start_soon(long_stream)
        await wait_for_in_flight(fleet.client, fleet.url)
        # File permissions do not stop root: replace the directory by a plain file.
        # Renamed away (atomic), not removed: the router may be writing a pass's temporary file into it.
        handoff_dir.rename(handoff_dir.with_name(handoff_dir.name + ".gone"))
        handoff_dir.write_text("not a directory")

        async def degraded() -> bool:
            return (await ready_status())[0] == 503

        await wait_until(degraded, what="degraded readiness")
        status, text = await ready_status()
        assert text == "monitoring degraded: persistence NotADirectoryError"
        refused = await fleet.client.post(f"{fleet.url}/v1/completions", json=REQUEST)
        assert refused.status_code == 503
        assert refused.json()["error"]["message"] == text
    # The request admitted before degradation ran to completion.
    assert in_flight[0].status_code == 200
    assert "data: [DONE]" in in_flight[0].text.split("\n")
    errors = await fleet.router.wait_event("stage_error", stage="persistence")
    assert errors and errors[0]["class"] == "NotADirectoryError"
    assert {"event", "stage", "class", "pass", "message", "ts"} <= set(errors[0])

    handoff_dir.unlink()
    handoff_dir.mkdir()

    async def recovered() -> bool:
        return (await ready_status())[0] == 200

    await wait_until(recovered, what="recovery after one clean pass")
    assert await fleet.router.wait_event("monitor_recovered")
    assert (await fleet.client.post(f"{fleet.url}/v1/completions", json=REQUEST)).status_code == 200


async def test_slow_decode_engine_gets_a_drift_hold_and_loses_it_after_recovery(start_fleet):
    fleet = await start_fleet(
        decode=3, mock_args=["--tokens", "8", "--token-delay-s", "0.002"],
        sections={"serving": {"count_tokens": False},
                  "telemetry": {"interval_s": 0.5},
                  "controller": {"monitor_interval_s": 0.1, "drift_factor": 3.0, "drift_intervals": 2}})
    await fleet.set_fault("d3", "slow_tokens", delay_s=0.05)

    async def engine(name: str) -> dict[str, Any]:
        engines = (await fleet.client.get(f"{fleet.url}/admin/engines")).json()["engines"]
        return {e["name"]: e for e in engines}[name]

    def drift_hold(view: dict[str, Any]) -> bool:
        return any(h["kind"] == "performance_drift" and not h["deferred"] for h in view["holds"])

    stop = trio.Event()

    async def load() -> None:
        with trio.move_on_after(30):
            while not stop.is_set():
                await fleet.client.post(f"{fleet.url}/v1/completions", json={**REQUEST, "max_tokens": 8})

    async with trio.open_nursery() as nursery:
        for _ in range(4):
            nursery.start_soon(load)

        async def held() -> bool:
            return drift_hold(await engine("d3"))

        await wait_until(held, timeout_s=15, what="drift hold on d3")
        assert not drift_hold(await engine("d1")) and not drift_hold(await engine("d2"))
        await fleet.clear_faults("d3")

        async def lifted() -> bool:
            return not drift_hold(await engine("d3"))

        await wait_until(lifted, timeout_s=15, what="drift hold lifted")
        stop.set()
    added = await fleet.router.wait_event("engine_hold_added", hold_kind="performance_drift")
    assert [e["engine"] for e in added] == ["d3"]


async def test_a_drift_hold_never_removes_the_last_eligible_decode_engine(start_fleet):
    fleet = await start_fleet(
        decode=2, mock_args=["--tokens", "8", "--token-delay-s", "0.002"],
        sections={"serving": {"count_tokens": False, "policy": "bounded"},
                  "engine": {"connect_timeout_s": 0.5, "health_timeout_s": 0.3},
                  "telemetry": {"interval_s": 0.4},
                  "recovery": {"eject_after": 2, "liveness_misses": 2},
                  "controller": {"monitor_interval_s": 0.1, "drift_factor": 3.0, "drift_intervals": 2}})
    await fleet.set_fault("d2", "slow_tokens", delay_s=0.05)

    async def views() -> dict[str, Any]:
        engines = (await fleet.client.get(f"{fleet.url}/admin/engines")).json()["engines"]
        return {e["name"]: e for e in engines}

    stop = trio.Event()

    async def load() -> None:
        with trio.move_on_after(30):
            while not stop.is_set():
                await fleet.client.post(f"{fleet.url}/v1/completions", json=REQUEST)

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(load)

        async def d2_held() -> bool:
            return not (await views())["d2"]["eligible"]

        await wait_until(d2_held, timeout_s=15, what="drift hold on d2")
        stop.set()
    # d1 dies: a confirmed failure removes it, and d2, though slow, is now the last decode engine.
    await fleet.engines["d1"].stop()

    async def d1_ejected_d2_serving() -> bool:
        v = await views()
        return v["d1"]["ejected"] and v["d2"]["eligible"]

    await wait_until(d1_ejected_d2_serving, what="d2 serving as the last decode engine")
    hold = [h for h in (await views())["d2"]["holds"] if h["kind"] == "performance_drift"]
    assert hold and hold[0]["deferred"]
    assert (await fleet.client.get(f"{fleet.url}/ready")).status_code == 200
    response = await fleet.client.post(f"{fleet.url}/v1/completions", json=REQUEST)
    assert response.status_code == 200


async def test_a_restarted_router_starts_with_fresh_monitor_failure_counters(start_fleet, tmp_path, nursery):
    state = tmp_path / "state"
    state.mkdir()
    fleet = await start_fleet(sections={
        "handoff": {"path": str(state / "handoff.json")},
        "controller": {"monitor_interval_s": 0.2, "monitor_failure_limit": 2, "stage_timeout_s": 1.5}})

    async def saved() -> bool:
        return (state / "handoff.json").exists()

    await wait_until(saved, what="first handoff")
    saved_bytes = (state / "handoff.json").read_bytes()
    (state / "handoff.json").unlink()
    state.rmdir()
    state.write_text("not a directory")

    async def degraded() -> bool:
        body = (await fleet.client.get(f"{fleet.url}/admin/engines")).json()
        return body["monitor"]["failure_streak"] >= 2

    await wait_until(degraded, what="degraded router")
    fleet.router.kill()
    await fleet.router.process.wait()
    state.unlink()
    state.mkdir()
    (state / "handoff.json").write_bytes(saved_bytes)
    resumed = await start_router(nursery, str(fleet.config_path), args=["--resume"])
    try:
        assert resumed.events("handoff_applied")
        body = (await fleet.client.get(f"{resumed.url}/admin/engines")).json()
        assert body["monitor"]["failure_streak"] == 0 and body["monitor"]["degraded"] is None
        assert (await fleet.client.get(f"{resumed.url}/ready")).status_code == 200
    finally:
        await resumed.stop()
