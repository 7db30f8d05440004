"""The process's tracer: turns a client's trace headers into one request's ``RequestTrace`` (pure, no I/O).

One per serving process (and per worker process), built only when ``[tracing] otlp_endpoint`` is set: the
request path holds None otherwise and does no tracing work at all.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from narwhal.config import TracingConfig
from narwhal.tracing.context import IdSource, Sampler, TraceContext, parse_traceparent
from narwhal.tracing.spans import RequestTrace, Span

__all__ = ["Tracer"]


class Tracer:
    """Starts each request's trace: continues the client's context or begins one, and samples it."""

    __slots__ = ("_ids", "_sink", "now_ns", "sampler")

    def __init__(self, config: TracingConfig, sink: Callable[[Span], None], *, ids: IdSource | None = None,
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

    def start(self, traceparent: bytes | None, tracestate: bytes | None) -> RequestTrace:
        """The trace of a request that arrived with these headers (either may be absent or malformed)."""
        ids = self._ids
        parent = parse_traceparent(traceparent, tracestate) if traceparent is not None else None
        if parent is None:
            trace_id = ids.trace_id()
            context = TraceContext(trace_id, ids.span_id(), self.sampler.sampled(None, trace_id))
            return RequestTrace(context, parent_span_id=None, start_ns=self.now_ns(), ids=ids, sink=self._sink)
        context = TraceContext(parent.trace_id, ids.span_id(), parent.sampled, parent.tracestate)
        return RequestTrace(context, parent_span_id=parent.span_id, start_ns=self.now_ns(), ids=ids,
                            sink=self._sink)
