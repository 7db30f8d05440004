"""The Kubernetes watcher against the API server double (tests/k8s_api_double.py), over real HTTP, under trio's
MockClock: Pods becoming engines and leaving, ports and models, resumed watches, 410 Gone, chunked lists,
bookmarks, outages and a refused token."""

from __future__ import annotations

import json
import logging
import ssl
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
import trustme

from narwhal.config import EngineSpec
from narwhal.discovery import kubernetes
from narwhal.discovery.entry import EntryProblem
from narwhal.discovery.events import log_update
from narwhal.discovery.kubernetes import (
    ClusterAccess,
    KubernetesWatcher,
    ViewUpdate,
    in_cluster_access,
)
from narwhal.discovery.pods import Pod, pod_engine
from tests.k8s_api_double import ApiDouble, make_pod, selector_matches

PREFILL = {"app": "engine", "role": "prefill"}
DECODE = {"app": "engine", "role": "decode"}


class Run:
    """A watcher on the double, the updates it reported, and shortcuts to change Pods."""

    def __init__(self, api: ApiDouble, watcher: KubernetesWatcher) -> None:
        self.api = api
        self.watcher = watcher
        self.updates: list[ViewUpdate] = []

    def reasons(self) -> list[str]:
        return [update.reason for update in self.updates]

    def urls(self) -> dict[str, str]:
        return {name: spec.url for name, spec in self.watcher.engines.items()}


async def start(nursery: trio.Nursery, tmp_path: Path, api: ApiDouble | None = None, *, token: str = "s3cret",
                before: Any = None, **options: Any) -> Run:
    """The double serving, ``before(api)`` applied, a watcher started on it (with a token file of ``token``)."""
    api = api or ApiDouble()
    await nursery.start(api.serve)
    if before is not None:
        before(api)
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    settings: dict[str, Any] = {"prefill_selector": "app=engine,role=prefill",
                                "decode_selector": "app=engine,role in (decode)", **options}
    watcher = KubernetesWatcher(api.namespace, api_url=api.url, token_file=str(token_file),
                                wall_clock=trio.current_time, **settings)
    run = Run(api, watcher)
    await nursery.start(watcher.run, run.updates.append)
    return run


async def settle() -> None:
    await trio.sleep(0.5)


async def test_pods_become_engines_while_running_and_ready_and_leave_when_not(autojump_clock, nursery,
                                                                              tmp_path) -> None:
    def before(api: ApiDouble) -> None:
        api.put(make_pod("p1", labels=PREFILL, ip="10.0.0.1"))
        api.put(make_pod("d1", labels=DECODE, ip="10.0.0.2", ready=False))
        api.put(make_pod("other", labels={"app": "web"}, ip="10.0.0.9"))

    run = await start(nursery, tmp_path, before=before)
    assert run.urls() == {"p1": "http://10.0.0.1:8000"}
    assert run.watcher.engines["p1"].role == "prefill" and run.watcher.engines["p1"].model is None
    assert run.watcher.status.listed and set(run.reasons()) == {"listed"}
    api = run.api
    # Added and not yet scheduled (no IP), then Pending, then Running and Ready.
    api.put(make_pod("d2", labels=DECODE, ip=None, phase="Pending", ready=False))
    api.put(make_pod("d2", labels=DECODE, ip="10.0.0.3", phase="Pending", ready=False))
    await settle()
    assert set(run.watcher.engines) == {"p1"}
    api.put(make_pod("d2", labels=DECODE, ip="10.0.0.3"))
    api.put(make_pod("d1", labels=DECODE, ip="10.0.0.2"))  # becomes ready
    await settle()
    assert run.urls() == {"p1": "http://10.0.0.1:8000", "d1": "http://10.0.0.2:8000", "d2": "http://10.0.0.3:8000"}
    assert run.watcher.engines["d2"].role == "decode"
    # Loses readiness; then terminating while still Ready; then deleted.
    api.put(make_pod("d1", labels=DECODE, ip="10.0.0.2", ready=False))
    terminating = make_pod("d2", labels=DECODE, ip="10.0.0.3")
    terminating["metadata"]["deletionTimestamp"] = "2026-12-04T09:00:00Z"
    api.put(terminating)
    api.delete("p1")
    await settle()
    assert run.watcher.engines == {}
    removed = [name for update in run.updates for name in update.change.removed]
    assert sorted(removed) == ["d1", "d2", "p1"]
    assert run.watcher.status.resource_version == str(api.resource_version)
    assert len(api.list_requests()) == 2  # one list per selector, nothing relisted
    nursery.cancel_scope.cancel()


async def test_a_named_port_and_the_model_label(autojump_clock, nursery, tmp_path) -> None:
    ports = [{"name": "metrics", "containerPort": 9090}, {"name": "http", "containerPort": 8123}]

    def before(api: ApiDouble) -> None:
        api.put(make_pod("d1", labels={**DECODE, "narwhal/model": "llama-3-8b"}, ip="10.0.0.1", ports=ports))
        api.put(make_pod("d2", labels=DECODE, ip="fd00::2", ports=ports))
        api.put(make_pod("d3", labels=DECODE, ip="10.0.0.3", ports=[{"name": "grpc", "containerPort": 9000}]))

    run = await start(nursery, tmp_path, before=before, port="http", model_label="narwhal/model",
                      default_model="qwen")
    engines = run.watcher.engines
    assert run.urls() == {"d1": "http://10.0.0.1:8123", "d2": "http://[fd00::2]:8123"}
    assert engines["d1"].model == "llama-3-8b" and engines["d2"].model == "qwen"
    # d3 has no port named "http": no engine, and said so once.
    problems = [problem for update in run.updates for problem in update.change.problems]
    assert [(p.key, p.problem) for p in problems] == [("serving/d3", "no container port named 'http'")]
    run.api.put(make_pod("d3", labels={**DECODE, "tier": "x"}, ip="10.0.0.3",
                         ports=[{"name": "grpc", "containerPort": 9000}]))
    await settle()
    assert len([p for update in run.updates for p in update.change.problems]) == 1  # same problem: not again
    nursery.cancel_scope.cancel()


async def test_a_pod_relabelled_from_one_role_to_the_other_changes_role(autojump_clock, nursery, tmp_path) -> None:
    run = await start(nursery, tmp_path, before=lambda api: api.put(make_pod("e1", labels=PREFILL)))
    assert run.watcher.engines["e1"].role == "prefill"
    run.api.put(make_pod("e1", labels=DECODE))  # the prefill watch sees it DELETED, the decode watch ADDED
    await settle()
    # (The two watches are independent: for a moment both may hold it, and it is logged as selected by both.)
    assert run.watcher.engines["e1"].role == "decode"
    run.api.put(make_pod("e1", labels={"app": "engine"}))  # neither selects it now
    await settle()
    assert run.watcher.engines == {}
    nursery.cancel_scope.cancel()


async def test_a_pod_both_selectors_select_is_no_engine_and_is_logged(autojump_clock, nursery, tmp_path) -> None:
    run = await start(nursery, tmp_path, prefill_selector="app=engine", decode_selector="app=engine,role=decode")
    run.api.put(make_pod("d1", labels=DECODE))
    await settle()
    assert run.watcher.engines == {}
    problems = [p for update in run.updates for p in update.change.problems]
    assert [p.problem for p in problems] == ["selected by both prefill_selector and decode_selector"]
    nursery.cancel_scope.cancel()


async def test_a_watch_the_server_ends_resumes_without_a_relist_and_without_missing_an_event(
        autojump_clock, nursery, tmp_path) -> None:
    run = await start(nursery, tmp_path, watch_timeout_s=60.0)
    api = run.api
    api.put(make_pod("d1", labels=DECODE, ip="10.0.0.1"))
    await settle()
    watches = len(api.watch_requests())
    # The server ends the watches (timeoutSeconds); a change made before the watcher watches again arrives.
    api.close_watches()
    api.put(make_pod("d2", labels=DECODE, ip="10.0.0.2"))
    await settle()
    assert set(run.watcher.engines) == {"d1", "d2"}
    assert len(api.list_requests()) == 2 and len(api.watch_requests()) == watches + 2
    resumed = api.watch_requests()[-1]
    assert resumed["allowWatchBookmarks"] == "true" and resumed["timeoutSeconds"] == "60"
    # And the server's own timeout, many times over: still one list per selector.
    for n in range(3, 8):
        api.put(make_pod(f"d{n}", labels=DECODE, ip=f"10.0.0.{n}"))
        await trio.sleep(61.0)
    assert len(run.watcher.engines) == 7 and len(api.list_requests()) == 2
    assert run.watcher.status.connected and run.watcher.status.degraded is None
    nursery.cancel_scope.cancel()


@pytest.mark.parametrize("gone_as_status", [False, True])
async def test_410_gone_on_a_watch_lists_again_and_applies_the_difference(autojump_clock, nursery, tmp_path,
                                                                          gone_as_status) -> None:
    api = ApiDouble(gone_as_status=gone_as_status, bookmark_interval_s=10_000.0)

    def before(api: ApiDouble) -> None:
        api.put(make_pod("d1", labels=DECODE, ip="10.0.0.1"))
        api.put(make_pod("d2", labels=DECODE, ip="10.0.0.2"))

    run = await start(nursery, tmp_path, api, before=before)
    first = len(run.updates)
    # While the watcher is not watching, d1 goes, d3 comes, d2 moves, and the history is compacted.
    api.outage()
    await trio.sleep(1.0)
    api.delete("d1")
    api.put(make_pod("d3", labels=DECODE, ip="10.0.0.3"))
    api.put(make_pod("d2", labels=DECODE, ip="10.0.0.22"))
    api.compact()
    api.outage(False)
    await trio.sleep(10.0)
    assert run.urls() == {"d2": "http://10.0.0.22:8000", "d3": "http://10.0.0.3:8000"}
    relisted = [u for u in run.updates[first:] if u.reason == "listed" and u.change]
    assert len(relisted) == 1
    change = relisted[0].change
    assert change.added == ("d3",) and change.removed == ("d1",) and change.changed == ("d2",)
    assert len(api.list_requests()) == 4  # both selectors' watches were past the compaction: both listed again
    nursery.cancel_scope.cancel()


async def test_a_chunked_list_reads_every_page_at_one_resource_version(autojump_clock, nursery, tmp_path) -> None:
    def before(api: ApiDouble) -> None:
        for n in range(1, 12):
            api.put(make_pod(f"d{n:02}", labels=DECODE, ip=f"10.0.1.{n}"))

    run = await start(nursery, tmp_path, before=before, page_size=4)
    assert len(run.watcher.engines) == 11
    decode_lists = [q for q in run.api.list_requests() if "decode" in q["labelSelector"]]
    assert [q.get("continue") is not None for q in decode_lists] == [False, True, True]
    assert all(q["limit"] == "4" for q in decode_lists)
    assert run.watcher.status.resource_versions["decode"] == "111"
    nursery.cancel_scope.cancel()


async def test_an_expired_continue_token_starts_the_list_again(autojump_clock, nursery, tmp_path) -> None:
    api = ApiDouble()
    for n in range(1, 6):
        api.put(make_pod(f"d{n}", labels=DECODE, ip=f"10.0.1.{n}"))
    expired = False
    answer = api._list

    async def expire_once(stream: Any, selector: str, query: dict[str, str]) -> None:
        nonlocal expired
        if query.get("continue") and not expired:
            expired = True
            api.expire_continue_tokens()
        await answer(stream, selector, query)

    api._list = expire_once  # type: ignore[method-assign]
    run = await start(nursery, tmp_path, api, page_size=2)
    assert len(run.watcher.engines) == 5 and run.watcher.status.degraded is None
    decode_lists = [q for q in api.list_requests() if "decode" in q["labelSelector"]]
    assert [q.get("continue") is not None for q in decode_lists] == [False, True, False, True, True]
    nursery.cancel_scope.cancel()


async def test_an_outage_keeps_the_view_reports_degraded_once_and_recovered(autojump_clock, nursery, tmp_path,
                                                                            caplog) -> None:
    def before(api: ApiDouble) -> None:
        api.put(make_pod("p1", labels=PREFILL, ip="10.0.0.1"))
        api.put(make_pod("d1", labels=DECODE, ip="10.0.0.2"))

    run = await start(nursery, tmp_path, before=before, retry_min_s=0.2, retry_max_s=5.0)
    assert set(run.reasons()) == {"listed"}
    del run.updates[:]
    caplog.set_level(logging.INFO, logger="narwhal.events")
    run.api.outage()
    await trio.sleep(120.0)
    assert set(run.watcher.engines) == {"p1", "d1"}  # never emptied for an outage
    assert run.reasons() == ["degraded"]
    status = run.watcher.status
    assert status.degraded is not None and status.degraded_since is not None and not status.connected
    # Meanwhile d1 is deleted and d2 added: applied once the API answers (the watch resumes; no 410 here).
    run.api.outage(False)
    run.api.delete("d1")
    run.api.put(make_pod("d2", labels=DECODE, ip="10.0.0.3"))
    await trio.sleep(10.0)
    assert set(run.watcher.engines) == {"p1", "d2"}
    assert run.reasons().count("degraded") == 1 and "recovered" in run.reasons()
    assert run.watcher.status.degraded is None and run.watcher.status.connected
    # What the router will log of it, with the etcd watcher's log_update.
    for update in run.updates:
        log_update(update, source="kubernetes", default_model="m")
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "narwhal.events"]
    # (One selector may hear its events before the other is back: recovered comes when both are.)
    events = [line["event"] for line in lines]
    assert events[0] == "discovery_degraded" and sorted(events[1:]) == ["discovery_recovered", "engine_discovered",
                                                                       "engine_vanished"]
    assert "ConnectError" in lines[0]["error"] or "Protocol" in lines[0]["error"]
    discovered = next(line for line in lines if line["event"] == "engine_discovered")
    assert {k: discovered[k] for k in ("engine", "url", "role", "model", "source")} == {
        "engine": "d2", "url": "http://10.0.0.3:8000", "role": "decode", "model": "m", "source": "kubernetes"}
    nursery.cancel_scope.cancel()


async def test_a_watch_gone_silent_is_reopened_after_its_timeout(autojump_clock, nursery, tmp_path) -> None:
    api = ApiDouble()
    api.stall = True
    run = await start(nursery, tmp_path, api, watch_timeout_s=60.0, timeout_s=5.0)
    await trio.sleep(30.0)
    api.put(make_pod("d1", labels=DECODE, ip="10.0.0.1"))
    await trio.sleep(20.0)
    assert run.watcher.engines == {} and len(api.watch_requests()) == 2  # silent, and not yet past 60 + 5 s
    api.stall = False
    await trio.sleep(20.0)
    assert set(run.watcher.engines) == {"d1"} and len(api.list_requests()) == 2  # reopened from its version
    nursery.cancel_scope.cancel()


async def test_every_selector_is_listed_again_every_resync_interval_s(autojump_clock, nursery, tmp_path) -> None:
    run = await start(nursery, tmp_path, resync_interval_s=600.0)
    await trio.sleep(599.0)
    assert len(run.api.list_requests()) == 2
    await trio.sleep(2.0)
    assert len(run.api.list_requests()) == 4
    assert run.reasons() == ["listed"]  # nothing changed: nothing reported
    nursery.cancel_scope.cancel()


async def test_a_watch_error_other_than_410_is_an_outage(autojump_clock, nursery, tmp_path) -> None:
    api = ApiDouble()
    answer = api._watch
    failures = 3

    async def failing(stream: Any, selector: str, query: dict[str, str]) -> None:
        nonlocal failures
        if failures and "decode" in selector:
            failures -= 1
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n\r\n"
                                  b'{"type":"ERROR","object":{"kind":"Status","code":500,"reason":"InternalError",'
                                  b'"message":"etcdserver: request timed out"}}\n')
            return
        await answer(stream, selector, query)

    api._watch = failing  # type: ignore[method-assign]
    run = await start(nursery, tmp_path, api)
    await trio.sleep(10.0)
    # Reported once, not once per try: a watch that opens proves nothing when the last one broke off after opening.
    assert run.reasons() == ["listed", "degraded"]
    degraded = run.updates[1].status.degraded or ""
    assert "500" in degraded and "request timed out" in degraded
    # The watch now opened stays quiet: its first line (a bookmark here) says it is back.
    await trio.sleep(60.0)
    assert run.reasons() == ["listed", "degraded", "recovered"]
    nursery.cancel_scope.cancel()


async def test_bookmarks_advance_the_resource_version_so_a_compaction_costs_no_relist(autojump_clock, nursery,
                                                                                      tmp_path) -> None:
    api = ApiDouble(bookmark_interval_s=30.0)
    run = await start(nursery, tmp_path, api)
    listed_at = run.watcher.status.resource_versions["decode"]
    # Prefill Pods change: the decode watch sees no event, only bookmarks carrying the new resourceVersion.
    for n in range(5):
        api.put(make_pod(f"p{n}", labels=PREFILL, ip=f"10.0.0.{n + 1}"))
    await trio.sleep(31.0)
    assert run.watcher.status.resource_versions["decode"] == str(api.resource_version) != listed_at
    api.compact()
    api.close_watches()
    await trio.sleep(5.0)
    assert len(api.list_requests()) == 2  # resumed from the bookmark's resourceVersion: not gone, no relist
    assert api.watch_requests()[-1]["resourceVersion"] == str(api.resource_version)
    assert len(run.watcher.engines) == 5
    nursery.cancel_scope.cancel()


async def test_a_refused_token_is_degraded_with_the_401_named(autojump_clock, nursery, tmp_path) -> None:
    run = await start(nursery, tmp_path, token="wrong")
    assert run.reasons() == ["degraded"] and run.watcher.engines == {}
    assert "401" in (run.watcher.status.degraded or "") and "Unauthorized" in (run.watcher.status.degraded or "")
    # The kubelet rotates the token file: read again on the next try, and recovered.
    (tmp_path / "token").write_text("s3cret")
    await trio.sleep(10.0)
    assert run.reasons()[-1] in ("recovered", "listed") and run.watcher.status.degraded is None
    nursery.cancel_scope.cancel()


def test_in_cluster_access_reads_the_service_account(tmp_path) -> None:
    (tmp_path / "namespace").write_text("serving\n")
    access = in_cluster_access({"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"},
                               str(tmp_path))
    assert access == ClusterAccess(api_url="https://10.96.0.1:443", token_file=str(tmp_path / "token"),
                                   ca_file=str(tmp_path / "ca.crt"), namespace="serving")
    assert in_cluster_access({"KUBERNETES_SERVICE_HOST": "fd00::1"}, str(tmp_path / "none")).api_url == \
        "https://[fd00::1]:443"
    with pytest.raises(ValueError, match="KUBERNETES_SERVICE_HOST"):
        in_cluster_access({})


def test_the_doubles_label_selectors() -> None:
    labels = {"app": "engine", "role": "decode"}
    assert selector_matches("app=engine,role==decode", labels)
    assert selector_matches("app, role in (prefill, decode), tier notin (x)", labels)
    assert not selector_matches("app=engine,role!=decode", labels)
    assert not selector_matches("!app", labels) and selector_matches("!tier", labels)
    with pytest.raises(ValueError):
        selector_matches("app in prefill", labels)


async def test_https_with_the_ca_file(nursery, tmp_path) -> None:
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_context)
    ca_file = tmp_path / "ca.crt"
    ca.cert_pem.write_to_path(str(ca_file))
    api = ApiDouble(ssl_context=server_context)
    run = await start(nursery, tmp_path, api, before=lambda api: api.put(make_pod("d1", labels=DECODE)),
                      ca_file=str(ca_file))
    assert api.url.startswith("https://") and set(run.watcher.engines) == {"d1"}
    # Without the cluster's CA the server is not trusted: degraded, and it says why.
    trustme.CA().cert_pem.write_to_path(str(tmp_path / "other.crt"))
    other = KubernetesWatcher(api.namespace, api_url=api.url, decode_selector="app=engine",
                              token_file=str(tmp_path / "token"), ca_file=str(tmp_path / "other.crt"))
    updates: list[ViewUpdate] = []
    await nursery.start(other.run, updates.append)
    assert [u.reason for u in updates] == ["degraded"] and "CERTIFICATE_VERIFY_FAILED" in (other.status.degraded or "")
    nursery.cancel_scope.cancel()


def pod(**options: Any) -> Pod:
    return msgspec.convert(make_pod("e1", labels=DECODE, **options), Pod)


def test_pod_engine_takes_only_running_ready_pods_with_an_ip() -> None:
    def engine(p: Pod) -> Any:
        return pod_engine(p, role="decode", namespace="ns", port=8000, model_label=None, default_model=None)

    assert engine(pod()) == EngineSpec(name="e1", url="http://10.0.0.1:8000", role="decode")
    assert engine(pod(ready=False)) is None
    assert engine(pod(ip=None)) is None
    for phase in ("Pending", "Succeeded", "Failed", "Unknown"):
        assert engine(pod(phase=phase)) is None
    no_conditions = pod()
    no_conditions.status.conditions = None
    assert engine(no_conditions) is None
    bad_port = pod_engine(pod(), role="decode", namespace="ns", port=70000, model_label=None, default_model=None)
    assert isinstance(bad_port, EntryProblem) and bad_port.key == "ns/e1" and "port" in bad_port.problem


async def test_a_list_page_past_its_bound_is_an_outage_not_a_crash(autojump_clock, nursery, tmp_path,
                                                                   monkeypatch) -> None:
    monkeypatch.setattr(kubernetes, "MAX_PAGE_BYTES", 2000)
    run = await start(nursery, tmp_path, before=lambda api: [api.put(make_pod(f"d{n}", labels=DECODE))
                                                             for n in range(5)])
    assert run.reasons() == ["degraded"] and "lower page_size" in (run.watcher.status.degraded or "")
    nursery.cancel_scope.cancel()
