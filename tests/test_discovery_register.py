"""``narwhal register`` end to end: a real etcd, a mock engine, the registrar as a process.

The key appears within a second or two, SIGTERM revokes it at once, kill -9
leaves it to its TTL, an unhealthy engine is deregistered and registered again
once healthy, and a lease lost to an etcd outage is replaced by a new one.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio

from narwhal.cli import main
from narwhal.discovery.etcd_http import b64, unb64
from narwhal.tools.local_fleet import LocalProcess, start_mock_engine
from tests.discovery_proxy import CuttableProxy
from tests.etcd_server import EtcdServer, start_etcd

P = "/narwhal/engines/"
TTL_S = 2


async def _read_lines(stream: trio.abc.ReceiveStream, sink: list[dict[str, Any]]) -> None:
    buffer = b""
    async for data in stream:
        buffer += data
        *complete, buffer = buffer.split(b"\n")
        for raw in complete:
            try:
                line = msgspec.json.decode(raw)
            except msgspec.DecodeError:
                continue
            if isinstance(line, dict):
                sink.append(line)


class World:
    def __init__(self, nursery: trio.Nursery, client: httpx.AsyncClient, servers: list[EtcdServer],
                 proxy: CuttableProxy, engine: LocalProcess) -> None:
        self.nursery = nursery
        self.client = client
        self.servers = servers  # the last one is the one running
        self.proxy = proxy
        self.engine = engine
        self.processes: list[LocalProcess] = []  # stopped at the end, last first

    async def registrar(self, *extra: str) -> LocalProcess:
        argv = [sys.executable, "-m", "narwhal", "register", "--etcd", self.proxy.url, "--name", "d1",
                "--url", self.engine.url, "--role", "decode", "--ttl-s", str(TTL_S), *extra]
        process = await trio.lowlevel.open_process(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                                   start_new_session=True)
        local = LocalProcess(process, 0, "registrar")
        self.processes.append(local)
        assert process.stderr is not None
        self.nursery.start_soon(_read_lines, process.stderr, local.lines)
        assert await local.wait_event("register_started", timeout_s=15.0), local.lines
        return local

    async def etcd(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = await self.client.post(f"{self.servers[-1].url}{path}", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    async def key(self, name: str = "d1") -> tuple[dict[str, Any], int] | None:
        """The registered value and its lease, or None."""
        kvs = (await self.etcd("/v3/kv/range", {"key": b64(P + name)})).get("kvs") or []
        if not kvs:
            return None
        return json.loads(unb64(kvs[0]["value"])), int(kvs[0].get("lease") or 0)

    async def wait_key(self, present: bool, timeout_s: float, what: str) -> float:
        """Poll until the key is (or is not) there; returns how long that took."""
        started = trio.current_time()
        with trio.move_on_after(timeout_s):
            while (await self.key() is not None) != present:
                await trio.sleep(0.05)
            return trio.current_time() - started
        raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


@pytest.fixture
async def world(nursery, tmp_path: Path):
    servers = [await start_etcd(tmp_path / "etcd")]
    client = httpx.AsyncClient(timeout=5.0)
    processes: list[LocalProcess] = []
    try:
        proxy = await CuttableProxy(int(servers[0].url.rpartition(":")[2])).start(nursery)
        engine = await start_mock_engine(nursery, "decode", engine_id="d1")
        processes.append(engine)
        world = World(nursery, client, servers, proxy, engine)
        world.processes = processes
        yield world
    finally:
        with trio.CancelScope(shield=True):
            for process in reversed(processes):
                await process.stop(grace_s=5.0)
            await client.aclose()
            for server in servers:
                await server.stop()


async def test_the_key_appears_at_once_and_sigterm_revokes_it_at_once(world: World) -> None:
    registrar = await world.registrar("--model", "m1")
    await world.wait_key(True, 3.0, "the registration")
    found = await world.key()
    assert found is not None
    value, lease = found
    assert value == {"url": world.engine.url, "role": "decode", "model": "m1"} and lease != 0
    [registered] = await registrar.wait_event("registered")
    assert registered["reason"] == "started" and registered["lease"] == lease and registered["key"] == P + "d1"
    registrar.process.send_signal(signal.SIGTERM)
    with trio.fail_after(5.0):
        assert await registrar.process.wait() == 0
    assert await world.key() is None  # revoked before it exited, not left to the TTL
    assert registrar.events("deregistered", reason="signal", lease=lease, revoked=True)


async def test_a_registrar_killed_without_a_word_leaves_the_key_to_its_ttl(world: World) -> None:
    registrar = await world.registrar()
    await world.wait_key(True, 3.0, "the registration")
    registrar.kill()
    await registrar.process.wait()
    assert await world.key() is not None
    gone_after = await world.wait_key(False, TTL_S + 3.0, "the lease to expire")
    assert gone_after > 0.5


async def test_an_unhealthy_engine_is_deregistered_and_registered_again_when_healthy(world: World) -> None:
    registrar = await world.registrar()
    await world.wait_key(True, 3.0, "the registration")
    first = await world.key()
    response = await world.client.post(f"{world.engine.url}/mock/faults", json={"mode": "unhealthy"})
    assert response.status_code == 200, response.text
    await world.wait_key(False, 3.0, "the deregistration")
    [gone] = await registrar.wait_event("deregistered")
    assert gone["reason"] == "unhealthy" and "HTTP 503" in gone["detail"]
    await world.client.delete(f"{world.engine.url}/mock/faults")
    await world.wait_key(True, 3.0, "the registration again")
    again = await world.key()
    assert first is not None and again is not None and again[1] != first[1]  # a new lease
    assert await registrar.wait_event("registered", reason="healthy")


async def test_a_lease_lost_in_an_etcd_outage_is_replaced_by_a_new_one(world: World) -> None:
    registrar = await world.registrar()
    await world.wait_key(True, 3.0, "the registration")
    first = await world.key()
    world.proxy.refuse()  # etcd is up, the registrar cannot reach it: its lease expires
    assert await registrar.wait_event("etcd_unavailable", timeout_s=3.0)
    await world.wait_key(False, TTL_S + 3.0, "the lease to expire")
    await world.proxy.listen()
    await world.wait_key(True, 3.0, "the registration again")
    again = await world.key()
    assert first is not None and again is not None and again[1] != first[1]
    assert await registrar.wait_event("registered", reason="lease_lost")
    assert len(registrar.events("etcd_unavailable")) == 1  # once per outage


async def test_etcd_restarted_on_its_data_dir_keeps_the_registration_and_its_lease(world: World,
                                                                                   tmp_path: Path) -> None:
    registrar = await world.registrar()
    await world.wait_key(True, 3.0, "the registration")
    first = await world.key()
    await world.servers[-1].stop()
    assert await registrar.wait_event("etcd_unavailable", timeout_s=3.0)
    world.servers.append(await start_etcd(tmp_path / "etcd"))  # the same data dir, new ports
    world.proxy.target_port = int(world.servers[-1].url.rpartition(":")[2])
    # etcd gives every lease a fresh TTL when it starts: the registrar's keepalives find it alive.
    await trio.sleep(TTL_S + 1.0)
    assert await world.key() == first
    assert [line["reason"] for line in registrar.events("registered")] == ["started"]
    assert not registrar.events("deregistered")


async def test_a_key_deleted_by_hand_is_put_back_under_the_same_lease(world: World) -> None:
    # Two endpoints, the first with nothing listening: the registrar goes on to the second.
    registrar = await world.registrar("--etcd", f"http://127.0.0.1:9,{world.proxy.url}")
    await world.wait_key(True, 3.0, "the registration")
    first = await world.key()
    await world.etcd("/v3/kv/deleterange", {"key": b64(P + "d1")})
    await world.wait_key(True, 3.0, "the key put back")
    assert await world.key() == first
    assert await registrar.wait_event("registered", reason="key_missing")


@pytest.mark.parametrize(("args", "expected"), [
    (["--name", "a/b"], "narwhal register: --name: engine name must be one segment (no '/') after the prefix"),
    (["--ttl-s", "0"], "narwhal register: --ttl-s: must be a positive number of seconds, got 0.0"),
    (["--url", "http://h:1/v1"], "narwhal register: --url/--role/--model: url must have no path"),
    (["--etcd", "127.0.0.1:2379"], "narwhal register: --etcd: expected http://HOST:PORT"),
])
def test_bad_arguments_are_one_line_and_exit_2(args: list[str], expected: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    base = {"--etcd": "http://127.0.0.1:2379", "--name": "d1", "--url": "http://127.0.0.1:8000", "--role": "decode"}
    for i in range(0, len(args), 2):
        base[args[i]] = args[i + 1]
    argv = ["register", *[part for pair in base.items() for part in pair]]
    code = _exit_code(lambda: main(argv))
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith(expected) and err.count("\n") == 1


def _exit_code(run: Callable[[], int]) -> int:
    try:
        return run()
    except SystemExit as exc:
        return int(exc.code or 0)
