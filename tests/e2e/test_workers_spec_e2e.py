"""``serving.workers = 2``: the spec's request-path rules hold when workers serve, end to end.

Evidence from a worker reaches the controller's fleet once; an engine's 4xx is
not engine failure (it clears connection and inference-status evidence);
operator drains survive health successes; ``/ready`` gives the spec's text
whichever worker answers, and a request admitted before the monitor degraded
runs to completion.
"""

from __future__ import annotations

import httpx
import pytest
import trio

from tests.e2e.test_workers_e2e import _ready, _sample, _stream, _wait
from tests.e2e.waiting import wait_for_passes

pytestmark = pytest.mark.e2e

# No keep-alive: each request opens a fresh connection, so both workers (waiting in accept()) answer.
FRESH = httpx.Limits(max_keepalive_connections=0)
COMPLETION = {"model": "mock-model", "prompt": "hello", "max_tokens": 4}


async def _engine(fleet, name: str) -> dict:
    body = (await fleet.client.get(f"{fleet.url}/admin/engines")).json()
    return {engine["name"]: engine for engine in body["engines"]}[name]


async def _ready_texts(url: str, count: int = 6) -> set[tuple[int, str]]:
    """``/ready`` asked ``count`` times over fresh connections: the distinct (status, text) answers."""
    async with httpx.AsyncClient(timeout=10.0, limits=FRESH) as client:
        answers = set()
        for _ in range(count):
            response = await client.get(f"{url}/ready")
            answers.add((response.status_code, response.text.strip()))
        return answers


async def test_the_request_path_rules_hold_with_two_workers(start_fleet, tmp_path) -> None:
    # One fleet for every check: starting two workers is most of this test's time.
    state = tmp_path / "state"
    state.mkdir()
    # count_tokens off: decode answers 400 when prompt + max_tokens exceeds 48 (a prefill asks for 1 token).
    sections = {"serving": {"workers": 2, "count_tokens": False}, "recovery": {"eject_after": 3},
                "handoff": {"path": str(state / "handoff.json")},
                "controller": {"monitor_interval_s": 0.2, "monitor_failure_limit": 2, "stage_timeout_s": 1.5}}
    fleet = await start_fleet(prefill=1, decode=1, sections=sections,
                              mock_args=["--tokens", "4", "--token-delay-s", "0.05", "--max-model-len", "48"])
    await _wait(lambda: _ready(fleet))
    await _evidence_is_counted_once_and_an_engine_4xx_is_not_engine_failure(fleet)
    await _drains_survive_health_successes_and_ready_names_the_exhausted_role(fleet)
    await _degraded_monitoring_reads_the_same_on_every_worker_and_admitted_streams_finish(fleet, state)


async def _evidence_is_counted_once_and_an_engine_4xx_is_not_engine_failure(fleet) -> None:
    await fleet.set_fault("d1", "status_500", count=2, legs=["decode"])
    async with httpx.AsyncClient(timeout=30.0, limits=FRESH) as client:
        for _ in range(2):
            response = await client.post(f"{fleet.url}/v1/completions", json=COMPLETION)
            assert response.status_code >= 500, response.text

        async def two_recorded() -> bool:
            return (await _engine(fleet, "d1"))["evidence"]["inference_status"] == 2

        await _wait(two_recorded, timeout_s=10.0)
        # Counted once each: a second count would have reached eject_after (3) and paused d1.
        await wait_for_passes(fleet.client, fleet.url, 2)
        view = await _engine(fleet, "d1")
        assert view["evidence"]["inference_status"] == 2 and view["eligible"] and not view["holds"], view
        metrics = (await fleet.client.get(f"{fleet.url}/metrics")).text
        assert _sample(metrics, "narwhal_engine_failures_total", engine="d1", **{"class": "inference_status"},
                       model="mock-model") == 2

        # Six engine 4xx answers, over both workers: relayed, never counted, and they clear the streak.
        for _ in range(6):
            response = await client.post(f"{fleet.url}/v1/completions", json={**COMPLETION, "max_tokens": 50})
            assert response.status_code == 400, response.text
            assert response.json()["error"]["code"] == "upstream_rejected"

        async def cleared() -> bool:
            return (await _engine(fleet, "d1"))["evidence"]["inference_status"] == 0

        await _wait(cleared, timeout_s=10.0)
        view = await _engine(fleet, "d1")
        assert view["eligible"] and not view["holds"] and not view["ejected"], view
        metrics = (await fleet.client.get(f"{fleet.url}/metrics")).text
        assert _sample(metrics, "narwhal_engine_failures_total", engine="d1", **{"class": "inference_status"},
                       model="mock-model") == 2
        assert fleet.router.events("engine_ejected") == []
        assert await _stream(client, fleet.url, tokens=4)


async def _drains_survive_health_successes_and_ready_names_the_exhausted_role(fleet) -> None:
    # An operator drain of the only decode engine: capacity is exhausted, and says so.
    response = await fleet.client.post(f"{fleet.url}/admin/engines/d1/drain")
    assert response.status_code == 200, response.text
    exhausted = "serving capacity exhausted: no eligible decode engine"

    async def exhausted_everywhere() -> bool:
        return await _ready_texts(fleet.url) == {(503, exhausted)}

    await _wait(exhausted_everywhere, timeout_s=10.0)
    # Several passes of health 200 from d1 later, the drain still stands on every worker.
    await wait_for_passes(fleet.client, fleet.url, 3)
    assert await _ready_texts(fleet.url) == {(503, exhausted)}
    before = (await fleet.engine_stats("d1"))["decode"]
    async with httpx.AsyncClient(timeout=30.0, limits=FRESH) as client:
        for _ in range(6):
            response = await client.post(f"{fleet.url}/v1/completions", json=COMPLETION)
            assert response.status_code == 503 and response.json()["error"]["message"] == exhausted
    assert (await fleet.engine_stats("d1"))["decode"] == before
    view = await _engine(fleet, "d1")
    assert any(hold["kind"] == "operator_drain" for hold in view["holds"]), view
    readmit = await fleet.client.post(f"{fleet.url}/admin/engines/d1/readmit")
    assert readmit.status_code == 200, readmit.text

    async def ready_everywhere() -> bool:
        return await _ready_texts(fleet.url) == {(200, "ready")}

    await _wait(ready_everywhere, timeout_s=10.0)


async def _degraded_monitoring_reads_the_same_on_every_worker_and_admitted_streams_finish(fleet, state) -> None:
    # Persistence fails on every pass: the spec's text, and a stream admitted before runs to completion.
    degraded = "monitoring degraded: persistence NotADirectoryError"
    texts: list[str] = []
    async with httpx.AsyncClient(timeout=30.0, limits=FRESH) as client:
        async with trio.open_nursery() as nursery:

            async def long_stream() -> None:
                texts.append(await _stream(client, fleet.url, tokens=40))

            nursery.start_soon(long_stream)

            async def in_flight() -> bool:
                metrics = (await fleet.client.get(f"{fleet.url}/metrics")).text
                return sum(_sample(metrics, "narwhal_worker_requests_in_flight", worker=str(i)) for i in (0, 1)) > 0

            await _wait(in_flight, timeout_s=10.0)
            # File permissions do not stop root: replace the directory by a plain file. Renamed away first
            # (atomic): the router may be writing a pass's temporary file into it at that very moment.
            state.rename(state.with_name("state.gone"))
            state.write_text("not a directory")

            async def degraded_everywhere() -> bool:
                return await _ready_texts(fleet.url) == {(503, degraded)}

            await _wait(degraded_everywhere, timeout_s=10.0)
            response = await client.post(f"{fleet.url}/v1/completions", json=COMPLETION)
            assert response.status_code == 503 and response.json()["error"]["message"] == degraded
        # Admitted before the monitor degraded: it ran to completion.
        assert len(texts) == 1 and texts[0].rstrip().endswith("data: [DONE]")
        state.unlink()
        state.mkdir()
        # One clean pass reopens admission on every worker.
        async def ready_everywhere() -> bool:
            return await _ready_texts(fleet.url) == {(200, "ready")}

        await _wait(ready_everywhere, timeout_s=10.0)
        assert await _stream(client, fleet.url, tokens=4)
