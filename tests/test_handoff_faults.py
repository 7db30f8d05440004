"""Fault injection on the handoff write (spec: "If a write fails, Narwhal removes its
temporary file and leaves the previous destination intact")."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import trio

import narwhal.state.handoff as handoff
from narwhal.config import Config, EngineSpec
from narwhal.control.monitor import Monitor
from narwhal.fleet import Fleet
from narwhal.fleet.admission import Admission
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.stages.persistence import PersistenceStage
from narwhal.state.handoff import read_document, write_atomic

ERRNOS = [errno.ENOSPC, errno.EIO, errno.EXDEV]
STEPS = ["write", "fsync", "replace"]
PREVIOUS = b'{"previous": "document", "bytes": "' + b"x" * 5000 + b'"}\n'
NEW = b'{"new": "document", "bytes": "' + b"y" * 50_000 + b'"}\n'


class FaultyOs:
    """Delegates to ``os`` but makes one step fail with ``OSError(code)``.

    A failing write first writes part of the data, as a disk filling up does.
    """

    def __init__(self, step: str, code: int, *, on_call: int = 1) -> None:
        self.step = step
        self.code = code
        self.on_call = on_call
        self.calls = 0

    def __getattr__(self, name: str):
        real = getattr(os, name)
        if name != self.step:
            return real

        def failing(*args, **kwargs):
            self.calls += 1
            if self.calls < self.on_call:
                return real(*args, **kwargs)
            if name == "write" and self.calls == self.on_call:
                fd, data = args
                os.write(fd, bytes(data[: len(data) // 2]))
            raise OSError(self.code, os.strerror(self.code))
        return failing


def prepare(tmp_path: Path) -> Path:
    destination = tmp_path / "handoff.json"
    write_atomic(destination, PREVIOUS)
    return destination


@pytest.mark.parametrize("code", ERRNOS, ids=errno.errorcode.get)
@pytest.mark.parametrize("step", STEPS)
def test_failed_step_leaves_previous_intact_and_no_temporary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str, code: int) -> None:
    destination = prepare(tmp_path)
    faulty = FaultyOs(step, code)
    monkeypatch.setattr(handoff, "os", faulty)
    with pytest.raises(OSError) as info:
        write_atomic(destination, NEW)
    assert info.value.errno == code
    assert faulty.calls >= 1
    assert destination.read_bytes() == PREVIOUS
    assert os.listdir(tmp_path) == ["handoff.json"]


@pytest.mark.parametrize("code", ERRNOS, ids=errno.errorcode.get)
def test_failed_later_write_call_also_cleans_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int) -> None:
    # The first write() is short; the error comes on the second call, mid-document.
    destination = prepare(tmp_path)

    class ShortThenFail(FaultyOs):
        def __getattr__(self, name: str):
            if name != "write":
                return getattr(os, name)

            def write(fd: int, data) -> int:
                self.calls += 1
                if self.calls == 1:
                    return os.write(fd, bytes(data[:100]))
                raise OSError(self.code, os.strerror(self.code))
            return write

    monkeypatch.setattr(handoff, "os", ShortThenFail("write", code))
    with pytest.raises(OSError):
        write_atomic(destination, NEW)
    assert destination.read_bytes() == PREVIOUS
    assert os.listdir(tmp_path) == ["handoff.json"]


def test_failed_temporary_creation_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    destination = prepare(tmp_path)
    monkeypatch.setattr(handoff, "os", FaultyOs("open", errno.ENOSPC))
    with pytest.raises(OSError):
        write_atomic(destination, NEW)
    assert destination.read_bytes() == PREVIOUS
    assert os.listdir(tmp_path) == ["handoff.json"]


def test_failed_directory_fsync_propagates_after_the_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The rename is the commit point: the new document is complete in place, but
    # its durability is unknown, so the caller hears about it.
    destination = prepare(tmp_path)
    monkeypatch.setattr(handoff, "os", FaultyOs("fsync", errno.EIO, on_call=2))
    with pytest.raises(OSError):
        write_atomic(destination, NEW)
    assert destination.read_bytes() == NEW
    assert os.listdir(tmp_path) == ["handoff.json"]


def test_directory_fsync_unsupported_is_not_a_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    destination = prepare(tmp_path)
    monkeypatch.setattr(handoff, "os", FaultyOs("fsync", errno.EINVAL, on_call=2))
    assert write_atomic(destination, NEW) is True
    assert destination.read_bytes() == NEW


def test_missing_directory_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        write_atomic(tmp_path / "absent" / "handoff.json", NEW)


# ----- through the persistence stage and the monitor -----

def make_config() -> Config:
    return Config(engines=[EngineSpec(name="p1", url="http://127.0.0.1:9001", role="prefill"),
                           EngineSpec(name="d1", url="http://127.0.0.1:9002", role="decode")])


def make_stage(destination: Path) -> PersistenceStage:
    fleet = Fleet([("p1", "prefill"), ("d1", "decode")], eject_after=3, liveness_misses=3,
                  failure_quarantine_s=None, probe_interval_s=5.0)
    return PersistenceStage(path=destination, router_id="r1", fleet=fleet, config=make_config())


@pytest.mark.parametrize("code", ERRNOS, ids=errno.errorcode.get)
@pytest.mark.parametrize("step", STEPS)
async def test_stage_raises_and_keeps_previous(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str, code: int) -> None:
    destination = tmp_path / "handoff.json"
    stage = make_stage(destination)
    await stage.run(1)
    previous = destination.read_bytes()
    monkeypatch.setattr(handoff, "os", FaultyOs(step, code))
    with pytest.raises(OSError) as info:
        await stage.run(2)
    assert info.value.errno == code
    assert destination.read_bytes() == previous
    assert os.listdir(tmp_path) == ["handoff.json"]
    assert stage.last_written_pass == 1


@pytest.mark.parametrize("step", STEPS)
async def test_monitor_records_persistence_error_and_degrades(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str) -> None:
    destination = tmp_path / "handoff.json"
    stage = make_stage(destination)
    admission = Admission()
    monitor = Monitor([stage], interval_s=1.0, stage_timeout_s=5.0, failure_limit=2,
                      admission=admission, metrics=RouterMetrics())
    assert (await monitor.run_pass()).ok
    previous = destination.read_bytes()

    for _ in range(2):
        monkeypatch.setattr(handoff, "os", FaultyOs(step, errno.ENOSPC))
        result = await monitor.run_pass()
        [error] = result.errors
        assert (error.stage, error.error_class) == ("persistence", "OSError")
        assert destination.read_bytes() == previous
        assert os.listdir(tmp_path) == ["handoff.json"]
    # A persistent write failure degrades readiness.
    assert admission.reason() == "monitoring degraded: persistence OSError"

    monkeypatch.undo()
    assert (await monitor.run_pass()).ok
    assert admission.reason() is None
    assert read_document(destination).pass_number == 4


async def test_monitor_times_out_a_stuck_write_without_blocking(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    release = threading.Event()
    real_fsync = os.fsync

    def stuck_fsync(fd: int) -> None:
        release.wait(5)
        real_fsync(fd)

    destination = tmp_path / "handoff.json"
    stage = make_stage(destination)
    monitor = Monitor([stage], interval_s=1.0, stage_timeout_s=0.05, failure_limit=3,
                      admission=Admission(), metrics=RouterMetrics())
    monkeypatch.setattr(handoff.os, "fsync", stuck_fsync)
    with trio.fail_after(2):
        first = await monitor.run_pass()
        second = await monitor.run_pass()
    assert [e.error_class for e in first.errors] == ["TimeoutError"]
    assert [e.error_class for e in second.errors] == ["HandoffWriteInProgress"]
    release.set()
    monkeypatch.undo()
    for _ in range(200):
        if not stage.write_in_progress:
            break
        await trio.sleep(0.01)
    assert read_document(destination).pass_number == 1
