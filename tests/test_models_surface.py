"""Several models at the HTTP surface: /v1/models, /v1/models/{id}, /ready and /ready?model=, /admin/models,
the first identity read after startup (an engine answering for another model stays out), and max_model_len.

Fakes only: the app over ``ModelViewer`` and a real ``Fleet``; the readmitter over fake engines behind
``httpx.MockTransport`` (tests/test_readmission.py's world); a worker answering /ready from its snapshot.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import msgspec
import pytest
import trio
from trio.testing import MockClock

from narwhal.app.control_app import create_app
from narwhal.config import Config, EngineSpec, FleetConfig, ModelConfig, RunningConfig
from narwhal.control import contract
from narwhal.control.model_lengths import ModelLengths
from narwhal.control.model_view import ModelViewer
from narwhal.control.readmission import Readmitter
from narwhal.fleet import EjectionCause, Fleet
from narwhal.http1.protocol import Request
from narwhal.lease.service import LeaseView
from narwhal.model_ready import query_model, ready_answer
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.served_models import ServedModels
from narwhal.tools.admin_cli import format_models
from narwhal.workers.protocol import Snapshot
from tests import test_readmission as readmission_tests
from tests.test_admin_cli import run as admin_cli_run
from tests.test_engine_view import FakeActions, FakeMetrics, FakeTelemetry
from tests.test_readmission import FakeEngine, World, events  # noqa: F401 - events is a fixture
from tests.test_worker_process import Answer, FakeLink, worker

# Two models: "a" (alias "a-latest") on p1/d1, "b" on p2/d2.
ENGINES = [("p1", "prefill", "a"), ("d1", "decode", "a"), ("p2", "prefill", "b"), ("d2", "decode", "b")]


def two_models() -> Config:
    return Config(
        fleet=FleetConfig(model="a", generation="g1",
                          models=[ModelConfig(name="a", aliases=["a-latest"]), ModelConfig(name="b", generation="g2")]),
        engines=[EngineSpec(name=name, url=f"http://127.0.0.1:{9000 + i}", role=role, model=model)
                 for i, (name, role, model) in enumerate(ENGINES)])


def one_model() -> Config:
    return Config(fleet=FleetConfig(model="m"), engines=[
        EngineSpec(name="p1", url="http://127.0.0.1:9000", role="prefill"),
        EngineSpec(name="d1", url="http://127.0.0.1:9001", role="decode")])


def fleet_of(config: Config) -> Fleet:
    return Fleet([(spec.name, spec.role, config.model_of(spec)) for spec in config.engines], eject_after=2,
                 liveness_misses=2, failure_quarantine_s=None, probe_interval_s=5.0)


class State:
    """The AppState the control app reads, over a real Fleet and ModelViewer."""

    def __init__(self, config: Config, refusal: str | None = None) -> None:
        self.config = config
        self.metrics = FakeMetrics()
        self.telemetry = FakeTelemetry()
        self.engine_view = None
        self.readmitter = FakeActions()
        self.fleet = fleet_of(config)
        self.lengths = ModelLengths()
        self.refusal = refusal
        self.model_view = ModelViewer(config=config, fleet=self.fleet, lengths=self.lengths, created=1_700_000_000,
                                      refusal=lambda: self.refusal, clock=lambda: 10.0)

    def readiness(self) -> str | None:
        return self.refusal

    def lease_view(self) -> LeaseView:
        return LeaseView(router_id="r1", backend="none", role="active")


async def get(state: State, path: str) -> tuple[int, str, Any]:
    response = await create_app(state).test_client().get(path)  # type: ignore[arg-type]
    text = await response.get_data(as_text=True)
    body = json.loads(text) if response.content_type == "application/json" else text
    return response.status_code, response.content_type, body


# ----- /v1/models ---------------------------------------------------------------------------


async def test_v1_models_lists_every_model_then_its_aliases_in_openai_list_format() -> None:
    state = State(two_models())
    state.lengths.record("p1", 4096)
    state.lengths.record("d1", 2048)
    status, _, body = await get(state, "/v1/models")
    assert status == 200 and body["object"] == "list"
    assert body["data"] == [
        {"id": "a", "object": "model", "created": 1_700_000_000, "owned_by": "narwhal", "max_model_len": 2048},
        {"id": "a-latest", "object": "model", "created": 1_700_000_000, "owned_by": "narwhal", "max_model_len": 2048,
         "parent": "a"},
        # No engine of b reported a length: the key is left out.
        {"id": "b", "object": "model", "created": 1_700_000_000, "owned_by": "narwhal"},
    ]


async def test_v1_models_id_answers_a_model_or_an_alias_and_404_model_not_found() -> None:
    state = State(two_models())
    state.lengths.record("d2", 1024)
    assert (await get(state, "/v1/models/b"))[2] == {
        "id": "b", "object": "model", "created": 1_700_000_000, "owned_by": "narwhal", "max_model_len": 1024}
    assert (await get(state, "/v1/models/a-latest"))[2]["parent"] == "a"
    status, _, body = await get(state, "/v1/models/nope")
    assert status == 404
    assert set(body["error"]) == {"message", "type", "code"}
    assert (body["error"]["type"], body["error"]["code"]) == ("invalid_request_error", "model_not_found")
    # A model id with a slash (as Hugging Face names are) is one id.
    slashed = Config(fleet=FleetConfig(model="org/m"), engines=[
        EngineSpec(name="p1", url="http://127.0.0.1:9000", role="prefill"),
        EngineSpec(name="d1", url="http://127.0.0.1:9001", role="decode")])
    assert (await get(State(slashed), "/v1/models/org/m"))[2]["id"] == "org/m"


# ----- /ready -------------------------------------------------------------------------------


async def test_ready_with_one_model_keeps_todays_text() -> None:
    state = State(one_model())
    assert (await get(state, "/ready"))[::2] == (200, "ready\n")
    state.fleet.eject("d1", "gone", 1.0)
    assert (await get(state, "/ready"))[::2] == (503, "serving capacity exhausted: no eligible decode engine\n")
    assert (await get(state, "/ready?model=m"))[::2] == (503, "serving capacity exhausted: no eligible decode engine\n")


async def test_ready_is_200_while_one_model_can_serve_and_names_those_that_cannot() -> None:
    state = State(two_models())
    state.fleet.eject("d2", "gone", 1.0)
    status, _, text = await get(state, "/ready")
    assert status == 200
    assert text == ("ready; model 'b' cannot serve: serving capacity exhausted: no eligible decode engine "
                    "of model 'b'\n")
    assert (await get(state, "/ready?model=a"))[::2] == (200, "ready\n")
    assert (await get(state, "/ready?model=a-latest"))[::2] == (200, "ready\n")
    assert (await get(state, "/ready?model=b"))[0] == 503
    state.fleet.eject("p1", "gone", 1.0)
    status, _, text = await get(state, "/ready")
    assert status == 503 and "no model can serve" in text
    assert (await get(state, "/ready?model=a-latest"))[::2] == (
        503, "serving capacity exhausted: no eligible prefill engine of model 'a'\n")


async def test_ready_for_a_model_not_served_is_404_and_a_closed_gate_is_503_for_every_model() -> None:
    state = State(two_models())
    status, content_type, body = await get(state, "/ready?model=zz")
    assert status == 404 and content_type == "application/json"
    assert body["error"]["code"] == "model_not_found"
    state.refusal = "monitor degraded: 3 failed passes"
    for path in ("/ready", "/ready?model=a", "/ready?model=b"):
        assert (await get(state, path))[::2] == (503, "monitor degraded: 3 failed passes\n")


def test_the_ready_query_reads_model_once_percent_decoded() -> None:
    assert query_model("") is None and query_model("x=1") is None
    assert query_model("model=org%2Fm&model=other") == "org/m"
    assert query_model("model=") == ""
    served = ServedModels.of(two_models())
    answer = ready_answer("", refusal=None, capacity_problem=None, capacity_problems={}, served=served)
    assert answer.status == 404


async def test_a_worker_answers_ready_for_a_model_from_its_snapshot() -> None:
    w = worker(FakeLink())
    w.plane.core.set_engines(two_models().engines)
    w.plane.core.set_fleet(two_models().fleet)
    problem = "serving capacity exhausted: no eligible decode engine of model 'b'"
    w.on_message(Snapshot(seq=1, eligible={"prefill": ["p1", "p2"], "decode": ["d1"]},
                          pools={"a": {"prefill": ["p1"], "decode": ["d1"]}, "b": {"prefill": ["p2"], "decode": []}},
                          capacity_problems={"b": problem}))
    answers = {}
    for target in (b"/ready", b"/ready?model=a-latest", b"/ready?model=b", b"/ready?model=zz"):
        answer = Answer()
        await w._serve_rest(Request(b"GET", target), answer)  # type: ignore[arg-type]
        answers[target] = (answer.status, answer.body)
    assert answers[b"/ready"] == (200, f"ready; model 'b' cannot serve: {problem}\n".encode())
    assert answers[b"/ready?model=a-latest"] == (200, b"ready\n")
    assert answers[b"/ready?model=b"] == (503, f"{problem}\n".encode())
    assert answers[b"/ready?model=zz"][0] == 404 and b"model_not_found" in answers[b"/ready?model=zz"][1]


# ----- /admin/models and the CLI ------------------------------------------------------------


async def test_admin_models_shows_each_model_its_engines_and_whether_it_can_serve() -> None:
    state = State(two_models())
    state.lengths.record("d2", 1024)
    state.fleet.eject("d2", "gone", 1.0)
    status, _, body = await get(state, "/admin/models")
    assert status == 200
    a, b = body["models"]
    assert a == {"name": "a", "aliases": ["a-latest"], "generation": "g1", "max_model_len": None, "can_serve": True,
                 "reason": None, "engines": [{"name": "p1", "role": "prefill", "state": "eligible", "removing": False},
                                             {"name": "d1", "role": "decode", "state": "eligible", "removing": False}]}
    assert (b["generation"], b["max_model_len"], b["can_serve"]) == ("g2", 1024, False)
    assert "no eligible decode engine of model 'b'" in b["reason"]
    assert [(e["name"], e["state"]) for e in b["engines"]] == [("p2", "eligible"), ("d2", "ejected")]
    table = format_models(body["models"])
    assert table.splitlines()[0].split() == ["MODEL", "ALIASES", "GENERATION", "MAX_MODEL_LEN", "SERVING", "ENGINES"]
    assert "d2 (decode, ejected)" in table and "b: cannot serve: serving capacity exhausted" in table


# ----- the first identity read after startup ------------------------------------------------


class CardEngine(FakeEngine):
    """A fake engine whose /v1/models card carries max_model_len, and that may lack the identity plugin."""

    def __init__(self, name: str, role: str) -> None:
        super().__init__(name, role)
        self.max_model_len: int | None = 4096
        self.silent = False

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if self.silent:
            await trio.sleep_forever()
        if request.url.path == "/v1/models":
            self.calls.append((request.method, request.url.path))
            card: dict[str, Any] = {"id": self.models_listed[0], "object": "model"}
            if self.max_model_len is not None:
                card["max_model_len"] = self.max_model_len
            return httpx.Response(200, json={"object": "list", "data": [card]})
        return await super().handle(request)


def card_world(monkeypatch: pytest.MonkeyPatch) -> World:
    # The readmission tests' world, its engines built as CardEngine.
    monkeypatch.setattr(readmission_tests, "FakeEngine", CardEngine)
    return World(engines=(("p1", "prefill"), ("d1", "decode"), ("d2", "decode"), ("d3", "decode")))


async def test_the_first_read_ejects_an_engine_answering_for_another_model_and_records_lengths(
        autojump_clock: MockClock, events, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    world = card_world(monkeypatch)
    engines = world.engines
    engines["p1"].max_model_len = 8192  # type: ignore[attr-defined]
    # d1's identity plugin names another model.
    engines["d1"].model = "m2"
    # d2 has no identity plugin (404) and vLLM serves another model: /v1/models alone decides.
    engines["d2"].identity_status = 404
    engines["d2"].models_listed = ["m2"]
    await world.readmitter.first_identity_read()
    now = world.now()
    for name, words in (("d1", "/narwhal/identity names model 'm2'; the engine is configured for model 'm1'"),
                        ("d2", "/v1/models lists ['m2']; the engine's model 'm1' is not among them")):
        view = world.fleet.view(name, now)
        assert view.ejected and not view.eligible and view.ejected_cause is EjectionCause.MODEL
        assert view.ejected_reason == f"model check: {words}"
        last = world.readmitter.last_result(name)
        assert last is not None and (last.outcome, last.check, last.reason) == ("refused", "model", words)
    assert sorted(e["engine"] for e in events() if e["check"] == "model") == ["d1", "d2"]
    assert world.fleet.is_eligible("p1", now) and world.fleet.is_eligible("d3", now)
    lengths = world.readmitter.model_lengths
    assert (lengths.get("p1"), lengths.get("d1"), lengths.get("d2"), lengths.get("d3")) == (8192, None, None, 4096)

    # The chain keeps refusing d2 at `model` until it serves its own model; then it comes back.
    d2 = engines["d2"]
    d2.identity_status = 200
    d2.model = "m2"
    refused = await world.readmitter.readmit("d2", operator=True)
    assert (refused.outcome, refused.check) == ("refused", "model")
    d2.model, d2.models_listed = "m1", ["m1"]
    d2.max_model_len = 2048  # type: ignore[attr-defined]
    readmitted = await world.readmitter.readmit("d2", operator=True)
    assert readmitted.readmitted and world.fleet.is_eligible("d2", world.now())
    assert lengths.get("d2") == 2048 and lengths.smallest(["p1", "d2"]) == 2048


async def test_the_first_read_leaves_engines_of_the_right_model_in_placement(
        autojump_clock: MockClock, monkeypatch: pytest.MonkeyPatch) -> None:
    world = card_world(monkeypatch)
    for engine in world.engines.values():
        engine.max_model_len = None  # type: ignore[attr-defined]
    # d3 does not answer: left to the health and liveness rules, and the read is bounded by the health timeout.
    world.engines["d3"].silent = True  # type: ignore[attr-defined]
    started = trio.current_time()
    await world.readmitter.first_identity_read()
    assert trio.current_time() - started == pytest.approx(world.config.engine.health_timeout_s)
    assert all(world.fleet.is_eligible(name, world.now()) for name in world.engines)
    assert world.readmitter.model_lengths.smallest(world.engines) is None
    assert all(world.readmitter.last_result(name) is None for name in world.engines)


def test_listed_max_model_len_reads_the_models_own_card() -> None:
    raw = msgspec.json.encode({"object": "list", "data": [{"id": "x", "max_model_len": 10},
                                                          {"id": "m", "max_model_len": 4096}]})
    assert contract.listed_max_model_len(raw, "m") == 4096
    assert contract.listed_max_model_len(raw, "other") is None
    for bad in ("4096", 0, -1, True, None, 1.5):
        odd = msgspec.json.encode({"data": [{"id": "m", "max_model_len": bad}]})
        assert contract.listed_max_model_len(odd, "m") is None
        # An odd length never makes the list itself unreadable.
        assert contract.listed_models(odd) == ["m"]
    assert contract.listed_max_model_len(b"not json", "m") is None


def test_model_lengths_keep_the_latest_report_and_give_the_smallest() -> None:
    lengths = ModelLengths()
    lengths.record("a", 4096)
    lengths.record("b", 2048)
    assert lengths.smallest(["a", "b", "c"]) == 2048
    lengths.record("b", None)
    assert lengths.smallest(["a", "b"]) == 4096
    lengths.forget("a")
    assert lengths.smallest(["a", "b"]) is None


def test_admin_models_on_the_command_line_reads_admin_models() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        return httpx.Response(200, json={"models": [
            {"name": "a", "aliases": [], "generation": "g1", "max_model_len": 2048, "can_serve": True, "reason": None,
             "engines": [{"name": "p1", "role": "prefill", "state": "eligible", "removing": False}]}]})

    code, out, err = admin_cli_run(["models"], httpx.MockTransport(handler))
    assert (code, err, seen) == (0, "", ["/admin/models"])
    assert out.splitlines()[1].split() == ["a", "-", "g1", "2048", "yes", "p1", "(prefill,", "eligible)"]


def test_a_reload_gives_the_models_view_its_new_models_and_aliases() -> None:
    state = State(one_model())
    assert [card.id for card in state.model_view.models().data] == ["m"]
    config = one_model()
    renamed = Config(fleet=FleetConfig(model="m", models=[ModelConfig(name="m", aliases=["m2"])]),
                     engines=config.engines)
    state.model_view.configure(RunningConfig(config=renamed))
    assert [(card.id, card.parent) for card in state.model_view.models().data] == [("m", None), ("m2", "m")]
    assert state.model_view.ready("m2").status == 200


async def test_a_broken_first_read_is_logged_and_never_stops_the_start(autojump_clock: MockClock, caplog) -> None:
    class Broken:
        async def get(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("a bug in the read")

        post_json = get

    world = World()
    readmitter = Readmitter(config=world.config, fleet=world.fleet, control_pool=Broken(),  # type: ignore[arg-type]
                            in_flight=world.in_flight, metrics=RouterMetrics(), attestation_key=None)
    caplog.set_level(logging.INFO, logger="narwhal.events")
    await readmitter.first_identity_read()
    assert all(world.fleet.is_eligible(name, world.now()) for name in world.engines)
    errors = [json.loads(r.getMessage()) for r in caplog.records if "readmission_error" in r.getMessage()]
    assert len(errors) == 3 and errors[0]["check"] == "model" and errors[0]["class"] == "RuntimeError"
