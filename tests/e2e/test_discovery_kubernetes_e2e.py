"""Discovery on Kubernetes, end to end through the router: ``narwhal serve`` with ``[discovery] backend =
"kubernetes"`` and no ``[[engines]]``, against the API server double (tests/k8s_api_double.py), whose Pods point
at mock engines on 127.0.0.1 by a named container port.

A Ready pod becomes an engine that serves once readmitted; a pod losing readiness leaves; a 410 Gone on the watch
lists again without dropping an engine. No real cluster runs here (docs/discovery-kubernetes.md).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from narwhal.tools.local_fleet import LocalProcess, render_config, start_mock_engine, start_router
from tests.e2e.waiting import wait_until
from tests.k8s_api_double import ApiDouble, make_pod

pytestmark = pytest.mark.e2e

REQUEST = {"model": "mock-model", "prompt": "hello", "max_tokens": 4}
ROLE_LABEL = "narwhal/role"


def pod(name: str, role: str, engine: LocalProcess, *, ready: bool = True) -> dict[str, Any]:
    port = int(engine.url.rpartition(":")[2])
    return make_pod(name, labels={"app": "llm", ROLE_LABEL: role}, ip="127.0.0.1", ready=ready,
                    ports=[{"name": "http", "containerPort": port}])


async def test_ready_pods_serve_through_the_router_and_leave_when_no_longer_ready(nursery, tmp_path):
    api = ApiDouble(namespace="serving", bookmark_interval_s=1.0)
    await nursery.start(api.serve)
    token = tmp_path / "token"
    token.write_text(api.token)
    engines = {name: await start_mock_engine(nursery, role, engine_id=name)
               for name, role in (("p1", "prefill"), ("d1", "decode"), ("d2", "decode"))}
    config = tmp_path / "narwhal.toml"
    config.write_text(render_config([], {
        "serving": {"count_tokens": False, "shutdown_grace_s": 2.0},
        "engine": {"connect_timeout_s": 1.0, "request_timeout_s": 10.0, "health_timeout_s": 0.5},
        "controller": {"monitor_interval_s": 0.2},
        "recovery": {"probe_interval_s": 1.0},
        "handoff": {"path": str(tmp_path / "handoff.json")},
        "fleet": {"attestation_key": "narwhal-dev-key"},
        "discovery": {"backend": "kubernetes", "api_url": api.url, "token_file": str(token),
                      "namespace": "serving", "prefill_selector": f"app=llm,{ROLE_LABEL}=prefill",
                      "decode_selector": f"app=llm,{ROLE_LABEL}=decode", "port": "http"}}))
    for name, role in (("p1", "prefill"), ("d1", "decode")):
        api.put(pod(name, role, engines[name]))
    router = await start_router(nursery, str(config))
    async with httpx.AsyncClient(timeout=10.0) as client:
        async def eligible() -> set[str]:
            answer = (await client.get(f"{router.url}/admin/engines")).json()
            return {e["name"] for e in answer["engines"] if e["eligible"]}

        async def both_serving() -> bool:
            return await eligible() == {"p1", "d1"}

        await wait_until(both_serving, timeout_s=15.0, what="the two pods readmitted as engines")
        response = await client.post(f"{router.url}/v1/completions", json=REQUEST)
        assert response.status_code == 200, response.text
        discovery = (await client.get(f"{router.url}/admin/discovery")).json()
        assert discovery["backend"] == "kubernetes" and discovery["state"] == "ok"
        assert discovery["resource_version"] is not None
        assert {e["name"]: e["role"] for e in discovery["engines"]} == {"p1": "prefill", "d1": "decode"}
        assert router.events("engine_discovered", engine="d1", source="kubernetes")

        # A second decode pod, not ready yet: no engine; once Ready, it joins.
        api.put(pod("d2", "decode", engines["d2"], ready=False))
        api.put(pod("d2", "decode", engines["d2"]))

        async def d2_serving() -> bool:
            return "d2" in await eligible()

        await wait_until(d2_serving, timeout_s=15.0, what="d2 readmitted once Ready")
        # The history compacted under the watch: 410 Gone, a new list, the same engines.
        api.compact()
        api.close_watches()
        api.put(pod("d1", "decode", engines["d1"], ready=False))

        async def d1_gone() -> bool:
            names = {e["name"] for e in (await client.get(f"{router.url}/admin/engines")).json()["engines"]}
            return "d1" not in names

        await wait_until(d1_gone, timeout_s=15.0, what="d1 gone once no longer Ready")
        assert await eligible() == {"p1", "d2"}
        assert router.events("engine_vanished", engine="d1", source="kubernetes")
        response = await client.post(f"{router.url}/v1/completions", json=REQUEST)
        assert response.status_code == 200
    with trio.CancelScope(shield=True):
        await router.stop(grace_s=10.0)
        for engine in engines.values():
            await engine.stop(grace_s=5.0)
