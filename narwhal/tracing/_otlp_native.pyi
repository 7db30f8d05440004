from collections.abc import Sequence

from narwhal.tracing.spans import Span

def bind(span_type: type, event_type: type, shared_type: type, /) -> bool: ...

def encode_request(spans: Sequence[Span], /) -> bytes: ...
