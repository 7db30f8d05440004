"""Trace context, sampling, a request's spans, the OTLP encoding, and the [tracing] config section."""

from __future__ import annotations

import random

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from narwhal.config import ConfigError, TracingConfig, parse_config
from narwhal.config_diff import is_reloadable
from narwhal.tracing.context import IdSource, Sampler, TraceContext, format_traceparent, parse_traceparent
from narwhal.tracing.otlp import encode_encoded, encode_request, encode_spans
from narwhal.tracing.spans import KIND_CLIENT, STATUS_ERROR, RequestTrace, SharedAttributes, Span
from narwhal.tracing.tracer import Propagated, Tracer

TRACE = bytes.fromhex("4bf92f3577b34da6a3ce929d0e0e4736")
PARENT = bytes.fromhex("00f067aa0ba902b7")
HEADER = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_parse_and_format_traceparent() -> None:
    context = parse_traceparent(HEADER, b"vendor=abc")
    assert context == TraceContext(TRACE, PARENT, True, "vendor=abc")
    assert format_traceparent(context) == HEADER
    assert parse_traceparent(HEADER.replace(b"-01", b"-00")).sampled is False


@pytest.mark.parametrize("value", [
    b"", b"garbage", b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    b"00-00000000000000000000000000000000-00f067aa0ba902b7-01",
    b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
    b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
    b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
])
def test_a_malformed_traceparent_is_ignored(value: bytes) -> None:
    assert parse_traceparent(value) is None


def test_a_future_version_is_read_by_version_00s_fields() -> None:
    context = parse_traceparent(b"01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-more")
    assert context is not None and context.trace_id == TRACE


def test_an_oversized_tracestate_is_dropped_whole() -> None:
    assert parse_traceparent(HEADER, b"a=" + b"x" * 600).tracestate == ""


def test_sampler_follows_the_parent_and_samples_roots_by_ratio() -> None:
    ids = IdSource(seed=7)
    assert Sampler(0.0).sampled(TraceContext(TRACE, PARENT, True), TRACE)
    assert not Sampler(1.0).sampled(TraceContext(TRACE, PARENT, False), TRACE)
    assert all(Sampler(1.0).sampled(None, ids.trace_id()) for _ in range(100))
    assert not any(Sampler(0.0).sampled(None, ids.trace_id()) for _ in range(100))
    kept = sum(Sampler(0.25).sampled(None, ids.trace_id()) for _ in range(4000))
    assert 800 < kept < 1200
    with pytest.raises(ValueError):
        Sampler(1.5)


def test_tracer_continues_a_clients_trace() -> None:
    sunk: list[Span] = []
    tracer = Tracer(TracingConfig(otlp_endpoint="http://c:4318"), sunk.extend, ids=IdSource(seed=1),
                    now_ns=lambda: 5)
    trace = tracer.start(HEADER, b"vendor=abc")
    assert trace.context.trace_id == TRACE and trace.root.parent_span_id == PARENT
    assert trace.root.span_id != PARENT
    prefill = trace.child("narwhal.prefill", 6, KIND_CLIENT)
    assert trace.engine_headers(prefill) == (b"\r\ntraceparent: 00-" + TRACE.hex().encode() + b"-"
                                             + prefill.span_id.hex().encode() + b"-01\r\ntracestate: vendor=abc")
    trace.finish(prefill, 7, error="timeout")
    trace.finish(trace.root, 8)
    assert sunk == [prefill, trace.root]
    assert prefill.status_code == STATUS_ERROR
    assert trace.response_header() == (b"traceparent", b"00-%s-%s-01" % (TRACE.hex().encode(),
                                                                         trace.root.span_id.hex().encode()))


def test_an_unsampled_trace_records_nothing_but_still_propagates() -> None:
    sunk: list[Span] = []
    tracer = Tracer(TracingConfig(otlp_endpoint="http://c:4318", sample_ratio=0.0), sunk.extend)
    trace = tracer.start(None, None)
    assert isinstance(trace, Propagated) and not trace.sampled
    name, value = trace.response_header()
    assert name == b"traceparent" and parse_traceparent(value).sampled is False
    assert trace.root_headers == b"\r\ntraceparent: " + value
    # A client's unsampled trace goes on with its id and tracestate, never recorded.
    client = tracer.start(HEADER.replace(b"-01", b"-00"), b"vendor=abc")
    assert isinstance(client, Propagated)
    assert client.root_headers.startswith(b"\r\ntraceparent: 00-" + TRACE.hex().encode())
    assert client.root_headers.endswith(b"-00\r\ntracestate: vendor=abc")
    # A client's sampled trace is followed whatever the ratio.
    assert tracer.start(HEADER, None).sampled
    assert sunk == []


def test_begin_gives_the_request_path_the_trace_and_both_headers() -> None:
    sunk: list[Span] = []
    unsampled = Tracer(TracingConfig(otlp_endpoint="http://c:4318", sample_ratio=0.0), sunk.extend)
    trace, (name, value), lines = unsampled.begin(None, None)
    assert trace is None and name == b"traceparent" and lines == b"\r\ntraceparent: " + value
    context = parse_traceparent(value)
    assert context is not None and not context.sampled
    # Each request its own ids.
    assert unsampled.begin(None, None)[1] != (name, value)
    # A client's unsampled context: its trace id and tracestate go on, nothing is recorded.
    trace, (_, value), lines = unsampled.begin(HEADER.replace(b"-01", b"-00"), b"vendor=abc")
    assert trace is None and value.startswith(b"00-" + TRACE.hex().encode()) and value.endswith(b"-00")
    assert lines == b"\r\ntraceparent: " + value + b"\r\ntracestate: vendor=abc"
    # Sampled: the trace, whose root's context the client and the engine calls get.
    sampled = Tracer(TracingConfig(otlp_endpoint="http://c:4318"), sunk.extend)
    for header in (None, HEADER, b"malformed"):
        trace, response, lines = sampled.begin(header, None)
        assert isinstance(trace, RequestTrace) and trace.sampled
        assert response == trace.response_header() and lines == trace.root_headers
        assert (trace.context.trace_id == TRACE) is (header == HEADER)
    assert sunk == []


class _Drawn(IdSource):
    """Ids whose first draw is given: the one draw of a new trace's ids (trace id, root and three children)."""

    def __init__(self, first: int) -> None:
        super().__init__(seed=5)
        draws = iter([first])
        random_bits = self.bits
        self.bits = lambda k: next(draws, None) or random_bits(k)


def test_a_new_traces_ids_come_from_one_draw_and_are_never_all_zero() -> None:
    sampled = TracingConfig(otlp_endpoint="http://c:4318")
    ids = [0x1111 << 256 | 0x22 << 192 | 0x33 << 128 | 0x44 << 64 | 0x55]
    trace, (_, value), _ = Tracer(sampled, lambda spans: None, ids=_Drawn(ids[0])).begin(None, None)
    assert trace is not None and trace.context.trace_id == (0x1111).to_bytes(16, "big")
    assert value == b"00-%032x-%016x-01" % (0x1111, 0x22)
    assert [trace.child("narwhal.placement", 1).span_id for _ in range(3)] == [
        (n).to_bytes(8, "big") for n in (0x33, 0x44, 0x55)]
    # An all-zero trace id becomes ...01; a zero span id among the four draws them again.
    trace, (_, value), _ = Tracer(sampled, lambda spans: None, ids=_Drawn(0x22 << 192)).begin(None, None)
    assert trace is not None and trace.context.trace_id == (1).to_bytes(16, "big")
    assert bytes(8) not in trace.context.span_id and value.startswith(b"00-" + b"0" * 31 + b"1-")
    assert bytes(8) != trace.child("narwhal.decode", 1).span_id
    # Not sampled: the header's span id is the draw's low 8 bytes (never zero either).
    unsampled = TracingConfig(otlp_endpoint="http://c:4318", sample_ratio=0.0)
    assert Tracer(unsampled, lambda spans: None, ids=_Drawn(ids[0])).begin(None, None)[1][1] == (
        b"00-%032x-%016x-00" % (0x1111, 0x55))
    assert Tracer(unsampled, lambda spans: None, ids=_Drawn(1 << 256)).begin(None, None)[1][1] == (
        b"00-%032x-%016x-00" % (1, 1))


def test_an_unsampled_request_trace_hands_out_its_root() -> None:
    sunk: list[Span] = []
    trace = RequestTrace(TraceContext(TRACE, PARENT, False), parent_span_id=None, start_ns=1, ids=IdSource(),
                         sink=sunk.extend)
    child = trace.child("narwhal.decode", 1, KIND_CLIENT)
    assert child is trace.root
    assert trace.engine_headers(child).endswith(b"-00")
    trace.finish(child, 2)
    assert sunk == []


def test_the_sampling_decision_is_the_trace_ids() -> None:
    tracer = Tracer(TracingConfig(otlp_endpoint="http://c:4318", sample_ratio=0.5), lambda spans: None,
                    ids=IdSource(seed=3))
    sampler = Sampler(0.5)
    for _ in range(200):
        trace = tracer.start(None, None)
        trace_id = bytes.fromhex(trace.response_header()[1].decode().split("-")[1])
        assert sampler.sampled(None, trace_id) is trace.sampled


def test_tracer_reconfigure_changes_the_ratio() -> None:
    tracer = Tracer(TracingConfig(otlp_endpoint="http://c:4318", sample_ratio=0.0), lambda spans: None)
    tracer.configure(TracingConfig(otlp_endpoint="http://c:4318", sample_ratio=1.0))
    assert tracer.start(None, None).sampled


def test_encoded_spans_decode_with_opentelemetry_proto() -> None:
    span = Span(TRACE, PARENT, bytes(range(1, 9)), "narwhal.prefill", KIND_CLIENT, 1_000)
    span.set("gen_ai.request.model", "m")
    span.set("narwhal.attempt", 2)
    span.set("narwhal.prefix_match", 0.5)
    span.set("narwhal.retried", True)
    span.event("narwhal.engine_failure", 1_500, **{"narwhal.engine": "p1"})
    span.end(2_000, error="timeout")
    message = ExportTraceServiceRequest.FromString(encode_spans([span], service_name="svc", scope_version="1"))
    [decoded] = message.resource_spans[0].scope_spans[0].spans
    assert message.resource_spans[0].scope_spans[0].scope.name == "narwhal"
    assert (decoded.trace_id, decoded.span_id, decoded.parent_span_id) == (TRACE, PARENT, bytes(range(1, 9)))
    assert (decoded.name, decoded.kind, decoded.start_time_unix_nano, decoded.end_time_unix_nano) == \
        ("narwhal.prefill", KIND_CLIENT, 1_000, 2_000)
    values = {kv.key: kv.value for kv in decoded.attributes}
    assert values["gen_ai.request.model"].string_value == "m"
    assert values["narwhal.attempt"].int_value == 2
    assert values["narwhal.prefix_match"].double_value == 0.5
    assert values["narwhal.retried"].bool_value is True
    assert decoded.events[0].name == "narwhal.engine_failure"
    assert decoded.events[0].time_unix_nano == 1_500
    assert (decoded.status.code, decoded.status.message) == (STATUS_ERROR, "timeout")


@pytest.mark.parametrize("parent", [None, bytes(range(1, 9))])
@pytest.mark.parametrize("request_id", ["", "r", "r" * 60, "réq-" * 40, "r" * 20_000])
def test_a_span_of_any_size_decodes_whole(parent: bytes | None, request_id: str) -> None:
    """Under 128 bytes, 128 bytes to 16 KiB (tag, length and head in one pack) and past 16 KiB: the same fields;
    a request id's bytes are its own whatever the length of the one before."""
    spans = []
    for text in (request_id, request_id + "x"):
        span = Span(TRACE, PARENT, parent, "narwhal.request" if parent is None else "narwhal.decode", KIND_CLIENT,
                    1_000)
        span.set("narwhal.request_id", text)
        span.end(2_000)
        spans.append(span)
    message = ExportTraceServiceRequest.FromString(encode_spans(spans, service_name="svc", scope_version="1"))
    decoded = message.resource_spans[0].scope_spans[0].spans
    for span, got in zip(spans, decoded, strict=True):
        assert (got.trace_id, got.span_id, got.parent_span_id) == (TRACE, PARENT, parent or b"")
        assert (got.name, got.start_time_unix_nano, got.end_time_unix_nano) == (span.name, 1_000, 2_000)
        assert [(kv.key, kv.value.string_value) for kv in got.attributes] == \
            [("narwhal.request_id", span.attributes["narwhal.request_id"])]


def _nested_export(spans: list[bytes], service_name: str, scope_version: str) -> bytes:
    """The export request built the plain way, each enclosing message made whole around the one inside it."""
    def field(tag: int, payload: bytes) -> bytes:
        size, head = len(payload), bytearray([tag])
        while size >= 0x80:
            head.append((size & 0x7F) | 0x80)
            size >>= 7
        head.append(size)
        return bytes(head) + payload

    key_value = field(0x0A, b"service.name") + field(0x12, field(0x0A, service_name.encode()))
    scope = field(0x0A, b"narwhal") + field(0x12, scope_version.encode())
    scope_spans = field(0x0A, scope) + b"".join(spans)
    return field(0x0A, field(0x0A, field(0x0A, key_value)) + field(0x12, scope_spans))


@pytest.mark.parametrize("requests", [0, 1, 3, 600])
def test_a_batch_is_the_export_request_of_its_requests_spans_in_order(requests: int) -> None:
    """One join, lengths added up first: the same bytes as the nested messages, and what a collector decodes."""
    rng = random.Random(requests)
    batch: list[Span] = []
    entries: list[bytes] = []
    for number in range(requests):
        spans = []
        for child in range(rng.randrange(1, 5)):
            span = Span(TRACE, rng.randbytes(8), PARENT, "narwhal.decode", KIND_CLIENT, number)
            # Large attributes now and then: a span past 16 KiB, a batch past 2 MiB (longer length prefixes).
            span.set("narwhal.request_id", "r" * rng.choice((10, 100, 20_000)) + str(child))
            span.end(number + 1)
            spans.append(span)
        batch += spans
        entries.append(encode_request(spans))
    body = encode_encoded(entries, service_name="svc", scope_version="1.2.3")
    assert body == _nested_export(entries, "svc", "1.2.3")
    message = ExportTraceServiceRequest.FromString(body)
    [resource_spans] = message.resource_spans
    assert resource_spans.resource.attributes[0].value.string_value == "svc"
    [scope_spans] = resource_spans.scope_spans
    assert (scope_spans.scope.name, scope_spans.scope.version) == ("narwhal", "1.2.3")
    assert [decoded.span_id for decoded in scope_spans.spans] == [span.span_id for span in batch]
    assert [decoded.attributes[0].value.string_value for decoded in scope_spans.spans] == \
        [span.attributes["narwhal.request_id"] for span in batch]


def test_a_requests_spans_reach_the_sink_together_when_the_root_ends() -> None:
    batches: list[list[Span]] = []
    trace = RequestTrace(TraceContext(TRACE, PARENT, True), parent_span_id=None, start_ns=1, ids=IdSource(seed=2),
                         sink=batches.append)
    placement = trace.child("narwhal.placement", 2)
    prefill = trace.child("narwhal.prefill", 3, KIND_CLIENT)
    trace.finish(placement, 4)
    trace.finish(prefill, 5)
    assert batches == []  # children wait for their root
    trace.finish(trace.root, 6)
    assert batches == [[placement, prefill, trace.root]]
    # A child that ends after its root (a tail the request left running) goes on its own.
    late = trace.child("narwhal.decode", 7, KIND_CLIENT)
    trace.finish(late, 8)
    assert batches[1:] == [[late]]
    with pytest.raises(RuntimeError, match="ended twice"):
        trace.finish(late, 9)
    # Every span its own id, none the root's.
    ids = [span.span_id for span in (placement, prefill, late)]
    assert len(set(ids)) == 3 and PARENT not in ids


def test_span_ids_are_drawn_together_and_never_all_zero() -> None:
    class Stub(random.Random):
        """Draws zeros first (as a real source may, once in 2**64), then counts up."""

        def __init__(self) -> None:
            super().__init__(0)
            self.draws = 0

        def getrandbits(self, k: int) -> int:
            self.draws += 1
            return 0 if self.draws == 1 else (1 << k) - self.draws

    ids = IdSource(seed=0)
    ids._random = Stub()
    drawn = ids.span_ids(3)
    assert len(drawn) == 24 and ids._random.draws == 2
    # The all-zero draw was thrown away whole, not passed on as an invalid id.
    assert all(drawn[at:at + 8] != bytes(8) for at in (0, 8, 16))
    assert len(IdSource().span_ids(4)) == 32


def test_shared_attributes_are_encoded_once_and_carried_by_each_span() -> None:
    shared = SharedAttributes({"narwhal.engine": "p1", "server.port": 8100})
    spans = []
    for n in (1, 2):
        span = Span(TRACE, n.to_bytes(8, "big"), PARENT, "narwhal.prefill", KIND_CLIENT, 1_000)
        span.shared = shared
        span.set("narwhal.kv_handoff.bytes", 100 * n)
        span.end(2_000)
        spans.append(span)
    message = ExportTraceServiceRequest.FromString(encode_spans(spans, service_name="svc", scope_version="1"))
    decoded = message.resource_spans[0].scope_spans[0].spans
    for n, span in zip((1, 2), decoded, strict=True):
        values = {kv.key: kv.value for kv in span.attributes}
        assert len(values) == len(span.attributes) == 3
        assert values["narwhal.engine"].string_value == "p1" and values["server.port"].int_value == 8100
        assert values["narwhal.kv_handoff.bytes"].int_value == 100 * n
    assert shared.encoded is not None  # made by the first span, kept for the next
    assert spans[0].all_attributes() == {"narwhal.engine": "p1", "server.port": 8100,
                                         "narwhal.kv_handoff.bytes": 100}


def test_tracing_config_defaults_and_reload() -> None:
    config = parse_config("")
    assert config.tracing == TracingConfig()
    assert not config.tracing.enabled
    config = parse_config('[tracing]\notlp_endpoint = "http://otel:4318"\nservice_name = "edge"\n'
                          'sample_ratio = 0.1\nheaders = { "x-api-key" = "secret" }\n')
    assert config.tracing.enabled
    assert (config.tracing.service_name, config.tracing.sample_ratio, config.tracing.headers) == \
        ("edge", 0.1, {"x-api-key": "secret"})
    assert is_reloadable("tracing.sample_ratio") and is_reloadable("tracing.otlp_endpoint")


@pytest.mark.parametrize(("text", "key"), [
    ('otlp_endpoint = "otel:4318"', "tracing.otlp_endpoint"),
    ('otlp_endpoint = "http://otel:4318/?x=1"', "tracing.otlp_endpoint"),
    ("sample_ratio = 1.5", "tracing.sample_ratio"),
    ("sample_ratio = -0.1", "tracing.sample_ratio"),
    ('service_name = ""', "tracing.service_name"),
    ('headers = { "bad name" = "v" }', "tracing.headers"),
    ('headers = { "x-key" = "line\\nbreak" }', "tracing.headers"),
    ("sample = 1.0", "tracing.sample"),
])
def test_tracing_config_errors_name_the_key(text: str, key: str) -> None:
    with pytest.raises(ConfigError, match=f"<config>: {key}[:. ]"):
        parse_config(f"[tracing]\n{text}\n")


def test_the_data_pool_puts_the_trace_lines_in_the_request_head() -> None:
    from narwhal.config import EngineSpec
    from narwhal.pools.data import _post_request

    engine = EngineSpec(name="d1", url="http://127.0.0.1:9", role="decode")
    lines = b"\r\ntraceparent: " + HEADER + b"\r\ntracestate: vendor=abc"
    head = _post_request(engine, "/v1/completions", b"{}", "r1", b"text/event-stream", trace=lines)
    assert b"\r\nx-request-id: r1\r\ntraceparent: " + HEADER + b"\r\ntracestate: vendor=abc\r\n\r\n{}" in head
    assert b"traceparent" not in _post_request(engine, "/v1/completions", b"{}", "r1", b"text/event-stream")
