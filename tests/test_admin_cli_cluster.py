"""``narwhal admin`` with several routers: the cluster table, and a replica's 409 followed once to the controller.

Against a fake router (``httpx.MockTransport``): the request's host says which router it reached; then once
against two routers serving on 127.0.0.1 (the replica's ``controller_redirect`` names the other).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from test_admin_api import TOKEN, admin_router, fleet_config, start_mock_fleet
from test_admin_cli import engine, fake_router, run, serving

from narwhal.cluster.records import ControllerRef
from narwhal.tools.admin_cli import TOKEN_ENV, format_cluster

REPLICA = "http://10.0.0.6:9000"
CONTROLLER_URL = "https://10.0.0.5:9000"


def not_controller(router_id: str = "r1", cluster_url: str = CONTROLLER_URL) -> httpx.Response:
    message = (f"this router is a replica: drains and reloads are decided by the controller {router_id} at "
               f"{cluster_url}; send it there (narwhal admin follows this answer)")
    return httpx.Response(409, json={
        "error": {"message": message, "type": "invalid_request_error", "code": "not_controller"},
        "controller": {"router_id": router_id, "cluster_url": cluster_url}})


@pytest.fixture(autouse=True)
def _no_token_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)


# ----- a replica's 409 -----------------------------------------------------------------------------------------


def test_a_drain_sent_to_a_replica_is_sent_once_to_the_controller_with_the_same_token() -> None:
    seen: list[tuple[str, str, str, str | None]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, str(request.url.copy_with(path="/")).rstrip("/"), request.url.path,
                     request.headers.get("authorization")))
        if request.url.host == "10.0.0.6":
            return not_controller()
        return httpx.Response(200, json={"action": "drain", "engine": engine("d1")})

    code, out, err = run(["drain", "d1", "--url", REPLICA, "--token", "t0k"], fake_router(handler))
    assert code == 0
    assert out.startswith("d1: drain requested;")
    assert err == f"narwhal admin: {REPLICA} is a replica; sent to the controller r1 at {CONTROLLER_URL}\n"
    assert seen == [("POST", REPLICA, "/admin/engines/d1/drain", "Bearer t0k"),
                    ("POST", CONTROLLER_URL, "/admin/engines/d1/drain", "Bearer t0k")]


def test_a_reload_follows_too() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "10.0.0.6":
            return not_controller()
        assert request.method == "POST" and request.url.path == "/admin/reload"
        return httpx.Response(200, json={"file": "/etc/narwhal.toml", "reloaded": True, "changes": {},
                                         "tls": "skipped"})

    code, out, err = run(["reload", "--url", REPLICA], fake_router(handler))
    assert code == 0 and out.startswith("reloaded /etc/narwhal.toml")
    assert "is a replica; sent to the controller r1" in err


def test_a_second_not_controller_is_the_error_not_followed_again() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url.host))
        # Every router says another is the controller (a lease changing hands, or a misconfigured one).
        return not_controller("r0", REPLICA) if request.url.host == "10.0.0.5" else not_controller()

    code, out, err = run(["drain", "d1", "--url", REPLICA], fake_router(handler))
    assert code == 1 and out == ""
    assert seen == ["10.0.0.6", "10.0.0.5"]
    first, second = err.splitlines()
    assert first == f"narwhal admin: {REPLICA} is a replica; sent to the controller r1 at {CONTROLLER_URL}"
    assert second == (f"narwhal admin: HTTP 409: this router is a replica: drains and reloads are decided by the "
                      f"controller r0 at {REPLICA}; send it there (narwhal admin follows this answer)")


@pytest.mark.parametrize("cluster_url", ["", "ftp://10.0.0.5/"])
def test_a_409_without_a_usable_controller_url_is_printed_not_followed(cluster_url: str) -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        return not_controller("", cluster_url)

    code, _, err = run(["maintenance", "d1", "--url", REPLICA], fake_router(handler))
    assert code == 1 and len(seen) == 1
    assert err.startswith("narwhal admin: HTTP 409: this router is a replica:") and err.count("\n") == 1


def test_other_409s_are_not_followed() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        return httpx.Response(409, json={"error": {"message": "readmission of d1 refused by check health: no",
                                                   "code": "readmission_refused"},
                                         "controller": {"router_id": "r1", "cluster_url": CONTROLLER_URL}})

    code, _, err = run(["readmit", "d1", "--url", REPLICA], fake_router(handler))
    assert code == 1 and len(seen) == 1
    assert err == "narwhal admin: HTTP 409: readmission of d1 refused by check health: no\n"


def test_an_unreachable_controller_is_named_in_the_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "10.0.0.6":
            return not_controller()
        raise httpx.ConnectError("connection refused")

    code, _, err = run(["drain", "d1", "--url", REPLICA], fake_router(handler))
    assert code == 1
    assert err.splitlines()[1] == f"narwhal admin: cannot reach {CONTROLLER_URL}: connection refused"


# ----- narwhal admin cluster -------------------------------------------------------------------------------------

VIEW: dict[str, Any] = {
    "mode": "replicas", "router_id": "r2", "role": "replica", "controller": "r1", "fleet_revision": 41,
    "view_age_s": 0.42, "stale": False,
    "routers": [
        {"router_id": "r1", "role": "controller", "advertise_url": "https://10.0.0.5:8443", "fleet_revision": 41,
         "lag_s": 0.0, "cluster_url": CONTROLLER_URL, "is_self": False},
        {"router_id": "r2", "role": "replica", "advertise_url": "https://10.0.0.6:8443", "fleet_revision": 40,
         "lag_s": 0.25, "cluster_url": REPLICA, "is_self": True},
    ]}


def test_admin_cluster_prints_this_routers_view_then_a_row_per_router() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        assert (request.method, request.url.path) == ("GET", "/admin/cluster")
        return httpx.Response(200, json=VIEW)

    code, out, err = run(["cluster"], fake_router(handler))
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == "cluster: mode replicas, this router r2 (replica), controller r1, view age 0.4 s, stale no"
    assert lines[1] == ""
    assert lines[2].split() == ["ROUTER", "ROLE", "ADVERTISE_URL", "FLEET_REVISION", "LAG_S"]
    assert lines[3].split() == ["r1", "controller", "https://10.0.0.5:8443", "41", "0.0"]
    assert lines[4].split() == ["*", "r2", "replica", "https://10.0.0.6:8443", "40", "0.2"]
    # Columns line up: the * sits in a column of its own.
    column = lines[2].index("ROUTER")
    assert lines[3][column:].startswith("r1") and lines[4][column:].startswith("r2")
    assert len(lines) == 5


def test_admin_cluster_on_a_controller_and_a_stale_replica() -> None:
    controller = {**VIEW, "router_id": "r1", "role": "controller", "view_age_s": None}
    assert format_cluster(controller).splitlines()[0] == (
        "cluster: mode replicas, this router r1 (controller), controller r1, view age -, stale no")
    stale = {**VIEW, "controller": None, "view_age_s": 31.0, "stale": True, "routers": []}
    assert format_cluster(stale).splitlines()[0] == (
        "cluster: mode replicas, this router r2 (replica), controller -, view age 31.0 s, stale yes")


def test_admin_cluster_json_prints_the_answer_as_it_came() -> None:
    code, out, _ = run(["cluster", "--json"], fake_router(lambda request: httpx.Response(200, json=VIEW)))
    assert code == 0 and json.loads(out) == VIEW


# ----- against running routers ----------------------------------------------------------------------------------


async def test_a_drain_sent_to_a_running_replica_lands_on_the_running_controller(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    mocks = await start_mock_fleet(nursery)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    controller = admin_router(fleet_config(mocks, tmp_path / "a", token=TOKEN), listen="127.0.0.1:0")
    replica = admin_router(fleet_config(mocks, tmp_path / "b", token=TOKEN), listen="127.0.0.1:0")
    async with serving(controller) as controller_url, serving(replica) as replica_url:
        replica.controller_redirect = lambda: ControllerRef(  # type: ignore[method-assign]
            router_id=controller.router_id, cluster_url=controller_url)
        code, out, err = await trio.to_thread.run_sync(
            run, ["drain", "d1", "--url", replica_url, "--token", TOKEN])
        assert code == 0, err
        assert out.startswith("d1: drain requested;")
        assert err == (f"narwhal admin: {replica_url} is a replica; sent to the controller {controller.router_id} "
                       f"at {controller_url}\n")
        assert controller.readmitter.drained("d1") and not replica.readmitter.drained("d1")
        code, out, err = await trio.to_thread.run_sync(run, ["cluster", "--url", replica_url, "--token", TOKEN])
        assert code == 0, err
        assert out.splitlines()[0].startswith(f"cluster: mode standby, this router {replica.router_id} ")
    mocks.stop_all()
