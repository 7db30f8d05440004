"""The admin API for drains, maintenance and readmission, through the real app of a real Router.

Mock engines run in this process on 127.0.0.1 (real sockets, real clock);
the router is built from a config naming them (construction does no I/O) and
its quart app is driven with quart's test client. ``MockFleet`` and
``admin_router`` are shared with ``test_admin_cli``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import trio

from narwhal.app.admin_guard import admin_refusal
from narwhal.app.admin_routes import register_admin_routes
from narwhal.config import AdminConfig, Config, EngineSpec, FleetConfig, HandoffConfig
from narwhal.control.readmission import Readmitter
from narwhal.router import Router
from narwhal.tools.mock.engine import MockService, MockSettings, serve_mock
from narwhal.tools.mock.faults import FaultRequest

ATTESTATION_KEY = "narwhal-dev-key"  # the mock engine's default key
TOKEN = "s3cret-token"


class MockFleet:
    """Mock engines served in this process, each restartable as a new process on its own port."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.services: dict[str, MockService] = {}
        self._stopped: dict[str, trio.Event] = {}

    async def start(self, name: str, role: str, *, port: int = 0, **settings: Any) -> MockService:
        stopped = trio.Event()
        mock_settings = MockSettings(role=role, engine_id=name, port=port, **settings)  # type: ignore[arg-type]

        async def serve(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            try:
                await serve_mock(mock_settings, task_status=task_status)
            finally:
                stopped.set()

        self.services[name] = await self.nursery.start(serve)
        self._stopped[name] = stopped
        return self.services[name]

    async def restart(self, name: str, *, started_at: float) -> MockService:
        """Stop ``name`` and start a new process on the same port whose identity says it started at ``started_at``.

        The start time is an input, not the clock: a test says "after the maintenance began" exactly, and
        no sleep has to make the wall clock move past it first.
        """
        old = self.services[name]
        old.stop(0)
        await self._stopped[name].wait()
        return await self.start(name, old.engine.settings.role, port=old.engine.port,
                                process_started_at=started_at)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.services[name].engine.port}"

    def stop_all(self) -> None:
        for service in self.services.values():
            service.stop(0)


async def start_mock_fleet(nursery: trio.Nursery) -> MockFleet:
    fleet = MockFleet(nursery)
    for name, role in (("p1", "prefill"), ("d1", "decode"), ("d2", "decode")):
        await fleet.start(name, role)
    return fleet


def fleet_config(mocks: MockFleet, tmp_path: Path, *, token: str | None = None,
                 allowed_hosts: list[str] | None = None) -> Config:
    admin = AdminConfig(token=token) if allowed_hosts is None else AdminConfig(token=token,
                                                                               allowed_hosts=allowed_hosts)
    return Config(
        fleet=FleetConfig(attestation_key=ATTESTATION_KEY),
        admin=admin,
        handoff=HandoffConfig(path=str(tmp_path / "handoff.json")),
        engines=[EngineSpec(name=name, url=mocks.url(name), role=service.engine.settings.role)
                 for name, service in mocks.services.items()])


def admin_router(config: Config, **kwargs: Any) -> Router:
    """A Router with the readmitter and its admin routes (wired here only if the Router does not yet)."""
    router = Router(config, **kwargs)
    if getattr(router, "readmitter", None) is None:
        router.readmitter = Readmitter(config=config, fleet=router.fleet, control_pool=router.control_pool,
                                       in_flight=router.in_flight, metrics=router.metrics,
                                       attestation_key=config.attestation_key_bytes())
        register_admin_routes(router.app, router)
    return router


class Harness:
    def __init__(self, mocks: MockFleet, router: Router) -> None:
        self.mocks = mocks
        self.router = router
        self.client = router.app.test_client()

    async def post(self, path: str, **kwargs: Any) -> tuple[int, Any]:
        response = await self.client.post(path, **kwargs)
        return response.status_code, await response.get_json()

    async def get(self, path: str, **kwargs: Any) -> tuple[int, Any]:
        response = await self.client.get(path, **kwargs)
        return response.status_code, await response.get_json()

    def eligible(self, role: str, model: str | None = None) -> list[str]:
        return self.router.fleet.eligible(role, trio.current_time())

    def hold_kinds(self, name: str) -> list[str]:
        return [str(hold.kind) for hold in self.router.fleet.view(name, trio.current_time()).holds]


@pytest.fixture
async def harness(nursery: trio.Nursery, tmp_path: Path):
    """``await harness(token=None, allowed_hosts=None)``: mock engines p1, d1, d2 and a router over them."""
    mocks = await start_mock_fleet(nursery)
    routers: list[Router] = []

    async def make(*, token: str | None = None, allowed_hosts: list[str] | None = None) -> Harness:
        router = admin_router(fleet_config(mocks, tmp_path, token=token, allowed_hosts=allowed_hosts))
        routers.append(router)
        return Harness(mocks, router)

    yield make
    for router in routers:
        await router.control_pool.aclose()
        await router.data_plane.data_pool.aclose()
    mocks.stop_all()


async def test_drain_stops_new_placements_and_reports_drained_once_nothing_is_in_flight(harness) -> None:
    h = await harness()
    h.router.in_flight.acquire("d1")

    status, body = await h.post("/admin/engines/d1/drain")
    assert status == 200
    assert body["action"] == "drain"
    engine = body["engine"]
    assert (engine["name"], engine["eligible"], engine["drained"]) == ("d1", False, False)
    assert [hold["kind"] for hold in engine["holds"]] == ["operator_drain"]
    assert h.eligible("decode") == ["d2"]

    h.router.in_flight.release("d1")
    status, body = await h.get("/admin/engines/d1")
    assert status == 200 and body["engine"]["drained"] is True
    status, body = await h.get("/admin/engines")
    [d1] = [e for e in body["engines"] if e["name"] == "d1"]
    assert d1["drained"] is True and d1["last_readmission"] is None


async def test_readmit_runs_the_chain_and_clears_the_drain(harness) -> None:
    h = await harness()
    await h.post("/admin/engines/d1/drain")

    status, body = await h.post("/admin/engines/d1/readmit")
    assert status == 200, body
    assert body["readmission"]["outcome"] == "readmitted"
    assert body["readmission"]["passed"] == ["health", "attestation", "model", "generation", "kv_role",
                                             "final_health"]
    assert body["engine"]["eligible"] is True and body["engine"]["holds"] == []
    assert sorted(h.eligible("decode")) == ["d1", "d2"]
    assert body["engine"]["last_readmission"]["outcome"] == "readmitted"


async def test_a_refused_readmit_is_409_with_the_check_and_why_and_the_drain_stays(harness) -> None:
    h = await harness()
    await h.post("/admin/engines/d1/drain")
    h.mocks.services["d1"].engine.add_fault(FaultRequest(mode="generation", value="g9"))

    status, body = await h.post("/admin/engines/d1/readmit")
    assert status == 409
    assert body["error"]["code"] == "readmission_refused"
    assert "generation" in body["error"]["message"] and "'g9'" in body["error"]["message"]
    assert (body["readmission"]["outcome"], body["readmission"]["check"]) == ("refused", "generation")
    assert "engine reports generation 'g9'" in body["readmission"]["reason"]
    assert h.hold_kinds("d1") == ["operator_drain"]
    assert h.eligible("decode") == ["d2"]
    status, body = await h.get("/admin/engines/d1")
    assert body["engine"]["last_readmission"]["check"] == "generation"


async def test_maintenance_readmit_is_refused_until_the_engine_restarts(harness) -> None:
    h = await harness()
    before = time.time()
    status, body = await h.post("/admin/engines/d1/maintenance")
    assert status == 200
    maintenance_started_at = body["maintenance_started_at"]
    assert before <= maintenance_started_at <= time.time()
    assert body["engine"]["maintenance_started_at"] == pytest.approx(body["maintenance_started_at"])
    assert h.hold_kinds("d1") == ["maintenance"]

    status, body = await h.post("/admin/engines/d1/readmit")
    assert status == 409
    assert body["readmission"]["check"] == "newer_process"
    assert "restart the engine" in body["readmission"]["reason"]
    assert h.hold_kinds("d1") == ["maintenance"]

    # A process that started before the maintenance began is still the old one ...
    await h.mocks.restart("d1", started_at=maintenance_started_at - 1.0)
    status, body = await h.post("/admin/engines/d1/readmit")
    assert status == 409 and body["readmission"]["check"] == "newer_process"
    # ... one started after it is the restart the operator was asked for.
    await h.mocks.restart("d1", started_at=maintenance_started_at + 1.0)
    status, body = await h.post("/admin/engines/d1/readmit")
    assert status == 200, body
    assert "newer_process" in body["readmission"]["passed"]
    assert h.hold_kinds("d1") == [] and "d1" in h.eligible("decode")


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/admin/engines/nope"),
    ("POST", "/admin/engines/nope/drain"),
    ("POST", "/admin/engines/nope/maintenance"),
    ("POST", "/admin/engines/nope/readmit"),
])
async def test_an_unknown_engine_is_a_404_json_error(harness, method: str, path: str) -> None:
    h = await harness()
    response = await h.client.open(path, method=method)
    assert response.status_code == 404
    assert response.content_type == "application/json"
    error = (await response.get_json())["error"]
    assert error == {"message": "no engine named 'nope'", "type": "invalid_request_error",
                     "code": "engine_not_found"}


ADMIN_CALLS = [
    ("GET", "/admin/engines"),
    ("GET", "/admin/engines/d1"),
    ("POST", "/admin/engines/d1/drain"),
    ("POST", "/admin/engines/d1/maintenance"),
    ("POST", "/admin/engines/d1/readmit"),
]


@pytest.mark.parametrize(("method", "path"), ADMIN_CALLS)
async def test_with_a_token_configured_every_admin_call_needs_it(harness, method: str, path: str) -> None:
    h = await harness(token=TOKEN)
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": TOKEN},
                    {"authorization": f"Basic {TOKEN}"}):
        response = await h.client.open(path, method=method, headers=headers)
        assert response.status_code == 401, headers
        assert (await response.get_json())["error"]["type"] == "authentication_error"
        assert response.headers["www-authenticate"].startswith("Bearer")
    # Refused calls changed nothing.
    assert h.hold_kinds("d1") == []
    response = await h.client.open(path, method=method, headers={"authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 200


async def test_drain_routes_accept_post_only(harness) -> None:
    h = await harness()
    response = await h.client.get("/admin/engines/d1/drain")
    assert response.status_code == 405
    assert h.hold_kinds("d1") == []


# ----- without a token: what a web page the operator opens may not do ---------------------------------------

EVERY_ADMIN_ROUTE = [
    *ADMIN_CALLS,
    ("GET", "/admin/telemetry"),
    ("GET", "/admin/lease"),
    ("GET", "/admin/router"),
    ("GET", "/admin/timeline"),
    ("POST", "/admin/reload"),
    ("GET", "/admin/nowhere"),
]


async def refused(response: Any) -> str:
    assert response.status_code == 403
    assert response.content_type == "application/json"
    error = (await response.get_json())["error"]
    assert (error["type"], error["code"]) == ("permission_error", "admin_request_refused")
    return str(error["message"])


@pytest.mark.parametrize(("method", "path"), EVERY_ADMIN_ROUTE)
async def test_a_cross_origin_request_is_refused_403_and_changes_nothing(harness, method: str, path: str) -> None:
    h = await harness()
    # A form POST from a page elsewhere: no preflight, a simple content type.
    response = await h.client.open(path, method=method, headers={
        "origin": "http://evil.example", "content-type": "application/x-www-form-urlencoded",
        "sec-fetch-site": "cross-site"})
    assert "'http://evil.example' is not this router's own" in await refused(response)
    assert h.hold_kinds("d1") == []
    assert sorted(h.eligible("decode")) == ["d1", "d2"]


@pytest.mark.parametrize("origin", ["null", "http://localhost.evil.example", "https://localhost",
                                    "http://localhost:8001", "localhost", "http://", "http://localhost/x"])
async def test_an_origin_other_than_the_routers_own_is_refused(harness, origin: str) -> None:
    h = await harness()
    response = await h.client.post("/admin/engines/d1/drain", headers={"host": "localhost:8000", "origin": origin})
    await refused(response)
    assert h.hold_kinds("d1") == []


@pytest.mark.parametrize("site", ["cross-site", "same-site", "Cross-Site"])
async def test_sec_fetch_site_cross_or_same_site_is_refused(harness, site: str) -> None:
    h = await harness()
    response = await h.client.post("/admin/engines/d1/drain", headers={"sec-fetch-site": site})
    assert "Sec-Fetch-Site" in await refused(response)
    assert h.hold_kinds("d1") == []


@pytest.mark.parametrize(("host", "origin", "scheme"), [
    ("127.0.0.1:8000", "http://127.0.0.1:8000", "http"),
    ("localhost", "http://localhost:80", "http"),
    ("LOCALHOST:8443", "https://localhost:8443", "https"),
    ("[::1]:8000", "http://[::1]:8000", "http"),
    ("router.localhost:9", "http://router.localhost:9", "http"),
])
async def test_the_fleet_pages_same_origin_requests_are_served(harness, host: str, origin: str,
                                                                scheme: str) -> None:
    h = await harness()
    headers = {"host": host, "origin": origin, "sec-fetch-site": "same-origin"}
    response = await h.client.post("/admin/engines/d1/drain", headers=headers, scheme=scheme)
    assert response.status_code == 200, await response.get_json()
    assert h.hold_kinds("d1") == ["operator_drain"]
    for path in ("/admin/engines", "/admin/router", "/admin/timeline?seconds=5"):
        response = await h.client.get(path, headers=headers, scheme=scheme)
        assert response.status_code == 200, path


@pytest.mark.parametrize("site", ["same-origin", "none"])
async def test_sec_fetch_site_same_origin_or_none_is_served(harness, site: str) -> None:
    h = await harness()
    response = await h.client.post("/admin/engines/d1/drain", headers={"sec-fetch-site": site})
    assert response.status_code == 200
    assert h.hold_kinds("d1") == ["operator_drain"]


async def test_a_curl_post_without_origin_or_content_type_is_served(harness) -> None:
    h = await harness()
    response = await h.client.post("/admin/engines/d1/drain", headers={"host": "127.0.0.1:8000"})
    assert response.status_code == 200
    assert h.hold_kinds("d1") == ["operator_drain"]


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "localhost.evil.example",
                                  "127.0.0.1.evil.example"])
async def test_a_foreign_host_is_refused(harness, host: str) -> None:
    """DNS rebinding: a page on evil.example, its name now resolving to the router, reads the API."""
    h = await harness()
    response = await h.client.get("/admin/engines", headers={"host": host})
    assert "Host" in await refused(response)
    response = await h.client.post("/admin/engines/d1/drain", headers={"host": host})
    await refused(response)
    assert h.hold_kinds("d1") == []
    # The page itself, on a name nobody gave, is refused too (its data would be).
    await refused(await h.client.get("/admin/ui", headers={"host": host}))
    # Not an admin path: served.
    assert (await h.client.get("/health", headers={"host": host})).status_code == 200


@pytest.mark.parametrize("host", ["[::1", "[evil]:80", "[::1]x", "localhost:http", "localhost:99999",
                                  "localhost:", "a b", "::1", "", "local_host..", "\u0661.0.0.1", "127.0.0.1:\u0668"])
def test_a_malformed_host_is_refused(host: str) -> None:
    refusal = admin_refusal(method="GET", path="/admin/engines", scheme="http", hosts=[host], origins=[],
                            fetch_sites=[], allowed_hosts=[])
    assert refusal is not None and "Host" in refusal


def test_two_hosts_or_origins_are_refused() -> None:
    def refusal(**headers: list[str]) -> str | None:
        return admin_refusal(method="POST", path="/admin/reload", scheme="http", allowed_hosts=[],
                             **{"hosts": ["127.0.0.1"], "origins": [], "fetch_sites": [], **headers})

    assert refusal() is None
    assert refusal(hosts=["127.0.0.1", "evil.example"]) is not None
    assert refusal(origins=["http://127.0.0.1", "http://evil.example"]) is not None
    # No Host at all (HTTP/1.0 from a script): no Origin can be its own.
    assert refusal(hosts=[]) is None
    assert refusal(hosts=[], origins=["http://127.0.0.1"]) is not None


@pytest.mark.parametrize("host", ["localhost:8000", "127.0.0.1:8000", "[::1]:8000", "10.1.2.3", "[fe80::1]:1",
                                  "Router.Internal:8000", "router.internal.", "dev.localhost"])
async def test_loopback_names_ip_addresses_and_allowed_hosts_are_served(harness, host: str) -> None:
    h = await harness(allowed_hosts=["router.internal"])
    response = await h.client.get("/admin/engines", headers={"host": host})
    assert response.status_code == 200, host


async def test_the_fleet_page_opens_from_a_link_on_another_site(harness) -> None:
    # Its HTML holds no state; what it then asks for is same-origin.
    h = await harness()
    response = await h.client.get("/admin/ui", headers={"host": "127.0.0.1:8000", "sec-fetch-site": "cross-site"})
    assert response.status_code == 200
    # Its fetches carry no custom header that would need CORS: same-origin GETs and POSTs.
    page = (await response.get_data()).decode()
    assert "mode:" not in page and "credentials:" not in page


async def test_with_a_token_the_token_is_the_protection(harness) -> None:
    h = await harness(token=TOKEN, allowed_hosts=[])
    cross = {"origin": "http://evil.example", "host": "evil.example", "sec-fetch-site": "cross-site"}
    response = await h.client.post("/admin/engines/d1/drain", headers=cross)
    assert response.status_code == 401
    assert h.hold_kinds("d1") == []
    # A page elsewhere cannot know the token; one who sends it is the operator.
    response = await h.client.post("/admin/engines/d1/drain",
                                   headers={**cross, "authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 200


# ----- query parameters: ASCII digits only, a 400 naming the parameter -----------------------------------


@pytest.mark.parametrize("value", ["\u00b2", "\uff11\uff12", "\u0661", "-5", "+5", " 5", "5 ", "0x10", "1e3",
                                   "1_000", "1234567", "9" * 400, "", "5.0"])
async def test_timeline_seconds_is_ascii_digits_only_else_400_naming_it(harness, value: str) -> None:
    h = await harness()
    response = await h.client.get("/admin/timeline", query_string={"seconds": value})
    assert response.status_code == 400
    assert response.content_type == "application/json"
    error = (await response.get_json())["error"]
    assert error["code"] == "invalid_seconds"
    assert error["message"].startswith("query parameter seconds must be a whole number of seconds in ASCII digits")


async def test_timeline_seconds_in_ascii_digits_is_served(harness) -> None:
    h = await harness()
    for value, buckets in (("0", 0), ("7", 7), ("000012", 12), ("999999", 900)):
        status, body = await h.get("/admin/timeline", query_string={"seconds": value})
        assert status == 200 and len(body["requests"]) == buckets, value


async def test_a_repeated_query_parameter_is_400(harness) -> None:
    h = await harness()
    status, body = await h.get("/admin/timeline?seconds=5&seconds=6")
    assert status == 400 and body["error"]["code"] == "invalid_seconds"
    assert "given 2 times" in body["error"]["message"]


@pytest.mark.parametrize(("method", "path"), EVERY_ADMIN_ROUTE[:-1])
async def test_a_query_parameter_an_admin_route_does_not_take_is_400_naming_it(harness, method: str,
                                                                               path: str) -> None:
    h = await harness()
    response = await h.client.open(path, method=method, query_string={"\uff53econds": "5"})
    assert response.status_code == 400
    error = (await response.get_json())["error"]
    assert error["code"] == "unknown_query_parameter"
    assert "'\uff53econds'" in error["message"]
    assert h.hold_kinds("d1") == []


async def test_admin_tenants_reads_the_tenant_counters_and_renders_nothing_else(harness, monkeypatch) -> None:
    h = await harness()
    metrics = h.router.metrics
    metrics.tenant_requests.inc("team-a", "200", amount=5)
    metrics.tenant_requests.inc("team-a", "429", amount=2)
    metrics.tenant_requests.inc("team-b", "200", amount=9)
    metrics.tenant_tokens.inc("team-a", "prompt", amount=100)
    metrics.tenant_refusals.inc("team-a", "requests", amount=2)
    rendered: list[str] = []
    render = metrics.registry.render

    def spy(prefix: str = "") -> str:
        text = render(prefix)
        rendered.append(text)
        return text

    monkeypatch.setattr(metrics.registry, "render", spy)
    status, body = await h.get("/admin/tenants")
    assert status == 200
    assert [(row["tenant"], row["requests"], row["errors"]) for row in body["tenants"]] == [
        ("team-b", 9, 0), ("team-a", 7, 2)]
    assert body["tenants"][1]["prompt_tokens"] == 100 and body["tenants"][1]["refusals"] == {"requests": 2}
    # Only the tenant families were rendered: the whole exposition grows with the fleet.
    [text] = rendered
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert names and all(name.startswith("narwhal_tenant_") for name in names), names
