"""One request's spans: structs ended once and handed to a sink (the exporter) together: pure, no I/O.

Times are Unix nanoseconds given by the caller (the request path reads its clock once per step); nothing
here reads a clock or allocates beyond the span itself, so a traced request costs a few microseconds.
"""

from __future__ import annotations

from binascii import hexlify
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from narwhal.compiled import optional_module
from narwhal.tracing.context import IdSource, TraceContext

__all__ = [
    "KIND_CLIENT",
    "KIND_INTERNAL",
    "KIND_SERVER",
    "NATIVE",
    "SPAN_NAMES",
    "STATUS_ERROR",
    "STATUS_OK",
    "STATUS_UNSET",
    "AttrValue",
    "PythonRequestTrace",
    "RequestTrace",
    "SharedAttributes",
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


class SharedAttributes:
    """Attributes many spans carry alike (a leg's engine, attempt, route and model): one read-only dict shared by
    those spans, whose OTLP bytes the encoder makes once (``encoded``) instead of once a span. A span's own
    attributes never repeat a key of its shared set (the encoder writes both, and OTLP keys are unique)."""

    __slots__ = ("attributes", "encoded")

    def __init__(self, attributes: dict[str, AttrValue]) -> None:
        self.attributes = attributes
        self.encoded: bytes | None = None


class Span(msgspec.Struct, gc=False):
    """One operation of a request; mutable until ``end``, which may be called once.

    Its attributes are its ``shared`` set's (if any) and its own ``attributes``, whose keys differ. A struct
    built in C (several a traced request) and left out of the garbage collector's scans: it holds no cycle.
    """

    trace_id: bytes
    span_id: bytes
    parent_span_id: bytes | None
    name: str
    kind: int
    start_ns: int
    end_ns: int = 0
    attributes: dict[str, AttrValue] = {}  # msgspec gives each span its own empty dict
    shared: SharedAttributes | None = None
    # None until the first event: most spans have none, and an empty list is one more object for the collector.
    events: list[SpanEvent] | None = None
    status_code: int = STATUS_UNSET
    status_message: str = ""
    ended: bool = False

    def __repr__(self) -> str:
        return f"Span({self.name!r}, span_id={self.span_id.hex()}, ended={self.ended})"

    def all_attributes(self) -> dict[str, AttrValue]:
        """Every attribute the span carries: its shared set's and its own."""
        if self.shared is None:
            return dict(self.attributes)
        return {**self.shared.attributes, **self.attributes}

    def set(self, key: str, value: AttrValue) -> None:
        """Set one attribute (OpenTelemetry semantic-convention names where they exist)."""
        self.attributes[key] = value

    def event(self, name: str, time_ns: int, **attributes: AttrValue) -> None:
        """Record an event at ``time_ns``."""
        if self.events is None:
            self.events = []
        self.events.append(SpanEvent(name, time_ns, attributes))

    def end(self, end_ns: int, error: str | None = None) -> None:
        """End the span (status error with ``error`` as its message when given); a second end raises."""
        if self.ended:
            raise RuntimeError(f"span {self.name} {self.span_id.hex()} ended twice")
        self.ended = True
        self.end_ns = end_ns
        if error is not None:
            self.status_code = STATUS_ERROR
            self.status_message = error


# Where, in an engine call's header lines (b"\r\ntraceparent: 00-<trace id>-<span id>-<flags>..."), the
# traceparent value and the span id's 16 hex digits start.
_TRACEPARENT_AT = len(b"\r\ntraceparent: ")
_SPAN_ID_AT = _TRACEPARENT_AT + len(b"00-") + 32 + len(b"-")


class PythonRequestTrace:
    """One request's spans: the root narwhal.request (server) and its children; hands them to a sink together
    when the root ends (one encode and one queue entry a request), a child that ends after its root alone.
    ``RequestTrace`` is this class, or its twin in C (``_spans_native``) when the install built it.

    ``context`` is the root span's own context (a fresh span id; the trace id and sampling decision continued
    from the client's ``traceparent`` or new). An unsampled trace still gives ``traceparent_for`` (flag 00) so
    engines see the decision, but its spans never reach the sink.
    """

    __slots__ = ("context", "response_traceparent", "root", "root_headers", "root_kw", "sampled", "_ended",
                 "_flags_state", "_ids", "_next_id", "_sink", "_span_ids", "_trace_head")

    def __init__(self, context: TraceContext, parent_span_id: bytes | None, start_ns: int, ids: IdSource,
                 sink: Callable[[list[Span]], None], span_ids: bytes = b"") -> None:
        """``span_ids``: ids already drawn for the children (8 bytes each; more are drawn as needed).

        Every traced request builds one, so its arguments may be given by position (a keyword call to a Python
        ``__init__`` costs twice a positional one) and its headers are cut from one formatted line."""
        self.context = context
        trace_id, root_id = context.trace_id, context.span_id
        self.root = Span(trace_id, root_id, parent_span_id, "narwhal.request", KIND_SERVER, start_ns)
        self._ids = ids
        self._sink = sink
        # The children ended so far, handed on with the root.
        self._ended: list[Span] = []
        # Child span ids, drawn a few at a time (a request's placement, prefill and decode).
        self._span_ids = span_ids
        self._next_id = 0
        self.sampled = sampled = context.sampled
        hexed = hexlify(trace_id + root_id)
        # The header lines of an engine call outside a leg: "\r\ntraceparent: 00-" trace id "-" span id "-" flags,
        # then the client's tracestate. A child's lines are the same with its own span id.
        lines = b"\r\ntraceparent: 00-%b-%b-%b" % (hexed[:32], hexed[32:], b"01" if sampled else b"00")
        state = context.tracestate
        if state:
            lines += b"\r\ntracestate: " + state.encode("ascii")
        self.root_headers = lines
        self._trace_head = lines[:_SPAN_ID_AT]
        self._flags_state = lines[_SPAN_ID_AT + 16:]
        # The root's traceparent: the client's response header, as the response's header list takes it.
        self.response_traceparent = (b"traceparent", lines[_TRACEPARENT_AT:_TRACEPARENT_AT + 55])
        # The data pool's keyword carrying the root's lines (shared by every such call of the request: a keyword
        # dict is only unpacked, never changed).
        self.root_kw = {"trace": lines}

    @property
    def trace_id_hex(self) -> str:
        """The trace id as the log line's ``trace_id`` field shows it (32 lowercase hex digits)."""
        return self.context.trace_id.hex()

    def child(self, name: str, start_ns: int, kind: int = KIND_INTERNAL,
              shared: SharedAttributes | None = None) -> Span:
        """A new span under the root (carrying ``shared``); an unsampled trace hands out its root instead (nothing
        is recorded, and engines get the root's id with the not-sampled flag), so it costs no span per step."""
        if not self.sampled:
            return self.root
        return Span(self.context.trace_id, self._next_span_id(), self.root.span_id, name, kind, start_ns,
                    shared=shared)

    def open(self, name: str, start_ns: int, kind: int = KIND_INTERNAL,
             shared: SharedAttributes | None = None) -> tuple[Span, dict[str, bytes]]:
        """``child``, with the data pool's keyword for the span's engine calls (``engine_kw``): what a leg asks
        for together (in one call: a request has two legs)."""
        if not self.sampled:
            return self.root, self.root_kw
        span_id = self._next_span_id()
        return (Span(self.context.trace_id, span_id, self.root.span_id, name, kind, start_ns, shared=shared),
                {"trace": self._trace_head + hexlify(span_id) + self._flags_state})

    def _next_span_id(self) -> bytes:
        at = self._next_id
        span_id = self._span_ids[at:at + 8]
        if not span_id:
            # The ids drawn with the trace are used up (a retry, a continuation): three more in one draw.
            self._span_ids = self._ids.span_ids(3)
            span_id, at = self._span_ids[:8], 0
        self._next_id = at + 8
        return span_id

    def finish(self, span: Span, end_ns: int, *, error: str | None = None) -> None:
        """End ``span``: the root hands every ended span to the sink, a child waits for it (or goes alone once
        the root has ended); nothing when the trace is not sampled."""
        if not self.sampled:
            return
        span.end(end_ns, error)
        root = self.root
        if span is root:
            ended = self._ended
            ended.append(span)
            self._sink(ended)
        elif root.ended:
            self._sink([span])
        else:
            self._ended.append(span)

    def engine_headers(self, span: Span) -> bytes:
        """The header lines an engine request made within ``span`` carries (``traceparent``, and the client's
        ``tracestate`` when it sent one), each as ``\\r\\nname: value`` for the data pool's request head."""
        return self.engine_kw(span)["trace"]

    def engine_kw(self, span: Span) -> dict[str, bytes]:
        """The data pool's keyword for an engine call made within ``span``: ``{"trace": engine_headers}`` (the
        root's is made once)."""
        if span is self.root:
            return self.root_kw
        return {"trace": self._trace_head + hexlify(span.span_id) + self._flags_state}

    def response_header(self) -> tuple[bytes, bytes]:
        """The ``traceparent`` the client's response carries: the root span's."""
        return self.response_traceparent

    def traceparent_for(self, span: Span) -> bytes:
        """The ``traceparent`` an engine request made within ``span`` carries: the engine's spans join under it."""
        if span is self.root:
            return self.response_traceparent[1]
        return b"00-%s-%s-%s" % (span.trace_id.hex().encode(), span.span_id.hex().encode(),
                                 b"01" if self.sampled else b"00")


def _native_request_trace() -> type[PythonRequestTrace] | None:
    _spans_native = optional_module("narwhal.tracing._spans_native")
    if _spans_native is None:  # the Python class, which behaves the same
        return None
    _spans_native.bind(Span)
    return _spans_native.RequestTrace


if TYPE_CHECKING:
    RequestTrace = PythonRequestTrace
else:
    RequestTrace = _native_request_trace() or PythonRequestTrace
# Whether the C RequestTrace runs (CI fails when its install did not build it).
NATIVE = RequestTrace is not PythonRequestTrace
