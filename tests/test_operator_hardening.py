"""Careless operators (issue 13, items 10, 11, 13): config numbers, admin exposure, tokens, loops.

Config rules are checked through ``parse_config``; the admin port split, the
startup warning and loop detection run a real in-process router on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import functools
import io
import json
import logging
import socket
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from narwhal.config import ConfigError, parse_config
from narwhal.errors import StartupError
from narwhal.router import Router, preflight
from narwhal.tools.admin_cli import run_admin

ENGINES = """
[[engines]]
name = "p1"
url = "http://127.0.0.1:{prefill_port}"
role = "prefill"
[[engines]]
name = "d1"
url = "http://127.0.0.1:{decode_port}"
role = "decode"
"""


def config_text(extra: str = "", prefill_port: int = 9001, decode_port: int = 9002) -> str:
    return extra + ENGINES.format(prefill_port=prefill_port, decode_port=decode_port)


# -- 11. numbers that are not numbers, and floors for periods -------------------------------------


@pytest.mark.parametrize(("section", "key", "value"), [
    ("serving", "request_deadline_s", "nan"),
    ("serving", "request_deadline_s", "inf"),
    ("serving", "idle_timeout_s", "nan"),
    ("serving", "shutdown_grace_s", "nan"),
    ("serving", "shutdown_grace_s", "inf"),
    ("engine", "connect_timeout_s", "nan"),
    ("engine", "request_timeout_s", "inf"),
    ("engine", "first_token_deadline_s", "-inf"),
    ("engine", "health_timeout_s", "nan"),
    ("controller", "monitor_interval_s", "nan"),
    ("controller", "monitor_interval_s", "inf"),
    ("controller", "stage_timeout_s", "nan"),
    ("controller", "drift_factor", "nan"),
    ("controller", "drift_factor", "inf"),
    ("telemetry", "interval_s", "nan"),
    ("recovery", "probe_interval_s", "nan"),
    ("recovery", "failure_quarantine_s", "inf"),
    ("lease", "ttl_s", "nan"),
])
def test_nan_and_inf_are_refused_in_one_line_naming_the_key(section, key, value):
    with pytest.raises(ConfigError) as caught:
        parse_config(config_text(f"[{section}]\n{key} = {value}\n"))
    message = str(caught.value)
    assert "\n" not in message
    assert f"{section}: {key} must be a finite number, got {value.lstrip('-+')}" in message.replace("-inf", "inf")


@pytest.mark.parametrize(("section", "key", "too_small", "floor"), [
    ("controller", "monitor_interval_s", 0.01, "0.05"),
    ("controller", "stage_timeout_s", 0.001, "0.01"),
    ("recovery", "probe_interval_s", 0.001, "0.05"),
    ("telemetry", "interval_s", 0.001, "0.05"),
    ("engine", "max_response_bytes", 100, "1024"),
    ("engine", "max_response_header_bytes", 100, "1024"),
    ("engine", "max_handoff_bytes", 10, "256"),
])
def test_periods_and_bounds_have_floors(section, key, too_small, floor):
    with pytest.raises(ConfigError, match=f"{section}: {key} must be >= {floor}, got {too_small}"):
        parse_config(config_text(f"[{section}]\n{key} = {too_small}\n"))
    parse_config(config_text(f"[{section}]\n{key} = {floor}\n"))


# -- 13. admin tokens that cannot travel in a header -----------------------------------------------


@pytest.mark.parametrize("token", ["caf\u00e9", "s3cret token", "tab\there", "\u2603"])
def test_a_token_that_is_not_printable_ascii_is_refused_at_config_load(token):
    with pytest.raises(ConfigError, match="admin: token must be printable ASCII"):
        parse_config(config_text(f"[admin]\ntoken = {json.dumps(token)}\n"))


@pytest.mark.parametrize("token", ["caf\u00e9", "line\nbreak", "\u2603"])
def test_the_admin_cli_says_so_in_one_line_instead_of_crashing(token):
    requests: list[httpx.Request] = []
    out, err = io.StringIO(), io.StringIO()
    args = argparse.Namespace(url="http://127.0.0.1:9", token=token, action="engines")
    status = run_admin(args, transport=httpx.MockTransport(lambda r: requests.append(r) or httpx.Response(200)),
                       out=out, err=err)
    assert status == 2
    assert err.getvalue().startswith("narwhal admin: --token: the token must be printable ASCII")
    assert err.getvalue().count("\n") == 1
    assert requests == []


def test_the_admin_cli_checks_the_environment_token_too(monkeypatch):
    monkeypatch.setenv("NARWHAL_ADMIN_TOKEN", "caf\u00e9")
    err = io.StringIO()
    args = argparse.Namespace(url="http://127.0.0.1:9", token=None, action="engines")
    assert run_admin(args, transport=httpx.MockTransport(lambda r: httpx.Response(200)), out=io.StringIO(),
                     err=err) == 2
    assert "$NARWHAL_ADMIN_TOKEN" in err.getvalue()


def test_the_admin_cli_says_a_broken_url_is_broken_instead_of_crashing():
    err = io.StringIO()
    args = argparse.Namespace(url="http://[::1", token=None, action="engines")
    assert run_admin(args, out=io.StringIO(), err=err) == 2
    assert err.getvalue().startswith("narwhal admin: --url 'http://[::1': ")
    assert err.getvalue().count("\n") == 1


# -- 13. preflight: what would fail later fails at start, in one line --------------------------------


def test_admin_listen_on_the_serving_address_is_refused(tmp_path: Path):
    config = parse_config(config_text(f'[admin]\nlisten = "0.0.0.0:8000"\n[handoff]\npath = "{tmp_path}/h.json"\n'))
    with pytest.raises(StartupError, match="admin.listen 0.0.0.0:8000 is the serving address 127.0.0.1:8000"):
        preflight(config, "127.0.0.1:8000")


def test_an_engine_url_that_is_this_router_is_refused(tmp_path: Path):
    config = parse_config(config_text(f'[handoff]\npath = "{tmp_path}/h.json"\n', decode_port=8000))
    with pytest.raises(StartupError, match=r'engine "d1": url http://127.0.0.1:8000 is this router\'s own'):
        preflight(config, "localhost:8000")
    preflight(config, "127.0.0.1:8001")


def test_a_missing_handoff_directory_is_refused(tmp_path: Path):
    config = parse_config(config_text(f'[handoff]\npath = "{tmp_path}/nowhere/h.json"\n'))
    with pytest.raises(StartupError, match="handoff.path .*nowhere/h.json: directory .* does not exist"):
        preflight(config, "127.0.0.1:0")


def test_an_unwritable_handoff_directory_is_refused():
    # /proc takes no new files, whoever we run as (chmod would not stop root).
    config = parse_config(config_text('[handoff]\npath = "/proc/narwhal-handoff.json"\n'))
    expected = "handoff.path /proc/narwhal-handoff.json: directory '/proc' is not writable"
    with pytest.raises(StartupError, match=expected):
        preflight(config, "127.0.0.1:0")


async def test_a_serving_port_in_use_is_a_startup_error(tmp_path: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = parse_config(config_text(f'[handoff]\npath = "{tmp_path}/h.json"\n'))
        router = Router(config, listen=f"127.0.0.1:{port}")
        with pytest.raises(StartupError, match=f"serving.listen: cannot listen on 127.0.0.1:{port}: "
                                               "Address already in use"):
            await router.run()


# -- 10. [admin] listen takes admin off the traffic port -------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(autouse=True)
def _capture_events(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")


def events(caplog: pytest.LogCaptureFixture, event: str) -> list[dict[str, Any]]:
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "narwhal.events"]
    return [line for line in lines if line["event"] == event]


async def start_router(nursery: trio.Nursery, text: str) -> tuple[Router, str]:
    router = Router(parse_config(text), listen="127.0.0.1:0")
    with trio.fail_after(20):
        port = await nursery.start(router.run)
    return router, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("path", ["/admin/engines", "/%61dmin/engines", "//admin/engines", "/admin/telemetry",
                                  "/admin/engines/p1", "/admin"])
async def test_with_admin_listen_the_traffic_port_answers_admin_paths_404(nursery, tmp_path, caplog, path):
    admin_port = free_port()
    router, url = await start_router(nursery, config_text(
        f'[admin]\nlisten = "127.0.0.1:{admin_port}"\ntoken = "s3cret"\n[handoff]\npath = "{tmp_path}/h.json"\n'))
    auth = {"authorization": "Bearer s3cret"}
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            response = await client.get(url + path, headers=auth)
            assert response.status_code == 404
            assert response.json()["error"]["code"] == "not_found"
            # It says where the admin API is.
            assert f"--url http://127.0.0.1:{admin_port}" in response.json()["error"]["message"]
            # The admin listener, bound before the router reported started, serves them.
            admin = await client.get(f"http://127.0.0.1:{admin_port}/admin/engines", headers=auth)
            assert admin.status_code == 200 and admin.json()["engines"]
            assert (await client.get(f"{url}/health")).status_code == 200
    finally:
        router.shutdown(0)
    assert events(caplog, "admin_unauthenticated") == []


async def test_without_a_token_the_admin_listener_refuses_web_pages_and_the_traffic_port_names_it(
        nursery, tmp_path):
    admin_port = free_port()
    router, url = await start_router(nursery, config_text(
        f'[admin]\nlisten = "127.0.0.1:{admin_port}"\n[handoff]\npath = "{tmp_path}/h.json"\n'))
    admin = f"http://127.0.0.1:{admin_port}"
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            # A form POST from a page elsewhere, and a page on a name rebound to the router.
            cross = await client.post(f"{admin}/admin/engines/d1/drain", content=b"x=1", headers={
                "origin": "http://evil.example", "content-type": "application/x-www-form-urlencoded"})
            assert cross.status_code == 403 and cross.json()["error"]["code"] == "admin_request_refused"
            rebound = await client.get(f"{admin}/admin/engines", headers={"host": f"evil.example:{admin_port}"})
            assert rebound.status_code == 403 and rebound.json()["error"]["code"] == "admin_request_refused"
            assert not router.readmitter.drained("d1")
            # curl -X POST from a shell: no Origin, no content type.
            shell = await client.post(f"{admin}/admin/engines/d1/drain")
            assert shell.status_code == 200 and router.readmitter.drained("d1")
        # narwhal admin pointed at the traffic port is told which --url to pass.
        err = io.StringIO()
        args = argparse.Namespace(url=url, token=None, action="engines")
        assert await trio.to_thread.run_sync(functools.partial(run_admin, args, out=io.StringIO(), err=err)) == 1
        assert err.getvalue() == (
            f"narwhal admin: HTTP 404: no route for GET /admin/engines on the traffic port: the admin API is "
            f"served on [admin] listen {admin} (narwhal admin --url {admin})\n")
    finally:
        router.shutdown(0)


async def test_without_a_token_startup_warns_naming_the_risk(nursery, tmp_path, caplog):
    router, url = await start_router(nursery, config_text(f'[handoff]\npath = "{tmp_path}/h.json"\n'))
    router.shutdown(0)
    [warning] = events(caplog, "admin_unauthenticated")
    assert warning["level"] == "warning"
    assert "no [admin] token" in warning["message"] and "drain" in warning["message"]
    assert warning["listen"].startswith("the serving address")


# -- 13. a request that comes back to the router that sent it -------------------------------------------


class _Target:
    """The router's port, known only once it has started; the relay waits for it (its health checks come first)."""

    def __init__(self) -> None:
        self.port = 0
        self.known = trio.Event()

    def set(self, port: int) -> None:
        self.port = port
        self.known.set()


async def forward(target: _Target, client: trio.SocketStream) -> None:
    """A plain TCP relay to the router: the loop the static check cannot see (a proxy, a load balancer)."""
    await target.known.wait()
    async with client, await trio.open_tcp_stream("127.0.0.1", target.port) as upstream:
        async def pump(src: trio.SocketStream, dst: trio.SocketStream) -> None:
            try:
                while data := await src.receive_some(65536):
                    await dst.send_all(data)
                await dst.send_eof()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        async with trio.open_nursery() as pumps:
            pumps.start_soon(pump, client, upstream)
            pumps.start_soon(pump, upstream, client)


async def test_an_engine_url_leading_back_to_the_router_is_refused_once_not_fanned_out(nursery, tmp_path, caplog):
    target = _Target()
    listeners = await nursery.start(functools.partial(trio.serve_tcp, functools.partial(forward, target), 0,
                                                      host="127.0.0.1"))
    relay_port = listeners[0].socket.getsockname()[1]
    router, url = await start_router(nursery, config_text(
        f'[serving]\ncount_tokens = false\n[handoff]\npath = "{tmp_path}/h.json"\n',
        prefill_port=relay_port, decode_port=relay_port))
    target.set(router.bound_port)
    try:
        async with httpx.AsyncClient(timeout=20) as client:
            response = await client.post(f"{url}/v1/completions",
                                         json={"model": "mock-model", "prompt": "hi", "max_tokens": 2})
    finally:
        router.shutdown(0)
    assert response.status_code == 502
    assert "request loop detected" in response.json()["error"]["message"]
    # One nested request came back and was refused: no fan-out.
    [loop] = [e for e in events(caplog, "request_loop") if e["path"] == "/v1/completions"]
    assert router.via_token in loop["via"]
    assert [e["status"] for e in events(caplog, "request")] == [502]


# -- issue 19 item 12: the admin listener has its own connection cap and head timeout --------------------


async def test_a_connection_flood_on_the_admin_listener_is_capped_and_cut_at_its_head_timeout(
        nursery, tmp_path, autojump_clock):
    admin_port = free_port()
    router, url = await start_router(nursery, config_text(
        f'[admin]\nlisten = "127.0.0.1:{admin_port}"\ntoken = "s3cret"\nmax_connections = 4\n'
        f'header_timeout_s = 2.0\n[handoff]\npath = "{tmp_path}/h.json"\n'))
    admin = router.admin_server
    assert admin is not None
    flood = []
    try:
        start = trio.current_time()
        for _ in range(60):
            flood.append(await trio.open_tcp_stream("127.0.0.1", admin_port))
        assert admin.statistics().connections_open <= 4 + 16
        answers = []
        for stream in flood:
            raw = b""
            with trio.fail_after(10):
                while data := await stream.receive_some(65536):
                    raw += data
            answers.append(raw)
        # Every connection past the cap and its 16 overflow slots was answered 503 and closed unread ...
        assert sum(raw.startswith(b"HTTP/1.1 503") for raw in answers) == 60 - 20
        # ... and the silent ones held their slots no longer than admin.header_timeout_s.
        assert answers.count(b"") == 20
        assert trio.current_time() - start <= 2.0 + 1.0
        assert admin.statistics().connections_open == 0
        # And the admin API answers again.
        stream = await trio.open_tcp_stream("127.0.0.1", admin_port)
        await stream.send_all(b"GET /admin/engines HTTP/1.1\r\nhost: x\r\nauthorization: Bearer s3cret\r\n"
                              b"connection: close\r\n\r\n")
        raw = b""
        with trio.fail_after(10):
            while data := await stream.receive_some(65536):
                raw += data
        assert raw.startswith(b"HTTP/1.1 200")
        flood.append(stream)
    finally:
        for stream in flood:
            await trio.aclose_forcefully(stream)
        router.shutdown(0)


def test_the_admin_listener_bounds_are_config_keys_with_defaults():
    config = parse_config(config_text(""))
    assert (config.admin.max_connections, config.admin.header_timeout_s) == (64, 5.0)
    with pytest.raises(ConfigError, match="admin: max_connections must be > 0, got 0"):
        parse_config(config_text("[admin]\nmax_connections = 0\n"))


# -- a restart without --resume over a handoff holding drains -----------------------------------------


async def drained_handoff(path: Path, text: str) -> None:
    """The handoff a router of ``text`` writes with p1 drained and d1 in maintenance."""
    from narwhal.fleet import Fleet, HoldKind
    from narwhal.stages.persistence import HandoffExtra, PersistenceStage

    config = parse_config(text)
    fleet = Fleet([(spec.name, spec.role) for spec in config.engines], eject_after=3, liveness_misses=3,
                  failure_quarantine_s=None, probe_interval_s=5.0)
    fleet.add_hold("p1", HoldKind.OPERATOR_DRAIN, "operator drain", 1.0)
    fleet.add_hold("d1", HoldKind.MAINTENANCE, "maintenance", 1.0)
    await PersistenceStage(path=path, router_id="before", fleet=fleet, config=config,
                           extra=lambda: HandoffExtra(drained=["p1"])).run(1)


@pytest.mark.parametrize("resume", [False, True])
async def test_a_start_without_resume_warns_naming_the_dropped_drains_and_the_flag(nursery, tmp_path, caplog,
                                                                                  resume):
    text = config_text(f'[admin]\ntoken = "t"\n[handoff]\npath = "{tmp_path}/h.json"\n')
    await drained_handoff(tmp_path / "h.json", text)
    router = Router(parse_config(text), listen="127.0.0.1:0", resume=resume)
    with trio.fail_after(20):
        await nursery.start(router.run)
    router.shutdown(0)
    dropped = events(caplog, "handoff_drains_dropped")
    if resume:
        assert dropped == [] and len(events(caplog, "handoff_applied")) == 1
        return
    [warning] = dropped
    assert warning["level"] == "warning" and warning["engines"] == ["d1", "p1"]
    assert warning["holds"] == {"d1": ["maintenance"], "p1": ["operator_drain"]}
    assert "--resume" in warning["message"] and warning["path"] == str(tmp_path / "h.json")


async def test_a_start_without_resume_and_without_a_handoff_says_nothing(nursery, tmp_path, caplog):
    router = Router(parse_config(config_text(f'[admin]\ntoken = "t"\n[handoff]\npath = "{tmp_path}/h.json"\n')),
                    listen="127.0.0.1:0")
    with trio.fail_after(20):
        await nursery.start(router.run)
    router.shutdown(0)
    assert events(caplog, "handoff_drains_dropped") == [] and events(caplog, "router_started")
