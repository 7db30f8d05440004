"""`narwhal serve` refuses to start, in one line and with exit status 2, on what would only fail later.

Each case runs the real command; none may print a traceback or start a router
that answers 503 for good.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from narwhal.tools.local_fleet import render_config

pytestmark = pytest.mark.e2e

ENGINES = [("p1", "http://127.0.0.1:9", "prefill"), ("d1", "http://127.0.0.1:9", "decode")]


def serve(config_path: Path, listen: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "narwhal", "serve", "--config", str(config_path), "--listen",
                           listen], capture_output=True, text=True, timeout=60)


def the_one_line(result: subprocess.CompletedProcess[str]) -> str:
    """The human line on stderr (the rest are JSON log events)."""
    lines = [line for line in result.stderr.splitlines() if not line.startswith("{")]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def the_failure(result: subprocess.CompletedProcess[str]) -> str:
    """A start-up failure: the operator's one line, and exactly one event, ``router_failed`` at level error.

    No ``router_stopped`` (the router never started) and nothing at level info.
    """
    events = [json.loads(line) for line in result.stderr.splitlines() if line.startswith("{")]
    assert [(e["event"], e["level"]) for e in events] == [("router_failed", "error")], result.stderr
    line = the_one_line(result)
    assert events[0]["message"] in line
    return line


def test_a_serving_port_in_use(tmp_path: Path):
    config = tmp_path / "narwhal.toml"
    config.write_text(render_config(ENGINES, {"handoff": {"path": str(tmp_path / "h.json")}}))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = serve(config, f"127.0.0.1:{port}")
    assert result.returncode == 2
    assert the_failure(result) == (f"narwhal: cannot start: serving.listen: cannot listen on 127.0.0.1:{port}: "
                                    "Address already in use")


def test_an_ipv6_address_is_logged_and_told_in_brackets(tmp_path: Path):
    config = tmp_path / "narwhal.toml"
    config.write_text(render_config(ENGINES, {"handoff": {"path": str(tmp_path / "h.json")}}))
    with socket.socket(socket.AF_INET6) as taken:
        taken.bind(("::1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = serve(config, f"[::1]:{port}")
    assert result.returncode == 2
    assert the_failure(result).endswith(f"cannot listen on [::1]:{port}: Address already in use")
    # Started: router_started's listen reads back as HOST:PORT, brackets included.
    process = subprocess.Popen([sys.executable, "-m", "narwhal", "serve", "--config", str(config), "--listen",
                                "[::1]:0"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stderr is not None
        for line in process.stderr:
            event = json.loads(line) if line.startswith("{") else {}
            if event.get("event") == "router_started":
                assert event["listen"].startswith("[::1]:") and int(event["listen"].rpartition(":")[2]) > 0
                break
        else:
            raise AssertionError("the router did not start")
    finally:
        process.terminate()
        process.communicate(timeout=30)


def test_an_admin_port_in_use(tmp_path: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = tmp_path / "narwhal.toml"
        config.write_text(render_config(ENGINES, {"handoff": {"path": str(tmp_path / "h.json")},
                                                  "admin": {"listen": f"127.0.0.1:{port}", "token": "t"}}))
        result = serve(config, "127.0.0.1:0")
    assert result.returncode == 2
    assert "admin.listen: cannot listen on" in the_failure(result)


def test_admin_listen_equal_to_the_serving_address(tmp_path: Path):
    config = tmp_path / "narwhal.toml"
    config.write_text(render_config(ENGINES, {"handoff": {"path": str(tmp_path / "h.json")},
                                              "admin": {"listen": "127.0.0.1:18000", "token": "t"}}))
    result = serve(config, "127.0.0.1:18000")
    assert result.returncode == 2
    assert the_failure(result) == ("narwhal: cannot start: admin.listen 127.0.0.1:18000 is the serving address "
                                    "127.0.0.1:18000: give the admin API a port of its own")


def test_a_missing_handoff_directory(tmp_path: Path):
    config = tmp_path / "narwhal.toml"
    config.write_text(render_config(ENGINES, {"handoff": {"path": str(tmp_path / "gone" / "h.json")}}))
    result = serve(config, "127.0.0.1:0")
    assert result.returncode == 2
    assert the_failure(result).endswith("gone' does not exist")


def test_nan_in_the_config(tmp_path: Path):
    config = tmp_path / "narwhal.toml"
    config.write_text("[controller]\nmonitor_interval_s = nan\n" + render_config(ENGINES))
    result = serve(config, "127.0.0.1:0")
    assert result.returncode == 2
    assert the_one_line(result).endswith("controller: monitor_interval_s must be a finite number, got nan")
