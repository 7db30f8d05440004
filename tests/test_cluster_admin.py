"""The cluster's admin surface: ``/admin/cluster``, the replica's 409 on admin mutations, ``/cluster/evidence``.

A real Router's control app (built from a config, no I/O) driven with quart's test client; the router's
cluster methods are replaced per test where the cluster's core would answer. The peer-certificate flag is
checked through the real HTTP/1.1 server over mutual TLS.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio
import trio.testing
import trustme

from narwhal.cluster.records import ClusterRouter, ClusterView, ControllerRef
from narwhal.config import parse_config
from narwhal.http1.asgi import ASGILifespan
from narwhal.http1.protocol import Request
from narwhal.router import Router
from narwhal.serving.front import is_admin_path
from narwhal.workers.process import WorkerSet
from narwhal.workers.protocol import Forward, ForwardReply
from tests.test_config import GOOD
from tests.test_http1_asgi import served
from tests.test_worker_process import FakeLink, worker

TOKEN = "s3cret-token"
CONTROLLER = ControllerRef(router_id="r1", cluster_url="https://10.0.0.5:9000")
MUTATIONS = [("POST", "/admin/engines/d1/drain"), ("POST", "/admin/engines/d1/maintenance"),
             ("POST", "/admin/engines/d1/readmit"), ("POST", "/admin/reload")]


@pytest.fixture
async def make_router(tmp_path: Path) -> AsyncIterator[Any]:
    routers: list[Router] = []

    def make(extra: str = "") -> Router:
        config = parse_config(GOOD + f'\n[handoff]\npath = "{tmp_path / "handoff.json"}"\n' + extra)
        router = Router(config, config_path=tmp_path / "narwhal.toml")
        routers.append(router)
        return router

    yield make
    for router in routers:
        await router.control_pool.aclose()
        await router.data_plane.data_pool.aclose()


def holds(router: Router, name: str) -> list[str]:
    return [str(hold.kind) for hold in router.fleet.view(name, 0.0).holds]


# ----- GET /admin/cluster ---------------------------------------------------------------------------------


async def test_admin_cluster_answers_this_router_alone_in_standby_mode(make_router) -> None:
    router = make_router('[lease]\nrouter_id = "solo"\nadvertise_url = "http://10.0.0.9:8000"\n')
    response = await router.app.test_client().get("/admin/cluster")
    assert response.status_code == 200
    assert await response.get_json() == {
        "mode": "standby", "router_id": "solo", "role": "controller", "controller": "solo", "fleet_revision": 0,
        "view_age_s": None, "stale": False,
        "routers": [{"router_id": "solo", "role": "controller", "advertise_url": "http://10.0.0.9:8000",
                     "fleet_revision": 0, "lag_s": 0.0, "cluster_url": "http://10.0.0.9:8000", "is_self": True}]}


async def test_admin_cluster_answers_the_routers_view_as_json(make_router, monkeypatch) -> None:
    router = make_router()
    view = ClusterView(mode="replicas", router_id="r2", role="replica", controller="r1", fleet_revision=41,
                       view_age_s=0.4, stale=False, routers=[
                           ClusterRouter(router_id="r1", role="controller", advertise_url="http://a:8000",
                                         fleet_revision=41, lag_s=0.0),
                           ClusterRouter(router_id="r2", role="replica", advertise_url="http://b:8000",
                                         fleet_revision=40, lag_s=0.2, is_self=True)])
    async def cluster_view() -> ClusterView:
        return view

    monkeypatch.setattr(router, "cluster_view", cluster_view)
    response = await router.app.test_client().get("/admin/cluster")
    assert response.status_code == 200
    assert msgspec.json.decode(await response.get_data(), type=ClusterView) == view


async def test_admin_cluster_takes_no_query_parameter_and_needs_the_token(make_router) -> None:
    router = make_router(f'[admin]\ntoken = "{TOKEN}"\n')
    client = router.app.test_client()
    assert (await client.get("/admin/cluster")).status_code == 401
    auth = {"authorization": f"Bearer {TOKEN}"}
    assert (await client.get("/admin/cluster?x=1", headers=auth)).status_code == 400
    assert (await client.get("/admin/cluster", headers=auth)).status_code == 200


# ----- admin mutations on a replica ------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path"), MUTATIONS)
async def test_an_admin_mutation_on_a_replica_is_409_naming_the_controller_and_changes_nothing(
        make_router, monkeypatch, method: str, path: str) -> None:
    router = make_router()
    monkeypatch.setattr(router, "controller_redirect", lambda: CONTROLLER)

    async def no_reload() -> None:
        raise AssertionError("a replica must not reload on an admin call")

    monkeypatch.setattr(router, "reload", no_reload)
    response = await router.app.test_client().open(path, method=method)
    assert response.status_code == 409
    assert await response.get_json() == {
        "error": {"message": "this router is a replica: drains and reloads are decided by the controller r1 at "
                             "https://10.0.0.5:9000; send it there (narwhal admin follows this answer)",
                  "type": "invalid_request_error", "code": "not_controller"},
        "controller": {"router_id": "r1", "cluster_url": "https://10.0.0.5:9000"}}
    assert holds(router, "d1") == []


@pytest.mark.parametrize("method", ["PUT", "PATCH", "DELETE"])
async def test_every_mutating_method_under_admin_is_refused_on_a_replica(make_router, monkeypatch,
                                                                         method: str) -> None:
    # No route takes these today; a future one is covered by the one guard, not by remembering it.
    router = make_router()
    monkeypatch.setattr(router, "controller_redirect", lambda: CONTROLLER)
    response = await router.app.test_client().open("/admin/engines/d1/holds", method=method)
    assert response.status_code == 409
    assert (await response.get_json())["error"]["code"] == "not_controller"


async def test_reads_on_a_replica_are_served(make_router, monkeypatch) -> None:
    router = make_router()
    monkeypatch.setattr(router, "controller_redirect", lambda: CONTROLLER)
    client = router.app.test_client()
    for path in ("/admin/engines", "/admin/engines/d1", "/admin/cluster", "/admin/lease", "/admin/ui", "/health"):
        assert (await client.get(path)).status_code == 200, path


async def test_the_controller_serves_admin_mutations(make_router, monkeypatch) -> None:
    router = make_router()
    monkeypatch.setattr(router, "controller_redirect", lambda: None)
    response = await router.app.test_client().post("/admin/engines/d1/drain")
    assert response.status_code == 200
    assert holds(router, "d1") == ["operator_drain"]


async def test_an_unauthenticated_caller_gets_401_not_the_controllers_address(make_router, monkeypatch) -> None:
    router = make_router(f'[admin]\ntoken = "{TOKEN}"\n')
    monkeypatch.setattr(router, "controller_redirect", lambda: CONTROLLER)
    client = router.app.test_client()
    assert (await client.post("/admin/reload")).status_code == 401
    response = await client.post("/admin/reload", headers={"authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 409


async def test_an_unknown_controller_is_named_so(make_router, monkeypatch) -> None:
    router = make_router()
    monkeypatch.setattr(router, "controller_redirect", lambda: ControllerRef(router_id="", cluster_url=""))
    body = await (await router.app.test_client().post("/admin/reload")).get_json()
    assert body["controller"] == {"router_id": "", "cluster_url": ""}
    assert "controller (not registered yet) at (unknown)" in body["error"]["message"]


# ----- POST /cluster/evidence ------------------------------------------------------------------------------


async def test_cluster_evidence_is_404_outside_replicas_mode(make_router) -> None:
    router = make_router()
    response = await router.app.test_client().post("/cluster/evidence", data=b"{}")
    assert response.status_code == 404
    assert await response.get_json() == {"error": {"message": "this router is not in replicas mode",
                                                   "type": "invalid_request_error", "code": "not_found"}}


def recording(router: Router, monkeypatch: pytest.MonkeyPatch, answer: tuple[int, bytes]) -> list[Any]:
    calls: list[Any] = []

    def cluster_evidence(body: bytes, *, authorization: str | None, peer_cert: bool,
                         peer: str = "") -> tuple[int, bytes]:
        calls.append((body, authorization, peer_cert))
        return answer

    monkeypatch.setattr(router, "cluster_evidence", cluster_evidence)
    return calls


async def test_cluster_evidence_passes_the_request_through_and_answers_the_routers_reply(
        make_router, monkeypatch) -> None:
    # The admin token is not the link's: the router authenticates the peer (cluster token or mutual TLS).
    router = make_router(f'[admin]\ntoken = "{TOKEN}"\n')
    calls = recording(router, monkeypatch, (401, b'{"error":{"code":"unauthorized"}}'))
    client = router.app.test_client()
    body = b'{"router_id":"r2","evidence":[]}'
    response = await client.post("/cluster/evidence", data=body, headers={"authorization": "Bearer link-token"})
    assert response.status_code == 401
    assert response.content_type == "application/json"
    assert await response.get_data() == b'{"error":{"code":"unauthorized"}}'
    response = await client.post("/cluster/evidence", data=b"")
    assert calls == [(body, "Bearer link-token", False), (b"", None, False)]


async def test_cluster_evidence_is_served_on_a_replica_too(make_router, monkeypatch) -> None:
    # Not under /admin/: the not_controller guard does not apply (the router decides what a replica answers).
    router = make_router()
    monkeypatch.setattr(router, "controller_redirect", lambda: CONTROLLER)
    recording(router, monkeypatch, (200, b'{"ok":true}'))
    assert (await router.app.test_client().post("/cluster/evidence", data=b"{}")).status_code == 200


def _tls(*, client_ca: bool) -> tuple[trustme.CA, ssl.SSLContext]:
    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server)
    if client_ca:
        ca.configure_trust(server)
        server.verify_mode = ssl.CERT_REQUIRED
    return ca, server


@pytest.mark.parametrize("mutual", [True, False])
async def test_cluster_evidence_says_whether_the_tls_peer_presented_a_verified_certificate(
        make_router, monkeypatch, mutual: bool) -> None:
    router = make_router()
    calls = recording(router, monkeypatch, (200, b"{}"))
    ca, server = _tls(client_ca=mutual)
    client = ssl.create_default_context()
    ca.configure_trust(client)
    if mutual:
        ca.issue_cert("router-r2").configure_cert(client)
    async with served(router.app, server) as port, httpx.AsyncClient(verify=client, timeout=5.0) as http:
        response = await http.post(f"https://127.0.0.1:{port}/cluster/evidence", content=b"{}")
    assert response.status_code == 200
    assert calls == [(b"{}", None, mutual)]


async def test_plain_http_never_claims_a_peer_certificate(make_router, monkeypatch) -> None:
    router = make_router()
    calls = recording(router, monkeypatch, (200, b"{}"))
    async with served(router.app) as port, httpx.AsyncClient(timeout=5.0) as http:
        await http.post(f"http://127.0.0.1:{port}/cluster/evidence", content=b"{}")
    assert calls == [(b"{}", None, False)]


# ----- where the link is served ----------------------------------------------------------------------------


@pytest.mark.parametrize(("target", "listener_only"), [
    (b"/cluster/evidence", True), (b"//cluster/evidence", True), (b"http://h/cluster/evidence", True),
    (b"/cluster", True), (b"/admin/cluster", True), (b"/clusters", False), (b"/v1/cluster", False)])
def test_with_admin_listen_the_traffic_port_leaves_the_link_to_the_admin_listener(target: bytes,
                                                                                 listener_only: bool) -> None:
    assert is_admin_path(Request(b"POST", target)) is listener_only


# ----- with serving.workers > 1: a worker forwards the link to the controller --------------------------------


class _CertifiedAnswer:
    """A worker's client connection: TLS with a verified client certificate; keeps the one response."""

    secure = True
    peer_certified = True

    def __init__(self) -> None:
        self.status = 0
        self.body = b""

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.status, self.body = status, body


async def test_a_worker_forwards_cluster_evidence_with_the_peer_certificate_flag(make_router, monkeypatch) -> None:
    link = FakeLink()
    w = worker(link)
    answer = _CertifiedAnswer()
    request = Request(b"POST", b"/cluster/evidence", headers=[(b"host", b"x"), (b"authorization", b"Bearer t")],
                      body=b'{"e":1}')
    async with trio.open_nursery() as nursery:
        nursery.start_soon(w._serve_rest, request, answer)
        await trio.testing.wait_all_tasks_blocked()
        forward = link.sent[-1]
        assert isinstance(forward, Forward) and forward.target == b"/cluster/evidence"
        assert forward.secure and forward.peer_cert
        # The controller answers it through its control app, the flag carried into the scope.
        router = make_router()
        calls = recording(router, monkeypatch, (202, b'{"applied":1}'))
        workers = WorkerSet.__new__(WorkerSet)
        workers.config, workers.app = router.config, router.app
        controller_link = FakeLink()
        async with ASGILifespan(router.app):
            await workers._answer_forward(controller_link, forward)  # type: ignore[arg-type]
        reply, = controller_link.sent
        assert isinstance(reply, ForwardReply) and reply.status == 202
        w.on_message(reply)
    assert calls == [(b'{"e":1}', "Bearer t", True)]
    assert (answer.status, answer.body) == (202, b'{"applied":1}')


async def test_a_replicas_link_presents_its_serving_certificate_to_a_mutual_tls_controller(
        make_router, monkeypatch, tmp_path: Path) -> None:
    from narwhal.cluster.link import EvidenceSender, link_ssl_context
    from narwhal.cluster.records import EvidenceItem

    router = make_router()
    calls = recording(router, monkeypatch, (200, b'{"controller": "r1"}'))
    ca, server = _tls(client_ca=True)
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    mine = ca.issue_cert("router-r2")
    mine.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    mine.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    replica = parse_config(GOOD + '\n[serving]\ntls_cert_file = "cert.pem"\ntls_key_file = "key.pem"\n'
                                  'tls_client_ca_file = "ca.pem"\n')
    context = link_ssl_context(replica, tmp_path)
    assert context is not None
    async with served(router.app, server) as port:
        sender = EvidenceSender(router_id="r2", controller=lambda: None, token=None, apply_placements=None,
                                ssl_context=context)
        sender.report(EvidenceItem("p1", failure_class="connection"))
        assert await sender._send(ControllerRef(router_id="r1", cluster_url=f"https://127.0.0.1:{port}"))
        await sender.aclose()
    assert len(calls) == 1 and calls[0][2] is True  # the controller saw a verified client certificate
