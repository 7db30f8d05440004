"""The process's tracer: turns a client's trace headers into one request's ``RequestTrace`` (pure, no I/O).

One per serving process (and per worker process), built only when ``[tracing] otlp_endpoint`` is set: the
request path holds None otherwise and does no tracing work at all.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from narwhal.config import TracingConfig
from narwhal.tracing.context import INVALID_SPAN_ID, IdSource, Sampler, TraceContext, parse_traceparent
from narwhal.tracing.spans import RequestTrace, Span

__all__ = ["Propagated", "Tracer"]

_LOW_64 = (1 << 64) - 1
_ONE_TRACE = (1).to_bytes(16, "big")


class Propagated:
    """A new trace this router does not sample: only its context travels (response and engine calls, flag 00)."""

    __slots__ = ("_header", "root_headers")

    sampled = False

    def __init__(self, traceparent: bytes, tracestate: str = "") -> None:
        self._header = (b"traceparent", traceparent)
        # What every engine call of the request carries (as ``RequestTrace.root_headers``).
        self.root_headers = b"\r\ntraceparent: " + traceparent
        if tracestate:
            self.root_headers += b"\r\ntracestate: " + tracestate.encode("ascii")

    def response_header(self) -> tuple[bytes, bytes]:
        return self._header


class Tracer:
    """Starts each request's trace: continues the client's context or begins one, and samples it."""

    __slots__ = ("_ids", "_sink", "now_ns", "sampler")

    def __init__(self, config: TracingConfig, sink: Callable[[list[Span]], None], *, ids: IdSource | None = None,
                 now_ns: Callable[[], int] = time.time_ns) -> None:
        self.sampler = Sampler(config.sample_ratio)
        self._sink = sink
        self._ids = ids or IdSource()
        # Span times are wall-clock Unix nanoseconds (what a collector shows); tests give their own.
        self.now_ns = now_ns

    def configure(self, config: TracingConfig) -> None:
        """A reload: requests that start from now on are sampled at the new ratio."""
        if config.sample_ratio != self.sampler.ratio:
            self.sampler = Sampler(config.sample_ratio)

    def begin(self, traceparent: bytes | None,
              tracestate: bytes | None) -> tuple[RequestTrace | None, tuple[bytes, bytes], bytes]:
        """What the request path needs of a new request's trace: the trace to record (None unless sampled), the
        response's ``traceparent`` header and the engine calls' header lines.

        A request without a ``traceparent`` that is not sampled (most, at a small ratio) is decided here without
        a trace object: one random number and one formatted header (``start`` does the rest)."""
        if traceparent is None:
            ids = self._ids
            # One draw: the trace id (the high 16 bytes), the root's span id and its first three children's.
            drawn = ids.bits(384)
            trace_bits = drawn >> 256
            # The trace id's low 8 bytes decide (as Sampler.sampled would).
            if (trace_bits & _LOW_64) >= self.sampler.bound:
                header = b"00-%032x-%016x-00" % (trace_bits or 1, (drawn & _LOW_64) or 1)
                return None, (b"traceparent", header), b"\r\ntraceparent: " + header
            raw = drawn.to_bytes(48, "big")
            trace_id, span_ids = raw[:16], raw[16:]
            # All-zero ids are invalid (W3C): about one draw in 2**61 has one.
            if not trace_bits:
                trace_id = _ONE_TRACE
            if INVALID_SPAN_ID in span_ids:
                span_ids = ids.span_ids(4)
            trace = RequestTrace(TraceContext(trace_id, span_ids[:8], True), None, self.now_ns(), ids, self._sink,
                                 span_ids[8:])
            return trace, trace.response_traceparent, trace.root_headers
        started = self.start(traceparent, tracestate)
        recorded = started if isinstance(started, RequestTrace) and started.sampled else None
        return recorded, started.response_header(), started.root_headers

    def start(self, traceparent: bytes | None, tracestate: bytes | None) -> RequestTrace | Propagated:
        """The trace of a request that arrived with these headers (either may be absent or malformed); a new trace
        that is not sampled costs one random number and one formatted header (``Propagated``)."""
        ids = self._ids
        parent = parse_traceparent(traceparent, tracestate) if traceparent is not None else None
        if parent is None:
            # A new trace, as ``begin`` starts one.
            trace, (_, header), _ = self.begin(None, None)
            return trace if trace is not None else Propagated(header)
        if not parent.sampled:
            # The client's decision: nothing recorded; its trace goes on with our span id, flag 00.
            return Propagated(b"00-%s-%016x-00" % (parent.trace_id.hex().encode(), ids.bits(64) or 1),
                              parent.tracestate)
        context = TraceContext(parent.trace_id, ids.span_id(), parent.sampled, parent.tracestate)
        return RequestTrace(context, parent_span_id=parent.span_id, start_ns=self.now_ns(), ids=ids,
                            sink=self._sink)
