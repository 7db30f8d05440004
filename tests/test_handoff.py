"""The handoff document, its atomic write, and the persistence stage (spec: "Durable
control-plane state", "Atomic handoff writes")."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import msgspec
import pytest
import trio

import narwhal.state.handoff as handoff
from narwhal.config import Config, EngineSpec
from narwhal.errors import FailureClass
from narwhal.fleet import EjectionCause, EngineCounters, EngineRecord, Fleet, HoldKind, HoldRecord
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.stages.persistence import HandoffExtra, HandoffWriteInProgress, PersistenceStage
from narwhal.state.handoff import (
    HANDOFF_SCHEMA,
    EngineSetEntry,
    HandoffDocument,
    HandoffMissing,
    HandoffSchemaMismatch,
    HandoffUnreadable,
    LeaseOwnership,
    decode_document,
    encode_document,
    read_document,
    write_atomic,
)

ENGINES = [("p1", "http://127.0.0.1:9001", "prefill"), ("d1", "http://127.0.0.1:9002", "decode")]


def make_config() -> Config:
    return Config(engines=[EngineSpec(name=n, url=u, role=r) for n, u, r in ENGINES])


def make_fleet() -> Fleet:
    return Fleet([(n, r) for n, _, r in ENGINES], eject_after=2, liveness_misses=2,
                 failure_quarantine_s=30.0, probe_interval_s=5.0)


def full_document() -> HandoffDocument:
    """A document in which every field, at every level, differs from its default."""
    hold = HoldRecord(kind=HoldKind.FAILURE_QUARANTINE, reason="ejected: connection", since_wall=1000.5,
                      deadline_wall=1030.5, deferred=True, cause="connection")
    record = EngineRecord(
        name="p1", role="prefill", model="m1", ejected=True, ejected_reason="connection streak reached 2",
        ejected_cause=EjectionCause.CONNECTION, ejected_at_wall=1000.5,
        holds=[hold, HoldRecord(kind=HoldKind.PERFORMANCE_DRIFT, reason="3x median latency", since_wall=990.0,
                                deadline_wall=1090.0, deferred=True, cause="stream")],
        streaks={FailureClass.CONNECTION: 2, FailureClass.STREAM: 1},
        liveness_misses=1, next_probe_at_wall=1005.0,
        counters=EngineCounters(ejections=3, probes={"success": 1, "failed": 2},
                                failures={FailureClass.CONNECTION: 7}),
    )
    return HandoffDocument(
        schema=HANDOFF_SCHEMA, router_id="r1", pid=4242, pass_number=17, written_at=1001.25,
        engine_set=[EngineSetEntry(name=n, url=u, role=r, model="m1") for n, u, r in ENGINES],
        engines=[record],
        consolidation_risk={"prefill": "critical", "decode": "elevated"},
        lease=LeaseOwnership(holder="r1", epoch=9), drained=["p1"],
    )


def assert_no_defaults(value: msgspec.Struct) -> None:
    """Fail if any field of ``value`` (recursively) still has its default: the round trip must cover it."""
    for field in msgspec.structs.fields(value):
        current = getattr(value, field.name)
        if field.default is not msgspec.NODEFAULT:
            assert current != field.default, f"{type(value).__name__}.{field.name} left at its default"
        assert current not in (None, [], {}, 0, ""), f"{type(value).__name__}.{field.name} is empty"
        items = current if isinstance(current, list) else [current]
        for item in items:
            if isinstance(item, msgspec.Struct):
                assert_no_defaults(item)


# ----- the document -----

def test_round_trip_keeps_every_field(tmp_path: Path) -> None:
    document = full_document()
    assert_no_defaults(document)
    assert decode_document(encode_document(document)) == document
    path = tmp_path / "handoff.json"
    write_atomic(path, encode_document(document))
    assert read_document(path) == document


def test_document_holds_no_monitor_failure_counters() -> None:
    # A restarted router starts with fresh monitor-failure counters: there is nothing to restore.
    names = {field.name for struct in (HandoffDocument, EngineRecord, EngineCounters)
             for field in msgspec.structs.fields(struct)}
    assert not [name for name in names if "monitor" in name]


def test_older_document_of_same_schema_gets_defaults() -> None:
    older = {"schema": HANDOFF_SCHEMA, "router_id": "r0", "pid": 1, "pass_number": 1, "written_at": 5.0,
             "engine_set": [{"name": "p1", "url": "http://127.0.0.1:9001", "role": "prefill"}],
             "engines": [{"name": "p1", "role": "prefill"}]}
    document = decode_document(json.dumps(older).encode())
    assert document.lease == LeaseOwnership(holder="none", epoch=0)
    assert document.consolidation_risk == {}
    assert document.drained == []
    assert document.engines[0].holds == []


def test_newer_fields_of_same_schema_are_ignored() -> None:
    newer = json.loads(encode_document(full_document()))
    newer["added_later"] = {"anything": 1}
    assert decode_document(json.dumps(newer).encode()) == full_document()


def test_other_schema_is_refused_before_reading_the_rest() -> None:
    # A schema-2 document may look nothing like schema 1: the schema number decides first.
    with pytest.raises(HandoffSchemaMismatch, match="^schema 2 differs from 1$") as info:
        decode_document(b'{"schema": 2, "fleet": "a different shape"}')
    assert (info.value.found, info.value.expected) == (2, 1)


@pytest.mark.parametrize(("data", "message"), [
    (b"", "empty"),
    (b'{"schema": 1, "router_id": "r', "not JSON"),
    (b"[1, 2]", "no schema number"),
    (b'{"router_id": "r1"}', "no schema number"),
    (b'{"schema": "1"}', "no schema number"),
    (b'{"schema": 1, "router_id": "r1"}', "not a handoff document"),
    (b'{"schema": 1, "router_id": "r1", "pid": 1, "pass_number": 1, "written_at": 1.0, '
     b'"engine_set": [], "engines": [], "consolidation_risk": {"prefill": "dire"}}', "not a handoff document"),
])
def test_corrupt_data_is_unreadable(data: bytes, message: str) -> None:
    with pytest.raises(HandoffUnreadable, match=message):
        decode_document(data)


def test_truncated_document_never_decodes() -> None:
    data = encode_document(full_document())
    for cut in range(0, len(data) - 1, 7):
        with pytest.raises(HandoffUnreadable):
            decode_document(data[:cut])


def test_read_missing_and_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(HandoffMissing, match="no handoff at"):
        read_document(tmp_path / "absent.json")
    with pytest.raises(HandoffUnreadable, match="cannot read"):
        read_document(tmp_path)  # a directory: IsADirectoryError


# ----- the atomic write -----

class RecordingOs:
    """Delegates to ``os``, recording the calls write_atomic makes, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, name: str):
        real = getattr(os, name)
        if not callable(real) or name not in {"open", "write", "fsync", "close", "replace", "unlink"}:
            return real

        def call(*args, **kwargs):
            self.calls.append((name, args))
            return real(*args, **kwargs)
        return call


def test_write_is_temp_file_full_write_fsync_rename_then_directory_fsync(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = RecordingOs()
    monkeypatch.setattr(handoff, "os", recorder)
    destination = tmp_path / "handoff.json"
    data = encode_document(full_document())
    assert write_atomic(destination, data) is True
    names = [name for name, _ in recorder.calls]
    assert names == ["open", "write", "fsync", "close", "replace", "open", "fsync", "close"]
    temporary = Path(recorder.calls[0][1][0])
    # Process-unique: in the destination's directory, named with our pid and a random suffix.
    assert temporary.parent == tmp_path
    assert temporary.name.startswith(f".handoff.json.{os.getpid()}.") and temporary.name.endswith(".tmp")
    assert recorder.calls[1][1][0] == recorder.calls[2][1][0]  # fsync the file written
    assert recorder.calls[4][1] == (temporary, destination)
    assert Path(recorder.calls[5][1][0]) == tmp_path  # then the directory
    assert destination.read_bytes() == data
    assert os.listdir(tmp_path) == ["handoff.json"]


def test_temporary_names_differ_per_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = RecordingOs()
    monkeypatch.setattr(handoff, "os", recorder)
    for _ in range(20):
        write_atomic(tmp_path / "handoff.json", b"{}")
    temporaries = {args[0] for name, args in recorder.calls if name == "replace"}
    assert len(temporaries) == 20


def test_write_replaces_previous_document(tmp_path: Path) -> None:
    destination = tmp_path / "handoff.json"
    write_atomic(destination, b"first")
    write_atomic(destination, b"second")
    assert destination.read_bytes() == b"second"


def test_partial_os_writes_are_completed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class ShortWrites(RecordingOs):
        def __getattr__(self, name: str):
            if name == "write":
                return lambda fd, data: os.write(fd, bytes(data[:3]))
            return super().__getattr__(name)

    monkeypatch.setattr(handoff, "os", ShortWrites())
    data = encode_document(full_document())
    write_atomic(tmp_path / "handoff.json", data)
    assert (tmp_path / "handoff.json").read_bytes() == data


def test_proceed_false_keeps_destination_and_removes_temporary(tmp_path: Path) -> None:
    destination = tmp_path / "handoff.json"
    write_atomic(destination, b"kept")
    assert write_atomic(destination, b"fenced meanwhile", proceed=lambda: False) is False
    assert destination.read_bytes() == b"kept"
    assert os.listdir(tmp_path) == ["handoff.json"]


# ----- the persistence stage -----

class Clocks:
    def __init__(self) -> None:
        self.now = 50.0
        self.wall = 1_000_000.0


def make_stage(path: Path, fleet: Fleet, clocks: Clocks, **kwargs) -> PersistenceStage:
    return PersistenceStage(path=path, router_id="r1", fleet=fleet, config=make_config(),
                            clock=lambda: clocks.now, wall_clock=lambda: clocks.wall, **kwargs)


async def test_stage_writes_every_pass(tmp_path: Path) -> None:
    clocks, fleet = Clocks(), make_fleet()
    path = tmp_path / "handoff.json"
    stage = make_stage(path, fleet, clocks)
    assert stage.name == "persistence"
    for pass_number in (1, 2, 3):
        clocks.now += 1.0
        clocks.wall += 1.0
        await stage.run(pass_number)
        document = read_document(path)
        assert document.pass_number == pass_number
        assert document.written_at == clocks.wall
        assert stage.last_written_pass == pass_number
    assert os.listdir(tmp_path) == ["handoff.json"]


def test_without_the_directory_sync_the_write_is_the_same_but_for_the_last_fsync(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = RecordingOs()
    monkeypatch.setattr(handoff, "os", recorder)
    destination = tmp_path / "handoff.json"
    data = encode_document(full_document())
    assert write_atomic(destination, data, sync_directory=False) is True
    assert [name for name, _ in recorder.calls] == ["open", "write", "fsync", "close", "replace"]
    assert read_document(destination) == full_document()


async def test_a_pass_that_changed_nothing_skips_only_the_directory_fsync_and_reads_back_the_same_state(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clocks, fleet = Clocks(), make_fleet()
    path = tmp_path / "handoff.json"
    stage = make_stage(path, fleet, clocks)
    synced: list[bool] = []
    real = handoff.write_atomic

    def recording(*args, sync_directory: bool = True, **kwargs):
        synced.append(sync_directory)
        return real(*args, sync_directory=sync_directory, **kwargs)
    monkeypatch.setattr("narwhal.stages.persistence.write_atomic", recording)
    documents = []
    for pass_number in range(1, 6):
        clocks.now += 1.0
        clocks.wall += 1.0
        if pass_number == 4:
            fleet.record_failure("d1", FailureClass.CONNECTION, clocks.now)  # a streak: the state changed
        await stage.run(pass_number)
        documents.append(read_document(path))
    # The first write and the one after the change make their rename durable; the others repeat a state.
    assert synced == [True, False, False, True, False]
    assert stage.directory_syncs_skipped == 3
    # Every pass still wrote its whole document: the same state, its own pass number and time.
    assert [document.pass_number for document in documents] == [1, 2, 3, 4, 5]
    assert [document.written_at for document in documents] == [1_000_001.0 + i for i in range(5)]
    assert documents[1].engines == documents[0].engines and documents[4].engines == documents[3].engines
    assert documents[3].engines != documents[2].engines
    restored = make_fleet()
    restored.restore(documents[2].engines, clocks.now, clocks.wall)
    assert restored.snapshot(clocks.now, clocks.wall) == documents[0].engines


async def test_each_written_file_is_reported_with_its_size_and_write_time(tmp_path: Path) -> None:
    metrics = RouterMetrics()
    path = tmp_path / "handoff.json"
    stage = make_stage(path, make_fleet(), Clocks(), on_written=metrics.handoff_written)
    assert "\nnarwhal_handoff_bytes " not in metrics.render()
    await stage.run(1)
    size = len(path.read_bytes())
    assert stage.last_written_bytes == size and stage.last_write_seconds is not None
    assert stage.last_write_seconds > 0
    rendered = metrics.render()
    assert f"narwhal_handoff_bytes {size}" in rendered and "narwhal_handoff_write_seconds_count 1" in rendered
    stage.paused = True
    await stage.run(2)
    # Nothing written, nothing reported.
    assert "narwhal_handoff_write_seconds_count 1" in metrics.render()


async def test_stage_document_holds_fleet_state_and_extras(tmp_path: Path) -> None:
    clocks, fleet = Clocks(), make_fleet()
    fleet.add_hold("p1", HoldKind.OPERATOR_DRAIN, "operator drain", clocks.now)
    fleet.record_failure("d1", FailureClass.CONNECTION, clocks.now)
    fleet.record_failure("d1", FailureClass.CONNECTION, clocks.now)  # eject_after 2: ejected
    extra = {"consolidation_risk": {"prefill": "critical", "decode": "none"}, "drained": ["p1"],
             "lease": LeaseOwnership(holder="r1", epoch=4)}
    path = tmp_path / "handoff.json"
    await make_stage(path, fleet, clocks, extra=lambda: HandoffExtra(**extra)).run(7)
    document = read_document(path)
    assert document.schema == HANDOFF_SCHEMA
    assert (document.router_id, document.pid, document.pass_number) == ("r1", os.getpid(), 7)
    # Each engine's model: [fleet] model for an engine that names none.
    assert document.engine_set == [EngineSetEntry(name=n, url=u, role=r, model="mock-model") for n, u, r in ENGINES]
    assert document.engines == fleet.snapshot(clocks.now, clocks.wall)
    d1 = document.engines[1]
    assert d1.ejected and d1.counters.ejections == 1
    assert [hold.kind for hold in document.engines[0].holds] == [HoldKind.OPERATOR_DRAIN]
    assert document.consolidation_risk == {"prefill": "critical", "decode": "none"}
    assert document.drained == ["p1"]
    assert document.lease == LeaseOwnership(holder="r1", epoch=4)


async def test_stage_without_extras_writes_defaults(tmp_path: Path) -> None:
    path = tmp_path / "handoff.json"
    await make_stage(path, make_fleet(), Clocks()).run(1)
    document = read_document(path)
    assert (document.lease, document.consolidation_risk, document.drained) == (LeaseOwnership(), {}, [])


async def test_stage_refuses_invalid_extras(tmp_path: Path) -> None:
    path = tmp_path / "handoff.json"
    stage = make_stage(path, make_fleet(), Clocks(), extra=lambda: HandoffExtra(consolidation_risk={"prefill": "dire"}))
    with pytest.raises(msgspec.ValidationError):
        await stage.run(1)
    assert not path.exists()


# Lease fencing hooks. ``PersistenceStage.paused`` and the ``proceed`` check of
# ``write_atomic`` are real behaviour of the stage (these tests fail if a paused
# stage writes, or if a fence during the write still renames), but no production
# code sets ``paused`` yet: the lease (issue 11, i11-lease) is its caller. When the
# lease lands, it gets an end-to-end test that a fenced router leaves the file
# alone; these stay as the stage's unit tests.


async def test_paused_stage_writes_nothing(tmp_path: Path) -> None:
    # Only the active router writes: a fenced or standby router leaves the file alone.
    path = tmp_path / "handoff.json"
    stage = make_stage(path, make_fleet(), Clocks())
    await stage.run(1)
    before = path.read_bytes()
    stage.paused = True
    await stage.run(2)
    assert path.read_bytes() == before
    stage.paused = False
    await stage.run(3)
    assert read_document(path).pass_number == 3


async def test_fenced_during_write_does_not_replace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "handoff.json"
    stage = make_stage(path, make_fleet(), Clocks())
    await stage.run(1)
    before = path.read_bytes()
    real_fsync = os.fsync

    def fsync_then_fence(fd: int) -> None:
        real_fsync(fd)
        stage.paused = True  # the lease code fences while the worker thread is writing

    monkeypatch.setattr(handoff.os, "fsync", fsync_then_fence)
    await stage.run(2)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert stage.last_written_pass == 1
    assert os.listdir(tmp_path) == ["handoff.json"]


async def test_slow_disk_does_not_block_the_event_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    released_by_event_loop: list[bool] = []
    real_write_atomic = handoff.write_atomic

    def slow_write(path, data, **kwargs):
        # Only the event loop sets the event; a write run on the loop's own thread would time out here.
        released_by_event_loop.append(release.wait(2))
        return real_write_atomic(path, data, **kwargs)

    monkeypatch.setattr("narwhal.stages.persistence.write_atomic", slow_write)
    stage = make_stage(tmp_path / "handoff.json", make_fleet(), Clocks())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stage.run, 1)
        for _ in range(5):
            await trio.sleep(0.01)
        release.set()
    assert released_by_event_loop == [True]
    assert read_document(tmp_path / "handoff.json").pass_number == 1


async def test_monitor_pass_persists_what_its_other_stages_did(tmp_path: Path) -> None:
    from narwhal.control.monitor import Monitor
    from narwhal.fleet.admission import Admission
    from narwhal.obs.router_metrics import RouterMetrics

    clocks, fleet = Clocks(), make_fleet()

    class DrainStage:
        name = "drain"

        async def run(self, pass_number: int) -> None:
            await trio.sleep(0.01)
            fleet.add_hold("p1", HoldKind.OPERATOR_DRAIN, f"drained in pass {pass_number}", clocks.now)

    path = tmp_path / "handoff.json"
    persistence = make_stage(path, fleet, clocks)
    monitor = Monitor([persistence, DrainStage()], interval_s=1.0, stage_timeout_s=5.0, failure_limit=3,
                      admission=Admission(), metrics=RouterMetrics())
    assert (await monitor.run_pass()).ok
    document = read_document(path)
    assert document.pass_number == 1
    assert [(h.kind, h.reason) for h in document.engines[0].holds] == [(HoldKind.OPERATOR_DRAIN, "drained in pass 1")]


async def test_stuck_write_makes_later_passes_fail_and_never_lands_last(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "handoff.json"
    release, entered = threading.Event(), threading.Event()
    real_write_atomic = handoff.write_atomic

    def stuck_first(path_, data, **kwargs):
        if decode_document(data).pass_number == 1:
            entered.set()
            release.wait(5)
        return real_write_atomic(path_, data, **kwargs)

    monkeypatch.setattr("narwhal.stages.persistence.write_atomic", stuck_first)
    stage = make_stage(path, make_fleet(), Clocks())
    stage_timeout = trio.CancelScope()

    async def first_pass() -> None:
        with stage_timeout:
            await stage.run(1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(first_pass)
        # Once the write is stuck in its thread, the monitor's stage timeout abandons it.
        assert await trio.to_thread.run_sync(entered.wait, 10)
        stage_timeout.cancel()
    assert stage_timeout.cancelled_caught
    with pytest.raises(HandoffWriteInProgress):
        await stage.run(2)
    assert stage.write_in_progress
    release.set()
    # The abandoned worker finishes on its own: wait until it lets go of the stage's write lock.
    assert await trio.to_thread.run_sync(lambda: stage._writing.acquire(timeout=10))
    stage._writing.release()
    assert not stage.write_in_progress
    assert read_document(path).pass_number == 1
    await stage.run(3)
    assert read_document(path).pass_number == 3


def test_superseded_write_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "handoff.json"
    stage = make_stage(path, make_fleet(), Clocks())
    assert stage._write(b"newer", 2) is True
    assert stage._write(b"older", 1) is False
    assert path.read_bytes() == b"newer"


def test_stage_repr_names_path_and_state(tmp_path: Path) -> None:
    stage = make_stage(tmp_path / "h.json", make_fleet(), Clocks())
    stage.paused = True
    assert "h.json" in repr(stage) and "paused" in repr(stage)


def test_wall_clock_default_is_unix_time(tmp_path: Path) -> None:
    stage = PersistenceStage(path=tmp_path / "h.json", router_id="r1", fleet=make_fleet(), config=make_config(),
                             clock=lambda: 0.0)
    assert abs(stage.document(1).written_at - time.time()) < 5
