"""The span exporter: batches, the OTLP/HTTP request it makes, and drops (counted) that never block a caller."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio
import trio.testing
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from narwhal.obs.router_metrics import RouterMetrics
from narwhal.tracing import exporter as exporter_module
from narwhal.tracing.exporter import DROP_EXPORT_FAILED, DROP_QUEUE_FULL, SpanExporter, traces_url
from narwhal.tracing.otlp import encode_request
from narwhal.tracing.spans import Span


@pytest.fixture
def mock_clock():
    return trio.testing.MockClock(autojump_threshold=0)


def span(n: int = 1) -> Span:
    s = Span(bytes(range(1, 17)), n.to_bytes(8, "big"), None, "narwhal.request", 2, 1_000)
    s.end(2_000)
    return s


class Seen:
    """An httpx transport double: records each POST; ``mode`` "ok", "fail" (503) or "hang"."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.posts: list[httpx.Request] = []
        self.spans = 0
        self.posted = trio.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        self.posts.append(request)
        self.posted.set()
        if self.mode == "hang":
            await trio.sleep_forever()
        if self.mode == "fail":
            return httpx.Response(503)
        message = ExportTraceServiceRequest.FromString(request.content)
        self.spans += sum(len(ss.spans) for rs in message.resource_spans for ss in rs.scope_spans)
        return httpx.Response(200)


def exporter(seen: Seen, **kwargs: Any) -> tuple[SpanExporter, RouterMetrics]:
    metrics = RouterMetrics()
    client = httpx.AsyncClient(transport=httpx.MockTransport(seen))
    options: dict[str, Any] = {"endpoint": "http://collector:4318/", "headers": {"x-api-key": "k"},
                               "service_name": "svc", "client": client,
                               "dropped_counter": metrics.trace_spans_dropped, **kwargs}
    return SpanExporter(**options), metrics


def test_traces_url() -> None:
    assert traces_url("http://h:4318") == "http://h:4318/v1/traces"
    assert traces_url("http://h:4318/otlp/") == "http://h:4318/otlp/v1/traces"


async def test_exports_a_batch_each_interval_as_otlp_protobuf(mock_clock) -> None:
    seen = Seen()
    exp, _ = exporter(seen, interval_s=1.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(exp.run)
        for n in range(1, 4):
            exp.submit(span(n))
        await seen.posted.wait()
        assert trio.current_time() == pytest.approx(1.0)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    [post] = seen.posts
    assert str(post.url) == "http://collector:4318/v1/traces"
    assert post.headers["content-type"] == "application/x-protobuf"
    assert post.headers["x-api-key"] == "k"
    message = ExportTraceServiceRequest.FromString(post.content)
    [resource_spans] = message.resource_spans
    assert resource_spans.resource.attributes[0].key == "service.name"
    assert resource_spans.resource.attributes[0].value.string_value == "svc"
    assert [s.span_id for s in resource_spans.scope_spans[0].spans] == [n.to_bytes(8, "big") for n in (1, 2, 3)]
    assert (exp.exported, exp.dropped) == (3, 0)


async def test_a_full_batch_goes_out_before_the_interval(mock_clock) -> None:
    seen = Seen()
    exp, _ = exporter(seen, interval_s=10.0, batch=4)
    async with trio.open_nursery() as nursery:
        await nursery.start(exp.run)
        for n in range(1, 10):
            exp.submit(span(n))
        await seen.posted.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert trio.current_time() == 0.0
        nursery.cancel_scope.cancel()
    # Two full batches at once; the last span waits for the interval.
    assert seen.spans == 8
    assert exp.queued == 1


async def test_a_full_queue_drops_and_counts_without_waiting(mock_clock) -> None:
    exp, metrics = exporter(Seen(), max_queue=3)
    for n in range(1, 6):
        exp.submit(span(n))
    assert exp.queued == 3
    assert exp.dropped == 2
    assert metrics.trace_spans_dropped.get(DROP_QUEUE_FULL) == 2
    assert "narwhal_trace_spans_dropped_total{reason=\"queue_full\"} 2" in metrics.render()


async def test_a_requests_spans_are_one_entry_counted_in_spans(mock_clock) -> None:
    seen = Seen()
    exp, metrics = exporter(seen, interval_s=10.0, max_queue=6, batch=4)
    # Three spans of one request: one entry, three spans queued; no POST yet (under the batch).
    exp.submit_all([span(1), span(2), span(3)])
    assert exp.queued == 3
    # Four more would pass max_queue: all four are dropped (counted as four), none queued.
    exp.submit_all([span(n) for n in range(4, 8)])
    assert (exp.queued, exp.dropped, metrics.trace_spans_dropped.get(DROP_QUEUE_FULL)) == (3, 4, 4)
    exp.submit_all([span(8), span(9)])
    assert exp.queued == 5
    async with trio.open_nursery() as nursery:
        await nursery.start(exp.run)
        await seen.posted.wait()
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    # Past the batch at once: whole entries go out until the batch is reached (3 + 2 spans here, one POST).
    [post] = seen.posts
    message = ExportTraceServiceRequest.FromString(post.content)
    assert [s.span_id for s in message.resource_spans[0].scope_spans[0].spans] == [
        n.to_bytes(8, "big") for n in (1, 2, 3, 8, 9)]
    assert (exp.queued, exp.exported) == (0, 5)


async def test_a_batch_takes_whole_entries_up_to_about_its_size(mock_clock) -> None:
    seen = Seen()
    exp, _ = exporter(seen, interval_s=10.0, batch=4)
    for first in (1, 4, 7):
        exp.submit_all([span(first), span(first + 1), span(first + 2)])
    async with trio.open_nursery() as nursery:
        await nursery.start(exp.run)
        await seen.posted.wait()
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    # Nine spans, batch 4: the first POST takes two entries (6 spans: the batch, plus the rest of the entry that
    # reached it), and the 3 left wait for the interval.
    assert [len(ExportTraceServiceRequest.FromString(p.content).resource_spans[0].scope_spans[0].spans)
            for p in seen.posts] == [6]
    assert exp.queued == 3


async def test_a_hanging_collector_never_blocks_submit_and_its_batches_drop(mock_clock) -> None:
    seen = Seen("hang")
    exp, metrics = exporter(seen, interval_s=1.0, timeout_s=5.0, max_queue=4, batch=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(exp.run)
        exp.submit(span(1))
        exp.submit(span(2))
        await seen.posted.wait()
        # The POST hangs: submitting goes on at once, and past the queue's bound it drops.
        before = trio.current_time()
        for n in range(3, 10):
            exp.submit(span(n))
        assert trio.current_time() == before
        assert exp.queued == 4
        assert exp.dropped == 3
        # The timeout gives up on the hung batch (dropped, not retried) and goes on with the queue.
        await trio.sleep(5.0 + 0.001)
        assert exp.dropped == 3 + 2
        nursery.cancel_scope.cancel()
    assert metrics.trace_spans_dropped.get(DROP_QUEUE_FULL) == 3
    assert metrics.trace_spans_dropped.get(DROP_EXPORT_FAILED) >= 2
    assert exp.exported == 0


async def test_a_failing_collector_drops_its_batches(mock_clock) -> None:
    seen = Seen("fail")
    exp, metrics = exporter(seen, interval_s=1.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(exp.run)
        exp.submit(span(1))
        exp.submit(span(2))
        await seen.posted.wait()
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert len(seen.posts) == 1
    assert exp.dropped == 2
    assert metrics.trace_spans_dropped.get(DROP_EXPORT_FAILED) == 2


async def test_a_collector_that_is_down_drops(mock_clock) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    metrics = RouterMetrics()
    exp = SpanExporter(endpoint="http://127.0.0.1:9", headers={}, service_name="narwhal",
                       client=httpx.AsyncClient(transport=httpx.MockTransport(refuse)),
                       dropped_counter=metrics.trace_spans_dropped)
    exp.submit(span(1))
    await exp.export_batch(httpx.AsyncClient(transport=httpx.MockTransport(refuse)))
    assert exp.dropped == 1
    assert metrics.trace_spans_dropped.get(DROP_EXPORT_FAILED) == 1


async def test_configure_sends_later_batches_to_the_new_endpoint(mock_clock) -> None:
    seen = Seen()
    exp, _ = exporter(seen)
    exp.configure(endpoint="http://other:4318", headers={"authorization": "Bearer t"}, service_name="renamed")
    exp.submit(span(1))
    await exp.export_batch(httpx.AsyncClient(transport=httpx.MockTransport(seen)))
    [post] = seen.posts
    assert str(post.url) == "http://other:4318/v1/traces"
    assert post.headers["authorization"] == "Bearer t"
    assert "x-api-key" not in post.headers
    message = ExportTraceServiceRequest.FromString(post.content)
    assert message.resource_spans[0].resource.attributes[0].value.string_value == "renamed"


async def test_the_service_follows_reloads_on_and_off(mock_clock) -> None:
    from narwhal.config import TracingConfig
    from narwhal.tracing.service import TracingService

    service = TracingService(TracingConfig())
    assert service.tracer is None and service.exporter is None
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        service.configure(TracingConfig(otlp_endpoint="http://c:4318", sample_ratio=0.5))
        assert service.tracer is not None and service.tracer.sampler.ratio == 0.5
        exporter = service.exporter
        await trio.testing.wait_all_tasks_blocked()
        # A change of ratio or endpoint keeps the exporter (and its queue).
        service.configure(TracingConfig(otlp_endpoint="http://other:4318", sample_ratio=1.0))
        assert service.exporter is exporter and service.tracer.sampler.ratio == 1.0
        service.configure(TracingConfig())
        assert service.tracer is None and service.exporter is None
        await trio.testing.wait_all_tasks_blocked()
        service.configure(TracingConfig(otlp_endpoint="http://c:4318"))
        assert service.exporter is not None and service.exporter is not exporter
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()


async def test_flush_sends_what_is_queued_at_once(mock_clock) -> None:
    seen = Seen()
    exp, _ = exporter(seen, interval_s=60.0, batch=2)
    async with trio.open_nursery() as nursery:
        await nursery.start(exp.run)
        exp.submit(span(1))
        await exp.flush()
        assert trio.current_time() == 0.0
        nursery.cancel_scope.cancel()
    assert seen.spans == 1 and exp.queued == 0



async def test_a_large_batch_is_encoded_in_chunks_that_let_the_data_plane_run(mock_clock, monkeypatch) -> None:
    # Spans are encoded by the export task, not as requests end: 300 requests' spans in one POST, in order,
    # and between chunks of their encoding other tasks run (a checkpoint), so a big batch never stalls them.
    seen = Seen()
    exp, _ = exporter(seen, interval_s=10.0, batch=300, max_queue=1000)
    encoded = 0

    def counting(spans):
        nonlocal encoded
        encoded += 1
        return encode_request(spans)

    monkeypatch.setattr(exporter_module, "encode_request", counting)
    seen_by_data_plane: set[int] = set()

    async def data_plane() -> None:
        while not seen.posts:
            seen_by_data_plane.add(encoded)
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        await nursery.start(exp.run)
        await trio.testing.wait_all_tasks_blocked()  # the export task waits for its batch
        nursery.start_soon(data_plane)
        for n in range(1, 301):
            exp.submit_all([span(n)])  # the 300th fills the batch: the export task wakes now
        assert encoded == 0  # nothing is encoded as requests end
        await seen.posted.wait()
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    [post] = seen.posts
    assert trio.current_time() == 0.0
    message = ExportTraceServiceRequest.FromString(post.content)
    ids = [s.span_id for s in message.resource_spans[0].scope_spans[0].spans]
    assert ids == [n.to_bytes(8, "big") for n in range(1, 301)]
    assert exp.exported == 300
    # The data plane ran between the chunks (128, 128, 44 requests), before the batch was whole (which gap it
    # ran in depends on trio's order within a scheduling batch, but a task that checkpoints lets it run in one).
    assert seen_by_data_plane & {128, 256}
