"""The fleet's engine set changing under it (a config reload): pure transitions, plain float times."""

from __future__ import annotations

import pytest

from narwhal.control.fleet_writer import FleetWriter
from narwhal.errors import FailureClass, SuccessKind
from narwhal.fleet import EjectionCause, FleetEventKind, HoldKind
from narwhal.obs.router_metrics import RouterMetrics
from tests.test_fleet import EJECT_AFTER, ENGINES, fail, make_fleet


def test_an_added_engine_starts_fresh_and_held_and_enters_only_by_readmission() -> None:
    fleet = make_fleet()
    fleet.drain_events()
    fleet.add_engine("d3", "decode", 10.0, "added by a config reload")
    view = fleet.view("d3", 10.0)
    assert not view.eligible and view.ejected and view.ejected_cause is EjectionCause.ADDED
    assert view.counters.ejections == 0 and not any(view.evidence.values())
    assert "d3" not in fleet.eligible("decode", 10.0)
    # Health alone does not place it: only the readmission chain's readmit does.
    fleet.record_success("d3", SuccessKind.HEALTH_200, 11.0)
    assert "d3" not in fleet.eligible("decode", 11.0)
    fleet.readmit("d3", 12.0)
    assert fleet.eligible("decode", 12.0) == ["d1", "d2", "d3"]
    kinds = [event.kind for event in fleet.drain_events()]
    assert kinds[0] is FleetEventKind.ADDED and FleetEventKind.READMITTED in kinds
    assert FleetEventKind.EJECTED not in kinds  # an addition is not a failure


def test_adding_a_name_the_fleet_has_or_an_unknown_role_is_refused() -> None:
    fleet = make_fleet()
    with pytest.raises(ValueError, match="already"):
        fleet.add_engine("d1", "decode", 1.0, "again")
    with pytest.raises(ValueError, match="role"):
        fleet.add_engine("x1", "router", 1.0, "bad role")


def test_an_engine_being_removed_takes_no_new_work_whatever_clears_later() -> None:
    fleet = make_fleet()
    fleet.start_removal("d1", 1.0, "removed from the config")
    assert fleet.eligible("decode", 1.0) == ["d2"]
    assert fleet.view("d1", 1.0).removing
    # Evidence still counts while its requests finish, but nothing brings it back.
    fleet.record_success("d1", SuccessKind.HEALTH_200, 2.0)
    fleet.readmit("d1", 3.0)
    assert fleet.eligible("decode", 3.0) == ["d2"]
    assert fleet.probe_partners("decode", 3.0, exclude="d2") == []


def test_a_cancelled_removal_places_the_engine_again_as_its_state_allows() -> None:
    fleet = make_fleet()
    fleet.start_removal("d1", 1.0, "removed from the config")
    fleet.cancel_removal("d1", 2.0, "put back unchanged")
    assert fleet.eligible("decode", 2.0) == ["d1", "d2"] and not fleet.view("d1", 2.0).removing
    # An ejected engine stays ejected: a cancelled removal is no readmission.
    fail(fleet, "d2", FailureClass.CONNECTION, 3.0)
    fleet.start_removal("d2", 4.0, "removed")
    fleet.cancel_removal("d2", 5.0, "put back")
    view = fleet.view("d2", 5.0)
    assert view.ejected and not view.removing and fleet.eligible("decode", 5.0) == ["d1"]
    kinds = [event.kind for event in fleet.drain_events()]
    assert kinds.count(FleetEventKind.REMOVAL_CANCELLED) == 2


def test_a_removed_engine_leaves_every_table_and_comes_back_fresh() -> None:
    fleet = make_fleet()
    fail(fleet, "d1", FailureClass.CONNECTION, 1.0)
    assert fleet.view("d1", 1.0).ejected
    fleet.start_removal("d1", 2.0, "removed")
    fleet.remove_engine("d1", 3.0, "gone")
    assert "d1" not in fleet
    assert [record.name for record in fleet.snapshot(3.0, 1000.0)] == ["p1", "p2", "d2"]
    assert [view.name for view in fleet.views(3.0)] == ["p1", "p2", "d2"]
    with pytest.raises(KeyError):
        fleet.view("d1", 3.0)
    fleet.add_engine("d1", "decode", 4.0, "added back")
    view = fleet.view("d1", 4.0)
    assert view.counters.ejections == 0 and view.counters.failures[FailureClass.CONNECTION] == 0
    assert view.ejected_cause is EjectionCause.ADDED
    kinds = [event.kind for event in fleet.drain_events()]
    assert kinds.count(FleetEventKind.REMOVING) == 1 and kinds.count(FleetEventKind.REMOVED) == 1


def test_the_handoff_snapshot_leaves_out_an_engine_being_removed() -> None:
    fleet = make_fleet()
    fleet.start_removal("p2", 1.0, "removed")
    assert [record.name for record in fleet.snapshot(1.0, 1000.0)] == ["p1", "d1", "d2"]


def test_removing_the_last_engine_of_a_role_names_the_capacity_problem() -> None:
    fleet = make_fleet(engines=[("p1", "prefill"), ("d1", "decode")])
    fleet.start_removal("d1", 1.0, "removed")
    assert fleet.capacity_problem(1.0) == "serving capacity exhausted: no eligible decode engine"


def test_reconfigure_changes_the_streak_length_from_now_on() -> None:
    fleet = make_fleet()
    fleet.reconfigure(eject_after=EJECT_AFTER + 2, liveness_misses=3, failure_quarantine_s=None,
                      probe_interval_s=5.0)
    fail(fleet, "p1", FailureClass.CONNECTION, 1.0, times=EJECT_AFTER + 1)
    assert not fleet.view("p1", 1.0).ejected
    fail(fleet, "p1", FailureClass.CONNECTION, 1.0, times=1)
    assert fleet.view("p1", 1.0).ejected
    with pytest.raises(ValueError):
        fleet.reconfigure(eject_after=0, liveness_misses=3, failure_quarantine_s=None, probe_interval_s=5.0)


def test_the_writer_drops_evidence_about_an_engine_it_no_longer_tracks() -> None:
    writer = FleetWriter(make_fleet(), RouterMetrics())
    writer.start_removal("d1", 1.0, "removed")
    writer.remove_engine("d1", 2.0, "gone")
    assert writer.record_failure("d1", FailureClass.CONNECTION, 3.0) == []
    assert writer.record_success("d1", SuccessKind.HEALTH_200, 3.0) == []
    assert writer.add_hold("d1", HoldKind.OPERATOR_DRAIN, "late", 3.0) == []
    assert writer.clear_hold("d1", HoldKind.OPERATOR_DRAIN, 3.0) is False
    # A health sweep started before the removal still lands, for the others.
    writer.record_health_sweep({name: True for name, _ in ENGINES}, 3.0)
    assert not writer.knows("d1") and writer.knows("d2")
