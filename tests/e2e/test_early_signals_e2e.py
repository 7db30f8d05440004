"""End to end: SIGHUP from the first moments of ``narwhal serve`` (a `systemctl reload` right after a start)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from narwhal.tools.local_fleet import render_config

pytestmark = pytest.mark.e2e

ENGINES = [("p1", "http://127.0.0.1:9", "prefill"), ("d1", "http://127.0.0.1:9", "decode")]


def catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler for ``signum`` (its ``SigCgt`` mask in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def events(log: Path) -> list[dict[str, Any]]:
    found = []
    for raw in log.read_text().splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if isinstance(line, dict):
            found.append(line)
    return found


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the signal masks in /proc")
def test_a_sighup_during_startup_is_survived_and_applied_once_started(tmp_path: Path):
    config = tmp_path / "narwhal.toml"
    config.write_text(render_config(ENGINES, {"handoff": {"path": str(tmp_path / "handoff.json")}}))
    log = tmp_path / "stderr.log"
    with log.open("wb") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "narwhal", "serve", "--config", str(config),
                                    "--listen", "127.0.0.1:0"], stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        # As soon as anything handles SIGHUP: the router's own handler comes about a second later, after
        # trio, msgspec and the router are imported. Before that, SIGHUP's default action ended the process.
        deadline = time.monotonic() + 20.0
        while not catches(process.pid, signal.SIGHUP):
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the router never handled SIGHUP"
        process.send_signal(signal.SIGHUP)

        def reloaded() -> list[dict[str, Any]]:
            return [line for line in events(log) if line.get("event") == "config_reloaded"]

        reload = wait_for(reloaded, 30.0, "config_reloaded")[0]
        assert reload["file"] == str(config)
        assert process.poll() is None, log.read_text()
        names = [line.get("event") for line in events(log)]
        assert names.index("router_started") < names.index("config_reloaded")
        early = [line for line in events(log) if line.get("event") == "signal"]
        assert early == [{**early[0], "signal": "SIGHUP", "during_startup": True}]
        # One reload for the SIGHUP of the startup, however many came.
        assert len(reloaded()) == 1
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
