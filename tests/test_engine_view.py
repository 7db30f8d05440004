"""The admin view of the fleet as typed structs, the typed ejection cause, and the app over a small Protocol."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import trio

from narwhal.app.admin_routes import register_admin_routes
from narwhal.app.control_app import create_app
from narwhal.config import Config, EngineSpec, FleetConfig
from narwhal.control.engine_view import EngineEntry, EnginesView, EngineViewer
from narwhal.control.fleet_writer import FleetWriter
from narwhal.control.model_lengths import ModelLengths
from narwhal.control.model_view import ModelViewer
from narwhal.control.readmission import ReadmissionResult, ReadmissionState
from narwhal.control.supervisor import Supervisor
from narwhal.errors import FailureClass
from narwhal.fleet import EjectionCause, Fleet, FleetEventKind, HoldKind
from narwhal.fleet.placement import InFlight
from narwhal.lease.service import LeaseView
from narwhal.obs.router_metrics import RouterMetrics

ENGINES = [("p1", "prefill"), ("d1", "decode"), ("d2", "decode")]


def make_fleet(quarantine_s: float | None = None) -> Fleet:
    return Fleet(ENGINES, eject_after=2, liveness_misses=2, failure_quarantine_s=quarantine_s, probe_interval_s=5.0)


def ejected_events(fleet: Fleet) -> list[tuple[str, EjectionCause | None]]:
    return [(e.engine, e.ejection_cause) for e in fleet.drain_events() if e.kind is FleetEventKind.EJECTED]


# -- the cause is a typed field, set where the fleet decides, never parsed from the reason --


def test_a_failure_streak_ejection_carries_its_class_as_the_cause() -> None:
    # Connection is the class the failure table ejects on directly.
    failure_class = FailureClass.CONNECTION
    fleet = make_fleet()
    for _ in range(2):
        fleet.record_failure("d1", failure_class, 1.0)
    assert ejected_events(fleet) == [("d1", EjectionCause(failure_class.value))]
    assert fleet.view("d1", 1.0).ejected_cause is EjectionCause.of(failure_class)


def test_liveness_and_probe_ejections_have_their_own_causes() -> None:
    fleet = make_fleet()
    for now in (1.0, 2.0):
        fleet.record_health_sweep({"p1": True, "d1": False, "d2": True}, now)
    fleet.record_failure("d2", FailureClass.STREAM, 3.0)
    fleet.record_probe("d2", "failed", 4.0, leg="decode", reason="HTTP 500")
    assert ejected_events(fleet) == [("d1", EjectionCause.LIVENESS), ("d2", EjectionCause.PROBE)]
    # Rewording a reason cannot change the label: it is not derived from the text.
    assert "probe leg" in (fleet.view("d2", 4.0).ejected_reason or "")


def test_the_cause_survives_the_handoff_and_readmission_clears_it() -> None:
    fleet = make_fleet()
    for now in (1.0, 2.0):
        fleet.record_health_sweep({"p1": True, "d1": False, "d2": True}, now)
    records = fleet.snapshot(2.0, 1000.0)
    resumed = make_fleet()
    resumed.restore(records, 50.0, 1010.0)
    assert resumed.view("d1", 50.0).ejected_cause is EjectionCause.LIVENESS
    resumed.readmit("d1", 51.0)
    assert resumed.view("d1", 51.0).ejected_cause is None


class _NoProbes:
    async def get(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("no probe expected")

    post_json = get


def test_the_ejections_metric_is_labelled_with_the_typed_cause() -> None:
    config = Config(fleet=FleetConfig(model="m"), engines=[
        EngineSpec(name=name, url=f"http://127.0.0.1:{9000 + i}", role=role) for i, (name, role) in enumerate(ENGINES)])
    fleet = make_fleet()
    metrics = RouterMetrics()
    supervisor = Supervisor(config=config, fleet=FleetWriter(fleet, metrics), control_pool=_NoProbes(),
                            metrics=metrics, clock=lambda: 1.0)
    for _ in range(2):
        supervisor.record_health_sweep({"p1": True, "d1": False, "d2": True})
    supervisor.record_failure("p1", FailureClass.CONNECTION)
    supervisor.record_failure("p1", FailureClass.CONNECTION)
    ejections = supervisor.metrics.engine_ejections
    assert ejections.get("d1", "liveness", "") == 1 and ejections.get("p1", "connection", "") == 1
    assert ejections.get("d1", "other", "") == 0


# -- EngineViewer: the /admin/engines answer as structs --


class FakeReadmitter:
    def __init__(self) -> None:
        self.last: dict[str, ReadmissionResult] = {}

    def admin_state(self, name: str, view: object = None) -> ReadmissionState:
        return ReadmissionState(drained=name == "d2", maintenance_started_at=None, readmission_running=False,
                                last_readmission=self.last.get(name))


class FakeController:
    def consolidation_risk(self, now: float | None = None) -> dict[str, str]:
        return {"prefill": "critical", "decode": "none"}


class FakeMonitor:
    failure_streak = 1
    degraded_reason: str | None = None
    passes = 7


def make_config() -> Config:
    return Config(fleet=FleetConfig(model="m"), engines=[
        EngineSpec(name=name, url=f"http://127.0.0.1:{9000 + i}", role=role) for i, (name, role) in enumerate(ENGINES)])


def make_viewer(fleet: Fleet, readmitter: FakeReadmitter | None = None, now: float = 10.0) -> EngineViewer:
    in_flight = InFlight([name for name, _ in ENGINES])
    in_flight.counts["d1"] = 3
    return EngineViewer(config=make_config(), fleet=fleet, in_flight=in_flight,
                        readmitter=readmitter or FakeReadmitter(), controller=FakeController(),
                        monitor=FakeMonitor(), clock=lambda: now)


def test_the_view_joins_the_fleet_with_the_shell_state() -> None:
    fleet = make_fleet(quarantine_s=30.0)
    fleet.record_failure("p1", FailureClass.CONNECTION, 5.0)
    fleet.record_failure("p1", FailureClass.CONNECTION, 5.0)
    fleet.add_hold("d2", HoldKind.OPERATOR_DRAIN, "operator", 6.0)
    view = make_viewer(fleet).engines()
    assert isinstance(view, EnginesView)
    assert [e.name for e in view.engines] == ["p1", "d1", "d2"]
    p1, d1, d2 = view.engines
    assert (p1.ejected, p1.ejected_cause, p1.url) == (True, EjectionCause.CONNECTION, "http://127.0.0.1:9000")
    assert [h.kind for h in p1.holds] == [HoldKind.FAILURE_QUARANTINE] and p1.holds[0].deadline == 35.0
    assert p1.holds[0].cause == "connection"  # a health 200 may clear it (architecture.md, "Fleet rules")
    assert p1.counters.failures[FailureClass.CONNECTION] == 2 and p1.counters.ejections == 1
    assert d1.in_flight == 3 and d1.eligible and not d1.drained
    assert d2.drained and [h.kind for h in d2.holds] == [HoldKind.OPERATOR_DRAIN]
    assert view.consolidation_risk == {"prefill": "critical", "decode": "none"}
    assert (view.monitor.passes, view.monitor.failure_streak, view.monitor.degraded) == (7, 1, None)


def test_the_json_keeps_the_documented_keys() -> None:
    result = ReadmissionResult(engine="d1", outcome="refused", check="identity", reason="wrong id", operator=True,
                               passed=["health"], at=1.0, duration_s=0.1)
    readmitter = FakeReadmitter()
    readmitter.last["d1"] = result
    body = msgspec.json.decode(msgspec.json.encode(make_viewer(make_fleet(), readmitter).engines()))
    assert set(body) == {"engines", "consolidation_risk", "monitor"}
    assert body["monitor"] == {"failure_streak": 1, "degraded": None, "passes": 7}
    d1 = body["engines"][1]
    assert list(d1) == ["name", "role", "url", "eligible", "ejected", "ejected_reason", "ejected_cause", "holds",
                        "evidence", "liveness_misses", "in_flight", "next_probe_at", "counters", "drained",
                        "maintenance_started_at", "readmission_running", "last_readmission",
                        "health_answered_at", "readmission_backoff_s", "next_readmission_at", "prefix_index",
                        "removing", "model", "source"]
    assert d1["evidence"] == {str(c): 0 for c in FailureClass}
    assert d1["last_readmission"]["check"] == "identity"


def test_one_engine_is_the_same_entry_and_unknown_names_raise() -> None:
    viewer = make_viewer(make_fleet())
    assert viewer.engine("d2") == viewer.engines().engines[2]
    assert isinstance(viewer.engine("d2"), EngineEntry)
    with pytest.raises(KeyError):
        viewer.engine("nope")


# -- the control app takes the AppState Protocol, not the Router --


class FakeActions:
    def __init__(self) -> None:
        self.drained: list[str] = []

    def clock(self) -> float:
        return trio.current_time()

    def knows(self, name: str) -> bool:
        return name in {n for n, _ in ENGINES}

    def drain(self, name: str, now: float) -> None:
        self.drained.append(name)

    def maintenance(self, name: str, now: float) -> float:
        return 123.0

    async def readmit(self, name: str, *, operator: bool) -> ReadmissionResult:
        return ReadmissionResult(engine=name, outcome="readmitted", check=None, reason="", operator=operator,
                                 passed=[], at=0.0, duration_s=0.0)


class FakeMetrics:
    def render(self) -> str:
        return "narwhal_fake 1\n"


class FakeTelemetry:
    def as_json(self) -> dict[str, Any]:
        return {"interval_s": 10.0}


class FakeState:
    """Everything ``create_app`` needs, and nothing of a Router."""

    def __init__(self) -> None:
        self.config = make_config()
        self.metrics = FakeMetrics()
        self.telemetry = FakeTelemetry()
        self.engine_view = make_viewer(make_fleet())
        self.readmitter = FakeActions()
        self.model_view = ModelViewer(config=self.config, fleet=make_fleet(), lengths=ModelLengths(), created=1,
                                      refusal=self.readiness, clock=lambda: 10.0)

    def readiness(self) -> str | None:
        return "no eligible decode engine"

    def lease_view(self) -> LeaseView:
        return LeaseView(router_id="r1", backend="none", role="active")

    def controller_redirect(self) -> None:
        return None  # it decides: admin changes apply here


async def test_the_app_serves_from_any_object_with_the_app_state() -> None:
    state = FakeState()
    app = create_app(state)
    register_admin_routes(app, state)
    client = app.test_client()
    ready = await client.get("/ready")
    assert ready.status_code == 503 and (await ready.get_data(as_text=True)) == "no eligible decode engine\n"
    assert (await (await client.get("/metrics")).get_data(as_text=True)) == "narwhal_fake 1\n"
    engines = await (await client.get("/admin/engines")).get_json()
    assert engines["monitor"]["passes"] == 7 and [e["name"] for e in engines["engines"]] == ["p1", "d1", "d2"]
    drained = await client.post("/admin/engines/d1/drain")
    assert drained.status_code == 200 and state.readmitter.drained == ["d1"]
    assert (await drained.get_json())["engine"]["name"] == "d1"
    readmit = await (await client.post("/admin/engines/d2/readmit")).get_json()
    assert readmit["readmission"]["outcome"] == "readmitted"
    assert (await client.get("/admin/engines/zz")).status_code == 404


def test_prefill_engines_show_their_prefix_index_size() -> None:
    from narwhal.fleet.placement.prefix_index import ENTRY_BYTES, PrefixIndex

    index = PrefixIndex(["p1"], max_bytes=1 << 20)
    index.record("p1", [1, 2, 3], 1.0)
    viewer = EngineViewer(config=make_config(), fleet=make_fleet(), in_flight=InFlight([n for n, _ in ENGINES]),
                          readmitter=FakeReadmitter(), controller=FakeController(), monitor=FakeMonitor(),
                          clock=lambda: 10.0, prefix_index=index)
    p1, d1, _ = viewer.engines().engines
    assert p1.prefix_index is not None and (p1.prefix_index.entries, p1.prefix_index.bytes) == (3, 4 * ENTRY_BYTES)
    assert d1.prefix_index is None
