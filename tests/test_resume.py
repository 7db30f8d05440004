"""--resume: apply the handoff only when schema and engine set match (spec: "Resume
validation"; drains, ejections and holds survive a restart)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from narwhal.config import Config, EngineSpec
from narwhal.errors import FailureClass
from narwhal.fleet import EngineRecord, Fleet, HoldKind
from narwhal.stages.persistence import HandoffExtra, PersistenceStage
from narwhal.state.handoff import EngineSetEntry, LeaseOwnership, encode_document, read_document, write_atomic
from narwhal.state.resume import ResumePlan, apply_resume, engine_set_difference, plan_resume

ENGINES = [("p1", 9001, "prefill"), ("p2", 9002, "prefill"), ("p3", 9003, "prefill"),
           ("d1", 9011, "decode"), ("d2", 9012, "decode")]
OLD_NOW, OLD_WALL = 100.0, 1_000_000.0
QUARANTINE_S = 30.0


def make_config(engines=ENGINES) -> Config:
    return Config(engines=[EngineSpec(name=n, url=f"http://127.0.0.1:{port}", role=r) for n, port, r in engines])


def make_fleet(config: Config) -> Fleet:
    return Fleet([(spec.name, spec.role) for spec in config.engines], eject_after=2, liveness_misses=3,
                 failure_quarantine_s=QUARANTINE_S, probe_interval_s=5.0)


def troubled_fleet(config: Config) -> Fleet:
    """A fleet with a drain, a temporary quarantine, evidence, an ejection and a verification hold."""
    fleet = make_fleet(config)
    now = OLD_NOW
    fleet.add_hold("p1", HoldKind.OPERATOR_DRAIN, "operator drain", now)
    for _ in range(2):
        fleet.record_failure("p2", FailureClass.TIMEOUT, now)  # health probe + temporary quarantine
        fleet.record_failure("d1", FailureClass.CONNECTION, now)  # ejected + quarantine
        fleet.record_failure("d2", FailureClass.INFERENCE_STATUS, now)  # verification hold
    fleet.record_failure("p3", FailureClass.STREAM, now)
    fleet.record_health_sweep({"p1": True, "d1": False, "d2": True}, now)  # p2, p3 silent
    fleet.record_probe("d2", "inconclusive", now)
    return fleet


async def write_handoff(path: Path, config: Config, fleet: Fleet, **extra) -> None:
    stage = PersistenceStage(path=path, router_id="old", fleet=fleet, config=config,
                             extra=(lambda: HandoffExtra(**extra)) if extra else None,
                             clock=lambda: OLD_NOW, wall_clock=lambda: OLD_WALL)
    await stage.run(41)


def hold_kinds(fleet: Fleet, name: str, now: float) -> list[HoldKind]:
    return [hold.kind for hold in fleet.view(name, now).holds]


# ----- a matching handoff is applied -----

async def test_matching_handoff_is_applied_and_state_survives(tmp_path: Path) -> None:
    config = make_config()
    old = troubled_fleet(config)
    path = tmp_path / "handoff.json"
    await write_handoff(path, config, old, lease=LeaseOwnership(holder="old", epoch=3), drained=["p1"])

    plan = plan_resume(path, config)
    assert plan.applied and plan.reason is None
    assert plan.document == read_document(path)
    assert plan.document.lease == LeaseOwnership(holder="old", epoch=3) and plan.document.drained == ["p1"]

    # The new router's monotonic clock has another origin; 5 s of wall time passed.
    new_now, new_wall = 7.0, OLD_WALL + 5.0
    fresh = make_fleet(config)
    apply_resume(plan, fresh, new_now, new_wall)

    # Same state at the same wall-clock instant, with times mapped between the two clocks.
    def without_probe_time(records: list[EngineRecord]) -> list[EngineRecord]:
        return [msgspec.structs.replace(r, next_probe_at_wall=None) for r in records]

    assert (without_probe_time(fresh.snapshot(new_now, new_wall))
            == without_probe_time(old.snapshot(OLD_NOW + 5.0, new_wall)))
    for role in ("prefill", "decode"):
        assert fresh.eligible(role, new_now) == old.eligible(role, OLD_NOW + 5.0)
    assert fresh.eligible("prefill", new_now) == ["p3"]
    assert fresh.eligible("decode", new_now) == []

    # The drain survives the restart.
    assert hold_kinds(fresh, "p1", new_now) == [HoldKind.OPERATOR_DRAIN]
    # The ejection and its quarantine survive, with the deadline still 25 s away.
    d1 = fresh.view("d1", new_now)
    assert d1.ejected and d1.ejected_reason == old.view("d1", OLD_NOW).ejected_reason
    [quarantine] = d1.holds
    assert quarantine.kind is HoldKind.FAILURE_QUARANTINE and quarantine.deadline == new_now + 25.0
    assert not d1.readmission_allowed
    # The temporary quarantine and the inference-verification hold survive.
    assert hold_kinds(fresh, "p2", new_now) == [HoldKind.FAILURE_QUARANTINE]
    assert hold_kinds(fresh, "d2", new_now) == [HoldKind.INFERENCE_VERIFICATION]
    # Counters: streaks by class, liveness misses, ejection and probe counts.
    assert fresh.view("p3", new_now).evidence[FailureClass.STREAM] == 1
    assert fresh.view("p3", new_now).liveness_misses == 1
    assert fresh.view("d1", new_now).counters.ejections == 1
    assert fresh.view("d2", new_now).counters.probes["inconclusive"] == 1

    # Out stays out until readmitted: the temporary quarantine ends at its deadline,
    # the ejection does not.
    later = new_now + 26.0
    assert "p2" in fresh.eligible("prefill", later)
    assert not fresh.is_eligible("d1", later) and fresh.readmission_allowed("d1", later)
    fresh.readmit("d1", later)
    assert fresh.is_eligible("d1", later)


async def test_deadlines_passed_while_down_come_back_expired(tmp_path: Path) -> None:
    config = make_config()
    path = tmp_path / "handoff.json"
    await write_handoff(path, config, troubled_fleet(config))
    fresh = make_fleet(config)
    apply_resume(plan_resume(path, config), fresh, 3.0, OLD_WALL + QUARANTINE_S + 60.0)
    d1 = fresh.view("d1", 3.0)
    assert d1.ejected and d1.holds == [] and d1.readmission_allowed
    assert fresh.view("p2", 3.0).holds == [] and fresh.is_eligible("p2", 3.0)
    # Holds without a deadline do not expire.
    assert hold_kinds(fresh, "p1", 3.0) == [HoldKind.OPERATOR_DRAIN]
    assert hold_kinds(fresh, "d2", 3.0) == [HoldKind.INFERENCE_VERIFICATION]


async def test_applied_plan_fields_for_the_log_event(tmp_path: Path) -> None:
    config = make_config()
    path = tmp_path / "handoff.json"
    await write_handoff(path, config, troubled_fleet(config))
    fields = plan_resume(path, config).event_fields()
    assert fields["writer"] == "old" and fields["pass"] == 41 and fields["written_at"] == OLD_WALL
    assert fields["ejected"] == ["d1"]
    assert fields["holds"] == {"p1": ["operator_drain"], "p2": ["failure_quarantine"],
                               "d1": ["failure_quarantine"], "d2": ["inference_verification"]}


async def test_trailing_slash_in_configured_url_is_the_same_engine(tmp_path: Path) -> None:
    config = make_config()
    path = tmp_path / "handoff.json"
    await write_handoff(path, config, make_fleet(config))
    slashed = Config(engines=[msgspec.structs.replace(spec, url=spec.url + "/") for spec in config.engines])
    assert plan_resume(path, slashed).applied


# ----- anything else starts fresh, with one clear reason -----

def assert_starts_fresh(plan: ResumePlan, reason: str, config: Config) -> None:
    assert not plan.applied and plan.document is None
    assert plan.reason == reason and "\n" not in plan.reason
    assert plan.event_fields() == {"path": plan.path, "reason": reason}
    fresh = make_fleet(config)
    apply_resume(plan, fresh, 1.0, OLD_WALL)
    assert fresh.snapshot(1.0, OLD_WALL) == make_fleet(config).snapshot(1.0, OLD_WALL)


async def test_other_schema_is_not_applied(tmp_path: Path) -> None:
    config = make_config()
    path = tmp_path / "handoff.json"
    await write_handoff(path, config, troubled_fleet(config))
    write_atomic(path, encode_document(msgspec.structs.replace(read_document(path), schema=2)))
    assert_starts_fresh(plan_resume(path, config), "handoff not applied: schema 2 differs from 1", config)


@pytest.mark.parametrize(("configured", "difference"), [
    ([("p1", 9001, "prefill"), ("d2", 9012, "decode")], "added d2, removed d1"),
    ([("p1", 9009, "prefill"), ("d1", 9011, "decode")], "changed p1"),
    ([("p1", 9001, "prefill"), ("d1", 9011, "decode"), ("d2", 9012, "decode")], "added d2"),
    ([("p1", 9001, "prefill"), ("p2", 9002, "prefill"), ("d1", 9011, "decode")], "added p2"),
    ([("p1", 9001, "decode"), ("p0", 9000, "prefill"), ("d3", 9013, "decode"), ("d4", 9014, "decode")],
     "added d3, d4, p0, removed d1, changed p1"),
])
async def test_other_engine_set_is_not_applied(tmp_path: Path, configured, difference: str) -> None:
    written = make_config([("p1", 9001, "prefill"), ("d1", 9011, "decode")])
    path = tmp_path / "handoff.json"
    await write_handoff(path, written, make_fleet(written))
    config = make_config(configured)
    assert_starts_fresh(plan_resume(path, config), f"handoff not applied: engine set differs: {difference}", config)


def test_removed_engine_alone_is_a_difference() -> None:
    written = make_config([("p1", 9001, "prefill"), ("p2", 9002, "prefill"), ("d1", 9011, "decode")])
    configured = make_config([("p1", 9001, "prefill"), ("d1", 9011, "decode")])
    saved = [EngineSetEntry(name=spec.name, url=spec.url, role=spec.role) for spec in written.engines]
    assert engine_set_difference(saved, configured.engines) == "removed p2"
    assert engine_set_difference(saved, written.engines) is None


def test_missing_handoff_starts_fresh(tmp_path: Path) -> None:
    config = make_config()
    path = tmp_path / "absent.json"
    assert_starts_fresh(plan_resume(path, config), f"handoff not applied: no handoff at {path}", config)


@pytest.mark.parametrize(("data", "why"), [
    (b"", "empty (a write cut short before its first byte, or not a handoff)"),
    (b'{"schema": 1, "router_id": "old", "pi', "not JSON: cut short (it ends inside the JSON)"),
    (b"\x00\xff garbage", "not JSON: JSON is malformed: invalid character (byte 0)"),
    (b'{"engines": []}', "no schema number: Object missing required field `schema`"),
])
def test_corrupt_handoff_starts_fresh(tmp_path: Path, data: bytes, why: str) -> None:
    config = make_config()
    path = tmp_path / "handoff.json"
    path.write_bytes(data)
    assert_starts_fresh(plan_resume(path, config), f"handoff not applied: unreadable: {why}", config)


async def test_records_outside_the_engine_set_are_unreadable(tmp_path: Path) -> None:
    config = make_config()
    path = tmp_path / "handoff.json"
    await write_handoff(path, config, make_fleet(config))
    document = read_document(path)
    stray = msgspec.structs.replace(document, engines=[*document.engines, EngineRecord(name="zz", role="decode")])
    write_atomic(path, encode_document(stray))
    assert_starts_fresh(plan_resume(path, config),
                        "handoff not applied: unreadable: engine record zz (decode) is not in its engine set", config)
    twice = msgspec.structs.replace(document, engines=[*document.engines, document.engines[0]])
    write_atomic(path, encode_document(twice))
    assert_starts_fresh(plan_resume(path, config),
                        "handoff not applied: unreadable: engine p1 is recorded twice", config)


def test_unreadable_path_starts_fresh(tmp_path: Path) -> None:
    config = make_config()
    plan = plan_resume(tmp_path, config)  # a directory
    assert not plan.applied and plan.reason.startswith(f"handoff not applied: unreadable: cannot read {tmp_path}:")


async def test_operator_holds_name_the_configured_engines_a_start_without_resume_would_drop(tmp_path: Path) -> None:
    from narwhal.state.resume import operator_holds

    config = make_config()
    fleet = troubled_fleet(config)  # p1 drained
    fleet.add_hold("d2", HoldKind.MAINTENANCE, "maintenance", OLD_NOW)
    path = tmp_path / "handoff.json"
    await write_handoff(path, config, fleet, drained=["p1", "gone"])
    assert operator_holds(path, config) == {"d2": ["maintenance"], "p1": ["operator_drain"]}
    # An engine no longer configured is not named; no handoff, nothing to say.
    assert operator_holds(path, make_config([e for e in ENGINES if e[0] != "d2"])) == {"p1": ["operator_drain"]}
    assert operator_holds(tmp_path / "none.json", config) == {}
