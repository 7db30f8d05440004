"""The monitor pass at fleet scale on MockClock: concurrency bounded by the control pool, no per-check O(N) work.

256 engines behind the real control pool (an httpx MockTransport answers every
``GET /health`` after 0.1 virtual seconds), the real supervisor, fleet writer
and health/liveness stages. Times are virtual and exact.
"""

from __future__ import annotations

import httpx
import msgspec
import pytest
import trio
from trio.testing import MockClock

from narwhal.config import Config, ControllerConfig, EngineConfig, EngineSpec, RunningConfig
from narwhal.control.fleet_writer import FleetWriter
from narwhal.control.monitor import Monitor
from narwhal.control.supervisor import Supervisor
from narwhal.fleet import Fleet
from narwhal.fleet.admission import Admission
from narwhal.fleet.placement import InFlight
from narwhal.fleet.telemetry import Telemetry
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.pools.control import ControlPool
from narwhal.stages import build_stages
from narwhal.stages import health as health_module
from narwhal.stages.health import HealthStage
from narwhal.stages.liveness import LivenessStage

ENGINES = 256
SLOTS = 16
ANSWER_S = 0.1


async def test_a_pass_over_256_engines_checks_them_16_at_a_time_and_never_wakes_the_publisher(
        autojump_clock: MockClock) -> None:
    config = Config(engines=[EngineSpec(name=f"e{i}", url=f"http://127.0.0.1:{10000 + i}",
                                        role="prefill" if i % 4 == 0 else "decode") for i in range(ENGINES)],
                    engine=EngineConfig(control_connections=SLOTS, health_timeout_s=30.0))
    in_flight = 0
    most = 0
    answered: list[str] = []

    async def health(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        await trio.sleep(ANSWER_S)
        in_flight -= 1
        answered.append(str(request.url.port))
        return httpx.Response(200)

    pool = ControlPool(control_connections=SLOTS, engine_config=config.engine,
                       transport=httpx.MockTransport(health))
    metrics = RouterMetrics()
    changes: list[int] = []
    fleet = FleetWriter(Fleet([(spec.name, spec.role) for spec in config.engines], eject_after=3,
                              liveness_misses=3, failure_quarantine_s=None, probe_interval_s=5.0),
                        metrics, on_change=lambda: changes.append(1))
    supervisor = Supervisor(config=config, fleet=fleet, control_pool=pool, metrics=metrics)
    stage = HealthStage(supervisor=supervisor, control_pool=pool, engines=config.engines, check_timeout_s=30.0)
    monitor = Monitor([stage, LivenessStage(supervisor=supervisor, health=stage)], interval_s=5.0,
                      stage_timeout_s=60.0, failure_limit=3, admission=Admission(clock=trio.current_time),
                      metrics=metrics)
    try:
        for number in (1, 2):
            result = await monitor.run_pass()
            assert result.ok
            # All at once up to the control pool's bound, never past it: 256 / 16 waves of 0.1 s.
            assert most == SLOTS
            assert abs(result.finished_at - result.started_at - ENGINES / SLOTS * ANSWER_S) < 1e-9
            assert len(answered) == number * ENGINES
            assert stage.sweep is not None and all(stage.sweep.results.values())
        # Healthy engines answering change nothing placement sees: the snapshot publisher was never woken
        # (it was once per answer, each time rebuilding every engine's placement content).
        assert changes == []
    finally:
        await pool.aclose()


def _fleet_config(answer_timeout_s: float) -> Config:
    return Config(engines=[EngineSpec(name=f"e{i}", url=f"http://127.0.0.1:{10000 + i}",
                                      role="prefill" if i % 4 == 0 else "decode") for i in range(ENGINES)],
                  engine=EngineConfig(control_connections=SLOTS, health_timeout_s=answer_timeout_s),
                  controller=ControllerConfig(stage_timeout_s=60.0))


def _supervised(config: Config, pool: ControlPool) -> Supervisor:
    metrics = RouterMetrics()
    fleet = FleetWriter(Fleet([(spec.name, spec.role) for spec in config.engines], eject_after=3,
                              liveness_misses=3, failure_quarantine_s=None, probe_interval_s=5.0), metrics)
    return Supervisor(config=config, fleet=fleet, control_pool=pool, metrics=metrics)


class _NoPersistence:
    name = "persistence"

    async def run(self, pass_number: int) -> None:
        """Nothing to write here: only the health stage runs."""


def _wired_health(config: Config, pool: ControlPool) -> HealthStage:
    """The health stage as the router builds it (``build_stages``)."""
    supervisor = _supervised(config, pool)
    telemetry = Telemetry([(s.name, s.role) for s in config.engines], clock=trio.current_time,
                          interval_s=config.telemetry.interval_s, keep_intervals=config.telemetry.keep_intervals)
    stages = build_stages(config=config, supervisor=supervisor, control_pool=pool, telemetry=telemetry,
                          in_flight=InFlight([s.name for s in config.engines]), persistence_stage=_NoPersistence())
    return stages.health


async def test_as_wired_the_sweep_takes_the_engines_in_turn_and_no_check_parks_on_the_pool(
        autojump_clock: MockClock) -> None:
    config = _fleet_config(30.0)
    pool: ControlPool
    in_flight = most = most_waiting = 0

    async def health(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, most, most_waiting
        in_flight += 1
        most = max(most, in_flight)
        most_waiting = max(most_waiting, pool.statistics().waiting)
        await trio.sleep(ANSWER_S)
        in_flight -= 1
        return httpx.Response(200)

    pool = ControlPool(control_connections=SLOTS, engine_config=config.engine,
                       transport=httpx.MockTransport(health))
    stage = _wired_health(config, pool)
    assert stage.parallel == SLOTS
    try:
        started = trio.current_time()
        await stage.run(1)
        # The same waves as a task per engine (256 / 16 of 0.1 s), every engine checked...
        assert trio.current_time() - started == pytest.approx(ENGINES / SLOTS * ANSWER_S)
        assert most == SLOTS
        assert stage.sweep is not None and len(stage.sweep.results) == ENGINES and all(stage.sweep.results.values())
        # ... by 16 tasks taking turns: none ever waited for a slot of the control pool.
        assert most_waiting == 0
    finally:
        await pool.aclose()


@pytest.mark.parametrize("parallel", [None, SLOTS], ids=["a-task-per-engine", "in-turn"])
async def test_engines_whose_turn_never_came_are_unchecked_not_failed(
        autojump_clock: MockClock, parallel: int | None, monkeypatch) -> None:
    """The first 16 engines hang: they time out (evidence); the rest find our pool busy to the deadline (none)."""
    config = _fleet_config(1.0)
    skipped: list[str] = []
    monkeypatch.setattr(health_module, "log_event",
                        lambda event, **fields: skipped.append(fields["engine"])
                        if event == "health_check_skipped" else None)

    async def health(request: httpx.Request) -> httpx.Response:
        if request.url.port is not None and request.url.port < 10000 + SLOTS:
            await trio.sleep_forever()
        return httpx.Response(200)

    pool = ControlPool(control_connections=SLOTS, engine_config=config.engine,
                       transport=httpx.MockTransport(health))
    stage = HealthStage(supervisor=_supervised(config, pool), control_pool=pool, engines=config.engines,
                        check_timeout_s=1.0, parallel=parallel)
    try:
        started = trio.current_time()
        await stage.run(1)
        assert trio.current_time() - started == pytest.approx(1.0)
        sweep = stage.sweep
        assert sweep is not None
        hung = {f"e{i}" for i in range(SLOTS)}
        assert {name for name, ok in sweep.results.items() if not ok} == hung
        assert sweep.unchecked == {f"e{i}" for i in range(SLOTS, ENGINES)}
        assert sorted(skipped) == sorted(sweep.unchecked)
    finally:
        await pool.aclose()


async def test_a_reload_keeps_the_sweeps_bound_as_the_control_pool_keeps_its_own(autojump_clock: MockClock) -> None:
    """``control_connections`` is not reloaded: the pool's limiter stays as built, and so does the sweep's bound."""
    config = _fleet_config(30.0)
    pool = ControlPool(control_connections=SLOTS, engine_config=config.engine,
                       transport=httpx.MockTransport(lambda request: httpx.Response(200)))
    stage = _wired_health(config, pool)
    reloaded = msgspec.structs.replace(config, engine=msgspec.structs.replace(config.engine, control_connections=4))
    stage.configure(RunningConfig(config=reloaded))
    assert stage.parallel == SLOTS and pool.statistics().control_connections == SLOTS
    await pool.aclose()
