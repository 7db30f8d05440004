"""--resume with several models: the engine set includes each engine's model, and a handoff written by a
one-model router (no ``model`` anywhere: today's handoffs) resumes on the same engines."""

from __future__ import annotations

from pathlib import Path

import msgspec

from narwhal.config import Config, parse_config
from narwhal.fleet import Fleet, HoldKind
from narwhal.stages.persistence import PersistenceStage
from narwhal.state.handoff import HANDOFF_SCHEMA, EngineSetEntry, read_document
from narwhal.state.resume import apply_resume, engine_set_difference, plan_resume

OLD_NOW, OLD_WALL = 100.0, 1_000_000.0
NOW = 5.0

# A handoff as a one-model router wrote it before models were named: no "model" in its engine set or records.
ONE_MODEL_HANDOFF = b"""{"schema":1,"router_id":"old","pid":4242,"pass_number":41,"written_at":1000000.0,
"engine_set":[{"name":"p1","url":"http://127.0.0.1:9001","role":"prefill"},
{"name":"d1","url":"http://127.0.0.1:9011","role":"decode"},
{"name":"p2","url":"http://127.0.0.1:9002","role":"prefill"},
{"name":"d2","url":"http://127.0.0.1:9012","role":"decode"}],
"engines":[
{"name":"p1","role":"prefill","ejected":false,"ejected_reason":null,"ejected_cause":null,"ejected_at_wall":null,
"holds":[],"streaks":{"connection":0,"timeout":0,"stream":0,"overload":0,"inference_status":0,"kv_handoff":0},
"liveness_misses":0,"next_probe_at_wall":null,"counters":{"ejections":0,"probes":{"success":0,"failed":0,
"inconclusive":0},"failures":{"connection":0,"timeout":0,"stream":0,"overload":0,"inference_status":0,
"kv_handoff":0}}},
{"name":"d1","role":"decode","ejected":false,"ejected_reason":null,"ejected_cause":null,"ejected_at_wall":null,
"holds":[{"kind":"operator_drain","reason":"operator drain","since_wall":1000000.0,"deadline_wall":null,
"deferred":false,"cause":null}],"streaks":{"connection":0,"timeout":0,"stream":0,"overload":0,
"inference_status":0,"kv_handoff":0},"liveness_misses":0,"next_probe_at_wall":null,"counters":{"ejections":0,
"probes":{"success":0,"failed":0,"inconclusive":0},"failures":{"connection":0,"timeout":0,"stream":0,
"overload":0,"inference_status":0,"kv_handoff":0}}},
{"name":"p2","role":"prefill","ejected":false,"ejected_reason":null,"ejected_cause":null,"ejected_at_wall":null,
"holds":[],"streaks":{"connection":0,"timeout":0,"stream":0,"overload":0,"inference_status":0,"kv_handoff":0},
"liveness_misses":0,"next_probe_at_wall":null,"counters":{"ejections":0,"probes":{"success":0,"failed":0,
"inconclusive":0},"failures":{"connection":0,"timeout":0,"stream":0,"overload":0,"inference_status":0,
"kv_handoff":0}}},
{"name":"d2","role":"decode","ejected":true,"ejected_reason":"connection streak reached 2 (eject_after 2)",
"ejected_cause":"connection","ejected_at_wall":1000000.0,"holds":[{"kind":"failure_quarantine",
"reason":"ejected: connection streak reached 2 (eject_after 2)","since_wall":1000000.0,"deadline_wall":1000030.0,
"deferred":false,"cause":"connection"}],"streaks":{"connection":2,"timeout":0,"stream":0,"overload":0,
"inference_status":0,"kv_handoff":0},"liveness_misses":0,"next_probe_at_wall":null,"counters":{"ejections":1,
"probes":{"success":0,"failed":0,"inconclusive":0},"failures":{"connection":2,"timeout":0,"stream":0,
"overload":0,"inference_status":0,"kv_handoff":0}}}],
"consolidation_risk":{"prefill":"none","decode":"critical"},"lease":{"holder":"none","epoch":0},"drained":["d1"]}
"""


def config(models: dict[str, str | None]) -> Config:
    """p1, d1, p2, d2 (ports as in the old handoff), each with the given model (None: [fleet] model, "a")."""
    ports = {"p1": 9001, "d1": 9011, "p2": 9002, "d2": 9012, "d3": 9013}
    text = '[fleet]\nmodel = "a"\n'
    for name, model in models.items():
        role = "prefill" if name.startswith("p") else "decode"
        text += f'[[engines]]\nname = "{name}"\nurl = "http://127.0.0.1:{ports[name]}"\nrole = "{role}"\n'
        if model is not None:
            text += f'model = "{model}"\n'
    return parse_config(text)


def make_fleet(cfg: Config) -> Fleet:
    return Fleet([(spec.name, spec.role, cfg.model_of(spec)) for spec in cfg.engines], eject_after=2,
                 liveness_misses=3, failure_quarantine_s=30.0, probe_interval_s=5.0)


async def write_handoff(path: Path, cfg: Config, fleet: Fleet) -> None:
    stage = PersistenceStage(path=path, router_id="old", fleet=fleet, config=cfg,
                             clock=lambda: OLD_NOW, wall_clock=lambda: OLD_WALL)
    await stage.run(41)


TWO_MODELS = {"p1": None, "d1": None, "p2": "b", "d2": "b"}


def test_a_one_model_routers_handoff_resumes_on_the_same_engines_now_serving_two_models(tmp_path: Path) -> None:
    path = tmp_path / "handoff.json"
    path.write_bytes(ONE_MODEL_HANDOFF)
    cfg = config(TWO_MODELS)
    plan = plan_resume(path, cfg)
    assert plan.applied, plan.reason
    fleet = make_fleet(cfg)
    apply_resume(plan, fleet, NOW, OLD_WALL + 10.0)
    # The state carried over, onto each engine's configured model.
    assert fleet.view("d2", NOW).ejected and fleet.view("d2", NOW).model == "b"
    assert [hold.kind for hold in fleet.view("d1", NOW).holds] == [HoldKind.OPERATOR_DRAIN]
    assert fleet.eligible("decode", NOW, "a") == [] and fleet.eligible("decode", NOW, "b") == []
    assert fleet.eligible("prefill", NOW, "b") == ["p2"]
    # Written again, the records and the engine set name the models.
    assert {record.name: record.model for record in fleet.snapshot(NOW, OLD_WALL)} == {
        "p1": "a", "d1": "a", "p2": "b", "d2": "b"}


def test_the_one_model_handoff_resumes_on_its_own_one_model_config(tmp_path: Path) -> None:
    path = tmp_path / "handoff.json"
    path.write_bytes(ONE_MODEL_HANDOFF)
    cfg = config({"p1": None, "d1": None, "p2": None, "d2": None})
    plan = plan_resume(path, cfg)
    assert plan.applied, plan.reason
    fleet = make_fleet(cfg)
    apply_resume(plan, fleet, NOW, OLD_WALL + 10.0)
    assert fleet.view("d2", NOW).ejected and fleet.eligible("decode", NOW) == []


async def test_a_handoff_names_each_engines_model_and_resumes_on_the_same_models(tmp_path: Path) -> None:
    path = tmp_path / "handoff.json"
    cfg = config(TWO_MODELS)
    fleet = make_fleet(cfg)
    fleet.add_hold("p2", HoldKind.OPERATOR_DRAIN, "operator drain", OLD_NOW)
    await write_handoff(path, cfg, fleet)
    document = read_document(path)
    # A defaulted field: the schema stays (an older reader decodes the document, ignoring it).
    assert document.schema == HANDOFF_SCHEMA == 1
    assert [(entry.name, entry.model) for entry in document.engine_set] == [
        ("p1", "a"), ("d1", "a"), ("p2", "b"), ("d2", "b")]
    assert {record.name: record.model for record in document.engines} == {"p1": "a", "d1": "a", "p2": "b", "d2": "b"}
    plan = plan_resume(path, cfg)
    assert plan.applied
    resumed = make_fleet(cfg)
    apply_resume(plan, resumed, NOW, OLD_WALL + 10.0)
    assert resumed.eligible("prefill", NOW, "b") == [] and resumed.eligible("prefill", NOW, "a") == ["p1"]


async def test_an_engine_that_moved_to_another_model_is_another_engine_set(tmp_path: Path) -> None:
    path = tmp_path / "handoff.json"
    written = config({"p1": None, "d1": None, "d2": None, "p2": "b", "d3": "b"})
    await write_handoff(path, written, make_fleet(written))
    moved = config({"p1": None, "d1": None, "d2": "b", "p2": "b", "d3": "b"})
    plan = plan_resume(path, moved)
    assert not plan.applied
    assert plan.reason == "handoff not applied: engine set differs: changed d2"


def test_a_saved_entry_without_a_model_fits_any_and_one_with_a_model_must_match() -> None:
    cfg = config(TWO_MODELS)
    old = [EngineSetEntry(name=spec.name, url=spec.url, role=spec.role) for spec in cfg.engines]
    assert engine_set_difference(old, cfg.engines) is None
    named = [msgspec.structs.replace(entry, model=cfg.model_of(cfg.engine_spec(entry.name))) for entry in old]
    assert engine_set_difference(named, cfg.engines) is None
    swapped = [msgspec.structs.replace(entry, model="a" if entry.model == "b" else "b") for entry in named]
    assert engine_set_difference(swapped, cfg.engines) == "changed d1, d2, p1, p2"


def test_a_record_naming_another_model_than_the_configured_one_is_not_applied(tmp_path: Path) -> None:
    # The engine set says nothing of models (hand-made or old), but d2's record says it served model a.
    data = ONE_MODEL_HANDOFF.replace(b'{"name":"d2","role":"decode",', b'{"name":"d2","role":"decode","model":"a",')
    path = tmp_path / "handoff.json"
    path.write_bytes(data)
    plan = plan_resume(path, config(TWO_MODELS))
    assert not plan.applied and plan.reason == "handoff not applied: engine set differs: changed d2"
