"""End to end: drains, maintenance and readmission, driven with ``python -m narwhal admin`` alone.

The real router and mock engines run as processes. These tests need the
Readmitter wired into the router (``Router.readmitter``, the admin routes of
``narwhal.app.admin_routes``, ``Readmitter.run`` in the router's nursery and the
monitor's readmission stage calling ``readmit_due``); the second one also
needs the monitor's health and liveness stages to eject an engine that stops.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import trio

from narwhal.tools.admin_cli import TOKEN_ENV
from narwhal.tools.local_fleet import LocalProcess, start_mock_engine
from tests.e2e.waiting import wait_for_passes, wait_until

pytestmark = pytest.mark.e2e

TOKEN = "e2e-admin-token"
SECTIONS: dict[str, dict[str, Any]] = {
    "fleet": {"attestation_key": "narwhal-dev-key"},  # the mock engine's default key
    "admin": {"token": TOKEN},
    "engine": {"connect_timeout_s": 0.5, "health_timeout_s": 0.5},
    "controller": {"monitor_interval_s": 0.2, "stage_timeout_s": 1.5},
    "recovery": {"liveness_misses": 2, "probe_interval_s": 0.5},
}
REQUEST = {"model": "mock-model", "prompt": "hello", "max_tokens": 4}


async def admin(fleet, *argv: str, token: str = TOKEN) -> tuple[int, str, str]:
    """Run ``python -m narwhal admin ARGV --url ROUTER`` with the token in the environment."""
    result = await trio.run_process(
        [sys.executable, "-m", "narwhal", "admin", *argv, "--url", fleet.url],
        capture_stdout=True, capture_stderr=True, check=False, env={**os.environ, TOKEN_ENV: token})
    return result.returncode, result.stdout.decode(), result.stderr.decode()


AUTH = {"authorization": f"Bearer {TOKEN}"}


async def engine_state(fleet, name: str) -> dict[str, Any]:
    response = await fleet.client.get(f"{fleet.url}/admin/engines/{name}", headers=AUTH)
    assert response.status_code == 200, response.text
    return response.json()["engine"]


async def restart_engine(nursery: trio.Nursery, fleet, name: str, role: str) -> LocalProcess:
    """Stop the mock engine ``name`` and start a new process on the same port."""
    old = fleet.engines[name]
    await old.stop()
    new = await start_mock_engine(nursery, role, engine_id=name, port=old.port)
    fleet.engines[name] = new
    return new


async def test_an_operator_drains_maintains_and_readmits_an_engine_with_the_cli(start_fleet, nursery) -> None:
    fleet = await start_fleet(prefill=1, decode=2, sections=SECTIONS)
    restarted: list[LocalProcess] = []
    try:
        # Drain: no new placements on d1, the others keep serving.
        code, out, err = await admin(fleet, "drain", "d1")
        assert code == 0, err
        assert out.startswith("d1: drain requested;")
        decodes_before = (await fleet.engine_stats("d1"))["decode"]
        for _ in range(4):
            response = await fleet.client.post(f"{fleet.url}/v1/completions", json=REQUEST)
            assert response.status_code == 200, response.text
        assert (await fleet.engine_stats("d1"))["decode"] == decodes_before
        d1 = await engine_state(fleet, "d1")
        assert d1["drained"] is True and [h["kind"] for h in d1["holds"]] == ["operator_drain"]

        # The drain survives the monitor's successful health sweeps.
        await wait_for_passes(fleet.client, fleet.url, 4, headers=AUTH)
        assert [h["kind"] for h in (await engine_state(fleet, "d1"))["holds"]] == ["operator_drain"]
        code, out, _ = await admin(fleet, "engines")
        assert code == 0
        row = next(line.split() for line in out.splitlines() if line.startswith("d1 "))
        assert row[:4] == ["d1", "decode", "drained", "operator_drain"]

        # Only a successful readmission clears it.
        code, out, err = await admin(fleet, "readmit", "d1")
        assert code == 0, err
        assert out.startswith("d1: readmitted")
        assert (await engine_state(fleet, "d1"))["eligible"] is True

        # Maintenance: refused until the engine runs a newer process, accepted after.
        code, out, err = await admin(fleet, "maintenance", "d1")
        assert code == 0, err
        code, out, err = await admin(fleet, "readmit", "d1")
        assert code == 1 and out == ""
        assert "refused by check newer_process" in err and "restart the engine" in err
        assert (await engine_state(fleet, "d1"))["last_readmission"]["check"] == "newer_process"
        assert [h["kind"] for h in (await engine_state(fleet, "d1"))["holds"]] == ["maintenance"]

        restarted.append(await restart_engine(nursery, fleet, "d1", "decode"))
        code, out, err = await admin(fleet, "readmit", "d1")
        assert code == 0, err
        d1 = await engine_state(fleet, "d1")
        assert d1["eligible"] is True and d1["holds"] == [] and not d1["ejected"]
        assert "newer_process" in d1["last_readmission"]["passed"]

        # Refusals an operator can read: a wrong token and an unknown engine.
        code, _, err = await admin(fleet, "engines", token="wrong")
        assert code == 1 and "HTTP 401" in err
        code, _, err = await admin(fleet, "drain", "d9")
        assert code == 1 and "no engine named 'd9'" in err
    finally:
        with trio.CancelScope(shield=True):
            for process in restarted:
                await process.stop()


async def test_an_ejected_engine_is_readmitted_by_itself_when_it_comes_back_at_the_same_address(
        start_fleet, nursery) -> None:
    fleet = await start_fleet(prefill=1, decode=2, sections=SECTIONS)
    port = fleet.engines["d2"].port
    await fleet.engines["d2"].stop()

    async def ejected() -> bool:
        return (await engine_state(fleet, "d2"))["ejected"]

    await wait_until(ejected, what="d2 to be ejected after it stopped")

    async def refused() -> bool:
        last = (await engine_state(fleet, "d2"))["last_readmission"]
        return last is not None and last["outcome"] == "refused"

    # Readmission attempts fail while it is down, pass after pass: they never give up.
    await wait_until(refused, what="a refused readmission of d2")
    first_refusal = (await engine_state(fleet, "d2"))["last_readmission"]["at"]

    async def refused_again() -> bool:
        last = (await engine_state(fleet, "d2"))["last_readmission"]
        return last["at"] > first_refusal

    await wait_until(refused_again, what="a later readmission attempt of d2")
    d2 = await engine_state(fleet, "d2")
    assert d2["ejected"] and d2["last_readmission"]["outcome"] == "refused"

    new = await start_mock_engine(nursery, "decode", engine_id="d2", port=port)
    try:
        async def back() -> bool:
            return (await engine_state(fleet, "d2"))["eligible"]

        await wait_until(back, what="d2 to be readmitted automatically")
        last = (await engine_state(fleet, "d2"))["last_readmission"]
        assert (last["outcome"], last["operator"]) == ("readmitted", False)
    finally:
        with trio.CancelScope(shield=True):
            await new.stop()
