"""End to end, several models behind one router (issue 35): each request goes to its model's engines (an alias
too), a drain in one model leaves the other's placement untouched, and last-engine protection counts per model.

The router and four mock engines (two per model, each serving its model's name) run as processes on 127.0.0.1.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from narwhal.tools.local_fleet import LocalProcess, render_config, start_mock_engine, start_router
from tests.e2e.waiting import wait_until

pytestmark = pytest.mark.e2e

MODELS = {"pa": ("prefill", "alpha"), "da": ("decode", "alpha"), "pb": ("prefill", "beta"), "db": ("decode", "beta")}


class TwoModels:
    def __init__(self, router: LocalProcess, engines: dict[str, LocalProcess], client: httpx.AsyncClient) -> None:
        self.router, self.engines, self.client = router, engines, client
        self.url = router.url

    async def complete(self, model: str | None, **fields: Any) -> httpx.Response:
        payload: dict[str, Any] = {"prompt": "hello", "max_tokens": 3, **fields}
        if model is not None:
            payload["model"] = model
        return await self.client.post(f"{self.url}/v1/completions", json=payload)

    async def request_line(self, count: int) -> dict[str, Any]:
        """The ``count``-th request log line (the router writes them in batches)."""
        async def logged() -> bool:
            return len(self.router.events("request")) >= count

        await wait_until(logged, timeout_s=10.0, what=f"{count} request lines")
        return self.router.events("request")[count - 1]

    async def engines_view(self) -> dict[str, dict[str, Any]]:
        response = await self.client.get(f"{self.url}/admin/engines")
        return {engine["name"]: engine for engine in response.json()["engines"]}


@pytest.fixture
async def two_models(nursery, tmp_path):
    processes: list[LocalProcess] = []
    client = httpx.AsyncClient(timeout=30.0)

    async def start(workers: int = 1, **recovery: Any) -> TwoModels:
        engines: dict[str, LocalProcess] = {}
        for name, (role, model) in MODELS.items():
            engines[name] = await start_mock_engine(nursery, role, engine_id=name, args=["--model", model])
            processes.append(engines[name])
        config = tmp_path / "narwhal.toml"
        config.write_text(render_config(
            [(name, engines[name].url, role, model) for name, (role, model) in MODELS.items()],
            {"serving": {"count_tokens": False, "shutdown_grace_s": 5.0, "workers": workers},
             "engine": {"connect_timeout_s": 1.0, "request_timeout_s": 10.0, "health_timeout_s": 0.5},
             "controller": {"monitor_interval_s": 0.2},
             "recovery": recovery,
             "handoff": {"path": str(tmp_path / "handoff.json")},
             "fleet": {"model": "alpha", "attestation_key": "narwhal-dev-key"}},
            models=[{"name": "beta", "aliases": ["beta-latest"]}]))
        router = await start_router(nursery, str(config))
        processes.append(router)
        return TwoModels(router, engines, client)

    yield start
    with trio.CancelScope(shield=True):
        await client.aclose()
        for process in reversed(processes):
            await process.stop(grace_s=10.0)


async def test_each_model_and_alias_is_served_by_its_own_engines_and_answers_carry_the_models_name(two_models):
    fleet = await two_models()
    for count, (asked, model, engines) in enumerate((("alpha", "alpha", ("pa", "da")), ("beta", "beta", ("pb", "db")),
                                                     ("beta-latest", "beta", ("pb", "db"))), start=1):
        response = await fleet.complete(asked)
        assert response.status_code == 200, response.text
        assert response.json()["model"] == model
        line = await fleet.request_line(count)
        assert (line["prefill"], line["decode"], line["model"]) == (*engines, model)
    streamed = await fleet.complete("beta-latest", stream=True)
    assert streamed.status_code == 200 and '"model":"beta"' in streamed.text.replace(" ", "")


async def test_an_unknown_model_is_404_and_a_missing_one_400_before_any_engine_call(two_models):
    fleet = await two_models()
    async def inference_calls() -> dict[str, tuple[int, int, int]]:
        # Health checks come and go meanwhile; completions and token counts are what a request would cost.
        stats = {name: (await fleet.client.get(f"{p.url}/mock/stats")).json() for name, p in fleet.engines.items()}
        return {name: (s["prefill"], s["decode"], s["plain"]) for name, s in stats.items()}

    before = await inference_calls()
    response = await fleet.complete("gamma")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert response.json()["error"]["code"] == "model_not_found"
    response = await fleet.complete(None)
    assert response.status_code == 400 and response.json()["error"]["code"] == "missing_model"
    assert await inference_calls() == before


async def test_a_drain_in_one_model_leaves_the_other_models_placement_untouched(two_models):
    fleet = await two_models()
    response = await fleet.client.post(f"{fleet.url}/admin/engines/da/drain")
    assert response.status_code == 200, response.text
    view = await fleet.engines_view()
    assert not view["da"]["eligible"] and view["db"]["eligible"] and view["pb"]["eligible"]
    # alpha has no decode engine left: 503 naming it; beta serves on.
    refused = await fleet.complete("alpha")
    assert refused.status_code == 503 and "alpha" in refused.json()["error"]["message"]
    for count in range(2, 5):
        response = await fleet.complete("beta")
        assert response.status_code == 200
        assert (await fleet.request_line(count))["decode"] == "db"


async def test_the_last_engine_of_a_model_is_protected_even_while_another_model_has_one_of_its_role(two_models):
    # db is beta's only decode engine; alpha's da is eligible. Overload answers (429) on db's decodes and health
    # would put a temporary quarantine on it: as beta's last eligible decode engine, the hold is deferred.
    fleet = await two_models(eject_after=1, failure_quarantine_s=60.0, liveness_misses=1000)
    response = await fleet.client.post(f"{fleet.engines['db'].url}/mock/faults",
                                       json={"mode": "status_429", "legs": ["decode", "health"]})
    assert response.status_code == 200
    assert (await fleet.complete("beta")).status_code == 502  # the engine's 429, as an upstream error

    async def deferred() -> bool:
        holds = (await fleet.engines_view())["db"]["holds"]
        return any(hold["kind"] == "failure_quarantine" and hold["deferred"] for hold in holds)

    await wait_until(deferred, timeout_s=15.0, what="db's quarantine deferred as beta's last decode engine")
    view = await fleet.engines_view()
    assert view["db"]["eligible"] and view["da"]["eligible"]
    reasons = [e["reason"] for e in fleet.router.events("engine_hold_deferred") if e.get("engine") == "db"]
    assert reasons and "last eligible decode (model 'beta') engine" in reasons[0]
    # Meanwhile alpha's engines took no hold of beta's making.
    assert view["da"]["holds"] == [] and view["pa"]["holds"] == []


async def test_worker_processes_place_each_model_on_its_own_engines_from_their_snapshots(two_models):
    fleet = await two_models(workers=2)
    for _ in range(4):
        assert (await fleet.complete("alpha")).json()["model"] == "alpha"
        assert (await fleet.complete("beta-latest")).json()["model"] == "beta"
    lines = [await fleet.request_line(count) for count in range(1, 9)]
    assert {(line["model"], line["prefill"], line["decode"]) for line in lines} == {
        ("alpha", "pa", "da"), ("beta", "pb", "db")}
    assert (await fleet.client.post(f"{fleet.url}/admin/engines/db/drain")).status_code == 200

    async def beta_refused() -> bool:
        return (await fleet.complete("beta")).status_code == 503

    # Each worker learns of the drain from its next snapshot.
    await wait_until(beta_refused, timeout_s=10.0, what="beta refused in every worker")
    for _ in range(4):
        assert (await fleet.complete("beta")).status_code == 503
        assert (await fleet.complete("alpha")).status_code == 200
