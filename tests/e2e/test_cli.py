"""The commands a newcomer runs: demo, serve with an admin listener, --help everywhere."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

pytestmark = pytest.mark.e2e


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("command", [[], ["serve"], ["demo"], ["mock-engine"], ["bench"]])
def test_help_on_every_command(command):
    result = subprocess.run([sys.executable, "-m", "narwhal", *command, "--help"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: narwhal")


SUBCOMMANDS = ["serve", "demo", "mock-engine", "bench", "admin", "engine-check"]


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_the_narwhal_console_script_runs_every_subcommand(command):
    # The installed script (what `.venv/bin/narwhal` is), not `python -m narwhal`.
    script = Path(sys.executable).parent / "narwhal"
    result = subprocess.run([str(script), command, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: narwhal {command}")


def test_narwhal_serve_is_narwhal_serve_too():
    script = Path(sys.executable).parent / "narwhal-serve"
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: narwhal serve")


async def test_demo_serves_and_stops_cleanly_on_ctrl_c():
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "narwhal", "demo", "--listen", "127.0.0.1:0", "--token-delay-s", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        output = b""
        with trio.fail_after(30):
            while b"curl -N" not in output:
                chunk = await process.stdout.receive_some(4096)
                assert chunk, output
                output += chunk
        url = re.search(rb"serving at (http://\S+)", output).group(1).decode()
        async with httpx.AsyncClient(timeout=10) as client:
            response = await client.post(f"{url}/v1/completions",
                                         json={"model": "mock-model", "prompt": "hi", "max_tokens": 4, "stream": True})
            assert response.text.rstrip().endswith("data: [DONE]")
            engines = (await client.get(f"{url}/admin/engines")).json()["engines"]
            assert sorted(e["name"] for e in engines) == ["d1", "d2", "p1", "p2"]
        process.send_signal(signal.SIGINT)
        with trio.fail_after(20):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_admin_listen_serves_the_control_app_but_not_completions(start_fleet):
    admin_port = free_port()
    fleet = await start_fleet(sections={"admin": {"listen": f"127.0.0.1:{admin_port}", "token": "s3cret"}})
    admin = f"http://127.0.0.1:{admin_port}"
    with trio.fail_after(10):
        while True:
            try:
                ready = await fleet.client.get(f"{admin}/ready")
                break
            except httpx.ConnectError:
                await trio.sleep(0.05)
    assert ready.status_code == 200
    assert (await fleet.client.get(f"{admin}/admin/engines")).status_code == 401
    engines = await fleet.client.get(f"{admin}/admin/engines", headers={"authorization": "Bearer s3cret"})
    assert engines.status_code == 200
    completion = await fleet.client.post(f"{admin}/v1/completions",
                                         json={"model": "mock-model", "prompt": "hi"})
    assert completion.status_code in (404, 405)
    # The traffic port still serves completions, but no longer the admin API.
    response = await fleet.client.post(f"{fleet.url}/v1/completions", json={"model": "mock-model", "prompt": "hi"})
    assert response.status_code == 200
    assert json.loads(response.text)["choices"]
    hidden = await fleet.client.get(f"{fleet.url}/admin/engines", headers={"authorization": "Bearer s3cret"})
    assert hidden.status_code == 404


def test_demo_on_a_busy_port_fails_at_once_with_one_line_suggesting_listen():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "narwhal", "demo", "--listen", f"127.0.0.1:{port}"],
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    # One line and nothing else: no engine was started (their events would be echoed), no traceback.
    assert result.stdout == ""
    assert result.stderr == (f"narwhal demo: cannot listen on 127.0.0.1:{port}: Address already in use; "
                             "choose a free address with --listen HOST:PORT (e.g. --listen 127.0.0.1:0 for any "
                             "free port)\n")
