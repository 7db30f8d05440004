"""The request path with several models: a request is placed only on its model's engines, an alias routes to its
model (the engines get the model's own name), an unknown model is a 404 before any engine call, a missing one a
400 unless one model is served, and each model's own deadline and attempts apply."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
import trio

from narwhal.config import parse_config
from narwhal.errors import EngineFailure, FailureClass, SuccessKind
from narwhal.fleet.admission import Admission
from narwhal.fleet.placement import InFlight
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.serving.request_core import RequestCore
from tests.test_request_core import FakePool, Sink

CONFIG = """
[serving]
count_tokens = false
policy = "{policy}"
request_deadline_s = 5.0
max_attempts = 3
[fleet]
model = "alpha"
[[fleet.models]]
name = "beta"
aliases = ["beta-latest", "b"]
request_deadline_s = 2.0
max_attempts = 1
[[engines]]
name = "pa"
url = "http://127.0.0.1:9001"
role = "prefill"
[[engines]]
name = "da"
url = "http://127.0.0.1:9002"
role = "decode"
[[engines]]
name = "da2"
url = "http://127.0.0.1:9005"
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


class ModelSupervisor:
    """Eligible engines per model and role, as the fleet keeps them."""

    def __init__(self) -> None:
        self.pools = {"alpha": {"prefill": ["pa"], "decode": ["da", "da2"]},
                      "beta": {"prefill": ["pb"], "decode": ["db"]}}
        self.asked: list[tuple[str, str | None]] = []
        self.failures: list[tuple[str, FailureClass]] = []

    def eligible(self, role: str, model: str | None = None) -> list[str]:
        self.asked.append((role, model))
        if model is None:
            return [name for pools in self.pools.values() for name in pools[role]]
        return list(self.pools.get(model, {}).get(role, []))

    def capacity_problem(self, model: str | None = None) -> str | None:
        pools = self.pools.get(model or "", {})
        missing = [role for role in ("prefill", "decode") if not pools.get(role)]
        return f"serving capacity exhausted: no eligible {' or '.join(missing)} engine of model {model!r}" \
            if missing else None

    def record_failure(self, engine: str, failure_class: FailureClass) -> None:
        self.failures.append((engine, failure_class))

    def record_success(self, engine: str, kind: SuccessKind) -> None:
        pass


def make_core(policy: str = "saturate", config_text: str = CONFIG) -> tuple[RequestCore, ModelSupervisor, FakePool]:
    config = parse_config(config_text.format(policy=policy))
    supervisor, pool = ModelSupervisor(), FakePool()
    core = RequestCore(config=config, supervisor=supervisor, data_pool=pool,
                       in_flight=InFlight(e.name for e in config.engines), admission=Admission(),
                       metrics=RouterMetrics())
    return core, supervisor, pool


def body(**fields: Any) -> bytes:
    payload = {"prompt": "hello", "max_tokens": 3}
    payload.update(fields)
    return msgspec.json.encode({k: v for k, v in payload.items() if v is not ...})


def request_lines(caplog) -> list[dict[str, Any]]:
    return [json.loads(r.getMessage()) for r in caplog.records
            if r.name == "narwhal.events" and json.loads(r.getMessage())["event"] == "request"]


@pytest.mark.parametrize(("asked", "engines", "sent"), [
    ("alpha", {"pa", "da", "da2"}, "alpha"),
    ("beta", {"pb", "db"}, "beta"),
    ("beta-latest", {"pb", "db"}, "beta"),
    ("b", {"pb", "db"}, "beta"),
])
async def test_a_request_is_placed_on_its_models_engines_and_they_get_the_models_own_name(asked, engines, sent,
                                                                                          caplog):
    core, supervisor, pool = make_core()
    caplog.set_level("INFO", logger="narwhal.events")
    sink = Sink()
    await core.handle("/v1/completions", body(model=asked), None, sink)
    assert sink.status == 200
    assert {call[0] for call in pool.calls} <= engines and len(pool.calls) == 2
    assert [call[2]["model"] for call in pool.calls] == [sent, sent]
    assert {model for _, model in supervisor.asked} == {sent}
    [line] = request_lines(caplog)
    assert line["model"] == sent


async def test_an_unknown_model_is_a_404_in_openais_shape_before_any_engine_is_called():
    core, supervisor, pool = make_core()
    sink = Sink()
    await core.handle("/v1/completions", body(model="gamma"), None, sink)
    assert sink.status == 404
    error = sink.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "model_not_found"
    assert "gamma" in error["message"] and "'alpha'" in error["message"] and "'beta'" in error["message"]
    assert pool.calls == [] and supervisor.asked == []


async def test_a_request_without_model_is_a_400_when_several_models_are_served():
    core, _, pool = make_core()
    sink = Sink()
    await core.handle("/v1/chat/completions", body(prompt=..., messages=[{"role": "user", "content": "hi"}]),
                      None, sink)
    assert sink.status == 400
    error = sink.json()["error"]
    assert error["code"] == "missing_model" and error["type"] == "invalid_request_error"
    assert pool.calls == []


async def test_a_request_without_model_gets_the_one_model_served():
    one = CONFIG.split("[[fleet.models]]")[0] + CONFIG.split('request_deadline_s = 2.0\nmax_attempts = 1\n')[1]
    one = one.split('[[engines]]\nname = "pb"')[0]
    core, _, pool = make_core(config_text=one)
    sink = Sink()
    await core.handle("/v1/completions", body(), None, sink)
    assert sink.status == 200
    assert [call[2]["model"] for call in pool.calls] == ["alpha", "alpha"]


async def test_a_model_with_no_eligible_engine_gets_503_and_the_other_model_still_serves():
    core, supervisor, pool = make_core()
    supervisor.pools["beta"]["decode"] = []
    sink = Sink()
    await core.handle("/v1/completions", body(model="b"), None, sink)
    assert sink.status == 503 and sink.json()["error"]["code"] == "no_capacity"
    assert "beta" in sink.json()["error"]["message"]
    # Never spilled onto the other model's engines.
    assert pool.calls == []
    sink = Sink()
    await core.handle("/v1/completions", body(model="alpha"), None, sink)
    assert sink.status == 200


async def test_each_model_has_its_own_request_deadline(autojump_clock):
    core, _, pool = make_core()
    pool.decode.append(["hang"])
    sink = Sink()
    start = trio.current_time()
    await core.handle("/v1/completions", body(model="beta", stream=True), None, sink)
    assert sink.status == 504 and "2 s" in sink.json()["error"]["message"]
    assert trio.current_time() - start == pytest.approx(2.0)
    pool.decode.append(["hang"])
    start = trio.current_time()
    sink = Sink()
    await core.handle("/v1/completions", body(model="alpha", stream=True), None, sink)
    assert sink.status == 504
    assert trio.current_time() - start == pytest.approx(5.0)


async def test_each_model_has_its_own_deadline_under_the_bounded_policy(autojump_clock):
    core, _, pool = make_core("bounded")
    pool.decode.append(["hang"])
    sink = Sink()
    start = trio.current_time()
    await core.handle("/v1/completions", body(model="beta", stream=True), None, sink)
    assert sink.status == 504
    assert trio.current_time() - start == pytest.approx(2.0)


async def test_each_model_has_its_own_max_attempts():
    core, supervisor, pool = make_core("bounded")
    scripted = pool.post_json
    decodes: list[str] = []

    async def failing_decode(engine, path, payload, *, request_id):
        if not json.loads(payload)["kv_transfer_params"].get("do_remote_decode"):
            decodes.append(engine.name)
            raise EngineFailure(engine.name, FailureClass.INFERENCE_STATUS, "HTTP 500", status=500)
        return await scripted(engine, path, payload, request_id=request_id)

    pool.post_json = failing_decode
    sink = Sink()
    await core.handle("/v1/completions", body(model="beta"), None, sink)
    # beta: max_attempts = 1.
    assert sink.status == 502 and decodes == ["db"]
    decodes.clear()
    sink = Sink()
    await core.handle("/v1/completions", body(model="alpha"), None, sink)
    # alpha: serving.max_attempts = 3, on alpha's decode engines only.
    assert sink.status == 502 and len(decodes) == 3 and set(decodes) <= {"da", "da2"}


async def test_a_reload_that_adds_an_alias_routes_it():
    core, _, _ = make_core()
    sink = Sink()
    await core.handle("/v1/completions", body(model="alpha-2"), None, sink)
    assert sink.status == 404
    reloaded = parse_config(CONFIG.format(policy="saturate").replace(
        '[fleet]\nmodel = "alpha"\n', '[fleet]\nmodel = "alpha"\n[[fleet.models]]\nname = "alpha"\n'
        'aliases = ["alpha-2"]\n'))
    core.set_fleet(reloaded.fleet)
    sink = Sink()
    await core.handle("/v1/completions", body(model="alpha-2"), None, sink)
    assert sink.status == 200
