"""The monitor pass at fleet scale on MockClock: concurrency bounded by the control pool, no per-check O(N) work.

256 engines behind the real control pool (an httpx MockTransport answers every
``GET /health`` after 0.1 virtual seconds), the real supervisor, fleet writer
and health/liveness stages. Times are virtual and exact.
"""

from __future__ import annotations

import httpx
import trio
from trio.testing import MockClock

from narwhal.config import Config, EngineConfig, EngineSpec
from narwhal.control.fleet_writer import FleetWriter
from narwhal.control.monitor import Monitor
from narwhal.control.supervisor import Supervisor
from narwhal.fleet import Fleet
from narwhal.fleet.admission import Admission
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.pools.control import ControlPool
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
