"""The supervisor: actions from the fleet become control-pool probes at once, with verdicts."""

from __future__ import annotations

import json

import httpx
import pytest
import trio

from narwhal.config import parse_config
from narwhal.control.fleet_writer import FleetWriter
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
        if how.startswith("health_") and request.url.path == "/health":
            return httpx.Response(int(how.removeprefix("health_")))
        if request.url.path == "/health":
            return httpx.Response(200)
        if how == "429":
            return httpx.Response(429)
        if how == "read_timeout":
            raise httpx.ReadTimeout("timed out", request=request)
        body = json.loads(request.content)
        if body["kv_transfer_params"].get("do_remote_decode"):
            if how == "bad_kv":
                return httpx.Response(200, json={"kv_transfer_params": "nope"})
            return httpx.Response(200, json={"choices": [], "kv_transfer_params": KV})
        if how == "no_done":
            return httpx.Response(200, content=b'data: {"choices": []}\n\n')
        if how in STREAM_BODIES:
            return httpx.Response(200, content=STREAM_BODIES[how])
        return httpx.Response(200, content=b'data: {"choices": []}\n\ndata: [DONE]\n\n')


# Decode bodies on which the old `endswith(b"data: [DONE]")` check and the data
# path's SSE watcher disagreed: the probe must judge them as the data path does.
STREAM_BODIES = {
    "done_then_comment": b'data: {"choices": []}\n\ndata: [DONE]\n\n: keep-alive\n\n',
    "done_without_space": b'data: {"choices": []}\n\ndata:[DONE]\n\n',
    "not_sse_but_done": b'<html>oops</html>\ndata: [DONE]',
}


async def make_world(nursery, quarantine_s: float | None = None):
    config = parse_config(CONFIG)
    engines = FakeEngines()
    pool = ControlPool(control_connections=4, engine_config=config.engine,
                       transport=httpx.MockTransport(engines))
    fleet = Fleet([(e.name, e.role) for e in config.engines], eject_after=2, liveness_misses=3,
                  failure_quarantine_s=quarantine_s, probe_interval_s=5.0)
    metrics = RouterMetrics()
    supervisor = Supervisor(config=config, fleet=FleetWriter(fleet, metrics), control_pool=pool, metrics=metrics)
    await nursery.start(supervisor.run)
    return supervisor, fleet, engines, pool


@pytest.fixture
async def world(nursery):
    supervisor, fleet, engines, pool = await make_world(nursery)
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
    assert supervisor.metrics.probes.get("d1", "health", "success", "") == 1


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
    assert supervisor.metrics.probes.get("p1", "inference", "failed", "") == 1


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
    assert supervisor.metrics.probes.get("d1", "inference", "inconclusive", "") == 1


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
    assert supervisor.metrics.probes.get("p1", "inference", "inconclusive", "") == 1
    assert ("p1", "/v1/completions") in engines.calls


async def test_health_sweep_and_probe_failures_are_counted_by_engine_and_class(world):
    supervisor, _, engines = world
    engines.behaviour["d1"] = "refuse"
    supervisor.record_failure("d1", FailureClass.TIMEOUT)
    supervisor.record_failure("d1", FailureClass.TIMEOUT)
    await settle()
    failures = supervisor.metrics.engine_failures
    assert failures.get("d1", "timeout", "") == 2
    # The health probe the streak asked for failed to connect: counted as well.
    assert failures.get("d1", "connection", "") == 1


# ---------- issue 10: rules 1-4 on the probe side ----------

def holds(fleet, name):
    return {h.kind for h in fleet.view(name, trio.current_time()).holds}


@pytest.mark.parametrize("how", ["429", "read_timeout"])
async def test_overload_or_timeout_on_the_suspects_own_leg_is_inconclusive_not_an_ejection(world, how):
    supervisor, fleet, engines = world
    engines.behaviour["d1"] = how
    supervisor.record_failure("d1", FailureClass.INFERENCE_STATUS)
    supervisor.record_failure("d1", FailureClass.INFERENCE_STATUS)
    await settle()
    view = fleet.view("d1", trio.current_time())
    assert not view.ejected and HoldKind.INFERENCE_VERIFICATION in holds(fleet, "d1")
    assert view.next_probe_at == pytest.approx(trio.current_time() + 5.0)
    assert supervisor.metrics.probes.get("d1", "inference", "inconclusive", "") == 1
    assert supervisor.metrics.probes.get("d1", "inference", "failed", "") == 0


async def test_a_failed_decode_leg_quarantines_by_its_class_and_a_health_200_does_not_clear_it(nursery):
    supervisor, fleet, engines, pool = await make_world(nursery, quarantine_s=60.0)
    engines.behaviour["d1"] = "no_done"
    supervisor.record_failure("d1", FailureClass.STREAM)
    supervisor.record_failure("d1", FailureClass.STREAM)
    await settle()
    [quarantine] = [h for h in fleet.view("d1", trio.current_time()).holds
                    if h.kind is HoldKind.FAILURE_QUARANTINE]
    assert quarantine.cause == FailureClass.STREAM
    assert await supervisor.health_probe("d1")
    supervisor.record_health_sweep({"p1": True, "p2": True, "d1": True, "d2": True})
    assert HoldKind.FAILURE_QUARANTINE in holds(fleet, "d1")
    assert fleet.quarantine_needs_inference_check("d1", trio.current_time())
    await pool.aclose()


async def test_probes_pair_held_engines_when_every_engine_of_a_role_is_held(world, autojump_clock):
    supervisor, fleet, engines = world
    # A fleet-wide burst (say of /health 5xx) put every engine under verification at once;
    # inference itself works. Before any probe runs, no engine of either role is eligible.
    for name in ("p1", "p2", "d1", "d2"):
        supervisor.record_failure(name, FailureClass.INFERENCE_STATUS)
        supervisor.record_failure(name, FailureClass.INFERENCE_STATUS)
    assert supervisor.capacity_problem() is not None
    start = trio.current_time()
    for _ in range(3):
        await settle()
        if supervisor.capacity_problem() is None:
            break
        await trio.sleep(5.0)
        supervisor.start_due_probes()
    assert supervisor.capacity_problem() is None
    assert trio.current_time() - start <= 5.0
    assert all(fleet.view(name, trio.current_time()).eligible for name in ("p1", "p2", "d1", "d2"))
    assert not any(fleet.view(name, trio.current_time()).ejected for name in ("p1", "p2", "d1", "d2"))


async def test_a_probe_never_pairs_with_an_ejected_or_drained_engine(world):
    _, fleet, _ = world
    now = trio.current_time()
    fleet.add_hold("p1", HoldKind.INFERENCE_VERIFICATION, "suspect", now)
    fleet.add_hold("p2", HoldKind.OPERATOR_DRAIN, "operator", now)
    assert fleet.probe_partners("prefill", now, exclude="d1") == ["p1"]
    fleet.eject("p1", "dead", now)
    assert fleet.probe_partners("prefill", now, exclude="d1") == []
    assert fleet.probe_partners("decode", now, exclude="d1") == ["d2"]


@pytest.mark.parametrize(("how", "outcome"), [("done_then_comment", "success"),
                                              ("done_without_space", "success"),
                                              ("not_sse_but_done", "failed")])
async def test_the_probe_judges_a_decode_stream_with_the_data_paths_sse_watcher(world, how, outcome):
    supervisor, fleet, engines = world
    engines.behaviour["d1"] = how
    fleet.add_hold("d1", HoldKind.INFERENCE_VERIFICATION, "suspect", trio.current_time())
    assert await supervisor.inference_probe("d1") == outcome


@pytest.mark.parametrize(("status", "healthy", "evidence"), [
    (204, True, None),                                  # 2xx: a successful health response
    (302, False, FailureClass.INFERENCE_STATUS),        # neither 2xx nor 4xx: inference_status
    (404, False, None),                                 # 4xx: the clearing table's 4xx row
    (429, False, FailureClass.OVERLOAD),
    (503, False, FailureClass.INFERENCE_STATUS),
])
async def test_the_health_probe_classifies_statuses_by_the_one_table(world, status, healthy, evidence):
    supervisor, fleet, engines = world
    engines.behaviour["d1"] = f"health_{status}"
    supervisor.record_failure("d1", FailureClass.INFERENCE_STATUS)
    assert await supervisor.health_probe("d1") is healthy
    streaks = fleet.view("d1", trio.current_time()).evidence
    if evidence is not None:
        assert streaks[evidence] == (2 if evidence is FailureClass.INFERENCE_STATUS else 1)
    elif status == 404:
        assert streaks[FailureClass.INFERENCE_STATUS] == 0  # the 4xx row clears inference_status
    assert sum(streaks.values()) == (0 if status == 404 else 1 if healthy else sum(streaks.values()))
