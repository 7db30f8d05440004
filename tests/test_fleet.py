"""The fleet state machine, one test (or more) per sentence of the spec sections it owns.

Sections: "Engine failure handling", "Failure evidence", "Liveness",
"Last-engine protection", "Clearing failure evidence" (the tables themselves are
walked in test_fleet_table.py), "Failure quarantine". Times are plain floats;
the tests at the end drive the fleet from trio tasks in virtual time.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import msgspec
import pytest
import trio
from trio.testing import MockClock

from narwhal.control.model_view import engine_state
from narwhal.errors import FailureClass, SuccessKind
from narwhal.fleet import (
    INFERENCE_FAILURES,
    PROTECTED_HOLDS,
    ActionKind,
    EngineRecord,
    Fleet,
    FleetEventKind,
    HoldKind,
)

ENGINES = [("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"), ("d2", "decode")]
EJECT_AFTER = 3
QUARANTINE_S = 30.0
PROBE_INTERVAL_S = 5.0


def make_fleet(*, quarantine_s: float | None = None, liveness_misses: int = 3,
               engines: list[tuple[str, str]] = ENGINES) -> Fleet:
    return Fleet(engines, eject_after=EJECT_AFTER, liveness_misses=liveness_misses,
                 failure_quarantine_s=quarantine_s, probe_interval_s=PROBE_INTERVAL_S)


def fail(fleet: Fleet, name: str, failure_class: FailureClass, now: float,
         times: int = EJECT_AFTER) -> list:
    actions = []
    for _ in range(times):
        actions += fleet.record_failure(name, failure_class, now)
    return actions


def hold_kinds(fleet: Fleet, name: str, now: float, *, deferred: bool | None = None) -> list[HoldKind]:
    return [h.kind for h in fleet.view(name, now).holds if deferred is None or h.deferred == deferred]


def sweep(fleet: Fleet, now: float, silent: tuple[str, ...] = ()) -> list:
    return fleet.record_health_sweep({name: name not in silent for name, _ in ENGINES}, now)


# The pure core stays pure (no trio, httpx, logging, time, nor the shell): tests/test_layout.py.

# "Health checks and suspect verification use the control pool" is shown on a real
# router with its data pool saturated: tests/test_router_wiring.py.


# ---------- Failure evidence ----------

def test_only_consecutive_failures_count_toward_eject_after() -> None:
    fleet = make_fleet()
    fail(fleet, "d1", FailureClass.CONNECTION, 0.0, times=2)
    fleet.record_success("d1", SuccessKind.DECODE_TERMINAL, 1.0)
    assert fail(fleet, "d1", FailureClass.CONNECTION, 2.0, times=2) == []
    assert not fleet.view("d1", 2.0).ejected


def test_failure_totals_are_counted_even_when_streaks_are_cleared() -> None:
    fleet = make_fleet()
    fail(fleet, "d1", FailureClass.OVERLOAD, 0.0, times=2)
    fleet.record_success("d1", SuccessKind.HEALTH_200, 1.0)
    fail(fleet, "d1", FailureClass.OVERLOAD, 2.0, times=1)
    assert fleet.view("d1", 2.0).counters.failures[FailureClass.OVERLOAD] == 3


@pytest.mark.parametrize("failure_class", INFERENCE_FAILURES)
def test_new_requests_are_paused_by_a_verification_hold_before_the_probe(failure_class: FailureClass) -> None:
    fleet = make_fleet()
    actions = fail(fleet, "d1", failure_class, 1.0)
    # By the time the shell sees the probe action, the engine takes no new work.
    assert [a.kind for a in actions] == [ActionKind.INFERENCE_PROBE]
    assert fleet.eligible("decode", 1.0) == ["d2"]
    assert hold_kinds(fleet, "d1", 1.0) == [HoldKind.INFERENCE_VERIFICATION]
    kinds = [e.kind for e in fleet.drain_events()]
    assert kinds == [FleetEventKind.HOLD_ADDED]


def test_inconclusive_probe_leg_leaves_the_verification_hold_active() -> None:
    fleet = make_fleet()
    fail(fleet, "d1", FailureClass.STREAM, 1.0)
    assert fleet.record_probe("d1", "inconclusive", 2.0, leg="prefill", reason="peer failed") == []
    assert hold_kinds(fleet, "d1", 2.0) == [HoldKind.INFERENCE_VERIFICATION]
    assert not fleet.is_eligible("d1", 2.0)
    assert not fleet.view("d1", 2.0).ejected


def test_inconclusive_probe_is_rescheduled_after_probe_interval_while_peers_serve() -> None:
    fleet = make_fleet()
    fail(fleet, "d1", FailureClass.INFERENCE_STATUS, 1.0)
    assert fleet.probes_due(1.0) == []  # the first probe is in flight already
    fleet.record_probe("d1", "inconclusive", 2.0)
    assert fleet.view("d1", 2.0).next_probe_at == 2.0 + PROBE_INTERVAL_S
    assert fleet.probes_due(2.0 + PROBE_INTERVAL_S - 0.001) == []
    # Meanwhile admission sends new work to the eligible peer.
    assert fleet.eligible("decode", 3.0) == ["d2"]
    assert fleet.probes_due(2.0 + PROBE_INTERVAL_S) == ["d1"]
    # Handed out once: it is in flight until its result is recorded.
    assert fleet.view("d1", 7.0).probe_in_flight
    assert fleet.probes_due(100.0) == []
    fleet.record_probe("d1", "inconclusive", 8.0)
    assert fleet.probes_due(8.0 + PROBE_INTERVAL_S) == ["d1"]


def test_successful_inference_probe_clears_recorded_inference_failures() -> None:
    fleet = make_fleet()
    fail(fleet, "d1", FailureClass.KV_HANDOFF, 1.0)
    fail(fleet, "d1", FailureClass.STREAM, 1.0, times=2)
    fail(fleet, "d1", FailureClass.INFERENCE_STATUS, 1.0, times=1)
    fail(fleet, "d1", FailureClass.TIMEOUT, 1.0, times=1)
    fleet.record_probe("d1", "success", 2.0)
    evidence = fleet.view("d1", 2.0).evidence
    assert all(evidence[c] == 0 for c in INFERENCE_FAILURES)
    assert evidence[FailureClass.TIMEOUT] == 1  # not an inference failure
    assert fleet.eligible("decode", 2.0) == ["d1", "d2"]


@pytest.mark.parametrize("leg", ["prefill", "decode"])
def test_failed_probe_leg_ejects_the_engine(leg: str) -> None:
    fleet = make_fleet()
    fail(fleet, "p1", FailureClass.KV_HANDOFF, 1.0)
    actions = fleet.record_probe("p1", "failed", 2.0, leg=leg, reason="HTTP 500")
    assert [(a.kind, a.engine) for a in actions] == [(ActionKind.EJECT, "p1")]
    view = fleet.view("p1", 2.0)
    assert view.ejected and view.ejected_at == 2.0
    assert view.ejected_reason == f"{leg} probe leg failed: HTTP 500"
    assert view.next_probe_at is None and fleet.probes_due(1e9) == []
    assert view.counters.probes == {"success": 0, "failed": 1, "inconclusive": 0}


def test_probe_results_are_reported_as_events() -> None:
    fleet = make_fleet()
    fail(fleet, "d1", FailureClass.STREAM, 1.0)
    fleet.drain_events()
    fleet.record_probe("d1", "inconclusive", 2.0, leg="decode", reason="cut short")
    [event] = fleet.drain_events()
    assert (event.kind, event.engine, event.outcome, event.leg) == (
        FleetEventKind.PROBE_RESULT, "d1", "inconclusive", "decode")
    assert event.reason == "decode probe leg inconclusive: cut short"


def test_ejected_engines_get_no_probe_actions() -> None:
    fleet = make_fleet()
    fleet.eject("d1", "operator", 0.0)
    assert fail(fleet, "d1", FailureClass.STREAM, 1.0) == []
    assert fail(fleet, "d1", FailureClass.TIMEOUT, 1.0) == []
    assert fleet.view("d1", 1.0).evidence[FailureClass.STREAM] == EJECT_AFTER


def test_shell_requested_verification_hold_asks_for_a_probe() -> None:
    fleet = make_fleet()
    actions = fleet.add_hold("d1", HoldKind.INFERENCE_VERIFICATION, "suspect", 0.0)
    assert [(a.kind, a.failure_class) for a in actions] == [(ActionKind.INFERENCE_PROBE, None)]
    assert fail(fleet, "d1", FailureClass.STREAM, 1.0) == []  # probe already in flight


# ---------- Liveness ----------

def test_liveness_has_its_own_per_engine_miss_counter() -> None:
    fleet = make_fleet(liveness_misses=3)
    sweep(fleet, 0.0, silent=("d1",))
    sweep(fleet, 1.0, silent=("d1", "p1"))
    assert [fleet.view(n, 1.0).liveness_misses for n, _ in ENGINES] == [1, 0, 2, 0]
    # Misses are not failure evidence, and failure evidence is not misses.
    assert sum(fleet.view("d1", 1.0).evidence.values()) == 0
    fail(fleet, "d2", FailureClass.TIMEOUT, 1.0, times=2)
    assert fleet.view("d2", 1.0).liveness_misses == 0


def test_liveness_ejects_after_exactly_liveness_misses_consecutive_silent_sweeps() -> None:
    fleet = make_fleet(liveness_misses=3)
    assert sweep(fleet, 0.0, silent=("d1",)) == []
    assert sweep(fleet, 1.0, silent=("d1",)) == []
    assert fleet.is_eligible("d1", 1.0)
    actions = sweep(fleet, 2.0, silent=("d1",))
    assert [(a.kind, a.engine, a.failure_class) for a in actions] == [(ActionKind.EJECT, "d1", None)]
    view = fleet.view("d1", 2.0)
    assert view.ejected and view.ejected_at == 2.0 and "3 consecutive silent" in view.ejected_reason
    assert sweep(fleet, 3.0, silent=("d1",)) == []  # ejected once


def test_engine_absent_from_a_sweep_counts_as_silent() -> None:
    fleet = make_fleet(liveness_misses=1)
    actions = fleet.record_health_sweep({"p1": True, "p2": True, "d2": True}, 0.0)
    assert [a.engine for a in actions] == ["d1"]


def test_successful_sweep_resets_the_liveness_counter() -> None:
    fleet = make_fleet(liveness_misses=3)
    sweep(fleet, 0.0, silent=("d1",))
    sweep(fleet, 1.0, silent=("d1",))
    sweep(fleet, 2.0)
    assert fleet.view("d1", 2.0).liveness_misses == 0
    assert sweep(fleet, 3.0, silent=("d1",)) + sweep(fleet, 4.0, silent=("d1",)) == []
    assert not fleet.view("d1", 4.0).ejected


def test_successful_health_probe_between_sweeps_resets_the_liveness_counter() -> None:
    fleet = make_fleet(liveness_misses=3)
    sweep(fleet, 0.0, silent=("d1",))
    sweep(fleet, 1.0, silent=("d1",))
    fleet.record_success("d1", SuccessKind.HEALTH_200, 1.5)  # a suspect health probe
    assert sweep(fleet, 2.0, silent=("d1",)) == []
    assert fleet.view("d1", 2.0).liveness_misses == 1


def test_health_sweep_rejects_unknown_engines() -> None:
    with pytest.raises(KeyError):
        make_fleet().record_health_sweep({"nope": True}, 0.0)


# ---------- Last-engine protection ----------

def test_performance_drift_hold_preserves_the_last_eligible_engine() -> None:
    fleet = make_fleet()
    fleet.add_hold("d1", HoldKind.PERFORMANCE_DRIFT, "ttft 4x fleet median", 0.0)
    assert fleet.eligible("decode", 0.0) == ["d2"]
    fleet.add_hold("d2", HoldKind.PERFORMANCE_DRIFT, "ttft 5x fleet median", 1.0)
    assert fleet.eligible("decode", 1.0) == ["d2"]
    assert hold_kinds(fleet, "d2", 1.0, deferred=True) == [HoldKind.PERFORMANCE_DRIFT]
    assert fleet.capacity_problem(1.0) is None
    events = fleet.drain_events()
    assert [(e.kind, e.engine) for e in events] == [
        (FleetEventKind.HOLD_ADDED, "d1"), (FleetEventKind.HOLD_DEFERRED, "d2")]
    assert "last eligible decode engine" in events[-1].reason


def test_temporary_quarantine_preserves_the_last_eligible_engine() -> None:
    fleet = make_fleet(quarantine_s=QUARANTINE_S, engines=[("p1", "prefill"), ("d1", "decode")])
    actions = fail(fleet, "d1", FailureClass.TIMEOUT, 0.0)
    assert [a.kind for a in actions] == [ActionKind.HEALTH_PROBE]
    assert hold_kinds(fleet, "d1", 0.0, deferred=True) == [HoldKind.FAILURE_QUARANTINE]
    assert fleet.eligible("decode", 0.0) == ["d1"]


def test_deferred_hold_is_applied_once_a_peer_is_eligible_again() -> None:
    fleet = make_fleet()
    fleet.add_hold("d1", HoldKind.OPERATOR_DRAIN, "upgrade", 0.0)
    fleet.add_hold("d2", HoldKind.PERFORMANCE_DRIFT, "slow", 1.0, wall=1_000_001.0)
    assert fleet.eligible("decode", 1.0) == ["d2"]
    fleet.drain_events()
    fleet.clear_hold("d1", HoldKind.OPERATOR_DRAIN, 2.0)
    assert fleet.eligible("decode", 2.0) == ["d1"]
    held = fleet.view("d2", 2.0).holds
    assert [(h.kind, h.deferred, h.since) for h in held] == [(HoldKind.PERFORMANCE_DRIFT, False, 2.0)]
    # Applied now, it begins now on the wall clock too (not when it was recorded deferred).
    [record] = [r for r in fleet.snapshot(now=2.0, wall_now=1_000_002.0) if r.name == "d2"]
    assert [h.since_wall for h in record.holds] == [1_000_002.0]
    applied = [e for e in fleet.drain_events() if e.kind is FleetEventKind.HOLD_ADDED]
    assert [(e.engine, e.hold_kind) for e in applied] == [("d2", HoldKind.PERFORMANCE_DRIFT)]


def test_protected_hold_is_deferred_again_when_its_peer_is_ejected() -> None:
    fleet = make_fleet()
    fleet.add_hold("d1", HoldKind.PERFORMANCE_DRIFT, "slow", 0.0)
    assert fleet.eligible("decode", 0.0) == ["d2"]
    fail(fleet, "d2", FailureClass.CONNECTION, 1.0)
    assert fleet.eligible("decode", 1.0) == ["d1"]
    assert hold_kinds(fleet, "d1", 1.0, deferred=True) == [HoldKind.PERFORMANCE_DRIFT]


def test_last_engine_kept_is_the_one_held_most_recently() -> None:
    fleet = make_fleet(engines=[("p1", "prefill"), ("d1", "decode"), ("d2", "decode"), ("d3", "decode")])
    fleet.add_hold("d1", HoldKind.PERFORMANCE_DRIFT, "slow", 0.0)
    fleet.add_hold("d2", HoldKind.PERFORMANCE_DRIFT, "slow", 1.0)
    fleet.eject("d3", "dead", 2.0)
    assert fleet.eligible("decode", 2.0) == ["d2"]


@pytest.mark.parametrize("failure", ["connection_streak", "failed_probe_leg", "liveness", "eject"])
def test_confirmed_failure_can_remove_the_last_eligible_engine(failure: str) -> None:
    fleet = make_fleet(quarantine_s=QUARANTINE_S, engines=[("p1", "prefill"), ("d1", "decode")])
    if failure == "connection_streak":
        fail(fleet, "d1", FailureClass.CONNECTION, 0.0)
    elif failure == "failed_probe_leg":
        fail(fleet, "d1", FailureClass.STREAM, 0.0)
        fleet.record_probe("d1", "failed", 0.0, leg="decode")
    elif failure == "liveness":
        for t in range(3):
            fleet.record_health_sweep({"p1": True}, float(t))
    else:
        fleet.eject("d1", "attestation mismatch", 0.0)
    assert fleet.eligible("decode", 3.0) == []
    assert fleet.view("d1", 3.0).ejected


def test_verification_hold_can_remove_the_last_eligible_engine() -> None:
    fleet = make_fleet(engines=[("p1", "prefill"), ("d1", "decode")])
    fail(fleet, "d1", FailureClass.STREAM, 0.0)
    assert fleet.eligible("decode", 0.0) == []


def test_capacity_problem_names_the_exhausted_role() -> None:
    fleet = make_fleet()
    assert fleet.capacity_problem(0.0) is None
    fleet.eject("d1", "dead", 0.0)
    fleet.eject("d2", "dead", 0.0)
    assert fleet.capacity_problem(0.0) == "serving capacity exhausted: no eligible decode engine"
    fleet.add_hold("p1", HoldKind.MAINTENANCE, "kernel", 0.0)
    fleet.add_hold("p2", HoldKind.OPERATOR_DRAIN, "move", 0.0)
    assert fleet.capacity_problem(0.0) == "serving capacity exhausted: no eligible prefill or decode engine"


def test_recovery_probes_continue_while_serving_capacity_is_exhausted() -> None:
    fleet = make_fleet(engines=[("p1", "prefill"), ("d1", "decode")])
    fail(fleet, "d1", FailureClass.STREAM, 0.0)
    assert fleet.capacity_problem(0.0) == "serving capacity exhausted: no eligible decode engine"
    fleet.record_probe("d1", "inconclusive", 1.0)
    assert fleet.probes_due(1.0 + PROBE_INTERVAL_S) == ["d1"]
    fleet.record_probe("d1", "success", 7.0)
    # Serving resumes by itself once the engine returns.
    assert fleet.capacity_problem(7.0) is None


def test_only_drift_and_quarantine_holds_are_protected() -> None:
    assert PROTECTED_HOLDS == {HoldKind.PERFORMANCE_DRIFT, HoldKind.FAILURE_QUARANTINE}
    for kind in set(HoldKind) - PROTECTED_HOLDS:
        fleet = make_fleet(engines=[("p1", "prefill"), ("d1", "decode")])
        fleet.add_hold("d1", kind, "test", 0.0)
        assert fleet.eligible("decode", 0.0) == [], kind


def test_every_hold_kind_pauses_new_requests() -> None:
    for kind in HoldKind:
        fleet = make_fleet()
        fleet.add_hold("d1", kind, "test", 0.0)
        assert fleet.eligible("decode", 0.0) == ["d2"], kind
        assert not fleet.is_eligible("d1", 0.0)


RANDOM_OPERATIONS = 9


def random_operation(fleet: Fleet, rng: random.Random, now: float, operations: int) -> None:
    """One of the first ``operations`` kinds of change, on a random engine (removals are the last two)."""
    name = rng.choice([n for n, _ in ENGINES])
    op = rng.randrange(operations)
    if op == 0:
        fleet.record_failure(name, rng.choice(list(FailureClass)), now)
    elif op == 1:
        fleet.record_success(name, rng.choice(list(SuccessKind)), now)
    elif op == 2:
        fleet.add_hold(name, rng.choice(list(HoldKind)), "r", now, rng.choice([None, now + 10.0]))
    elif op == 3:
        fleet.clear_hold(name, rng.choice(list(HoldKind)), now)
    elif op == 4:
        fleet.record_probe(name, rng.choice(["success", "failed", "inconclusive"]), now)
    elif op == 5:
        fleet.readmit(name, now)
    elif op == 6:
        fleet.eject(name, "r", now)
    elif op == 7:
        fleet.start_removal(name, now, "r")
    else:
        fleet.cancel_removal(name, now, "r")


def random_walk(seeds: int, steps: int, operations: int) -> Iterator[tuple[int, Fleet, float]]:
    """A fresh fleet per seed through ``steps`` random changes of the first ``operations`` kinds, the clock
    moving on before each: (seed, fleet, now) after every change."""
    for seed in range(seeds):
        rng = random.Random(seed)
        fleet = make_fleet(quarantine_s=QUARANTINE_S)
        now = 0.0
        for _ in range(steps):
            now += rng.choice([0.0, 0.5, 3.0, 31.0])
            random_operation(fleet, rng, now, operations)
            yield seed, fleet, now


def test_random_operations_keep_the_last_engine_invariant_and_a_true_cache() -> None:
    for seed, fleet, now in random_walk(30, 200, RANDOM_OPERATIONS - 2):
        views = fleet.views(now)
        for role in ("prefill", "decode"):
            eligible = fleet.eligible(role, now)
            # The cache agrees with the state it summarises.
            assert eligible == [v.name for v in views if v.role == role and not v.ejected
                                and all(h.deferred for h in v.holds)]
            # Only protected holds keep these engines out; one of them must serve.
            protectable = [v for v in views if v.role == role and not v.ejected
                           and all(h.kind in PROTECTED_HOLDS for h in v.holds)]
            assert eligible or not protectable, (seed, role, views)
            # No expired hold survives a look at it.
            assert all(h.deadline is None or h.deadline > now for v in views for h in v.holds)


def test_the_unsettled_views_and_the_states_agree_with_every_view_after_random_operations() -> None:
    # What the monitor's stages and the timeline read instead of every engine's view, on every state reached.
    reached = {"unsettled": 0, "settled": 0, "held": 0, "ejected": 0, "removing": 0}
    for seed, fleet, now in random_walk(20, 150, RANDOM_OPERATIONS):
        unsettled = fleet.views_of_unsettled(now)
        states = fleet.states(now)
        views = fleet.views(now)
        assert unsettled == [v for v in views if v.ejected or v.holds or v.removing], (seed, views)
        assert states == {v.name: engine_state(v) for v in views}, (seed, views)
        reached["unsettled" if unsettled else "settled"] += 1
        for state in ("held", "ejected"):
            reached[state] += state in states.values()
        reached["removing"] += any(v.removing for v in unsettled)
    assert all(reached.values()), reached


def test_a_success_the_fleet_says_clears_nothing_changes_nothing_in_every_state_reached() -> None:
    # The request path skips such a success (WorkerView asks success_clears first): it must be a no-op.
    skipped = 0
    for seed, fleet, now in random_walk(10, 120, RANDOM_OPERATIONS):
        for name in ("p1", "p2", "d1", "d2", "unknown"):
            for kind in SuccessKind:
                if fleet.success_clears(name, kind):
                    continue
                skipped += 1
                views, mutations, events = fleet.views(now), fleet.mutations, fleet.has_events
                assert name not in fleet or fleet.record_success(name, kind, now) == [], (seed, name, kind)
                assert (fleet.views(now), fleet.mutations, fleet.has_events) == (views, mutations, events)
    assert skipped > 1000


# ---------- Clearing failure evidence (beyond the table) ----------

def test_operator_drain_survives_successful_health_responses() -> None:
    fleet = make_fleet(quarantine_s=QUARANTINE_S)
    for kind in (HoldKind.OPERATOR_DRAIN, HoldKind.MAINTENANCE, HoldKind.INFERENCE_VERIFICATION):
        fleet.add_hold("d1", kind, "test", 0.0)
    fleet.record_success("d1", SuccessKind.HEALTH_200, 1.0)
    sweep(fleet, 2.0)
    assert hold_kinds(fleet, "d1", 2.0) == [HoldKind.INFERENCE_VERIFICATION, HoldKind.OPERATOR_DRAIN,
                                           HoldKind.MAINTENANCE]


def test_client_traffic_successes_are_cheap_when_there_is_nothing_to_clear() -> None:
    fleet = make_fleet()
    fleet.eligible("decode", 0.0)
    for _ in range(1000):
        assert fleet.record_success("d1", SuccessKind.DECODE_TERMINAL, 0.0) == []
    assert fleet.drain_events() == []


# ---------- Failure quarantine ----------

@pytest.mark.parametrize("cause", ["connection_streak", "failed_probe_leg", "liveness", "eject"])
def test_failed_engine_is_quarantined_until_the_deadline(cause: str) -> None:
    fleet = make_fleet(quarantine_s=QUARANTINE_S)
    if cause == "connection_streak":
        fail(fleet, "d1", FailureClass.CONNECTION, 10.0)
    elif cause == "failed_probe_leg":
        fail(fleet, "d1", FailureClass.STREAM, 10.0)
        fleet.record_probe("d1", "failed", 10.0, leg="prefill")
    elif cause == "liveness":
        for t in (8.0, 9.0, 10.0):
            sweep(fleet, t, silent=("d1",))
    else:
        fleet.eject("d1", "identity changed", 10.0)
    [hold] = [h for h in fleet.view("d1", 10.0).holds if h.kind is HoldKind.FAILURE_QUARANTINE]
    assert (hold.since, hold.deadline, hold.deferred) == (10.0, 10.0 + QUARANTINE_S, False)
    assert not fleet.readmission_allowed("d1", 10.0 + QUARANTINE_S - 0.001)
    assert fleet.readmission_allowed("d1", 10.0 + QUARANTINE_S)


def test_no_quarantine_without_failure_quarantine_s() -> None:
    fleet = make_fleet(quarantine_s=None)
    fail(fleet, "d1", FailureClass.CONNECTION, 0.0)
    fail(fleet, "d2", FailureClass.TIMEOUT, 0.0)
    assert hold_kinds(fleet, "d1", 0.0) == [] and hold_kinds(fleet, "d2", 0.0) == []
    assert fleet.readmission_allowed("d1", 0.0)


def test_successful_health_check_clears_the_quarantine_first() -> None:
    fleet = make_fleet(quarantine_s=QUARANTINE_S)
    fleet.eject("d1", "dead", 0.0, FailureClass.CONNECTION)  # ejection quarantine
    fail(fleet, "p1", FailureClass.OVERLOAD, 0.0)            # temporary quarantine
    assert hold_kinds(fleet, "p1", 0.0, deferred=False) == [HoldKind.FAILURE_QUARANTINE]
    assert not fleet.readmission_allowed("d1", 0.0)
    fleet.record_success("p1", SuccessKind.HEALTH_200, 1.0)  # the health probe's answer
    sweep(fleet, 1.0)                                        # the monitor's sweep
    assert hold_kinds(fleet, "d1", 1.0) == [] and hold_kinds(fleet, "p1", 1.0) == []
    assert fleet.readmission_allowed("d1", 1.0)
    assert fleet.eligible("prefill", 1.0) == ["p1", "p2"]
    assert fleet.eligible("decode", 1.0) == ["d2"]  # d1 still awaits readmission


def test_successful_inference_check_clears_the_quarantine_first() -> None:
    fleet = make_fleet(quarantine_s=QUARANTINE_S)
    fail(fleet, "d1", FailureClass.TIMEOUT, 0.0)
    fail(fleet, "d1", FailureClass.STREAM, 0.0)
    assert hold_kinds(fleet, "d1", 0.0) == [HoldKind.INFERENCE_VERIFICATION, HoldKind.FAILURE_QUARANTINE]
    # The handoff lists them in the same order (the kinds' order, not the order they were added).
    [record] = [r for r in fleet.snapshot(0.0, 100.0) if r.name == "d1"]
    assert [h.kind for h in record.holds] == [HoldKind.INFERENCE_VERIFICATION, HoldKind.FAILURE_QUARANTINE]
    fleet.record_probe("d1", "success", 1.0)
    assert hold_kinds(fleet, "d1", 1.0) == []
    assert fleet.is_eligible("d1", 1.0)


def test_traffic_successes_do_not_clear_the_quarantine() -> None:
    fleet = make_fleet(quarantine_s=QUARANTINE_S)
    fail(fleet, "d1", FailureClass.TIMEOUT, 0.0)
    for kind in (SuccessKind.CLIENT_4XX, SuccessKind.PREFILL_HANDOFF, SuccessKind.DECODE_TERMINAL):
        fleet.record_success("d1", kind, 1.0)
    assert hold_kinds(fleet, "d1", 1.0) == [HoldKind.FAILURE_QUARANTINE]


def test_candidate_selection_expires_the_quarantine_at_its_deadline() -> None:
    fleet = make_fleet(quarantine_s=QUARANTINE_S)
    fail(fleet, "d1", FailureClass.TIMEOUT, 10.0)
    deadline = 10.0 + QUARANTINE_S
    assert fleet.eligible("decode", deadline - 1e-6) == ["d2"]
    fleet.drain_events()
    # No monitor pass, no other call: selection itself notices the deadline.
    assert fleet.eligible("decode", deadline) == ["d1", "d2"]
    [event] = fleet.drain_events()
    assert (event.kind, event.hold_kind, event.at) == (
        FleetEventKind.HOLD_CLEARED, HoldKind.FAILURE_QUARANTINE, deadline)
    assert "deadline passed" in event.reason


def test_is_eligible_also_expires_the_quarantine_at_its_deadline() -> None:
    fleet = make_fleet(quarantine_s=QUARANTINE_S)
    fail(fleet, "d1", FailureClass.TIMEOUT, 0.0)
    assert not fleet.is_eligible("d1", QUARANTINE_S - 1e-6)
    assert fleet.is_eligible("d1", QUARANTINE_S)


def test_successful_inference_probe_also_clears_the_verification_hold() -> None:
    fleet = make_fleet(quarantine_s=QUARANTINE_S)
    fail(fleet, "d1", FailureClass.KV_HANDOFF, 0.0)
    fleet.record_probe("d1", "success", 1.0, leg="decode")
    assert hold_kinds(fleet, "d1", 1.0) == []
    cleared = [e.hold_kind for e in fleet.drain_events() if e.kind is FleetEventKind.HOLD_CLEARED]
    assert cleared == [HoldKind.INFERENCE_VERIFICATION]


# ---------- Holds, readmission, visibility ----------

def test_hold_deadline_set_by_the_shell_expires_too() -> None:
    fleet = make_fleet()
    fleet.add_hold("d1", HoldKind.MAINTENANCE, "reboot", 0.0, deadline=60.0)
    assert not fleet.is_eligible("d1", 59.0)
    assert fleet.is_eligible("d1", 60.0)


def test_clear_hold_reports_whether_there_was_one() -> None:
    fleet = make_fleet()
    fleet.add_hold("d1", HoldKind.OPERATOR_DRAIN, "move", 0.0)
    assert fleet.clear_hold("d1", HoldKind.OPERATOR_DRAIN, 1.0)
    assert not fleet.clear_hold("d1", HoldKind.OPERATOR_DRAIN, 1.0)
    assert fleet.is_eligible("d1", 1.0)


def test_readmit_clears_ejection_readmission_holds_and_evidence() -> None:
    fleet = make_fleet(quarantine_s=QUARANTINE_S)
    fail(fleet, "d1", FailureClass.STREAM, 0.0)
    for kind in (HoldKind.OPERATOR_DRAIN, HoldKind.MAINTENANCE, HoldKind.PERFORMANCE_DRIFT):
        fleet.add_hold("d1", kind, "test", 0.0)
    sweep(fleet, 0.0, silent=("d1",))
    fail(fleet, "d1", FailureClass.CONNECTION, 1.0)
    fleet.readmit("d1", 40.0)
    view = fleet.view("d1", 40.0)
    assert not view.ejected and view.ejected_reason is None and view.ejected_at is None
    # Drift is the drift controller's to lift, not readmission's.
    assert [h.kind for h in view.holds] == [HoldKind.PERFORMANCE_DRIFT]
    assert set(view.evidence.values()) == {0} and view.liveness_misses == 0
    assert view.counters.ejections == 1
    assert FleetEventKind.READMITTED in [e.kind for e in fleet.drain_events()]


def test_events_name_engine_class_kind_and_reason() -> None:
    fleet = make_fleet(quarantine_s=QUARANTINE_S)
    fail(fleet, "d1", FailureClass.CONNECTION, 0.0)
    events = fleet.drain_events()
    assert [(e.kind, e.engine, e.failure_class, e.hold_kind) for e in events] == [
        (FleetEventKind.EJECTED, "d1", FailureClass.CONNECTION, None),
        (FleetEventKind.HOLD_ADDED, "d1", None, HoldKind.FAILURE_QUARANTINE)]
    assert all(e.reason and e.at == 0.0 for e in events)
    assert fleet.drain_events() == []


def test_view_shows_why_an_engine_is_out() -> None:
    fleet = make_fleet()
    fail(fleet, "d1", FailureClass.STREAM, 1.0)
    fleet.record_probe("d1", "inconclusive", 2.0)
    view = fleet.view("d1", 2.0)
    assert not view.eligible and not view.ejected
    assert [(h.kind, h.since, h.reason) for h in view.holds] == [
        (HoldKind.INFERENCE_VERIFICATION, 1.0, "stream streak reached 3 (eject_after 3)")]
    assert view.evidence[FailureClass.STREAM] == 3 and len(view.evidence) == len(FailureClass)
    assert view.next_probe_at == 7.0
    assert view.counters.probes["inconclusive"] == 1
    assert [v.name for v in fleet.views(2.0)] == ["p1", "p2", "d1", "d2"]
    assert repr(fleet) == "<Fleet [prefill: 2/2 eligible | decode: 1/2 eligible]>"


def test_constructor_rejects_bad_fleets() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        make_fleet(engines=[("a", "prefill"), ("a", "decode")])
    with pytest.raises(ValueError, match="role"):
        make_fleet(engines=[("a", "encode")])


# ---------- durable handoff ----------

def build_busy_fleet() -> Fleet:
    fleet = make_fleet(quarantine_s=QUARANTINE_S)
    fail(fleet, "p1", FailureClass.CONNECTION, 10.0)                      # ejected + quarantine
    fail(fleet, "d1", FailureClass.STREAM, 10.0)                          # verification hold
    fleet.record_probe("d1", "inconclusive", 11.0)                         # next probe at 16
    fleet.add_hold("d2", HoldKind.OPERATOR_DRAIN, "move rack", 12.0)
    fleet.add_hold("p2", HoldKind.PERFORMANCE_DRIFT, "slow", 12.0)        # deferred: last prefill
    fail(fleet, "p2", FailureClass.TIMEOUT, 12.0, times=2)
    sweep(fleet, 12.0, silent=("p2",))
    return fleet


def test_snapshot_restore_round_trip() -> None:
    original = build_busy_fleet()
    records = original.snapshot(now=13.0, wall_now=1_000_000.0)
    # The records survive the handoff's JSON encoding.
    decoded = msgspec.json.decode(msgspec.json.encode(records), type=list[EngineRecord])
    assert decoded == records
    # A new process: its monotonic clock reads 500 when the wall clock reads 1,000,005.
    restored = make_fleet(quarantine_s=QUARANTINE_S)
    restored.restore(decoded, now=500.0, wall_now=1_000_005.0)
    shift = 500.0 - 13.0 - 5.0
    for before, after in zip(original.views(13.0), restored.views(500.0), strict=True):
        assert after.eligible == before.eligible and after.ejected == before.ejected
        assert after.ejected_reason == before.ejected_reason
        assert after.evidence == before.evidence and after.counters == before.counters
        assert after.liveness_misses == before.liveness_misses
        assert [(h.kind, h.reason, h.deferred) for h in after.holds] == [
            (h.kind, h.reason, h.deferred) for h in before.holds]
        assert [h.since for h in after.holds] == pytest.approx([h.since + shift for h in before.holds])
        assert [h.deadline for h in after.holds if h.deadline] == pytest.approx(
            [h.deadline + shift for h in before.holds if h.deadline])
    assert restored.view("d1", 500.0).next_probe_at == pytest.approx(16.0 + shift)
    assert restored.view("p1", 500.0).ejected_at == pytest.approx(10.0 + shift)


def test_a_hold_keeps_the_wall_time_read_when_it_began_through_writes_and_restores() -> None:
    fleet = make_fleet()
    fleet.add_hold("d2", HoldKind.OPERATOR_DRAIN, "move rack", 12.0, wall=1_000_012.0)
    fleet.add_hold("d2", HoldKind.OPERATOR_DRAIN, "move rack", 15.0, wall=1_000_099.0)  # asked again
    fleet.add_hold("d1", HoldKind.MAINTENANCE, "planned", 12.0)  # no wall given: converted at each write

    def starts(records: list[EngineRecord]) -> dict[str, float]:
        return {record.name: hold.since_wall for record in records for hold in record.holds}

    # The writer's wall clock stepped 2.6 s: the kept start does not move, the converted one does.
    assert starts(fleet.snapshot(now=20.0, wall_now=1_000_020.0 + 2.6)) == {
        "d2": 1_000_012.0, "d1": pytest.approx(1_000_012.0 + 2.6)}
    restored = make_fleet()
    restored.restore(fleet.snapshot(now=20.0, wall_now=1_000_020.0), now=500.0, wall_now=1_000_030.0)
    assert restored.view("d2", 500.0).holds[0].since_wall == 1_000_012.0
    # Restored, both are the handoff's wall times, whatever the next writer's clock reads.
    assert starts(restored.snapshot(now=600.0, wall_now=1_000_130.0 - 1.7)) == {
        "d2": 1_000_012.0, "d1": pytest.approx(1_000_012.0)}


def test_restore_brings_past_deadlines_back_expired() -> None:
    records = build_busy_fleet().snapshot(now=13.0, wall_now=1_000_000.0)
    restored = make_fleet(quarantine_s=QUARANTINE_S)
    restored.restore(records, now=0.0, wall_now=1_000_000.0 + 60.0)  # quarantine ran out meanwhile
    assert hold_kinds(restored, "p1", 0.0) == []
    assert restored.readmission_allowed("p1", 0.0)
    assert restored.view("p1", 0.0).ejected


def test_restore_probes_again_a_verification_whose_probe_was_in_flight() -> None:
    fleet = make_fleet()
    fail(fleet, "d1", FailureClass.STREAM, 0.0)  # probe in flight when the process stopped
    restored = make_fleet()
    restored.restore(fleet.snapshot(1.0, 100.0), now=50.0, wall_now=101.0)
    assert restored.probes_due(50.0) == ["d1"]
    assert not restored.is_eligible("d1", 50.0)


def test_restore_rejects_an_engine_set_that_does_not_match() -> None:
    fleet = make_fleet()
    with pytest.raises(ValueError, match="unknown"):
        fleet.restore([EngineRecord(name="d9", role="decode")], 0.0, 0.0)
    with pytest.raises(ValueError, match="role"):
        fleet.restore([EngineRecord(name="d1", role="prefill")], 0.0, 0.0)


# ---------- virtual time: a monitor's schedule and the probe schedule under trio's MockClock ----------
# (Deadlines themselves are tested above with plain floats: the fleet takes `now` as an argument.)

async def test_inconclusive_probes_are_rescheduled_in_virtual_time(
        autojump_clock: MockClock) -> None:
    fleet = make_fleet()
    start = trio.current_time()
    fail(fleet, "d1", FailureClass.STREAM, start)
    probe_started: list[float] = []

    async def run_probe(outcome: str) -> None:
        probe_started.append(trio.current_time())
        await trio.sleep(0.25)  # the probe's own round trips
        fleet.record_probe("d1", outcome, trio.current_time())

    async def monitor() -> None:
        # A monitor pass every second, on an absolute schedule; bounded.
        for pass_number in range(1, 30):
            await trio.sleep_until(start + pass_number * 1.0)
            for _ in fleet.probes_due(trio.current_time()):
                await run_probe("inconclusive" if len(probe_started) < 2 else "success")
            if not fleet.view("d1", trio.current_time()).holds:
                return

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_probe, "inconclusive")  # the probe the action asked for
        nursery.start_soon(monitor)
    # Probe at 0 ends at 0.25: due at 5.25, picked up by the pass at 6; ends at
    # 6.25: due at 11.25, picked up at 12 and succeeds.
    assert [t - start for t in probe_started] == [0.0, 6.0, 12.0]
    assert fleet.is_eligible("d1", trio.current_time())
