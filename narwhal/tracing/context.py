"""W3C trace context (``traceparent``/``tracestate``), span and trace ids, and the sampler: pure, no I/O.

Follows https://www.w3.org/TR/trace-context/: lowercase hex only, all-zero ids and version ``ff`` invalid,
a future version read by version 00's fields (more may follow after a dash). A malformed header is
ignored (the router starts a new trace), never an error for the client.
"""

from __future__ import annotations

import os
import random
import re

import msgspec

__all__ = ["INVALID_SPAN_ID", "MAX_TRACESTATE_BYTES", "IdSource", "Sampler", "TraceContext", "format_traceparent",
           "parse_traceparent"]

# The spec asks vendors to pass on at least 512 bytes of tracestate; a longer one is dropped whole (not cut
# mid-member), so an engine never gets a truncated list.
MAX_TRACESTATE_BYTES = 512

_ZERO_TRACE = bytes(16)
# An all-zero span id is invalid (W3C); a draw holding one is drawn again.
INVALID_SPAN_ID = bytes(8)
# version-traceid-parentid-flags; a future version may add fields after another dash.
_TRACEPARENT = re.compile(rb"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?", re.DOTALL)
# Printable ASCII, space and tab: what may travel in a header value as it came.
_TRACESTATE = re.compile(rb"[\x20-\x7e\t]*")


class TraceContext(msgspec.Struct, frozen=True):
    """W3C trace context of one span."""

    trace_id: bytes  # 16 bytes, not all zero
    span_id: bytes  # 8 bytes, not all zero
    sampled: bool
    tracestate: str = ""  # the client's, passed on as is


def parse_traceparent(value: bytes | None, tracestate: bytes | None = None) -> TraceContext | None:
    """The context a client's ``traceparent`` (and ``tracestate``) carries, or None when absent or malformed."""
    if value is None:
        return None
    match = _TRACEPARENT.fullmatch(value.strip(b" \t"))
    if match is None:
        return None
    version, trace_hex, span_hex, flags_hex, rest = match.groups()
    if version == b"ff" or (version == b"00" and rest is not None):
        return None
    trace_id = bytes.fromhex(trace_hex.decode())
    span_id = bytes.fromhex(span_hex.decode())
    if trace_id == _ZERO_TRACE or span_id == INVALID_SPAN_ID:
        return None
    state = ""
    if tracestate is not None:
        tracestate = tracestate.strip(b" \t")
        if len(tracestate) <= MAX_TRACESTATE_BYTES and _TRACESTATE.fullmatch(tracestate):
            state = tracestate.decode("ascii")
    return TraceContext(trace_id, span_id, bool(int(flags_hex, 16) & 1), state)


def format_traceparent(context: TraceContext) -> bytes:
    """``00-<trace id>-<span id>-01`` (or ``-00`` when not sampled)."""
    return b"00-%s-%s-%s" % (context.trace_id.hex().encode(), context.span_id.hex().encode(),
                             b"01" if context.sampled else b"00")


class IdSource:
    """Random trace and span ids: a Mersenne twister seeded from the OS, a fraction of a microsecond an id.

    Not for secrets (ids are not); build one per process, so forked workers do not share a sequence.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._random = random.Random(int.from_bytes(os.urandom(16), "big") if seed is None else seed)
        # Random bits as an int (``bits(128)``): the tracer's path for a trace it does not sample.
        self.bits = self._random.getrandbits

    def trace_id(self) -> bytes:
        """16 random bytes, never all zero."""
        bits = self._random.getrandbits
        value = bits(128)
        while not value:
            value = bits(128)
        return value.to_bytes(16, "big")

    def span_ids(self, count: int) -> bytes:
        """``count`` span ids, 8 random bytes each, none all zero, as one string (one draw for all)."""
        bits, size = self._random.getrandbits, 8 * count
        ids = bits(64 * count).to_bytes(size, "big")
        # Eight zero bytes anywhere (an all-zero id among them) draw again: one search in C, not a loop.
        while INVALID_SPAN_ID in ids:
            ids = bits(64 * count).to_bytes(size, "big")
        return ids

    def span_id(self) -> bytes:
        """8 random bytes, never all zero."""
        bits = self._random.getrandbits
        value = bits(64)
        while not value:
            value = bits(64)
        return value.to_bytes(8, "big")


# As OpenTelemetry's TraceIdRatioBased: a root is sampled when its trace id's low 8 bytes are below the bound,
# so every process with the same ratio decides the same for one trace id.
_TRACE_ID_LIMIT = (1 << 64) - 1


class Sampler:
    """Parent-based ratio sampling: a parent's decision is followed; a root is sampled at ``ratio``."""

    def __init__(self, ratio: float) -> None:
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"sample ratio must be in [0, 1], got {ratio}")
        self.ratio = ratio
        # A root is sampled when its trace id's low 8 bytes, as an int, are below this.
        self.bound = round(ratio * (_TRACE_ID_LIMIT + 1))

    def sampled(self, parent: TraceContext | None, trace_id: bytes) -> bool:
        """Whether the span with this parent (None: a root) and trace id is recorded."""
        if parent is not None:
            return parent.sampled
        return int.from_bytes(trace_id[8:], "big") < self.bound
