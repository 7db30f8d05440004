"""One request's spans: plain slotted objects, ended once and handed to a sink (the exporter): pure, no I/O.

Times are Unix nanoseconds given by the caller (the request path reads its clock once per step); nothing
here reads a clock or allocates beyond the span itself, so a traced request costs a few microseconds.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from narwhal.tracing.context import IdSource, TraceContext, format_traceparent

__all__ = [
    "KIND_CLIENT",
    "KIND_INTERNAL",
    "KIND_SERVER",
    "SPAN_NAMES",
    "STATUS_ERROR",
    "STATUS_OK",
    "STATUS_UNSET",
    "AttrValue",
    "RequestTrace",
    "Span",
    "SpanEvent",
]

AttrValue = str | int | float | bool

# OpenTelemetry's SpanKind and StatusCode, as numbered in OTLP.
KIND_INTERNAL = 1
KIND_SERVER = 2
KIND_CLIENT = 3
STATUS_UNSET = 0
STATUS_OK = 1
STATUS_ERROR = 2

# The span names are part of the interface (issue 40): dashboards and tests select by them.
SPAN_NAMES = frozenset({
    "narwhal.request", "narwhal.placement", "narwhal.prefill", "narwhal.decode", "narwhal.continuation",
    "narwhal.queue",
})


class SpanEvent(msgspec.Struct, frozen=True, array_like=True):
    """Something that happened at one instant of a span (e.g. evidence that ejects an engine)."""

    name: str
    time_ns: int
    attributes: dict[str, AttrValue]


class Span:
    """One operation of a request; mutable until ``end``, which may be called once."""

    __slots__ = ("trace_id", "span_id", "parent_span_id", "name", "kind", "start_ns", "end_ns", "attributes",
                 "events", "status_code", "status_message", "ended")

    def __init__(self, trace_id: bytes, span_id: bytes, parent_span_id: bytes | None, name: str, kind: int,
                 start_ns: int) -> None:
        self.trace_id = trace_id
        self.span_id = span_id
        self.parent_span_id = parent_span_id
        self.name = name
        self.kind = kind
        self.start_ns = start_ns
        self.end_ns = 0
        self.attributes: dict[str, AttrValue] = {}
        self.events: list[SpanEvent] = []
        self.status_code = STATUS_UNSET
        self.status_message = ""
        self.ended = False

    def __repr__(self) -> str:
        return f"Span({self.name!r}, span_id={self.span_id.hex()}, ended={self.ended})"

    def set(self, key: str, value: AttrValue) -> None:
        """Set one attribute (OpenTelemetry semantic-convention names where they exist)."""
        self.attributes[key] = value

    def event(self, name: str, time_ns: int, **attributes: AttrValue) -> None:
        """Record an event at ``time_ns``."""
        self.events.append(SpanEvent(name, time_ns, attributes))

    def end(self, end_ns: int, *, error: str | None = None) -> None:
        """End the span (status error with ``error`` as its message when given); a second end raises."""
        if self.ended:
            raise RuntimeError(f"span {self.name} {self.span_id.hex()} ended twice")
        self.ended = True
        self.end_ns = end_ns
        if error is not None:
            self.status_code = STATUS_ERROR
            self.status_message = error


class RequestTrace:
    """One request's spans: the root narwhal.request (server) and its children; hands them to a sink once ended.

    ``context`` is the root span's own context (a fresh span id; the trace id and sampling decision continued
    from the client's ``traceparent`` or new). An unsampled trace still gives ``traceparent_for`` (flag 00) so
    engines see the decision, but its spans never reach the sink.
    """

    __slots__ = ("context", "root", "root_headers", "sampled", "_flags_state", "_ids", "_root_traceparent", "_sink",
                 "_trace_head")

    def __init__(self, context: TraceContext, *, parent_span_id: bytes | None, start_ns: int, ids: IdSource,
                 sink: Callable[[Span], None]) -> None:
        self.context = context
        self.root = Span(context.trace_id, context.span_id, parent_span_id, "narwhal.request", KIND_SERVER,
                         start_ns)
        self._ids = ids
        self._sink = sink
        self.sampled = context.sampled
        # The root's traceparent: the client's response header, and what engine calls outside a leg carry.
        self._root_traceparent = format_traceparent(context)
        # What every engine call's lines share: before the span id, and after it (flags, the client's tracestate).
        self._trace_head = b"\r\ntraceparent: 00-" + context.trace_id.hex().encode() + b"-"
        state = context.tracestate
        self._flags_state = (b"-01" if context.sampled else b"-00") + (
            b"\r\ntracestate: " + state.encode("ascii") if state else b"")
        # The header lines of an engine call outside a leg (the data pool's ``trace``).
        self.root_headers = self._trace_head + context.span_id.hex().encode() + self._flags_state

    @property
    def trace_id_hex(self) -> str:
        """The trace id as the log line's ``trace_id`` field shows it (32 lowercase hex digits)."""
        return self.context.trace_id.hex()

    def child(self, name: str, start_ns: int, kind: int = KIND_INTERNAL) -> Span:
        """A new span under the root; an unsampled trace hands out its root instead (nothing is recorded, and
        engines get the root's id with the not-sampled flag), so it costs no span per step."""
        if not self.context.sampled:
            return self.root
        return Span(self.context.trace_id, self._ids.span_id(), self.root.span_id, name, kind, start_ns)

    def finish(self, span: Span, end_ns: int, *, error: str | None = None) -> None:
        """End ``span`` and hand it to the sink; nothing when the trace is not sampled."""
        if self.sampled:
            # Span.end, inline: once per span of every traced request.
            if span.ended:
                raise RuntimeError(f"span {span.name} {span.span_id.hex()} ended twice")
            span.ended = True
            span.end_ns = end_ns
            if error is not None:
                span.status_code = STATUS_ERROR
                span.status_message = error
            self._sink(span)

    def engine_headers(self, span: Span) -> bytes:
        """The header lines an engine request made within ``span`` carries (``traceparent``, and the client's
        ``tracestate`` when it sent one), each as ``\\r\\nname: value`` for the data pool's request head."""
        if span is self.root:
            return self.root_headers
        return self._trace_head + span.span_id.hex().encode() + self._flags_state

    def response_header(self) -> tuple[bytes, bytes]:
        """The ``traceparent`` the client's response carries: the root span's."""
        return (b"traceparent", self._root_traceparent)

    def traceparent_for(self, span: Span) -> bytes:
        """The ``traceparent`` an engine request made within ``span`` carries: the engine's spans join under it."""
        if span is self.root:
            return self._root_traceparent
        return b"00-%s-%s-%s" % (span.trace_id.hex().encode(), span.span_id.hex().encode(),
                                 b"01" if self.sampled else b"00")
