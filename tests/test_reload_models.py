"""``Router.reload`` with several models: an engine moving between models is a removal plus an addition,
and ``[fleet] model`` / ``[[fleet.models]]`` (aliases) apply live."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from narwhal.config import load_config
from narwhal.router import Router
from tests.test_request_core import Sink

# Model a ([fleet] model): p1, d1, d2; model b: p2, d3. No engine listens on these ports.
TWO_MODELS = """
[serving]
listen = "127.0.0.1:8000"
[handoff]
path = "{handoff}"
[fleet]
model = "a"

[[engines]]
name = "p1"
url = "http://127.0.0.1:9001"
role = "prefill"

[[engines]]
name = "d1"
url = "http://127.0.0.1:9002"
role = "decode"

[[engines]]
name = "d2"
url = "http://127.0.0.1:9003"
role = "decode"

[[engines]]
name = "p2"
url = "http://127.0.0.1:9004"
role = "prefill"
model = "b"

[[engines]]
name = "d3"
url = "http://127.0.0.1:9005"
role = "decode"
model = "b"
"""


def events(caplog: pytest.LogCaptureFixture, name: str) -> list[dict]:
    lines = [json.loads(record.getMessage()) for record in caplog.records if record.name == "narwhal.events"]
    return [line for line in lines if line["event"] == name]


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "narwhal.toml"
    path.write_text(TWO_MODELS.replace("{handoff}", str(tmp_path / "handoff.json")))
    return path


@pytest.fixture
async def router(config_file: Path):
    built = Router(load_config(config_file), config_path=config_file)
    try:
        yield built
    finally:
        await built.control_pool.aclose()
        await built.data_plane.data_pool.aclose()  # type: ignore[attr-defined]


def move_d2_to_b(text: str) -> str:
    return text.replace('url = "http://127.0.0.1:9003"\nrole = "decode"\n',
                        'url = "http://127.0.0.1:9003"\nrole = "decode"\nmodel = "b"\n')


async def test_an_engine_moved_to_another_model_leaves_its_pool_and_joins_the_other_held(
        router: Router, config_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    assert router.fleet.eligible("decode", 1.0, "a") == ["d1", "d2"]
    config_file.write_text(move_d2_to_b(config_file.read_text()))
    outcome = await router.reload()
    assert outcome.reloaded and outcome.changes is not None
    assert outcome.changes.engines_changed == ["d2"]
    # Not running (nothing in flight): the old d2 (model a) left at once, the new d2 (model b) came in.
    [removing], [removed], [added] = (events(caplog, kind) for kind in
                                      ("engine_removing", "engine_removed", "engine_added"))
    assert (removing["engine"], removing["model"]) == ("d2", "a")
    assert (removed["engine"], removed["model"]) == ("d2", "a")
    assert (added["engine"], added["model"]) == ("d2", "b")
    assert router.fleet.model_of("d2") == "b"
    # Model a keeps d1 alone; in model b, d2 is held out of placement until readmission admits it.
    assert router.fleet.eligible("decode", 1.0, "a") == ["d1"]
    assert router.fleet.eligible("decode", 1.0, "b") == ["d3"]
    view = router.fleet.view("d2", 1.0)
    assert view.model == "b" and view.ejected and str(view.ejected_cause) == "added"
    # Readmission and probes now know d2 as model b's: its model check asks for b.
    assert router.supervisor.engines["d2"].model == "b"
    spec = router.readmitter._spec("d2")
    assert router.readmitter.config.model_of(spec) == "b"
    # The handoff's engine set and the request path follow.
    assert [(e.name, e.model) for e in router.persistence.engine_set] == [
        ("p1", "a"), ("d1", "a"), ("p2", "b"), ("d3", "b"), ("d2", "b")]
    core = router.data_plane.core  # type: ignore[attr-defined]
    assert core.models.decode_engines == {"a": frozenset({"d1"}), "b": frozenset({"d2", "d3"})}
    # Engine series carry d2's new model.
    assert 'narwhal_engine_eligible{engine="d2",role="decode",model="b"} 0' in router.metrics.render()


async def test_a_reload_that_adds_an_alias_routes_it_to_its_models_engines(
        router: Router, config_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    core = router.data_plane.core  # type: ignore[attr-defined]
    body = b'{"model": "bee", "prompt": "hi", "max_tokens": 2}'
    sink = Sink()
    await core.handle("/v1/completions", body, None, sink)
    assert sink.status == 404 and sink.json()["error"]["code"] == "model_not_found"
    config_file.write_text(config_file.read_text() + '\n[[fleet.models]]\nname = "b"\naliases = ["bee"]\n')
    outcome = await router.reload()
    assert outcome.reloaded and outcome.changes is not None
    assert outcome.changes.keys_changed == ["fleet.models"] and outcome.changes.keys_needing_restart == []
    sink = Sink()
    await core.handle("/v1/completions", body, None, sink)
    # Placed on model b's prefill engine p2 (none listens there: its /tokenize is refused), under b's own name.
    assert sink.status == 502 and "engine p2 failed" in sink.json()["error"]["message"]
    [request] = [line for line in events(caplog, "request") if line["status"] == 502]
    assert request["model"] == "b"
    assert core.metrics.requests.get("/v1/completions", "502", "b") == 1


async def test_fleet_model_is_reloadable_and_moves_the_engines_that_name_none(
        router: Router, config_file: Path) -> None:
    config_file.write_text(config_file.read_text().replace('model = "a"', 'model = "c"', 1))
    outcome = await router.reload()
    assert outcome.reloaded and outcome.changes is not None
    assert "fleet.model" in outcome.changes.keys_changed and outcome.changes.keys_needing_restart == []
    # p1, d1, d2 served [fleet] model: each is a removal plus an addition, into model c.
    assert sorted(outcome.changes.engines_changed) == ["d1", "d2", "p1"]
    assert router.fleet.models() == ["b", "c"]
    assert router.fleet.eligible("decode", 1.0, "c") == []  # held until readmission
    assert router.fleet.eligible("decode", 1.0, "b") == ["d3"]
