"""``python -m narwhal admin``: the table, the actions' results, and one line and exit 1 on every failure.

Formatting and exit codes are checked against a fake router (``httpx.MockTransport``);
then the commands run against a real Router serving on 127.0.0.1 with mock
engines in this process (the blocking CLI in a worker thread), and once as
``python -m narwhal admin`` in a subprocess.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trustme
from test_admin_api import TOKEN, MockFleet, admin_router, fleet_config, start_mock_fleet

from narwhal.config import load_config
from narwhal.router import Router
from narwhal.tools.admin_cli import TOKEN_ENV, add_parser, format_engines


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="narwhal")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def run(argv: list[str], transport: httpx.BaseTransport | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    args = parse(["admin", *argv])
    code = args.run(args, transport=transport, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def engine(name: str, role: str = "decode", **fields: Any) -> dict[str, Any]:
    base = {"name": name, "role": role, "eligible": True, "ejected": False, "ejected_reason": None,
            "holds": [], "evidence": {"connection": 0, "timeout": 0}, "liveness_misses": 0, "in_flight": 0,
            "drained": False, "maintenance_started_at": None, "last_readmission": None}
    return {**base, **fields}


def fake_router(handler: Callable[[httpx.Request], httpx.Response]) -> httpx.MockTransport:
    return httpx.MockTransport(handler)


# ----- arguments ------------------------------------------------------------------------------


def test_url_and_token_go_before_or_after_the_action(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    args = parse(["admin", "--url", "http://127.0.0.1:9", "drain", "d1", "--token", "t"])
    assert (args.url, args.token, args.action, args.name) == ("http://127.0.0.1:9", "t", "drain", "d1")
    args = parse(["admin", "readmit", "d1"])
    assert (args.url, args.token) == ("http://127.0.0.1:8000", None)
    with pytest.raises(SystemExit):
        parse(["admin", "drain"])  # NAME is required


def test_the_token_defaults_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str | None] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return httpx.Response(200, json={"engines": []})

    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert run(["engines"], fake_router(handler))[0] == 0
    assert run(["engines", "--token", "given"], fake_router(handler))[0] == 0
    monkeypatch.delenv(TOKEN_ENV)
    assert run(["engines"], fake_router(handler))[0] == 0
    assert seen == ["Bearer from-env", "Bearer given", None]


# ----- output -----------------------------------------------------------------------------------


def test_engines_prints_a_table_with_state_holds_streaks_and_in_flight() -> None:
    engines = [
        engine("p1", "prefill", in_flight=3),
        engine("d1", eligible=False, drained=True,
               holds=[{"kind": "operator_drain", "reason": "operator drain"}]),
        engine("d2", eligible=False, ejected=True, ejected_reason="connection streak reached 3",
               evidence={"connection": 3, "timeout": 0}, liveness_misses=2,
               last_readmission={"outcome": "refused", "check": "health", "operator": False, "at": 0.0,
                                 "reason": "GET /health answered HTTP 503"}),
        engine("d3", eligible=False, holds=[{"kind": "maintenance", "reason": "planned maintenance"}],
               in_flight=1, maintenance_started_at=60.0),
    ]
    lines = format_engines(engines).splitlines()
    assert lines[0].split() == ["NAME", "ROLE", "STATE", "HOLDS", "STREAKS", "IN", "FLIGHT"]
    assert lines[1].split() == ["p1", "prefill", "eligible", "-", "-", "3"]
    assert lines[2].split() == ["d1", "decode", "drained", "operator_drain", "-", "0"]
    assert lines[3].split() == ["d2", "decode", "ejected", "-", "connection=3,", "liveness=2", "0"]
    assert lines[4].split() == ["d3", "decode", "draining", "maintenance", "-", "1"]
    # Columns line up: every row's STATE starts where the header's does.
    column = lines[0].index("STATE")
    assert all(line[column - 2:column] == "  " and line[column] != " " for line in lines[1:5])
    notes = lines[6:]
    assert "d2: ejected: connection streak reached 3" in notes
    assert ("d2: last readmission refused at 1970-01-01 00:00:00Z (automatic) by check health: "
            "GET /health answered HTTP 503") in notes
    assert "d3: maintenance since 1970-01-01 00:01:00Z" in notes


def test_actions_print_their_result() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        action = request.url.path.rsplit("/", 1)[1]
        assert request.method == "POST"
        body: dict[str, Any] = {"action": action, "engine": engine("d1", in_flight=2)}
        if action == "maintenance":
            body["maintenance_started_at"] = 0.0
        if action == "readmit":
            body["readmission"] = {"outcome": "readmitted", "passed": ["health", "final_health"]}
        return httpx.Response(200, json=body)

    code, out, _ = run(["drain", "d1"], fake_router(handler))
    assert code == 0
    assert out == "d1: drain requested; draining: 2 request(s) in flight will finish; " \
                  "undo with: narwhal admin readmit d1\n"
    code, out, _ = run(["maintenance", "d1"], fake_router(handler))
    assert code == 0 and out.startswith("d1: maintenance started 1970-01-01 00:00:00Z;")
    assert "restart the engine, then run: narwhal admin readmit d1" in out
    code, out, _ = run(["readmit", "d1"], fake_router(handler))
    assert (code, out) == (0, "d1: readmitted (passed: health, final_health); state eligible\n")


@pytest.mark.parametrize(("status", "body", "words"), [
    (401, {"error": {"message": "admin API needs a valid bearer token", "type": "authentication_error"}},
     "HTTP 401: admin API needs a valid bearer token (pass --token or set NARWHAL_ADMIN_TOKEN)"),
    (404, {"error": {"message": "no engine named 'd9'", "type": "invalid_request_error",
                     "code": "engine_not_found"}},
     "HTTP 404: no engine named 'd9'"),
    # Not a router's admin API (the traffic port of one with [admin] listen set, or something else).
    (404, None, "HTTP 404: Not Found (no admin API at http://127.0.0.1:8000: if the router sets [admin] listen, "
                "pass --url ADMIN_ADDRESS)"),
    (404, {"error": {"message": "no route for POST /admin/engines/d9/readmit", "code": "not_found"}},
     "HTTP 404: no route for POST /admin/engines/d9/readmit (no admin API at http://127.0.0.1:8000: if the "
     "router sets [admin] listen, pass --url ADMIN_ADDRESS)"),
    (409, {"error": {"message": "readmission of d9 refused by check newer_process: restart the engine"},
           "readmission": {"check": "newer_process"}},
     "HTTP 409: readmission of d9 refused by check newer_process: restart the engine"),
    (500, None, "HTTP 500: Internal Server Error"),
])
def test_a_failure_exits_1_with_one_line(status: int, body: Any, words: str) -> None:
    transport = fake_router(lambda request: httpx.Response(status, json=body) if body
                            else httpx.Response(status))
    code, out, err = run(["readmit", "d9"], transport)
    assert code == 1 and out == ""
    assert err == f"narwhal admin: {words}\n"


def test_an_unreachable_router_exits_1_with_one_line() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    code, out, err = run(["engines", "--url", "http://127.0.0.1:9"], fake_router(refuse))
    assert (code, out) == (1, "")
    assert err == "narwhal admin: cannot reach http://127.0.0.1:9: [Errno 111] Connection refused\n"


# ----- against a running router -------------------------------------------------------------


@contextlib.asynccontextmanager
async def serving(router: Router) -> AsyncIterator[str]:
    """Run ``router`` on 127.0.0.1 and yield its URL; shut it down gracefully and wait for it."""
    async with trio.open_nursery() as nursery:
        port = await nursery.start(router.run)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            router.shutdown(0)


async def test_an_operator_drains_maintains_and_readmits_with_the_cli_alone(
        nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    mocks = await start_mock_fleet(nursery)
    router = admin_router(fleet_config(mocks, tmp_path, token=TOKEN), listen="127.0.0.1:0")
    async with serving(router) as url:
        await drain_maintain_and_readmit(router, mocks, url)
    mocks.stop_all()


async def drain_maintain_and_readmit(router: Router, mocks: MockFleet, url: str) -> None:
    async def cli(*argv: str) -> tuple[int, str, str]:
        return await trio.to_thread.run_sync(run, [*argv, "--url", url, "--token", TOKEN])

    code, out, err = await cli("drain", "d1")
    assert code == 0, err
    assert out.startswith("d1: drain requested; drained: nothing in flight")
    code, out, _ = await cli("engines")
    assert code == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:4]}
    assert rows["d1"][:4] == ["d1", "decode", "drained", "operator_drain"]
    assert rows["d2"][2] == "eligible"

    code, out, err = await cli("maintenance", "d2")
    assert code == 0, err
    code, out, err = await cli("readmit", "d2")
    assert (code, out) == (1, "")
    assert err.startswith("narwhal admin: HTTP 409: readmission of d2 refused by check newer_process: ")
    assert err.count("\n") == 1

    started_at = router.readmitter.maintenance_started_at("d2")
    assert started_at is not None
    await mocks.restart("d2", started_at=started_at + 1.0)
    for name in ("d1", "d2"):
        code, out, err = await cli("readmit", name)
        assert code == 0, err
        assert out.startswith(f"{name}: readmitted (passed: health, attestation")
    assert sorted(router.fleet.eligible("decode", trio.current_time())) == ["d1", "d2"]

    code, _, err = await trio.to_thread.run_sync(run, ["engines", "--url", url, "--token", "wrong"])
    assert code == 1 and "HTTP 401" in err
    code, _, err = await cli("drain", "d9")
    assert code == 1 and err == "narwhal admin: HTTP 404: no engine named 'd9'\n"


async def test_python_m_narwhal_admin_dispatches_to_the_admin_cli(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    mocks = await start_mock_fleet(nursery)
    router = admin_router(fleet_config(mocks, tmp_path, token=TOKEN), listen="127.0.0.1:0")
    env = {**os.environ, TOKEN_ENV: TOKEN}
    async with serving(router) as url:
        engines = await trio.run_process([sys.executable, "-m", "narwhal", "admin", "engines", "--url", url],
                                         capture_stdout=True, capture_stderr=True, check=False, env=env)
        unknown = await trio.run_process([sys.executable, "-m", "narwhal", "admin", "readmit", "nope",
                                          "--url", url], capture_stdout=True, capture_stderr=True, check=False,
                                         env=env)
    mocks.stop_all()
    assert engines.returncode == 0, engines.stderr
    assert engines.stdout.decode().splitlines()[0].split()[:3] == ["NAME", "ROLE", "STATE"]
    assert unknown.returncode == 1
    assert unknown.stderr.decode() == "narwhal admin: HTTP 404: no engine named 'nope'\n"


def test_reload_posts_and_prints_what_changed_or_the_refusal() -> None:
    seen: list[tuple[str, str]] = []
    body = {"file": "/etc/narwhal.toml", "reloaded": True, "tls": "skipped",
            "changes": {"engines_added": ["d3"], "engines_removed": ["d1"], "engines_changed": [],
                        "keys_changed": ["recovery.eject_after"], "keys_needing_restart": ["serving.listen"]}}

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.path))
        return httpx.Response(200, json=body)

    code, out, err = run(["reload"], fake_router(answer))
    assert code == 0 and err == "" and seen == [("POST", "/admin/reload")]
    assert out == ("reloaded /etc/narwhal.toml\n  engines added: d3\n  engines removed: d1\n"
                   "  keys changed: recovery.eject_after\n"
                   "  need a restart (running values kept): serving.listen\n")
    code, out, _ = run(["reload"], fake_router(lambda request: httpx.Response(
        200, json={"file": "/etc/narwhal.toml", "reloaded": True, "changes": {}, "tls": "reloaded"})))
    assert out == "reloaded /etc/narwhal.toml\n  nothing changed\n  TLS files: reloaded\n"
    refused = {"error": {"message": "config not reloaded, nothing changed: /etc/narwhal.toml: recovery: "
                                    "eject_after must be > 0, got 0", "code": "config_reload_failed"}}
    code, out, err = run(["reload"], fake_router(lambda request: httpx.Response(422, json=refused)))
    assert code == 1 and out == ""
    assert err == ("narwhal admin: HTTP 422: config not reloaded, nothing changed: /etc/narwhal.toml: "
                   "recovery: eject_after must be > 0, got 0\n")


async def test_a_reload_whose_tls_files_fail_prints_why_and_exits_1(tmp_path: Path) -> None:
    """The router's answer to POST /admin/reload with a broken key file, read by the CLI."""
    cert = trustme.CA().issue_cert("127.0.0.1")
    (tmp_path / "cert.pem").write_bytes(b"".join(blob.bytes() for blob in cert.cert_chain_pems))
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    config_file = tmp_path / "narwhal.toml"
    config_file.write_text(
        f'[serving]\ntls_cert_file = "{tmp_path / "cert.pem"}"\ntls_key_file = "{tmp_path / "key.pem"}"\n'
        f'[handoff]\npath = "{tmp_path / "handoff.json"}"\n'
        '[[engines]]\nname = "p1"\nurl = "http://127.0.0.1:9"\nrole = "prefill"\n'
        '[[engines]]\nname = "d1"\nurl = "http://127.0.0.1:10"\nrole = "decode"\n')
    router = Router(load_config(config_file), config_path=config_file)
    try:
        (tmp_path / "key.pem").write_text("not a key\n")
        response = await router.app.test_client().post("/admin/reload")
        assert response.status_code == 200
        body = await response.get_json()
    finally:
        await router.control_pool.aclose()
        await router.data_plane.data_pool.aclose()  # type: ignore[attr-defined]
    assert body["reloaded"] is True and body["tls"] == "failed"
    reason = f"serving.tls_key_file: '{tmp_path / 'key.pem'}' holds no usable PEM private key (unencrypted keys only)"
    assert body["tls_error"] == reason

    code, out, err = run(["reload"], fake_router(lambda request: httpx.Response(200, json=body)))
    assert code == 1
    assert out == f"reloaded {config_file}\n  nothing changed\n  TLS files: failed: {reason}\n"
    assert err == ("narwhal admin: the TLS files were not reloaded: the router keeps its running certificates "
                   "until a reload reads good files\n")
