"""End to end: client keys on the completion routes (``[auth] keys_file``), a router and mock engines as processes.

The openai client is what our users' clients are: it sends ``Authorization: Bearer KEY`` and reads OpenAI's
error bodies and rate-limit headers.
"""

from __future__ import annotations

import hashlib
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from narwhal.tools.local_fleet import LocalProcess, render_config, start_mock_engine, start_router
from tests.e2e.waiting import wait_until

pytestmark = pytest.mark.e2e

REQUEST = {"model": "mock-model", "prompt": "hello", "max_tokens": 2}
KEYS = {"alpha": "nwk-alpha-key-for-tests", "beta": "nwk-beta-key-for-tests", "gamma": "nwk-gamma-key"}


def keys_toml(entries: dict[str, dict[str, Any]]) -> str:
    lines = []
    for name, fields in entries.items():
        lines += ["[[keys]]", f'name = "{name}"', f'sha256 = "{hashlib.sha256(KEYS[name].encode()).hexdigest()}"']
        for field, value in fields.items():
            rendered = "[" + ", ".join(f'"{v}"' for v in value) + "]" if isinstance(value, list) else (
                f'"{value}"' if isinstance(value, str) else str(value))
            lines.append(f"{field} = {rendered}")
        lines.append("")
    return "\n".join(lines)


class World:
    def __init__(self, nursery: trio.Nursery, tmp_path: Path, client: httpx.AsyncClient) -> None:
        self.nursery = nursery
        self.tmp_path = tmp_path
        self.client = client
        self.engines: dict[str, LocalProcess] = {}
        self.router: LocalProcess | None = None

    async def start(self, keys: dict[str, dict[str, Any]], *, workers: int = 1) -> LocalProcess:
        for name, role in (("p1", "prefill"), ("d1", "decode")):
            self.engines[name] = await start_mock_engine(self.nursery, role, engine_id=name)
        self.write_keys(keys)
        config = self.tmp_path / "narwhal.toml"
        config.write_text(render_config(
            [(name, engine.url, "prefill" if name.startswith("p") else "decode")
             for name, engine in self.engines.items()],
            {"serving": {"workers": workers}, "auth": {"keys_file": "keys.toml"},
             "handoff": {"path": str(self.tmp_path / "handoff.json")},
             "fleet": {"attestation_key": "narwhal-dev-key"}}))
        self.router = await start_router(self.nursery, str(config))
        return self.router

    def write_keys(self, keys: dict[str, dict[str, Any]]) -> None:
        (self.tmp_path / "keys.toml").write_text(keys_toml(keys))

    async def complete(self, key: str | None, **fields: Any) -> httpx.Response:
        assert self.router is not None
        headers = {} if key is None else {"authorization": f"Bearer {key}"}
        return await self.client.post(f"{self.router.url}/v1/completions", json={**REQUEST, **fields},
                                      headers=headers)

    async def engine_requests(self) -> int:
        stats = (await self.client.get(f"{self.engines['p1'].url}/mock/stats")).json()
        return int(stats["prefill"])


@pytest.fixture
async def world(nursery, tmp_path):
    client = httpx.AsyncClient(timeout=10.0)
    world = World(nursery, tmp_path, client)
    yield world
    with trio.CancelScope(shield=True):
        await client.aclose()
        if world.router is not None:
            await world.router.stop(grace_s=5.0)
        for engine in world.engines.values():
            await engine.stop(grace_s=5.0)


async def test_keys_models_and_limits_answer_as_openai_and_a_refusal_never_reaches_an_engine(world: World) -> None:
    await world.start({"alpha": {"requests_per_minute": 2}, "beta": {"models": ["another-model"]}})
    assert world.router is not None
    assert (await world.complete(KEYS["alpha"])).status_code == 200
    served = await world.engine_requests()
    for key in (None, "nwk-not-a-key", KEYS["alpha"] + "x"):
        refused = await world.complete(key)
        assert refused.status_code == 401, refused.text
        assert refused.json()["error"]["code"] == "invalid_api_key"
    forbidden = await world.complete(KEYS["beta"])
    assert forbidden.status_code == 403 and forbidden.json()["error"]["code"] == "model_not_allowed"
    assert (await world.complete(KEYS["alpha"])).status_code == 200
    limited = await world.complete(KEYS["alpha"])
    assert limited.status_code == 429, limited.text
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(limited.headers["retry-after"]) >= 1
    assert limited.headers["x-ratelimit-limit-requests"] == "2"
    assert limited.headers["x-ratelimit-remaining-requests"] == "0"
    assert "x-ratelimit-reset-requests" in limited.headers
    # Only the two admitted requests reached an engine.
    assert await world.engine_requests() == served + 1
    metrics = (await world.client.get(f"{world.router.url}/metrics")).text
    assert 'narwhal_tenant_requests_total{tenant="alpha",status="200"} 2' in metrics
    assert 'narwhal_tenant_refusals_total{tenant="alpha",reason="requests"} 1' in metrics
    assert 'narwhal_tenant_refusals_total{tenant="unknown",reason="invalid_api_key"} 3' in metrics
    assert 'narwhal_tenant_refusals_total{tenant="beta",reason="model"} 1' in metrics
    assert await world.router.wait_event("request", timeout_s=2.0, status=429, tenant="alpha")
    lines = [line for line in world.router.lines if line.get("event") == "request" and line.get("status") == 200]
    assert lines and all(line["tenant"] == "alpha" for line in lines)
    # The key itself is in no log line.
    assert not any(KEYS["alpha"] in str(line) for line in world.router.lines)


# With two workers the keys reach each worker in the controller's snapshot.
@pytest.mark.parametrize("workers", [1, 2])
async def test_a_reload_admits_a_new_key_and_refuses_a_removed_one_at_once_and_a_bad_file_changes_nothing(
        world: World, workers: int) -> None:
    router = await world.start({"alpha": {}}, workers=workers)
    assert (await world.complete(KEYS["alpha"])).status_code == 200
    assert (await world.complete(KEYS["gamma"])).status_code == 401
    world.write_keys({"gamma": {}})
    os.kill(router.pid, signal.SIGHUP)
    assert await router.wait_event("config_reloaded", timeout_s=5.0)

    async def gamma_admitted() -> bool:
        return (await world.complete(KEYS["gamma"])).status_code == 200

    await wait_until(gamma_admitted, timeout_s=2.0, what="the new key admitted")
    for _ in range(2 * workers):  # every worker (connections are spread over them)
        assert (await world.complete(KEYS["alpha"])).status_code == 401
    (world.tmp_path / "keys.toml").write_text("[[keys]]\nname = \"broken\"\nsha256 = \"zz\"\n")
    os.kill(router.pid, signal.SIGHUP)
    failed = await router.wait_event("config_reload_failed", timeout_s=5.0)
    assert failed and failed[0]["key"].startswith("auth.keys_file")
    assert (await world.complete(KEYS["gamma"])).status_code == 200


async def test_a_finished_request_gives_back_its_concurrency_and_is_charged_its_tokens(world: World) -> None:
    # Through the request path's end (RequestCore._finish_tenant), not ClientAuth alone: beta's one slot comes
    # back after each request, and alpha's tokens (prompt and completion) are charged once its request ends.
    await world.start({"alpha": {"tokens_per_minute": 1}, "beta": {"max_concurrent": 1}})
    assert world.router is not None
    for _ in range(3):
        served = await world.complete(KEYS["beta"])
        assert served.status_code == 200, served.text
    assert (await world.complete(KEYS["alpha"])).status_code == 200
    limited = await world.complete(KEYS["alpha"])
    assert limited.status_code == 429, limited.text
    assert limited.headers["x-ratelimit-limit-tokens"] == "1"
    assert limited.headers["x-ratelimit-remaining-tokens"] == "0"
    metrics = (await world.client.get(f"{world.router.url}/metrics")).text
    assert 'narwhal_tenant_refusals_total{tenant="alpha",reason="tokens"} 1' in metrics
    assert 'narwhal_tenant_requests_total{tenant="beta",status="200"} 3' in metrics
    assert 'narwhal_tenant_refusals_total{tenant="beta"' not in metrics
