"""End to end, two models behind one router: metrics and logs carry `model`, and the handoff carries each
engine's model across a `--resume`."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import trio

from narwhal.tools.local_fleet import LocalProcess, start_mock_engine, start_router
from tests.e2e.waiting import wait_until

pytestmark = pytest.mark.e2e

# Model a is [fleet] model (pa, da); model b is its own (pb, db), with an alias.
MODELS = {"pa": ("prefill", "mock-model"), "da": ("decode", "mock-model"),
          "pb": ("prefill", "model-b"), "db": ("decode", "model-b")}


def config_text(urls: dict[str, str], handoff: Path, *, eject_after: int = 2) -> str:
    lines = ['[controller]', 'monitor_interval_s = 0.2', '[engine]', 'connect_timeout_s = 1.0',
             'health_timeout_s = 0.5', '[recovery]', f'eject_after = {eject_after}', 'liveness_misses = 2',
             'failure_quarantine_s = 120.0', '[handoff]', f'path = "{handoff}"', '[fleet]',
             'model = "mock-model"', 'attestation_key = "narwhal-dev-key"', '',
             '[[fleet.models]]', 'name = "model-b"', 'aliases = ["b"]', '']
    for name, (role, model) in MODELS.items():
        lines += ['[[engines]]', f'name = "{name}"', f'url = "{urls[name]}"', f'role = "{role}"']
        if model != "mock-model":
            lines.append(f'model = "{model}"')
        lines.append("")
    return "\n".join(lines)


def samples(metrics: str, name: str) -> dict[str, float]:
    """``name``'s samples: the text inside the braces -> value."""
    found = {}
    for line in metrics.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].rsplit("} ", 1)
            found[labels] = float(value)
    return found


async def test_two_models_label_their_series_and_logs_and_resume_with_their_models(nursery, tmp_path):
    processes: list[LocalProcess] = []
    try:
        await _two_models(nursery, tmp_path, processes)
    finally:
        with trio.CancelScope(shield=True):
            for process in reversed(processes):
                await process.stop(grace_s=10.0)


async def _two_models(nursery, tmp_path: Path, processes: list[LocalProcess]) -> None:
    engines = {}
    for name, (role, model) in MODELS.items():
        engines[name] = await start_mock_engine(nursery, role, engine_id=name, args=["--model", model])
        processes.append(engines[name])
    urls = {name: engine.url for name, engine in engines.items()}
    handoff = tmp_path / "handoff.json"
    config = tmp_path / "narwhal.toml"
    config.write_text(config_text(urls, handoff))
    router = await start_router(nursery, str(config))
    processes.append(router)
    async with httpx.AsyncClient(timeout=30.0) as client:
        async def ready() -> bool:
            return (await client.get(f"{router.url}/ready")).status_code == 200

        await wait_until(ready, what="/ready")
        for model in ("mock-model", "b", "model-b", "no-such-model"):
            await client.post(f"{router.url}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2})
        await client.post(f"{router.url}/v1/completions", content=b"{not json")
        metrics = (await client.get(f"{router.url}/metrics")).text
        requests = samples(metrics, "narwhal_requests_total")
        assert requests['route="/v1/completions",status="200",model="mock-model"'] == 1
        # The alias counts under its model's own name.
        assert requests['route="/v1/completions",status="200",model="model-b"'] == 2
        # An unknown model and a body that is not JSON: refused before a model is known.
        assert requests['route="/v1/completions",status="404",model=""'] == 1
        assert requests['route="/v1/completions",status="400",model=""'] == 1
        assert "no-such-model" not in metrics
        eligible = samples(metrics, "narwhal_engine_eligible")
        assert eligible == {'engine="pa",role="prefill",model="mock-model"': 1.0,
                            'engine="da",role="decode",model="mock-model"': 1.0,
                            'engine="pb",role="prefill",model="model-b"': 1.0,
                            'engine="db",role="decode",model="model-b"': 1.0}
        assert samples(metrics, "narwhal_consolidation_risk") == {
            'role="prefill",model="mock-model"': 2.0, 'role="decode",model="mock-model"': 2.0,
            'role="prefill",model="model-b"': 2.0, 'role="decode",model="model-b"': 2.0}
        async def request_lines() -> list[dict]:
            # The router batches request lines: wait until all five are written.
            lines = router.events("request")
            return lines if len(lines) >= 5 else []

        logged = await wait_until(request_lines, what="five request lines")
        assert sorted((line["status"], line["model"]) for line in logged) == [
            (200, "mock-model"), (200, "model-b"), (200, "model-b"), (400, None), (404, None)]

        # db refuses connections: its ejection is model b's, in the log and the counter.
        response = await client.post(f"{urls['db']}/mock/faults", json={"mode": "refuse", "duration_s": 60.0})
        assert response.status_code == 200
        [ejected] = await router.wait_event("engine_ejected", engine="db", timeout_s=15.0)
        assert ejected["model"] == "model-b"
        metrics = (await client.get(f"{router.url}/metrics")).text
        ejections = samples(metrics, "narwhal_engine_ejections_total")
        assert [value for labels, value in ejections.items()
                if labels.startswith('engine="db",') and labels.endswith('model="model-b"')] == [1.0]
        # Model a still serves; b has no decode engine.
        ok = await client.post(f"{router.url}/v1/completions", json={"model": "mock-model", "prompt": "hi",
                                                                      "max_tokens": 2})
        assert ok.status_code == 200

        async def db_ejected_in_handoff() -> dict | None:
            document = json.loads(handoff.read_bytes())
            records = {record["name"]: record for record in document["engines"]}
            return document if records["db"].get("ejected") else None

        document = await wait_until(db_ejected_in_handoff, what="db ejected in the handoff")
        assert {entry["name"]: entry["model"] for entry in document["engine_set"]} == {
            name: model for name, (_, model) in MODELS.items()}
        assert {record["name"]: record["model"] for record in document["engines"]} == {
            name: model for name, (_, model) in MODELS.items()}
        await router.stop()

        # Resumed on the same engines and models: db stays out of model b's pool from the handoff.
        config.write_text(config_text(urls, handoff, eject_after=1000))
        resumed = await start_router(nursery, str(config), args=["--resume"])
        processes.append(resumed)
        [applied] = await resumed.wait_event("handoff_applied", timeout_s=10.0)
        assert "db" in applied["ejected"]
        body = (await client.get(f"{resumed.url}/admin/engines")).json()
        views = {engine["name"]: engine for engine in body["engines"]}
        assert not views["db"]["eligible"] and views["da"]["eligible"]
        metrics = (await client.get(f"{resumed.url}/metrics")).text
        assert samples(metrics, "narwhal_engine_eligible")['engine="db",role="decode",model="model-b"'] == 0.0
