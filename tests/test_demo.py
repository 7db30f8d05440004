"""``narwhal demo``'s banner and its watch on the mock engines it started (the whole demo: tests/e2e/test_cli.py)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import trio

from narwhal.tools.demo import banner, watch_engine
from narwhal.tools.local_fleet import LocalProcess


def events(caplog: pytest.LogCaptureFixture, name: str) -> list[dict]:
    lines = [json.loads(record.getMessage()) for record in caplog.records if record.name == "narwhal.events"]
    return [line for line in lines if line["event"] == name]


def test_the_banner_names_the_fleet_page_the_config_and_the_admin_url_off_the_default_port() -> None:
    config = Path("/tmp/narwhal-demo-x/narwhal.toml")
    text = banner("http://127.0.0.1:8123", config)
    assert "Fleet page: http://127.0.0.1:8123/admin/ui\n" in text
    assert f"Config: {config} (" in text and "narwhal admin reload --url http://127.0.0.1:8123)" in text
    assert "  narwhal admin engines --url http://127.0.0.1:8123\n" in text
    # On the default address `narwhal admin` needs no --url.
    default = banner("http://127.0.0.1:8000", config)
    assert "--url" not in default and "  narwhal admin engines\n" in default


async def _exiting_engine(code: int) -> LocalProcess:
    process = await trio.lowlevel.open_process([sys.executable, "-c", f"import sys; sys.exit({code})"])
    return LocalProcess(process, 9, "d1")


async def test_a_mock_engine_that_dies_is_logged_with_its_name_pid_and_exit_code(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    engine = await _exiting_engine(3)
    with trio.fail_after(30):
        await watch_engine(engine, trio.Event())
    [exited] = events(caplog, "demo_engine_exited")
    assert (exited["level"], exited["name"], exited["pid"], exited["exit_code"]) == ("warning", "d1", engine.pid, 3)


async def test_an_engine_the_demo_stops_is_not_logged_as_died(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    stopping = trio.Event()
    stopping.set()
    engine = await _exiting_engine(0)
    with trio.fail_after(30):
        await watch_engine(engine, stopping)
    assert events(caplog, "demo_engine_exited") == []
