"""A router's return from an etcd outage, on a fake etcd under trio's MockClock: whichever of its parts reaches
etcd first (the membership's keepalive, every ``min(1 s, ttl_s / 4, replica_stale_s / 4)``) ends the others'
backoff, so a replica serves again, and a controller publishes again, within about a keepalive of etcd's return
rather than at the end of a backoff of up to 5 s."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import trio

from narwhal.cluster.fleet_view import FleetRecordsView
from narwhal.cluster.link import EvidenceSender
from narwhal.cluster.publisher import FleetPublisher
from narwhal.cluster.records import FleetEntry
from narwhal.cluster.service import ClusterService
from narwhal.cluster.store import ClusterStore
from narwhal.config import parse_config
from narwhal.discovery.etcd_http import EtcdUnavailable, b64, unb64
from narwhal.discovery.etcd_watch import EtcdWatcher
from narwhal.fleet.admission import Admission
from narwhal.fleet.model import EngineRecord
from narwhal.fleet.registry import EngineEntry

KEY = "/narwhal/recovery"
ENDPOINT = "http://etcd:2379"
CONFIG = f"""
[lease]
mode = "replicas"
backend = "etcd"
endpoints = ["{ENDPOINT}"]
key = "{KEY}"
router_id = "r2"
ttl_s = 2.0
renew_interval_s = 0.4
fence_margin_s = 0.6
replica_stale_s = 2.0
cluster_token_file = "token"

[[engines]]
name = "p1"
url = "http://127.0.0.1:9001"
role = "prefill"
[[engines]]
name = "d1"
url = "http://127.0.0.1:9002"
role = "decode"
"""
# With these timings the membership's keepalive runs every min(1, 2 / 4, 2 / 4) = 0.5 s.
KEEPALIVE_S = 0.5


def fleet_entry(name: str, *, ejected: bool = False) -> FleetEntry:
    return FleetEntry(entry=EngineEntry(name=name, url="http://10.0.0.1:8000", role="prefill", model="m"),
                      record=EngineRecord(name=name, role="prefill", model="m", ejected=ejected))


class FakeEtcd:
    """The few gateway calls a router's cluster service makes; ``down``: every connection is refused."""

    def __init__(self) -> None:
        self.down = False
        self.revision = 7
        self.kv: dict[str, bytes] = {f"{KEY}/fleet/p1": msgspec.json.encode(fleet_entry("p1"))}
        self.dropped = trio.Event()  # set when etcd goes down: every open watch stream ends
        self.calls: list[tuple[str, float]] = []

    def go_down(self) -> None:
        self.down = True
        self.dropped.set()

    def come_back(self) -> None:
        self.down = False
        self.dropped = trio.Event()

    def count(self, path: str) -> int:
        return sum(1 for called, _ in self.calls if called == path)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.calls.append((path, trio.current_time()))
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        header = {"cluster_id": "1", "revision": str(self.revision)}
        body: dict[str, Any] = json.loads(request.content or b"{}") if path != "/v3/watch" else {}
        if path == "/v3/kv/range":
            start, end = unb64(body["key"]).decode(), unb64(body["range_end"]).decode()
            kvs = [{"key": b64(key), "value": b64(value), "mod_revision": "3"}
                   for key, value in sorted(self.kv.items()) if start <= key < end]
            return httpx.Response(200, json={"header": header, "kvs": kvs, "count": str(len(kvs))})
        if path == "/v3/kv/put":
            self.revision += 1
            self.kv[unb64(body["key"]).decode()] = unb64(body["value"])
            return httpx.Response(200, json={"header": {**header, "revision": str(self.revision)}})
        if path == "/v3/lease/grant":
            return httpx.Response(200, json={"header": header, "ID": "42", "TTL": "3"})
        if path == "/v3/lease/keepalive":
            return httpx.Response(200, json={"result": {"header": header, "ID": "42", "TTL": "3"}})
        if path == "/v3/lease/revoke":
            return httpx.Response(200, json={"header": header})
        if path == "/v3/watch":
            return httpx.Response(200, stream=_WatchStream(self, header))
        return httpx.Response(404, text="not faked")


class _WatchStream(httpx.AsyncByteStream):
    """Says "created", then stays open until etcd goes down."""

    def __init__(self, fake: FakeEtcd, header: dict[str, str]) -> None:
        self.fake = fake
        self.header = header

    async def __aiter__(self) -> AsyncIterator[bytes]:
        dropped = self.fake.dropped
        yield json.dumps({"result": {"header": self.header, "created": True}}).encode() + b"\n"
        await dropped.wait()


class Replica:
    """A ClusterService wired to the fake etcd, as the router wires it (its watcher, store, publisher)."""

    def __init__(self, fake: FakeEtcd, *, controller: bool = False) -> None:
        config = parse_config(CONFIG)
        client = httpx.AsyncClient(transport=httpx.MockTransport(fake.handle))
        store = ClusterStore([ENDPOINT], key=KEY, timeout_s=0.4, client=client)
        view = FleetRecordsView(store.fleet_prefix)
        watcher = EtcdWatcher([ENDPOINT], prefix=store.fleet_prefix, view=view, timeout_s=0.4, idle_s=30.0,
                              client=client, wall_clock=trio.current_time)
        self.fake = fake
        self.controller = controller
        self.writes: list[float] = []
        self.entries = [fleet_entry("p1")]
        self.admission = Admission(clock=trio.current_time)
        self.publisher = FleetPublisher(prefix=store.fleet_prefix, entries=lambda: self.entries,
                                        write=self._write, published_names=self._names,
                                        acting=lambda: self.controller)
        sender = EvidenceSender(router_id="r2", controller=lambda: None, token="t", apply_placements=None,
                                client=client)
        self.service = ClusterService(config=config, router_id="r2", store=store, publisher=self.publisher,
                                      sender=sender, admission=self.admission, is_controller=lambda: self.controller,
                                      apply_fleet=lambda *args: None, became_controller=lambda entries: None,
                                      advertise_url=lambda: "http://r2", cluster_url=lambda: "http://r2",
                                      wall_clock=trio.current_time, watcher=watcher)
        self.service.view = view

    async def _write(self, puts: Any, deletes: Any) -> bool:
        """The controller's guarded write (through the lease backend): it fails while etcd is down."""
        self.fake.calls.append(("write", trio.current_time()))
        if self.fake.down:
            raise EtcdUnavailable("etcd unreachable: http://etcd:2379: ConnectError")
        self.writes.append(trio.current_time())
        return True

    async def _names(self) -> list[str]:
        if self.fake.down:
            raise EtcdUnavailable("etcd unreachable: http://etcd:2379: ConnectError")
        return ["p1"]

    def serving(self) -> bool:
        return self.admission.refusal(trio.current_time()) is None


async def wait_for(condition: Any, timeout_s: float) -> float:
    """When ``condition()`` first held (polled every 10 ms of mock time); fails past ``timeout_s``."""
    with trio.fail_after(timeout_s):
        while not condition():
            await trio.sleep(0.01)
    return trio.current_time()


async def outage(fake: FakeEtcd, *, path: str, down_for_s: float) -> float:
    """etcd down for about ``down_for_s``, back just after a call to ``path`` (the worst moment for that
    caller: its whole backoff lies ahead); returns when etcd came back."""
    fake.go_down()
    await trio.sleep(down_for_s)
    calls = fake.count(path)
    await wait_for(lambda: fake.count(path) > calls, timeout_s=10.0)
    fake.come_back()
    return trio.current_time()


async def test_a_stale_replica_serves_again_within_a_keepalive_of_etcds_return(autojump_clock, nursery) -> None:
    fake = FakeEtcd()
    replica = Replica(fake)
    await nursery.start(replica.service.run)
    await wait_for(lambda: replica.service.fresh_at is not None, timeout_s=2.0)
    assert replica.serving()
    # Down long enough for the watch's backoff to reach its 5 s bound and the view to pass replica_stale_s.
    back_at = await outage(fake, path="/v3/watch", down_for_s=30.0)
    assert not replica.serving()
    assert replica.service.watcher.status.degraded is not None
    serving_at = await wait_for(replica.serving, timeout_s=10.0)
    # The membership's keepalive reaches etcd within KEEPALIVE_S, and the watch is retried at once.
    assert serving_at - back_at <= KEEPALIVE_S + 0.1, serving_at - back_at
    assert replica.service.watcher.status.degraded is None and not replica.service.stale_logged
    # While etcd was down it was not hammered: the watch backed off to one attempt in 5 s.
    watches = [at for path, at in fake.calls if path == "/v3/watch" and at < back_at]
    assert min(b - a for a, b in zip(watches[-3:], watches[-2:], strict=False)) >= 5.0
    nursery.cancel_scope.cancel()


async def test_a_controller_publishes_what_changed_in_an_outage_within_a_keepalive_of_etcds_return(
        autojump_clock, nursery) -> None:
    fake = FakeEtcd()
    replica = Replica(fake, controller=True)
    await nursery.start(replica.service.run)
    await wait_for(lambda: replica.service.role == "controller", timeout_s=2.0)
    await wait_for(lambda: len(replica.writes) == 1, timeout_s=2.0)
    # The fleet changes during an outage: the publisher's writes fail and back off to 5 s.
    fake.go_down()
    replica.entries = [fleet_entry("p1", ejected=True)]
    replica.publisher.poke()
    back_at = await outage(fake, path="write", down_for_s=30.0)
    written_at = await wait_for(lambda: len(replica.writes) == 2, timeout_s=10.0)
    assert written_at - back_at <= KEEPALIVE_S + 0.1, written_at - back_at
    writes = [at for path, at in fake.calls if path == "write" and at < back_at]
    assert min(b - a for a, b in zip(writes[-3:], writes[-2:], strict=False)) >= 5.0
    nursery.cancel_scope.cancel()
