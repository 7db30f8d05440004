"""The monitor's stages against a real Supervisor and Fleet, with a fake control pool.

The control pool is an object with ``async get()``, so each engine's health
answer (200, another status, a transport failure, a hang) is chosen per test;
times are virtual and exact.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
from trio.testing import MockClock

from narwhal.config import Config, ControllerConfig, EngineConfig, EngineSpec, TelemetryConfig
from narwhal.control.fleet_writer import FleetWriter
from narwhal.control.monitor import STAGE_NAMES, Monitor
from narwhal.control.supervisor import Supervisor
from narwhal.errors import EngineFailure, FailureClass, PoolSaturated
from narwhal.fleet import Fleet, HoldKind
from narwhal.fleet.admission import Admission
from narwhal.fleet.placement import InFlight
from narwhal.fleet.telemetry import Telemetry
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.pools.control import ControlResponse
from narwhal.stages import build_stages, health_check_timeout_s
from narwhal.stages.controller import ControllerStage
from narwhal.stages.drain import DrainStage
from narwhal.stages.health import HealthStage
from narwhal.stages.liveness import LivenessStage
from narwhal.stages.readmission import ReadmissionStage
from narwhal.stages.rollover import RolloverStage
from narwhal.stages.telemetry import TelemetryStage

NAMES = [("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"), ("d2", "decode"), ("d3", "decode")]
CHECK_TIMEOUT_S = 1.5
LIVENESS_MISSES = 3


def make_config(**sections: Any) -> Config:
    engines = [EngineSpec(name=name, url=f"http://127.0.0.1:{9001 + i}", role=role)
               for i, (name, role) in enumerate(NAMES)]
    return Config(engines=engines, **sections)


class FakeControlPool:
    """Answers GET /health per engine: "ok", a status code, an exception to raise, or "hang".

    Inference probes (POST) hang: a probe the supervisor starts stays in flight.
    """

    def __init__(self, **answers: Any) -> None:
        self.answers = answers
        self.calls: list[tuple[str, str, float | None, float]] = []

    async def get(self, engine: EngineSpec, path: str, *, timeout_s: float | None = None,
                  caller_deadline: float = float("inf")) -> ControlResponse:
        self.calls.append((engine.name, path, timeout_s, trio.current_time()))
        answer = self.answers.get(engine.name, "ok")
        if answer == "hang":
            await trio.sleep_forever()
        if isinstance(answer, Exception):
            raise answer
        return ControlResponse(status=200 if answer == "ok" else answer, body=b"")

    async def post_json(self, engine: EngineSpec, path: str, body: bytes, *,
                        timeout_s: float | None = None) -> ControlResponse:
        await trio.sleep_forever()
        raise AssertionError("unreachable")


@contextlib.asynccontextmanager
async def running(supervisor: Supervisor) -> AsyncIterator[None]:
    """The supervisor's probe nursery, open for the block (as the router keeps it)."""
    async with trio.open_nursery() as nursery:
        await nursery.start(supervisor.run)
        yield
        nursery.cancel_scope.cancel()


class Rig:
    """A real fleet and supervisor, the health and liveness stages, over a fake pool."""

    def __init__(self, pool: FakeControlPool) -> None:
        self.config = make_config()
        self.fleet = Fleet([(spec.name, spec.role) for spec in self.config.engines], eject_after=3,
                           liveness_misses=LIVENESS_MISSES, failure_quarantine_s=None, probe_interval_s=5.0)
        metrics = RouterMetrics()
        self.supervisor = Supervisor(config=self.config, fleet=FleetWriter(self.fleet, metrics), control_pool=pool,
                                     metrics=metrics)
        self.health = HealthStage(supervisor=self.supervisor, control_pool=pool, engines=self.config.engines,
                                  check_timeout_s=CHECK_TIMEOUT_S)
        self.liveness = LivenessStage(supervisor=self.supervisor, health=self.health)

    def view(self, name: str):
        return self.fleet.view(name, trio.current_time())


def events(caplog: pytest.LogCaptureFixture, event: str) -> list[dict]:
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "narwhal.events"]
    return [line for line in lines if line["event"] == event]


@pytest.fixture(autouse=True)
def _capture_events(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")


# -- health ------------------------------------------------------------------------------


async def test_one_sweep_checks_all_engines_concurrently_each_bounded(autojump_clock: MockClock) -> None:
    pool = FakeControlPool(p2="hang", d1=503,
                           d2=EngineFailure("d2", FailureClass.CONNECTION, "refused"), d3=429)
    rig = Rig(pool)
    async with running(rig.supervisor):
        await rig.health.run(7)
        # All five asked at once; the hang is cut at the check timeout, which ends the sweep.
        assert sorted(pool.calls) == sorted((name, "/health", CHECK_TIMEOUT_S, 0.0) for name, _ in NAMES)
        assert trio.current_time() == CHECK_TIMEOUT_S
        assert rig.health.sweep is not None and rig.health.sweep.pass_number == 7
        assert rig.health.sweep.results == {"p1": True, "p2": False, "d1": False, "d2": False, "d3": False}
        # Each failure is evidence of its class.
        evidence = {name: {str(k): v for k, v in rig.view(name).evidence.items() if v} for name, _ in NAMES}
        assert evidence == {"p1": {}, "p2": {"timeout": 1}, "d1": {"inference_status": 1},
                            "d2": {"connection": 1}, "d3": {"overload": 1}}


async def test_failed_health_checks_are_logged(autojump_clock: MockClock, caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig(FakeControlPool(p2="hang", d1=404))
    async with running(rig.supervisor):
        await rig.health.run(1)
        failed = {line["engine"]: (line["failure_class"], line["reason"])
                  for line in events(caplog, "health_check_failed")}
        assert failed == {"p2": ("timeout", "no health answer within 1.5 s"), "d1": (None, "HTTP 404")}


async def test_no_control_slot_is_no_answer_but_no_evidence_against_the_engine(autojump_clock: MockClock) -> None:
    rig = Rig(FakeControlPool(d1=PoolSaturated("no free control pool connection before the request deadline")))
    async with running(rig.supervisor):
        await rig.health.run(1)
        assert "d1" not in rig.health.sweep.results
        assert rig.health.sweep.unchecked == {"d1"}
        assert not any(rig.view("d1").evidence.values())


async def test_a_full_control_pool_never_counts_as_engine_silence(autojump_clock: MockClock) -> None:
    # Hung engines can hold every control slot; the healthy engine left without a slot
    # must not be ejected for a silence that was ours.
    rig = Rig(FakeControlPool(d1=PoolSaturated("no free control pool connection")))
    async with running(rig.supervisor):
        for number in range(1, LIVENESS_MISSES + 2):
            await rig.health.run(number)
            await rig.liveness.run(number)
        view = rig.view("d1")
        assert view.liveness_misses == 0 and not view.ejected and view.eligible


# One table for every status (narwhal.pools.classify): the health stage used to have its
# own rule, which disagreed on 1xx/3xx (no evidence) and 204 (not a success).
@pytest.mark.parametrize(("status", "healthy", "evidence"), [
    (200, True, {"inference_status": 1}),     # health 200 does not clear inference_status
    (204, True, {"inference_status": 1}),
    (101, False, {"inference_status": 2}),
    (302, False, {"inference_status": 2}),
    (404, False, {}),                        # the clearing table's 4xx row clears inference_status
    (408, False, {"inference_status": 1, "overload": 1}),
    (429, False, {"inference_status": 1, "overload": 1}),
    (500, False, {"inference_status": 2}),
    (503, False, {"inference_status": 2}),
])
async def test_health_statuses_are_classified_by_the_one_table(
        autojump_clock: MockClock, status: int, healthy: bool, evidence: dict[str, int]) -> None:
    rig = Rig(FakeControlPool(d1=status))
    async with running(rig.supervisor):
        rig.supervisor.record_failure("d1", FailureClass.INFERENCE_STATUS)
        await rig.health.run(1)
        assert rig.health.sweep is not None
        assert rig.health.sweep.results["d1"] is healthy
        assert {str(k): v for k, v in rig.view("d1").evidence.items() if v} == evidence
        # Whatever the status, the engine answered: it is not silent.
        assert ("d1" in rig.health.sweep.answered) is (not healthy)


async def test_an_engine_that_answers_5xx_is_not_silent_and_never_ejected_for_liveness(
        autojump_clock: MockClock) -> None:
    rig = Rig(FakeControlPool(d1=503, d2="hang"))
    async with running(rig.supervisor):
        for number in range(1, 2 * LIVENESS_MISSES):
            await rig.health.run(number)
            await rig.liveness.run(number)
        assert rig.view("d1").liveness_misses == 0 and not rig.view("d1").ejected
        assert rig.view("d2").ejected  # no HTTP answer within the timeout: silent


async def test_a_health_200_clears_its_row_of_the_evidence_table(autojump_clock: MockClock) -> None:
    rig = Rig(FakeControlPool())
    async with running(rig.supervisor):
        for failure_class in (FailureClass.CONNECTION, FailureClass.TIMEOUT, FailureClass.OVERLOAD,
                              FailureClass.INFERENCE_STATUS):
            rig.supervisor.record_failure("p1", failure_class)
        await rig.health.run(1)
        # Health 200 clears connection, timeout and overload; not inference_status.
        assert {str(k): v for k, v in rig.view("p1").evidence.items() if v} == {"inference_status": 1}


# -- liveness ----------------------------------------------------------------------------


async def test_liveness_misses_count_silent_sweeps_and_eject_at_the_limit(autojump_clock: MockClock) -> None:
    pool = FakeControlPool(d3="hang", d2=503)
    rig = Rig(pool)
    async with running(rig.supervisor):
        for number in range(1, LIVENESS_MISSES):
            await rig.health.run(number)
            await rig.liveness.run(number)
            assert rig.view("d3").liveness_misses == number and not rig.view("d3").ejected
        # d2 answers again: any successful health response resets its counter.
        pool.answers["d2"] = "ok"
        await rig.health.run(LIVENESS_MISSES)
        await rig.liveness.run(LIVENESS_MISSES)
        assert rig.view("d2").liveness_misses == 0 and not rig.view("d2").ejected
        assert rig.view("d3").ejected
        assert rig.view("d3").ejected_reason == "3 consecutive silent health sweeps (liveness_misses 3)"
        assert rig.fleet.eligible("decode", trio.current_time()) == ["d1", "d2"]
        assert rig.liveness.sweeps_applied == LIVENESS_MISSES


async def test_liveness_gives_no_evidence_when_this_pass_has_no_complete_sweep(
        autojump_clock: MockClock, caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig(FakeControlPool(d3="hang"))
    async with running(rig.supervisor):
        await rig.liveness.run(1)                        # no sweep at all yet
        await rig.health.run(1)
        await rig.liveness.run(2)                        # the sweep is from another pass
        assert all(rig.view(name).liveness_misses == 0 for name, _ in NAMES)
        assert rig.liveness.sweeps_skipped == 2
        assert [line["pass"] for line in events(caplog, "liveness_skipped")] == [1, 2]


# -- drain -------------------------------------------------------------------------------


async def test_a_drain_settles_once_nothing_is_in_flight(autojump_clock: MockClock,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    fleet = Fleet(NAMES, eject_after=3, liveness_misses=3, failure_quarantine_s=None, probe_interval_s=5.0)
    in_flight = InFlight([name for name, _ in NAMES])
    drain = DrainStage(fleet=fleet, in_flight=in_flight)
    in_flight.acquire("d1")
    in_flight.acquire("d2")
    fleet.add_hold("d1", HoldKind.OPERATOR_DRAIN, "operator", 0.0)
    fleet.add_hold("p1", HoldKind.MAINTENANCE, "maintenance", 0.0)
    await drain.run(1)
    assert drain.drained == {"p1"}                   # d1 still has a request in flight; d2 is not draining
    in_flight.release("d1")
    await drain.run(2)
    await drain.run(3)
    assert drain.drained == {"p1", "d1"}
    assert [(e["engine"], e["holds"]) for e in events(caplog, "engine_drained")] == [
        ("p1", ["maintenance"]), ("d1", ["operator_drain"])]
    fleet.clear_hold("d1", HoldKind.OPERATOR_DRAIN, 1.0)
    await drain.run(4)
    assert drain.drained == {"p1"}


# -- rollover, telemetry, readmission ----------------------------------------------------


async def test_rollover_closes_intervals_and_telemetry_publishes_them(autojump_clock: MockClock) -> None:
    telemetry = Telemetry(NAMES, interval_s=10.0, keep_intervals=3, clock=trio.current_time)
    metrics = RouterMetrics()
    rollover = RolloverStage(telemetry=telemetry)
    publisher = TelemetryStage(telemetry=telemetry, metrics=metrics)
    await rollover.run(1)
    await publisher.run(1)
    assert publisher.published is None
    telemetry.record_request(prefill="p1", decode="d1", ttft_s=0.25, inter_token_s=0.5, error_engine="d1")
    await trio.sleep(10.0)
    await rollover.run(2)
    await publisher.run(2)
    assert publisher.published is telemetry.latest() and publisher.published.end == 10.0
    text = metrics.render()
    assert 'narwhal_engine_interval_time_to_first_token_seconds{engine="p1",quantile="0.5",model=""} 0.25' in text
    assert 'narwhal_engine_interval_inter_token_seconds{engine="d1",quantile="0.9",model=""} 0.5' in text
    assert 'narwhal_engine_interval_requests{engine="d1",model=""} 1' in text
    assert 'narwhal_engine_interval_errors{engine="d1",model=""} 1' in text
    assert 'narwhal_engine_interval_errors{engine="p2",model=""} 0' in text
    assert 'engine="p2",quantile' not in text       # no samples, no latency series
    assert publisher.publish() is False              # nothing new since


async def test_readmission_starts_due_probes_then_runs_the_readmission_hook() -> None:
    calls: list[str] = []

    class FakeSupervisor:
        def start_due_probes(self) -> None:
            calls.append("start_due_probes")

    class FakeReadmission:
        async def readmit_due(self) -> None:
            await trio.sleep(0)
            calls.append("readmit_due")

    await ReadmissionStage(supervisor=FakeSupervisor()).run(1)
    await ReadmissionStage(supervisor=FakeSupervisor(), readmission=FakeReadmission()).run(2)
    assert calls == ["start_due_probes", "start_due_probes", "readmit_due"]


async def test_readmission_stage_hands_out_the_fleets_due_reprobes(autojump_clock: MockClock) -> None:
    rig = Rig(FakeControlPool())
    async with running(rig.supervisor):
        for _ in range(3):
            rig.supervisor.record_failure("d1", FailureClass.STREAM)
        rig.fleet.record_probe("d1", "inconclusive", trio.current_time(), reason="no peer")
        assert rig.view("d1").next_probe_at == 5.0
        stage = ReadmissionStage(supervisor=rig.supervisor)
        await stage.run(1)
        assert rig.view("d1").next_probe_at == 5.0       # not due yet
        await trio.sleep(5.0)
        await stage.run(2)
        assert rig.view("d1").next_probe_at is None and rig.view("d1").probe_in_flight


# -- build_stages and the monitor over the real stages -------------------------------------


class FakePersistence:
    name = "persistence"

    def __init__(self) -> None:
        self.passes: list[int] = []

    async def run(self, pass_number: int) -> None:
        self.passes.append(pass_number)


def build(pool: FakeControlPool, config: Config) -> tuple[list[Any], Supervisor, Telemetry]:
    fleet = Fleet([(spec.name, spec.role) for spec in config.engines], eject_after=3,
                  liveness_misses=LIVENESS_MISSES, failure_quarantine_s=None, probe_interval_s=5.0)
    metrics = RouterMetrics()
    supervisor = Supervisor(config=config, fleet=FleetWriter(fleet, metrics), control_pool=pool, metrics=metrics)
    telemetry = Telemetry([(s.name, s.role) for s in config.engines], clock=trio.current_time,
                          interval_s=config.telemetry.interval_s,
                          keep_intervals=config.telemetry.keep_intervals)
    stages = build_stages(config=config, supervisor=supervisor, control_pool=pool, telemetry=telemetry,
                          in_flight=InFlight([s.name for s in config.engines]),
                          persistence_stage=FakePersistence())
    return stages.in_spec_order(), supervisor, telemetry


def test_build_stages_returns_the_eight_in_spec_order() -> None:
    stages, _, _ = build(FakeControlPool(), make_config())
    assert tuple(stage.name for stage in stages) == STAGE_NAMES
    assert isinstance(stages[-1], FakePersistence)


def test_build_stages_names_each_stage_by_its_job() -> None:
    config = make_config()
    pool = FakeControlPool()
    fleet = Fleet([(spec.name, spec.role) for spec in config.engines], eject_after=3,
                  liveness_misses=LIVENESS_MISSES, failure_quarantine_s=None, probe_interval_s=5.0)
    metrics = RouterMetrics()
    supervisor = Supervisor(config=config, fleet=FleetWriter(fleet, metrics), control_pool=pool, metrics=metrics)
    telemetry = Telemetry([(s.name, s.role) for s in config.engines], clock=trio.current_time,
                          interval_s=config.telemetry.interval_s, keep_intervals=config.telemetry.keep_intervals)
    persistence = FakePersistence()
    stages = build_stages(config=config, supervisor=supervisor, control_pool=pool, telemetry=telemetry,
                          in_flight=InFlight([s.name for s in config.engines]), persistence_stage=persistence)
    for name in STAGE_NAMES:
        assert getattr(stages, name).name == name
    assert isinstance(stages.controller, ControllerStage) and isinstance(stages.drain, DrainStage)
    assert stages.persistence is persistence
    assert stages.liveness.health is stages.health


def test_health_checks_are_capped_inside_the_stage_timeout() -> None:
    assert health_check_timeout_s(make_config()) == pytest.approx(1.6)            # defaults: both 2.0 s
    config = make_config(engine=EngineConfig(health_timeout_s=0.5))
    assert health_check_timeout_s(config) == 0.5


async def test_a_hanging_engine_is_its_own_timeout_not_a_health_stage_error(autojump_clock: MockClock) -> None:
    config = make_config(controller=ControllerConfig(monitor_failure_limit=1),
                         telemetry=TelemetryConfig(interval_s=1.0, keep_intervals=3))
    pool = FakeControlPool(d3="hang")
    stages, supervisor, telemetry = build(pool, config)
    async with running(supervisor):
        admission = Admission()
        monitor = Monitor(stages, interval_s=config.controller.monitor_interval_s,
                          stage_timeout_s=config.controller.stage_timeout_s,
                          failure_limit=config.controller.monitor_failure_limit,
                          admission=admission, metrics=supervisor.metrics)
        for _ in range(LIVENESS_MISSES):
            result = await monitor.run_pass()
            assert result.ok, result.errors
            assert result.finished_at - result.started_at == pytest.approx(1.6)
        assert admission.reason() is None
        assert supervisor.fleet.view("d3", trio.current_time()).ejected
        assert stages[-1].passes == [1, 2, 3]
        assert len(telemetry.closed_intervals()) == 2    # opened in pass 1, closed in passes 2 and 3
