"""The vLLM plugin registering the engine it runs in: a real etcd, the middleware driven as an ASGI app.

The key appears (with the engine's url, role and model) once ``/health`` answers 200, is kept past
its TTL, vanishes at once at lifespan shutdown, survives an etcd restart, and comes back under a new
lease after an outage longer than the TTL. What cannot be registered is one logged error, never a
crash of the engine.
"""

from __future__ import annotations

import base64
import http.server
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from narwhal.engine_plugin import IdentityMiddleware, PluginSettings
from narwhal.plugin_register import PluginRegistrar, Registration, registration_from_environment
from tests.discovery_proxy import CuttableProxy
from tests.etcd_server import EtcdServer, start_etcd

P = "/narwhal/engines/"
TTL_S = 2
CONSUMER = '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}'
ARGV = ["vllm", "serve", "Qwen/Qwen3-0.6B", "--kv-transfer-config", CONSUMER]
ENV = {"NARWHAL_ENGINE_ID": "d1", "NARWHAL_GENERATION": "g1", "NARWHAL_REGISTER_TTL_S": str(TTL_S)}


class Health:
    """vLLM's /health, as a thread: answers ``status``."""

    def __init__(self) -> None:
        self.status = 200
        health = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                self.send_response(health.status if self.path == "/health" else 404)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


@pytest.fixture
def health() -> Iterator[Health]:
    server = Health()
    yield server
    server.close()


@pytest.fixture
async def etcd(tmp_path: Path):
    servers = [await start_etcd(tmp_path / "etcd")]
    try:
        yield servers  # the last one is the one running
    finally:
        with trio.CancelScope(shield=True):
            for server in servers:
                await server.stop()


async def key(servers: list[EtcdServer]) -> tuple[dict[str, Any], int] | None:
    """The registered value and its lease, or None."""
    async with httpx.AsyncClient(timeout=5.0) as client:
        response = await client.post(f"{servers[-1].url}/v3/kv/range",
                                     json={"key": base64.b64encode(f"{P}d1".encode()).decode()})
    kvs = response.json().get("kvs") or []
    if not kvs:
        return None
    return json.loads(base64.b64decode(kvs[0]["value"])), int(kvs[0].get("lease") or 0)


async def wait_key(servers: list[EtcdServer], present: bool, timeout_s: float) -> None:
    with trio.fail_after(timeout_s):
        while (await key(servers) is not None) != present:
            await trio.sleep(0.05)


async def lifespan_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """vLLM's app as far as lifespan goes."""
    assert scope["type"] == "lifespan"
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


class Lifespan:
    """A server's side of the lifespan protocol, against the middleware."""

    def __init__(self, middleware: IdentityMiddleware) -> None:
        self.middleware = middleware
        self.to_app, self._from_server = trio.open_memory_channel[dict[str, Any]](4)
        self.sent: list[dict[str, Any]] = []
        self.done = trio.Event()

    async def _send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    async def run(self) -> None:
        await self.middleware({"type": "lifespan", "asgi": {"version": "3.0"}}, self._from_server.receive, self._send)
        self.done.set()

    async def startup(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self.run)
        await self.to_app.send({"type": "lifespan.startup"})

    async def shutdown(self) -> None:
        await self.to_app.send({"type": "lifespan.shutdown"})
        with trio.fail_after(10):
            await self.done.wait()


def middleware(env: dict[str, str], argv: list[str] = ARGV) -> IdentityMiddleware:
    return IdentityMiddleware(lifespan_app, PluginSettings.from_environment(env, argv, started_at=1.0))


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "narwhal.engine_plugin"]


async def test_registered_once_healthy_kept_past_the_ttl_and_revoked_at_shutdown(
        nursery: trio.Nursery, etcd: list[EtcdServer], health: Health, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.engine_plugin")
    health.status = 503  # the model is still loading
    plugin = middleware({**ENV, "NARWHAL_REGISTER_ETCD": etcd[-1].url, "NARWHAL_REGISTER_URL": health.url})
    lifespan = Lifespan(plugin)
    await lifespan.startup(nursery)
    await trio.sleep(1.0)
    assert await key(etcd) is None  # not before vLLM serves
    health.status = 200
    await wait_key(etcd, True, 3.0)
    found = await key(etcd)
    assert found is not None
    value, lease = found
    assert value == {"url": health.url, "role": "decode", "model": "Qwen/Qwen3-0.6B"} and lease != 0
    await trio.sleep(TTL_S + 1.0)
    assert await key(etcd) == found  # the same lease, kept alive
    await lifespan.shutdown()
    assert await key(etcd) is None  # revoked at once, not left to the TTL
    assert lifespan.sent == [{"type": "lifespan.startup.complete"}, {"type": "lifespan.shutdown.complete"}]
    logged = messages(caplog)
    assert f"narwhal registration: registered key={P}d1 lease={lease} reason=started" in logged
    assert f"narwhal registration: deregistered key={P}d1 lease={lease} reason=shutdown revoked=True" in logged


async def test_an_engine_that_stops_answering_health_is_deregistered_and_registered_again(
        nursery: trio.Nursery, etcd: list[EtcdServer], health: Health, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.engine_plugin")
    plugin = middleware({**ENV, "NARWHAL_REGISTER_ETCD": etcd[-1].url, "NARWHAL_REGISTER_URL": health.url})
    lifespan = Lifespan(plugin)
    await lifespan.startup(nursery)
    await wait_key(etcd, True, 3.0)
    health.status = 503
    await wait_key(etcd, False, 3.0)
    health.status = 200
    await wait_key(etcd, True, 3.0)
    await lifespan.shutdown()
    logged = messages(caplog)
    assert any("reason=unhealthy revoked=True (HTTP 503 on" in line for line in logged), logged
    assert any(line.endswith("reason=healthy") for line in logged), logged


async def test_an_etcd_outage_longer_than_the_ttl_ends_in_a_new_lease_and_a_restart_is_survived(
        nursery: trio.Nursery, etcd: list[EtcdServer], health: Health, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.engine_plugin")
    proxy = await CuttableProxy(int(etcd[-1].url.rpartition(":")[2])).start(nursery)
    # Two endpoints, the first with nothing listening: the registrar goes on to the second.
    settings = PluginSettings.from_environment(
        {**ENV, "NARWHAL_REGISTER_ETCD": f"http://127.0.0.1:9,{proxy.url}", "NARWHAL_REGISTER_URL": health.url},
        ARGV)
    assert isinstance(settings.registration, Registration)
    registrar = PluginRegistrar(settings.registration)
    registrar.start()
    try:
        await wait_key(etcd, True, 3.0)
        first = await key(etcd)
        # etcd restarted on its data dir: it gives every lease a fresh TTL, the keepalives find it alive.
        await etcd[-1].stop()
        etcd.append(await start_etcd(tmp_path / "etcd"))
        proxy.target_port = int(etcd[-1].url.rpartition(":")[2])
        await trio.sleep(TTL_S + 1.0)
        assert await key(etcd) == first
        # Cut off for longer than the TTL: the lease expires, a new one is granted once etcd is back.
        proxy.refuse()
        await wait_key(etcd, False, TTL_S + 3.0)
        await proxy.listen()
        # A round or two (each bounded by its calls' timeouts) to find the lease gone and grant a new one:
        # bounded loosely, since a loaded machine (the suite on two cores) stretches each round.
        await wait_key(etcd, True, 10.0)
        again = await key(etcd)
        assert first is not None and again is not None and again[1] != first[1] and again[0] == first[0]
    finally:
        await trio.to_thread.run_sync(registrar.stop)  # the proxy runs on this loop: do not block it
    assert await key(etcd) is None
    logged = messages(caplog)
    assert [line.rpartition("reason=")[2] for line in logged if " registered " in line] == ["started", "lease_lost"]
    # Once per outage: the cut, and the restart if a round fell within it (etcd may restart within a round).
    assert 1 <= len([line for line in logged if "etcd unavailable" in line]) <= 2


@pytest.mark.parametrize(("env", "argv", "problem"), [
    ({}, ARGV, "NARWHAL_REGISTER_URL is not set"),
    ({"NARWHAL_REGISTER_URL": "http://h:8000"},
     ["vllm", "serve", "m", "--kv-transfer-config", '{"kv_role":"kv_both"}'],
     "kv_roles [producer, consumer] allow prefill and decode: set NARWHAL_REGISTER_ROLE"),
    ({"NARWHAL_REGISTER_URL": "http://h:8000"}, ["vllm", "serve", "m"], "cannot tell this engine's role: no KV role"),
    ({"NARWHAL_REGISTER_URL": "http://h:8000", "NARWHAL_REGISTER_ROLE": "prefill"}, ARGV,
     "NARWHAL_REGISTER_ROLE=prefill needs kv_role producer, but this engine's kv_roles are [consumer]"),
    ({"NARWHAL_REGISTER_URL": "http://h:8000/v1"}, ARGV, "NARWHAL_REGISTER_URL: must have no path"),
    ({"NARWHAL_REGISTER_URL": "http://h:8000", "NARWHAL_REGISTER_TTL_S": "0"}, ARGV,
     "NARWHAL_REGISTER_TTL_S='0' is not a positive number"),
    ({"NARWHAL_REGISTER_URL": "http://h:8000", "NARWHAL_ENGINE_ID": ""}, ARGV,
     "the engine cannot identify itself: NARWHAL_ENGINE_ID is not set"),
])
async def test_what_cannot_be_registered_is_one_logged_error_and_the_engine_serves_on(
        env: dict[str, str], argv: list[str], problem: str, caplog: pytest.LogCaptureFixture,
        nursery: trio.Nursery) -> None:
    plugin = middleware({**ENV, "NARWHAL_REGISTER_ETCD": "http://127.0.0.1:9", **env}, argv)
    assert plugin.registrar is None
    [error] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert error.getMessage().startswith("narwhal registration: not registering this engine in etcd: ")
    assert problem in error.getMessage(), error.getMessage()
    lifespan = Lifespan(plugin)
    await lifespan.startup(nursery)
    await lifespan.shutdown()
    assert lifespan.sent == [{"type": "lifespan.startup.complete"}, {"type": "lifespan.shutdown.complete"}]


def test_the_role_comes_from_the_kv_role_or_narwhal_register_role() -> None:
    base = {"NARWHAL_REGISTER_ETCD": "http://e:2379, http://f:2379/", "NARWHAL_REGISTER_URL": "http://h:8000"}
    both = registration_from_environment({**base, "NARWHAL_REGISTER_ROLE": "Prefill"}, engine_id="p1", model="m",
                                         kv_roles=("producer", "consumer"))
    assert both == Registration(endpoints=("http://e:2379", "http://f:2379"), name="p1", url="http://h:8000",
                                role="prefill", model="m")
    producer = registration_from_environment({**base, "NARWHAL_REGISTER_PREFIX": "/x/", "NARWHAL_REGISTER_TTL_S": "4"},
                                             engine_id="p1", model="m", kv_roles=("producer",))
    assert isinstance(producer, Registration)
    assert (producer.role, producer.key, producer.grant_ttl_s, producer.value()) == (
        "prefill", "/x/p1", 4, b'{"url":"http://h:8000","role":"prefill","model":"m"}')
    assert registration_from_environment({}, engine_id="p1", model="m", kv_roles=("producer",)) is None


async def test_without_lifespan_events_the_first_request_starts_the_registration() -> None:
    settings = PluginSettings.from_environment(
        {**ENV, "NARWHAL_REGISTER_ETCD": "http://127.0.0.1:9", "NARWHAL_REGISTER_URL": "http://127.0.0.1:9"}, ARGV)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    plugin = IdentityMiddleware(app, settings)
    assert plugin.registrar is not None and not plugin.registrar.started

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: dict[str, Any]) -> None:
        pass

    await plugin({"type": "http", "method": "GET", "path": "/health", "headers": []}, receive, send)
    assert plugin.registrar.started
    await trio.to_thread.run_sync(plugin.registrar.stop)


class RecordingEtcd:
    """etcd's answers to the registrar's calls, recorded (no sockets: the rounds are driven by hand)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.lease_alive = True

    def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(path)
        if path == "/v3/lease/grant":
            return {"ID": str(len(self.calls))}
        if path == "/v3/lease/keepalive":
            return {"result": {"TTL": "6"} if self.lease_alive else {}}
        if path == "/v3/kv/range":
            return {"kvs": [{"key": "k"}]}
        return {}


def driven_registrar(monkeypatch: pytest.MonkeyPatch, answers: list[bool]) -> tuple[PluginRegistrar, RecordingEtcd]:
    """A registrar whose health checks answer ``answers`` in turn, against a recording etcd."""
    registrar = PluginRegistrar(Registration(endpoints=("http://etcd",), name="d1", url="http://engine",
                                             role="decode", model="m", ttl_s=6.0))
    etcd = RecordingEtcd()
    monkeypatch.setattr(registrar, "_etcd", etcd)
    monkeypatch.setattr(registrar, "_check_health", lambda: (answers.pop(0), "" if answers else "timed out"))
    return registrar, etcd


def test_a_round_whose_health_check_fails_once_still_keeps_the_lease_alive(monkeypatch) -> None:
    """A busy API server that misses one health check (or answers it late) keeps its key: the lease is renewed
    every round until the health rule (two failures in a row) deregisters; a lapsed lease took the engine out of
    the fleet (seen in the real-vLLM tier during a NIXL handshake)."""
    registrar, etcd = driven_registrar(monkeypatch, [True, False, True, False, False])
    registrar.step()
    assert registrar.registered and etcd.calls == ["/v3/lease/grant", "/v3/kv/put"]
    for _ in range(2):  # a miss, then an answer: kept alive in both rounds
        etcd.calls.clear()
        registrar.step()
        assert registrar.registered and etcd.calls[0] == "/v3/lease/keepalive", etcd.calls
    etcd.calls.clear()
    registrar.step()  # a first miss: kept alive
    registrar.step()  # the second in a row: revoked
    assert etcd.calls == ["/v3/lease/keepalive", "/v3/kv/range", "/v3/lease/keepalive", "/v3/kv/range",
                          "/v3/lease/revoke"]
    assert not registrar.registered


def test_a_lapsed_lease_is_registered_again_only_in_a_round_whose_health_check_passed(monkeypatch) -> None:
    registrar, etcd = driven_registrar(monkeypatch, [True, False, True])
    registrar.step()
    etcd.lease_alive = False  # expired meanwhile
    etcd.calls.clear()
    registrar.step()  # gone, and health misses: not registered again yet
    assert not registrar.registered and etcd.calls == ["/v3/lease/keepalive"]
    etcd.calls.clear()
    registrar.step()
    assert registrar.registered and etcd.calls == ["/v3/lease/grant", "/v3/kv/put"]
