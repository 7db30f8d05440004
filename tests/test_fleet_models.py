"""The fleet's rules per model pool: last-engine protection, drains, capacity and probe partners are counted
per (model, role), never across models. The pure Fleet, plain float times."""

from __future__ import annotations

from narwhal.errors import FailureClass
from narwhal.fleet import Fleet, FleetEventKind, HoldKind

# Model a: one prefill, one decode engine. Model b: one prefill, two decode engines.
ENGINES = [("pa", "prefill", "a"), ("da", "decode", "a"),
           ("pb", "prefill", "b"), ("db1", "decode", "b"), ("db2", "decode", "b")]


def make_fleet(engines: list[tuple[str, str, str]] = ENGINES) -> Fleet:
    return Fleet(engines, eject_after=3, liveness_misses=3, failure_quarantine_s=30.0, probe_interval_s=5.0)


def deferred(fleet: Fleet, name: str, now: float) -> list[HoldKind]:
    return [hold.kind for hold in fleet.view(name, now).holds if hold.deferred]


def test_last_engine_protection_in_a_does_not_protect_an_engine_of_b_and_bs_last_is_protected_on_its_own() -> None:
    fleet = make_fleet()
    # da is model a's last decode engine: its drift hold is deferred, though b has two eligible decode engines.
    fleet.add_hold("da", HoldKind.PERFORMANCE_DRIFT, "slow", 0.0)
    assert fleet.eligible("decode", 0.0, "a") == ["da"]
    assert deferred(fleet, "da", 0.0) == [HoldKind.PERFORMANCE_DRIFT]
    # a's protected engine counts for nothing in b: db1's hold applies at once (db2 still serves b).
    fleet.add_hold("db1", HoldKind.PERFORMANCE_DRIFT, "slow", 1.0)
    assert fleet.eligible("decode", 1.0, "b") == ["db2"] and deferred(fleet, "db1", 1.0) == []
    # db2 is now b's last decode engine: protected, although model a's da is eligible.
    fleet.add_hold("db2", HoldKind.PERFORMANCE_DRIFT, "slow", 2.0)
    assert fleet.eligible("decode", 2.0, "b") == ["db2"]
    assert deferred(fleet, "db2", 2.0) == [HoldKind.PERFORMANCE_DRIFT]
    assert fleet.eligible("decode", 2.0) == ["da", "db2"]
    reasons = {event.engine: event.reason for event in fleet.drain_events()
               if event.kind is FleetEventKind.HOLD_DEFERRED}
    assert "last eligible decode (model 'a') engine" in reasons["da"]
    assert "last eligible decode (model 'b') engine" in reasons["db2"]


def test_a_temporary_quarantine_is_deferred_on_the_last_engine_of_its_own_model_only() -> None:
    fleet = make_fleet()
    for _ in range(3):
        fleet.record_failure("da", FailureClass.TIMEOUT, 0.0)
        fleet.record_failure("db1", FailureClass.TIMEOUT, 0.0)
    assert deferred(fleet, "da", 0.0) == [HoldKind.FAILURE_QUARANTINE]
    assert fleet.eligible("decode", 0.0, "a") == ["da"]
    assert deferred(fleet, "db1", 0.0) == [] and fleet.eligible("decode", 0.0, "b") == ["db2"]


def test_a_drain_in_a_leaves_bs_placement_untouched() -> None:
    fleet = make_fleet()
    before = fleet.eligible_pools(0.0)["b"]
    # An operator drain is no protected hold: it empties a's decode pool.
    fleet.add_hold("da", HoldKind.OPERATOR_DRAIN, "upgrade", 0.0)
    assert fleet.eligible("decode", 0.0, "a") == []
    assert fleet.eligible_pools(0.0)["b"] == before == {"prefill": ["pb"], "decode": ["db1", "db2"]}
    assert fleet.eligible("decode", 0.0) == ["db1", "db2"]
    assert fleet.view("db1", 0.0).holds == [] and fleet.view("db2", 0.0).holds == []
    assert fleet.capacity_problem(0.0, "b") is None
    assert fleet.capacity_problem(0.0, "a") == "serving capacity exhausted: no eligible decode engine of model 'a'"
    # Model b can serve: the fleet as a whole has no capacity problem.
    assert fleet.capacity_problem(0.0) is None
    assert fleet.capacity_problems(0.0) == {"a": "serving capacity exhausted: no eligible decode engine of model 'a'"}
    # The drain lifted: a serves again, b never noticed.
    fleet.clear_hold("da", HoldKind.OPERATOR_DRAIN, 1.0)
    assert fleet.eligible_pools(1.0) == {"a": {"prefill": ["pa"], "decode": ["da"]}, "b": before}


def test_the_whole_fleet_has_a_capacity_problem_only_when_no_model_can_serve() -> None:
    fleet = make_fleet()
    fleet.eject("da", "dead", 0.0)
    assert fleet.capacity_problem(0.0) is None
    fleet.eject("pb", "dead", 0.0)
    problem = fleet.capacity_problem(0.0)
    assert problem is not None and problem.startswith("serving capacity exhausted: no model can serve")
    assert "a: no eligible decode engine" in problem and "b: no eligible prefill engine" in problem
    assert set(fleet.capacity_problems(0.0)) == {"a", "b"}
    assert fleet.capacity_problem(0.0, "c") == "serving capacity exhausted: model 'c' has no engines"


def test_probe_partners_come_from_the_suspects_own_model_only() -> None:
    fleet = make_fleet()
    assert fleet.probe_partners("decode", 0.0, exclude="pb") == ["db1", "db2"]
    assert fleet.probe_partners("decode", 0.0, exclude="pa") == ["da"]
    assert fleet.probe_partners("prefill", 0.0, exclude="db1") == ["pb"]
    # a's only decode engine drained: no partner in a (the probe is inconclusive), and none from b's eligible ones.
    fleet.add_hold("da", HoldKind.OPERATOR_DRAIN, "upgrade", 1.0)
    assert fleet.probe_partners("decode", 1.0, exclude="pa") == []
    # A drift hold on a's last decode engine is deferred: it still serves, and pairs.
    fleet.clear_hold("da", HoldKind.OPERATOR_DRAIN, 2.0)
    fleet.add_hold("da", HoldKind.PERFORMANCE_DRIFT, "slow", 2.0)
    assert fleet.probe_partners("decode", 2.0, exclude="pa") == ["da"]
    fleet.eject("da", "dead", 3.0)
    assert fleet.probe_partners("decode", 3.0, exclude="pa") == []
