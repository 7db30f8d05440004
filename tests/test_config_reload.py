"""``Router.reload`` in one process: what a reload applies, what it keeps, and a bad file changing nothing."""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from pathlib import Path

import pytest
import trio
from trio.testing import MockClock

from narwhal.config import MAX_CONFIG_BYTES, load_config
from narwhal.control.reload import ReloadOutcome
from narwhal.errors import FailureClass
from narwhal.router import Router
from narwhal.tools.admin_cli import format_reload
from tests.test_config import GOOD

# The engines are test_config's minimal file (p1, d1); the sections are what the tests here change.
BASE = """
[serving]
listen = "127.0.0.1:8000"
[recovery]
eject_after = 3
[admin]
token = "old-token"
[handoff]
path = "{handoff}"
""" + GOOD


def events(caplog: pytest.LogCaptureFixture, name: str) -> list[dict]:
    lines = [json.loads(record.getMessage()) for record in caplog.records if record.name == "narwhal.events"]
    return [line for line in lines if line["event"] == name]


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "narwhal.toml"
    path.write_text(BASE.replace("{handoff}", str(tmp_path / "handoff.json")))
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


async def test_placement_and_the_engine_timeouts_apply_live_in_every_part_that_reads_them(
        router: Router, config_file: Path) -> None:
    placement = router.data_plane.core.placement  # type: ignore[attr-defined]
    index = router.prefix_index.index
    index.record("p1", [1, 2, 3], 1.0)
    assert placement.placer.cache_aware and placement.choose(
        "prefill", ["p1"], "/v1/completions", {"prompt": "x"}, router.in_flight).reason == "only_choice"
    config_file.write_text(config_file.read_text().replace("[admin]", """[placement]
policy = "least_outstanding"
balance_abs = 2
balance_rel = 2.5
max_index_mb = 1
block_tokens = 32
[engine]
connect_timeout_s = 0.7
request_timeout_s = 7.0
first_token_deadline_s = 0.4
stream_silence_s = 0.6
health_timeout_s = 0.3
pool_idle_s = 1.5
[admin]"""))
    outcome = await router.reload()
    assert outcome.changes is not None and outcome.changes.keys_needing_restart == []
    assert outcome.changes.keys_changed == [
        "engine.connect_timeout_s", "engine.first_token_deadline_s", "engine.health_timeout_s",
        "engine.pool_idle_s", "engine.request_timeout_s", "engine.stream_silence_s", "placement.balance_abs",
        "placement.balance_rel", "placement.block_tokens", "placement.max_index_mb", "placement.policy"]
    # Placement (the data plane's, through the snapshot): the policy, the bound, the block size, the index.
    placer = placement.placer
    assert (placer.cache_aware, placer.balance_abs, placer.balance_rel) == (False, 2, 2.5)
    assert placement.config.block_tokens == 32
    assert index.max_bytes == 1024 * 1024 and index.entries("p1") == 0  # a new block size empties it
    # The engine timeouts: the data pool's, the control pool's, the health sweep's, the probes', the rechecks'.
    pool = router.data_plane.data_pool  # type: ignore[attr-defined]
    assert pool._config.first_token_deadline_s == 0.4 and pool._config.stream_silence_s == 0.6
    assert (pool._connections.connect_timeout_s, pool._connections.write_timeout_s,
            pool._connections.idle_s) == (0.7, 7.0, 1.5)
    assert router.control_pool._config.health_timeout_s == 0.3
    control = router.control_pool._connections
    assert (control.connect_timeout_s, control.write_timeout_s, control.idle_s) == (0.7, 7.0, 1.5)
    assert router.stages.health.check_timeout_s == 0.3
    assert router.supervisor._probe_timeout_s == 0.4
    assert router.readmitter.rechecker.timeout_s == 0.3
    # The bounds the pools are built with stay: a key outside the timeouts needs a restart.
    config_file.write_text(config_file.read_text().replace("pool_idle_s = 1.5", "pool_idle_s = 1.5\n"
                                                           "max_response_bytes = 4096"))
    outcome = await router.reload()
    assert outcome.changes is not None and outcome.changes.keys_needing_restart == ["engine.max_response_bytes"]
    assert router.config.engine.max_response_bytes == 8 * 1024 * 1024


async def test_the_next_prefill_choice_follows_a_reloaded_policy(router: Router, config_file: Path) -> None:
    config_file.write_text(config_file.read_text()
                           + '[[engines]]\nname = "p2"\nurl = "http://127.0.0.1:9005"\nrole = "prefill"\n')
    await router.reload()
    placement = router.data_plane.core.placement  # type: ignore[attr-defined]
    request = {"prompt": "the same long prompt " * 20}

    def choose() -> str:
        choice = placement.choose("prefill", ["p1", "p2"], "/v1/completions", request, router.in_flight)
        assert choice is not None
        return choice.reason

    # Cache-aware: the second time, the engine that has the prompt wins.
    assert [choose(), choose()] == ["miss", "hit"]
    config_file.write_text(config_file.read_text().replace("[admin]", '[placement]\npolicy = "least_outstanding"\n'
                                                                      "[admin]"))
    await router.reload()
    assert {choose() for _ in range(4)} == {"least_outstanding"}
    config_file.write_text(config_file.read_text().replace('policy = "least_outstanding"', 'policy = "cache_aware"'))
    await router.reload()
    assert choose() == "hit"  # the index kept what it held: only a new block size empties it


# -- an engine removed and put back within serving.shutdown_grace_s ---------------------------------

D2 = '\n[[engines]]\nname = "d2"\nurl = "http://127.0.0.1:9003"\nrole = "decode"\n'
D1 = '[[engines]]\nname = "d1"\nurl = "http://127.0.0.1:9002"\nrole = "decode"\n'


async def streams_on_d1(router: Router, nursery, count: int) -> tuple[trio.Event, list[BaseException]]:
    """``count`` streams on d1 as the request path holds them (in flight, a leg the removal may cut).

    They run until the returned event is set; a cut is appended to the list.
    """
    core = router.data_plane.core  # type: ignore[attr-defined]
    finish, cuts = trio.Event(), []

    async def stream(task_status=trio.TASK_STATUS_IGNORED) -> None:
        router.in_flight.acquire("d1")  # type: ignore[attr-defined]
        try:
            with core._cuttable("d1", "decode"):
                task_status.started()
                await finish.wait()
        except Exception as exc:
            cuts.append(exc)
        finally:
            router.in_flight.release("d1")  # type: ignore[attr-defined]

    for _ in range(count):
        await nursery.start(stream)
    return finish, cuts


async def reload_now(router: Router, clock: MockClock) -> ReloadOutcome:
    """``router.reload()`` at this instant of mock time.

    A reload reads its file in a worker thread; under autojump the clock would run on while it does
    (to a removal's deadline, say): frozen for the reload, as it is for a real router's few milliseconds.
    """
    clock.autojump_threshold = math.inf
    try:
        return await router.reload()
    finally:
        clock.autojump_threshold = 0


async def test_an_identical_engine_put_back_within_the_grace_period_keeps_its_streams(
        router: Router, config_file: Path, nursery, autojump_clock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    config_file.write_text(config_file.read_text() + D2)
    await router.reload()
    await nursery.start(router.engine_set.run)  # as Router.run starts it: removals wait for their requests
    finish, cuts = await streams_on_d1(router, nursery, 8)
    with_d1 = config_file.read_text()
    config_file.write_text(with_d1.replace(D1, ""))
    outcome = await reload_now(router, autojump_clock)
    assert outcome.changes is not None and outcome.changes.engines_removed == ["d1"]
    assert router.fleet.view("d1", trio.current_time()).removing
    await trio.sleep(5.0)
    config_file.write_text(with_d1)
    outcome = await reload_now(router, autojump_clock)
    assert outcome.changes is not None and outcome.changes.engines_added == ["d1"]
    # Past the grace deadline of the first reload: nothing was cut, d1 never left.
    await trio.sleep(router.config.serving.shutdown_grace_s + 5.0)
    assert cuts == []
    assert router.in_flight["d1"] == 8
    now = trio.current_time()
    view = router.fleet.view("d1", now)
    assert not view.removing and not view.ejected and router.fleet.is_eligible("d1", now)
    assert "d1" in router.supervisor.engines and "d1" in router.data_plane.core.engines  # type: ignore[attr-defined]
    assert [e.name for e in router.persistence.engine_set] == ["p1", "d1", "d2"]
    assert events(caplog, "engine_removed") == [] and events(caplog, "engine_removal_cut") == []
    assert [e["engine"] for e in events(caplog, "engine_removal_cancelled")] == ["d1"]
    finish.set()


async def test_a_changed_engine_put_back_within_the_grace_period_is_still_a_removal_and_an_addition(
        router: Router, config_file: Path, nursery, autojump_clock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    config_file.write_text(config_file.read_text() + D2)
    await router.reload()
    await nursery.start(router.engine_set.run)
    finish, cuts = await streams_on_d1(router, nursery, 3)
    with_d1 = config_file.read_text()
    config_file.write_text(with_d1.replace(D1, ""))
    await reload_now(router, autojump_clock)
    await trio.sleep(5.0)
    config_file.write_text(with_d1.replace("127.0.0.1:9002", "127.0.0.1:9102"))
    await reload_now(router, autojump_clock)
    await trio.sleep(router.config.serving.shutdown_grace_s + 5.0)
    # The old d1's streams were cut at its grace deadline; the new d1 came in fresh and held.
    assert len(cuts) == 3
    assert events(caplog, "engine_removal_cancelled") == []
    assert [e["engine"] for e in events(caplog, "engine_removed")] == ["d1"]
    assert router.supervisor.engines["d1"].url == "http://127.0.0.1:9102"
    view = router.fleet.view("d1", trio.current_time())
    assert view.ejected and str(view.ejected_cause) == "added"
    finish.set()


# -- the file is read off the event loop: regular files only, bounded ---------------------------------

def _write_if_read(path: Path, text: str) -> None:
    """Give a reader blocked on the FIFO at ``path`` its content; nothing when nobody reads it."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return  # no reader (ENXIO): the reload did not block on it
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


async def test_a_fifo_at_the_config_path_is_refused_without_blocking_the_loop(
        router: Router, config_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    text = config_file.read_text()
    config_file.unlink()
    os.mkfifo(config_file)
    # A reader that blocked on the FIFO would hold the whole loop until a writer came: one comes after 10 s.
    unblock = threading.Timer(10.0, _write_if_read, (config_file, text))
    unblock.start()
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await trio.sleep(0)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticker)
            with trio.fail_after(5):
                outcome = await router.reload()
            nursery.cancel_scope.cancel()
    finally:
        unblock.cancel()
    assert not outcome.reloaded and outcome.error is not None
    assert outcome.error.key is None and "not a regular file (a FIFO)" in outcome.error.problem
    [failed] = events(caplog, "config_reload_failed")
    assert "FIFO" in failed["problem"]
    assert ticks > 0


async def test_a_config_file_over_the_bound_is_refused_before_it_is_read(
        router: Router, config_file: Path) -> None:
    before = router.config
    config_file.write_text(config_file.read_text() + "#" * MAX_CONFIG_BYTES + "\n")
    outcome = await router.reload()
    assert not outcome.reloaded and outcome.error is not None
    assert f"over the {MAX_CONFIG_BYTES} byte bound" in outcome.error.problem
    assert router.config is before


async def test_the_config_file_is_read_in_a_worker_thread(
        router: Router, config_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    threads = []

    def recording_load(path):
        threads.append(threading.current_thread())
        return load_config(path)

    monkeypatch.setattr("narwhal.router.load_config", recording_load)
    outcome = await router.reload()
    assert outcome.reloaded
    assert threads and threads[0] is not threading.main_thread()


async def test_a_second_entry_for_one_engine_is_refused_naming_both(
        router: Router, config_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    before = router.config
    config_file.write_text(config_file.read_text() + D1.replace('"d1"', '"d1-copy"').replace("9002", "9002/"))
    outcome = await router.reload()
    assert not outcome.reloaded and router.config is before
    [failed] = events(caplog, "config_reload_failed")
    assert failed["key"] == 'engine "d1-copy".url' and 'engine "d1"' in failed["problem"]
    assert not router.fleet.knows("d1-copy")


# -- a reload that would take the admin token away ----------------------------------------------------

def warnings_named(caplog: pytest.LogCaptureFixture, name: str) -> list[dict]:
    return [event for event in events(caplog, name) if event["level"] == "warning"]


async def test_a_reload_that_drops_the_admin_token_is_refused_and_the_api_stays_closed(
        router: Router, config_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    client = router.app.test_client()
    config_file.write_text(config_file.read_text().replace('token = "old-token"', ""))
    response = await client.post("/admin/reload", headers={"authorization": "Bearer old-token"})
    assert response.status_code == 422
    error = (await response.get_json())["reload"]["error"]
    assert error["key"] == "admin.token" and "allow_unauthenticated" in error["problem"]
    [failed] = events(caplog, "config_reload_failed")
    assert failed["key"] == "admin.token"
    assert router.config.admin.token == "old-token"
    assert (await client.get("/admin/engines")).status_code == 401


async def test_with_allow_unauthenticated_the_token_goes_and_every_reload_warns(
        router: Router, config_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    config_file.write_text(config_file.read_text().replace('token = "old-token"', "allow_unauthenticated = true"))
    outcome = await router.reload()
    assert outcome.reloaded and outcome.changes is not None
    assert outcome.changes.keys_changed == ["admin.allow_unauthenticated", "admin.token"]
    assert router.config.admin.token is None
    assert (await router.app.test_client().get("/admin/engines")).status_code == 200
    assert len(warnings_named(caplog, "admin_unauthenticated")) == 1
    # Every reload that leaves the API open says so again, changed or not.
    assert (await router.reload()).reloaded
    assert len(warnings_named(caplog, "admin_unauthenticated")) == 2


async def test_a_reload_that_keeps_or_changes_the_token_does_not_warn(
        router: Router, config_file: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    config_file.write_text(config_file.read_text().replace('"old-token"', '"new-token"'))
    assert (await router.reload()).reloaded
    assert router.config.admin.token == "new-token"
    assert events(caplog, "admin_unauthenticated") == []
