"""One writer for the fleet (issue 10, rule 5): every mutation path logs its events when
they happen, and no action the fleet returns is dropped."""

from __future__ import annotations

import ast
import json
import logging
import pathlib
import time
from typing import Any

import httpx
import pytest
import trio
from trio.testing import MockClock

import narwhal
from narwhal.config import Config, EngineSpec, FleetConfig, RecoveryConfig
from narwhal.control.fleet_writer import FleetWriter
from narwhal.control.readmission import Readmitter
from narwhal.control.supervisor import Supervisor
from narwhal.errors import FailureClass
from narwhal.fleet import DRAIN_HOLDS, Action, ActionKind, Fleet, HoldKind
from narwhal.fleet.placement import InFlight
from narwhal.fleet.tables import drained
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.pools.control import ControlPool
from narwhal.stages.controller import ControllerStage
from narwhal.stages.drain import DrainStage
from narwhal.state.resume import ResumePlan, apply_resume
from tests.test_drift import DRIFT_FACTOR, DRIFT_INTERVALS, FakeTelemetry

ENGINES = [("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"), ("d2", "decode"), ("d3", "decode")]
NOW = 100.0


class RecordingRunner:
    def __init__(self) -> None:
        self.actions: list[Action] = []

    def run_action(self, action: Action) -> None:
        self.actions.append(action)


def make_writer(quarantine_s: float | None = None) -> tuple[FleetWriter, RouterMetrics]:
    metrics = RouterMetrics()
    fleet = Fleet(ENGINES, eject_after=2, liveness_misses=2, failure_quarantine_s=quarantine_s,
                  probe_interval_s=5.0)
    return FleetWriter(fleet, metrics), metrics


def logged(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "narwhal.events"]


@pytest.fixture(autouse=True)
def _capture_events(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")


def config() -> Config:
    return Config(fleet=FleetConfig(model="m1", generation="g1"), recovery=RecoveryConfig(probe_interval_s=5.0),
                  engines=[EngineSpec(name=name, url=f"http://127.0.0.1:{9001 + i}", role=role)
                           for i, (name, role) in enumerate(ENGINES)])


def readmitter(writer: FleetWriter, metrics: RouterMetrics) -> Readmitter:
    cfg = config()
    pool = ControlPool(control_connections=2, engine_config=cfg.engine,
                       transport=httpx.MockTransport(lambda request: httpx.Response(500)))
    return Readmitter(config=cfg, fleet=writer, control_pool=pool, in_flight=InFlight([n for n, _ in ENGINES]),
                      metrics=metrics, attestation_key=b"k")


# ---------- every mutation path logs its events when they happen ----------

def test_an_operator_drain_is_logged_and_counted_the_moment_it_is_applied(caplog) -> None:
    writer, metrics = make_writer()
    readmitter(writer, metrics).drain("d1", NOW)
    # Logged by the writer at once, not whenever the supervisor next drained the fleet's events.
    added = [e for e in logged(caplog) if e["event"] == "engine_hold_added"]
    assert [(e["engine"], e["hold_kind"]) for e in added] == [("d1", "operator_drain")]
    assert metrics.holds_applied.get("d1", "operator_drain", "") == 1


def test_a_drift_hold_from_the_controller_stage_is_logged_when_applied(caplog) -> None:
    writer, metrics = make_writer()
    telemetry = FakeTelemetry(dict(ENGINES))
    controller = ControllerStage(fleet=writer, telemetry=telemetry, drift_factor=DRIFT_FACTOR,
                                 drift_intervals=DRIFT_INTERVALS, clock=lambda: NOW)
    for _ in range(DRIFT_INTERVALS):
        telemetry.close(d1=0.01, d2=0.01, d3=0.5)
    controller.step(NOW)
    added = [e for e in logged(caplog) if e["event"] == "engine_hold_added"]
    assert [(e["engine"], e["hold_kind"]) for e in added] == [("d3", "performance_drift")]
    assert metrics.holds_applied.get("d3", "performance_drift", "") == 1


async def test_a_readmission_is_logged_by_the_writer(caplog, autojump_clock: MockClock) -> None:
    writer, metrics = make_writer()
    writer.eject("d1", "dead", NOW, FailureClass.CONNECTION)
    writer.readmit("d1", NOW + 1)
    kinds = [(e["event"], e["engine"]) for e in logged(caplog) if e["event"].startswith("engine_")]
    assert kinds == [("engine_ejected", "d1"), ("engine_readmitted", "d1")]
    assert metrics.engine_ejections.get("d1", "connection", "") == 1


def test_a_hold_that_expires_on_a_read_is_logged_on_that_read(caplog) -> None:
    writer, _ = make_writer(quarantine_s=10.0)
    writer.record_failure("d1", FailureClass.TIMEOUT, NOW)
    writer.record_failure("d1", FailureClass.TIMEOUT, NOW)  # temporary quarantine, deadline NOW + 10
    caplog.clear()
    assert writer.eligible("decode", NOW + 10) == ["d1", "d2", "d3"]
    cleared = [e for e in logged(caplog) if e["event"] == "engine_hold_cleared"]
    assert [(e["engine"], e["hold_kind"]) for e in cleared] == [("d1", "failure_quarantine")]


# ---------- no returned action is dropped ----------

def test_actions_returned_before_a_runner_is_attached_are_run_on_attach() -> None:
    writer, _ = make_writer()
    writer.record_failure("d1", FailureClass.TIMEOUT, NOW)
    [action] = writer.record_failure("d1", FailureClass.TIMEOUT, NOW)
    runner = RecordingRunner()
    writer.attach(runner)
    assert runner.actions == [action]
    writer.record_failure("d2", FailureClass.OVERLOAD, NOW)
    writer.record_failure("d2", FailureClass.OVERLOAD, NOW)
    assert [(a.kind, a.engine) for a in runner.actions] == [(ActionKind.HEALTH_PROBE, "d1"),
                                                            (ActionKind.HEALTH_PROBE, "d2")]


def test_a_verification_hold_added_by_any_path_gets_its_probe() -> None:
    # The fleet answers an inference-verification hold with a probe action; callers used to drop it.
    writer, _ = make_writer()
    runner = RecordingRunner()
    writer.attach(runner)
    writer.add_hold("p1", HoldKind.INFERENCE_VERIFICATION, "operator suspects p1", NOW)
    assert [(a.kind, a.engine) for a in runner.actions] == [(ActionKind.INFERENCE_PROBE, "p1")]


def test_resume_runs_the_probe_a_restored_verification_hold_was_waiting_for() -> None:
    old, _ = make_writer()
    old.record_failure("d1", FailureClass.STREAM, NOW)
    old.record_failure("d1", FailureClass.STREAM, NOW)  # verification hold, probe in flight when saved
    records = old.snapshot(NOW, 5000.0)
    writer, _ = make_writer()
    runner = RecordingRunner()
    writer.attach(runner)
    plan = ResumePlan(path="h.json", applied=True, document=_document(records))
    apply_resume(plan, writer, NOW + 1, 5001.0)
    assert [(a.kind, a.engine) for a in runner.actions] == [(ActionKind.INFERENCE_PROBE, "d1")]


def _document(records: list) -> Any:
    from narwhal.state.handoff import HANDOFF_SCHEMA, EngineSetEntry, HandoffDocument
    return HandoffDocument(schema=HANDOFF_SCHEMA, router_id="r", pid=1, pass_number=1, written_at=time.time(),
                           engine_set=[EngineSetEntry(name=n, url=f"http://127.0.0.1:{9001 + i}", role=r)
                                       for i, (n, r) in enumerate(ENGINES)],
                           engines=records)


async def test_a_probe_asked_for_while_one_runs_runs_again_after_it(autojump_clock: MockClock, nursery) -> None:
    cfg = config()
    calls: list[float] = []

    async def health(request: httpx.Request) -> httpx.Response:
        calls.append(trio.current_time())
        await trio.sleep(1.0)
        return httpx.Response(200)

    pool = ControlPool(control_connections=4, engine_config=cfg.engine, transport=httpx.MockTransport(health))
    writer, metrics = make_writer()
    supervisor = Supervisor(config=cfg, fleet=writer, control_pool=pool, metrics=metrics)
    await nursery.start(supervisor.run)
    supervisor.run_action(Action(ActionKind.HEALTH_PROBE, "d1", FailureClass.TIMEOUT, "first"))
    await trio.sleep(0.5)
    supervisor.run_action(Action(ActionKind.HEALTH_PROBE, "d1", FailureClass.TIMEOUT, "second"))
    await trio.sleep(5.0)
    assert calls == [0.0, 1.0]  # the second request waited for the first, then ran
    await pool.aclose()


# ---------- "drained" and DRAIN_HOLDS exist once ----------

def test_drained_means_a_drain_hold_and_nothing_in_flight() -> None:
    assert DRAIN_HOLDS == {HoldKind.OPERATOR_DRAIN, HoldKind.MAINTENANCE}
    for kind in HoldKind:
        assert drained([kind], 0) is (kind in DRAIN_HOLDS)
        assert drained([kind], 1) is False
    assert drained([], 0) is False


async def test_the_drain_stage_and_the_readmitter_agree_on_drained(autojump_clock: MockClock) -> None:
    writer, metrics = make_writer()
    readmission = readmitter(writer, metrics)
    in_flight = readmission.in_flight
    stage = DrainStage(fleet=writer, in_flight=in_flight, clock=lambda: NOW)
    readmission.drain("d1", NOW)
    readmission.maintenance("p1", NOW)
    in_flight.acquire("p1")
    stage.settle(NOW)
    assert stage.drained == {name for name, _ in ENGINES if readmission.drained(name)} == {"d1"}


# ---------- structure: nothing else mutates a Fleet ----------

MUTATIONS = {"record_failure", "record_success", "record_health_sweep", "record_probe", "probes_due",
             "add_hold", "clear_hold", "eject", "readmit", "restore", "drain_events", "add_engine",
             "start_removal", "remove_engine", "reconfigure"}


def test_only_the_writer_holds_a_bare_fleet() -> None:
    package = pathlib.Path(narwhal.__file__).parent
    holders = []
    for source in package.rglob("*.py"):
        relative = source.relative_to(package).as_posix()
        if relative.startswith("fleet/"):
            continue
        tree = ast.parse(source.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in ("narwhal.fleet", "narwhal.fleet.machine"):
                if any(alias.name == "Fleet" for alias in node.names):
                    holders.append(relative)
    # The router builds the Fleet and hands it to its writer at once; nothing else names the class.
    assert sorted(holders) == ["control/fleet_writer.py", "router.py"]
    writer_source = (package / "control" / "fleet_writer.py").read_text()
    for name in MUTATIONS:
        assert f"self._fleet.{name}(" in writer_source
