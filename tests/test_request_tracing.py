"""The request path's spans (issue 40), driven through the request core with a fake pool that records headers."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import trio
import trio.testing
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from narwhal.config import TracingConfig, parse_config
from narwhal.errors import EngineFailure, FailureClass
from narwhal.fleet.admission import Admission
from narwhal.fleet.placement import InFlight
from narwhal.fleet.placement.policy import Choice
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.serving.request_core import RequestCore
from narwhal.serving.request_spans import placed
from narwhal.tracing.otlp import encode_spans
from narwhal.tracing.spans import KIND_CLIENT, KIND_SERVER, STATUS_ERROR, Span
from narwhal.tracing.tracer import Tracer
from tests.test_request_core import CONFIG, FakePool, FakeSupervisor, Sink, body

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01".encode()


class TracedPool(FakePool):
    """The fake pool, keeping the trace header lines each engine call carried (b"" when none)."""

    def __init__(self) -> None:
        super().__init__()
        self.traces: list[tuple[str, str, bytes]] = []

    async def post_json(self, engine, path, body, *, request_id, trace=b""):
        self.traces.append((engine.name, path, trace))
        return await super().post_json(engine, path, body, request_id=request_id)

    @contextlib.asynccontextmanager
    async def stream(self, engine, path, body, *, request_id, trace=b""):
        self.traces.append((engine.name, path + " (stream)", trace))
        async with super().stream(engine, path, body, request_id=request_id) as upstream:
            yield upstream


class Seen(msgspec.Struct):
    """A span as a collector decodes it from the router's OTLP protobuf (opentelemetry-proto)."""

    name: str
    trace_id: bytes
    span_id: bytes
    parent_span_id: bytes | None
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[str]
    status_code: int
    status_message: str


def _value(value: Any) -> Any:
    return getattr(value, value.WhichOneof("value"))


def collected(spans: list[Seen]) -> Callable[[list[Span]], None]:
    """A tracer's sink that encodes each handed-over batch as the exporter does and keeps what a collector reads."""
    def sink(ended: list[Span]) -> None:
        message = ExportTraceServiceRequest.FromString(encode_spans(ended, service_name="narwhal", scope_version="1"))
        for span in message.resource_spans[0].scope_spans[0].spans:
            attributes = {kv.key: _value(kv.value) for kv in span.attributes}
            assert len(attributes) == len(span.attributes)  # OTLP keys are unique within a span
            spans.append(Seen(span.name, span.trace_id, span.span_id, span.parent_span_id or None, span.kind,
                              span.start_time_unix_nano, span.end_time_unix_nano, attributes,
                              [event.name for event in span.events], span.status.code, span.status.message))
    return sink


def make(ratio: float = 1.0, policy: str = "saturate", traced: bool = True):
    config = parse_config(CONFIG.format(count_tokens="false", policy=policy))
    spans: list[Seen] = []
    tracer = (Tracer(TracingConfig(otlp_endpoint="http://c:4318", sample_ratio=ratio), collected(spans))
              if traced else None)
    pool = TracedPool()
    supervisor = FakeSupervisor()
    core = RequestCore(config=config, supervisor=supervisor, data_pool=pool,
                       in_flight=InFlight(e.name for e in config.engines), admission=Admission(),
                       metrics=RouterMetrics(), tracer=tracer)
    return core, pool, supervisor, spans


def header_lines(trace: bytes) -> dict[str, str]:
    lines = [line for line in trace.decode().split("\r\n") if line]
    return dict(line.split(": ", 1) for line in lines)


def by_name(spans: list[Seen]) -> dict[str, list[Seen]]:
    out: dict[str, list[Seen]] = {}
    for span in spans:
        out.setdefault(span.name, []).append(span)
    return out


async def test_a_streamed_pd_request_is_one_trace_continued_from_the_client(caplog) -> None:
    core, pool, _, spans = make()
    sink = Sink()
    caplog.set_level(logging.INFO)
    await core.handle("/v1/completions", body(stream=True), None, sink, None, TRACEPARENT, b"vendor=x")
    named = by_name(spans)
    [root] = named["narwhal.request"]
    [placement] = named["narwhal.placement"]
    [prefill] = named["narwhal.prefill"]
    [decode] = named["narwhal.decode"]
    assert "narwhal.queue" not in named  # it never waited
    assert spans[-1] is root  # the root ends last
    assert {span.trace_id.hex() for span in spans} == {CLIENT_TRACE}
    assert root.parent_span_id.hex() == CLIENT_PARENT and root.kind == KIND_SERVER
    assert {span.parent_span_id for span in (placement, prefill, decode)} == {root.span_id}
    assert (prefill.kind, decode.kind) == (KIND_CLIENT, KIND_CLIENT)
    assert root.attributes["http.route"] == "/v1/completions"
    assert root.attributes["http.response.status_code"] == 200
    assert root.attributes["gen_ai.request.model"] == "mock-model"
    assert placement.attributes["narwhal.placement.prefill"] == "p1"
    assert placement.attributes["narwhal.placement.decode"] in ("d1", "d2")
    assert prefill.attributes["narwhal.engine"] == "p1"
    assert prefill.attributes["narwhal.retry"] == 0
    assert prefill.attributes["narwhal.kv_handoff.bytes"] > 0
    assert decode.attributes["gen_ai.usage.output_tokens"] == 2
    # Each engine call carries the traceparent of its own span, and the client's tracestate.
    calls = {path: header_lines(trace) for _, path, trace in pool.traces}
    assert calls["/v1/completions"] == {"traceparent": f"00-{CLIENT_TRACE}-{prefill.span_id.hex()}-01",
                                        "tracestate": "vendor=x"}
    assert calls["/v1/completions (stream)"]["traceparent"] == f"00-{CLIENT_TRACE}-{decode.span_id.hex()}-01"
    # The response says which span answered; the request line names the trace.
    assert (b"traceparent", f"00-{CLIENT_TRACE}-{root.span_id.hex()}-01".encode()) in sink.headers
    [line] = [json.loads(r.getMessage()) for r in caplog.records if '"event": "request"' in r.getMessage()
              or '"event":"request"' in r.getMessage()]
    assert line["trace_id"] == CLIENT_TRACE


class _LiveFeeds:
    """KV event feeds that are live and want the prompt's token IDs: placement asks a prefill's /tokenize."""

    active = True
    mode = "preferred"

    def wanted(self, candidates) -> bool:
        return True


async def test_placements_own_engine_call_carries_the_placement_spans_traceparent() -> None:
    core, pool, _, spans = make()
    core.placement.kv = _LiveFeeds()
    await core.handle("/v1/completions", body(stream=True), None, Sink(), None, TRACEPARENT, b"vendor=x")
    named = by_name(spans)
    [placement], [prefill], [decode] = named["narwhal.placement"], named["narwhal.prefill"], named["narwhal.decode"]
    calls = {path: header_lines(trace) for _, path, trace in pool.traces}
    assert calls["/tokenize"] == {"traceparent": f"00-{CLIENT_TRACE}-{placement.span_id.hex()}-01",
                                  "tracestate": "vendor=x"}
    # The legs after it carry their own spans' again.
    assert calls["/v1/completions"]["traceparent"] == f"00-{CLIENT_TRACE}-{prefill.span_id.hex()}-01"
    assert calls["/v1/completions (stream)"]["traceparent"] == f"00-{CLIENT_TRACE}-{decode.span_id.hex()}-01"


async def test_a_retried_request_has_a_failed_attempt_with_its_evidence() -> None:
    core, pool, supervisor, spans = make(policy="bounded")
    pool.prefill.append(EngineFailure("p1", FailureClass.INFERENCE_STATUS, "HTTP 500", status=500))
    sink = Sink()
    await core.handle("/v1/completions", body(), None, sink)
    assert sink.status == 200
    named = by_name(spans)
    first, second = named["narwhal.prefill"]
    assert first.status_code == STATUS_ERROR
    assert first.attributes["narwhal.failure_class"] == "inference_status"
    assert first.events == ["narwhal.engine_failure"]
    assert (first.attributes["narwhal.retry"], second.attributes["narwhal.retry"]) == (0, 1)
    assert second.status_code == 0
    [decode] = named["narwhal.decode"]
    assert decode.attributes["narwhal.attempt"] == 2
    [root] = named["narwhal.request"]
    assert root.attributes["narwhal.attempts"] == 2
    assert len(named["narwhal.placement"]) == 2


async def test_a_failed_request_marks_the_root_an_error() -> None:
    core, pool, _, spans = make()
    pool.prefill.append(EngineFailure("p1", FailureClass.TIMEOUT, "no answer"))
    sink = Sink()
    await core.handle("/v1/completions", body(), None, sink)
    assert sink.status == 504
    root = spans[-1]
    assert root.name == "narwhal.request"
    assert root.status_code == STATUS_ERROR
    assert root.attributes["http.response.status_code"] == 504
    assert root.attributes["error.type"] == "timeout"


@pytest.fixture
def mock_clock():
    return trio.testing.MockClock(autojump_threshold=0)


async def test_waiting_for_capacity_is_a_queue_span(mock_clock) -> None:
    core, pool, supervisor, spans = make(policy="bounded")
    supervisor.roles["decode"] = []
    sink = Sink()

    async def capacity_returns() -> None:
        await trio.sleep(0.12)
        supervisor.roles["decode"] = ["d1"]

    async with trio.open_nursery() as nursery:
        nursery.start_soon(capacity_returns)
        await core.handle("/v1/completions", body(), None, sink)
    assert sink.status == 200
    named = by_name(spans)
    [queue] = named["narwhal.queue"]
    assert queue.attributes["narwhal.queue.reason"] == "no_capacity"
    assert queue.status_code == 0
    assert queue.end_ns >= queue.start_ns
    # The first refusal says why it waited; the polls after it are the queue span, not a placement each.
    failed_placements = [s for s in named["narwhal.placement"] if s.status_code == STATUS_ERROR]
    assert len(failed_placements) == 1
    assert failed_placements[0].status_message == "no_capacity"
    assert len(named["narwhal.placement"]) == 2


async def test_an_unsampled_request_records_nothing_but_tells_the_engines() -> None:
    core, pool, _, spans = make(ratio=0.0)
    sink = Sink()
    await core.handle("/v1/completions", body(stream=True), None, sink)
    assert spans == []
    assert all(header_lines(trace)["traceparent"].endswith("-00") for _, _, trace in pool.traces)
    assert any(name == b"traceparent" for name, _ in sink.headers)


async def test_without_tracing_engine_calls_carry_no_trace_headers() -> None:
    core, pool, _, spans = make(traced=False)
    sink = Sink()
    await core.handle("/v1/completions", body(stream=True), None, sink)
    assert sink.status == 200
    assert [trace for _, _, trace in pool.traces] == [b"", b""]
    assert not any(name == b"traceparent" for name, _ in sink.headers)


@pytest.mark.parametrize("bad", [b"nonsense", b"00-" + b"0" * 32 + b"-" + b"1" * 16 + b"-01"])
async def test_a_malformed_traceparent_starts_a_new_trace(bad: bytes) -> None:
    core, _, _, spans = make()
    await core.handle("/v1/completions", body(), None, Sink(), None, bad, None)
    root = spans[-1]
    assert root.parent_span_id is None
    assert root.trace_id != bytes(16)


async def test_a_clients_unsampled_trace_goes_on_unrecorded() -> None:
    core, pool, _, spans = make(ratio=1.0)
    sink = Sink()
    await core.handle("/v1/completions", body(stream=True), None, sink, None, TRACEPARENT[:-2] + b"00", b"v=1")
    assert spans == []
    for _, _, trace in pool.traces:
        lines = header_lines(trace)
        assert lines["traceparent"].startswith(f"00-{CLIENT_TRACE}-") and lines["traceparent"].endswith("-00")
        assert lines["tracestate"] == "v=1"
    [value] = [v for name, v in sink.headers if name == b"traceparent"]
    assert value.decode().startswith(f"00-{CLIENT_TRACE}-")


async def test_an_engines_4xx_ends_its_leg_without_evidence() -> None:
    from narwhal.errors import UpstreamClientError

    core, pool, supervisor, spans = make()
    pool.prefill.append(UpstreamClientError("p1", 400, b'{"error": {"message": "bad prompt"}}'))
    sink = Sink()
    await core.handle("/v1/completions", body(), None, sink)
    assert sink.status == 400
    [prefill] = by_name(spans)["narwhal.prefill"]
    assert prefill.status_code == STATUS_ERROR and prefill.events == []
    assert supervisor.failures == []


def test_the_placement_span_says_both_choices_a_spill_and_the_match() -> None:
    spans = []
    for matched in (0.75, 0.5):
        span = Span(bytes(range(1, 17)), bytes(range(1, 9)), None, "narwhal.placement", 1, 1_000)
        placed(span, "prefill", Choice("p2", "spill", matched), 3)
        placed(span, "decode", Choice("d1", "least_outstanding", None), 2)
        span.end(2_000)
        spans.append(span)
    # The choices repeat whole: one shared set for both requests; the match is each request's own.
    assert spans[0].shared is spans[1].shared
    seen: list[Seen] = []
    collected(seen)(spans)
    for one, matched in zip(seen, (0.75, 0.5), strict=True):
        assert one.attributes == {
            "narwhal.placement.prefill": "p2", "narwhal.placement.prefill_reason": "spill",
            "narwhal.placement.prefill_candidates": 3, "narwhal.placement.spill": True,
            "narwhal.placement.decode": "d1", "narwhal.placement.decode_reason": "least_outstanding",
            "narwhal.placement.decode_candidates": 2, "narwhal.placement.prefix_match": matched}
    # Another prefill choice under the same decode choice is another set.
    other = Span(bytes(range(1, 17)), bytes(range(1, 9)), None, "narwhal.placement", 1, 1_000)
    placed(other, "prefill", Choice("p1", "hit", 1.0), 3)
    placed(other, "decode", Choice("d1", "least_outstanding", None), 2)
    assert other.shared is not spans[0].shared
    assert other.all_attributes()["narwhal.placement.prefill"] == "p1"
    assert "narwhal.placement.spill" not in other.all_attributes()
