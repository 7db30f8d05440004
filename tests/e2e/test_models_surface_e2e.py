"""Several models over HTTP, end to end: ``narwhal serve`` with mock engines of two models (and one engine that serves a
third model where the config says the first), with one process and with two workers.

/v1/models in OpenAI's list format with each model's smallest max_model_len, /v1/models/{id}, the startup
model read keeping the wrong engine out of placement (refused at the ``model`` check, naming both models),
/ready and /ready?model= as one model loses its decode engine, /admin/models and ``narwhal admin models``.
"""

from __future__ import annotations

import os
import sys

import httpx
import pytest
import trio

from narwhal.tools.admin_cli import TOKEN_ENV
from narwhal.tools.local_fleet import LocalProcess, start_mock_engine, start_router
from tests.e2e.waiting import wait_until

pytestmark = pytest.mark.e2e

TOKEN = "e2e-models-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
# name, role, the model the config says, what the engine serves (--model), its --max-model-len
ENGINES = [("a-p1", "prefill", "alpha", "alpha", 2048), ("a-d1", "decode", "alpha", "alpha", 1024),
           ("a-d2", "decode", "alpha", "gamma", 512),
           ("b-p1", "prefill", "beta", "beta", 4096), ("b-d1", "decode", "beta", "beta", 4096)]


def config_text(urls: dict[str, str], workers: int, tmp: str) -> str:
    lines = [
        "[serving]", f"workers = {workers}", "shutdown_grace_s = 5.0", "",
        "[engine]", "connect_timeout_s = 0.5", "health_timeout_s = 0.5", "request_timeout_s = 10.0", "",
        "[controller]", "monitor_interval_s = 0.2", "stage_timeout_s = 1.5", "",
        "[recovery]", "liveness_misses = 2", "probe_interval_s = 0.5", "",
        "[handoff]", f'path = "{tmp}/handoff.json"', "",
        "[admin]", f'token = "{TOKEN}"', "",
        "[fleet]", 'model = "alpha"', 'attestation_key = "narwhal-dev-key"', "",
        "[[fleet.models]]", 'name = "alpha"', 'aliases = ["alpha-latest"]', "",
    ]
    for name, role, model, _, _ in ENGINES:
        lines += ["[[engines]]", f'name = "{name}"', f'url = "{urls[name]}"', f'role = "{role}"', f'model = "{model}"',
                  ""]
    return "\n".join(lines)


@pytest.mark.parametrize("workers", [1, 2])
async def test_two_models_behind_one_router(nursery, tmp_path, workers: int) -> None:
    engines: dict[str, LocalProcess] = {}
    for name, role, _, serves, max_len in ENGINES:
        engines[name] = await start_mock_engine(nursery, role, engine_id=name,
                                                args=["--model", serves, "--max-model-len", str(max_len)])
    config = tmp_path / "narwhal.toml"
    config.write_text(config_text({name: p.url for name, p in engines.items()}, workers, str(tmp_path)))
    router = await start_router(nursery, str(config))
    try:
        async with httpx.AsyncClient(base_url=router.url, timeout=30.0) as client:
            await check_two_models(client, router, engines)
    finally:
        with trio.CancelScope(shield=True):
            await router.stop(grace_s=10.0)
            for process in engines.values():
                await process.stop(grace_s=5.0)


async def check_two_models(client: httpx.AsyncClient, router: LocalProcess, engines: dict[str, LocalProcess]) -> None:
    # The engine configured for alpha that serves gamma was read before the router served: out of placement.
    d2 = (await client.get("/admin/engines/a-d2", headers=AUTH)).json()["engine"]
    assert d2["ejected"] and not d2["eligible"] and d2["ejected_cause"] == "model" and d2["model"] == "alpha"
    assert "'gamma'" in d2["ejected_reason"] and "'alpha'" in d2["ejected_reason"]
    assert d2["last_readmission"]["check"] == "model"
    refusals = [e for e in router.events("readmission") if e["engine"] == "a-d2"]
    assert refusals and all(e["check"] == "model" for e in refusals)
    # Read before the router served: its ejection is logged before router_started.
    order = [line.get("event") for line in router.lines]
    ejected = next(i for i, line in enumerate(router.lines)
                   if line.get("event") == "engine_ejected" and line.get("engine") == "a-d2")
    assert ejected < order.index("router_started")
    assert router.events("engine_ejected", engine="a-d2")[0]["ejection_cause"] == "model"

    # /v1/models: OpenAI's list, aliases with parent, each model's smallest max_model_len (a-d2's is not alpha's).
    listed = (await client.get("/v1/models")).json()
    assert listed["object"] == "list"
    cards = {card["id"]: card for card in listed["data"]}
    assert list(cards) == ["alpha", "alpha-latest", "beta"]
    assert all(card["object"] == "model" and card["owned_by"] == "narwhal" and isinstance(card["created"], int)
               for card in cards.values())
    assert (cards["alpha"]["max_model_len"], cards["beta"]["max_model_len"]) == (1024, 4096)
    assert cards["alpha-latest"]["parent"] == "alpha" and "parent" not in cards["alpha"]
    assert (await client.get("/v1/models")).json() == listed  # created is stable
    assert (await client.get("/v1/models/alpha-latest")).json() == cards["alpha-latest"]
    missing = await client.get("/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"

    # Requests for alpha (by its alias too) never reach the engine serving gamma.
    for model in ("alpha", "alpha-latest", "beta") * 4:
        response = await client.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2})
        assert response.status_code == 200, response.text
        assert response.json()["model"] == ("beta" if model == "beta" else "alpha")
    stats = (await client.get(f"{engines['a-d2'].url}/mock/stats")).json()
    assert stats["decode"] == 0

    # /ready: both models serve.
    ready = await client.get("/ready")
    assert (ready.status_code, ready.text) == (200, "ready\n")
    assert (await client.get("/ready?model=zz")).status_code == 404

    # beta loses its one decode engine: /ready stays 200 and says so; ?model= answers per model.
    await engines["b-d1"].stop(grace_s=2.0)

    async def beta_down() -> bool:
        return (await client.get("/ready", params={"model": "beta"})).status_code == 503

    await wait_until(beta_down, timeout_s=15.0, what="/ready?model=beta 503")
    ready = await client.get("/ready")
    assert ready.status_code == 200
    assert ready.text.startswith("ready; model 'beta' cannot serve: serving capacity exhausted: no eligible decode "
                                 "engine of model 'beta'")
    assert (await client.get("/ready", params={"model": "alpha-latest"})).text == "ready\n"
    refused = await client.post("/v1/completions", json={"model": "beta", "prompt": "hi", "max_tokens": 2})
    assert refused.status_code == 503

    # /admin/models and the CLI.
    models = {m["name"]: m for m in (await client.get("/admin/models", headers=AUTH)).json()["models"]}
    assert list(models) == ["alpha", "beta"]
    alpha, beta = models["alpha"], models["beta"]
    assert (alpha["aliases"], alpha["max_model_len"], alpha["can_serve"]) == (["alpha-latest"], 1024, True)
    assert {e["name"]: e["state"] for e in alpha["engines"]} == {"a-p1": "eligible", "a-d1": "eligible",
                                                                  "a-d2": "ejected"}
    assert not beta["can_serve"] and "decode" in beta["reason"]
    assert (await client.get("/admin/models")).status_code == 401
    result = await trio.run_process([sys.executable, "-m", "narwhal", "admin", "models", "--url", router.url],
                                    capture_stdout=True, capture_stderr=True, check=False,
                                    env={**os.environ, TOKEN_ENV: TOKEN})
    out: str = result.stdout.decode()
    assert result.returncode == 0, result.stderr.decode()
    assert "a-d2 (decode, ejected)" in out and "beta: cannot serve:" in out
