"""End to end: `python -m narwhal serve --resume` across router restarts (spec: "Resume validation")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

from narwhal.tools.bench.fleet import free_port
from narwhal.tools.local_fleet import render_config, start_router
from tests.e2e.waiting import wait_for_passes, wait_until

pytestmark = pytest.mark.e2e

FAST = {"controller": {"monitor_interval_s": 0.2},
        "engine": {"health_timeout_s": 0.5},
        "recovery": {"liveness_misses": 2, "failure_quarantine_s": 120.0}}


async def engines_view(fleet, url: str) -> dict[str, dict]:
    response = await fleet.client.get(f"{url}/admin/engines")
    assert response.status_code == 200, response.text
    body = response.json()
    engines = body["engines"] if isinstance(body, dict) else body
    return {engine["name"]: engine for engine in engines}


def handoff_of(fleet) -> dict:
    path = Path(fleet.config_path).parent / "handoff.json"
    return json.loads(path.read_bytes())


async def test_ejection_survives_a_restart_with_resume(start_fleet, nursery, tmp_path):
    fleet = await start_fleet(prefill=1, decode=2, sections=FAST)
    # d2 refuses connections from now on: the old router ejects it.
    await fleet.set_fault("d2", "refuse", duration_s=60.0)

    async def d2_ejected_in_handoff() -> bool:
        records = {record["name"]: record for record in handoff_of(fleet)["engines"]}
        return records["d2"].get("ejected", False)

    await wait_until(d2_ejected_in_handoff)
    old_reason = (await engines_view(fleet, fleet.url))["d2"]["ejected_reason"]
    await fleet.router.stop()

    # The same engines, but evidence so slow to act that a new router could not
    # eject d2 by itself within this test, nor readmit it while it refuses: only
    # the handoff can keep it out.
    patient = tmp_path / "patient.toml"
    patient.write_text(render_config(
        [(name, engine.url, "prefill" if name.startswith("p") else "decode")
         for name, engine in fleet.engines.items()],
        {"controller": {"monitor_interval_s": 0.2}, "engine": {"health_timeout_s": 0.5},
         "recovery": {"eject_after": 1000, "liveness_misses": 1000, "failure_quarantine_s": 120.0},
         "handoff": {"path": str(tmp_path / "handoff.json")}}))
    resumed = await start_router(nursery, str(patient), args=["--resume"])
    try:
        [applied] = resumed.events("handoff_applied")
        assert applied["ejected"] == ["d2"]
        await wait_for_passes(fleet.client, resumed.url, 3)
        d2 = (await engines_view(fleet, resumed.url))["d2"]
        assert d2["ejected"] and not d2["eligible"]
        assert d2["ejected_reason"] == old_reason
        # Its quarantine came along with its deadline, so readmission waits for it.
        assert [hold["kind"] for hold in d2["holds"]] == ["failure_quarantine"]
        response = await fleet.client.get(f"{resumed.url}/ready")
        assert response.status_code == 200, response.text
    finally:
        await resumed.stop()

    # Without --resume the same router starts fresh.
    fresh = await start_router(nursery, str(patient))
    try:
        assert not fresh.events("handoff_applied") and not fresh.events("handoff_not_applied")
        await wait_for_passes(fleet.client, fresh.url, 3)
        assert not (await engines_view(fleet, fresh.url))["d2"]["ejected"]
    finally:
        await fresh.stop()


async def test_mismatched_or_corrupt_handoff_starts_fresh(start_fleet, nursery, tmp_path):
    fleet = await start_fleet(prefill=1, decode=1, sections=FAST)
    await wait_until(lambda: trio.to_thread.run_sync((tmp_path / "handoff.json").exists))
    await fleet.router.stop()

    # Another engine set: one more decode engine in the config (at an address of its own: two entries
    # with one URL are refused at startup; nothing need answer there for this test).
    grown = tmp_path / "grown.toml"
    grown.write_text(render_config(
        [("p1", fleet.engines["p1"].url, "prefill"), ("d1", fleet.engines["d1"].url, "decode"),
         ("d2", f"http://127.0.0.1:{free_port()}", "decode")],
        {**FAST, "handoff": {"path": str(tmp_path / "handoff.json")}}))
    router = await start_router(nursery, str(grown), args=["--resume"])
    try:
        [event] = router.events("handoff_not_applied")
        assert event["reason"] == "handoff not applied: engine set differs: added d2"
        assert (await fleet.client.get(f"{router.url}/ready")).status_code == 200
    finally:
        await router.stop()

    # A corrupt file: logged, and the router still starts and serves.
    (tmp_path / "handoff.json").write_bytes(b'{"schema": 1, "router_id": "r1", "pi')
    router = await start_router(nursery, str(fleet.config_path), args=["--resume"])
    try:
        [event] = router.events("handoff_not_applied")
        assert event["reason"].startswith("handoff not applied: unreadable: not JSON")
        assert (await fleet.client.get(f"{router.url}/ready")).status_code == 200
    finally:
        await router.stop()

    # A missing file likewise.
    (tmp_path / "handoff.json").unlink()
    router = await start_router(nursery, str(fleet.config_path), args=["--resume"])
    try:
        [event] = router.events("handoff_not_applied")
        assert event["reason"] == f"handoff not applied: no handoff at {tmp_path / 'handoff.json'}"
    finally:
        await router.stop()
