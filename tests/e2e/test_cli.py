"""The commands a newcomer runs: demo, serve with an admin listener, --help everywhere."""

from __future__ import annotations

import json
import os
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


def _child_pid(parent: int, *argv_part: str) -> int:
    """The pid of ``parent``'s child whose command line holds ``argv_part`` in order (Linux /proc)."""
    # Every thread's children: trio starts processes from a worker thread.
    children = [pid for task in Path(f"/proc/{parent}/task").iterdir()
                for pid in (task / "children").read_text().split()]
    for child in children:
        argv = Path(f"/proc/{child}/cmdline").read_bytes().decode().split("\0")
        if any(argv[i:i + len(argv_part)] == list(argv_part) for i in range(len(argv))):
            return int(child)
    raise AssertionError(f"no child of {parent} runs {argv_part}")


async def test_demo_serves_and_stops_cleanly_on_ctrl_c():
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "narwhal", "demo", "--listen", "127.0.0.1:0", "--token-delay-s", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stderr = bytearray()

    async def drain_stderr() -> None:
        while chunk := await process.stderr.receive_some(65536):
            stderr.extend(chunk)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain_stderr)
            output = b""
            with trio.fail_after(30):
                while b"narwhal admin engines" not in output:
                    chunk = await process.stdout.receive_some(4096)
                    assert chunk, output
                    output += chunk
            url = re.search(rb"serving at (http://\S+)", output).group(1).decode()
            # Off the default port the banner gives the --url for narwhal admin, the fleet page and the config.
            assert f"narwhal admin engines --url {url}".encode() in output
            assert f"Fleet page: {url}/admin/ui".encode() in output
            config = re.search(rb"Config: (\S+narwhal\.toml)", output).group(1).decode()
            assert "[[engines]]" in Path(config).read_text()
            async with httpx.AsyncClient(timeout=10) as client:
                response = await client.post(f"{url}/v1/completions",
                                             json={"model": "mock-model", "prompt": "hi", "max_tokens": 4,
                                                   "stream": True})
                assert response.text.rstrip().endswith("data: [DONE]")
                engines = (await client.get(f"{url}/admin/engines")).json()["engines"]
                assert sorted(e["name"] for e in engines) == ["d1", "d2", "p1", "p2"]
                assert (await client.get(f"{url}/admin/ui")).status_code == 200
            # A mock engine that dies is logged.
            pid = _child_pid(process.pid, "--engine-id", "d1")
            os.kill(pid, signal.SIGKILL)
            with trio.fail_after(20):
                while b'"demo_engine_exited"' not in stderr:
                    await trio.sleep(0.05)
            [line] = [json.loads(raw) for raw in bytes(stderr).splitlines() if b'"demo_engine_exited"' in raw]
            assert (line["name"], line["pid"], line["exit_code"]) == ("d1", pid, -signal.SIGKILL)
            process.send_signal(signal.SIGINT)
            with trio.fail_after(20):
                assert await process.wait() == 0
    finally:
        if process.returncode is None:
            # Ctrl-C first: the demo stops the engines and the router it started (each in its own session).
            process.send_signal(signal.SIGINT)
            with trio.move_on_after(20):
                await process.wait()
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


async def _raw(port: int, data: bytes) -> bytes:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(data)
        raw = b""
        with trio.fail_after(20):
            while chunk := await stream.receive_some(65536):
                raw += chunk
    return raw


@pytest.mark.parametrize("workers", [1, 2])
async def test_an_absolute_form_admin_target_on_the_traffic_port_drains_nothing(start_fleet, workers):
    """Issue 19 item 11, from outside: ``POST http://x/admin/engines/d1/drain`` on the traffic port, in each front."""
    admin_port = free_port()
    fleet = await start_fleet(sections={"admin": {"listen": f"127.0.0.1:{admin_port}", "token": "s3cret"},
                                        "serving": {"workers": workers}})
    port = int(fleet.url.rsplit(":", 1)[1])
    for form in (b"http://x/admin/engines/d1/drain", b"HTTP://127.0.0.1:1/%61dmin/engines/d1/drain"):
        for _ in range(4):  # the kernel spreads connections over the workers
            raw = await _raw(port, b"POST %b HTTP/1.1\r\nhost: x\r\nauthorization: Bearer s3cret\r\n"
                                   b"content-length: 0\r\nconnection: close\r\n\r\n" % form)
            assert raw.startswith(b"HTTP/1.1 404"), raw[:200]
    raw = await _raw(port, b"POST ftp://x/admin/engines/d1/drain HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
    assert raw.startswith(b"HTTP/1.1 400") and b"invalid_request_target" in raw
    auth = {"authorization": "Bearer s3cret"}
    engines = (await fleet.client.get(f"http://127.0.0.1:{admin_port}/admin/engines", headers=auth)).json()
    d1 = next(e for e in engines["engines"] if e["name"] == "d1")
    assert d1["holds"] == [] and d1["eligible"]
    # The admin listener takes the absolute form too, under its token.
    raw = await _raw(admin_port, b"POST http://x/admin/engines/d1/drain HTTP/1.1\r\nhost: x\r\n"
                                 b"content-length: 0\r\nconnection: close\r\n\r\n")
    assert raw.startswith(b"HTTP/1.1 401")
