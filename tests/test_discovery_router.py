"""Discovery in the router: the union of file and discovered engines, the service that applies it, the lease
side, and an engine that comes and goes not readmitted faster than its backoff."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import msgspec
import pytest
import trio

from narwhal.config import DiscoveryConfig, EngineSpec, LeaseConfig, RunningConfig, load_config, parse_config
from narwhal.control.discovery import DiscoveryService
from narwhal.control.readmission.schedule import ReadmissionSchedule
from narwhal.discovery.etcd_watch import ViewUpdate, WatchStatus
from narwhal.discovery.union import union_entries
from narwhal.discovery.view import diff_views
from narwhal.errors import StartupError
from narwhal.fleet.registry import EngineEntry, entries_from_config
from narwhal.lease.rules import Role
from narwhal.router import Router
from tests.test_admin_api import fleet_config, start_mock_fleet
from tests.test_config import GOOD

DISCOVERY = '[discovery]\nbackend = "etcd"\nendpoints = ["http://127.0.0.1:1"]\n'


def events(caplog: pytest.LogCaptureFixture, name: str) -> list[dict]:
    lines = [json.loads(record.getMessage()) for record in caplog.records if record.name == "narwhal.events"]
    return [line for line in lines if line["event"] == name]


def spec(name: str, port: int, role: str = "decode", model: str | None = None) -> EngineSpec:
    return EngineSpec(name=name, url=f"http://127.0.0.1:{port}", role=role, model=model)  # type: ignore[arg-type]


FILE = [EngineEntry(name="p1", url="http://127.0.0.1:9001", role="prefill", model="m"),
        EngineEntry(name="d1", url="http://127.0.0.1:9002", role="decode", model="m")]


# ----- the union (pure) -----------------------------------------------------------------------


def test_discovered_engines_join_the_file_with_their_model_or_the_default():
    entries, refused = union_entries(FILE, {"d3": spec("d3", 9103, model="other"), "d2": spec("d2", 9102)},
                                     default_model="m")
    assert refused == []
    assert [(e.name, e.model, e.source) for e in entries] == [
        ("p1", "m", "file"), ("d1", "m", "file"), ("d2", "m", "discovery"), ("d3", "other", "discovery")]


def test_a_name_of_the_file_and_a_url_already_taken_for_the_role_are_refused_and_the_file_stands():
    discovered = {"d1": spec("d1", 9999), "d2": spec("d2", 9002), "d3": spec("d3", 9002, role="prefill"),
                  "d4": spec("d4", 9104), "d5": spec("d5", 9104)}
    entries, refused = union_entries(FILE, discovered, default_model="m")
    assert [e.name for e in entries] == ["p1", "d1", "d3", "d4"]
    assert entries[1].url == "http://127.0.0.1:9002"  # the file's d1
    assert [(r.name, r.in_file) for r in refused] == [("d1", True), ("d2", False), ("d5", False)]
    assert '"d1"' in refused[1].problem and "both decode" in refused[1].problem
    assert '"d4"' in refused[2].problem


def test_the_callers_own_problem_refuses_a_discovered_engine():
    entries, refused = union_entries(FILE, {"d2": spec("d2", 8000), "d3": spec("d3", 9103)}, default_model="m",
                                     problem=lambda s: "this router" if s.port == 8000 else None)
    assert [e.name for e in entries] == ["p1", "d1", "d3"]
    assert [(r.name, r.problem) for r in refused] == [("d2", "this router")]


# ----- the service, on a watcher of the same shape as EtcdWatcher ----------------------------------


class FakeWatcher:
    """Reports what the test sends, as a watcher does: the first update before ``started``."""

    def __init__(self) -> None:
        self.send, self.receive = trio.open_memory_channel[ViewUpdate](16)
        self.closed = False

    async def run(self, on_update, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        on_update(await self.receive.receive())
        task_status.started()
        async for update in self.receive:
            on_update(update)

    async def aclose(self) -> None:
        self.closed = True


def update(reason: str, engines: dict[str, EngineSpec], before: dict[str, EngineSpec] | None = None,
           degraded: str | None = None, revision: int = 7) -> ViewUpdate:
    return ViewUpdate(reason=reason, engines=engines, change=diff_views(before or {}, engines),  # type: ignore[arg-type]
                      status=WatchStatus(revision=revision, listed=True, degraded=degraded, current_at=100.0,
                                         last_event_at=90.0))


class World:
    def __init__(self, text: str) -> None:
        self.config = parse_config(text)
        self.watcher = FakeWatcher()
        self.applied: list[list[EngineEntry]] = []
        self.active = True
        self.service = DiscoveryService(config=self.config, file_entries=lambda: entries_from_config(self.config),
                                        apply=self.applied.append, is_active=lambda: self.active,
                                        build=lambda config: self.watcher, wall_clock=lambda: 103.0)

    def names(self) -> list[str]:
        return [entry.name for entry in self.applied[-1]]


async def test_each_update_applies_file_plus_discovered_and_an_outage_changes_nothing(
        nursery, autojump_clock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    world = World(GOOD + DISCOVERY)
    d2 = {"d2": spec("d2", 9102)}
    await world.watcher.send.send(update("listed", d2))
    await nursery.start(world.service.run)
    assert world.names() == ["p1", "d1", "d2"]
    assert [e["engine"] for e in events(caplog, "engine_discovered")] == ["d2"]
    await world.watcher.send.send(update("degraded", d2, d2, degraded="etcd unreachable"))
    await trio.sleep(1.0)
    assert len(world.applied) == 1  # the fleet never empties on an outage
    view = world.service.view()
    assert (view.state, view.degraded, view.revision, view.view_age_s) == ("degraded", "etcd unreachable", 7, 3.0)
    assert [e.name for e in view.engines] == ["d2"]
    assert len(events(caplog, "discovery_degraded")) == 1
    await world.watcher.send.send(update("recovered", d2, d2))
    await world.watcher.send.send(update("events", {}, d2))
    await trio.sleep(1.0)
    assert world.names() == ["p1", "d1"]
    assert [e["engine"] for e in events(caplog, "engine_vanished")] == ["d2"]
    assert world.service.view().state == "ok"


async def test_a_discovered_name_of_the_file_stops_the_start_and_later_is_logged_and_ignored(
        nursery, autojump_clock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    world = World(GOOD + DISCOVERY)
    await world.watcher.send.send(update("listed", {"d1": spec("d1", 9999)}))
    with pytest.raises(StartupError, match='engine \'d1\' is both in the config file.*/narwhal/engines/d1'):
        await world.service.run()

    world = World(GOOD + DISCOVERY)
    await world.watcher.send.send(update("listed", {}))
    await nursery.start(world.service.run)
    clash = {"d1": spec("d1", 9999), "d2": spec("d2", 9102)}
    await world.watcher.send.send(update("events", clash))
    await trio.sleep(1.0)
    assert world.names() == ["p1", "d1", "d2"] and world.applied[-1][1].url == "http://127.0.0.1:9002"
    [invalid] = events(caplog, "discovery_entry_invalid")
    assert invalid["key"] == "/narwhal/engines/d1" and "also in the config file" in invalid["problem"]
    assert [r["name"] for r in world.service.view().refused] == ["d1"]


async def test_with_no_engines_in_the_file_the_set_is_the_discovered_one(nursery, autojump_clock) -> None:
    world = World(DISCOVERY)
    await world.watcher.send.send(update("listed", {"p9": spec("p9", 9101, role="prefill"), "d9": spec("d9", 9102)}))
    await nursery.start(world.service.run)
    assert world.names() == ["d9", "p9"]
    assert all(entry.source == "discovery" for entry in world.applied[-1])


async def test_a_standby_watches_without_applying_and_applies_the_moment_it_takes_over(
        nursery, autojump_clock) -> None:
    world = World(GOOD + DISCOVERY)
    world.active = False
    await world.watcher.send.send(update("listed", {"d2": spec("d2", 9102)}))
    await nursery.start(world.service.run)
    await world.watcher.send.send(update("events", {"d2": spec("d2", 9102), "d3": spec("d3", 9103)}))
    await trio.sleep(5.0)
    assert world.applied == []
    assert [e.name for e in world.service.view().engines] == ["d2", "d3"] and not world.service.view().acting
    world.active = True
    took_over = trio.current_time()
    while not world.applied:
        await trio.sleep(0.01)
    assert trio.current_time() - took_over <= world.service.poll_s + 0.01
    assert world.names() == ["p1", "d1", "d2", "d3"]


async def test_a_reload_that_turns_discovery_off_drops_the_discovered_engines(nursery, autojump_clock) -> None:
    world = World(GOOD + DISCOVERY)
    await world.watcher.send.send(update("listed", {"d2": spec("d2", 9102)}))
    await nursery.start(world.service.run)
    world.config = parse_config(GOOD)
    world.service.configure(RunningConfig(config=world.config, attestation_key=None))
    assert [e.name for e in world.service.apply_entries()] == ["p1", "d1"]
    assert world.service.view().state == "off"
    await trio.sleep(1.0)
    assert world.watcher.closed


# ----- an engine that comes and goes ---------------------------------------------------------------


def test_an_engine_back_soon_after_it_left_keeps_its_flap_backoff():
    schedule = ReadmissionSchedule(["d1"], probe_interval_s=30.0, backoff_base_s=2.0)
    schedule.ejected("d1", 0.0)
    schedule.readmitted("d1", 1.0)
    schedule.remove("d1", 3.0)  # its key vanished two seconds after it came in
    schedule.add("d1", 4.0)
    schedule.ejected("d1", 4.0)  # added back: held out of placement until readmission
    state = schedule.state("d1")
    assert state.level == 1 and state.not_before == 6.0
    schedule.health("d1", True, 4.5)
    assert not schedule.due_on_health("d1", 5.9) and schedule.due_on_health("d1", 6.0)
    # Again: the backoff doubles, as for any readmission that did not last.
    schedule.readmitted("d1", 6.0)
    schedule.remove("d1", 7.0)
    schedule.add("d1", 7.5)
    schedule.ejected("d1", 7.5)
    assert schedule.state("d1").level == 2 and schedule.state("d1").not_before == 11.5


def test_a_backoff_an_engine_had_when_it_left_stands_and_a_long_absence_starts_fresh():
    schedule = ReadmissionSchedule(["d1"], probe_interval_s=30.0, backoff_base_s=2.0)
    schedule.ejected("d1", 0.0)
    for at in (1.0, 2.0, 3.0):
        schedule.refused("d1", at, check="model", on_health=True)
    assert schedule.state("d1").level == 3
    schedule.remove("d1", 4.0)
    schedule.add("d1", 5.0)
    schedule.ejected("d1", 5.0)
    assert schedule.state("d1").level == 3 and schedule.state("d1").not_before == 3.0 + 8.0
    schedule.remove("d1", 6.0)
    schedule.add("d1", 6.0 + 30.0)
    schedule.ejected("d1", 36.0)
    assert schedule.state("d1").level == 0 and schedule.state("d1").not_before == -math.inf


async def test_a_flapping_engine_is_not_tried_at_once_when_it_comes_back(
        nursery, autojump_clock, tmp_path: Path) -> None:
    path = tmp_path / "n.toml"
    path.write_text(f'[handoff]\npath = "{tmp_path / "h.json"}"\n' + GOOD + DISCOVERY)
    router = Router(load_config(path), config_path=path)
    try:
        await nursery.start(router.engine_set.run)
        await nursery.start(router.readmitter.run)
        d2 = EngineEntry(name="d2", url="http://127.0.0.1:9", role="decode", model="default", source="discovery")
        base = entries_from_config(router.config)
        router.engine_set.apply([*base, d2])
        assert "d2" in router.readmitter._scheduled  # a new engine is tried at once
        await trio.sleep(1.0)
        router.readmitter.schedule.readmitted("d2", trio.current_time())  # as if it passed readmission
        router.engine_set.apply(base)
        await trio.sleep(1.0)
        assert "d2" not in router.registry
        router.engine_set.apply([*base, d2])
        schedule = router.readmitter.schedule.state("d2")
        assert schedule.level == 1 and schedule.not_before > trio.current_time()
        assert "d2" not in router.readmitter._scheduled  # back within its backoff: not at once
    finally:
        await router.control_pool.aclose()
        await router.data_plane.data_pool.aclose()  # type: ignore[attr-defined]


# ----- with a lease: the holder acts, a standby watches --------------------------------------------


async def test_a_standby_router_watches_and_applies_its_view_once_it_holds_the_lease(nursery, tmp_path: Path) -> None:
    mocks = await start_mock_fleet(nursery)
    config = fleet_config(mocks, tmp_path)
    config = msgspec.structs.replace(
        config, serving=msgspec.structs.replace(config.serving, listen="127.0.0.1:0"),
        lease=LeaseConfig(backend="file", path=str(tmp_path / "lease.json"), router_id="ra", ttl_s=10.0,
                          renew_interval_s=1.0, fence_margin_s=2.0),
        discovery=DiscoveryConfig(backend="etcd", endpoints=["http://127.0.0.1:1"]))
    router = Router(config)
    try:
        watcher = FakeWatcher()
        router.discovery._build = lambda config: watcher
        assert router.lease is not None and not router._acts()  # every router starts as a standby
        await nursery.start(router.engine_set.run)
        await nursery.start(router.readmitter.run)
        found = {"d9": spec("d9", 9)}
        await watcher.send.send(update("listed", found))
        await nursery.start(router.discovery.run)
        await trio.sleep(0.5)
        assert "d9" not in router.registry  # a standby only watches
        assert [e.name for e in router.discovery_view().engines] == ["d9"]
        await nursery.start(router.lease.run)
        with trio.fail_after(10):
            while router.lease.role is not Role.ACTIVE:
                await trio.sleep(0.01)
            took_over = trio.current_time()
            while "d9" not in router.registry:
                await trio.sleep(0.01)
        assert trio.current_time() - took_over <= router.discovery.poll_s + 0.1
        assert router.discovery_view().acting
        assert router.fleet.view("d9", trio.current_time()).ejected  # enters placement only through readmission
    finally:
        mocks.stop_all()
        await router.control_pool.aclose()
        await router.data_plane.data_pool.aclose()  # type: ignore[attr-defined]


async def test_a_standby_follows_a_handoff_that_holds_discovered_engines(
        autojump_clock, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # The holder's handoff names d9, which it discovered; the standby sees d9 discovered too (not applied):
    # the engine sets match, the document is followed, and d9's record waits for the takeover.
    from narwhal.lease.rules import LeaseRecord
    from narwhal.stages.persistence import HandoffExtra
    from narwhal.state import handoff
    from narwhal.state.handoff import EngineSetEntry, LeaseOwnership
    from tests.test_lease_service import ENGINES, MemoryBackend, Rig

    caplog.set_level(logging.INFO)
    writer = Rig(tmp_path, MemoryBackend(), router_id="r2")
    writer.fleet.add_engine("d9", "decode", trio.current_time(), "discovered", writer.config.fleet.model)
    writer.stage.engine_set = [*(EngineSetEntry(name=n, url=u, role=r, model=writer.config.fleet.model)
                                 for n, u, r in ENGINES),
                               EngineSetEntry(name="d9", url="http://127.0.0.1:9009", role="decode",
                                              model=writer.config.fleet.model)]
    writer.stage.extra = lambda: HandoffExtra(lease=LeaseOwnership(holder="r2", epoch=5))
    backend = MemoryBackend()
    backend.record = LeaseRecord(holder="r2", epoch=5, expires_at=1e9)
    backend.handoff = handoff.encode_document(writer.stage.document(1))
    rig = Rig(tmp_path, backend)
    discovered = [spec("d9", 9009)]
    rig.service.follower._engines = lambda: [*rig.config.engines, *discovered]
    await rig.service.tick()
    assert rig.service.applied_epoch == 5 and rig.service.follower.engine_set_differs is None
    assert events(caplog, "standby_following") and not events(caplog, "standby_engine_set_differs")
    # Without d9 in its view, the standby says the sets differ (and, once told, plans the document again).
    discovered.clear()
    rig.service.follower.engines_changed()
    await rig.service.tick()
    assert rig.service.follower.engine_set_differs == "removed d9"


async def test_a_reload_applies_the_file_plus_the_discovered_engines_of_now(
        nursery, autojump_clock, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    path = tmp_path / "n.toml"
    head = f'[handoff]\npath = "{tmp_path / "h.json"}"\n' + DISCOVERY
    path.write_text(head + GOOD)
    router = Router(load_config(path), config_path=path)
    watcher = FakeWatcher()
    router.discovery._build = lambda config: watcher
    try:
        await nursery.start(router.engine_set.run)
        await nursery.start(router.readmitter.run)
        await watcher.send.send(update("listed", {"d2": spec("d2", 9102)}))
        await nursery.start(router.discovery.run)
        assert [e.name for e in router.registry.entries()] == ["p1", "d1", "d2"]
        assert router.registry.entries()[2].source == "discovery"
        # The file gains d3 and an engine named d2 of its own: the file's d2 replaces the discovered one.
        path.write_text(head + GOOD + '[[engines]]\nname = "d3"\nurl = "http://127.0.0.1:9103"\nrole = "decode"\n'
                        '[[engines]]\nname = "d2"\nurl = "http://127.0.0.1:9202"\nrole = "decode"\n')
        autojump_clock.autojump_threshold = math.inf  # the file is read in a thread: no time passes meanwhile
        outcome = await router.reload()
        autojump_clock.autojump_threshold = 0
        assert outcome.reloaded, outcome
        await trio.sleep(1.0)
        entries = {e.name: e for e in router.registry.entries()}
        assert set(entries) == {"p1", "d1", "d2", "d3"}
        assert (entries["d2"].source, entries["d2"].url) == ("file", "http://127.0.0.1:9202")
        [invalid] = events(caplog, "discovery_entry_invalid")
        assert invalid["key"] == "/narwhal/engines/d2"
    finally:
        await router.control_pool.aclose()
        await router.data_plane.data_pool.aclose()  # type: ignore[attr-defined]


# ----- [discovery] in the config -------------------------------------------------------------------


@pytest.mark.parametrize(("section", "expected"), [
    ('backend = "etcd"\n', 'discovery.endpoints is required when discovery.backend = "etcd" and [lease] has no'),
    ('backend = "zk"\n', 'discovery.backend: must be one of "none", "etcd", "kubernetes"'),
    ('prefix = "/narwhal/engines"\n', "discovery: prefix must start and end with '/'"),
    ('endpoints = ["etcd:2379"]\n', "discovery: endpoints[0] must be http(s)://HOST:PORT"),
    ('backend = "kubernetes"\n', "discovery: backend = \"kubernetes\" needs prefill_selector or decode_selector"),
    ("port = 70000\n", "discovery: port must be 1-65535 or a container port's name"),
    ('port = "HTTP_port"\n', "discovery: port must be a number or a container port's name"),
    ('namespace = "Prod"\n', "discovery: namespace must be a Kubernetes namespace name"),
    ('api_url = "10.0.0.1:6443"\n', "discovery: api_url must be https://HOST[:PORT]"),
    ('model_label = ""\n', "discovery: model_label must not be empty when set"),
])
def test_bad_discovery_keys_are_named(section: str, expected: str) -> None:
    from narwhal.config import ConfigError
    with pytest.raises(ConfigError, match=None) as info:
        parse_config(GOOD + "[discovery]\n" + section, "n.toml")
    assert expected in str(info.value)


def test_discovery_config_defaults_and_the_engines_it_lets_the_file_leave_out() -> None:
    config = parse_config('[lease]\nbackend = "etcd"\nendpoints = ["http://e:2379"]\n[discovery]\nbackend = "etcd"\n')
    assert config.engines == [] and config.discovery_endpoints == ["http://e:2379"]
    assert config.discovery.prefix == "/narwhal/engines/"
    k8s = parse_config('[discovery]\nbackend = "kubernetes"\ndecode_selector = "app=vllm"\nport = "http"\n')
    assert (k8s.discovery.port, k8s.discovery.namespace) == ("http", None)
    # Without discovery every role needs an engine of the file; with it, the store may bring them.
    prefill_only = '[[engines]]\nname = "p1"\nurl = "http://127.0.0.1:9001"\nrole = "prefill"\n'
    from narwhal.config import ConfigError
    with pytest.raises(ConfigError, match="no decode engine configured"):
        parse_config(prefill_only)
    assert [e.name for e in parse_config(prefill_only + DISCOVERY).engines] == ["p1"]


def test_narwhal_admin_discovery_shows_the_state_and_the_engines() -> None:
    from narwhal.tools.admin_cli import format_discovery
    view = {"backend": "etcd", "state": "degraded", "acting": False, "revision": 42, "resource_version": None,
            "last_event_at": 0.0, "view_age_s": 12.5, "degraded": "etcd watch unreachable",
            "engines": [{"name": "d9", "role": "decode", "model": "m", "url": "http://10.0.0.9:8000"}],
            "refused": [{"name": "d1", "problem": "also in the file"}]}
    assert format_discovery(view) == (
        "discovery: etcd, degraded (etcd watch unreachable), standby: watching, not applying\n"
        "revision 42, last event 1970-01-01 00:00:00Z, view confirmed 12.5 s ago\n"
        "\n"
        "ENGINE  ROLE    MODEL  URL\n"
        "d9      decode  m      http://10.0.0.9:8000\n"
        "\n"
        "d1: refused: also in the file\n")
    assert format_discovery({"backend": "none", "state": "off"}) == 'discovery: off ([discovery] backend = "none")\n'


async def test_a_reload_to_a_watcher_this_build_cannot_make_keeps_the_engines_and_says_why(
        nursery, autojump_clock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    world = World(GOOD + DISCOVERY)

    def build(config):
        if config.discovery.backend == "kubernetes":
            raise StartupError("discovery.backend = \"kubernetes\": the Kubernetes watcher is not in this build")
        return world.watcher

    world.service._build = build
    await world.watcher.send.send(update("listed", {"d2": spec("d2", 9102)}))
    await nursery.start(world.service.run)
    world.config = parse_config(GOOD + '[discovery]\nbackend = "kubernetes"\ndecode_selector = "app=vllm"\n')
    world.service.configure(RunningConfig(config=world.config, attestation_key=None))
    await trio.sleep(1.0)
    assert [e.name for e in world.service.apply_entries()] == ["p1", "d1", "d2"]  # what was discovered stays
    view = world.service.view()
    assert view.state == "degraded" and "not in this build" in (view.degraded or "")
    assert "not in this build" in events(caplog, "discovery_degraded")[-1]["error"]
