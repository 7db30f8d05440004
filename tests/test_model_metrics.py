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
