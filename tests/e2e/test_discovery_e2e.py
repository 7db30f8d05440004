"""Discovery on a real etcd, end to end: ``narwhal serve`` with ``[discovery] backend = "etcd"`` and no
``[[engines]]``, mock engines registered by ``narwhal register`` processes.

Engines serve within 2 s of their key appearing; a registrar killed with -9 takes its engine away after the
TTL; etcd stopped and restarted drops no engine; a change made while the router could not read etcd is
applied once it can.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from narwhal.discovery.etcd_http import b64
from narwhal.tools.local_fleet import LocalProcess, render_config, start_mock_engine, start_router
from tests.discovery_proxy import CuttableProxy
from tests.e2e.waiting import wait_until
from tests.etcd_server import EtcdServer, start_etcd
from tests.test_discovery_register import _read_lines

pytestmark = pytest.mark.e2e

P = "/narwhal/engines/"
TTL_S = 2
REQUEST = {"model": "mock-model", "prompt": "hello", "max_tokens": 4}


class World:
    def __init__(self, nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient, workers: int = 1) -> None:
        self.nursery = nursery
        self.workers = workers
        self.recovery: dict[str, Any] = {"probe_interval_s": 1.0}
        self.tmp_path = tmp_path
        self.client = client
        self.servers: list[EtcdServer] = []
        self.processes: list[LocalProcess] = []
        self.engines: dict[str, LocalProcess] = {}
        self.router: LocalProcess | None = None
        self.router_proxy: CuttableProxy | None = None  # the router's way to etcd
        self.store_proxy: CuttableProxy | None = None  # the registrars' way to etcd

    @property
    def url(self) -> str:
        assert self.router is not None
        return self.router.url

    async def start(self) -> None:
        """etcd, the proxies, three mock engines (p1, d1, d2) and the router; nothing registered yet."""
        self.servers.append(await start_etcd(self.tmp_path / "etcd"))
        port = int(self.servers[-1].url.rpartition(":")[2])
        self.router_proxy = await CuttableProxy(port).start(self.nursery)
        self.store_proxy = await CuttableProxy(port).start(self.nursery)
        for name, role in (("p1", "prefill"), ("d1", "decode"), ("d2", "decode")):
            self.engines[name] = await start_mock_engine(self.nursery, role, engine_id=name)
            self.processes.append(self.engines[name])
        config = self.tmp_path / "narwhal.toml"
        config.write_text(render_config([], {
            "serving": {"shutdown_grace_s": 2.0, "workers": self.workers},
            "engine": {"connect_timeout_s": 1.0, "request_timeout_s": 10.0},
            "handoff": {"path": str(self.tmp_path / "handoff.json")},
            "fleet": {"attestation_key": "narwhal-dev-key"},
            "recovery": self.recovery,
            "discovery": {"backend": "etcd", "endpoints": [self.router_proxy.url]},
        }))
        self.router = await start_router(self.nursery, str(config))
        self.processes.append(self.router)

    async def restart_etcd(self, down_s: float) -> None:
        """Stop etcd, wait, start it again on its data dir (new ports: both proxies follow)."""
        await self.servers[-1].stop()
        await trio.sleep(down_s)
        self.servers.append(await start_etcd(self.tmp_path / "etcd"))
        port = int(self.servers[-1].url.rpartition(":")[2])
        assert self.router_proxy is not None and self.store_proxy is not None
        self.router_proxy.target_port = self.store_proxy.target_port = port

    async def register(self, name: str) -> LocalProcess:
        engine = self.engines[name]
        role = "prefill" if name.startswith("p") else "decode"
        assert self.store_proxy is not None
        argv = [sys.executable, "-m", "narwhal", "register", "--etcd", self.store_proxy.url, "--name", name,
                "--url", engine.url, "--role", role, "--ttl-s", str(TTL_S)]
        process = await trio.lowlevel.open_process(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                                   start_new_session=True)
        local = LocalProcess(process, 0, f"registrar-{name}")
        self.processes.append(local)
        assert process.stderr is not None
        self.nursery.start_soon(_read_lines, process.stderr, local.lines)
        return local

    async def key_present(self, name: str) -> bool:
        response = await self.client.post(f"{self.servers[-1].url}/v3/kv/range", json={"key": b64(P + name)})
        return bool(response.json().get("kvs"))

    async def engines_state(self) -> dict[str, dict[str, Any]]:
        response = await self.client.get(f"{self.url}/admin/engines")
        assert response.status_code == 200, response.text
        return {engine["name"]: engine for engine in response.json()["engines"]}

    async def discovery(self) -> dict[str, Any]:
        response = await self.client.get(f"{self.url}/admin/discovery")
        assert response.status_code == 200, response.text
        return response.json()


@pytest.fixture(params=[1, 2], ids=["one-process", "two-workers"])
async def world(nursery, tmp_path: Path, request: pytest.FixtureRequest):
    client = httpx.AsyncClient(timeout=10.0)
    built = World(nursery, tmp_path, client, workers=request.param)
    try:
        await built.start()
        yield built
    finally:
        with trio.CancelScope(shield=True):
            for process in reversed(built.processes):
                await process.stop(grace_s=5.0)
            await client.aclose()
            for server in built.servers:
                await server.stop()


async def _ready(world: World) -> bool:
    return (await world.client.get(f"{world.url}/ready")).status_code == 200


async def _serves_within(world: World, names: list[str], limit_s: float) -> None:
    """Every engine of ``names`` registered now: each key appears, and traffic flows within ``limit_s`` of it."""
    async def keys() -> bool:
        return all([await world.key_present(name) for name in names])

    await wait_until(keys, 10.0, f"the keys of {names}", poll_s=0.02)
    appeared = trio.current_time()

    async def eligible() -> bool:
        state = await world.engines_state()
        return all(name in state and state[name]["eligible"] for name in names)

    await wait_until(eligible, limit_s + 1.0, f"{names} eligible", poll_s=0.02)
    response = await world.client.post(f"{world.url}/v1/completions", json=REQUEST)
    assert response.status_code == 200, response.text
    took = trio.current_time() - appeared
    assert took < limit_s, f"{names} served {took:.2f} s after their keys appeared"


async def test_registered_engines_serve_within_2_s_and_a_killed_registrar_takes_its_engine_after_the_ttl(
        world: World) -> None:
    assert (await world.client.get(f"{world.url}/ready")).status_code == 503  # no engine yet
    view = await world.discovery()
    assert view["backend"] == "etcd" and view["state"] == "ok" and view["engines"] == []
    assert (await world.client.get(f"{world.url}/v1/models")).json()["data"] == []
    await world.register("p1")
    d1 = await world.register("d1")
    await _serves_within(world, ["p1", "d1"], 2.0)
    assert await _ready(world)
    assert {name: e["source"] for name, e in (await world.engines_state()).items()} == {"p1": "discovery",
                                                                                       "d1": "discovery"}
    models = (await world.client.get(f"{world.url}/v1/models")).json()["data"]
    assert [card["id"] for card in models] == ["mock-model"]  # the discovered engines' model is served
    view = await world.discovery()
    assert sorted(e["name"] for e in view["engines"]) == ["d1", "p1"] and view["revision"] > 0
    assert view["last_event_at"] is not None and view["view_age_s"] is not None
    assert world.router is not None
    [found] = await world.router.wait_event("engine_discovered", engine="d1")
    assert found["source"] == "etcd" and found["role"] == "decode" and found["url"] == world.engines["d1"].url

    d1.kill()
    killed = trio.current_time()

    async def gone() -> bool:
        return "d1" not in await world.engines_state()

    await wait_until(gone, TTL_S + 5.0, "d1 to leave after its TTL", poll_s=0.05)
    assert trio.current_time() - killed > 0.5  # left to its TTL, not at once
    assert world.router.events("engine_vanished", engine="d1", source="etcd")
    assert not await _ready(world)  # no decode engine left


@pytest.mark.long
async def test_an_etcd_outage_drops_no_engine_and_a_change_made_meanwhile_is_applied_once_back(
        world: World) -> None:
    await world.register("p1")
    await world.register("d1")
    await _serves_within(world, ["p1", "d1"], 2.0)
    assert world.router is not None and world.router_proxy is not None

    # etcd itself stopped (30 s, the issue's outage, in one of the two runs), then back on its data dir: nothing
    # leaves meanwhile.
    await world.restart_etcd(30.0 if world.workers == 1 else 3.0)
    assert world.router.events("discovery_degraded")
    await wait_until(lambda: world.router.wait_event("discovery_recovered", timeout_s=0.1), 10.0,  # type: ignore[union-attr]
                     "discovery_recovered")
    assert set(await world.engines_state()) == {"p1", "d1"}
    assert not world.router.events("engine_vanished")
    assert await _ready(world)

    # The router cut off from etcd while d2 registers: it keeps serving p1 and d1, and finds d2 once back.
    world.router_proxy.refuse()

    async def is_degraded() -> dict[str, Any] | None:
        view = await world.discovery()
        return view if view["state"] == "degraded" else None

    degraded = await wait_until(is_degraded, 10.0, "discovery degraded")
    assert degraded["state"] == "degraded" and {e["name"] for e in degraded["engines"]} == {"p1", "d1"}
    await world.register("d2")
    await wait_until(lambda: world.key_present("d2"), 10.0, "d2's key")
    await trio.sleep(1.0)
    assert "d2" not in await world.engines_state()
    assert await _ready(world)
    await world.router_proxy.listen()

    async def d2_eligible() -> bool:
        state = await world.engines_state()
        return "d2" in state and bool(state["d2"]["eligible"])

    await wait_until(d2_eligible, 10.0, "d2 applied once etcd is back")
    assert set(await world.engines_state()) == {"p1", "d1", "d2"}
    assert not world.router.events("engine_vanished")
    assert (await world.discovery())["state"] == "ok"
    assert json.dumps(degraded)  # the answer is JSON all through


async def test_resume_applies_a_handoff_that_holds_discovered_engines(world: World) -> None:
    # The handoff's engine set is the file's engines plus the discovered ones: --resume compares it with the
    # same union, once discovery's first list is in, and an operator drain of a discovered engine survives.
    if world.workers != 1:
        pytest.skip("one process is enough: resume happens in the controller")
    for name in ("p1", "d1", "d2"):
        await world.register(name)
    await _serves_within(world, ["p1", "d1", "d2"], 2.0)
    assert world.router is not None
    assert (await world.client.post(f"{world.url}/admin/engines/d2/drain")).status_code == 200

    async def drain_saved() -> bool:
        handoff = world.tmp_path / "handoff.json"
        if not handoff.exists():
            return False
        document = json.loads(handoff.read_text())
        return any(entry == "d2" or (isinstance(entry, dict) and entry.get("name") == "d2")
                   for entry in document.get("drained", []))

    await wait_until(drain_saved, 10.0, "the drain in the handoff")
    await world.router.stop(grace_s=5.0)
    world.processes.remove(world.router)
    world.router = await start_router(world.nursery, str(world.tmp_path / "narwhal.toml"), args=["--resume"])
    world.processes.append(world.router)
    [applied] = await world.router.wait_event("handoff_applied", timeout_s=10.0)
    assert applied
    assert not world.router.events("handoff_not_applied")
    state = await world.engines_state()
    assert state["d2"]["drained"] and not state["d2"]["eligible"]
    assert state["d1"]["eligible"] and state["p1"]["eligible"]


async def test_a_discovered_name_of_the_file_stops_the_start_in_one_line(tmp_path: Path) -> None:
    server = await start_etcd(tmp_path / "etcd")
    try:
        async with httpx.AsyncClient(timeout=5.0) as client:
            value = json.dumps({"url": "http://127.0.0.1:9", "role": "decode"}).encode()
            response = await client.post(f"{server.url}/v3/kv/put", json={"key": b64(P + "d1"),
                                                                           "value": b64(value)})
            assert response.status_code == 200
        config = tmp_path / "narwhal.toml"
        config.write_text(render_config(
            [("p1", "http://127.0.0.1:9", "prefill"), ("d1", "http://127.0.0.1:19", "decode")],
            {"handoff": {"path": str(tmp_path / "h.json")},
             "discovery": {"backend": "etcd", "endpoints": [server.url]}}))
        result = await trio.run_process(
            [sys.executable, "-m", "narwhal", "serve", "--config", str(config), "--listen", "127.0.0.1:0"],
            capture_stdout=True, capture_stderr=True, check=False)
        stderr = result.stderr.decode()
        assert result.returncode == 2, stderr
        assert "Traceback" not in stderr
        assert ("narwhal: cannot start: discovery: engine 'd1' is both in the config file's [[engines]] and "
                "discovered at /narwhal/engines/d1: rename one") in stderr
    finally:
        await server.stop()


@pytest.fixture
async def flap_world(nursery, tmp_path: Path):
    client = httpx.AsyncClient(timeout=10.0)
    built = World(nursery, tmp_path, client)
    # A readmission that lasts less than 10 s is a flap; the first flap backs off 2 s (the recheck period).
    built.recovery = {"probe_interval_s": 10.0, "recheck_interval_s": 2.0}
    try:
        await built.start()
        yield built
    finally:
        with trio.CancelScope(shield=True):
            for process in reversed(built.processes):
                await process.stop(grace_s=5.0)
            await client.aclose()
            for server in built.servers:
                await server.stop()


async def test_an_engine_that_comes_straight_back_waits_out_its_backoff(flap_world: World) -> None:
    world = flap_world
    await world.register("p1")
    d1 = await world.register("d1")
    await _serves_within(world, ["p1", "d1"], 2.0)
    d1.process.send_signal(signal.SIGTERM)  # revokes its lease: the key goes at once
    with trio.fail_after(5.0):
        await d1.process.wait()

    async def gone() -> bool:
        return "d1" not in await world.engines_state()

    await wait_until(gone, 5.0, "d1 removed", poll_s=0.02)
    await world.register("d1")
    await wait_until(lambda: world.key_present("d1"), 5.0, "d1's key again", poll_s=0.02)
    back = trio.current_time()

    async def eligible() -> bool:
        state = await world.engines_state()
        return "d1" in state and bool(state["d1"]["eligible"])

    await wait_until(eligible, 10.0, "d1 readmitted after its backoff", poll_s=0.05)
    took = trio.current_time() - back
    assert took >= 1.5, f"d1 back in placement {took:.2f} s after it came back: faster than its 2 s backoff"
    assert world.router is not None and world.router.events("engine_discovered", engine="d1")


async def test_with_a_lease_the_holder_applies_a_standby_watches_and_serves_them_once_it_takes_over(
        nursery, tmp_path: Path) -> None:
    client = httpx.AsyncClient(timeout=10.0)
    world = World(nursery, tmp_path, client)
    routers: dict[str, LocalProcess] = {}
    try:
        world.servers.append(await start_etcd(tmp_path / "etcd"))
        port = int(world.servers[-1].url.rpartition(":")[2])
        world.store_proxy = await CuttableProxy(port).start(nursery)
        for name, role in (("p1", "prefill"), ("d1", "decode")):
            world.engines[name] = await start_mock_engine(nursery, role, engine_id=name)
            world.processes.append(world.engines[name])
        await world.register("p1")
        await world.register("d1")
        for router_id in ("ra", "rb"):
            config = tmp_path / f"{router_id}.toml"
            (tmp_path / router_id).mkdir()
            config.write_text(render_config([], {
                "serving": {"shutdown_grace_s": 2.0},
                "engine": {"connect_timeout_s": 1.0, "request_timeout_s": 10.0},
                "controller": {"monitor_interval_s": 0.2, "stage_timeout_s": 1.0},
                "handoff": {"path": str(tmp_path / router_id / "handoff.json")},
                "fleet": {"attestation_key": "narwhal-dev-key"},
                "recovery": {"probe_interval_s": 1.0},
                "lease": {"backend": "etcd", "router_id": router_id, "endpoints": [world.servers[-1].url],
                          "key": "/narwhal/test-lease", "ttl_s": 2.0, "renew_interval_s": 0.4,
                          "fence_margin_s": 0.6},
                # Discovery on the lease's etcd (the default endpoints).
                "discovery": {"backend": "etcd"},
            }))
            routers[router_id] = await start_router(nursery, str(config))
            world.processes.append(routers[router_id])
            if router_id == "ra":
                world.router = routers["ra"]
                await _serves_within(world, ["p1", "d1"], 5.0)
        active, standby = routers["ra"], routers["rb"]

        async def discovery(router: LocalProcess) -> dict[str, Any]:
            return (await client.get(f"{router.url}/admin/discovery")).json()

        async def standby_sees_both() -> bool:
            view = await discovery(standby)
            return sorted(e["name"] for e in view["engines"]) == ["d1", "p1"]

        await wait_until(standby_sees_both, 10.0, "the standby's view")
        view = await discovery(standby)
        assert view["acting"] is False and view["state"] == "ok"
        assert (await discovery(active))["acting"] is True
        engines = (await client.get(f"{standby.url}/admin/engines")).json()["engines"]
        assert engines == []  # a standby only watches
        assert (await client.get(f"{standby.url}/ready")).status_code == 503

        active.kill()
        world.router = standby

        async def standby_serves() -> bool:
            response = await client.post(f"{standby.url}/v1/completions", json=REQUEST)
            return response.status_code == 200

        await wait_until(standby_serves, 15.0, "the standby serving the discovered engines")
        assert (await discovery(standby))["acting"] is True
        assert standby.events("lease_acquired", holder="rb")
        assert not standby.events("standby_engine_set_differs")  # it compared with what it saw discovered
    finally:
        with trio.CancelScope(shield=True):
            for process in reversed(world.processes):
                await process.stop(grace_s=5.0)
            await client.aclose()
            for server in world.servers:
                await server.stop()
