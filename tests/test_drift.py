"""Performance drift and consolidation risk: the pure rules and the controller stage over a real Fleet.

Telemetry is a fake holding hand-made closed intervals, so "exactly
drift_intervals intervals" is counted interval by interval.
"""

from __future__ import annotations

import json
import logging

import pytest

from narwhal.fleet import Fleet, HoldKind
from narwhal.fleet.drift import DriftTracker, Risk, Verdict, consolidation_risk, judge_interval, risk_by_role
from narwhal.fleet.telemetry import EngineInterval, Interval
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.stages.controller import ControllerStage

DRIFT_FACTOR = 3.0
DRIFT_INTERVALS = 3
FAST, SLOW = 0.02, 0.5
NOW = 50.0


def figures(role: str, median_s: float | None) -> EngineInterval:
    samples = 0 if median_s is None else 10
    if role == "prefill":
        return EngineInterval(role=role, requests=samples, errors=0, ttft_samples=samples,
                              ttft_p50_s=median_s, ttft_p90_s=median_s, inter_token_samples=0,
                              inter_token_p50_s=None, inter_token_p90_s=None)
    return EngineInterval(role=role, requests=samples, errors=0, ttft_samples=0, ttft_p50_s=None,
                          ttft_p90_s=None, inter_token_samples=samples, inter_token_p50_s=median_s,
                          inter_token_p90_s=median_s)


class FakeTelemetry:
    """Closed intervals appended by the test, each with the given per-engine medians."""

    def __init__(self, roles: dict[str, str]) -> None:
        self.roles = roles
        self.intervals: list[Interval] = []

    def close(self, **medians: float | None) -> Interval:
        index = len(self.intervals)
        interval = Interval(index=index, start=10.0 * index, end=10.0 * (index + 1),
                            engines={name: figures(role, medians.get(name)) for name, role in self.roles.items()})
        self.intervals.append(interval)
        return interval

    def closed_intervals(self) -> list[Interval]:
        return list(self.intervals)


def setup(engines: list[tuple[str, str]]) -> tuple[Fleet, FakeTelemetry, ControllerStage]:
    fleet = Fleet(engines, eject_after=3, liveness_misses=3, failure_quarantine_s=None, probe_interval_s=5.0)
    telemetry = FakeTelemetry(dict(engines))
    controller = ControllerStage(fleet=fleet, telemetry=telemetry, drift_factor=DRIFT_FACTOR,
                                 drift_intervals=DRIFT_INTERVALS, clock=lambda: NOW)
    return fleet, telemetry, controller


def drift_hold(fleet: Fleet, name: str):
    return next((h for h in fleet.view(name, NOW).holds if h.kind is HoldKind.PERFORMANCE_DRIFT), None)


THREE_DECODE = [("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"), ("d2", "decode"), ("d3", "decode")]


# -- the pure rules ----------------------------------------------------------------------


@pytest.mark.parametrize(("eligible", "total", "risk"), [
    (0, 4, "critical"), (1, 4, "critical"), (1, 1, "critical"), (0, 1, "critical"),
    (2, 5, "elevated"), (3, 7, "elevated"), (2, 4, "none"), (2, 3, "none"), (2, 2, "none"), (4, 4, "none"),
])
def test_consolidation_risk_table(eligible: int, total: int, risk: str) -> None:
    assert consolidation_risk(eligible, total) == risk


def test_risk_by_role() -> None:
    assert risk_by_role({"prefill": 3}, {"prefill": 4, "decode": 2}) == {
        "prefill": Risk.NONE, "decode": Risk.CRITICAL}


def test_an_engine_is_judged_against_the_median_of_its_roles_peers_with_data() -> None:
    telemetry = FakeTelemetry(dict(THREE_DECODE))
    interval = telemetry.close(p1=0.1, p2=0.31, d1=0.01, d2=0.03, d3=None)
    verdicts = {name: verdict for name, (verdict, _) in judge_interval(interval, DRIFT_FACTOR).items()}
    # p2: 0.31 > 3 x 0.1; p1: 0.1 < 3 x 0.31; d1, d2 only compare with each other (d3 has no data).
    assert verdicts == {"p1": Verdict.WITHIN, "p2": Verdict.DRIFTING, "d1": Verdict.WITHIN,
                        "d2": Verdict.WITHIN, "d3": Verdict.NO_DATA}
    lonely = telemetry.close(p1=0.1, d1=0.01)
    assert judge_interval(lonely, DRIFT_FACTOR)["p1"] == (Verdict.NO_DATA, "no peer with data")
    # Exactly drift_factor x the peers' median is still within bounds.
    edge = telemetry.close(d1=0.03, d2=0.01, d3=0.01)
    assert judge_interval(edge, DRIFT_FACTOR)["d1"][0] is Verdict.WITHIN


def test_tracker_needs_consecutive_drifting_intervals() -> None:
    telemetry = FakeTelemetry(dict(THREE_DECODE))
    tracker = DriftTracker(drift_factor=DRIFT_FACTOR, drift_intervals=DRIFT_INTERVALS)
    pattern = [SLOW, SLOW, FAST, SLOW, SLOW, None, SLOW, SLOW]
    for d3 in pattern:
        assert tracker.observe(telemetry.close(d1=FAST, d2=FAST, d3=d3)) == []
    [decision] = tracker.observe(telemetry.close(d1=FAST, d2=FAST, d3=SLOW))
    assert decision.engine == "d3" and decision.hold
    assert decision.reason.startswith("performance drift for 3 consecutive intervals: median inter-token latency")


# -- the controller stage over a real fleet -----------------------------------------------


async def test_an_engine_gets_the_hold_after_exactly_drift_intervals_and_loses_it_after_as_many_good_ones(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    fleet, telemetry, controller = setup(THREE_DECODE)
    for k in range(1, DRIFT_INTERVALS):
        telemetry.close(d1=FAST, d2=FAST, d3=SLOW)
        await controller.run(k)
        assert drift_hold(fleet, "d3") is None, f"held after only {k} intervals"
    telemetry.close(d1=FAST, d2=FAST, d3=SLOW)
    await controller.run(DRIFT_INTERVALS)
    hold = drift_hold(fleet, "d3")
    assert hold is not None and not hold.deferred and hold.since == NOW
    assert "performance drift for 3 consecutive intervals" in hold.reason
    assert fleet.eligible("decode", NOW) == ["d1", "d2"]

    # The held engine still finishes a slow in-flight stream: that interval is no recovery.
    telemetry.close(d1=FAST, d2=FAST, d3=SLOW)
    controller.step(NOW)
    for k in range(1, DRIFT_INTERVALS):
        telemetry.close(d1=FAST, d2=FAST, d3=FAST)
        controller.step(NOW)
        assert drift_hold(fleet, "d3") is not None, f"lifted after only {k} good intervals"
    telemetry.close(d1=FAST, d2=FAST, d3=FAST)
    [decision] = controller.step(NOW)
    assert not decision.hold and decision.engine == "d3"
    assert drift_hold(fleet, "d3") is None
    assert fleet.eligible("decode", NOW) == ["d1", "d2", "d3"]
    lines = [json.loads(r.getMessage()) for r in caplog.records]
    assert [line["event"] for line in lines if line["event"].startswith("drift_")] == [
        "drift_hold_applied", "drift_hold_lifted"]


async def test_a_held_engine_without_traffic_counts_as_back_within_bounds() -> None:
    fleet, telemetry, controller = setup(THREE_DECODE)
    for _ in range(DRIFT_INTERVALS):
        telemetry.close(d1=FAST, d2=FAST, d3=SLOW)
    controller.step(NOW)
    assert drift_hold(fleet, "d3") is not None
    for _ in range(DRIFT_INTERVALS):
        assert drift_hold(fleet, "d3") is not None
        telemetry.close(d1=FAST, d2=FAST, d3=None)
        controller.step(NOW)
    assert drift_hold(fleet, "d3") is None
    # Back in placement and still slow: held again after drift_intervals more intervals.
    for _ in range(DRIFT_INTERVALS):
        assert drift_hold(fleet, "d3") is None
        telemetry.close(d1=FAST, d2=FAST, d3=SLOW)
        controller.step(NOW)
    assert drift_hold(fleet, "d3") is not None


def test_each_closed_interval_is_judged_once() -> None:
    fleet, telemetry, controller = setup(THREE_DECODE)
    telemetry.close(d1=FAST, d2=FAST, d3=SLOW)
    telemetry.close(d1=FAST, d2=FAST, d3=SLOW)
    for _ in range(5):
        controller.step(NOW)
    assert drift_hold(fleet, "d3") is None and controller.last_interval == 1
    telemetry.close(d1=FAST, d2=FAST, d3=SLOW)
    controller.step(NOW)
    assert drift_hold(fleet, "d3") is not None


def test_prefill_drift_is_judged_on_time_to_first_token() -> None:
    engines = [("p1", "prefill"), ("p2", "prefill"), ("p3", "prefill"), ("d1", "decode")]
    fleet, telemetry, controller = setup(engines)
    for _ in range(DRIFT_INTERVALS):
        telemetry.close(p1=0.1, p2=0.12, p3=1.0, d1=FAST)
    controller.step(NOW)
    assert drift_hold(fleet, "p3") is not None and drift_hold(fleet, "d1") is None


async def test_the_last_eligible_engine_of_a_role_never_gets_the_hold(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    engines = [("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"), ("d2", "decode")]
    fleet, telemetry, controller = setup(engines)
    # d1 is drained by the operator: d2 is the last eligible decode engine.
    fleet.add_hold("d1", HoldKind.OPERATOR_DRAIN, "operator", NOW)
    assert controller.consolidation_risk() == {"prefill": "none", "decode": "critical"}
    # d2 drifts against the streams d1 is still finishing: no hold, it keeps serving.
    for _ in range(2 * DRIFT_INTERVALS):
        telemetry.close(d1=0.001, d2=FAST)
        controller.step(NOW)
        assert drift_hold(fleet, "d2") is None
        assert fleet.eligible("decode", NOW) == ["d2"]
    skipped = [json.loads(r.getMessage()) for r in caplog.records if "drift_hold_skipped" in r.getMessage()]
    assert skipped and all(s["engine"] == "d2" and s["risk"] == "critical" for s in skipped)


def test_no_new_soft_hold_at_critical_but_lifting_goes_on() -> None:
    engines = [("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"), ("d2", "decode"), ("d3", "decode")]
    fleet, telemetry, controller = setup(engines)
    for _ in range(DRIFT_INTERVALS):
        telemetry.close(d1=FAST, d2=FAST, d3=SLOW)
    controller.step(NOW)
    assert drift_hold(fleet, "d3") is not None
    # An operator drain on d1 leaves d2 alone: the decode role is critical.
    fleet.add_hold("d1", HoldKind.OPERATOR_DRAIN, "operator", NOW)
    assert controller.consolidation_risk()["decode"] == "critical"
    for _ in range(DRIFT_INTERVALS):
        telemetry.close(d1=FAST, d2=SLOW, d3=None)
    controller.step(NOW)
    # d2 is not held, while d3's hold is lifted after its quiet intervals.
    assert drift_hold(fleet, "d2") is None
    assert drift_hold(fleet, "d3") is None
    assert fleet.eligible("decode", NOW) == ["d2", "d3"]


def test_the_fleet_itself_defers_a_drift_hold_on_the_last_eligible_engine() -> None:
    # Belt and braces: were the controller to ask, the fleet records the hold deferred.
    fleet, _, _ = setup([("p1", "prefill"), ("d1", "decode")])
    fleet.add_hold("d1", HoldKind.PERFORMANCE_DRIFT, "drift", NOW)
    hold = drift_hold(fleet, "d1")
    assert hold is not None and hold.deferred
    assert fleet.eligible("decode", NOW) == ["d1"]


def test_consolidation_risk_follows_eligibility_and_is_a_gauge() -> None:
    engines = [("p1", "prefill"), ("p2", "prefill"), ("p3", "prefill"), ("p4", "prefill"), ("p5", "prefill"),
               ("d1", "decode"), ("d2", "decode")]
    fleet = Fleet(engines, eject_after=3, liveness_misses=3, failure_quarantine_s=None, probe_interval_s=5.0)
    metrics = RouterMetrics()
    controller = ControllerStage(fleet=fleet, telemetry=FakeTelemetry(dict(engines)), drift_factor=DRIFT_FACTOR,
                                 drift_intervals=DRIFT_INTERVALS, metrics=metrics, clock=lambda: NOW)
    assert controller.consolidation_risk() == {"prefill": "none", "decode": "none"}
    for name in ("p1", "p2", "p3"):
        fleet.eject(name, "test", NOW)
    fleet.eject("d1", "test", NOW)
    assert controller.consolidation_risk() == {"prefill": "elevated", "decode": "critical"}
    text = metrics.render()
    assert 'narwhal_consolidation_risk{role="prefill",model=""} 1' in text
    assert 'narwhal_consolidation_risk{role="decode",model=""} 2' in text


# -- several models: each model's engines are compared with their own ------------------------------

TWO_MODELS = [("pa1", "prefill", "a"), ("pa2", "prefill", "a"), ("da1", "decode", "a"), ("da2", "decode", "a"),
              ("da3", "decode", "a"), ("pb1", "prefill", "b"), ("db1", "decode", "b"), ("db2", "decode", "b")]


def setup_models(engines: list[tuple[str, str, str]]) -> tuple[Fleet, FakeTelemetry, ControllerStage, RouterMetrics]:
    fleet = Fleet(engines, eject_after=3, liveness_misses=3, failure_quarantine_s=None, probe_interval_s=5.0)
    telemetry = FakeTelemetry({name: role for name, role, _ in engines})
    metrics = RouterMetrics()
    controller = ControllerStage(fleet=fleet, telemetry=telemetry, drift_factor=DRIFT_FACTOR,
                                 drift_intervals=DRIFT_INTERVALS, metrics=metrics, clock=lambda: NOW)
    return fleet, telemetry, controller, metrics


def test_peers_are_the_engines_of_the_same_model_and_role() -> None:
    models = {name: model for name, _, model in TWO_MODELS}
    roles = {name: role for name, role, _ in TWO_MODELS}
    interval = Interval(index=0, start=0.0, end=10.0, engines={
        name: figures(roles[name], value) for name, value in
        {"da1": FAST, "da2": FAST, "da3": FAST, "db1": SLOW, "db2": SLOW, "pa1": FAST, "pa2": FAST,
         "pb1": SLOW}.items()})
    # One pool for every engine (no models given): model b's slower engines drift against model a's.
    assert judge_interval(interval, DRIFT_FACTOR)["db1"][0] is Verdict.DRIFTING
    verdicts = judge_interval(interval, DRIFT_FACTOR, models)
    # Per model: b's decode engines match each other; b's only prefill engine has no peer of its model.
    assert verdicts["db1"][0] is Verdict.WITHIN and verdicts["db2"][0] is Verdict.WITHIN
    assert verdicts["pb1"] == (Verdict.NO_DATA, "no peer with data")
    assert verdicts["da1"][0] is Verdict.WITHIN


def test_a_slower_model_is_not_drift_but_a_slow_engine_within_its_model_is() -> None:
    fleet, telemetry, controller, _ = setup_models(TWO_MODELS)
    for _ in range(DRIFT_INTERVALS):
        # Model b is ten times slower than model a throughout, and db2 is slower still than db1.
        telemetry.close(da1=FAST, da2=FAST, da3=FAST, db1=10 * FAST, db2=100 * FAST)
    controller.step(NOW)
    assert [name for name in ("da1", "da2", "da3", "db1") if drift_hold(fleet, name)] == []
    assert drift_hold(fleet, "db2") is not None
    # The hold takes db2 out of b's placement; db1 still serves b.
    assert fleet.eligible("decode", NOW, "b") == ["db1"]


def test_consolidation_risk_is_per_model_and_role_and_a_gauge() -> None:
    fleet, _, controller, metrics = setup_models(TWO_MODELS)
    assert controller.consolidation_risks() == {"a": {"prefill": "none", "decode": "none"},
                                                "b": {"prefill": "critical", "decode": "none"}}
    fleet.eject("db1", "test", NOW)
    fleet.eject("da1", "test", NOW)
    assert controller.consolidation_risks() == {"a": {"prefill": "none", "decode": "none"},
                                                "b": {"prefill": "critical", "decode": "critical"}}
    # The role-wide answer (handoff, /admin/engines) is each role's worst model.
    assert controller.consolidation_risk() == {"prefill": "critical", "decode": "critical"}
    text = metrics.render()
    assert 'narwhal_consolidation_risk{role="decode",model="a"} 0' in text
    assert 'narwhal_consolidation_risk{role="decode",model="b"} 2' in text


def test_a_drift_hold_is_skipped_only_when_the_engines_own_model_is_critical() -> None:
    engines = [("pa1", "prefill", "a"), ("da1", "decode", "a"), ("da2", "decode", "a"), ("da3", "decode", "a"),
               ("pb1", "prefill", "b"), ("db1", "decode", "b"), ("db2", "decode", "b")]
    fleet, telemetry, controller, _ = setup_models(engines)
    # Model b's decode role is critical (db1 drained); model a's is not.
    fleet.add_hold("db1", HoldKind.OPERATOR_DRAIN, "operator", NOW)
    for _ in range(DRIFT_INTERVALS):
        telemetry.close(da1=FAST, da2=FAST, da3=SLOW, db1=FAST, db2=SLOW)
    controller.step(NOW)
    assert drift_hold(fleet, "da3") is not None
    assert drift_hold(fleet, "db2") is None
