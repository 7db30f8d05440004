"""End to end: the engine set and other keys change with SIGHUP or ``POST /admin/reload``, no restart.

The real router (one process, or a controller with two workers) and mock
engines run as processes; the config file is rewritten and the router told to
read it again.
"""

from __future__ import annotations

import os
import signal
import sys
import tomllib
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from narwhal.tools.admin_cli import TOKEN_ENV
from narwhal.tools.local_fleet import LocalProcess, render_config, start_mock_engine, start_router
from tests.e2e.test_lease_e2e import Pair
from tests.e2e.test_placement_e2e import _sample
from tests.e2e.waiting import wait_for_passes, wait_until

pytestmark = pytest.mark.e2e

TOKEN = "e2e-reload-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
REQUEST = {"model": "mock-model", "prompt": "hello", "max_tokens": 4}


def sections(workers: int) -> dict[str, dict[str, Any]]:
    return {
        "serving": {"workers": workers},
        "admin": {"token": TOKEN},
        "engine": {"connect_timeout_s": 0.5, "health_timeout_s": 0.5},
        "controller": {"monitor_interval_s": 0.2, "stage_timeout_s": 1.5},
        "recovery": {"probe_interval_s": 0.5},
    }


def rewrite(path: Path, *, engines: dict[str, tuple[str, str]] | None = None,
            changes: dict[str, dict[str, Any]] | None = None, extra: str = "") -> None:
    """Write ``path`` again: its sections with ``changes`` merged, and ``engines`` (name -> (url, role))."""
    current = tomllib.loads(path.read_text())
    listed = current.pop("engines", [])
    if engines is None:
        engines = {entry["name"]: (entry["url"], entry["role"]) for entry in listed}
    for section, values in (changes or {}).items():
        current.setdefault(section, {}).update(values)
    text = render_config([(name, url, role) for name, (url, role) in engines.items()], current)
    path.write_text(text + extra)


def engine_map(path: Path) -> dict[str, tuple[str, str]]:
    return {entry["name"]: (entry["url"], entry["role"]) for entry in tomllib.loads(path.read_text())["engines"]}


async def engines(fleet) -> dict[str, dict[str, Any]]:
    response = await fleet.client.get(f"{fleet.url}/admin/engines", headers=AUTH)
    assert response.status_code == 200, response.text
    return {entry["name"]: entry for entry in response.json()["engines"]}


def sighup(router: LocalProcess) -> None:
    router.process.send_signal(signal.SIGHUP)


async def reloaded(router: LocalProcess, count: int) -> dict[str, Any]:
    """Wait for the ``count``-th ``config_reloaded`` event and return it."""

    async def enough() -> list[dict[str, Any]]:
        found = router.events("config_reloaded")
        return found if len(found) >= count else []

    return (await wait_until(enough, timeout_s=10.0, what=f"config_reloaded #{count}"))[count - 1]


async def eligible(fleet, name: str, timeout_s: float = 15.0) -> dict[str, Any]:
    async def check() -> dict[str, Any] | None:
        entry = (await engines(fleet)).get(name)
        return entry if entry is not None and entry["eligible"] else None

    return await wait_until(check, timeout_s=timeout_s, what=f"{name} eligible")


class LongStream:
    """A paced streamed completion read in the background: its chunks as they come, ``done`` at its end."""

    def __init__(self, fleet, body: dict[str, Any]) -> None:
        self.fleet = fleet
        self.body = body
        self.received: list[bytes] = []
        self.started = trio.Event()
        self.done = trio.Event()

    @classmethod
    async def start(cls, nursery: trio.Nursery, fleet, *, max_tokens: int) -> LongStream:
        """Start it and wait for its first bytes."""
        stream = cls(fleet, {**REQUEST, "max_tokens": max_tokens, "stream": True})
        nursery.start_soon(stream._read)
        await stream.started.wait()
        return stream

    async def _read(self) -> None:
        fleet = self.fleet
        async with fleet.client.stream("POST", f"{fleet.url}/v1/completions", json=self.body) as response:
            assert response.status_code == 200
            async for chunk in response.aiter_bytes():
                self.received.append(chunk)
                self.started.set()
        self.done.set()

    @property
    def text(self) -> str:
        return b"".join(self.received).decode()


@pytest.mark.parametrize("workers", [1, 2])
async def test_added_engines_enter_through_readmission_and_a_wrong_generation_stays_out(
        start_fleet, nursery, workers: int) -> None:
    fleet = await start_fleet(prefill=1, decode=1, sections=sections(workers))
    good = await start_mock_engine(nursery, "decode", engine_id="d2")
    stale = await start_mock_engine(nursery, "decode", engine_id="d3", args=["--generation", "g0"])
    try:
        before = engine_map(fleet.config_path)
        rewrite(fleet.config_path, engines={**before, "d2": (good.url, "decode"), "d3": (stale.url, "decode")})
        sighup(fleet.router)
        event = await reloaded(fleet.router, 1)
        assert event["engines_added"] == ["d2", "d3"] and event["engines_removed"] == []
        assert event["keys_needing_restart"] == []
        assert fleet.router.events("engine_added", engine="d2") and fleet.router.events("engine_added", engine="d3")

        d2 = await eligible(fleet, "d2")
        assert d2["last_readmission"]["outcome"] == "readmitted"
        assert d2["counters"]["ejections"] == 0  # an addition is not counted as an ejection

        # d2 takes decodes; d3 never does.
        async def d2_served() -> bool:
            response = await fleet.client.post(f"{fleet.url}/v1/completions", json=REQUEST)
            assert response.status_code == 200, response.text
            return (await fleet.client.get(f"{good.url}/mock/stats")).json()["decode"] > 0

        await wait_until(d2_served, timeout_s=20.0, what="a decode on the added engine d2")

        # d3 stays out with the refusal in /admin/engines, retried like any held engine.
        async def refused_twice() -> bool:
            return len(fleet.router.events("readmission", engine="d3", outcome="refused")) >= 2

        await wait_until(refused_twice, timeout_s=15.0, what="d3 refused twice")
        d3 = (await engines(fleet))["d3"]
        assert not d3["eligible"] and d3["ejected_cause"] == "added"
        assert d3["last_readmission"]["check"] == "generation"
        assert "g0" in d3["last_readmission"]["reason"]
        assert (await fleet.client.get(f"{stale.url}/mock/stats")).json()["decode"] == 0
    finally:
        await good.stop()
        await stale.stop()


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_removed_engine_finishes_its_long_stream_then_leaves_and_gets_nothing_more(
        start_fleet, nursery, workers: int) -> None:
    fleet = await start_fleet(prefill=1, decode=1, sections=sections(workers),
                              mock_args=["--token-delay-s", "0.05"])
    replacement = await start_mock_engine(nursery, "decode", engine_id="d2")
    try:
        stream = await LongStream.start(nursery, fleet, max_tokens=60)
        received = stream.received
        # Replace d1 by d2 in one reload while d1 streams.
        before = engine_map(fleet.config_path)
        rewrite(fleet.config_path, engines={"p1": before["p1"], "d2": (replacement.url, "decode")})
        sighup(fleet.router)
        event = await reloaded(fleet.router, 1)
        assert event["engines_added"] == ["d2"] and event["engines_removed"] == ["d1"]
        d1 = (await engines(fleet))["d1"]
        assert d1["removing"] is True and not d1["eligible"]
        # Half-way through the stream d1 is still there, its one request in flight.
        await wait_until(lambda: _count_at_least(received, 30), timeout_s=10.0, what="30 chunks")
        d1 = (await engines(fleet))["d1"]
        assert d1["removing"] is True and d1["in_flight"] == 1
        assert fleet.router.events("engine_removed", engine="d1") == []

        with trio.fail_after(20):
            await stream.done.wait()
        text = stream.text
        assert text.rstrip().endswith("data: [DONE]")
        assert text.count("data: {") >= 60  # every token arrived
        await wait_until(lambda: _has(fleet.router, "engine_removed", engine="d1"), timeout_s=10.0,
                         what="engine_removed d1")
        assert "d1" not in await engines(fleet)
        missing = await fleet.client.get(f"{fleet.url}/admin/engines/d1", headers=AUTH)
        assert missing.status_code == 404

        d1_requests = (await fleet.engine_stats("d1"))["decode"]
        await eligible(fleet, "d2")
        served = 0

        async def six_served() -> bool:
            # A worker whose snapshot has not yet caught up with d2's readmission has no decode
            # engine for a moment (503 no_capacity); nothing else is allowed.
            nonlocal served
            response = await fleet.client.post(f"{fleet.url}/v1/completions", json=REQUEST)
            if response.status_code == 503 and response.json()["error"]["code"] == "no_capacity":
                return False
            assert response.status_code == 200, response.text
            served += 1
            return served >= 6

        await wait_until(six_served, timeout_s=10.0, what="six requests served after the removal")
        assert (await fleet.engine_stats("d1"))["decode"] == d1_requests
        assert (await fleet.client.get(f"{replacement.url}/mock/stats")).json()["decode"] >= 6
    finally:
        await replacement.stop()


async def _count_at_least(received: list[bytes], count: int) -> bool:
    return b"".join(received).count(b"data: {") >= count


async def _has(process: LocalProcess, name: str, **match: Any) -> bool:
    return bool(process.events(name, **match))


async def test_a_broken_config_changes_nothing_and_a_restart_key_is_reported(start_fleet, nursery) -> None:
    fleet = await start_fleet(prefill=1, decode=1, sections=sections(1))
    extra = await start_mock_engine(nursery, "decode", engine_id="d2")
    try:
        before = engine_map(fleet.config_path)
        original = fleet.config_path.read_text()
        rewrite(fleet.config_path, engines={**before, "d2": (extra.url, "decode")},
                changes={"recovery": {"eject_after": 0}})
        sighup(fleet.router)
        failed = await fleet.router.wait_event("config_reload_failed", timeout_s=10.0)
        assert failed, "no config_reload_failed event"
        assert failed[0]["file"] == str(fleet.config_path)
        assert failed[0]["key"] == "recovery" and "eject_after" in failed[0]["problem"]
        await wait_for_passes(fleet.client, fleet.url, 2, headers=AUTH)
        assert fleet.router.events("config_reloaded") == []
        assert sorted(await engines(fleet)) == ["d1", "p1"]
        response = await fleet.client.post(f"{fleet.url}/v1/completions", json=REQUEST)
        assert response.status_code == 200

        # A key that needs a restart is reported and keeps its running value; the others apply.
        fleet.config_path.write_text(original)
        rewrite(fleet.config_path, changes={"serving": {"workers": 3, "listen": "127.0.0.1:1"},
                                            "recovery": {"eject_after": 5}})
        result = await trio.run_process(
            [sys.executable, "-m", "narwhal", "admin", "reload", "--url", fleet.url],
            capture_stdout=True, capture_stderr=True, check=False, env={**os.environ, TOKEN_ENV: TOKEN})
        out = result.stdout.decode()
        assert result.returncode == 0, result.stderr.decode()
        assert "keys changed: recovery.eject_after" in out
        assert "need a restart (running values kept): serving.listen, serving.workers" in out
        event = await reloaded(fleet.router, 1)
        assert event["keys_needing_restart"] == ["serving.listen", "serving.workers"]
        assert event["level"] == "warning"
        response = await fleet.client.post(f"{fleet.url}/v1/completions", json=REQUEST)
        assert response.status_code == 200  # still serving where it was
    finally:
        await extra.stop()


async def test_a_reload_during_a_drain_keeps_the_drain_and_removes_the_drained_engine_at_once(
        start_fleet, nursery) -> None:
    fleet = await start_fleet(prefill=1, decode=2, sections=sections(1))
    extra = await start_mock_engine(nursery, "decode", engine_id="d3")
    try:
        response = await fleet.client.post(f"{fleet.url}/admin/engines/d1/drain", headers=AUTH)
        assert response.status_code == 200
        before = engine_map(fleet.config_path)
        rewrite(fleet.config_path, engines={**before, "d3": (extra.url, "decode")})
        sighup(fleet.router)
        await reloaded(fleet.router, 1)
        d1 = (await engines(fleet))["d1"]
        assert [hold["kind"] for hold in d1["holds"]] == ["operator_drain"] and not d1["eligible"]
        await eligible(fleet, "d3")
        assert [hold["kind"] for hold in (await engines(fleet))["d1"]["holds"]] == ["operator_drain"]

        # Removing the drained engine (nothing in flight) takes it out at once.
        current = engine_map(fleet.config_path)
        del current["d1"]
        rewrite(fleet.config_path, engines=current)
        response = await fleet.client.post(f"{fleet.url}/admin/reload", headers=AUTH)
        assert response.status_code == 200, response.text
        assert response.json()["changes"]["engines_removed"] == ["d1"]
        await wait_until(lambda: _has(fleet.router, "engine_removed", engine="d1"), timeout_s=5.0,
                         what="engine_removed d1")
        assert sorted(await engines(fleet)) == ["d2", "d3", "p1"]
    finally:
        await extra.stop()


@pytest.mark.parametrize("workers", [1, 2])
async def test_resume_after_a_reload_applies_the_running_set(start_fleet, nursery, tmp_path, workers: int) -> None:
    fleet = await start_fleet(prefill=1, decode=1, sections=sections(workers))
    extra = await start_mock_engine(nursery, "decode", engine_id="d2")
    try:
        before = engine_map(fleet.config_path)
        rewrite(fleet.config_path, engines={**before, "d2": (extra.url, "decode")})
        sighup(fleet.router)
        await reloaded(fleet.router, 1)
        await eligible(fleet, "d2")
        response = await fleet.client.post(f"{fleet.url}/admin/engines/d1/drain", headers=AUTH)
        assert response.status_code == 200
        # The handoff is written every pass: two more passes and it holds the drain and d2.
        await wait_for_passes(fleet.client, fleet.url, 2, headers=AUTH)
        await fleet.router.stop()

        router = await start_router(nursery, str(fleet.config_path), args=["--resume"])
        try:
            applied = await router.wait_event("handoff_applied", timeout_s=10.0)
            assert applied, router.events("handoff_not_applied")
            async with httpx.AsyncClient(timeout=10.0) as client:
                response = await client.get(f"{router.url}/admin/engines", headers=AUTH)
                state = {entry["name"]: entry for entry in response.json()["engines"]}
            assert sorted(state) == ["d1", "d2", "p1"]
            assert [hold["kind"] for hold in state["d1"]["holds"]] == ["operator_drain"]
            assert state["d2"]["eligible"]
        finally:
            await router.stop()
    finally:
        await extra.stop()


async def test_a_standby_reloads_its_own_config_and_says_when_its_set_differs_from_the_active(
        nursery, tmp_path) -> None:
    client = httpx.AsyncClient(timeout=10.0)
    pair = Pair(nursery, tmp_path, "file", client, None)
    extra: LocalProcess | None = None
    try:
        await pair.start_engines()
        active, standby = await pair.start_active_and_standby()
        extra = await start_mock_engine(nursery, "decode", engine_id="d3")
        active_config, standby_config = tmp_path / "ra.toml", tmp_path / "rb.toml"

        # The active gets d3; the standby's set now differs from the active's handoff.
        rewrite(active_config, engines={**engine_map(active_config), "d3": (extra.url, "decode")})
        sighup(active)
        await reloaded(active, 1)

        async def d3_eligible_on_active() -> bool:
            return bool((await pair.engine(active, "d3"))["eligible"])

        await wait_until(d3_eligible_on_active, timeout_s=15.0, what="d3 eligible on the active")
        differs = await standby.wait_event("standby_engine_set_differs", timeout_s=10.0)
        assert differs and "d3" in differs[0]["difference"]
        view = await pair.lease_view(standby)
        assert view["role"] == "standby" and "d3" in view["engine_set_differs"]
        assert (await pair.lease_view(active))["engine_set_differs"] is None

        # The standby's own file edited the same way and SIGHUP: it follows the handoff again.
        rewrite(standby_config, engines={**engine_map(standby_config), "d3": (extra.url, "decode")})
        sighup(standby)
        event = await reloaded(standby, 1)
        assert event["engines_added"] == ["d3"]

        async def matches() -> bool:
            return (await pair.lease_view(standby))["engine_set_differs"] is None

        await wait_until(matches, timeout_s=10.0, what="the standby's set matching the handoff")
        applied = (await pair.lease_view(standby))["handoff_applied_pass"]

        async def newer_pass_applied() -> bool:
            return (await pair.lease_view(standby))["handoff_applied_pass"] > applied

        await wait_until(newer_pass_applied, timeout_s=10.0, what="the standby applying the handoff again")
        assert (await pair.engine(standby, "d3"))["name"] == "d3"
    finally:
        with trio.CancelScope(shield=True):
            await client.aclose()
            for router in reversed(pair.routers):
                await router.stop(grace_s=5.0)
            for engine in pair.engines.values():
                await engine.stop(grace_s=5.0)
            if extra is not None:
                await extra.stop()


async def test_a_reload_while_the_router_drains_for_shutdown_applies_and_the_stream_finishes(
        start_fleet, nursery) -> None:
    fleet = await start_fleet(prefill=1, decode=2, sections=sections(1), mock_args=["--token-delay-s", "0.05"])
    stream = await LongStream.start(nursery, fleet, max_tokens=40)
    fleet.router.process.send_signal(signal.SIGTERM)
    assert await fleet.router.wait_event("router_shutdown", timeout_s=5.0)
    current = engine_map(fleet.config_path)
    del current["d2"]
    rewrite(fleet.config_path, engines=current, changes={"recovery": {"eject_after": 4}})
    sighup(fleet.router)
    event = await reloaded(fleet.router, 1)
    assert event["keys_changed"] == ["recovery.eject_after"] and event["engines_removed"] == ["d2"]
    with trio.fail_after(20):
        await stream.done.wait()
    assert stream.text.rstrip().endswith("data: [DONE]")
    with trio.fail_after(15):
        assert await fleet.router.process.wait() == 0
    assert fleet.router.events("router_stopped")


PROMPT = {"model": "mock-model", "prompt": "the same long shared prefix " * 24, "max_tokens": 2}
REASONS = ("hit", "miss", "spill", "only_choice", "least_outstanding")


def prefills(metrics: str, *reasons: str) -> float:
    """Prefill placements counted in ``metrics`` for ``reasons`` (every reason when none are given)."""
    return sum(_sample(metrics, "narwhal_placement_total", role="prefill", reason=reason, model="mock-model")
               for reason in reasons or REASONS)


async def test_placement_and_an_engine_timeout_change_live_by_sighup_in_every_worker(start_fleet) -> None:
    fleet = await start_fleet(prefill=2, decode=1, sections={
        **sections(2), "serving": {"workers": 2, "count_tokens": False},
        "placement": {"policy": "least_outstanding"}})
    for name in ("p1", "p2", "d1"):
        await eligible(fleet, name)
    # Fresh connections, so requests spread over both worker processes.
    async with httpx.AsyncClient(timeout=30.0, limits=httpx.Limits(max_keepalive_connections=0)) as client:

        async def complete() -> None:
            response = await client.post(f"{fleet.url}/v1/completions", json=PROMPT)
            assert response.status_code == 200, response.text

        async def prefill_placements(at_least: int) -> str | None:
            text = (await fleet.client.get(f"{fleet.url}/metrics")).text
            return text if prefills(text) >= at_least else None

        for _ in range(6):
            await complete()
        metrics = await wait_until(lambda: prefill_placements(6), what="six prefill placements reported")
        assert prefills(metrics, "least_outstanding") == 6
        # A first token 1 s late is within the running deadline (30 s).
        await fleet.set_fault("d1", "first_token_delay", delay_s=1.0, legs=["decode"], count=1)
        response = await client.post(f"{fleet.url}/v1/completions", json={**PROMPT, "stream": True})
        assert response.status_code == 200 and response.text.rstrip().endswith("data: [DONE]")

        rewrite(fleet.config_path, changes={"placement": {"policy": "cache_aware"},
                                            "engine": {"first_token_deadline_s": 0.5}})
        sighup(fleet.router)
        event = await reloaded(fleet.router, 1)
        assert event["keys_changed"] == ["engine.first_token_deadline_s", "placement.policy"]
        assert event["keys_needing_restart"] == []

        # Both workers place cache-aware now (a request's log line carries the matched share then).
        async def both_cache_aware() -> bool:
            await complete()
            return {line["worker"] for line in fleet.router.events("request")
                    if line.get("prefix_match") is not None} == {0, 1}

        await wait_until(both_cache_aware, timeout_s=15.0, what="cache-aware placements in both workers")
        for _ in range(6):
            await complete()

        # Workers report their counts in their own time: wait for the hits themselves, not for a total
        # read while a report was still on its way (that total could come one short).
        async def six_hits_reported() -> str | None:
            text = (await fleet.client.get(f"{fleet.url}/metrics")).text
            return text if prefills(text, "hit") >= 6 else None

        after = await wait_until(six_hits_reported, what="six prefix hits reported")
        # The same prompt: its engine keeps it (hits), and nothing is placed by load alone any more.
        assert prefills(after, "least_outstanding") == 7  # the six and the stream before the reload

        # The same late first token now breaks the new deadline, whichever worker serves it.
        await fleet.set_fault("d1", "first_token_delay", delay_s=1.0, legs=["decode"], count=1)
        response = await client.post(f"{fleet.url}/v1/completions", json={**PROMPT, "stream": True})
        assert response.status_code == 502, response.text
        assert "no first token within 0.5 s" in response.json()["error"]["message"]


@pytest.mark.parametrize(("workers", "policy"), [(1, "saturate"), (2, "saturate"), (2, "bounded")])
async def test_a_stream_still_running_on_a_removed_engine_is_cut_at_the_grace_without_blame(
        start_fleet, nursery, workers: int, policy: str) -> None:
    grace_s = 1.0
    fleet = await start_fleet(prefill=1, decode=1, mock_args=["--token-delay-s", "0.05"], sections={
        **sections(workers), "serving": {"workers": workers, "policy": policy, "shutdown_grace_s": grace_s}})
    d2 = await start_mock_engine(nursery, "decode", engine_id="d2")
    try:
        await eligible(fleet, "d1")
        # 200 tokens, one per 50 ms: about 10 s, far past the grace.
        stream = await LongStream.start(nursery, fleet, max_tokens=200)
        rewrite(fleet.config_path, engines={**engine_map(fleet.config_path), "d2": (d2.url, "decode")})
        sighup(fleet.router)
        await reloaded(fleet.router, 1)
        await eligible(fleet, "d2")
        current = engine_map(fleet.config_path)
        del current["d1"]
        rewrite(fleet.config_path, engines=current)
        removed_at = trio.current_time()
        sighup(fleet.router)
        await reloaded(fleet.router, 2)
        with trio.fail_after(8):
            await stream.done.wait()
        took = trio.current_time() - removed_at
        assert await fleet.router.wait_event("engine_removal_cut", engine="d1", timeout_s=5.0)
        [request] = await fleet.router.wait_event("request", timeout_s=5.0)
        if policy == "saturate":
            # Cut at the grace, long before the stream's own end, with the usual SSE error event.
            assert grace_s <= took < 5.0, took
            assert "data: [DONE]" not in stream.text and '"code":"engine_removed"' in stream.text
            assert request["error"] == "engine_removed" and request["decode"] == "d1"
        else:
            # Bounded with continue_streams: the answer goes on from d2 in the same stream.
            assert stream.text.rstrip().endswith("data: [DONE]") and "error" not in stream.text
            assert stream.text.count("data: {") >= 200
            assert request["continuations"] == 1 and request["decode"] == "d2"
            assert request["error"] is None and request["continued_after"] == "engine_removed"
        assert await fleet.router.wait_event("engine_removed", engine="d1", timeout_s=5.0)
        # Nobody is blamed: no failure counted on any engine, and d2 took the next requests.
        state = await engines(fleet)
        assert sorted(state) == ["d2", "p1"]
        assert all(not any(entry["counters"]["failures"].values()) for entry in state.values())
        assert all(entry["eligible"] for entry in state.values())
        response = await fleet.client.post(f"{fleet.url}/v1/completions", json=REQUEST)
        assert response.status_code == 200, response.text
    finally:
        await d2.stop()


CACHE_ARGS = ["--tokens", "2", "--prefix-cache-blocks", "400"]


def group_prompt(group: int, request: int) -> dict[str, Any]:
    """A prompt of ``group``'s long shared prefix (about 20 blocks) and a suffix of its own."""
    prefix = " ".join(f"g{group}w{i}" for i in range(256))
    return {"model": "mock-model", "prompt": f"{prefix} r{request}", "max_tokens": 2}


async def test_cache_aware_placement_follows_a_reloaded_prefill_set_in_both_workers(start_fleet, nursery) -> None:
    # No engine fails here: health checks get time to spare, so that a loaded CI machine does not eject p3 for a
    # moment (a new prefix placed on p2 meanwhile would stay there, equal holders keeping the last one used).
    fleet = await start_fleet(prefill=2, decode=1, mock_args=CACHE_ARGS, sections={
        **sections(2), "serving": {"workers": 2, "count_tokens": False},
        "engine": {"connect_timeout_s": 2.0, "health_timeout_s": 2.0},
        "controller": {"monitor_interval_s": 0.2, "stage_timeout_s": 5.0}})
    p3 = await start_mock_engine(nursery, "prefill", engine_id="p3", args=CACHE_ARGS)
    try:
        for name in ("p1", "p2", "d1"):
            await eligible(fleet, name)
        async with httpx.AsyncClient(timeout=30.0, limits=httpx.Limits(max_keepalive_connections=0)) as client:

            async def complete(group: int, request: int) -> None:
                response = await client.post(f"{fleet.url}/v1/completions", json=group_prompt(group, request))
                assert response.status_code == 200, response.text

            # Eight prefixes spread over p1 and p2 (a miss goes to the emptier index): p2's index then holds about
            # 100 blocks, more than the warm-up below can put on p3 in its 20 s.
            for group in range(8):
                for request in range(3):
                    await complete(group, request)
            before = {name: (await fleet.engine_stats(name))["prefill"] for name in ("p1", "p2")}
            assert before["p1"] > 0 and before["p2"] > 0, before

            # One reload: p1 out, p3 in.
            current = engine_map(fleet.config_path)
            del current["p1"]
            rewrite(fleet.config_path, engines={**current, "p3": (p3.url, "prefill")})
            sighup(fleet.router)
            event = await reloaded(fleet.router, 1)
            assert event["engines_removed"] == ["p1"] and event["engines_added"] == ["p3"]
            await wait_until(lambda: _has(fleet.router, "engine_removed", engine="p1"), timeout_s=10.0,
                             what="engine_removed p1")
            await eligible(fleet, "p3")
            # Each worker learns of the reload from its own snapshot, a moment after the controller. A worker
            # still without p3 would place the new prefix below on p2, and the prefix would then stay there
            # (equal holders go to the one placed last): so first, until both workers have placed a one-block
            # prompt of its own on p3 (the emptiest index; a block each leaves it far emptier than p2).
            warmed = 0

            async def p3_placed_from_both_workers() -> bool:
                nonlocal warmed
                warmed += 1
                response = await client.post(f"{fleet.url}/v1/completions", json={
                    "model": "mock-model", "prompt": " ".join(f"warm{warmed}w{i}" for i in range(16)), "max_tokens": 2})
                assert response.status_code == 200, response.text
                return {line["worker"] for line in fleet.router.events("request") if line["prefill"] == "p3"} == {0, 1}

            # Each round places one more block on p3 (a new prompt), and the workers take connections unevenly (one
            # may take ten in a row): a round every 0.25 s, so p3's index stays below p2's while the rounds last.
            await wait_until(p3_placed_from_both_workers, timeout_s=20.0, what="p3 placed from both workers",
                             poll_s=0.25)

            # A new prefix goes to the engine whose index is empty, p3, and stays there from either worker. The
            # least loaded come first, and a worker counts the other's requests as the controller last reported
            # them: one that still counts a warm-up request on p3 places the prefix on p2 (a miss between
            # unequal loads), where it stays. So a new prefix is tried, a quarter second apart (past the next
            # report: six tried back to back in 0.1 s all met the same stale count once), until one goes to p3.
            async def p3_prefills() -> int:
                return int((await fleet.client.get(f"{p3.url}/mock/stats")).json()["prefill"])

            new_group = 8

            async def a_new_prefix_goes_to_p3() -> bool:
                nonlocal new_group
                new_group += 1
                on_p3 = await p3_prefills()
                await complete(new_group, 0)
                return await p3_prefills() > on_p3

            await wait_until(a_new_prefix_goes_to_p3, timeout_s=20.0,
                             what="a new prefix placed on p3, the emptiest index", poll_s=0.25)

            async def p3_holds_it_in_both_workers() -> bool:
                await complete(new_group, len(fleet.router.events("request")))
                lines = [line for line in fleet.router.events("request") if line["prefill"] == "p3"]
                return {line["worker"] for line in lines if (line["prefix_match"] or 0) > 0.9} == {0, 1}

            try:
                await wait_until(p3_holds_it_in_both_workers, timeout_s=20.0, what="hits on p3 from both workers")
            except AssertionError as exc:
                # What a failure needs to be understood: where each worker put the new prefix, and any ejection.
                placed = [(line["worker"], line["prefill"], line["prefix_match"])
                          for line in fleet.router.events("request")
                          if line["ts"] > event["ts"] and line["prefix_match"] is not None]
                ejected = [(line["engine"], line["reason"]) for line in fleet.router.events("engine_ejected")]
                text = (await fleet.client.get(f"{fleet.url}/metrics")).text
                entries = {name: _sample(text, "narwhal_placement_index_entries", engine=name, model="mock-model")
                           for name in ("p2", "p3")}
                raise AssertionError(f"{exc}; placed after the reload (worker, prefill, match): {placed[-12:]}; "
                                     f"ejections: {ejected}; index entries: {entries}; warm-up rounds: {warmed}"
                                     ) from None
            # The old prefixes: those p1 held go elsewhere, those on p2 stay.
            for group in range(8):
                await complete(group, 100)
        stats = {name: await fleet.engine_stats(name) for name in ("p1", "p2")}
        p3_stats = (await fleet.client.get(f"{p3.url}/mock/stats")).json()
        assert stats["p1"]["prefill"] == before["p1"]  # nothing reached the removed engine
        assert p3_stats["prefill"] >= 2 and p3_stats["prefix_cache"]["cached_tokens"] > 0
        # The index keys follow the set: p1's gone from /metrics and /admin/engines, p3's there.
        metrics = (await fleet.client.get(f"{fleet.url}/metrics")).text
        assert 'narwhal_placement_index_entries{engine="p1",' not in metrics
        assert _sample(metrics, "narwhal_placement_index_entries", engine="p3", model="mock-model") > 0
        assert (await engines(fleet))["p3"]["prefix_index"]["entries"] > 0
        assert not [line for line in fleet.router.events("request")
                    if line["prefill"] == "p1" and line["ts"] > event["ts"]]
    finally:
        await p3.stop()
