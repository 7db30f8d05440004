"""The etcd watcher's timing, on a fake etcd under trio's MockClock: retries back off to a bound and report
degraded once, a watch is listed again every resync_interval_s, and a stream that keeps ending does not spin."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import trio

from narwhal.discovery.etcd_http import b64
from narwhal.discovery.etcd_watch import EtcdWatcher, ViewUpdate

P = "/narwhal/engines/"


class FakeEtcd:
    """Answers ranges with ``keys`` at ``revision``; a watch says "created" and then ``after_created``."""

    def __init__(self) -> None:
        self.down = False
        self.revision = 5
        self.keys = {"d1": {"url": "http://10.0.0.1:8000", "role": "decode"}}
        self.after_created = "hang"  # or "end": the stream ends at once
        # Members cut off from their leader: they answer a watch with gRPC's "no leader" error.
        self.leaderless: set[str] = set()
        self.dropped = trio.Event()  # set: every open stream ends (with "no leader" on a leaderless member)
        self.calls: list[tuple[str, float]] = []

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.calls.append((request.url.path, trio.current_time()))
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        header = {"cluster_id": "1", "revision": str(self.revision)}
        if request.url.path == "/v3/kv/range":
            kvs = [{"key": b64(P + name), "value": b64(json.dumps(value)), "mod_revision": "3"}
                   for name, value in self.keys.items()]
            return httpx.Response(200, json={"header": header, "kvs": kvs, "count": str(len(kvs))})
        if request.url.host in self.leaderless:
            return httpx.Response(200, stream=_WatchStream(self, request.url.host, header, "no_leader"))
        return httpx.Response(200, stream=_WatchStream(self, request.url.host, header, self.after_created))

    def count(self, path: str) -> int:
        return sum(1 for called, _ in self.calls if called == path)


class _WatchStream(httpx.AsyncByteStream):
    def __init__(self, fake: FakeEtcd, host: str, header: dict[str, str], after: str) -> None:
        self.fake = fake
        self.host = host
        self.header = header
        self.after = after

    async def __aiter__(self) -> AsyncIterator[bytes]:
        no_leader = b'{"error": {"grpc_code": 14, "http_code": 503, "message": "etcdserver: no leader"}}\n'
        if self.after == "no_leader":
            yield no_leader
            return
        yield json.dumps({"result": {"header": self.header, "created": True}}).encode() + b"\n"
        if self.after == "compacted":
            yield b'{"result": {"header": {}, "canceled": true, "compact_revision": "9"}}\n'
        if self.after == "hang":
            await self.fake.dropped.wait()
            if self.host in self.fake.leaderless:
                yield no_leader


def watcher(fake: FakeEtcd, endpoints: tuple[str, ...] = ("http://etcd:2379",), **options: Any) -> EtcdWatcher:
    client = httpx.AsyncClient(transport=httpx.MockTransport(fake.handle))
    return EtcdWatcher(list(endpoints), prefix=P, client=client, wall_clock=trio.current_time, **options)


async def test_an_outage_from_the_start_reports_degraded_once_and_backs_off_to_retry_max_s(autojump_clock,
                                                                                          nursery) -> None:
    fake = FakeEtcd()
    fake.down = True
    updates: list[ViewUpdate] = []
    watch = watcher(fake, retry_min_s=0.2, retry_max_s=5.0)
    await nursery.start(watch.run, updates.append)  # started all the same: the router starts with no engines
    assert watch.engines == {} and not watch.status.listed
    await trio.sleep(120.0)
    assert [u.reason for u in updates] == ["degraded"]
    gaps = [round(b - a, 6) for (_, a), (_, b) in zip(fake.calls, fake.calls[1:], strict=False)]
    assert max(gaps) == 5.0 and gaps[:3] == [0.2, 0.4, 0.8]
    assert len(fake.calls) < 40  # 0.2, 0.4, ... then one a 5 s
    fake.down = False
    await trio.sleep(5.0)
    assert [u.reason for u in updates] == ["degraded", "recovered", "listed"]
    assert set(watch.engines) == {"d1"} and watch.status.degraded is None
    nursery.cancel_scope.cancel()


async def test_the_prefix_is_listed_again_every_resync_interval_s(autojump_clock, nursery) -> None:
    fake = FakeEtcd()
    updates: list[ViewUpdate] = []
    watch = watcher(fake, resync_interval_s=300.0)
    await nursery.start(watch.run, updates.append)
    # A watch that silently stopped delivering: the resync finds what it missed.
    fake.keys["d2"] = {"url": "http://10.0.0.2:8000", "role": "prefill"}
    await trio.sleep(299.0)
    assert fake.count("/v3/kv/range") == 1 and set(watch.engines) == {"d1"}
    await trio.sleep(2.0)
    assert fake.count("/v3/kv/range") == 2 and set(watch.engines) == {"d1", "d2"}
    assert updates[-1].reason == "listed" and updates[-1].change.added == ("d2",)
    await trio.sleep(600.0)
    assert fake.count("/v3/kv/range") == 4
    nursery.cancel_scope.cancel()


async def test_a_stream_that_keeps_ending_at_once_is_reopened_with_backoff(autojump_clock, nursery) -> None:
    fake = FakeEtcd()
    fake.after_created = "end"
    watch = watcher(fake, retry_min_s=0.2, retry_max_s=5.0)
    await nursery.start(watch.run, lambda update: None)
    await trio.sleep(60.0)
    assert 5 <= fake.count("/v3/watch") <= 20
    assert watch.status.degraded is None  # etcd answers: nothing is down
    nursery.cancel_scope.cancel()


async def test_a_member_without_a_leader_is_passed_over_for_the_next(autojump_clock, nursery) -> None:
    fake = FakeEtcd()
    fake.leaderless = {"a"}
    updates: list[ViewUpdate] = []
    watch = watcher(fake, ("http://a:2379", "http://b:2379"))
    await nursery.start(watch.run, updates.append)
    await trio.sleep(1.0)
    assert watch.status.connected and watch.status.endpoint == "http://b:2379"
    assert "degraded" not in [u.reason for u in updates]
    # Every member loses its leader: degraded, the view kept; one gets it back: recovered.
    fake.leaderless = {"a", "b"}
    fake.dropped.set()
    await trio.sleep(60.0)
    assert watch.status.degraded is not None and "no leader" in watch.status.degraded
    assert set(watch.engines) == {"d1"}
    fake.leaderless = set()
    fake.dropped = trio.Event()
    await trio.sleep(10.0)
    assert watch.status.connected
    assert watch.status.degraded is None and [u.reason for u in updates].count("degraded") == 1
    nursery.cancel_scope.cancel()


async def test_a_watch_compacted_again_at_once_every_time_does_not_spin(autojump_clock, nursery) -> None:
    fake = FakeEtcd()
    fake.after_created = "compacted"
    updates: list[ViewUpdate] = []
    watch = watcher(fake, retry_min_s=0.2, retry_max_s=5.0)
    await nursery.start(watch.run, updates.append)
    await trio.sleep(60.0)
    assert 5 <= fake.count("/v3/kv/range") <= 20
    assert [u.reason for u in updates] == ["listed"]  # nothing changed, nothing is down
    nursery.cancel_scope.cancel()
