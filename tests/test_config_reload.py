"""``Router.reload`` in one process: what a reload applies, what it keeps, and a bad file changing nothing."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from narwhal.config import load_config
from narwhal.errors import FailureClass
from narwhal.router import Router
from narwhal.tools.admin_cli import format_reload

BASE = """
[serving]
listen = "127.0.0.1:8000"
[recovery]
eject_after = 3
[admin]
token = "old-token"
[handoff]
path = "{handoff}"
[[engines]]
name = "p1"
url = "http://127.0.0.1:9001"
role = "prefill"
[[engines]]
name = "d1"
url = "http://127.0.0.1:9002"
role = "decode"
"""


def events(caplog: pytest.LogCaptureFixture, name: str) -> list[dict]:
    lines = [json.loads(record.getMessage()) for record in caplog.records if record.name == "narwhal.events"]
    return [line for line in lines if line["event"] == name]


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "narwhal.toml"
    path.write_text(BASE.format(handoff=tmp_path / "handoff.json"))
    return path


@pytest.fixture
async def router(config_file: Path):
    built = Router(load_config(config_file), config_path=config_file)
    try:
        yield built
    finally:
        await built.control_pool.aclose()
        await built.data_plane.data_pool.aclose()  # type: ignore[attr-defined]


async def test_a_broken_file_changes_nothing_and_logs_one_failure_naming_file_key_and_problem(
        router: Router, config_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    before = router.config
    config_file.write_text(config_file.read_text().replace("eject_after = 3", "eject_after = 0")
                           .replace('"old-token"', '"new-token"'))
    outcome = await router.reload()
    assert not outcome.reloaded
    assert router.config is before
    [failed] = events(caplog, "config_reload_failed")
    assert failed["file"] == str(config_file)
    assert failed["key"] == "recovery"
    assert "eject_after must be > 0" in failed["problem"]
    assert events(caplog, "config_reloaded") == []
    # The old token still opens the admin API; the new one does not.
    client = router.app.test_client()
    response = await client.get("/admin/engines", headers={"authorization": "Bearer new-token"})
    assert response.status_code == 401


async def test_not_toml_at_all_is_a_failure_without_a_key(
        router: Router, config_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    config_file.write_text("[serving\n")
    outcome = await router.reload()
    assert not outcome.reloaded and outcome.error is not None
    [failed] = events(caplog, "config_reload_failed")
    assert failed["key"] is None and failed["problem"].startswith("not valid TOML")


async def test_reloadable_keys_take_effect_and_restart_keys_keep_their_running_values(
        router: Router, config_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    text = (config_file.read_text().replace("eject_after = 3", "eject_after = 7\nliveness_misses = 9")
            .replace('"old-token"', '"new-token"').replace("127.0.0.1:8000", "127.0.0.1:8111")
            .replace("[admin]", "[controller]\nmonitor_interval_s = 0.5\nstage_timeout_s = 0.25\n"
                                "drift_factor = 4.5\n[telemetry]\ninterval_s = 2.5\n"
                                "[fleet]\ngeneration = \"g7\"\n[admin]"))
    config_file.write_text(text)
    outcome = await router.reload()
    assert outcome.reloaded and outcome.changes is not None
    assert outcome.changes.keys_needing_restart == ["serving.listen"]
    assert outcome.changes.keys_changed == ["admin.token", "controller.drift_factor",
                                            "controller.monitor_interval_s", "controller.stage_timeout_s",
                                            "fleet.generation", "recovery.eject_after", "recovery.liveness_misses",
                                            "telemetry.interval_s"]
    [reloaded] = events(caplog, "config_reloaded")
    assert reloaded["keys_needing_restart"] == ["serving.listen"]
    assert reloaded["level"] == "warning"
    assert router.config.serving.listen == "127.0.0.1:8000"
    assert router.config.recovery.eject_after == 7
    assert router.readmitter.config.fleet.generation == "g7"
    assert router.monitor.interval_s == 0.5 and router.monitor.stage_timeout_s == 0.25
    assert router.controller.tracker.drift_factor == 4.5 and router.telemetry.interval_s == 2.5
    # The fleet ejects on the new streak length: 6 connection failures are not enough, the 7th is.
    for _ in range(6):
        router.fleet.record_failure("d1", FailureClass.CONNECTION, 1.0)
    assert not router.fleet.view("d1", 1.0).ejected
    router.fleet.record_failure("d1", FailureClass.CONNECTION, 1.0)
    assert router.fleet.view("d1", 1.0).ejected
    client = router.app.test_client()
    assert (await client.get("/admin/engines", headers={"authorization": "Bearer old-token"})).status_code == 401
    assert (await client.get("/admin/engines", headers={"authorization": "Bearer new-token"})).status_code == 200


async def test_post_admin_reload_answers_with_what_changed_and_422_on_a_broken_file(
        router: Router, config_file: Path) -> None:
    client = router.app.test_client()
    auth = {"authorization": "Bearer old-token"}
    assert (await client.post("/admin/reload")).status_code == 401
    config_file.write_text(config_file.read_text().replace("eject_after = 3", "eject_after = 4")
                           + '[[engines]]\nname = "d2"\nurl = "http://127.0.0.1:9003"\nrole = "decode"\n')
    response = await client.post("/admin/reload", headers=auth)
    assert response.status_code == 200
    body = await response.get_json()
    assert body["reloaded"] is True
    assert body["changes"]["keys_changed"] == ["recovery.eject_after"]
    assert body["changes"]["engines_added"] == ["d2"]
    text = format_reload(body)
    assert "keys changed: recovery.eject_after" in text and "engines added: d2" in text

    config_file.write_text(config_file.read_text().replace('url = "http://127.0.0.1:9003"', 'url = "ftp://x"'))
    response = await client.post("/admin/reload", headers=auth)
    assert response.status_code == 422
    body = await response.get_json()
    assert body["error"]["code"] == "config_reload_failed"
    assert body["reload"]["error"]["key"] == 'engine "d2"'
    assert "ftp://x" in body["reload"]["error"]["problem"]
    assert str(config_file) in body["error"]["message"]
    assert router.config.recovery.eject_after == 4


async def test_a_router_without_a_config_file_says_there_is_nothing_to_read(router: Router) -> None:
    router.config_path = None
    outcome = await router.reload()
    assert not outcome.reloaded and outcome.error is not None
    assert outcome.error.problem == "no config file to read again"


async def test_an_engine_url_that_is_this_router_is_refused_and_changes_nothing(
        router: Router, config_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    config_file.write_text(config_file.read_text()
                           + '[[engines]]\nname = "d2"\nurl = "http://127.0.0.1:8000"\nrole = "decode"\n')
    outcome = await router.reload()
    assert not outcome.reloaded and outcome.error is not None
    assert outcome.error.key == "engines[2].url" and "loop back" in outcome.error.problem
    assert not router.fleet.knows("d2")
    assert len(events(caplog, "config_reload_failed")) == 1


async def test_a_changed_url_is_a_removal_then_a_fresh_held_addition(
        router: Router, config_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    router.fleet.record_failure("d1", FailureClass.CONNECTION, 1.0)
    config_file.write_text(config_file.read_text().replace("127.0.0.1:9002", "127.0.0.1:9102"))
    outcome = await router.reload()
    assert outcome.changes is not None and outcome.changes.engines_changed == ["d1"]
    # Not running (no nursery, nothing in flight): the old d1 left at once and the new one came in.
    names = [event["event"] for event in events(caplog, "engine_removing") + events(caplog, "engine_removed")
             + events(caplog, "engine_added")]
    assert names == ["engine_removing", "engine_removed", "engine_added"]
    assert router.supervisor.engines["d1"].url == "http://127.0.0.1:9102"
    view = router.fleet.view("d1", 2.0)
    assert view.ejected and str(view.ejected_cause) == "added" and not any(view.evidence.values())
    entry = router.engine_view.engine("d1")
    assert entry.url == "http://127.0.0.1:9102"
    assert [e.name for e in router.persistence.engine_set] == ["p1", "d1"]


async def test_the_prefix_index_follows_the_engine_set(router: Router, config_file: Path) -> None:
    router.prefix_index.index.record("p1", [1, 2, 3], 1.0)
    config_file.write_text(config_file.read_text()
                           + '[[engines]]\nname = "p2"\nurl = "http://127.0.0.1:9005"\nrole = "prefill"\n')
    await router.reload()
    assert router.prefix_index.index.engines == ["p1", "p2"]
    assert router.prefix_index.index.match("p1", [1, 2, 3]) == 3
    config_file.write_text(config_file.read_text().replace('name = "p1"', 'name = "p3"'))
    await router.reload()
    # p1 left (nothing in flight, not running: at once): its entries and its key are gone.
    assert router.prefix_index.index.engines == ["p2", "p3"]
    assert router.prefix_index.index.match("p1", [1, 2, 3]) == 0
