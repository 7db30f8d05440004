"""Issue 27: readmission starts as soon as an ejected engine answers health, and backs off when it keeps failing.

The same fakes as ``test_readmission.py`` (engines behind ``httpx.MockTransport``
on the real control pool) under trio's MockClock with autojump, so every time
asserted is exact: the fakes answer in zero virtual time, so an attempt starts
at the very instant of the health answer that started it.

Recheck and backoff times here are binary fractions (0.125 s), so the tick grid
and the backoff land on the same instants without rounding.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import trio
from trio.testing import MockClock

from narwhal.config import ConfigError, RecoveryConfig, parse_config
from narwhal.control.fleet_writer import FleetWriter
from narwhal.control.readmission import Readmitter
from narwhal.errors import FailureClass, SuccessKind
from narwhal.stages.health import HealthStage
from tests.test_operator_hardening import config_text
from tests.test_readmission import KEY, WALL_BASE, World
from tests.test_router_wiring import router

RECHECK_S = 0.125


class SweepSupervisor:
    """What the health stage reports to: the fleet, as the real supervisor passes it on."""

    def __init__(self, world: World) -> None:
        self.world = world

    def record_success(self, engine: str, kind: SuccessKind) -> None:
        self.world.fleet.record_success(engine, kind, trio.current_time())

    def record_failure(self, engine: str, failure_class: FailureClass) -> None:
        self.world.fleet.record_failure(engine, failure_class, trio.current_time())


def health_stage(world: World) -> HealthStage:
    return HealthStage(supervisor=SweepSupervisor(world), control_pool=world.pool, engines=world.config.engines,
                       check_timeout_s=1.0, observer=world.readmitter)


def attempt_times(world: World, name: str) -> Callable[[], list[float]]:
    """Times the chain reached attestation on ``name`` (one per attempt that passed its first health check)."""
    engine = world.engines[name]
    times: list[float] = []
    handle = engine.handle

    async def recording(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/narwhal/identity":
            times.append(trio.current_time())
        return await handle(request)

    engine.handle = recording  # type: ignore[method-assign]
    return lambda: list(times)


def started_at(world: World, name: str) -> float:
    """Monotonic start of ``name``'s latest attempt."""
    last = world.readmitter.last_result(name)
    assert last is not None
    return last.at - WALL_BASE


def histogram_count(world: World, name: str) -> int:
    return sum(sum(counts) for labels, (counts, _) in world.metrics.health_to_eligible.series.items()
               if labels[0] == name)


# ----- the immediate start ----------------------------------------------------------------------


async def test_a_health_success_in_the_monitor_sweep_starts_the_chain_in_the_same_pass(
        autojump_clock: MockClock, nursery: trio.Nursery) -> None:
    # The tick is a minute away and the recheck is left out: only the sweep can start it.
    world = World(probe_interval_s=60.0, recheck=False)
    health = health_stage(world)
    await nursery.start(world.readmitter.run)
    world.fleet.eject("d1", "connection streak", world.now(), FailureClass.CONNECTION)
    world.engines["d1"].refuse_connections = True

    await trio.sleep(1.0)
    await health.run(1)
    assert world.readmitter.last_result("d1") is None  # still down: nothing to try

    world.engines["d1"].refuse_connections = False  # restarted
    await trio.sleep(1.0)
    sweep_at = world.now()
    await health.run(2)
    await trio.sleep(0.001)

    last = world.readmitter.last_result("d1")
    assert last is not None and last.readmitted and last.operator is False
    assert started_at(world, "d1") == sweep_at
    assert last.health_to_eligible_s == 0.0
    assert world.fleet.is_eligible("d1", world.now())


async def test_the_recheck_notices_a_restart_between_passes_and_never_checks_engines_in_placement(
        autojump_clock: MockClock, nursery: trio.Nursery) -> None:
    world = World(probe_interval_s=60.0, recheck_interval_s=RECHECK_S)
    t0 = world.now()
    await nursery.start(world.readmitter.run)
    world.fleet.eject("d1", "connection streak", t0, FailureClass.CONNECTION)
    world.engines["d1"].refuse_connections = True

    await trio.sleep(3.01)
    world.engines["d1"].refuse_connections = False  # back 3.01 s after the ejection
    await trio.sleep(1.0)

    last = world.readmitter.last_result("d1")
    assert last is not None and last.readmitted
    # The first recheck after it came back (the grid is t0 + k * 0.125) started the chain.
    assert started_at(world, "d1") == t0 + 3.125
    assert last.health_to_eligible_s == 0.0
    assert histogram_count(world, "d1") == 1
    # While it was down, nothing but health checks; no attempt was refused.
    assert world.count("d1", "refused", "health") == 0
    down_calls = [path for _, path in world.engines["d1"].calls[:-5]]
    assert set(down_calls) == {"/health"} and len(down_calls) == 25  # 0.125 .. 3.0
    # Engines in placement got no probe from the recheck, and d1 none since it is back.
    assert world.engines["p1"].calls == [] and world.engines["d2"].calls == []
    assert len(world.engines["d1"].calls) == 25 + 5


async def test_the_recheck_ends_a_held_engines_health_clearable_quarantine_between_passes(
        autojump_clock: MockClock, nursery: trio.Nursery) -> None:
    # A timeout streak holds d1 (a temporary quarantine) while its health probe decides; the
    # probe is lost here, so only a health success may end the hold before its deadline.
    world = World(probe_interval_s=60.0, quarantine_s=30.0, recheck_interval_s=RECHECK_S)
    world.engines["d1"].refuse_connections = True
    await nursery.start(world.readmitter.run)
    await trio.sleep(0.01)
    for _ in range(3):
        world.fleet.record_failure("d1", FailureClass.TIMEOUT, world.now())
    assert not world.fleet.is_eligible("d1", world.now())
    await trio.sleep(1.0)
    assert not world.fleet.is_eligible("d1", world.now())
    world.engines["d1"].refuse_connections = False
    await trio.sleep(RECHECK_S)
    assert world.fleet.is_eligible("d1", world.now())
    assert world.readmitter.last_result("d1") is None  # never ejected: no chain, the health success was enough


async def test_the_recheck_sleeps_while_nothing_is_out_and_an_ejection_wakes_it_on_its_grid(
        autojump_clock: MockClock, nursery: trio.Nursery) -> None:
    world = World(probe_interval_s=60.0, recheck_interval_s=RECHECK_S)
    writer = FleetWriter(world.fleet, world.metrics)  # tells the readmitter of fleet events, as in the router
    world.readmitter = Readmitter(config=world.config, fleet=writer, control_pool=world.pool,
                                  in_flight=world.in_flight, metrics=world.metrics, wall_clock=world.wall,
                                  attestation_key=KEY)
    rechecker = world.readmitter.rechecker
    looks: list[float] = []
    targets = rechecker.targets
    rechecker.targets = lambda now: looks.append(now) or targets(now)  # type: ignore[func-returns-value]
    t0 = world.now()
    await nursery.start(world.readmitter.run)
    await trio.sleep(10.0)
    # Nothing out: one look at the fleet, then asleep (not 80 ticks).
    assert looks == [t0 + RECHECK_S] and rechecker.idle
    world.engines["d1"].refuse_connections = True
    writer.eject("d1", "connection streak", world.now(), FailureClass.CONNECTION)
    await trio.sleep(0.99)
    # Woken by the ejection: ticks resume on the same grid, t0 + k * 0.125, and check d1 each time.
    assert looks[1:] == [t0 + k * RECHECK_S for k in range(81, 88)]
    assert [path for _, path in world.engines["d1"].calls] == ["/health"] * 7
    world.engines["d1"].refuse_connections = False  # back: the chain readmits it, then the recheck sleeps
    await trio.sleep(1.0)
    assert world.fleet.is_eligible("d1", world.now()) and rechecker.idle
    settled = len(looks)
    await trio.sleep(10.0)
    assert len(looks) == settled


# ----- backoff after refusals -------------------------------------------------------------------


async def test_refusals_back_off_doubling_up_to_probe_interval_and_the_reason_stays_visible(
        autojump_clock: MockClock, nursery: trio.Nursery) -> None:
    world = World(probe_interval_s=2.0, recheck_interval_s=RECHECK_S)
    world.engines["d1"].generation = "g-old"  # answers health, fails the generation check
    attempts = attempt_times(world, "d1")
    t0 = world.now()
    await nursery.start(world.readmitter.run)
    world.fleet.eject("d1", "connection streak", t0, FailureClass.CONNECTION)

    await trio.sleep(11.0)
    # Immediately at the first recheck, then after 0.125, 0.25, 0.5, 1, 2, 2, 2 ... (probe_interval_s).
    assert [t - t0 for t in attempts()] == [0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    state = world.readmitter.admin_state("d1")
    assert state.last_readmission is not None and state.last_readmission.check == "generation"
    assert "g-old" in state.last_readmission.reason
    assert state.readmission_backoff_s == 2.0
    assert state.next_readmission_at == t0 + 12.0
    assert state.health_answered_at == t0 + 0.125
    assert world.count("d1", "refused", "generation") == 9

    world.engines["d1"].generation = "g1"  # fixed: the next backed-off attempt readmits it
    await trio.sleep(1.5)
    last = world.readmitter.last_result("d1")
    assert last is not None and last.readmitted and started_at(world, "d1") == t0 + 12.0
    # From the first health success seen after the ejection to back in placement.
    assert last.health_to_eligible_s == 12.0 - 0.125


async def test_a_tick_attempt_that_finds_the_engine_down_does_not_delay_its_return(
        autojump_clock: MockClock, nursery: trio.Nursery) -> None:
    world = World(probe_interval_s=1.0, recheck_interval_s=RECHECK_S)
    t0 = world.now()
    await nursery.start(world.readmitter.run)
    world.fleet.eject("d1", "connection streak", t0, FailureClass.CONNECTION)
    world.engines["d1"].refuse_connections = True
    for _ in range(10):  # ten monitor passes: ten tick attempts refused at health
        await trio.sleep(1.0)
        await world.readmitter.readmit_due()
    assert world.count("d1", "refused", "health") >= 9
    assert world.readmitter.admin_state("d1").readmission_backoff_s == 0.0
    await trio.sleep(0.01)  # off the recheck grid
    world.engines["d1"].refuse_connections = False
    await trio.sleep(0.5)
    assert started_at(world, "d1") == pytest.approx(t0 + 10.125)
    assert world.fleet.is_eligible("d1", world.now())


# ----- the operator's holds ---------------------------------------------------------------------


async def test_a_drained_or_maintained_engine_answering_health_still_needs_the_operators_readmit(
        autojump_clock: MockClock, nursery: trio.Nursery) -> None:
    world = World(probe_interval_s=1.0, recheck_interval_s=RECHECK_S)
    health = health_stage(world)
    await nursery.start(world.readmitter.run)
    now = world.now()
    world.fleet.eject("d1", "connection streak", now, FailureClass.CONNECTION)
    world.readmitter.drain("d1", now)
    world.fleet.eject("p1", "connection streak", now, FailureClass.CONNECTION)
    world.readmitter.maintenance("p1", now)

    for number in range(1, 11):  # ten passes: every engine answers 200 to every sweep
        await trio.sleep(1.0)
        await health.run(number)
        await world.readmitter.readmit_due()
    assert world.readmitter.last_result("d1") is None and world.readmitter.last_result("p1") is None
    # The sweep's checks only: the recheck leaves drained engines to the operator.
    assert world.engines["d1"].calls == [("GET", "/health")] * 10
    assert world.readmitter.admin_state("d1").next_readmission_at is None

    assert (await world.readmitter.readmit("d1", operator=True)).readmitted
    assert world.fleet.is_eligible("d1", world.now())


async def test_a_drain_that_arrives_after_the_health_answer_stops_the_start(
        autojump_clock: MockClock, nursery: trio.Nursery) -> None:
    world = World(probe_interval_s=60.0, recheck=False)
    await nursery.start(world.readmitter.run)
    now = world.now()
    world.fleet.eject("d1", "connection streak", now, FailureClass.CONNECTION)
    world.readmitter.health_observed("d1", False)
    world.readmitter.drain("d1", now)
    world.readmitter.health_observed("d1", True)
    await trio.sleep(1.0)
    assert world.readmitter.last_result("d1") is None


# ----- a flapping engine ------------------------------------------------------------------------


async def test_a_flapping_engine_is_readmitted_later_each_time_and_a_lasting_readmission_resets_that(
        autojump_clock: MockClock, nursery: trio.Nursery) -> None:
    world = World(probe_interval_s=2.0, recheck_interval_s=RECHECK_S)
    t0 = world.now()
    await nursery.start(world.readmitter.run)
    waits: list[float] = []

    async def eject_and_wait_for_readmission() -> float:
        ejected_at = world.now()
        world.fleet.eject("d1", "connection streak", ejected_at, FailureClass.CONNECTION)
        with trio.fail_after(10):  # virtual seconds: a readmission that never comes fails, not spins
            while not world.fleet.is_eligible("d1", world.now()):
                await trio.sleep(0.001)
        readmitted_at = started_at(world, "d1")
        waits.append(readmitted_at - ejected_at)
        return readmitted_at

    # Ejected 0.51 s after each readmission: none lasts, so each return waits longer.
    await trio.sleep(0.01)
    for _ in range(6):
        readmitted_at = await eject_and_wait_for_readmission()
        await trio.sleep_until(readmitted_at + 0.51)
    # Off the grid by 0.01 s: the first recheck is 0.115 s later; then the backoff of
    # 0.125, 0.25, 0.5, 1, 2 rounded up to the next recheck.
    assert waits == pytest.approx([0.115, 0.24, 0.365, 0.615, 1.115, 2.115])
    # It stays in placement for a whole probe interval: the next ejection starts from scratch.
    await trio.sleep_until(readmitted_at + 2.01)
    await eject_and_wait_for_readmission()
    assert waits[-1] == pytest.approx(0.115)
    assert world.now() - t0 < 20


async def test_an_engine_ejected_for_failed_inference_starts_on_health_only_after_it_went_away(
        autojump_clock: MockClock, nursery: trio.Nursery) -> None:
    world = World(probe_interval_s=60.0, recheck=False)
    await nursery.start(world.readmitter.run)
    for name in ("d1", "d2"):
        world.fleet.eject(name, "decode failed", world.now(), FailureClass.INFERENCE_STATUS)
        # Health that never stopped answering says nothing about its decodes.
        world.readmitter.health_observed(name, True)
    await trio.sleep(1.0)
    assert world.readmitter.last_result("d1") is None and world.readmitter.last_result("d2") is None
    # d1 is readmitted by the operator: its health never "returned", so no figure.
    result = await world.readmitter.readmit("d1", operator=True)
    assert result.readmitted and result.health_to_eligible_s is None
    # d2 goes silent, then answers again: it went away and came back, so its health now counts.
    world.readmitter.health_observed("d2", False)
    await trio.sleep(1.0)
    world.readmitter.health_observed("d2", True)
    await trio.sleep(0.01)
    last = world.readmitter.last_result("d2")
    assert last is not None and last.readmitted and last.operator is False and last.health_to_eligible_s == 0.0


# ----- the event and the metric -----------------------------------------------------------------


async def test_engine_readmitted_carries_the_health_to_eligible_time(
        autojump_clock: MockClock, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    world = World(probe_interval_s=60.0, recheck=False)
    writer = FleetWriter(world.fleet, world.metrics)  # logs the fleet's events, as in the router
    world.readmitter = Readmitter(config=world.config, fleet=writer, control_pool=world.pool,
                                  in_flight=world.in_flight, metrics=world.metrics, wall_clock=world.wall,
                                  attestation_key=KEY)
    world.readmitter.rechecker.targets = lambda now: []
    world.engines["d1"].health = [200, 503, 200]  # the first chain's final health fails, the second passes
    await nursery.start(world.readmitter.run)
    writer.eject("d1", "connection streak", world.now(), FailureClass.CONNECTION)
    world.readmitter.health_observed("d1", True)
    await trio.sleep(0.01)
    assert world.readmitter.last_result("d1").check == "final_health"  # type: ignore[union-attr]
    await trio.sleep(0.5)
    world.readmitter.health_observed("d1", True)  # the run of successes goes on: its clock keeps running
    await trio.sleep(0.01)

    lines: list[dict[str, Any]] = [json.loads(r.getMessage()) for r in caplog.records if r.name == "narwhal.events"]
    [readmitted] = [line for line in lines if line["event"] == "engine_readmitted"]
    assert readmitted["engine"] == "d1" and readmitted["health_to_eligible_s"] == pytest.approx(0.51)
    [ok] = [line for line in lines if line["event"] == "readmission" and line["outcome"] == "readmitted"]
    assert ok["health_to_eligible_s"] == pytest.approx(0.51)
    assert histogram_count(world, "d1") == 1
    bucket = 'narwhal_readmission_health_to_eligible_seconds_bucket{engine="d1",model="m1",le="1"} 1'
    assert bucket in world.metrics.render()


async def test_an_operator_readmission_is_not_in_the_histogram(autojump_clock: MockClock) -> None:
    world = World(recheck=False)
    world.fleet.eject("d1", "connection streak", world.now(), FailureClass.CONNECTION)
    world.readmitter.health_observed("d1", True)
    await trio.sleep(3.0)
    result = await world.readmitter.readmit("d1", operator=True)
    assert result.readmitted and result.health_to_eligible_s == 3.0
    assert histogram_count(world, "d1") == 0


# ----- the setting -------------------------------------------------------------------------------


def test_recheck_interval_defaults_to_a_tenth_of_a_second_capped_at_the_probe_interval() -> None:
    assert RecoveryConfig().recheck_period_s == 0.1
    assert RecoveryConfig(probe_interval_s=0.05).recheck_period_s == 0.05
    assert RecoveryConfig(recheck_interval_s=0.5).recheck_period_s == 0.5


@pytest.mark.parametrize(("text", "message"), [
    ("recheck_interval_s = 0.01", "recovery: recheck_interval_s must be >= 0.05, got 0.01"),
    ("recheck_interval_s = 6.0", "recovery: recheck_interval_s (6) must be <= probe_interval_s (5)"),
    ("recheck_interval_s = nan", "recovery: recheck_interval_s must be a finite number"),
])
def test_a_bad_recheck_interval_is_refused_naming_the_key(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(config_text(f"[recovery]\n{text}\n"))
    assert message in str(caught.value)


def test_the_router_wires_the_sweep_and_the_recheck_to_the_readmitter() -> None:
    built = router()
    assert built.stages.health.observer is built.readmitter
    assert built.readmitter.rechecker.interval_s == built.config.recovery.recheck_period_s
