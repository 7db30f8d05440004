"""Request series carry the served model's own name as their last label; a name a client made up never does."""

from __future__ import annotations

import msgspec

from narwhal.config import parse_config
from narwhal.errors import EngineFailure, FailureClass
from narwhal.fleet.admission import Admission
from narwhal.fleet.placement import InFlight
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.serving.request_core import RequestCore
from tests.test_request_core import FakePool, FakeSupervisor, Sink

TWO_MODELS = """
[fleet]
model = "alpha"

[[fleet.models]]
name = "beta"
aliases = ["b"]

[[engines]]
name = "pa"
url = "http://127.0.0.1:9001"
role = "prefill"

[[engines]]
name = "da"
url = "http://127.0.0.1:9002"
role = "decode"

[[engines]]
name = "pb"
url = "http://127.0.0.1:9003"
role = "prefill"
model = "beta"

[[engines]]
name = "db"
url = "http://127.0.0.1:9004"
role = "decode"
model = "beta"
"""


class ModelSupervisor(FakeSupervisor):
    """Eligible engines per model, as the fleet's pools give them."""

    def __init__(self) -> None:
        super().__init__()
        self.pools = {"alpha": {"prefill": ["pa"], "decode": ["da"]}, "beta": {"prefill": ["pb"], "decode": ["db"]}}

    def eligible(self, role: str, model: str | None = None) -> list[str]:
        assert model is not None
        return list(self.pools[model][role])

    def capacity_problem(self, model: str | None = None) -> str | None:
        assert model is not None
        missing = [role for role, names in self.pools[model].items() if not names]
        return f"serving capacity exhausted: no eligible {missing[0]} engine" if missing else None


def make_core() -> tuple[RequestCore, ModelSupervisor, FakePool]:
    config = parse_config(TWO_MODELS)
    supervisor, pool = ModelSupervisor(), FakePool()
    core = RequestCore(config=config, supervisor=supervisor, data_pool=pool,
                       in_flight=InFlight(e.name for e in config.engines), admission=Admission(),
                       metrics=RouterMetrics())
    return core, supervisor, pool


def body(model: object) -> bytes:
    return msgspec.json.encode({"model": model, "prompt": "hello", "max_tokens": 3})


async def test_request_series_carry_the_models_own_name_for_an_alias_too() -> None:
    core, _, _ = make_core()
    await core.handle("/v1/completions", body("alpha"), None, Sink())
    await core.handle("/v1/completions", body("b"), None, Sink())
    await core.handle("/v1/completions", body("beta"), None, Sink())
    requests = core.metrics.requests
    assert requests.get("/v1/completions", "200", "alpha") == 1
    assert requests.get("/v1/completions", "200", "beta") == 2
    assert core.metrics.request_duration.count("/v1/completions", "beta") == 2
    assert core.metrics.ttft.count("/v1/completions", "alpha") == 1
    assert core.metrics.placements.get("prefill", "only_choice", "beta") == 2
    assert core.metrics.placements.get("decode", "only_choice", "alpha") == 1
    text = core.metrics.render()
    assert 'narwhal_requests_total{route="/v1/completions",status="200",model="beta"} 2' in text


async def test_an_unknown_model_or_a_body_refused_before_its_model_is_known_counts_under_the_empty_model() -> None:
    core, _, pool = make_core()
    for made_up in ("gamma", "x" * 200):
        sink = Sink()
        await core.handle("/v1/completions", body(made_up), None, sink)
        assert sink.status == 404
    sink = Sink()
    await core.handle("/v1/completions", b"{not json", None, sink)
    assert sink.status == 400
    assert pool.calls == []
    # A client's made-up name never becomes a label value: the label set stays bounded.
    assert set(core.metrics.requests.values) == {("/v1/completions", "404", ""), ("/v1/completions", "400", "")}
    assert "gamma" not in core.metrics.render()


async def test_a_model_without_capacity_counts_its_saturation_under_its_own_name() -> None:
    core, supervisor, _ = make_core()
    supervisor.pools["beta"]["decode"] = []
    sink = Sink()
    await core.handle("/v1/completions", body("b"), None, sink)
    assert sink.status == 503
    assert core.metrics.saturations.values == {("no_decode", "beta"): 1}
    assert core.metrics.requests.get("/v1/completions", "503", "beta") == 1
    await core.handle("/v1/completions", body("alpha"), None, Sink())
    assert core.metrics.requests.get("/v1/completions", "200", "alpha") == 1


async def test_an_engine_failure_is_logged_with_the_engines_model(caplog) -> None:
    core, _, pool = make_core()
    pool.decode.append(EngineFailure("db", FailureClass.INFERENCE_STATUS, "HTTP 500"))
    sink = Sink()
    with caplog.at_level("INFO", logger="narwhal.events"):
        await core.handle("/v1/completions", body("beta"), None, sink)
    assert sink.status == 502
    lines = [msgspec.json.decode(r.getMessage()) for r in caplog.records if r.name == "narwhal.events"]
    [failure] = [line for line in lines if line["event"] == "engine_failure"]
    assert (failure["engine"], failure["model"]) == ("db", "beta")
    [request] = [line for line in lines if line["event"] == "request"]
    assert request["model"] == "beta"


# ----- engine series: the engine's model --------------------------------------------------------------------


class _NoProbes:
    """A control pool no test here reaches."""

    async def get(self, *args, **kwargs):
        raise AssertionError("no probe expected")


def test_engine_series_and_fleet_events_carry_the_engines_model(caplog) -> None:
    from narwhal.control.fleet_writer import FleetWriter
    from narwhal.control.supervisor import Supervisor
    from narwhal.fleet import Fleet, HoldKind

    config = parse_config(TWO_MODELS)
    metrics = RouterMetrics()
    fleet = Fleet([(spec.name, spec.role, config.model_of(spec)) for spec in config.engines], eject_after=2,
                  liveness_misses=3, failure_quarantine_s=None, probe_interval_s=5.0)
    writer = FleetWriter(fleet, metrics)
    supervisor = Supervisor(config=config, fleet=writer, control_pool=_NoProbes(),  # type: ignore[arg-type]
                            metrics=metrics, clock=lambda: 1.0)
    with caplog.at_level("INFO", logger="narwhal.events"):
        supervisor.record_failure("db", FailureClass.CONNECTION)
        supervisor.record_failure("db", FailureClass.CONNECTION)
        writer.add_hold("da", HoldKind.OPERATOR_DRAIN, "operator", 1.0)
    assert metrics.engine_failures.values == {("db", "connection", "beta"): 2}
    assert metrics.engine_ejections.values == {("db", "connection", "beta"): 1}
    assert metrics.holds_applied.values == {("da", "operator_drain", "alpha"): 1}
    lines = [msgspec.json.decode(r.getMessage()) for r in caplog.records if r.name == "narwhal.events"]
    assert {(line["event"], line["engine"], line["model"]) for line in lines} == {
        ("engine_ejected", "db", "beta"), ("engine_hold_added", "da", "alpha")}
    # An engine a reload removed meanwhile: counted under the model its spec named.
    fleet.remove_engine("db", 2.0, "test")
    supervisor.record_failure("db", FailureClass.CONNECTION)
    assert metrics.engine_failures.get("db", "connection", "beta") == 3


def test_interval_gauges_carry_the_engines_model() -> None:
    from narwhal.fleet.telemetry import Telemetry
    from narwhal.stages.telemetry import TelemetryStage

    now = [0.0]
    telemetry = Telemetry([("pa", "prefill"), ("da", "decode"), ("pb", "prefill"), ("db", "decode")],
                          interval_s=10.0, keep_intervals=2, clock=lambda: now[0])
    models = {"pa": "alpha", "da": "alpha", "pb": "beta", "db": "beta"}
    metrics = RouterMetrics()
    stage = TelemetryStage(telemetry=telemetry, metrics=metrics, model_of=models.__getitem__)
    telemetry.roll(0.0)
    telemetry.record_request(prefill="pb", decode="db", ttft_s=0.2, inter_token_s=0.01, error_engine=None)
    now[0] = 10.0
    telemetry.roll(10.0)
    assert stage.publish()
    text = metrics.render()
    assert 'narwhal_engine_interval_requests{engine="db",model="beta"} 1' in text
    assert 'narwhal_engine_interval_time_to_first_token_seconds{engine="pb",quantile="0.5",model="beta"} 0.2' in text
    assert 'narwhal_engine_interval_requests{engine="pa",model="alpha"} 0' in text


def test_worker_counts_summed_by_the_controller_keep_the_model_label() -> None:
    from narwhal.workers.metrics_sum import MetricsSum, export_state

    total = MetricsSum()
    for worker in (1, 2):
        registry = RouterMetrics()
        registry.requests.inc("/v1/completions", "200", "beta")
        registry.requests.inc("/v1/completions", "404", "")
        registry.placements.inc("prefill", "miss", "beta", amount=worker)
        total.update(worker, export_state(registry.registry))
    controller = RouterMetrics()
    controller.requests.inc("/v1/completions", "200", "alpha")
    total.attach_to(controller.registry)
    text = controller.render()
    assert 'narwhal_requests_total{route="/v1/completions",status="200",model="beta"} 2' in text
    assert 'narwhal_requests_total{route="/v1/completions",status="200",model="alpha"} 1' in text
    assert 'narwhal_requests_total{route="/v1/completions",status="404",model=""} 2' in text
    assert 'narwhal_placement_total{role="prefill",reason="miss",model="beta"} 3' in text
