"""Traces through Narwhal to real vLLM (issue 40): the engines get the router's traceparent (one span of its own
per leg) and the client's tracestate, and the router's spans reach a collector double.

The engines record what came in with a test-only middleware (``engine_site/narwhal_trace_recorder.py``), so
this holds whether or not vLLM itself exports (``--otlp-traces-endpoint``: the tier's engines are shared by
every test and run without it). vLLM's tracing extras bring opentelemetry-proto into the tier's venv, which
the collector double decodes with.
"""

from __future__ import annotations

import httpx
import pytest
import trio

from tests.real_vllm.fleet import MODEL_NAME

pytestmark = pytest.mark.real_vllm

TRACE = "5b8aa5a2d2c872e8321cf37308d69df2"
CLIENT_SPAN = "051581bf3cb55c13"


async def seen_by(client: httpx.AsyncClient, engine_url: str) -> list[dict[str, str | None]]:
    response = await client.get(f"{engine_url}/narwhal-test/trace-headers")
    assert response.status_code == 200, response.text
    return response.json()


async def test_real_vllm_gets_the_routers_traceparent(start_narwhal, nursery) -> None:
    pytest.importorskip("opentelemetry.proto")
    from tests.otlp_collector import Collector

    collector = Collector()
    await nursery.start(collector.serve)
    narwhal = await start_narwhal(engines=["p1", "d1"], tracing={"otlp_endpoint": collector.url})
    response = await narwhal.client.post(
        f"{narwhal.url}/v1/completions",
        json={"model": MODEL_NAME, "prompt": "The narwhal router", "max_tokens": 4, "temperature": 0,
              "stream": True},
        headers={"traceparent": f"00-{TRACE}-{CLIENT_SPAN}-01", "tracestate": "tier=real", "x-request-id": "tr-1"})
    assert response.status_code == 200, response.text
    _, trace, root, flags = response.headers["traceparent"].split("-")
    assert (trace, flags) == (TRACE, "01") and root != CLIENT_SPAN
    fleet = narwhal.fleet
    on_p1 = [s for s in await seen_by(narwhal.client, fleet["p1"].url) if s["request_id"] == "tr-1"]
    on_d1 = [s for s in await seen_by(narwhal.client, fleet["d1"].url)
             if s["request_id"] == "tr-1" and s["path"] == "/v1/completions"]
    assert on_p1 and len(on_d1) == 1
    parents = set()
    for seen in on_p1 + on_d1:
        version, trace, parent, flags = str(seen["traceparent"]).split("-")
        assert (version, trace, flags) == ("00", TRACE, "01")
        assert parent not in (CLIENT_SPAN, root)  # a leg's own span, under the router's request span
        parents.add(parent)
        assert seen["tracestate"] == "tier=real"
    # The prefill and the decode are two spans: the router's, exported.
    assert len(parents) >= 2
    tid = bytes.fromhex(TRACE)
    with trio.fail_after(30):
        await collector.wait_for(lambda: {"narwhal.request", "narwhal.prefill", "narwhal.decode"}
                                 <= {span.name for span in collector.trace(tid)})
    [prefill] = collector.named("narwhal.prefill", tid)
    [decode] = collector.named("narwhal.decode", tid)
    assert {prefill.span_id.hex(), decode.span_id.hex()} <= parents
