"""End to end, the fleet rules of issue 10: quarantine clearing by cause, overload on a
probe leg, probes that cannot deadlock, and one classification of health answers.

Each test runs the real router and mock engines as processes on 127.0.0.1 and
talks HTTP to them; faults are injected over the mock's own API.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest
import trio

from narwhal.tools.local_fleet import render_config, start_mock_engine, start_router
from tests.e2e.waiting import wait_for_passes, wait_until

pytestmark = pytest.mark.e2e

ENGINE = {"connect_timeout_s": 0.5, "request_timeout_s": 2.0, "first_token_deadline_s": 2.0,
          "stream_silence_s": 1.0, "health_timeout_s": 0.5}
REQUEST = {"model": "mock-model", "prompt": "hello", "max_tokens": 4, "stream": True}


def sections(**recovery: Any) -> dict[str, dict[str, Any]]:
    return {"serving": {"count_tokens": False}, "engine": ENGINE,
            "controller": {"monitor_interval_s": 0.2, "stage_timeout_s": 1.5},
            "recovery": {"liveness_misses": 3, **recovery}}


async def engines(fleet) -> dict[str, dict[str, Any]]:
    response = await fleet.client.get(f"{fleet.url}/admin/engines")
    return {engine["name"]: engine for engine in response.json()["engines"]}


async def complete(fleet) -> int:
    response = await fleet.client.post(f"{fleet.url}/v1/completions", json=REQUEST)
    return response.status_code


async def ready(fleet) -> int:
    return (await fleet.client.get(f"{fleet.url}/ready")).status_code


async def test_decodes_failing_while_health_answers_cost_clients_at_most_eject_after_failures(start_fleet):
    # The operator's report: 15 failed requests in 12 s instead of 3.
    fleet = await start_fleet(decode=2, sections=sections(eject_after=3, probe_interval_s=1.0,
                                                          failure_quarantine_s=60.0))
    await fleet.set_fault("d1", "status_5xx", legs=["decode"])  # /health keeps answering 200

    def refused() -> list[dict[str, Any]]:
        return fleet.router.events("readmission", engine="d1", outcome="refused", check="inference")

    # Clients keep coming, one after another, until at least 50 were sent and readmission
    # tried (and refused) twice meanwhile: counted by requests and events, not by a time window.
    sent = failures = 0
    with trio.fail_after(45.0):  # well inside the 60 s quarantine
        while sent < 50 or len(refused()) < 2:
            sent += 1
            if await complete(fleet) != 200:
                failures += 1
    assert failures == 3  # eject_after, once: the quarantine period (60 s) outlasts the test
    view = (await engines(fleet))["d1"]
    assert view["ejected"]
    [quarantine] = [hold for hold in view["holds"] if hold["kind"] == "failure_quarantine"]
    assert quarantine["cause"] == "inference_status"  # the probe's decode leg answered 500
    # Readmission kept trying every probe_interval_s, and its inference probe kept it out.
    assert not fleet.router.events("readmission", engine="d1", outcome="readmitted")
    # A healthy engine again: the next attempt's probe passes and clears the quarantine.
    await fleet.clear_faults("d1")

    async def readmitted() -> bool:
        return (await engines(fleet))["d1"]["eligible"]

    await wait_until(readmitted, timeout_s=20.0, what="d1 readmitted through its inference probe")
    assert (await engines(fleet))["d1"]["holds"] == []


async def test_an_overloaded_engine_under_verification_stays_held_and_is_never_ejected(start_fleet):
    fleet = await start_fleet(decode=2, sections=sections(eject_after=3, probe_interval_s=0.5,
                                                          failure_quarantine_s=60.0))
    # Three 500s, then 429 to every decode (the faults act in the order they were set).
    await fleet.set_fault("d1", "status_500", count=3, legs=["decode"])
    await fleet.set_fault("d1", "status_429", legs=["decode"])

    async def held() -> bool:
        return any(hold["kind"] == "inference_verification" for hold in (await engines(fleet))["d1"]["holds"])

    for _ in range(200):
        await complete(fleet)
        if await held():
            break
    assert await held()

    async def probed_inconclusively_three_times() -> bool:
        return len(fleet.router.events("probe_result", engine="d1", probe="inference",
                                       outcome="inconclusive")) >= 3

    await wait_until(probed_inconclusively_three_times, timeout_s=20.0, what="three inconclusive probes of d1")
    view = (await engines(fleet))["d1"]
    assert not view["ejected"] and not view["eligible"]
    assert not fleet.router.events("engine_ejected", engine="d1")
    assert "429" in fleet.router.events("probe_result", engine="d1", probe="inference")[-1]["reason"]
    # Meanwhile clients are served by the peer.
    assert [await complete(fleet) for _ in range(5)] == [200] * 5
    await fleet.clear_faults("d1")

    async def recovered() -> bool:
        return (await engines(fleet))["d1"]["eligible"]

    await wait_until(recovered, timeout_s=20.0, what="d1 cleared by a passing probe")


async def test_a_fleet_wide_burst_of_health_5xx_recovers_by_itself(start_fleet):
    fleet = await start_fleet(prefill=1, decode=1, sections=sections(eject_after=2, probe_interval_s=0.5))
    for name in fleet.engines:
        await fleet.set_fault(name, "unhealthy")  # /health answers 503; inference still works

    async def all_held() -> bool:
        # Counted by events, not by catching /ready's 503: each probe that passes clears its hold at once, so
        # the moment every engine is held at the same time can be too short to poll under load.
        return all(fleet.router.events("engine_hold_added", engine=name, hold_kind="inference_verification")
                   for name in fleet.engines)

    await wait_until(all_held, timeout_s=20.0, what="every engine held for verification")
    # Let the burst go on for a few monitor passes: every sweep sees 503 everywhere.
    await wait_for_passes(fleet.client, fleet.url, 3)
    for name in fleet.engines:
        await fleet.clear_faults(name)

    async def ready_again() -> bool:
        return await ready(fleet) == 200

    await wait_until(ready_again, timeout_s=20.0, what="/ready 200 again without an operator")
    view = await engines(fleet)
    # An engine that answers /health is not silent: no liveness ejection, no readmission needed.
    assert not any(engine["ejected"] for engine in view.values())
    assert not fleet.router.events("engine_ejected")
    for name in fleet.engines:
        assert fleet.router.events("engine_hold_added", engine=name, hold_kind="inference_verification")
        assert fleet.router.events("probe_result", engine=name, probe="inference", outcome="success")
    assert await complete(fleet) == 200


async def test_the_default_handoff_lives_in_the_state_directory_and_the_startup_line_says_where(
        nursery, tmp_path):
    # Issue 10, rule 7: no [handoff] path, so nothing may land in the working directory.
    engines = {name: await start_mock_engine(nursery, role, engine_id=name)
               for name, role in (("p1", "prefill"), ("d1", "decode"))}
    config = tmp_path / "etc" / "narwhal.toml"
    config.parent.mkdir()
    config.write_text(render_config([(name, p.url, "prefill" if name == "p1" else "decode")
                                     for name, p in engines.items()],
                                    {"controller": {"monitor_interval_s": 0.2}}))
    state = tmp_path / "state"  # does not exist yet: the router creates it
    in_cwd = set(Path.cwd().glob("narwhal-handoff*.json"))
    router = await start_router(nursery, str(config), env={"XDG_STATE_HOME": str(state)})
    try:
        [started] = router.events("router_started")
        # Port 0: the router's process names its default file (narwhal-handoff-<host>-<pid>.json).
        expected = state / "narwhal" / f"narwhal-handoff-{socket.gethostname()}-{router.pid}.json"
        assert started["handoff"] == str(expected)

        async def written() -> bool:
            return expected.exists()

        await wait_until(written, what="the handoff written to the state directory")
        assert json.loads(expected.read_bytes())["engine_set"]
        assert not list(config.parent.glob("narwhal-handoff*.json"))
        assert set(Path.cwd().glob("narwhal-handoff*.json")) == in_cwd
    finally:
        with trio.CancelScope(shield=True):
            await router.stop(grace_s=10.0)
            for engine in engines.values():
                await engine.stop(grace_s=10.0)
