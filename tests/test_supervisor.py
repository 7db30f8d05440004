"""The supervisor: actions from the fleet become control-pool probes at once, with verdicts."""

from __future__ import annotations

import json

import httpx
import pytest
import trio

from narwhal.config import parse_config
from narwhal.control.supervisor import Supervisor
from narwhal.errors import FailureClass, SuccessKind
from narwhal.fleet import Fleet, HoldKind
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.pools.control import ControlPool

CONFIG = """
[recovery]
eject_after = 2
probe_interval_s = 5.0
[[engines]]
name = "p1"
url = "http://p1:1"
role = "prefill"
[[engines]]
name = "p2"
url = "http://p2:1"
role = "prefill"
[[engines]]
name = "d1"
url = "http://d1:1"
role = "decode"
[[engines]]
name = "d2"
url = "http://d2:1"
role = "decode"
"""

KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "x",
      "remote_block_ids": [1], "remote_host": "127.0.0.1", "remote_port": 1}


class FakeEngines:
    """An httpx handler playing every engine; ``behaviour[name]`` picks how each answers."""

    def __init__(self) -> None:
        self.behaviour: dict[str, str] = {}
        self.calls: list[tuple[str, str]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        name = request.url.host
        self.calls.append((name, request.url.path))
        how = self.behaviour.get(name, "ok")
        if how == "refuse":
            raise httpx.ConnectError("refused", request=request)
        if how == "500":
            return httpx.Response(500)
        if request.url.path == "/health":
            return httpx.Response(200)
        body = json.loads(request.content)
        if body["kv_transfer_params"].get("do_remote_decode"):
            if how == "bad_kv":
                return httpx.Response(200, json={"kv_transfer_params": "nope"})
            return httpx.Response(200, json={"choices": [], "kv_transfer_params": KV})
        if how == "no_done":
            return httpx.Response(200, content=b'data: {"choices": []}\n\n')
        return httpx.Response(200, content=b'data: {"choices": []}\n\ndata: [DONE]\n\n')


@pytest.fixture
async def world(nursery):
    config = parse_config(CONFIG)
    engines = FakeEngines()
    pool = ControlPool(control_connections=4, engine_config=config.engine,
                       transport=httpx.MockTransport(engines))
    fleet = Fleet([(e.name, e.role) for e in config.engines], eject_after=2, liveness_misses=3,
                  failure_quarantine_s=None, probe_interval_s=5.0)
    supervisor = Supervisor(config=config, fleet=fleet, control_pool=pool, metrics=RouterMetrics())
    await nursery.start(supervisor.run)
    yield supervisor, fleet, engines
    await pool.aclose()


async def settle() -> None:
    # MockTransport answers without real I/O; let started probe tasks finish.
    for _ in range(50):
        await trio.sleep(0)


async def test_timeout_streak_runs_a_health_probe_at_once_and_200_clears(world):
    supervisor, fleet, engines = world
    supervisor.record_failure("d1", FailureClass.TIMEOUT)
    assert engines.calls == []
    supervisor.record_failure("d1", FailureClass.TIMEOUT)
    await settle()
    assert engines.calls == [("d1", "/health")]
    assert fleet.view("d1", trio.current_time()).evidence[FailureClass.TIMEOUT] == 0
    assert supervisor.metrics.probes.get("d1", "health", "success") == 1


async def test_failed_health_probe_is_evidence(world):
    supervisor, fleet, engines = world
    engines.behaviour["d1"] = "refuse"
    supervisor.record_failure("d1", FailureClass.OVERLOAD)
    supervisor.record_failure("d1", FailureClass.OVERLOAD)
    await settle()
    view = fleet.view("d1", trio.current_time())
    assert view.evidence[FailureClass.CONNECTION] == 1
    assert view.evidence[FailureClass.OVERLOAD] == 2


async def test_stream_streak_pauses_then_probe_success_clears_hold_and_evidence(world):
    supervisor, fleet, engines = world
    supervisor.record_failure("d1", FailureClass.STREAM)
    supervisor.record_failure("d1", FailureClass.STREAM)
    # The hold is in place before any probe I/O happens.
    assert "d1" not in supervisor.eligible("decode")
    await settle()
    paths = [call for call in engines.calls if call[1] == "/v1/completions"]
    # A healthy prefill peer produced the handoff; the suspect decoded it.
    assert paths[0][0] in ("p1", "p2") and paths[1] == ("d1", "/v1/completions")
    view = fleet.view("d1", trio.current_time())
    assert view.eligible and view.evidence[FailureClass.STREAM] == 0
    assert all(h.kind is not HoldKind.INFERENCE_VERIFICATION for h in view.holds)


async def test_failed_suspect_leg_ejects(world):
    supervisor, fleet, engines = world
    engines.behaviour["p1"] = "bad_kv"
    supervisor.record_failure("p1", FailureClass.KV_HANDOFF)
    supervisor.record_failure("p1", FailureClass.KV_HANDOFF)
    await settle()
    view = fleet.view("p1", trio.current_time())
    assert view.ejected
    assert supervisor.metrics.probes.get("p1", "inference", "failed") == 1


async def test_suspect_decode_without_done_fails_its_leg(world):
    supervisor, fleet, engines = world
    engines.behaviour["d2"] = "no_done"
    supervisor.record_failure("d2", FailureClass.INFERENCE_STATUS)
    supervisor.record_failure("d2", FailureClass.INFERENCE_STATUS)
    await settle()
    assert fleet.view("d2", trio.current_time()).ejected


async def test_failed_peer_leg_is_inconclusive_and_rescheduled(world, autojump_clock):
    supervisor, fleet, engines = world
    engines.behaviour["p1"] = engines.behaviour["p2"] = "500"
    supervisor.record_failure("d1", FailureClass.STREAM)
    supervisor.record_failure("d1", FailureClass.STREAM)
    await settle()
    view = fleet.view("d1", trio.current_time())
    assert not view.ejected and not view.eligible
    assert view.next_probe_at == pytest.approx(trio.current_time() + 5.0)
    engines.behaviour.clear()
    await trio.sleep(5.0)
    supervisor.start_due_probes()
    await trio.sleep(0.01)
    assert fleet.view("d1", trio.current_time()).eligible


async def test_no_eligible_peer_is_inconclusive_not_a_failure(world):
    supervisor, fleet, engines = world
    for name in ("p1", "p2"):
        fleet.eject(name, "test", trio.current_time())
    supervisor.record_failure("d1", FailureClass.STREAM)
    supervisor.record_failure("d1", FailureClass.STREAM)
    await settle()
    view = fleet.view("d1", trio.current_time())
    assert not view.ejected and view.next_probe_at is not None
    assert supervisor.metrics.probes.get("d1", "inference", "inconclusive") == 1


async def test_connection_streak_ejects_without_a_probe(world):
    supervisor, fleet, engines = world
    supervisor.record_failure("p2", FailureClass.CONNECTION)
    supervisor.record_failure("p2", FailureClass.CONNECTION)
    await settle()
    assert fleet.view("p2", trio.current_time()).ejected
    assert engines.calls == []
    assert supervisor.metrics.engine_ejections.values


async def test_success_rows_flow_through(world):
    supervisor, fleet, _ = world
    supervisor.record_failure("d1", FailureClass.CONNECTION)
    supervisor.record_success("d1", SuccessKind.DECODE_TERMINAL)
    assert fleet.view("d1", trio.current_time()).evidence[FailureClass.CONNECTION] == 0


async def test_failed_decode_peer_leg_is_inconclusive_for_a_suspect_prefill(world):
    supervisor, fleet, engines = world
    engines.behaviour["d1"] = engines.behaviour["d2"] = "500"
    supervisor.record_failure("p1", FailureClass.KV_HANDOFF)
    supervisor.record_failure("p1", FailureClass.KV_HANDOFF)
    await settle()
    view = fleet.view("p1", trio.current_time())
    # The suspect's own leg passed; the peer failed: no verdict, the hold stays, a re-probe is due.
    assert not view.ejected and not view.eligible and view.next_probe_at is not None
    assert supervisor.metrics.probes.get("p1", "inference", "inconclusive") == 1
    assert ("p1", "/v1/completions") in engines.calls


async def test_health_sweep_and_probe_failures_are_counted_by_engine_and_class(world):
    supervisor, _, engines = world
    engines.behaviour["d1"] = "refuse"
    supervisor.record_failure("d1", FailureClass.TIMEOUT)
    supervisor.record_failure("d1", FailureClass.TIMEOUT)
    await settle()
    failures = supervisor.metrics.engine_failures
    assert failures.get("d1", "timeout") == 2
    # The health probe the streak asked for failed to connect: counted as well.
    assert failures.get("d1", "connection") == 1
