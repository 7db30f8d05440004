"""Spans as an OTLP/HTTP ``ExportTraceServiceRequest``, protobuf wire format written by hand: pure, no I/O.

No protobuf runtime at run time: the messages are small and fixed (opentelemetry-proto's trace.proto,
common.proto, resource.proto), and writing them directly is a few microseconds a span. The tests decode
the output with the official ``opentelemetry-proto`` classes, field by field.

``encode_request`` is the C encoder of ``_otlp_native`` when the install built it (the same bytes for about a
fifth of the instructions); ``python_encode_request`` otherwise, or when ``NARWHAL_NO_EXTENSIONS`` is set.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence

from narwhal.compiled import optional_module
from narwhal.tracing.spans import SPAN_NAMES, AttrValue, SharedAttributes, Span, SpanEvent

__all__ = ["NATIVE", "SCOPE_NAME", "encode_encoded", "encode_request", "encode_span", "encode_spans",
           "python_encode_request"]

SCOPE_NAME = "narwhal"

_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1
_pack_fixed64 = struct.Struct("<Q").pack
_pack_double = struct.Struct("<d").pack


# One-byte varints, made once: most lengths and enum values are below 128.
_SMALL = [bytes((n,)) for n in range(0x80)]


def _varint(value: int) -> bytes:
    if value < 0x80:
        return _SMALL[value]
    if value < 0x4000:
        # Two bytes: a span's own length, mostly.
        return bytes(((value & 0x7F) | 0x80, value >> 7))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag, the payload's length, the payload."""
    size = len(payload)
    return tag + (_SMALL[size] if size < 0x80 else _varint(size)) + payload


def _text(value: str) -> bytes:
    # A lone surrogate cannot be UTF-8; protobuf strings must be.
    return value.encode("utf-8", "replace")


# Tags ((field << 3) | wire type: 0 varint, 1 fixed64, 2 length-delimited).
_T1_LEN = b"\x0a"  # field 1, length-delimited
_T2_LEN = b"\x12"
_T3_LEN = b"\x1a"
_SPAN_NAME = b"\x2a"  # Span.name = 5
_SPAN_ATTR = b"\x4a"  # Span.attributes = 9
_SPAN_EVENT = b"\x5a"  # Span.events = 11
_SPAN_STATUS = b"\x7a"  # Span.status = 15
_EVENT_TIME = b"\x09"  # Event.time_unix_nano = 1 (fixed64)
_EVENT_NAME = b"\x12"  # Event.name = 2
_EVENT_ATTR = b"\x1a"  # Event.attributes = 3
_STATUS_MESSAGE = b"\x12"  # Status.message = 2
_STATUS_CODE = b"\x18"  # Status.code = 3 (varint)
_ANY_STRING = b"\x0a"  # AnyValue.string_value = 1
_ANY_BOOL_TRUE = b"\x12\x02\x10\x01"  # KeyValue.value = AnyValue{bool_value = 2: true}, whole
_ANY_BOOL_FALSE = b"\x12\x02\x10\x00"
_ANY_INT = b"\x18"  # AnyValue.int_value = 3 (varint, two's complement)
_ANY_DOUBLE = b"\x21"  # AnyValue.double_value = 4 (fixed64)

# Attribute keys and span names repeat from span to span: their encoded prefix is kept (bounded, as names are
# few but an attribute key could in principle be made of request data).
_KEYS: dict[str, bytes] = {}
_NAMES: dict[str, bytes] = {}
_MAX_CACHED = 1024


def _key(key: str) -> bytes:
    encoded = _KEYS.get(key)
    if encoded is None:
        if len(_KEYS) >= _MAX_CACHED:
            _KEYS.clear()
        encoded = _KEYS[key] = _field(_T1_LEN, _text(key))
    return encoded


def _key_value(key: str, value: AttrValue) -> bytes:
    """One ``KeyValue`` message's bytes (without its own tag)."""
    if value.__class__ is str:
        # First: the one attribute not kept encoded (a request id) is a string.
        text = value.encode("utf-8", "replace")
        size = len(text)
        if size < 0x7E:
            return _key(key) + b"\x12" + _SMALL[size + 2] + b"\x0a" + _SMALL[size] + text
        return _key(key) + _field(_T2_LEN, _field(_ANY_STRING, text))
    if value is True:
        body = _ANY_BOOL_TRUE
    elif value is False:
        body = _ANY_BOOL_FALSE
    elif isinstance(value, int) and _INT64_MIN <= value <= _INT64_MAX:
        body = _field(_T2_LEN, _ANY_INT + _varint(value if value >= 0 else value + (1 << 64)))
    elif isinstance(value, float):
        body = _field(_T2_LEN, _ANY_DOUBLE + _pack_double(value))
    else:
        # A string, or an int past int64 (shown as its digits rather than wrapped).
        body = _field(_T2_LEN, _field(_ANY_STRING, _text(str(value))))
    return _key(key) + body


# Most attributes repeat from request to request whole (a route, an engine, a model, a status, a retry number):
# each (key, value) item's tagged bytes are kept, one cache per tag, so encoding one is a dict lookup of the
# item ``dict.items()`` hands out. Keys whose values are one request's own, and floats, are not kept (they would
# only churn the cache). A key always takes values of one type here (True == 1 would share an entry otherwise).
_MAX_ATTRIBUTES = 8192
_UNIQUE_KEYS = frozenset({"narwhal.request_id"})
_SPAN_ATTRIBUTES: dict[tuple[str, AttrValue], bytes] = {}
_EVENT_ATTRIBUTES: dict[tuple[str, AttrValue], bytes] = {}


# A one-request string (a request id): the bytes before its text depend only on the tag, key and text length,
# so they are kept by those and the text appended (one concatenation instead of the nested fields).
_UNIQUE_HEADS: dict[tuple[bytes, str, int], bytes] = {}


def _attribute(cache: dict[tuple[str, AttrValue], bytes], tag: bytes, item: tuple[str, AttrValue]) -> bytes:
    """A cache miss: encode the item, and keep it unless its value is one request's own."""
    key, value = item
    if value.__class__ is str and key in _UNIQUE_KEYS:
        text = value.encode("utf-8", "replace")
        at = (tag, key, len(text))
        head = _UNIQUE_HEADS.get(at)
        if head is None:
            if len(_UNIQUE_HEADS) >= _MAX_CACHED:
                _UNIQUE_HEADS.clear()
            head = _UNIQUE_HEADS[at] = _field(tag, _key_value(key, value))[:-len(text) or None]
        return head + text
    encoded = _field(tag, _key_value(key, value))
    if key not in _UNIQUE_KEYS and value.__class__ is not float:
        if len(cache) >= _MAX_ATTRIBUTES:
            cache.clear()
        cache[item] = encoded
    return encoded


def _attributes(tag: bytes, attributes: dict[str, AttrValue]) -> bytes:
    # (encode_span does the same inline for a span's own attributes.)
    cache = _SPAN_ATTRIBUTES if tag == _SPAN_ATTR else _EVENT_ATTRIBUTES
    get = cache.get
    return b"".join([get(item) or _attribute(cache, tag, item) for item in attributes.items()])


def _event(event: SpanEvent) -> bytes:
    body = _EVENT_TIME + _pack_fixed64(event.time_ns) + _field(_EVENT_NAME, _text(event.name))
    if event.attributes:
        body += _attributes(_EVENT_ATTR, event.attributes)
    return _field(_SPAN_EVENT, body)


# A span's ``ScopeSpans.spans`` tag (2) and two-byte length (a span is 128 bytes to 16 KiB, mostly), then its
# ids, kind, start and end with their tags and lengths, in one pack: trace_id = 1 (16 bytes), span_id = 2 (8 bytes),
# parent_span_id = 4 (8 bytes; a root has none), kind = 6 (varint: 1..5, one byte), start and end (fixed64). The
# tags are constant arguments, so one C call writes everything of a span but its name and attributes.
_pack_child_head = struct.Struct("<BBBBB16sBB8sBB8sBBBQBQ").pack
_pack_root_head = struct.Struct("<BBBBB16sBB8sBBBQBQ").pack
# The same without the tag and length (a span under 128 bytes or over 16 KiB: its length is written apart).
_pack_child_ids = struct.Struct("<BB16sBB8sBB8sBBBQBQ").pack
_pack_root_ids = struct.Struct("<BB16sBB8sBBBQBQ").pack
_CHILD_HEAD = 58  # the ids, kind and times of a span with a parent, in bytes
_ROOT_HEAD = 48


def _name(name: str) -> bytes:
    """A cache miss: a span name's tagged bytes, kept (the interface's names are made at import)."""
    if len(_NAMES) >= _MAX_CACHED:
        _NAMES.clear()
    encoded = _NAMES[name] = _field(_SPAN_NAME, _text(name))
    return encoded


for _span_name in SPAN_NAMES:
    _name(_span_name)


def _encode_shared(shared: SharedAttributes) -> bytes:
    """A shared attribute set's bytes, made by the first span that carries it and kept on it."""
    shared.encoded = b"".join([_field(_SPAN_ATTR, _key_value(key, value)) for key, value in shared.attributes.items()])
    return shared.encoded


def encode_span(span: Span) -> bytes:
    """One span as the bytes of its ``ScopeSpans.spans`` field (``encode_request`` of one span)."""
    return encode_request((span,))


def python_encode_request(spans: Sequence[Span]) -> bytes:
    """Spans (a request's, mostly) as the bytes of their ``ScopeSpans.spans`` fields, one after another: what
    ``encode_encoded`` joins into an export request. One call a request, its loop inline: a traced request's
    encoding is fixed cost per span, not per attribute."""
    out: list[bytes] = []
    get = _SPAN_ATTRIBUTES.get
    name_of = _NAMES.get
    for span in spans:
        # Protobuf readers take fields in any order: ids, kind, times, name, then the attributes. The span's
        # size is known before its head is written, so the tag, length and head are one pack.
        shared = span.shared
        if shared is None:
            tail = [name_of(span.name) or _name(span.name)]
        else:
            tail = [name_of(span.name) or _name(span.name), shared.encoded or _encode_shared(shared)]
        # A loop, not a comprehension (a function call of its own on 3.11): a span has few attributes of its own.
        for item in span.attributes.items():
            tail.append(get(item) or _attribute(_SPAN_ATTRIBUTES, _SPAN_ATTR, item))
        if span.events:
            tail += [_event(event) for event in span.events]
        if span.status_code:
            status = _STATUS_CODE + _varint(span.status_code)
            if span.status_message:
                status = _field(_STATUS_MESSAGE, _text(span.status_message)) + status
            tail.append(_field(_SPAN_STATUS, status))
        body = b"".join(tail)
        parent = span.parent_span_id
        size = len(body) + (_ROOT_HEAD if parent is None else _CHILD_HEAD)
        if 0x80 <= size < 0x4000:
            low, high = (size & 0x7F) | 0x80, size >> 7
            if parent is not None:
                head = _pack_child_head(0x12, low, high, 0x0A, 16, span.trace_id, 0x12, 8, span.span_id, 0x22, 8,
                                        parent, 0x30, span.kind, 0x39, span.start_ns, 0x41, span.end_ns)
            else:
                head = _pack_root_head(0x12, low, high, 0x0A, 16, span.trace_id, 0x12, 8, span.span_id,
                                       0x30, span.kind, 0x39, span.start_ns, 0x41, span.end_ns)
            out += (head, body)
            continue
        if parent is not None:
            head = _pack_child_ids(0x0A, 16, span.trace_id, 0x12, 8, span.span_id, 0x22, 8, parent,
                                   0x30, span.kind, 0x39, span.start_ns, 0x41, span.end_ns)
        else:
            head = _pack_root_ids(0x0A, 16, span.trace_id, 0x12, 8, span.span_id,
                                  0x30, span.kind, 0x39, span.start_ns, 0x41, span.end_ns)
        out += (_T2_LEN, _varint(size), head, body)
    return b"".join(out)


def _native_encoder() -> Callable[[Sequence[Span]], bytes] | None:
    _otlp_native = optional_module("narwhal.tracing._otlp_native")
    if _otlp_native is None:  # the Python encoder, byte for byte the same
        return None
    # Where the span types keep their fields: the encoder reads them there, not through getattr.
    _otlp_native.bind(Span, SpanEvent, SharedAttributes)
    return _otlp_native.encode_request


_native = _native_encoder()
# Whether the C encoder runs (CI fails when its install did not build it).
NATIVE = _native is not None
encode_request: Callable[[Sequence[Span]], bytes] = _native or python_encode_request


def encode_spans(spans: Sequence[Span], *, service_name: str, scope_version: str) -> bytes:
    """One ``ExportTraceServiceRequest``: resource {service.name}, one scope "narwhal" holding ``spans``."""
    return encode_encoded([encode_request(spans)], service_name=service_name, scope_version=scope_version)


def encode_encoded(spans: Sequence[bytes], *, service_name: str, scope_version: str) -> bytes:
    """As ``encode_spans``, of spans already encoded (``encode_request``, ``encode_span``).

    The lengths of the enclosing messages are added up first and the spans copied once, in one join: a batch is
    hundreds of KiB, and each nesting made whole would copy it again (one fresh mapping of memory each).
    """
    # Resource.attributes = 1 inside ResourceSpans.resource = 1; Scope name and version inside ScopeSpans.scope = 1.
    resource = _field(_T1_LEN, _field(_T1_LEN, _key_value("service.name", service_name)))
    scope = _field(_T1_LEN, _field(_T1_LEN, _text(SCOPE_NAME)) + _field(_T2_LEN, _text(scope_version)))
    scope_spans_size = len(scope) + sum(map(len, spans))
    scope_spans_head = _T2_LEN + _varint(scope_spans_size)  # ResourceSpans.scope_spans = 2
    resource_spans_size = len(resource) + len(scope_spans_head) + scope_spans_size
    # ExportTraceServiceRequest.resource_spans = 1
    return b"".join((_T1_LEN, _varint(resource_spans_size), resource, scope_spans_head, scope, *spans))
