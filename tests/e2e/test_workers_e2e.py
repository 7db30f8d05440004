"""``serving.workers = 2``: a controller and two worker processes on one port, end to end."""

from __future__ import annotations

import os
import re
import signal

import httpx
import pytest
import trio

from tests.e2e.waiting import wait_until

pytestmark = pytest.mark.e2e

WORKERS = {"serving": {"workers": 2, "shutdown_grace_s": 10.0}}


def _sample(metrics: str, name: str, **labels: str) -> float:
    """The value of one Prometheus sample (0 when absent)."""
    label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (r"\{" + re.escape(label_text) + r"\}" if labels else "") + r" ([0-9.e+-]+)$"
    for line in metrics.splitlines():
        match = re.match(pattern, line)
        if match:
            return float(match.group(1))
    return 0.0


async def _wait(predicate, *, timeout_s: float = 20.0, interval_s: float = 0.05):
    with trio.fail_after(timeout_s):
        while True:
            result = await predicate()
            if result:
                return result
            await trio.sleep(interval_s)


async def _stream(client: httpx.AsyncClient, url: str, tokens: int = 8) -> str:
    body = {"model": "mock-model", "prompt": "hello", "max_tokens": tokens, "stream": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        return (await response.aread()).decode()


async def _ready(fleet) -> bool:
    return (await fleet.client.get(f"{fleet.url}/ready")).status_code == 200


async def _every_worker_serving(fleet) -> None:
    """Send requests on fresh connections until each worker has finished one: all of them accept.

    /ready answers 200 as soon as one worker serves; its sibling may still be starting
    (slowly, on a loaded machine), and a connection left for a sibling that does not
    accept yet is rightly taken as overflow.
    """
    body = {"model": "mock-model", "prompt": "hi", "max_tokens": 2}
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=30.0, limits=limits) as client:
        async def all_served() -> bool:
            assert (await client.post(f"{fleet.url}/v1/completions", json=body)).status_code == 200
            text = (await fleet.client.get(f"{fleet.url}/metrics")).text
            return all(_sample(text, "narwhal_worker_requests_finished", worker=str(i)) > 0 for i in (0, 1))

        await _wait(all_served, timeout_s=30.0)


async def test_400_streams_are_intact_and_both_workers_serve(start_fleet) -> None:
    fleet = await start_fleet(prefill=1, decode=2, sections=WORKERS, mock_args=["--tokens", "8"])
    await _wait(lambda: _ready(fleet))
    results: list[str] = []
    # Fresh connections spread over the workers waiting in accept().
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=60.0, limits=limits) as client:
        async def one() -> None:
            results.append(await _stream(client, fleet.url))

        limiter = trio.CapacityLimiter(32)

        async def bounded() -> None:
            async with limiter:
                await one()

        async with trio.open_nursery() as nursery:
            for _ in range(400):
                nursery.start_soon(bounded)
    assert len(results) == 400
    assert all(text.rstrip().endswith("data: [DONE]") for text in results)

    async def counted() -> str | None:
        text = (await fleet.client.get(f"{fleet.url}/metrics")).text
        total = _sample(text, "narwhal_requests_total", route="/v1/completions", status="200", model="mock-model")
        return text if total >= 400 else None

    metrics = await _wait(counted)
    per_worker = [_sample(metrics, "narwhal_worker_requests_finished", worker=str(i)) for i in (0, 1)]
    assert sum(per_worker) == 400
    assert min(per_worker) > 0, per_worker
    assert _sample(metrics, "narwhal_worker_up", worker="0") == 1.0
    # Every JSON line of a worker names it.
    request_lines = fleet.router.events("request")
    assert request_lines and all("worker" in line for line in request_lines)
    assert {line["worker"] for line in request_lines} == {0, 1}


async def test_a_drain_reaches_every_worker(start_fleet) -> None:
    fleet = await start_fleet(prefill=1, decode=2, sections=WORKERS, mock_args=["--tokens", "4"])
    await _wait(lambda: _ready(fleet))
    response = await fleet.client.post(f"{fleet.url}/admin/engines/d1/drain")
    assert response.status_code == 200, response.text
    before = (await fleet.engine_stats("d1"))["decode"]
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=30.0, limits=limits) as client:
        for _ in range(40):
            await _stream(client, fleet.url, tokens=4)
    # No worker placed a new decode on the drained engine.
    assert (await fleet.engine_stats("d1"))["decode"] == before
    view = (await fleet.client.get(f"{fleet.url}/admin/engines/d1")).json()["engine"]
    assert view["eligible"] is False
    # Every snapshot (the drain's included) reached the workers; the delay is measured, and bounded.
    metrics = (await fleet.client.get(f"{fleet.url}/metrics")).text
    delivered = _sample(metrics, "narwhal_worker_snapshot_lag_seconds_count")
    assert delivered >= 2
    assert _sample(metrics, "narwhal_worker_snapshot_lag_seconds_bucket", le="1") == delivered


async def test_a_dead_engine_is_ejected_after_eject_after_failures_summed_over_workers(start_fleet) -> None:
    sections = {**WORKERS, "recovery": {"eject_after": 3}}
    fleet = await start_fleet(prefill=1, decode=2, sections=sections, mock_args=["--tokens", "4"])
    await _wait(lambda: _ready(fleet))
    fleet.engines["d1"].kill()
    failures = 0
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=30.0, limits=limits) as client:
        for _ in range(30):
            body = {"model": "mock-model", "prompt": "hi", "max_tokens": 4}
            response = await client.post(f"{fleet.url}/v1/completions", json=body)
            if response.status_code != 200:
                failures += 1
        # Three connection failures eject d1 whichever worker (or health check) saw them; a
        # snapshot round trip may let a request or two more through before every worker has it.
        # d1 counts as idle only once every worker reported a snapshot without it
        # (``AggregateInFlight``): from then on no worker places on d1.

        async def ejected_everywhere() -> bool:
            view = (await fleet.client.get(f"{fleet.url}/admin/engines/d1")).json()["engine"]
            return view["ejected"] and view["in_flight"] == 0

        await wait_until(ejected_everywhere, timeout_s=20.0, what="d1 ejected in every worker's snapshot")
        for _ in range(10):
            body = {"model": "mock-model", "prompt": "hi", "max_tokens": 4}
            assert (await client.post(f"{fleet.url}/v1/completions", json=body)).status_code == 200
    ejections = await fleet.router.wait_event("engine_ejected", timeout_s=5.0, engine="d1")
    assert len(ejections) == 1, ejections
    assert ejections[0]["ejection_cause"] == "connection"
    assert ejections[0]["reason"] == "connection streak reached 3 (eject_after 3)"
    # Each failure a client saw was logged by the worker that served it and counted once by
    # the controller: the controller's count is the sum over workers, plus the failures its
    # own health checks and readmission probes of the dead d1 saw (a loaded machine makes
    # the requests slow enough for a health pass or a probe to fall among them).

    def worker_failures() -> list[dict]:
        return fleet.router.events("engine_failure", engine="d1")

    def controller_failures() -> list[dict]:
        return (fleet.router.events("health_check_failed", engine="d1", failure_class="connection")
                + fleet.router.events("probe_result", engine="d1", probe="health", outcome="failed"))

    async def counted_once() -> bool:
        # Lines reach us in batches: wait until those of every failure counted so far arrived.
        counters = (await fleet.client.get(f"{fleet.url}/admin/engines/d1")).json()["engine"]["counters"]
        return counters["failures"]["connection"] == len(worker_failures()) + len(controller_failures())

    await wait_until(counted_once, timeout_s=10.0, what="every failure of d1 logged and counted once")
    assert {line["worker"] for line in worker_failures()} <= {0, 1}
    assert not any("worker" in line for line in controller_failures())
    assert failures == len(worker_failures()), (failures, worker_failures())
    assert failures + len(controller_failures()) >= 3


async def test_a_killed_worker_is_replaced_while_serving_continues(start_fleet) -> None:
    fleet = await start_fleet(prefill=1, decode=1, sections=WORKERS, mock_args=["--tokens", "4"])
    await _wait(lambda: _ready(fleet))
    started = await fleet.router.wait_event("worker_started", timeout_s=10.0, worker=1)
    victim = started[0]["pid"]
    os.kill(victim, signal.SIGKILL)
    await fleet.router.wait_event("worker_exited", timeout_s=10.0, worker=1)
    # While worker 1 is down (and restarting), every new client is served whole by worker 0.
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=30.0, limits=limits) as client:
        texts = [await _stream(client, fleet.url, tokens=4) for _ in range(20)]
    assert all(text.rstrip().endswith("data: [DONE]") and text.count("data: {") >= 4 for text in texts)

    async def replaced() -> bool:
        return len(fleet.router.events("worker_started", worker=1)) >= 2

    await _wait(replaced)

    async def both_up() -> bool:
        text = (await fleet.client.get(f"{fleet.url}/metrics")).text
        return _sample(text, "narwhal_worker_up", worker="1") == 1.0 and _sample(
            text, "narwhal_worker_restarts", worker="1") == 1.0

    await _wait(both_up)


async def test_sigterm_drains_a_stream_in_flight_on_each_worker(start_fleet) -> None:
    fleet = await start_fleet(prefill=1, decode=1, sections=WORKERS,
                              mock_args=["--tokens", "60", "--token-delay-s", "0.05"])
    await _wait(lambda: _ready(fleet))
    texts: list[str] = []
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=30.0, limits=limits) as client:
        async with trio.open_nursery() as nursery:
            opened = await _streams_on_each_worker(fleet, client, nursery, texts)
            fleet.router.process.send_signal(signal.SIGTERM)
    assert len(texts) == opened
    assert all(text.rstrip().endswith("data: [DONE]") for text in texts)
    with trio.fail_after(15):
        await fleet.router.process.wait()
    assert fleet.router.process.returncode == 0
    exits = fleet.router.events("worker_exited")
    assert {e["worker"] for e in exits} == {0, 1} and all(e["returncode"] == 0 for e in exits)


async def _collect(client: httpx.AsyncClient, url: str, sink: list[str], *,
                   task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """A 60-token stream into ``sink``; started once its response head came (a worker is serving it)."""
    body = {"model": "mock-model", "prompt": "hello", "max_tokens": 60, "stream": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        task_status.started()
        sink.append((await response.aread()).decode())


async def _streams_on_each_worker(fleet, client: httpx.AsyncClient, nursery: trio.Nursery, sink: list[str]) -> int:
    """Open long streams (new connections) until each worker has one in flight; how many were opened.

    Each next stream is opened once the last one's response head came and the workers' reports count it (in
    flight or finished), so a slow machine opens no more of them, only later.
    """
    await _every_worker_serving(fleet)

    async def counts() -> tuple[list[float], float]:
        text = (await fleet.client.get(f"{fleet.url}/metrics")).text
        busy = [_sample(text, "narwhal_worker_requests_in_flight", worker=str(i)) for i in (0, 1)]
        return busy, sum(_sample(text, "narwhal_worker_requests_finished", worker=str(i)) for i in (0, 1))

    _, finished_before = await counts()
    opened = 0
    with trio.fail_after(60):
        while True:
            # Started once its response head came: a signal sent after that finds it in flight at a worker, never
            # still in a listener's backlog (a connection no worker accepted yet is closed by a drain, rightly).
            await nursery.start(_collect, client, fleet.url, sink)
            opened += 1

            async def counted(target: int = opened) -> list[float] | None:
                busy, finished = await counts()
                return busy if sum(busy) + finished - finished_before >= target else None

            busy = await _wait(counted)
            if min(busy) > 0:
                return opened
            assert opened < 40, busy


async def test_sighup_to_the_workers_cuts_no_stream_and_kills_no_worker(start_fleet) -> None:
    fleet = await start_fleet(prefill=1, decode=1, sections=WORKERS,
                              mock_args=["--tokens", "60", "--token-delay-s", "0.05"])
    await _wait(lambda: _ready(fleet))
    pids = [e["pid"] for e in fleet.router.events("worker_started")]
    assert len(pids) == 2
    texts: list[str] = []
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=30.0, limits=limits) as client:
        async with trio.open_nursery() as nursery:
            opened = await _streams_on_each_worker(fleet, client, nursery, texts)
            # What a closing terminal or `kill -HUP -- -PGID` does: every process gets SIGHUP.
            for pid in pids:
                os.kill(pid, signal.SIGHUP)
            fleet.router.process.send_signal(signal.SIGHUP)
    # Each stream was in flight during the signals (3 s of tokens) and ended whole.
    assert len(texts) == opened
    assert all(text.rstrip().endswith("data: [DONE]") for text in texts)
    assert all(_alive(pid) for pid in pids)
    assert not fleet.router.events("worker_exited")
    assert await fleet.router.wait_event("tls_reload_skipped", timeout_s=5.0)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            # A zombie has exited; only its parent's wait is missing.
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def test_workers_stop_and_exit_when_the_controller_dies(start_fleet) -> None:
    sections = {"serving": {"workers": 2, "shutdown_grace_s": 2.0}}
    fleet = await start_fleet(prefill=1, decode=1, sections=sections, mock_args=["--tokens", "4"])
    await _wait(lambda: _ready(fleet))
    pids = [e["pid"] for e in fleet.router.events("worker_started")]
    assert len(pids) == 2
    fleet.router.kill()
    await fleet.router.process.wait()

    async def all_gone() -> bool:
        return not any(_alive(pid) for pid in pids)

    # Orphaned workers close admission and leave within shutdown_grace_s (2 s), plus scheduling slack.
    await _wait(all_gone, timeout_s=2.0 + 3.0)
    orphaned = fleet.router.events("worker_orphaned")
    assert {e["worker"] for e in orphaned} == {0, 1}


async def test_workers_fence_on_their_own_clock_when_the_controller_freezes(start_fleet, tmp_path) -> None:
    ttl_s, renew_s, margin_s = 2.0, 0.4, 0.6
    sections = {"serving": {"workers": 2, "shutdown_grace_s": 2.0},
                "lease": {"backend": "file", "router_id": "rw", "ttl_s": ttl_s, "renew_interval_s": renew_s,
                          "fence_margin_s": margin_s, "path": str(tmp_path / "lease.json")}}
    fleet = await start_fleet(prefill=1, decode=1, sections=sections, mock_args=["--tokens", "2"])
    await _wait(lambda: _ready(fleet))
    body = {"model": "mock-model", "prompt": "hi", "max_tokens": 2}
    assert (await fleet.client.post(f"{fleet.url}/v1/completions", json=body)).status_code == 200
    # Freeze the controller only: the workers keep running, with the deadline they were last given.
    os.kill(fleet.router.pid, signal.SIGSTOP)
    try:
        await trio.sleep(ttl_s)  # past last renewal + ttl - margin, whatever the last renewal was
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=5.0, limits=limits) as client:
            for _ in range(6):  # new connections: both workers answer
                ready = await client.get(f"{fleet.url}/ready")
                assert (ready.status_code, ready.text.strip()) == (503, "fenced: lease not renewed")
                refused = await client.post(f"{fleet.url}/v1/completions", json=body)
                assert refused.status_code == 503
                assert refused.json()["error"]["message"] == "fenced: lease not renewed"
    finally:
        os.kill(fleet.router.pid, signal.SIGCONT)
    # Nobody else holds the lease: the controller takes it anew and the workers admit again.
    await _wait(lambda: _ready(fleet), timeout_s=20.0)
    assert (await fleet.client.post(f"{fleet.url}/v1/completions", json=body)).status_code == 200


async def test_clients_under_the_total_cap_are_all_served_however_the_kernel_spreads_them(start_fleet) -> None:
    # serving.max_client_connections is per worker (2 x 12 here). The kernel spreads accepts
    # unevenly; a worker at its cap must leave new clients to its sibling, not refuse them.
    sections = {"serving": {"workers": 2, "shutdown_grace_s": 2.0, "max_client_connections": 12}}
    fleet = await start_fleet(prefill=1, decode=1, sections=sections, mock_args=["--tokens", "2"])
    await _wait(lambda: _ready(fleet))
    await _every_worker_serving(fleet)
    port = int(fleet.url.rsplit(":", 1)[1])
    streams: list[trio.SocketStream] = []
    statuses: list[bytes] = []
    try:
        with trio.fail_after(30):
            for _ in range(22):
                # Each client keeps its connection (its slot) after its answer, as keep-alive clients do.
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                streams.append(stream)
                await stream.send_all(b"GET /ready HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
                answer = b""
                while b"\r\n\r\n" not in answer:
                    chunk = await stream.receive_some(4096)
                    assert chunk, answer
                    answer += chunk
                statuses.append(answer.split(b"\r\n", 1)[0])
    finally:
        for stream in streams:
            await stream.aclose()
    assert statuses == [b"HTTP/1.1 200 OK"] * 22, statuses
    assert not fleet.router.events("http_connections_capped")
