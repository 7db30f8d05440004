"""The registrar's rounds on a fake etcd and a fake engine under trio's MockClock: keepalives every ttl/3,
--health-failures in a row before it deregisters, one etcd_unavailable per outage, a new lease after one."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import pytest
import trio

from narwhal.discovery.etcd_http import unb64
from narwhal.discovery.register import RegisterOptions, Registrar


class FakeEtcd:
    """Leases that expire on the mock clock, keys bound to them, and an outage switch."""

    def __init__(self) -> None:
        self.down = False
        self.leases: dict[int, tuple[int, float]] = {}  # id -> (ttl, expires at)
        self.keys: dict[str, int] = {}  # key -> lease
        self.next_id = 100
        self.calls: list[tuple[str, float]] = []

    def _expire(self) -> None:
        now = trio.current_time()
        for lease_id, (_, expires) in list(self.leases.items()):
            if expires <= now:
                del self.leases[lease_id]
                self.keys = {key: lease for key, lease in self.keys.items() if lease != lease_id}

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        self._expire()
        path = request.url.path
        self.calls.append((path, trio.current_time()))
        body = json.loads(request.content)
        if path == "/v3/lease/grant":
            self.next_id += 1
            ttl = int(body["TTL"])
            self.leases[self.next_id] = (ttl, trio.current_time() + ttl)
            return httpx.Response(200, json={"ID": str(self.next_id), "TTL": str(ttl)})
        if path == "/v3/kv/put":
            lease = int(body.get("lease") or 0)
            if lease and lease not in self.leases:
                return httpx.Response(404, json={"error": "etcdserver: requested lease not found"})
            self.keys[unb64(body["key"]).decode()] = lease
            return httpx.Response(200, json={"header": {}})
        if path == "/v3/lease/keepalive":
            lease = int(body["ID"])
            if lease not in self.leases:
                return httpx.Response(200, json={"result": {"ID": str(lease)}})
            ttl = self.leases[lease][0]
            self.leases[lease] = (ttl, trio.current_time() + ttl)
            return httpx.Response(200, json={"result": {"ID": str(lease), "TTL": str(ttl)}})
        if path == "/v3/kv/range":
            key = unb64(body["key"]).decode()
            kvs = [{"key": body["key"], "lease": str(self.keys[key])}] if key in self.keys else []
            return httpx.Response(200, json={"kvs": kvs})
        if path == "/v3/lease/revoke":
            lease = int(body["ID"])
            if self.leases.pop(lease, None) is None:
                return httpx.Response(404, json={"error": "etcdserver: requested lease not found"})
            self.keys = {key: held for key, held in self.keys.items() if held != lease}
            return httpx.Response(200, json={"header": {}})
        return httpx.Response(404)

    def count(self, path: str) -> int:
        return sum(1 for called, _ in self.calls if called == path)


class FakeEngine:
    def __init__(self) -> None:
        self.status = 200

    async def handle(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(self.status)


def registrar(etcd: FakeEtcd, engine: FakeEngine, **options: Any) -> Registrar:
    settings: dict[str, Any] = {"endpoints": ("http://etcd:2379",), "name": "d1", "url": "http://10.0.0.1:8000",
                                "role": "decode", "ttl_s": 9.0}
    settings.update(options)
    return Registrar(RegisterOptions(**settings),
                     etcd_client=httpx.AsyncClient(transport=httpx.MockTransport(etcd.handle)),
                     health_client=httpx.AsyncClient(transport=httpx.MockTransport(engine.handle)))


def events(caplog: pytest.LogCaptureFixture, name: str) -> list[dict[str, Any]]:
    lines = [json.loads(record.getMessage()) for record in caplog.records if record.name == "narwhal.events"]
    return [line for line in lines if line["event"] == name]


KEY = "/narwhal/engines/d1"


async def test_the_lease_is_kept_alive_every_ttl_over_3(autojump_clock, nursery) -> None:
    etcd, engine = FakeEtcd(), FakeEngine()
    await nursery.start(registrar(etcd, engine).run)
    await trio.sleep(90.0)
    assert etcd.count("/v3/lease/grant") == 1 and KEY in etcd.keys
    assert 29 <= etcd.count("/v3/lease/keepalive") <= 31  # every 3 s
    nursery.cancel_scope.cancel()


async def test_it_deregisters_after_health_failures_in_a_row(autojump_clock, nursery, caplog) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    etcd, engine = FakeEtcd(), FakeEngine()
    await nursery.start(registrar(etcd, engine, health_failures=3).run)
    await trio.sleep(1.0)
    engine.status = 503
    await trio.sleep(6.5)  # two rounds answered 503: still registered
    assert KEY in etcd.keys
    await trio.sleep(3.0)  # the third: revoked
    assert KEY not in etcd.keys and etcd.leases == {}
    [gone] = events(caplog, "deregistered")
    assert gone["reason"] == "unhealthy" and gone["revoked"] and "HTTP 503" in gone["detail"]
    engine.status = 200
    await trio.sleep(3.0)
    assert KEY in etcd.keys
    assert [e["reason"] for e in events(caplog, "registered")] == ["started", "healthy"]
    nursery.cancel_scope.cancel()


async def test_the_lease_is_kept_alive_through_health_failures_short_of_the_limit(autojump_clock, nursery,
                                                                                caplog) -> None:
    """Rounds whose health check failed, fewer than --health-failures in a row, still renew the lease: a busy
    engine's key must not lapse before the rule has decided (it did when those rounds skipped the keepalive)."""
    caplog.set_level(logging.INFO, logger="narwhal.events")
    etcd, engine = FakeEtcd(), FakeEngine()
    await nursery.start(registrar(etcd, engine, health_failures=3, ttl_s=6.0).run)
    await trio.sleep(1.0)
    first = etcd.keys[KEY]
    engine.status = 503
    await trio.sleep(4.0)  # the rounds at 2 s and 4 s fail: two in a row, short of three
    engine.status = 200
    await trio.sleep(6.0)
    assert etcd.keys[KEY] == first  # the same lease all along
    assert [e["reason"] for e in events(caplog, "registered")] == ["started"]
    assert not events(caplog, "deregistered")
    nursery.cancel_scope.cancel()


async def test_an_outage_longer_than_the_ttl_is_logged_once_and_ends_with_a_new_lease(autojump_clock, nursery,
                                                                                      caplog) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    etcd, engine = FakeEtcd(), FakeEngine()
    await nursery.start(registrar(etcd, engine).run)
    await trio.sleep(1.0)
    first = etcd.keys[KEY]
    etcd.down = True
    await trio.sleep(30.0)
    assert len(events(caplog, "etcd_unavailable")) == 1
    etcd.down = False
    await trio.sleep(3.0)
    assert etcd.keys[KEY] != first
    assert [e["reason"] for e in events(caplog, "registered")] == ["started", "lease_lost"]
    nursery.cancel_scope.cancel()


async def test_deregister_revokes_and_an_unreachable_etcd_is_left_to_the_ttl(autojump_clock, nursery, caplog) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    etcd, engine = FakeEtcd(), FakeEngine()
    reg = registrar(etcd, engine)
    await reg.step()
    await reg.deregister("signal")
    assert etcd.keys == {} and events(caplog, "deregistered")[-1]["revoked"] is True
    await reg.step()
    etcd.down = True
    with trio.fail_after(reg.call_timeout_s * 2 + 1):
        await reg.deregister("signal")
    assert events(caplog, "deregistered")[-1]["revoked"] is False and not reg.registered
