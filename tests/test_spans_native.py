"""The C RequestTrace (``narwhal.tracing._spans_native``) behaves as ``spans.PythonRequestTrace``.

The tracing suites run whichever the install built (``spans.RequestTrace``); here both run the same calls
side by side and must give the same spans, headers and sink calls, and the suites run once more in a
process that has only the Python twins.
"""

from __future__ import annotations

import gc
import os
import weakref

import pytest

from narwhal.tracing import spans
from narwhal.tracing.context import IdSource, TraceContext
from narwhal.tracing.spans import KIND_CLIENT, KIND_INTERNAL, PythonRequestTrace, SharedAttributes, Span
from tests.python_twins import pass_with_only_python

native = pytest.importorskip("narwhal.tracing._spans_native", reason="the C RequestTrace was not built")
NativeRequestTrace = native.RequestTrace


def test_ci_builds_and_runs_the_c_request_trace() -> None:
    if os.environ.get("CI"):
        assert spans.NATIVE
    assert spans.RequestTrace is (NativeRequestTrace if spans.NATIVE else PythonRequestTrace)


def test_the_tracing_suites_pass_with_only_the_python_twins() -> None:
    pass_with_only_python(["tests/test_tracing.py", "tests/test_trace_exporter.py", "tests/test_request_tracing.py"],
                          "from narwhal.tracing import otlp, spans; assert not otlp.NATIVE and not spans.NATIVE",
                          timeout_s=300)


class _Ids(IdSource):
    """Span ids counted up from 1 (the same for both classes)."""

    def __init__(self) -> None:
        super().__init__(seed=1)
        self.next = 1

    def span_ids(self, count: int) -> bytes:
        drawn = b"".join((self.next + i).to_bytes(8, "big") for i in range(count))
        self.next += count
        return drawn


def _run(cls: type, context: TraceContext, parent: bytes | None, span_ids: bytes) -> tuple[list[object], list[object]]:
    """One request's calls on a trace of ``cls``: what each returned and what reached the sink."""
    sunk: list[object] = []
    trace = cls(context, parent, 100, _Ids(), lambda ended: sunk.append([_state(span) for span in ended]), span_ids)
    seen: list[object] = [trace.sampled, trace.trace_id_hex, trace.root_headers, trace.root_kw,
                          trace.response_traceparent, trace.response_header(), trace.context == context]
    shared = SharedAttributes({"narwhal.engine": "p1"})
    placing = trace.child("narwhal.placement", 110)
    seen += [_state(placing), trace.engine_kw(placing), trace.engine_headers(placing), trace.traceparent_for(placing)]
    trace.finish(placing, 120)
    # More legs than the ids drawn with the trace: the rest are drawn three at a time.
    for n in range(5):
        leg, kw = trace.open("narwhal.prefill", 130 + n, KIND_CLIENT, shared=shared)
        seen += [_state(leg), kw, leg.shared is shared, trace.engine_kw(leg) == kw]
        leg.set("narwhal.kv_handoff.bytes", n)
        trace.finish(leg, 140 + n, error="engine_5xx" if n % 2 else None)
    queue = trace.child(name="narwhal.queue", start_ns=150, kind=KIND_INTERNAL)
    seen.append(_state(queue))
    seen += [_state(trace.root), trace.engine_kw(trace.root), trace.traceparent_for(trace.root)]
    trace.finish(trace.root, 200, error="HTTP 502")
    # A child that ends after its root goes to the sink alone.
    trace.finish(queue, 210)
    seen.append(_state(trace.root))
    return seen, sunk


def _state(span: Span) -> tuple[object, ...]:
    return (span.trace_id, span.span_id, span.parent_span_id, span.name, span.kind, span.start_ns, span.end_ns,
            dict(span.attributes), span.shared is not None, span.status_code, span.status_message, span.ended)


@pytest.mark.parametrize("sampled", [True, False])
@pytest.mark.parametrize("tracestate", ["", "vendor=a,other=b"])
@pytest.mark.parametrize("parent", [None, b"\x01" * 8])
@pytest.mark.parametrize("span_ids", [b"", b"\x07" * 24, b"\x05" * 12])
def test_both_classes_give_the_same_spans_headers_and_sink_calls(sampled: bool, tracestate: str,
                                                                  parent: bytes | None, span_ids: bytes) -> None:
    context = TraceContext(bytes(range(1, 17)), b"\xaa" * 8, sampled, tracestate)
    assert _run(NativeRequestTrace, context, parent, span_ids) == _run(PythonRequestTrace, context, parent, span_ids)


def test_keywords_build_it_as_positions_do() -> None:
    context = TraceContext(b"t" * 16, b"r" * 8, True)
    by_keyword = NativeRequestTrace(context, parent_span_id=None, start_ns=5, ids=IdSource(seed=2), sink=print)
    by_position = NativeRequestTrace(context, None, 5, IdSource(seed=2), print)
    assert by_keyword.root_headers == by_position.root_headers
    assert _state(by_keyword.root) == _state(by_position.root)


@pytest.mark.parametrize("cls", [NativeRequestTrace, PythonRequestTrace])
def test_misuse_raises_as_the_python_class_does(cls: type) -> None:
    trace = cls(TraceContext(b"t" * 16, b"r" * 8, True), None, 5, IdSource(seed=3), lambda ended: None)
    span = trace.child("narwhal.placement", 6)
    trace.finish(span, 7)
    with pytest.raises(RuntimeError, match="ended twice"):
        trace.finish(span, 8)
    assert span.end_ns == 7
    with pytest.raises(TypeError):
        trace.finish(trace.root, 9, "error by position")
    with pytest.raises(TypeError):
        trace.child("narwhal.placement")
    with pytest.raises(UnicodeEncodeError):
        cls(TraceContext(b"t" * 16, b"r" * 8, True, "caf\u00e9=1"), None, 5, IdSource(seed=3), print)


def test_a_sink_that_raises_reaches_the_caller() -> None:
    def sink(ended: list[Span]) -> None:
        raise ValueError("queue closed")

    trace = NativeRequestTrace(TraceContext(b"t" * 16, b"r" * 8, True), None, 5, IdSource(seed=4), sink)
    with pytest.raises(ValueError, match="queue closed"):
        trace.finish(trace.root, 6)


def test_a_trace_in_a_reference_cycle_is_collected() -> None:
    class Holder:
        trace: object = None

    holder = Holder()
    holder.trace = NativeRequestTrace(TraceContext(b"t" * 16, b"r" * 8, True), None, 5, IdSource(seed=5),
                                      lambda ended, holder=holder: None)
    gone = weakref.ref(holder)
    del holder
    gc.collect()
    assert gone() is None


def test_its_attributes_are_read_only() -> None:
    trace = NativeRequestTrace(TraceContext(b"t" * 16, b"r" * 8, True), None, 5, IdSource(seed=6), print)
    with pytest.raises(AttributeError):
        trace.root = None
