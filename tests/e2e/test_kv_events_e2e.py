"""Placement from the engines' own KV events, end to end: mock prefill engines publish vLLM-format events from
their simulated caches, the router subscribes, and places where the blocks really are.

Router and mocks run as processes on 127.0.0.1; the prompts' blocks are put on an engine behind the router's back
(a request sent to the engine directly, as another router would), so only the feed can tell the router where they are.
"""

from __future__ import annotations

import socket
from typing import Any

import httpx
import pytest
import trio

from narwhal.tools.local_fleet import LocalProcess, render_config, start_mock_engine, start_router
from tests.e2e.waiting import wait_until

pytestmark = pytest.mark.e2e

PREFIX_WORDS = 200


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _prompt(group: str, serial: int) -> str:
    return " ".join(f"{group}w{i}" for i in range(PREFIX_WORDS)) + " " + " ".join(f"u{serial}x{i}" for i in range(8))


class KvFleet:
    def __init__(self, router: LocalProcess, engines: dict[str, LocalProcess], client: httpx.AsyncClient,
                 ports: dict[str, int]) -> None:
        self.router, self.engines, self.client, self.ports = router, engines, client, ports
        self.url = router.url
        self.others: list[KvFleet] = []
        self.processes: list[LocalProcess] = []

    async def adopt(self, started: Any) -> LocalProcess:
        """A process the test starts itself, stopped with the fleet's."""
        process: LocalProcess = await started
        self.processes.append(process)
        return process

    async def placement(self) -> dict[str, Any]:
        response = await self.client.get(f"{self.url}/admin/placement")
        assert response.status_code == 200, response.text
        return response.json()

    async def feed(self, name: str) -> dict[str, Any]:
        return (await self.placement())["engines"][name]["kv_events"]

    async def wait_feed(self, name: str, what: str, check: Any, timeout_s: float = 15.0) -> dict[str, Any]:
        async def ok() -> dict[str, Any] | None:
            feed = await self.feed(name)
            return feed if check(feed) else None

        return await wait_until(ok, timeout_s=timeout_s, what=f"{name}'s feed: {what}")

    async def prefill_directly(self, name: str, prompt: str) -> None:
        """A prefill sent to the engine itself, as another router would: this router does not see it."""
        body = {"model": "mock-model", "prompt": prompt, "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
        response = await self.client.post(f"{self.engines[name].url}/v1/completions", json=body)
        assert response.status_code == 200, response.text

    async def complete(self, prompt: str) -> httpx.Response:
        return await self.client.post(f"{self.url}/v1/completions",
                                      json={"model": "mock-model", "prompt": prompt, "max_tokens": 2})

    async def request_line(self, count: int) -> dict[str, Any]:
        async def logged() -> bool:
            return len(self.router.events("request")) >= count

        await wait_until(logged, timeout_s=10.0, what=f"{count} request lines")
        return self.router.events("request")[count - 1]


@pytest.fixture
async def kv_fleet(nursery, tmp_path):
    processes: list[LocalProcess] = []
    client = httpx.AsyncClient(timeout=30.0)

    async def start(*, mode: str = "auto", workers: int = 1, configured: tuple[str, ...] = ("p1", "p2"),
                    publishing: tuple[str, ...] = ("p1", "p2"), routers: int = 1) -> KvFleet:
        engines: dict[str, LocalProcess] = {}
        ports: dict[str, int] = {}
        rows: list[Any] = []
        for name in ("p1", "p2"):
            ports[name] = _free_port()
            replay = _free_port()
            events = ["--kv-events", str(ports[name]), "--kv-events-replay", str(replay)] if name in publishing else []
            engines[name] = await start_mock_engine(nursery, "prefill", engine_id=name, port=_free_port(),
                                                    args=["--tokens", "2", "--cache-blocks", "400", *events])
            processes.append(engines[name])
            extra = {"kv_events": f"tcp://127.0.0.1:{ports[name]}",
                     "kv_events_replay": f"tcp://127.0.0.1:{replay}"} if name in configured else {}
            rows.append((name, engines[name].url, "prefill", "mock-model", extra))
        engines["d1"] = await start_mock_engine(nursery, "decode", engine_id="d1", args=["--tokens", "2"])
        processes.append(engines["d1"])
        rows.append(("d1", engines["d1"].url, "decode"))
        fleets = []
        for index in range(routers):
            config = tmp_path / f"narwhal-{index}.toml"
            config.write_text(render_config(rows, {
                "serving": {"count_tokens": False, "shutdown_grace_s": 2.0, "workers": workers},
                "engine": {"connect_timeout_s": 1.0, "request_timeout_s": 10.0, "health_timeout_s": 0.5},
                "controller": {"monitor_interval_s": 0.2},
                "handoff": {"path": str(tmp_path / f"handoff-{index}.json")},
                "placement": {"kv_events": mode}}))
            router = await start_router(nursery, str(config))
            processes.append(router)
            fleets.append(KvFleet(router, engines, client, ports))
        fleet = fleets[0]
        fleet.others = fleets[1:]
        fleet.processes = processes
        return fleet

    yield start
    with trio.CancelScope(shield=True):
        await client.aclose()
        for process in reversed(processes):
            await process.stop(grace_s=10.0)


async def _live(fleet: KvFleet, *names: str) -> None:
    for name in names:
        await fleet.wait_feed(name, "live", lambda feed: feed["state"] == "live")


@pytest.mark.parametrize("workers", [1, 2])
async def test_the_router_places_where_the_feed_says_the_blocks_are(kv_fleet, workers: int) -> None:
    fleet = await kv_fleet(workers=workers)
    await _live(fleet, "p1", "p2")
    # Put a prefix on each engine in turn behind the router's back: the router follows the blocks.
    serial = sent = 0
    for holder in ("p2", "p1"):
        other = "p1" if holder == "p2" else "p2"
        await fleet.client.post(f"{fleet.engines[other].url}/reset_prefix_cache")
        await fleet.wait_feed(other, "cleared", lambda feed: feed["blocks"] == 0)
        serial += 1
        await fleet.prefill_directly(holder, _prompt(f"A{holder}", serial))
        await fleet.wait_feed(holder, "blocks stored", lambda feed: feed["blocks"] >= PREFIX_WORDS // 16)
        for _ in range(3):
            serial += 1
            response = await fleet.complete(_prompt(f"A{holder}", serial))
            assert response.status_code == 200, response.text
        sent += 3
        await fleet.request_line(sent)
        lines = fleet.router.events("request")[sent - 3:sent]
        assert {line["prefill"] for line in lines} == {holder}, lines
        assert all(line["prefix_match"] and line["prefix_match"] > 0.9 for line in lines), lines
    view = await fleet.placement()
    assert view["kv_events"] == "auto"
    for name in ("p1", "p2"):
        feed = view["engines"][name]["kv_events"]
        assert feed["state"] == "live" and feed["last_seq"] is not None and feed["dropped"] == 0
        assert set(feed) == {"state", "last_seq", "blocks", "events_per_s", "resyncs", "dropped"}
        assert set(view["engines"][name]["index"]) == {"entries", "bytes"}
    metrics = (await fleet.client.get(f"{fleet.url}/metrics")).text
    assert 'narwhal_kv_events_state{engine="p1",model="mock-model",state="live"} 1' in metrics


async def test_the_identity_gives_the_publisher_and_a_new_process_clears_the_engines_blocks(
        kv_fleet, nursery) -> None:
    fleet = await kv_fleet(configured=())
    # No [[engines]] kv_events: the mock's identity reports its endpoints as vLLM holds them (tcp://*:PORT).
    await _live(fleet, "p1", "p2")
    await fleet.prefill_directly("p1", _prompt("B", 1))
    await fleet.wait_feed("p1", "blocks stored", lambda feed: feed["blocks"] >= PREFIX_WORDS // 16)
    # The engine restarts (same addresses): its feed goes down, then the new process's sequence starts over
    # and its cache is empty, so the router forgets what the old one held.
    old = fleet.engines["p1"]
    http_port = int(old.url.rsplit(":", 1)[1])
    old.kill()
    await fleet.wait_feed("p1", "down", lambda feed: feed["state"] == "down")
    fleet.engines["p1"] = await fleet.adopt(start_mock_engine(
        nursery, "prefill", engine_id="p1", port=http_port,
        args=["--tokens", "2", "--cache-blocks", "400", "--kv-events", str(fleet.ports["p1"])]))
    await fleet.wait_feed("p1", "live again, empty", lambda feed: feed["state"] == "live" and feed["blocks"] == 0)
    assert fleet.router.events("kv_events_resync"), "the reconnect's lost events are said"
    await fleet.prefill_directly("p1", _prompt("B", 2))
    await fleet.wait_feed("p1", "the new process's blocks", lambda feed: feed["blocks"] >= PREFIX_WORDS // 16)


@pytest.mark.parametrize("mode", ["required", "auto"])
async def test_required_keeps_an_engine_without_a_live_feed_out_of_prefill(kv_fleet, mode: str) -> None:
    fleet = await kv_fleet(mode=mode, configured=("p1",), publishing=("p1",))
    await _live(fleet, "p1")
    # New prompts (misses) spread over the prefill engines under auto; required leaves p2 out.
    for serial in range(6):
        response = await fleet.complete(_prompt(f"C{serial}", serial))
        assert response.status_code == 200, response.text
    await fleet.request_line(6)
    prefills = {line["prefill"] for line in fleet.router.events("request")}
    assert prefills == ({"p1"} if mode == "required" else {"p1", "p2"})
    view = await fleet.placement()
    assert view["kv_events"] == mode and view["engines"]["p2"]["kv_events"]["state"] == "off"


async def test_two_routers_send_the_same_prefix_to_the_same_engine(kv_fleet) -> None:
    fleet = await kv_fleet(routers=2)
    routers = [fleet, *fleet.others]
    for router in routers:
        await _live(router, "p1", "p2")
    groups, rounds = 6, 6
    for serial in range(groups * rounds):
        # Each router gets half of the prompts: group g's requests alternate between them.
        router = routers[serial % 2]
        response = await router.complete(_prompt(f"G{serial % groups}", serial))
        assert response.status_code == 200, response.text
    engine_of: dict[int, str] = {}
    for index, router in enumerate(routers):
        await router.request_line(groups * rounds // 2)
        # Requests were sequential: a router's request lines are in the order it got them.
        for position, line in enumerate(router.router.events("request")):
            engine_of[2 * position + index] = line["prefill"]
    assert len(engine_of) == groups * rounds
    by_group: dict[int, list[str]] = {}
    for serial, engine in sorted(engine_of.items()):
        by_group.setdefault(serial % groups, []).append(engine)
    # The same engine for the same prefix: each group's most common engine took at least 95% of its requests.
    same = sum(max(engines.count(name) for name in set(engines)) for engines in by_group.values())
    assert same >= 0.95 * groups * rounds, by_group
    # And both engines serve: the prefixes spread.
    assert {engines[0] for engines in by_group.values()} == {"p1", "p2"}, by_group
