"""The readmission chain, operator drains, maintenance and the retry schedule, sentence by sentence.

Engines are fakes behind ``httpx.MockTransport`` on the real ``ControlPool``
(no sockets), so time is trio's MockClock with autojump and every time
asserted here is exact. The spec's "Readmission and drains" section:
the six checks (and each failing alone), the maintenance newer-process
requirement, drains surviving health successes and a resume, and a drain
cleared only by a successful readmission.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
from collections.abc import Callable
from typing import Any

import httpx
import msgspec
import pytest
import trio
from trio.testing import MockClock

from narwhal.config import Config, EngineConfig, EngineSpec, FleetConfig, ModelConfig, RecoveryConfig
from narwhal.control.readmission import CHAIN, Readmitter
from narwhal.errors import FailureClass, SuccessKind
from narwhal.fleet import EngineRecord, Fleet, HoldKind
from narwhal.fleet.placement import InFlight
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.pools.control import ControlPool

KEY = b"fleet-key"
WALL_BASE = 1_700_000_000.0
FULL_CHAIN = ["health", "attestation", "model", "generation", "kv_role", "final_health"]


class FakeEngine:
    """One engine's answers to the control calls; attributes are the knobs a test turns."""

    def __init__(self, name: str, role: str) -> None:
        self.engine_id = name
        self.role = role
        self.model = "m1"
        self.models_listed = ["m1"]
        self.generation = "g1"
        self.signing_key = KEY
        self.process_started_at = WALL_BASE - 3600.0
        self.kv_roles = ["producer"] if role == "prefill" else ["consumer"]
        # Health answers in order; the last one repeats.
        self.health = [200]
        self.health_delay_s = 0.0
        self.refuse_connections = False
        self.nonce_suffix = ""
        self.attest_engine_id: str | None = None
        self.identity_status = 200
        # An OpenAI-style 503 from /narwhal/identity with this message (the vLLM plugin's "not configured").
        self.identity_error: str | None = None
        self.calls: list[tuple[str, str]] = []
        self.health_times: list[float] = []
        self.running = 0
        self.max_running = 0

    def signature(self, nonce: str) -> str:
        message = f"{self.engine_id}|{nonce}|{self.generation}".encode()
        return hmac.new(self.signing_key, message, hashlib.sha256).hexdigest()

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.calls.append((request.method, path))
        if self.refuse_connections:
            raise httpx.ConnectError("connection refused", request=request)
        if path == "/health":
            self.health_times.append(trio.current_time())
            self.running += 1
            self.max_running = max(self.max_running, self.running)
            try:
                await trio.sleep(self.health_delay_s)
            finally:
                self.running -= 1
            status = self.health.pop(0) if len(self.health) > 1 else self.health[0]
            return httpx.Response(status)
        if path == "/narwhal/identity":
            if self.identity_error is not None:
                return httpx.Response(503, json={"error": {"message": self.identity_error,
                                                           "type": "ServiceUnavailable", "code": 503}})
            if self.identity_status != 200:
                return httpx.Response(self.identity_status)
            return httpx.Response(200, json={
                "engine_id": self.engine_id, "model": self.model, "generation": self.generation,
                "process_started_at": self.process_started_at, "kv_roles": self.kv_roles})
        if path == "/narwhal/attest":
            nonce = json.loads(request.content)["nonce"] + self.nonce_suffix
            return httpx.Response(200, json={"engine_id": self.attest_engine_id or self.engine_id,
                                             "nonce": nonce, "signature": self.signature(nonce)})
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": m} for m in self.models_listed]})
        return httpx.Response(404)


class World:
    """A fleet of fake engines, the real fleet and control pool, and a Readmitter over them."""

    def __init__(self, *, quarantine_s: float | None = None, probe_interval_s: float = 5.0,
                 key: bytes | None = KEY, engines: tuple[tuple[str, str], ...] = (("p1", "prefill"),
                                                                                 ("d1", "decode"),
                                                                                 ("d2", "decode")),
                 recheck: bool = True, recheck_interval_s: float | None = None) -> None:
        """``recheck=False`` leaves out the recheck of out engines: the probe_interval_s tick alone."""
        self.engines = {name: FakeEngine(name, role) for name, role in engines}
        by_port = {9001 + i: engine for i, engine in enumerate(self.engines.values())}
        self.config = Config(
            fleet=FleetConfig(model="m1", generation="g1"),
            engine=EngineConfig(health_timeout_s=30.0),
            recovery=RecoveryConfig(probe_interval_s=probe_interval_s, failure_quarantine_s=quarantine_s,
                                    recheck_interval_s=recheck_interval_s),
            engines=[EngineSpec(name=name, url=f"http://127.0.0.1:{port}", role=engine.role)
                     for port, (name, engine) in zip(by_port, self.engines.items(), strict=True)])

        async def route(request: httpx.Request) -> httpx.Response:
            return await by_port[request.url.port].handle(request)

        self.pool = ControlPool(control_connections=8, engine_config=self.config.engine,
                                transport=httpx.MockTransport(route))
        self.fleet = Fleet([(spec.name, spec.role) for spec in self.config.engines], eject_after=3,
                           liveness_misses=3, failure_quarantine_s=quarantine_s,
                           probe_interval_s=probe_interval_s)
        self.in_flight = InFlight(self.engines)
        self.metrics = RouterMetrics()
        self.readmitter = Readmitter(config=self.config, fleet=self.fleet, control_pool=self.pool,
                                     in_flight=self.in_flight, metrics=self.metrics, wall_clock=self.wall,
                                     attestation_key=key)
        if not recheck:
            self.readmitter.rechecker.targets = lambda now: []

    def now(self) -> float:
        return trio.current_time()

    def wall(self) -> float:
        return WALL_BASE + trio.current_time()

    def count(self, name: str, outcome: str, check: str) -> float:
        return self.metrics.readmissions.get(name, outcome, check, self.config.model_of(self.config.engine_spec(name)))


def readmission_events(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    lines = [json.loads(record.getMessage()) for record in caplog.records if record.name == "narwhal.events"]
    return [line for line in lines if line["event"] == "readmission"]


@pytest.fixture
def events(caplog: pytest.LogCaptureFixture) -> Callable[[], list[dict[str, Any]]]:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    return lambda: readmission_events(caplog)


# ----- the chain ----------------------------------------------------------------------------


async def test_every_check_passing_returns_an_ejected_engine_to_placement(
        autojump_clock: MockClock, events) -> None:
    world = World()
    world.fleet.eject("d1", "connection streak", world.now())
    assert "d1" not in world.fleet.eligible("decode", world.now())

    result = await world.readmitter.readmit("d1", operator=True)

    assert result.outcome == "readmitted" and result.readmitted
    assert result.check is None
    assert result.passed == FULL_CHAIN
    assert "d1" in world.fleet.eligible("decode", world.now())
    assert not world.fleet.view("d1", world.now()).ejected
    # The chain's calls, in order: health, identity + attestation, models, final health.
    assert world.engines["d1"].calls == [("GET", "/health"), ("GET", "/narwhal/identity"),
                                         ("POST", "/narwhal/attest"), ("GET", "/v1/models"),
                                         ("GET", "/health")]
    [event] = events()
    assert event["engine"] == "d1" and event["outcome"] == "readmitted" and event["check"] is None
    assert event["operator"] is True
    assert world.count("d1", "readmitted", "none") == 1
    last = world.readmitter.admin_state("d1").last_readmission
    assert last is not None and last.outcome == "readmitted"
    assert last.at == world.wall()


def _health_first(e: FakeEngine) -> None:
    e.health = [503]


def _health_unreachable(e: FakeEngine) -> None:
    e.refuse_connections = True


def _health_final(e: FakeEngine) -> None:
    e.health = [200, 503]


def _bad_signature(e: FakeEngine) -> None:
    e.signing_key = b"some other key"


def _wrong_nonce(e: FakeEngine) -> None:
    e.nonce_suffix = "-stale"


def _other_engine_id(e: FakeEngine) -> None:
    e.attest_engine_id = "impostor"


def _identity_missing(e: FakeEngine) -> None:
    e.identity_status = 404


def _wrong_model(e: FakeEngine) -> None:
    e.model = "m2"
    e.models_listed = ["m2"]


def _model_not_listed(e: FakeEngine) -> None:
    e.models_listed = ["m2"]


def _wrong_generation(e: FakeEngine) -> None:
    e.generation = "g2"  # signed correctly for g2: the generation check, not attestation, refuses it


def _decode_not_consumer(e: FakeEngine) -> None:
    e.kv_roles = ["producer"]


def _prefill_not_producer(e: FakeEngine) -> None:
    e.kv_roles = ["consumer"]


# (engine, fault, failed check, words in the reason, checks passed before it)
CASES = [
    ("d1", _health_first, "health", "GET /health answered HTTP 503", []),
    ("d1", _health_unreachable, "health", "connection", []),
    ("d1", _bad_signature, "attestation", "signature does not verify", ["health"]),
    ("d1", _wrong_nonce, "attestation", "did not echo our nonce", ["health"]),
    ("d1", _other_engine_id, "attestation", "'impostor'", ["health"]),
    ("d1", _identity_missing, "attestation", "GET /narwhal/identity answered HTTP 404", ["health"]),
    ("d1", _wrong_model, "model", "names model 'm2'; the engine is configured for model 'm1'",
     ["health", "attestation"]),
    ("d1", _model_not_listed, "model", "/v1/models lists ['m2']", ["health", "attestation"]),
    ("d1", _wrong_generation, "generation", "generation 'g2'; fleet.generation is 'g1'",
     ["health", "attestation", "model"]),
    ("d1", _decode_not_consumer, "kv_role", "needs KV role 'consumer'",
     ["health", "attestation", "model", "generation"]),
    ("p1", _prefill_not_producer, "kv_role", "needs KV role 'producer'",
     ["health", "attestation", "model", "generation"]),
    ("d1", _health_final, "final_health", "GET /health answered HTTP 503",
     ["health", "attestation", "model", "generation", "kv_role"]),
]


@pytest.mark.parametrize(("name", "fault", "check", "words", "passed"), CASES,
                         ids=[f"{c[0]}-{c[2]}-{i}" for i, c in enumerate(CASES)])
async def test_each_check_failing_alone_keeps_the_engine_out_with_its_reason(
        autojump_clock: MockClock, events, name: str, fault: Callable[[FakeEngine], None], check: str,
        words: str, passed: list[str]) -> None:
    world = World()
    world.fleet.eject(name, "liveness", world.now())
    fault(world.engines[name])

    result = await world.readmitter.readmit(name, operator=False)

    assert result.outcome == "refused"
    assert result.check == check
    assert words in result.reason
    assert result.passed == passed
    view = world.fleet.view(name, world.now())
    assert view.ejected and not view.eligible
    # Stopped at the first failure: no final health after an earlier refusal.
    assert world.engines[name].calls.count(("GET", "/health")) == (2 if check == "final_health" else 1)
    [event] = events()
    assert event["engine"] == name and event["outcome"] == "refused"
    assert event["check"] == check and words in event["reason"]
    assert world.count(name, "refused", check) == 1
    last = world.readmitter.admin_state(name).last_readmission
    assert last is not None and (last.outcome, last.check, last.reason) == ("refused", check, result.reason)


async def test_an_engines_own_error_message_is_part_of_the_reason(autojump_clock: MockClock) -> None:
    world = World()
    world.fleet.eject("d1", "liveness", world.now())
    world.engines["d1"].identity_error = "narwhal identity plugin is not configured: NARWHAL_GENERATION is not set"
    result = await world.readmitter.readmit("d1", operator=True)
    assert (result.check, result.reason) == (
        "attestation", "GET /narwhal/identity answered HTTP 503: narwhal identity plugin is not configured: "
                       "NARWHAL_GENERATION is not set")
    world.engines["d1"].identity_error = "x" * 1000
    result = await world.readmitter.readmit("d1", operator=True)
    assert result.reason == "GET /narwhal/identity answered HTTP 503: " + "x" * 200 + "..."


async def test_without_an_attestation_key_nothing_is_readmitted(autojump_clock: MockClock) -> None:
    world = World(key=None)
    world.fleet.eject("d1", "liveness", world.now())
    result = await world.readmitter.readmit("d1", operator=True)
    assert (result.check, result.passed) == ("attestation", ["health"])
    assert "no fleet attestation key" in result.reason
    assert ("POST", "/narwhal/attest") not in world.engines["d1"].calls


async def test_each_attestation_uses_a_fresh_nonce(autojump_clock: MockClock) -> None:
    world = World()
    nonces: list[str] = []
    engine = world.engines["d1"]
    handle = engine.handle

    async def recording(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/narwhal/attest":
            nonces.append(json.loads(request.content)["nonce"])
        return await handle(request)

    engine.handle = recording  # type: ignore[method-assign]
    for _ in range(3):
        assert (await world.readmitter.readmit("d1", operator=True)).readmitted
    assert len(set(nonces)) == 3 and all(len(n) == 32 for n in nonces)


async def test_unknown_engine_is_a_key_error(autojump_clock: MockClock) -> None:
    world = World()
    assert not world.readmitter.knows("nope")
    with pytest.raises(KeyError):
        await world.readmitter.readmit("nope", operator=True)
    with pytest.raises(KeyError):
        world.readmitter.drain("nope", world.now())


def test_the_chain_order_is_the_specs_with_newer_process_after_attestation() -> None:
    assert [str(c) for c in CHAIN] == ["health", "attestation", "newer_process", "model", "generation",
                                       "kv_role", "final_health", "inference"]


# ----- operator drains -----------------------------------------------------------------------


async def test_a_drain_stops_new_placements_and_settles_at_zero_in_flight(autojump_clock: MockClock) -> None:
    world = World()
    world.in_flight.acquire("d1")
    world.in_flight.acquire("d1")
    world.readmitter.drain("d1", world.now())

    assert world.fleet.eligible("decode", world.now()) == ["d2"]
    assert world.readmitter.drained("d1") is False
    world.in_flight.release("d1")
    assert world.readmitter.drained("d1") is False
    world.in_flight.release("d1")
    assert world.readmitter.drained("d1") is True
    assert world.readmitter.admin_state("d1").drained is True
    assert world.readmitter.drained("d2") is False  # idle but not drained


async def test_a_drain_survives_health_successes_and_probe_success(autojump_clock: MockClock) -> None:
    world = World()
    world.readmitter.drain("d1", world.now())
    await trio.sleep(1)
    world.fleet.record_success("d1", SuccessKind.HEALTH_200, world.now())
    world.fleet.record_health_sweep({"p1": True, "d1": True, "d2": True}, world.now())
    world.fleet.record_probe("d1", "success", world.now())
    await trio.sleep(3600)
    kinds = [hold.kind for hold in world.fleet.view("d1", world.now()).holds]
    assert kinds == [HoldKind.OPERATOR_DRAIN]
    assert "d1" not in world.fleet.eligible("decode", world.now())


async def test_a_failed_readmit_leaves_the_drain_and_says_why_a_successful_one_clears_it(
        autojump_clock: MockClock) -> None:
    world = World()
    world.readmitter.drain("d1", world.now())
    world.engines["d1"].generation = "g0"

    refused = await world.readmitter.readmit("d1", operator=True)
    assert (refused.check, refused.outcome) == ("generation", "refused")
    assert [h.kind for h in world.fleet.view("d1", world.now()).holds] == [HoldKind.OPERATOR_DRAIN]
    assert "d1" not in world.fleet.eligible("decode", world.now())

    world.engines["d1"].generation = "g1"
    assert (await world.readmitter.readmit("d1", operator=True)).readmitted
    assert world.fleet.view("d1", world.now()).holds == []
    assert "d1" in world.fleet.eligible("decode", world.now())


async def test_a_drain_added_while_a_readmission_runs_is_not_cleared_by_it(autojump_clock: MockClock) -> None:
    world = World()
    world.fleet.eject("d1", "liveness", world.now())
    world.engines["d1"].health_delay_s = 1.0
    async with trio.open_nursery() as nursery:
        results = []

        async def readmit() -> None:
            results.append(await world.readmitter.readmit("d1", operator=False))

        nursery.start_soon(readmit)
        await trio.sleep(0.5)
        world.readmitter.drain("d1", world.now())
    [result] = results
    assert (result.outcome, result.check) == ("refused", "operator_hold")
    assert "operator_drain began while this readmission ran" in result.reason
    view = world.fleet.view("d1", world.now())
    assert view.ejected and [h.kind for h in view.holds] == [HoldKind.OPERATOR_DRAIN]


# ----- planned maintenance -----------------------------------------------------------------


async def test_maintenance_refuses_an_engine_that_was_not_restarted_and_accepts_a_newer_process(
        autojump_clock: MockClock) -> None:
    world = World()
    await trio.sleep(100)
    started_at = world.readmitter.maintenance("d1", world.now())
    assert started_at == WALL_BASE + 100
    assert world.readmitter.admin_state("d1").maintenance_started_at == started_at
    # /admin/engines hands over the view it already has: the same state (drained, maintenance start, schedule).
    for name in ("d1", "d2", "p1"):
        assert world.readmitter.admin_state(name, world.fleet.view(name, world.now())) == \
            world.readmitter.admin_state(name)
    assert world.readmitter.admin_state("d1").drained is True
    assert "d1" not in world.fleet.eligible("decode", world.now())
    await trio.sleep(30)

    refused = await world.readmitter.readmit("d1", operator=True)
    assert (refused.outcome, refused.check) == ("refused", "newer_process")
    assert refused.passed == ["health", "attestation"]
    assert "not after maintenance began" in refused.reason and "restart the engine" in refused.reason
    assert [h.kind for h in world.fleet.view("d1", world.now()).holds] == [HoldKind.MAINTENANCE]

    # A process that started exactly at the maintenance start is not newer.
    world.engines["d1"].process_started_at = started_at
    assert (await world.readmitter.readmit("d1", operator=True)).check == "newer_process"

    world.engines["d1"].process_started_at = started_at + 20  # restarted during maintenance
    accepted = await world.readmitter.readmit("d1", operator=True)
    assert accepted.readmitted
    assert accepted.passed == ["health", "attestation", "newer_process", "model", "generation", "kv_role",
                               "final_health"]
    assert world.fleet.view("d1", world.now()).holds == []
    assert world.readmitter.admin_state("d1").maintenance_started_at is None


async def test_a_drained_engine_readmitted_as_a_newer_process_is_reported_and_the_same_one_is_not(
        autojump_clock: MockClock) -> None:
    world = World()
    newer: list[str] = []
    world.readmitter.on_newer_process = newer.append
    await trio.sleep(100)
    # Drained, not restarted (its process is older than the drain): the same process, caches and all.
    world.readmitter.drain("p1", world.now())
    assert (await world.readmitter.readmit("p1", operator=True)).readmitted
    assert newer == []
    # Drained again and restarted meanwhile: a newer process, told before it is back in placement.
    world.readmitter.drain("p1", world.now())
    await trio.sleep(10)
    world.engines["p1"].process_started_at = world.wall()
    assert (await world.readmitter.readmit("p1", operator=True)).readmitted
    assert newer == ["p1"]
    # Readmitted again with that same process: nothing new.
    world.readmitter.drain("p1", world.now())
    assert (await world.readmitter.readmit("p1", operator=True)).readmitted
    assert newer == ["p1"]
    # Once attested, any other start is a newer process, whatever the engine's clock says of the drain.
    world.readmitter.drain("p1", world.now())
    world.engines["p1"].process_started_at = WALL_BASE - 7200.0
    assert (await world.readmitter.readmit("p1", operator=True)).readmitted
    assert newer == ["p1", "p1"]


async def test_a_fresh_readmitter_judges_a_newer_process_by_the_drains_start(autojump_clock: MockClock) -> None:
    # No identity attested yet (a router just started or resumed): a process started after the
    # drain began was restarted during it; one started before was not.
    for started_after_drain_s, expected in ((-5.0, []), (5.0, ["d1"])):
        world = World()
        newer: list[str] = []
        world.readmitter.on_newer_process = newer.append
        await trio.sleep(100)
        world.readmitter.drain("d1", world.now())
        world.engines["d1"].process_started_at = world.wall() + started_after_drain_s
        await trio.sleep(10)
        assert (await world.readmitter.readmit("d1", operator=True)).readmitted
        assert newer == expected


async def test_a_refused_attestation_tells_nothing_of_the_process(autojump_clock: MockClock) -> None:
    world = World()
    newer: list[str] = []
    world.readmitter.on_newer_process = newer.append
    world.readmitter.drain("p1", world.now())
    await trio.sleep(10)
    world.engines["p1"].process_started_at = world.wall()
    world.engines["p1"].signing_key = b"not-the-fleet-key"
    assert (await world.readmitter.readmit("p1", operator=True)).check == "attestation"
    assert newer == []


async def test_asking_for_maintenance_again_keeps_the_first_start(autojump_clock: MockClock) -> None:
    world = World()
    first = world.readmitter.maintenance("d1", world.now())
    await trio.sleep(50)
    assert world.readmitter.maintenance("d1", world.now()) == first


def world_with_a_stepping_wall_clock() -> tuple[World, list[float]]:
    """A World whose readmitter's wall clock runs ``stepped[0]`` seconds ahead of the true one."""
    world = World()
    stepped = [0.0]
    world.readmitter.wall_clock = lambda: world.wall() + stepped[0]
    return world, stepped


async def test_the_maintenance_start_is_the_wall_clock_read_when_it_began_whatever_the_clocks_do_after(
        autojump_clock: MockClock) -> None:
    # Seen on a VM: the wall clock ran 2.6 s ahead of the monotonic one in a minute. A start rebuilt as
    # "wall now less the monotonic time since" moved 2.6 s later, and an engine restarted 0.5 s after the
    # maintenance began was refused as not newer.
    world, stepped = world_with_a_stepping_wall_clock()
    await trio.sleep(100)
    started_at = world.readmitter.maintenance("d1", world.now())
    assert started_at == WALL_BASE + 100
    await trio.sleep(0.5)
    world.engines["d1"].process_started_at = world.readmitter.wall_clock()  # restarted now
    stepped[0] = 2.6
    await trio.sleep(60)
    assert world.readmitter.maintenance_started_at("d1") == started_at
    assert world.readmitter.admin_state("d1").maintenance_started_at == started_at
    assert world.readmitter.maintenance("d1", world.now()) == started_at  # asked again: the first start
    assert (await world.readmitter.readmit("d1", operator=True)).readmitted
    # A later maintenance reads the wall clock afresh.
    second = world.readmitter.maintenance("d1", world.now())
    assert second == world.wall() + 2.6


async def test_maintenance_and_drain_survive_a_resume_into_another_process(autojump_clock: MockClock) -> None:
    world = World()
    await trio.sleep(10)
    started_at = world.readmitter.maintenance("d1", world.now())
    world.readmitter.drain("d2", world.now())
    document = msgspec.json.encode(world.fleet.snapshot(world.now(), world.wall()))
    await trio.sleep(60)  # the router is down for a minute

    # The next process: its monotonic clock has another origin; the wall clock is shared.
    def clock() -> float:
        return trio.current_time() + 500.0

    fleet = Fleet([(s.name, s.role) for s in world.config.engines], eject_after=3, liveness_misses=3,
                  failure_quarantine_s=None, probe_interval_s=5.0)
    fleet.restore(msgspec.json.decode(document, type=list[EngineRecord]), clock(), world.wall())
    readmitter = Readmitter(config=world.config, fleet=fleet, control_pool=world.pool,
                            in_flight=world.in_flight, metrics=world.metrics, clock=clock,
                            wall_clock=world.wall, attestation_key=KEY)

    assert readmitter.maintenance_started_at("d1") == pytest.approx(started_at)
    assert fleet.eligible("decode", clock()) == []
    assert readmitter.drained("d1") and readmitter.drained("d2")
    assert (await readmitter.readmit("d1", operator=True)).check == "newer_process"
    world.engines["d1"].process_started_at = world.wall() - 5  # restarted during the outage
    assert (await readmitter.readmit("d1", operator=True)).readmitted
    assert fleet.eligible("decode", clock()) == ["d1"]
    assert [h.kind for h in fleet.view("d2", clock()).holds] == [HoldKind.OPERATOR_DRAIN]


async def test_the_maintenance_start_crosses_a_takeover_as_read_whatever_either_routers_clocks_do(
        autojump_clock: MockClock) -> None:
    # The handoff carries each hold's start as wall time. Converted afresh at every write ("wall now less
    # the monotonic time since"), a start moved with each step of the writer's wall clock, and again with
    # the reader's after a takeover: an engine restarted just after maintenance began could be refused.
    world, stepped = world_with_a_stepping_wall_clock()
    await trio.sleep(100)
    started_at = world.readmitter.maintenance("d1", world.now())
    world.readmitter.drain("d2", world.now())
    drained_at = world.wall()
    await trio.sleep(0.5)
    world.engines["d1"].process_started_at = world.wall()  # restarted half a second later
    stepped[0] = 2.6  # the old router's wall clock steps ahead before its last write
    records = world.fleet.snapshot(world.now(), world.readmitter.wall_clock())
    holds = {h.kind: h.since_wall for record in records for h in record.holds}
    assert holds == {HoldKind.MAINTENANCE: started_at, HoldKind.OPERATOR_DRAIN: drained_at}
    document = msgspec.json.encode(records)
    await trio.sleep(30)

    # The standby: another monotonic origin, and a wall clock 1.7 s behind the old router's true time.
    def clock() -> float:
        return trio.current_time() + 500.0

    def wall() -> float:
        return world.wall() - 1.7

    fleet = Fleet([(s.name, s.role) for s in world.config.engines], eject_after=3, liveness_misses=3,
                  failure_quarantine_s=None, probe_interval_s=5.0)
    fleet.restore(msgspec.json.decode(document, type=list[EngineRecord]), clock(), wall())
    readmitter = Readmitter(config=world.config, fleet=fleet, control_pool=world.pool,
                            in_flight=world.in_flight, metrics=world.metrics, clock=clock,
                            wall_clock=wall, attestation_key=KEY)
    assert readmitter.maintenance_started_at("d1") == started_at
    # Its own writes keep the start as read, whatever its clock reads then.
    again = fleet.snapshot(clock(), wall() + 5.0)
    assert {h.kind: h.since_wall for record in again for h in record.holds} == holds
    assert (await readmitter.readmit("d1", operator=True)).readmitted


# ----- the schedule -----------------------------------------------------------------------------


async def run_schedule(world: World, seconds: float) -> None:
    """Call ``readmit_due`` on every whole second for ``seconds``, as the monitor's readmission stage
    does once a pass, then give the attempts started by the last pass half a second to finish."""
    first = math.floor(trio.current_time()) + 1
    async with trio.open_nursery() as nursery:
        await nursery.start(world.readmitter.run)
        for k in range(int(seconds)):
            await trio.sleep_until(first + k)
            await world.readmitter.readmit_due()
        await trio.sleep(0.5)
        nursery.cancel_scope.cancel()


async def test_an_ejected_engine_is_retried_every_probe_interval_and_never_given_up(
        autojump_clock: MockClock) -> None:
    world = World(probe_interval_s=5.0, recheck=False)
    t0 = trio.current_time()
    world.fleet.eject("d1", "connection streak", t0)
    world.engines["d1"].health = [503]

    await run_schedule(world, 200)
    assert world.engines["d1"].health_times == [t0 + 5 * k for k in range(1, 41)]
    assert world.count("d1", "refused", "health") == 40
    assert world.fleet.view("d1", trio.current_time()).ejected

    # It comes back at the same address: the next attempt readmits it, and the retries stop.
    world.engines["d1"].health = [200]
    await run_schedule(world, 30)
    assert world.engines["d1"].health_times[40:] == [t0 + 205, t0 + 205]  # health and final health
    assert world.fleet.is_eligible("d1", trio.current_time())
    assert world.count("d1", "readmitted", "none") == 1
    last = world.readmitter.last_result("d1")
    assert last is not None and last.operator is False
    # Engines that were never ejected are never tried.
    assert world.engines["p1"].calls == [] and world.engines["d2"].calls == []


async def test_retries_respect_the_quarantine_deadline(autojump_clock: MockClock) -> None:
    world = World(quarantine_s=12.0, probe_interval_s=5.0, recheck=False)
    t0 = trio.current_time()
    world.fleet.eject("d1", "connection streak", t0)
    assert not world.fleet.view("d1", t0).readmission_allowed
    world.engines["d1"].health = [503]

    await run_schedule(world, 25)
    assert world.engines["d1"].health_times == [t0 + 12, t0 + 17, t0 + 22]


async def test_drained_and_maintained_engines_wait_for_the_operator(autojump_clock: MockClock) -> None:
    world = World(probe_interval_s=5.0)
    now = trio.current_time()
    world.fleet.eject("d1", "liveness", now)
    world.readmitter.drain("d1", now)
    world.fleet.eject("p1", "liveness", now)
    world.readmitter.maintenance("p1", now)
    world.readmitter.maintenance("d2", now)

    await run_schedule(world, 60)
    assert all(engine.calls == [] for engine in world.engines.values())
    assert world.readmitter.last_result("d1") is None

    assert (await world.readmitter.readmit("d1", operator=True)).readmitted
    assert world.fleet.is_eligible("d1", trio.current_time())


async def test_attempts_run_concurrently_across_engines_and_one_at_a_time_per_engine(
        autojump_clock: MockClock) -> None:
    world = World(probe_interval_s=5.0, recheck=False)
    t0 = trio.current_time()
    for name in ("d1", "d2"):
        world.fleet.eject(name, "liveness", t0)
        world.engines[name].health = [503]
        world.engines[name].health_delay_s = 12.5  # each attempt outlasts two retry intervals

    await run_schedule(world, 35)
    for name in ("d1", "d2"):
        # Started together at 5; the next only after the previous ended (17.5), at the next pass.
        assert world.engines[name].health_times == [t0 + 5, t0 + 18, t0 + 31]
        assert world.engines[name].max_running == 1


async def test_an_operator_readmit_waits_for_the_automatic_attempt_in_progress(
        autojump_clock: MockClock) -> None:
    world = World(probe_interval_s=5.0, recheck=False)
    t0 = trio.current_time()
    world.fleet.eject("d1", "liveness", t0)
    world.engines["d1"].health_delay_s = 2.0
    async with trio.open_nursery() as nursery:
        await nursery.start(world.readmitter.run)
        await trio.sleep_until(t0 + 5)
        await world.readmitter.readmit_due()
        await trio.sleep(1)
        assert world.readmitter.admin_state("d1").readmission_running is True
        result = await world.readmitter.readmit("d1", operator=True)
        nursery.cancel_scope.cancel()
    # The automatic attempt readmitted it (5..9); the operator's chain ran after it, alone.
    assert result.readmitted and result.operator
    assert world.engines["d1"].health_times == [t0 + 5, t0 + 7, t0 + 9, t0 + 11]
    assert world.engines["d1"].max_running == 1


async def test_an_operator_readmit_does_not_wait_for_the_quarantine(autojump_clock: MockClock) -> None:
    # The chain's health check is a successful health check, which the spec lets end a quarantine.
    world = World(quarantine_s=300.0)
    world.fleet.eject("d1", "refused", world.now(), FailureClass.CONNECTION)
    assert (await world.readmitter.readmit("d1", operator=True)).readmitted
    assert world.fleet.view("d1", world.now()).holds == []


class FakeProbe:
    """Stands in for the supervisor's inference probe: answers in order, the last repeats."""

    def __init__(self, world: World, *outcomes: str) -> None:
        self.world = world
        self.outcomes = list(outcomes)
        self.calls: list[tuple[str, float]] = []

    async def __call__(self, name: str) -> str:
        self.calls.append((name, trio.current_time()))
        outcome = self.outcomes.pop(0) if len(self.outcomes) > 1 else self.outcomes[0]
        # The real probe reports to the fleet; a success clears the quarantine.
        self.world.fleet.record_probe(name, outcome, trio.current_time())  # type: ignore[arg-type]
        return outcome


async def test_an_inference_caused_quarantine_is_cleared_only_by_the_chain_ending_in_a_probe(
        autojump_clock: MockClock, nursery: trio.Nursery) -> None:
    world = World(quarantine_s=300.0, probe_interval_s=5.0)
    probe = FakeProbe(world, "failed", "failed", "success")
    world.readmitter = Readmitter(config=world.config, fleet=world.fleet, control_pool=world.pool,
                                  in_flight=world.in_flight, metrics=world.metrics, wall_clock=world.wall,
                                  attestation_key=KEY, inference_check=probe)
    await nursery.start(world.readmitter.run)
    world.fleet.eject("d1", "decode probe leg failed: HTTP 500", world.now(), FailureClass.INFERENCE_STATUS)
    # Health answers 200 all along; it must not end this quarantine.
    world.fleet.record_success("d1", SuccessKind.HEALTH_200, world.now())
    for _ in range(4):
        await trio.sleep(5.0)
        await world.readmitter.readmit_due()
        await trio.sleep(0.1)
    # Attempts every probe_interval_s, each ending in a probe; the third probe passed.
    assert [t for _, t in probe.calls] == pytest.approx([5.0, 10.1, 15.2])
    assert world.count("d1", "refused", "inference") == 2
    view = world.fleet.view("d1", world.now())
    assert not view.ejected and view.holds == []


async def test_without_a_probe_an_inference_caused_quarantine_waits_for_its_deadline(
        autojump_clock: MockClock, nursery: trio.Nursery) -> None:
    world = World(quarantine_s=30.0, probe_interval_s=5.0)
    await nursery.start(world.readmitter.run)
    world.fleet.eject("d1", "decode failed", world.now(), FailureClass.STREAM)
    for _ in range(5):
        await trio.sleep(5.0)
        world.fleet.record_success("d1", SuccessKind.HEALTH_200, world.now())
        await world.readmitter.readmit_due()
    assert world.fleet.view("d1", world.now()).ejected
    await trio.sleep(10.0)
    await world.readmitter.readmit_due()
    await trio.sleep(0.1)
    assert not world.fleet.view("d1", world.now()).ejected


async def test_readmit_due_needs_the_running_readmitter(autojump_clock: MockClock) -> None:
    world = World()
    with pytest.raises(RuntimeError, match="Readmitter.run"):
        await world.readmitter.readmit_due()


async def test_a_readmission_health_200_counts_as_a_successful_health_response(autojump_clock: MockClock) -> None:
    # Spec: "Any successful health response resets that counter" — the chain's own included.
    world = World(key=None)
    world.fleet.record_health_sweep({}, world.now())
    assert world.fleet.view("d1", world.now()).liveness_misses == 1
    result = await world.readmitter.readmit("d1", operator=True)
    assert result.passed == ["health"]
    assert world.fleet.view("d1", world.now()).liveness_misses == 0


@pytest.mark.parametrize(("status", "readmitted"), [(200, True), (204, True), (302, False), (404, False),
                                                    (429, False), (503, False)])
async def test_the_chains_health_checks_use_the_one_status_table(
        autojump_clock: MockClock, status: int, readmitted: bool) -> None:
    # As the health stage: any 2xx is a successful health response (issue 10, rule 4).
    world = World()
    world.fleet.eject("d1", "refused", world.now(), FailureClass.CONNECTION)
    world.engines["d1"].health = [status]
    result = await world.readmitter.readmit("d1", operator=True)
    assert result.readmitted is readmitted
    if not readmitted:
        assert result.check == "health" and str(status) in result.reason


# ----- engine-supplied strings are bounded (issue 19 item 13) ---------------------------------

HUGE = 3_500_000


def _huge_engine_id(e: FakeEngine) -> None:
    e.engine_id = "x" * HUGE


def _huge_model(e: FakeEngine) -> None:
    e.model = "m" * 10_000


def _huge_generation(e: FakeEngine) -> None:
    e.generation = "g" * 2_000


def _many_long_model_ids(e: FakeEngine) -> None:
    e.models_listed = ["n" * 900 + str(i) for i in range(200)]


def _long_kv_roles(e: FakeEngine) -> None:
    e.kv_roles = ["r" * 20 for _ in range(7)]


def _foreign_attest_engine_id(e: FakeEngine) -> None:
    e.attest_engine_id = "y" * 3000


@pytest.mark.parametrize(("knob", "check", "words"), [
    (_huge_engine_id, "attestation", "refused unread"),
    (_huge_model, "attestation", "model is 10000 characters long, more than 1024"),
    (_huge_generation, "attestation", "generation is 2000 characters long"),
    (_many_long_model_ids, "model", "(200 in all)"),
    (_long_kv_roles, "kv_role", "engine reports kv_roles"),
    (_foreign_attest_engine_id, "attestation", "(3000 characters)"),
])
async def test_engine_supplied_strings_are_bounded_in_the_reason_the_log_and_the_admin_view(
        autojump_clock: MockClock, caplog: pytest.LogCaptureFixture, knob, check, words) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    world = World()
    knob(world.engines["d1"])
    world.fleet.eject("d1", "connection streak", world.now())
    result = await world.readmitter.readmit("d1", operator=True)
    assert result.outcome == "refused" and result.check == check
    assert words in result.reason and len(result.reason) <= 1100
    # What the log line and /admin/engines/d1 carry.
    [line] = [r.getMessage() for r in caplog.records if r.name == "narwhal.events" and '"readmission"' in
              r.getMessage()]
    assert len(line) < 2000
    shown = msgspec.json.encode(world.readmitter.admin_state("d1"))
    assert len(shown) < 2000


async def test_an_identity_document_over_the_bound_is_refused_before_decoding(autojump_clock: MockClock) -> None:
    world = World()
    world.engines["d1"].kv_roles = ["consumer"] + ["z"] * 20_000  # small strings, a large document
    world.fleet.eject("d1", "connection streak", world.now())
    result = await world.readmitter.readmit("d1", operator=True)
    assert result.check == "attestation"
    assert "identity document is" in result.reason and "more than 16384" in result.reason


# ----- several models: an engine is checked against its own model ---------------------------------------


def two_models(world: World) -> tuple[Readmitter, Fleet]:
    """The world's engines with p2 and d2 serving model m2 (generation g2 from its [[fleet.models]] entry)."""
    engines = [spec if spec.name not in ("p2", "d2") else msgspec.structs.replace(spec, model="m2")
               for spec in world.config.engines]
    config = msgspec.structs.replace(world.config, engines=engines, fleet=msgspec.structs.replace(
        world.config.fleet, models=[ModelConfig(name="m2", generation="g2")]))
    fleet = Fleet([(spec.name, spec.role, config.model_of(spec)) for spec in config.engines], eject_after=3,
                  liveness_misses=3, failure_quarantine_s=None, probe_interval_s=5.0)
    readmitter = Readmitter(config=config, fleet=fleet, control_pool=world.pool,  # type: ignore[arg-type]
                            in_flight=world.in_flight, metrics=world.metrics, wall_clock=world.wall,
                            attestation_key=KEY)
    return readmitter, fleet


async def test_an_engine_of_model_b_is_checked_against_b_and_bs_generation(autojump_clock: MockClock) -> None:
    world = World(engines=(("p1", "prefill"), ("d1", "decode"), ("p2", "prefill"), ("d2", "decode")))
    readmitter, fleet = two_models(world)
    fleet.eject("d2", "liveness", world.now())
    # d2 still serves m1 (the fleet's [fleet] model): refused by the model check, naming both models.
    result = await readmitter.readmit("d2", operator=False)
    assert (result.outcome, result.check) == ("refused", "model")
    assert "'m1'" in result.reason and "'m2'" in result.reason
    assert world.metrics.readmissions.get("d2", "refused", "model", "m2") == 1
    # m2 now, but generation g1: m2's generation is g2, from its [[fleet.models]] entry.
    engine = world.engines["d2"]
    engine.model, engine.models_listed = "m2", ["m2"]
    result = await readmitter.readmit("d2", operator=False)
    assert (result.outcome, result.check) == ("refused", "generation")
    assert "'g2'" in result.reason
    engine.generation = "g2"
    result = await readmitter.readmit("d2", operator=False)
    assert result.outcome == "readmitted"
    assert fleet.eligible("decode", world.now(), "m2") == ["d2"]
    # Model m1's engines keep the fleet's model and generation.
    fleet.eject("d1", "liveness", world.now())
    assert (await readmitter.readmit("d1", operator=False)).outcome == "readmitted"
