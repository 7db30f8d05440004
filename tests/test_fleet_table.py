"""The spec's two tables, walked row by row against the fleet state machine."""

from __future__ import annotations

import itertools

import pytest

from narwhal.errors import FailureClass, SuccessKind
from narwhal.fleet import (
    DRAIN_HOLDS,
    EVIDENCE_CLEARED,
    FAILURE_ACTIONS,
    LIVENESS,
    QUARANTINE_CLEARED_BY_HEALTH,
    Action,
    ActionKind,
    Fleet,
    FleetEventKind,
    HoldKind,
)
from narwhal.fleet.tables import PROBE_LEG_INCONCLUSIVE, PROBE_PARTNER_HOLDS

ENGINES = [("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"), ("d2", "decode")]
NOW = 100.0


def make_fleet(eject_after: int = 3, liveness_misses: int = 10) -> Fleet:
    return Fleet(ENGINES, eject_after=eject_after, liveness_misses=liveness_misses,
                 failure_quarantine_s=None, probe_interval_s=5.0)


def fail(fleet: Fleet, name: str, failure_class: FailureClass, times: int) -> list[Action]:
    actions: list[Action] = []
    for _ in range(times):
        actions += fleet.record_failure(name, failure_class, NOW)
    return actions


def test_failure_table_is_the_spec_table() -> None:
    # Copied from the spec's "Failure evidence" table, one row per line.
    assert FAILURE_ACTIONS == {
        "connection": "eject",                      # Eject the engine
        "timeout": "health_probe",                  # Run a health probe
        "stream": "inference_probe",                # Pause new requests and probe prefill/decode
        "overload": "health_probe",                 # Run a health probe
        "inference_status": "inference_probe",      # Pause new requests and probe prefill/decode
        "kv_handoff": "inference_probe",            # Pause new requests and probe prefill/decode
    }
    assert set(FAILURE_ACTIONS) == set(FailureClass)


def test_clearing_table_is_the_spec_table() -> None:
    # Copied from the spec's "Clearing failure evidence" table.
    assert {kind: set(cleared) for kind, cleared in EVIDENCE_CLEARED.items()} == {
        "client_4xx": {"connection", "inference_status"},
        "health_200": {"connection", "timeout", "overload", "liveness"},
        "prefill_handoff": {"connection", "inference_status", "kv_handoff"},
        "decode_terminal": {"connection", "inference_status", "stream"},
    }
    assert set(EVIDENCE_CLEARED) == set(SuccessKind)


@pytest.mark.parametrize("eject_after", [1, 3])
@pytest.mark.parametrize("failure_class", list(FAILURE_ACTIONS))
def test_failure_row_takes_no_action_below_eject_after(failure_class: FailureClass,
                                                       eject_after: int) -> None:
    fleet = make_fleet(eject_after)
    assert fail(fleet, "d1", failure_class, eject_after - 1) == []
    view = fleet.view("d1", NOW)
    assert view.evidence[failure_class] == eject_after - 1
    assert view.eligible and not view.ejected and view.holds == []


@pytest.mark.parametrize("eject_after", [1, 3])
@pytest.mark.parametrize(("failure_class", "action_kind"), list(FAILURE_ACTIONS.items()))
def test_failure_row_action_when_streak_reaches_eject_after(
        failure_class: FailureClass, action_kind: ActionKind, eject_after: int) -> None:
    fleet = make_fleet(eject_after)
    fail(fleet, "d1", failure_class, eject_after - 1)
    actions = fleet.record_failure("d1", failure_class, NOW)
    assert [(a.kind, a.engine, a.failure_class) for a in actions] == [(action_kind, "d1", failure_class)]
    assert str(failure_class) in actions[0].reason
    view = fleet.view("d1", NOW)
    if action_kind is ActionKind.EJECT:
        # "Eject the engine"
        assert view.ejected and not view.eligible and view.holds == []
    elif action_kind is ActionKind.HEALTH_PROBE:
        # "Run a health probe": nothing else changes (no quarantine configured).
        assert not view.ejected and view.eligible and view.holds == []
    else:
        # "Pause new requests and probe prefill/decode"
        assert not view.ejected and not view.eligible
        assert [h.kind for h in view.holds] == [HoldKind.INFERENCE_VERIFICATION]
        assert view.probe_in_flight
    # The peer of the same role is untouched.
    assert fleet.is_eligible("d2", NOW)


@pytest.mark.parametrize(("failure_class", "action_kind"), list(FAILURE_ACTIONS.items()))
def test_failure_row_action_fires_once_per_eject_after_failures(
        failure_class: FailureClass, action_kind: ActionKind) -> None:
    fleet = make_fleet(eject_after=3)
    assert len(fail(fleet, "d1", failure_class, 3)) == 1
    # Past the threshold: no repeat until the streak reaches the next multiple,
    # and never a second ejection or a second probe while one is pending.
    later = fail(fleet, "d1", failure_class, 3)
    if action_kind is ActionKind.HEALTH_PROBE:
        assert [(a.kind, a.failure_class) for a in later] == [(action_kind, failure_class)]
        assert "streak reached 6" in later[0].reason
    else:
        assert later == []


@pytest.mark.parametrize(("first", "second"), list(itertools.permutations(FailureClass, 2)))
def test_streaks_of_different_classes_are_independent(first: FailureClass,
                                                      second: FailureClass) -> None:
    fleet = make_fleet(eject_after=3)
    assert fail(fleet, "d1", first, 2) + fail(fleet, "d1", second, 2) == []
    evidence = fleet.view("d1", NOW).evidence
    assert evidence[first] == 2 and evidence[second] == 2
    assert sum(evidence.values()) == 4
    actions = fleet.record_failure("d1", second, NOW)
    assert [(a.kind, a.failure_class) for a in actions] == [(FAILURE_ACTIONS[second], second)]
    assert fleet.view("d1", NOW).evidence[first] == 2


@pytest.mark.parametrize("failure_class", list(FailureClass))
def test_streaks_of_different_engines_are_independent(failure_class: FailureClass) -> None:
    fleet = make_fleet(eject_after=3)
    # Two failures on each of four engines: twice eject_after in all, no action.
    for name, _ in ENGINES:
        assert fail(fleet, name, failure_class, 2) == []
    for name, _ in ENGINES:
        assert fleet.view(name, NOW).evidence[failure_class] == 2
    actions = fleet.record_failure("p1", failure_class, NOW)
    assert [a.engine for a in actions] == ["p1"]
    assert fleet.view("p2", NOW).evidence[failure_class] == 2


@pytest.mark.parametrize(("success", "cleared"), list(EVIDENCE_CLEARED.items()))
def test_success_row_clears_exactly_its_evidence(success: SuccessKind, cleared: tuple) -> None:
    fleet = make_fleet(eject_after=3, liveness_misses=10)
    for failure_class in FailureClass:
        fail(fleet, "d1", failure_class, 2)
    fleet.record_health_sweep({"p1": True, "p2": True, "d2": True}, NOW)  # d1 misses one
    fleet.drain_events()
    assert fleet.record_success("d1", success, NOW) == []
    view = fleet.view("d1", NOW)
    for failure_class in FailureClass:
        assert view.evidence[failure_class] == (0 if failure_class in cleared else 2), failure_class
    assert view.liveness_misses == (0 if LIVENESS in cleared else 1)
    events = fleet.drain_events()
    assert all(e.kind is FleetEventKind.EVIDENCE_CLEARED and e.engine == "d1" for e in events)
    assert {e.failure_class or LIVENESS for e in events} == set(cleared)


def test_a_cleared_streak_reads_as_english_whatever_its_class() -> None:
    # "cleared a inference_status streak" / "a overload streak": the class is a name, not a word.
    fleet = make_fleet(eject_after=3, liveness_misses=10)
    for failure_class in FailureClass:
        fail(fleet, "d1", failure_class, 2)
    fleet.drain_events()
    for success in SuccessKind:
        fleet.record_success("d1", success, NOW)
    cleared = [e for e in fleet.drain_events() if e.failure_class is not None]
    assert {e.failure_class for e in cleared} == set(FailureClass)
    for event in cleared:
        assert event.reason.endswith(f" cleared the {event.failure_class} streak of 2"), event.reason


@pytest.mark.parametrize("success", list(SuccessKind))
def test_success_row_touches_only_its_engine(success: SuccessKind) -> None:
    fleet = make_fleet()
    for name, _ in ENGINES:
        fail(fleet, name, FailureClass.CONNECTION, 2)
    fleet.record_success("d1", success, NOW)
    assert fleet.view("d1", NOW).evidence[FailureClass.CONNECTION] == 0
    for name in ("p1", "p2", "d2"):
        assert fleet.view(name, NOW).evidence[FailureClass.CONNECTION] == 2


@pytest.mark.parametrize(("success", "cleared"), list(EVIDENCE_CLEARED.items()))
def test_success_row_resets_the_count_toward_eject_after(success: SuccessKind, cleared: tuple) -> None:
    fleet = make_fleet(eject_after=3)
    for failure_class in (c for c in FailureClass if c in cleared):
        fail(fleet, "d1", failure_class, 2)
        fleet.record_success("d1", success, NOW)
        # Two more are not consecutive with the first two: still no action.
        assert fail(fleet, "d1", failure_class, 2) == []


# ---------- what may clear a failure quarantine (issue 10, rule 1) ----------

QUARANTINE_S = 60.0


def quarantine_fleet() -> Fleet:
    return Fleet(ENGINES, eject_after=1, liveness_misses=2, failure_quarantine_s=QUARANTINE_S,
                 probe_interval_s=5.0)


def quarantine_cause(fleet: Fleet, name: str, now: float) -> object:
    [hold] = [h for h in fleet.view(name, now).holds if h.kind is HoldKind.FAILURE_QUARANTINE]
    return hold.cause


def test_a_health_200_clears_the_quarantines_the_health_row_names() -> None:
    # The health 200 row of the clearing table, read for quarantines.
    assert QUARANTINE_CLEARED_BY_HEALTH == {"connection", "timeout", "overload", "liveness"}
    assert QUARANTINE_CLEARED_BY_HEALTH == set(EVIDENCE_CLEARED[SuccessKind.HEALTH_200])


@pytest.mark.parametrize("failure_class", list(FailureClass))
def test_an_ejection_quarantine_is_cleared_by_health_only_when_its_cause_is_on_the_health_row(
        failure_class: FailureClass) -> None:
    fleet = quarantine_fleet()
    fleet.eject("d1", "confirmed failure", NOW, failure_class)
    assert quarantine_cause(fleet, "d1", NOW) == failure_class
    fleet.record_success("d1", SuccessKind.HEALTH_200, NOW + 1)
    fleet.record_health_sweep({name: True for name, _ in ENGINES}, NOW + 2)
    by_health = failure_class in EVIDENCE_CLEARED[SuccessKind.HEALTH_200]
    assert fleet.readmission_allowed("d1", NOW + 2) is by_health
    assert fleet.quarantine_needs_inference_check("d1", NOW + 2) is not by_health
    # Whatever the cause, a successful inference check or the deadline ends it.
    fleet.record_probe("d1", "success", NOW + 3)
    assert fleet.readmission_allowed("d1", NOW + 3)
    other = quarantine_fleet()
    other.eject("d1", "confirmed failure", NOW, failure_class)
    assert other.readmission_allowed("d1", NOW + QUARANTINE_S)


@pytest.mark.parametrize("failure_class", [FailureClass.STREAM, FailureClass.INFERENCE_STATUS,
                                           FailureClass.KV_HANDOFF])
def test_a_failed_probe_leg_quarantines_with_the_legs_class_and_health_does_not_clear_it(
        failure_class: FailureClass) -> None:
    fleet = quarantine_fleet()
    [action] = fleet.record_failure("d1", failure_class, NOW)
    assert action.kind is ActionKind.INFERENCE_PROBE
    fleet.record_probe("d1", "failed", NOW + 1, leg="decode", reason="HTTP 500", failure_class=failure_class)
    assert fleet.view("d1", NOW + 1).ejected
    assert quarantine_cause(fleet, "d1", NOW + 1) == failure_class
    for t in range(2, 30):
        fleet.record_health_sweep({name: True for name, _ in ENGINES}, NOW + t)
    assert not fleet.readmission_allowed("d1", NOW + 29)
    assert fleet.readmission_allowed("d1", NOW + 1 + QUARANTINE_S)


def test_liveness_and_temporary_quarantines_record_their_cause_and_health_clears_them() -> None:
    fleet = quarantine_fleet()
    for t in (0.0, 1.0):
        fleet.record_health_sweep({"d1": True, "p1": True, "p2": True}, NOW + t)  # d2 silent
    assert fleet.view("d2", NOW + 1).ejected and quarantine_cause(fleet, "d2", NOW + 1) == LIVENESS
    fleet.record_failure("p1", FailureClass.OVERLOAD, NOW + 1)
    assert quarantine_cause(fleet, "p1", NOW + 1) == FailureClass.OVERLOAD
    fleet.record_health_sweep({name: True for name, _ in ENGINES}, NOW + 2)
    assert fleet.readmission_allowed("d2", NOW + 2)
    assert [h.kind for h in fleet.view("p1", NOW + 2).holds] == []


def test_the_quarantine_cause_survives_a_snapshot_and_restore() -> None:
    fleet = quarantine_fleet()
    fleet.eject("d1", "decode failed", NOW, FailureClass.INFERENCE_STATUS)
    restored = quarantine_fleet()
    restored.restore(fleet.snapshot(NOW, 5000.0), NOW + 1, 5001.0)
    assert quarantine_cause(restored, "d1", NOW + 1) == FailureClass.INFERENCE_STATUS
    restored.record_success("d1", SuccessKind.HEALTH_200, NOW + 2)
    assert not restored.readmission_allowed("d1", NOW + 2)


# ---------- probe legs and partners (issue 10, rules 2 and 3) ----------

def test_overload_and_timeout_make_a_probe_leg_inconclusive_and_nothing_else_does() -> None:
    # "A 408 or 429 (overload) or a control-pool timeout on a verification-probe leg makes
    # the leg inconclusive": every other class fails the leg.
    assert PROBE_LEG_INCONCLUSIVE == {"overload", "timeout"}


def test_a_probe_may_pair_with_peers_held_by_these_holds_only() -> None:
    assert PROBE_PARTNER_HOLDS == {"inference_verification", "failure_quarantine", "performance_drift"}
    assert not PROBE_PARTNER_HOLDS & DRAIN_HOLDS


def test_probe_partners_prefer_eligible_engines_then_the_longest_held() -> None:
    fleet = Fleet(ENGINES, eject_after=1, liveness_misses=2, failure_quarantine_s=None, probe_interval_s=5.0)
    assert fleet.probe_partners("prefill", NOW, exclude="d1") == ["p1", "p2"]
    fleet.add_hold("p2", HoldKind.INFERENCE_VERIFICATION, "suspect", NOW)
    fleet.add_hold("p1", HoldKind.INFERENCE_VERIFICATION, "suspect", NOW + 1)
    # No prefill engine is eligible: the held ones, longest held first; never the suspect itself.
    assert fleet.eligible("prefill", NOW + 2) == []
    assert fleet.probe_partners("prefill", NOW + 2, exclude="d1") == ["p2", "p1"]
    assert fleet.probe_partners("prefill", NOW + 2, exclude="p2") == ["p1"]
    fleet.add_hold("p2", HoldKind.OPERATOR_DRAIN, "operator", NOW + 2)
    fleet.eject("p1", "dead", NOW + 2)
    assert fleet.probe_partners("prefill", NOW + 3, exclude="d1") == []
