"""The engine registry (pure: the set, its difference, the removal deadline) and its shell (removals, the tables)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import pytest
import trio

from narwhal.config import parse_config
from narwhal.control.engine_set import EngineSet, EngineSetListener, FleetFollower
from narwhal.control.fleet_writer import FleetWriter
from narwhal.fleet import Fleet
from narwhal.fleet.registry import (
    EngineEntry,
    EngineRegistry,
    diff_entries,
    entries_from_config,
    removal_deadline,
)
from narwhal.obs.router_metrics import RouterMetrics
from tests.test_config import GOOD

GRACE_S = 30.0


def entry(name: str, port: int, role: str = "decode") -> EngineEntry:
    return EngineEntry(name=name, url=f"http://127.0.0.1:{port}", role=role, model="m")  # type: ignore[arg-type]


P1, D1, D2 = entry("p1", 9001, "prefill"), entry("d1", 9002), entry("d2", 9003)
D1_MOVED = entry("d1", 9102)


def kinds(registry: EngineRegistry) -> list[tuple[str, str]]:
    return [(str(event.kind), event.entry.name) for event in registry.drain_events()]


def test_the_config_file_gives_the_entries_with_the_fleets_model_and_source_file() -> None:
    config = parse_config(GOOD)
    entries = entries_from_config(config)
    assert [(e.name, e.role, e.model, e.source) for e in entries] == [
        (spec.name, spec.role, config.fleet.model, "file") for spec in config.engines]
    assert entries[0].spec() == config.engines[0]
    # An engine's own model wins over [fleet] model.
    own = parse_config(GOOD.replace('role = "decode"', 'role = "decode"\nmodel = "m2"').replace(
        'role = "prefill"', 'role = "prefill"\nmodel = "m2"'))
    assert {e.model for e in entries_from_config(own)} == {"m2"}


def test_the_difference_matches_by_name_and_a_changed_entry_is_a_removal_and_an_addition() -> None:
    diff = diff_entries([P1, D1, D2], [D2, D1_MOVED, entry("d3", 9004)])
    assert diff.added == ["d1", "d3"]
    assert diff.removed == ["p1", "d1"]
    assert diff.changed == ["d1"]
    assert diff_entries([P1, D1], [P1, D1]) == diff_entries([], [])
    # The model is part of an engine: another model is another engine.
    assert diff_entries([D1], [EngineEntry(name="d1", url=D1.url, role="decode", model="other")]).changed == ["d1"]


def test_the_removal_deadline_is_the_grace_period_after_the_removal_began() -> None:
    assert removal_deadline(100.0, GRACE_S) == 130.0
    registry = EngineRegistry([P1, D1, D2], grace_s=GRACE_S)
    registry.apply([P1, D2], now=100.0)
    assert dict(registry.leaving) == {"d1": 130.0}


def test_a_removal_then_the_same_engine_put_back_cancels_it_and_a_changed_one_waits_for_the_name() -> None:
    registry = EngineRegistry([P1, D1], grace_s=GRACE_S)
    registry.apply([P1], now=1.0)
    assert kinds(registry) == [("removing", "d1")]
    # Still tracked (its requests finish), but no longer served.
    assert "d1" in registry and [e.name for e in registry.serving()] == ["p1"]
    registry.apply([P1, D1], now=2.0)
    assert kinds(registry) == [("removal_cancelled", "d1")] and not registry.leaving
    # Moved: the old d1 leaves first; the new one is added once it did.
    diff = registry.apply([P1, D1_MOVED], now=3.0)
    assert diff.changed == ["d1"] and kinds(registry) == [("removing", "d1")]
    assert registry.specs["d1"].url == D1.url
    registry.finish_removal("d1")
    assert kinds(registry) == [("removed", "d1"), ("added", "d1")]
    assert registry.specs["d1"].url == D1_MOVED.url and not registry.leaving


def test_an_addition_waiting_for_its_name_is_dropped_when_removed_again_and_finishing_twice_is_nothing() -> None:
    registry = EngineRegistry([D1], grace_s=GRACE_S)
    registry.apply([D1_MOVED], now=1.0)
    registry.apply([], now=2.0)  # the waiting d1 is dropped; the old one goes on leaving
    assert kinds(registry) == [("removing", "d1")] and dict(registry.leaving) == {"d1": 1.0 + GRACE_S}
    registry.finish_removal("d1")
    registry.finish_removal("d1")
    assert kinds(registry) == [("removed", "d1")] and registry.entries() == []


class Recorder(EngineSetListener):
    def __init__(self, name: str, heard: list[tuple[str, str, str]]) -> None:
        self.name, self.heard = name, heard

    def on_added(self, entry: EngineEntry) -> None:
        self.heard.append((self.name, "added", entry.name))

    def on_removed(self, entry: EngineEntry) -> None:
        self.heard.append((self.name, "removed", entry.name))


class Counts(dict[str, int]):
    def __missing__(self, name: str) -> int:
        return 0


def engine_set(in_flight: Counts, heard: list[tuple[str, str, str]],
               clock: Callable[[], float] = trio.current_time) -> tuple[EngineSet, FleetWriter]:
    registry = EngineRegistry([P1, D1], grace_s=GRACE_S)
    fleet = FleetWriter(Fleet([("p1", "prefill"), ("d1", "decode")], eject_after=3, liveness_misses=3,
                              failure_quarantine_s=None, probe_interval_s=5.0), RouterMetrics())
    listeners = [FleetFollower(fleet, in_flight, grace_s=GRACE_S, clock=clock), Recorder("a", heard),
                 Recorder("b", heard)]
    return EngineSet(registry, listeners, in_flight=in_flight, clock=clock), fleet


async def test_a_removed_engine_with_requests_in_flight_leaves_at_its_deadline_not_later(
        nursery: trio.Nursery, autojump_clock: trio.testing.MockClock) -> None:
    in_flight, heard = Counts(d1=2), []
    engines, fleet = engine_set(in_flight, heard)
    await nursery.start(engines.run)
    started = trio.current_time()
    engines.apply([P1])
    assert fleet.view("d1", started).removing
    await trio.sleep(GRACE_S - 0.1)
    assert fleet.knows("d1") and heard == []
    await trio.sleep(0.2)
    # Cut at the deadline, its requests still in flight; every table heard, in order.
    assert not fleet.knows("d1") and "d1" not in engines.registry
    assert heard == [("a", "removed", "d1"), ("b", "removed", "d1")]


async def test_a_removed_engine_leaves_as_soon_as_its_last_request_finished(
        nursery: trio.Nursery, autojump_clock: trio.testing.MockClock) -> None:
    in_flight, heard = Counts(d1=1), []
    engines, fleet = engine_set(in_flight, heard)
    await nursery.start(engines.run)
    engines.apply([P1])
    await trio.sleep(1.0)
    assert fleet.knows("d1")
    in_flight["d1"] = 0
    await trio.sleep(0.1)
    assert not fleet.knows("d1") and trio.current_time() < GRACE_S


async def test_the_same_engine_put_back_calls_its_removal_off_and_nothing_is_cut_later(
        nursery: trio.Nursery, autojump_clock: trio.testing.MockClock) -> None:
    in_flight, heard = Counts(d1=1), []
    engines, fleet = engine_set(in_flight, heard)
    await nursery.start(engines.run)
    engines.apply([P1])
    await trio.sleep(5.0)
    engines.apply([P1, D1])
    await trio.sleep(GRACE_S * 2)
    assert fleet.knows("d1") and not fleet.view("d1", trio.current_time()).removing and heard == []


def test_before_running_a_removal_completes_at_once_and_a_moved_engine_comes_back_held() -> None:
    heard: list[tuple[str, str, str]] = []
    engines, fleet = engine_set(Counts(), heard, clock=lambda: 1.0)
    engines.apply([P1, D1_MOVED])
    assert heard == [("a", "removed", "d1"), ("b", "removed", "d1"), ("a", "added", "d1"), ("b", "added", "d1")]
    view = fleet.view("d1", 1.0)
    assert view.ejected and str(view.ejected_cause) == "added"


@pytest.mark.parametrize("grace_s", [0.5, 30.0])
def test_the_fleet_logs_what_a_removal_waits_for_and_how_long(grace_s: float,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    fleet = FleetWriter(Fleet([("d1", "decode")], eject_after=3, liveness_misses=3, failure_quarantine_s=None,
                              probe_interval_s=5.0), RouterMetrics())
    FleetFollower(fleet, Counts(d1=4), grace_s=grace_s, clock=lambda: 1.0).on_removing(D1)
    assert fleet.view("d1", 1.0).removing
    [removing] = [line for line in map(json.loads, (r.getMessage() for r in caplog.records
                                                    if r.name == "narwhal.events"))
                  if line["event"] == "engine_removing"]
    assert removing["reason"].endswith(f"leaves once its 4 request(s) in flight finish (cut after {grace_s:g} s)")
