"""Traces end to end (issue 40): the router and mock engines as processes, a collector double in the test.

The collector decodes OTLP/HTTP protobuf with opentelemetry-proto; the mock engines record the trace
context each request carried (``/mock/stats`` ``trace_headers``).
"""

from __future__ import annotations

import os
import re
import signal
import tomllib
from typing import Any

import pytest
import trio

from narwhal.tools.local_fleet import render_config
from tests.e2e.test_continuation_e2e import BOUNDED, MOCK, count_from_here
from tests.e2e.waiting import wait_until
from tests.otlp_collector import Collector, attributes

pytestmark = pytest.mark.e2e

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
REQUEST = {"model": "mock-model", "prompt": "hello", "max_tokens": 4, "stream": True}


def tracing(collector_url: str, **extra: Any) -> dict[str, Any]:
    return {"otlp_endpoint": collector_url, "service_name": "narwhal-e2e", **extra}


async def start_collector(nursery: trio.Nursery, mode: str = "ok") -> Collector:
    collector = Collector(mode)
    await nursery.start(collector.serve)
    return collector


async def traced_request(fleet: Any, trace: str, **body: Any) -> Any:
    headers = {"traceparent": f"00-{trace}-{CLIENT_SPAN}-01", "tracestate": "client=1"}
    response = await fleet.client.post(f"{fleet.url}/v1/completions", json={**REQUEST, **body}, headers=headers)
    assert response.status_code == 200, response.text
    return response


async def spans_of(collector: Collector, trace_id: str, names: set[str]) -> dict[str, list[Any]]:
    """The trace's spans by name, once every name in ``names`` (the root last of all) arrived."""
    tid = bytes.fromhex(trace_id)

    def ready() -> bool:
        return {span.name for span in collector.trace(tid)} >= names

    with trio.fail_after(15):
        await collector.wait_for(ready)
    out: dict[str, list[Any]] = {}
    for span in collector.trace(tid):
        out.setdefault(span.name, []).append(span)
    return out


async def test_a_streamed_pd_request_is_one_trace_that_the_engines_join(start_fleet, nursery):
    collector = await start_collector(nursery)
    fleet = await start_fleet(prefill=1, decode=1, sections={"tracing": tracing(collector.url)})
    response = await traced_request(fleet, CLIENT_TRACE)
    assert re.fullmatch(rf"00-{CLIENT_TRACE}-[0-9a-f]{{16}}-01", response.headers["traceparent"])

    spans = await spans_of(collector, CLIENT_TRACE, {"narwhal.request", "narwhal.placement", "narwhal.prefill",
                                                     "narwhal.decode"})
    [root], [placement], [prefill], [decode] = (spans[name] for name in (
        "narwhal.request", "narwhal.placement", "narwhal.prefill", "narwhal.decode"))
    assert root.parent_span_id.hex() == CLIENT_SPAN
    assert root.span_id.hex() == response.headers["traceparent"].split("-")[2]
    assert {span.parent_span_id for span in (placement, prefill, decode)} == {root.span_id}
    assert collector.service_names[0] == "narwhal-e2e"
    root_attrs = attributes(root.attributes)
    assert root_attrs["http.route"] == "/v1/completions"
    assert root_attrs["http.response.status_code"] == 200
    assert root_attrs["gen_ai.request.model"] == "mock-model"
    assert attributes(prefill.attributes)["narwhal.engine"] == "p1"
    assert attributes(decode.attributes)["narwhal.engine"] == "d1"
    assert attributes(decode.attributes)["gen_ai.usage.output_tokens"] == 4
    # The engines got the router's traceparent of their own leg's span, and the client's tracestate.
    [seen_prefill] = [h for h in (await fleet.engine_stats("p1"))["trace_headers"] if h["kind"] == "prefill"]
    [seen_decode] = [h for h in (await fleet.engine_stats("d1"))["trace_headers"] if h["kind"] == "decode"]
    assert seen_prefill["traceparent"] == f"00-{CLIENT_TRACE}-{prefill.span_id.hex()}-01"
    assert seen_decode["traceparent"] == f"00-{CLIENT_TRACE}-{decode.span_id.hex()}-01"
    assert seen_prefill["tracestate"] == seen_decode["tracestate"] == "client=1"
    # The request line leads to the trace.
    [line] = await fleet.router.wait_event("request")
    assert line["trace_id"] == CLIENT_TRACE


async def test_a_retried_request_shows_the_failed_attempt(start_fleet, nursery):
    collector = await start_collector(nursery)
    fleet = await start_fleet(prefill=1, decode=2, sections={**BOUNDED, "tracing": tracing(collector.url)})
    for name in ("d1", "d2"):
        await fleet.set_fault(name, "status_500", count=1, legs=["decode"])
    await traced_request(fleet, CLIENT_TRACE)
    [line] = await fleet.router.wait_event("request")
    assert line["attempts"] >= 2
    spans = await spans_of(collector, CLIENT_TRACE, {"narwhal.request", "narwhal.decode"})
    decodes = sorted(spans["narwhal.decode"], key=lambda s: s.start_time_unix_nano)
    assert len(decodes) == line["attempts"]
    failed = decodes[0]
    assert failed.status.code == 2  # error
    assert attributes(failed.attributes)["narwhal.failure_class"] == "inference_status"
    assert [event.name for event in failed.events] == ["narwhal.engine_failure"]
    assert attributes(decodes[-1].attributes)["narwhal.retry"] == line["attempts"] - 1
    assert decodes[-1].status.code != 2
    assert len(spans["narwhal.prefill"]) == line["attempts"]


async def test_a_continued_stream_has_a_continuation_span(start_fleet, nursery):
    collector = await start_collector(nursery)
    fleet = await start_fleet(prefill=1, decode=2, sections={**BOUNDED, "tracing": tracing(collector.url)},
                              mock_args=MOCK)
    for name in ("d1", "d2"):
        await fleet.set_fault(name, "cut", after_tokens=4, count=1)
    await count_from_here(fleet, "/v1/completions")
    [line] = await fleet.router.wait_event("request")
    assert line["continuations"] == 2
    trace_id = line["trace_id"]
    spans = await spans_of(collector, trace_id, {"narwhal.request", "narwhal.decode", "narwhal.continuation"})
    assert len(spans["narwhal.decode"]) == 1 and len(spans["narwhal.continuation"]) == 2
    assert spans["narwhal.decode"][0].status.code == 2
    joins = sorted(spans["narwhal.continuation"], key=lambda s: s.start_time_unix_nano)
    first_join = attributes(joins[0].attributes)
    assert first_join["narwhal.continuation.regenerated_tokens"] >= 0
    assert "narwhal.continuation.join_gap_ms" in first_join
    assert joins[-1].status.code != 2
    assert attributes(spans["narwhal.request"][0].attributes)["narwhal.continuations"] == 2


@pytest.mark.parametrize("mode", ["hang", "down"])
async def test_a_collector_that_hangs_or_is_down_costs_clients_nothing(start_fleet, nursery, mode):
    sections: dict[str, dict[str, Any]] = {}
    if mode == "down":
        # A port nothing listens on: the collector is down. Two worker processes: their drops are summed.
        url = "http://127.0.0.1:9"
        sections["serving"] = {"workers": 2, "shutdown_grace_s": 5.0}
    else:
        url = (await start_collector(nursery, "hang")).url
    fleet = await start_fleet(sections={**sections, "tracing": tracing(url)})
    with trio.fail_after(10):
        for n in range(20):
            await traced_request(fleet, f"{n + 1:032x}", stream=n % 2 == 0)

    async def dropped() -> float:
        text = (await fleet.client.get(f"{fleet.url}/metrics")).text
        found = re.search(r'narwhal_trace_spans_dropped_total\{reason="export_failed"\} (\d+)', text)
        return float(found.group(1)) if found else 0.0

    # The export times out (5 s) or is refused: its spans are dropped and counted, never retried.
    count = await wait_until(dropped, timeout_s=15.0, what="spans dropped")
    assert count >= 4


async def test_worker_processes_export(start_fleet, nursery):
    collector = await start_collector(nursery)
    fleet = await start_fleet(sections={"serving": {"workers": 2, "shutdown_grace_s": 5.0},
                                        "tracing": tracing(collector.url)})
    traces = [f"{n + 1:032x}" for n in range(8)]
    for trace in traces:
        await traced_request(fleet, trace)
    # Whichever worker served it, each request's trace reaches the collector whole.
    for trace in traces:
        spans = await spans_of(collector, trace, {"narwhal.request", "narwhal.prefill", "narwhal.decode"})
        assert len(spans["narwhal.request"]) == 1
    text = (await fleet.client.get(f"{fleet.url}/metrics")).text
    assert 'narwhal_trace_spans_dropped_total{reason="export_failed"} 0' in text
    assert 'narwhal_trace_spans_dropped_total{reason="queue_full"} 0' in text


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_reload_turns_tracing_on_and_off(start_fleet, nursery, workers):
    collector = await start_collector(nursery)
    fleet = await start_fleet(sections={"serving": {"workers": workers, "shutdown_grace_s": 5.0}})
    untraced = await fleet.client.post(f"{fleet.url}/v1/completions", json=REQUEST)
    assert "traceparent" not in untraced.headers

    async def reload(tracing_section: dict[str, Any] | None) -> None:
        config = tomllib.loads(fleet.config_path.read_text())
        engines = [(e["name"], e["url"], e["role"]) for e in config.pop("engines")]
        config.pop("tracing", None)
        if tracing_section is not None:
            config["tracing"] = tracing_section
        fleet.config_path.write_text(render_config(engines, config))
        seen = len(fleet.router.events("config_reloaded"))
        os.kill(fleet.router.pid, signal.SIGHUP)

        async def reloaded() -> bool:
            return len(fleet.router.events("config_reloaded")) > seen

        await wait_until(reloaded, what="config_reloaded")

    await reload(tracing(collector.url))

    async def traced() -> bool:
        response = await fleet.client.post(f"{fleet.url}/v1/completions", json=REQUEST,
                                           headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
        return "traceparent" in response.headers

    # Every worker takes the new section from its next snapshot.
    await wait_until(traced, what="a traced response")
    await spans_of(collector, CLIENT_TRACE, {"narwhal.request", "narwhal.decode"})
    await reload(None)

    async def untraced_again() -> bool:
        response = await fleet.client.post(f"{fleet.url}/v1/completions", json=REQUEST)
        return "traceparent" not in response.headers

    for _ in range(4):  # each worker, whichever answers
        await wait_until(untraced_again, what="tracing off")
