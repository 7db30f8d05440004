"""The C span encoder (``narwhal.tracing._otlp_native``) writes exactly the Python encoder's bytes.

The decode tests of test_tracing.py run whichever encoder the install built; these hold the two to the same
bytes over generated spans, the odd values included, and check which one runs.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.trace.v1.trace_pb2 import ScopeSpans

from narwhal.tracing import otlp
from narwhal.tracing.spans import KIND_CLIENT, STATUS_ERROR, SharedAttributes, Span, SpanEvent

native = pytest.importorskip("narwhal.tracing._otlp_native", reason="the C encoder was not built")


def test_ci_builds_and_runs_the_c_encoder() -> None:
    # A CI whose install silently fell back to Python would test only one encoder and bench the slow one.
    if os.environ.get("CI"):
        assert otlp.NATIVE
    assert otlp.encode_request is native.encode_request or not otlp.NATIVE


def test_narwhal_no_extensions_selects_the_python_encoder() -> None:
    code = "from narwhal.tracing import otlp; print(otlp.NATIVE, otlp.encode_request is otlp.python_encode_request)"
    env = {**os.environ, "NARWHAL_NO_EXTENSIONS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"]


def _python_bytes(spans: list[Span]) -> bytes:
    # The Python encoder keeps items by (key, value), where True == 1; the generated keys name their type, so a
    # key never meets both. A fresh copy of each shared set keeps the two encoders from reusing each other's bytes.
    fresh = {id(s.shared): SharedAttributes(dict(s.shared.attributes)) for s in spans if s.shared is not None}
    copies = [Span(s.trace_id, s.span_id, s.parent_span_id, s.name, s.kind, s.start_ns, s.end_ns, dict(s.attributes),
                   None if s.shared is None else fresh[id(s.shared)], s.events, s.status_code, s.status_message,
                   s.ended) for s in spans]
    return otlp.python_encode_request(copies)


class _Label(str):
    """A str subclass with its own __str__ (the encoders write str() of any value but an exact str)."""

    def __str__(self) -> str:
        return "label:" + super().__str__()


_texts = st.text(max_size=40) | st.text(alphabet="\ud800\udfffab\u00e9\U0001f600", max_size=8)
_values = st.one_of(
    st.tuples(st.just("s"), _texts | st.text(min_size=120, max_size=300)),
    st.tuples(st.just("b"), st.booleans()),
    st.tuples(st.just("i"), st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1)),
    st.tuples(st.just("big"), st.integers(min_value=1 << 63, max_value=1 << 80)
              | st.integers(max_value=-(1 << 63) - 1)),
    st.tuples(st.just("f"), st.floats(allow_nan=False)),
    st.tuples(st.just("sub"), _texts.map(_Label)),
    st.tuples(st.just("none"), st.none()),
)
_attributes = st.dictionaries(st.text(max_size=12), _values, max_size=6).map(
    lambda items: {f"{kind}.{key}": value for key, (kind, value) in items.items()})
_ids = st.binary(min_size=8, max_size=8)


@st.composite
def _spans(draw: st.DrawFn) -> list[Span]:
    shared = draw(st.lists(_attributes.map(SharedAttributes), max_size=2))
    spans = []
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        events = draw(st.none() | st.lists(st.builds(SpanEvent, _texts, st.integers(0, (1 << 64) - 1), _attributes),
                                           max_size=2))
        status = draw(st.sampled_from([0, 1, STATUS_ERROR]))
        spans.append(Span(draw(st.binary(min_size=16, max_size=16)), draw(_ids), draw(st.none() | _ids),
                          draw(st.sampled_from(["narwhal.request", "narwhal.decode"]) | _texts),
                          draw(st.integers(1, 5)), draw(st.integers(0, (1 << 64) - 1)),
                          draw(st.integers(0, (1 << 64) - 1)), draw(_attributes),
                          draw(st.none() | st.sampled_from(shared)) if shared else None, events, status,
                          draw(_texts) if status else ""))
    return spans


@settings(max_examples=300, deadline=None)
@given(_spans())
def test_the_c_encoder_writes_the_python_encoders_bytes(spans: list[Span]) -> None:
    expected = _python_bytes(spans)
    assert native.encode_request(spans) == expected
    # And again, now that the shared sets carry their bytes.
    assert native.encode_request(spans) == expected
    decoded = ScopeSpans.FromString(expected)
    assert [span.span_id for span in decoded.spans] == [span.span_id for span in spans]


@pytest.mark.parametrize("size", [0, 1, 100, 127, 128, 16_000, 16_384, 70_000, 3_000_000])
def test_every_length_width_is_the_same(size: int) -> None:
    # One-, two- and three-byte lengths, for the span and for the value inside it, and a span past the buffer
    # the encoder keeps between calls.
    span = Span(b"t" * 16, b"s" * 8, b"p" * 8, "narwhal.decode", KIND_CLIENT, 1, 2,
                {"narwhal.request_id": "x" * size})
    span.end(3, "boom")
    assert native.encode_request([span, span]) == otlp.python_encode_request([span, span])


def test_a_shared_sets_bytes_are_kept_on_it() -> None:
    shared = SharedAttributes({"narwhal.engine": "d1", "server.port": 8200, "narwhal.retry": 0})
    span = Span(b"t" * 16, b"s" * 8, None, "narwhal.request", KIND_CLIENT, 1, 2, shared=shared)
    native.encode_request([span])
    assert shared.encoded == b"".join(otlp._field(b"\x4a", otlp._key_value(key, value))
                                      for key, value in shared.attributes.items())


def test_a_span_subclass_and_odd_ids_take_the_slow_path_to_the_same_bytes() -> None:
    class Traced(Span):
        pass

    # Ids shorter or longer than their field are padded or cut, as struct's "16s" and "8s" do.
    span = Traced(b"short", b"s" * 12, b"", "narwhal.placement", 1, 5, 6, {"i.n": 7})
    assert native.encode_request([span]) == otlp.python_encode_request([span])


def test_a_value_whose_str_encodes_spans_gets_its_own_buffer() -> None:
    inner = Span(b"i" * 16, b"j" * 8, None, "narwhal.request", 2, 1, 2, {"s.k": "v"})

    class Reentrant:
        def __str__(self) -> str:
            return native.encode_request([inner]).hex()

    outer = Span(b"t" * 16, b"s" * 8, None, "narwhal.request", 2, 1, 2,
                 {"x.value": Reentrant(), "s.after": "z"})  # type: ignore[dict-item]
    assert native.encode_request([outer]) == otlp.python_encode_request([outer])


@pytest.mark.parametrize(("span", "error"), [
    (Span("not bytes", b"s" * 8, None, "n", 1, 1, 2), TypeError),  # type: ignore[arg-type]
    (Span(b"t" * 16, b"s" * 8, None, "n", 1, -1, 2), OverflowError),
    (Span(b"t" * 16, b"s" * 8, None, b"not text", 1, 1, 2), TypeError),  # type: ignore[arg-type]
])
def test_a_malformed_span_raises_and_the_next_call_is_whole(span: Span, error: type[Exception]) -> None:
    with pytest.raises(error):
        native.encode_request([span])
    good = Span(b"t" * 16, b"s" * 8, None, "narwhal.request", 2, 1, 2, {"s.k": "v"})
    assert native.encode_request([good]) == otlp.python_encode_request([good])
