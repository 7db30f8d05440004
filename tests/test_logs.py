"""Operator logs: JSON lines through the batching handler, its direct path, and the timestamp."""

from __future__ import annotations

import datetime
import functools
import io
import json
import logging
import time
import types
from collections.abc import Iterator

import msgspec
import pytest
import trio
import trio.testing

from narwhal.obs import logs


@pytest.fixture
def stderr(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    """configure_logging() writing to a buffer; the logging setup it changes is restored afterwards."""
    root = logging.getLogger()
    events = logging.getLogger("narwhal.events")
    saved = (root.handlers[:], root.level, events.level, logs._batching)
    buffer = io.StringIO()
    monkeypatch.setattr("sys.stderr", buffer)
    monkeypatch.setattr("atexit.register", lambda *args: None)
    logs.configure_logging()
    yield buffer
    root.handlers[:], root.level = saved[0], saved[1]
    events.setLevel(saved[2])
    logs._batching = saved[3]


def _alone() -> None:
    """Only the batching handler on the root logger, as in the router (pytest adds its own per test phase)."""
    assert logs._batching is not None
    logging.getLogger().handlers[:] = [logs._batching]


def _lines(buffer: io.StringIO) -> list[dict[str, object]]:
    logs.flush_logs()
    return [json.loads(line) for line in buffer.getvalue().splitlines()]


def test_an_event_is_one_json_line_with_event_ts_level_and_fields(stderr: io.StringIO) -> None:
    _alone()
    logs.log_event("request", request_id="r1", status=200, error=None)
    [line] = _lines(stderr)
    assert line["event"] == "request"
    assert line["level"] == "info"
    assert (line["request_id"], line["status"], line["error"]) == ("r1", 200, None)
    parsed = datetime.datetime.fromisoformat(str(line["ts"]).replace("Z", "+00:00"))
    assert abs((datetime.datetime.now(datetime.UTC) - parsed).total_seconds()) < 5


def test_info_lines_wait_for_the_batch_and_warnings_flush_at_once(stderr: io.StringIO) -> None:
    _alone()
    logs.log_event("request", request_id="r1")
    assert stderr.getvalue() == ""  # batched: at most max_delay_s late
    logs.log_event("engine_failure", level=logging.WARNING, engine="d1")
    written = [json.loads(line) for line in stderr.getvalue().splitlines()]
    assert [(line["event"], line["level"]) for line in written] == [("request", "info"), ("engine_failure", "warning")]


def test_another_handler_still_sees_every_event(stderr: io.StringIO) -> None:
    # The direct path to the batch is only taken while the batching handler is the sole destination:
    # a handler added later (pytest's caplog, an embedding application) gets every line too.
    seen: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    _alone()
    collect = Collect()
    batching = logs._batching
    assert batching is not None and batching.sole_destination(logging.INFO)
    logging.getLogger().addHandler(collect)
    try:
        assert not batching.sole_destination(logging.INFO)
        logs.log_event("request", request_id="r2")
    finally:
        logging.getLogger().removeHandler(collect)
    assert batching.sole_destination(logging.INFO)
    logs.log_event("request", request_id="r3")
    assert [json.loads(line)["request_id"] for line in seen] == ["r2"]
    assert [line["request_id"] for line in _lines(stderr)] == ["r2", "r3"]


def test_a_disabled_level_writes_nothing(stderr: io.StringIO) -> None:
    _alone()
    logging.getLogger("narwhal.events").setLevel(logging.WARNING)
    logs.log_event("request", request_id="r1")
    assert _lines(stderr) == []


def test_process_fields_are_on_every_line(stderr: io.StringIO, monkeypatch: pytest.MonkeyPatch) -> None:
    _alone()
    monkeypatch.setattr(logs, "_process_fields", {})
    monkeypatch.setattr(logs, "_process_members", "")
    logs.set_log_fields(worker=1)
    logs.log_event("request", request_id="r1")
    logs.log_fields("request", _Fields("r2", None, 1.5))
    assert [(line["worker"], line["request_id"]) for line in _lines(stderr)] == [(1, "r1"), (1, "r2")]


class _Fields(msgspec.Struct):
    request_id: str
    error: str | None
    ttft_ms: float


class _Nothing(msgspec.Struct):
    """No fields: the line is its head alone."""


@pytest.mark.parametrize("process", [{}, {"worker": 3}])
def test_a_struct_event_is_the_line_log_event_writes(stderr: io.StringIO, monkeypatch: pytest.MonkeyPatch,
                                                      process: dict[str, int]) -> None:
    _alone()
    monkeypatch.setattr(logs, "_process_fields", {})
    monkeypatch.setattr(logs, "_process_members", "")
    logs.set_log_fields(**process)
    monkeypatch.setattr(logs, "_now_iso", lambda: "2026-12-06T08:00:00.000Z")
    logs.log_event("request", request_id='r"1', error=None, ttft_ms=1.5)
    logs.log_fields("request", _Fields('r"1', None, 1.5))
    logs.log_event("tick")
    logs.log_fields("tick", _Nothing())
    logs.log_event("engine_failure", level=logging.WARNING, request_id="r2", error="x", ttft_ms=0.0)
    logs.log_fields("engine_failure", _Fields("r2", "x", 0.0), level=logging.WARNING)
    logs.flush_logs()
    written = stderr.getvalue().splitlines()
    # Byte for byte, so the order of the fields (an interface) is the same too.
    assert written[0::2] == written[1::2] and len(written) == 6
    assert list(json.loads(written[0])) == ["event", "ts", "level", *process, "request_id", "error", "ttft_ms"]
    logging.getLogger("narwhal.events").setLevel(logging.WARNING)
    logs.log_fields("request", _Fields("r3", None, 1.0))
    assert _lines(stderr) == [json.loads(line) for line in written]


def test_timestamps_match_isoformat_at_millisecond_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    # One second formatted, then reused within it; a new second formats again.
    for ns in (1_796_155_131_951_625_600, 1_796_155_131_999_999_999, 1_796_155_132_000_000_000,
               1_796_155_132_000_999_999, 1_796_241_600_007_000_000):
        monkeypatch.setattr("time.time_ns", lambda ns=ns: ns)
        expected = datetime.datetime.fromtimestamp(ns // 1000 / 1e6, datetime.UTC).isoformat(
            timespec="milliseconds").replace("+00:00", "Z")
        assert logs._now_iso() == expected


async def test_the_flusher_sleeps_until_a_line_waits_then_writes_it_within_its_delay(
        stderr: io.StringIO, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock) -> None:
    _alone()
    handler = logs._batching
    assert handler is not None
    # The handler's batch clock follows trio's mock clock here.
    monkeypatch.setattr(logs, "time", types.SimpleNamespace(monotonic=autojump_clock.current_time, time_ns=time.time_ns,
                                                            strftime=time.strftime, gmtime=time.gmtime))
    handler._last_flush = trio.current_time()
    looks: list[float] = []
    flush_if_due = handler.flush_if_due
    monkeypatch.setattr(handler, "flush_if_due", lambda: looks.append(trio.current_time()) or flush_if_due())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(logs.run_log_flusher, 0.1)
        await trio.sleep(5.0)
        assert looks == []  # nothing waited: it never woke (it used to look 50 times)
        logs.log_event("request", request_id="r0")  # the batch was due long ago: written at once
        logged_at = trio.current_time()
        logs.log_event("request", request_id="r1")  # this one waits for the flusher
        await trio.sleep(0.09)
        assert [json.loads(line)["request_id"] for line in stderr.getvalue().splitlines()] == ["r0"]
        await trio.sleep(0.02)
        assert [json.loads(line)["request_id"] for line in stderr.getvalue().splitlines()] == ["r0", "r1"]
        assert looks == [logged_at + 0.1]
        # A line left waiting by another thread wakes it too.
        handler._last_flush = trio.current_time()
        await trio.to_thread.run_sync(functools.partial(logs.log_event, "request", request_id="r2"))
        await trio.sleep(0.11)
        assert [json.loads(line)["request_id"] for line in stderr.getvalue().splitlines()] == ["r0", "r1", "r2"]
        assert len(looks) == 2
        nursery.cancel_scope.cancel()
    assert handler.on_pending is None
