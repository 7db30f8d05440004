"""Hostile handoff files for --resume (issue 13, item 12): never hang, never read without bound, never crash.

Each case must come back "not applied" with its reason, quickly, and the
router's resume step must carry on.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest
import trio

from narwhal.config import Config, EngineSpec
from narwhal.native_parts import native_parts
from narwhal.state.handoff import (
    HANDOFF_SCHEMA,
    HandoffUnreadable,
    decode_document,
    json_nesting_exceeds,
    read_document,
)
from narwhal.state.resume import plan_resume

CONFIG = Config(engines=[EngineSpec(name="p1", url="http://127.0.0.1:9001", role="prefill"),
                         EngineSpec(name="d1", url="http://127.0.0.1:9002", role="decode")])


def deep_document(depth: int) -> bytes:
    return (b'{"schema": %d, "router_id": "x", "pid": 1, "pass_number": 1, "written_at": 0, '
            b'"engine_set": [], "engines": [], "junk": ' % HANDOFF_SCHEMA + b"[" * depth + b"]" * depth + b"}")


def test_a_document_nested_100000_deep_is_not_applied_and_raises_no_recursion_error(tmp_path: Path):
    path = tmp_path / "handoff.json"
    path.write_bytes(deep_document(100_000))
    plan = plan_resume(path, CONFIG)
    assert not plan.applied
    assert plan.reason is not None and "nested deeper than" in plan.reason


def test_nesting_within_the_bound_still_decodes():
    document = decode_document(deep_document(8))
    assert document.schema == HANDOFF_SCHEMA and document.engines == []


@pytest.mark.parametrize(("text", "depth", "deeper"), [
    (b'{"a": [1, {"b": []}]}', 3, True),
    (b'{"a": [1, {"b": []}]}', 4, False),
    (b'{"a": "[[[[[[", "b": "\\\\", "c": "\\"[[[["}', 1, False),
    (b"[" * 17 + b"]" * 17, 16, True),
    (b"[" * 16 + b"]" * 16, 16, False),
])
def test_nesting_is_measured_outside_strings(text: bytes, depth: int, deeper: bool):
    assert json_nesting_exceeds(text, depth) is deeper


def test_a_fifo_at_the_handoff_path_is_not_applied_and_does_not_hang(tmp_path: Path):
    path = tmp_path / "handoff.json"
    os.mkfifo(path)
    # In a child, so that a hang fails the test instead of hanging the suite.
    script = textwrap.dedent(f"""
        from narwhal.config import Config, EngineSpec
        from narwhal.state.resume import plan_resume
        config = Config(engines=[EngineSpec(name="p1", url="http://127.0.0.1:9001", role="prefill"),
                                 EngineSpec(name="d1", url="http://127.0.0.1:9002", role="decode")])
        print(plan_resume({str(path)!r}, config).reason)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "not a regular file (a FIFO)" in result.stdout


def test_a_symlink_to_dev_zero_is_not_read(tmp_path: Path):
    path = tmp_path / "handoff.json"
    path.symlink_to("/dev/zero")
    plan = plan_resume(path, CONFIG)
    assert not plan.applied
    assert plan.reason is not None and "not a regular file (a character device)" in plan.reason


def test_a_directory_is_not_applied(tmp_path: Path):
    plan = plan_resume(tmp_path, CONFIG)
    assert not plan.applied and plan.reason is not None and "a directory" in plan.reason


def test_a_file_over_the_size_bound_is_not_read(tmp_path: Path):
    path = tmp_path / "handoff.json"
    with path.open("wb") as f:
        f.truncate(64 * 1024 * 1024 + 1)  # sparse: nothing is written
    plan = plan_resume(path, CONFIG)
    assert not plan.applied
    assert plan.reason is not None and "over the 67108864 byte bound" in plan.reason


def test_the_size_bound_holds_for_a_small_bound_too(tmp_path: Path):
    path = tmp_path / "handoff.json"
    path.write_bytes(msgspec.json.encode({"schema": HANDOFF_SCHEMA, "pad": "x" * 1000}))
    with pytest.raises(HandoffUnreadable, match="over the 100 byte bound"):
        read_document(path, max_bytes=100)


async def test_the_router_starts_with_a_fifo_handoff_and_says_why_it_was_not_applied(
        tmp_path: Path, caplog: pytest.LogCaptureFixture):
    from narwhal.router import Router

    caplog.set_level(logging.INFO, logger="narwhal.events")
    path = tmp_path / "handoff.json"
    os.mkfifo(path)
    config = msgspec.structs.replace(CONFIG, handoff=msgspec.structs.replace(CONFIG.handoff, path=str(path)))
    router = Router(config, listen="127.0.0.1:0", resume=True)
    async with trio.open_nursery() as nursery:
        with trio.fail_after(20):
            await nursery.start(router.run)
        router.shutdown(0)
    events = [json.loads(record.getMessage()) for record in caplog.records if record.name == "narwhal.events"]
    # It said why, naming the file and its kind, and applied nothing ...
    [not_applied] = [event for event in events if event["event"] == "handoff_not_applied"]
    assert not_applied["path"] == str(path)
    assert "not a regular file (a FIFO)" in not_applied["reason"]
    assert [event for event in events if event["event"] == "handoff_applied"] == []
    # ... and started (a FIFO opened for reading must not hang startup) after saying so.
    names = [event["event"] for event in events]
    assert names.index("handoff_not_applied") < names.index("router_started")
    [started] = [event for event in events if event["event"] == "router_started"]
    assert started["listen"] == f"127.0.0.1:{router.bound_port}"
    # Which compiled parts run (CI builds them all).
    assert started["native"] == native_parts()
    if os.environ.get("CI"):
        assert started["native"] == ["relay", "otlp_encoder", "request_trace", "hub_round"]
