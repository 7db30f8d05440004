"""One client request as an object: the ``Exchange``, its engine ``Leg`` s, and its ``request`` log line.

``RequestCore`` (``request_core.py``) makes one ``Exchange`` per completion
request and serves it; the exchange holds what the request is (route, parsed
body, request id, sink, start time, the stream join when it may be continued),
the legs it ran on engines, and how it ended. The ``request`` log line is
built here and nowhere else (``log_line``). No I/O beyond that line.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Protocol

import msgspec
import trio

from narwhal.config import EngineSpec
from narwhal.http1.pump import ClientSocket
from narwhal.obs.logs import log_fields
from narwhal.served_models import ServedModel
from narwhal.serving.continuation import StreamJoin
from narwhal.tracing.spans import RequestTrace, Span

__all__ = ["UNTRACED", "Exchange", "Leg", "LegKind", "RequestLine", "Sink"]

# The data pool's keyword for an engine request of an untraced exchange: none (never mutated).
UNTRACED: dict[str, bytes] = {}

# A continuation is a decode leg that resumes a stream the client already has bytes of.
LegKind = Literal["prefill", "decode", "continuation"]


class Sink(Protocol):
    """Where a response goes; the data-plane ``Responder`` is one."""

    started: bool
    # The whole response went out.
    finished: bool

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None: ...
    async def start_stream(self, status: int, headers: list[tuple[bytes, bytes]], first: bytes = b"",
                           end: bool = False) -> None: ...
    async def write(self, data: bytes) -> None: ...
    async def end_stream(self, last: bytes = b"") -> None: ...
    def direct(self) -> tuple[ClientSocket, bool] | None:
        """For the relay pump: the client connection of a started stream and whether it is chunk-framed;
        None when the pump cannot write to it (TLS, a test's sink)."""
        ...


class Leg:
    """One engine call of an exchange: its kind, engine, attempt, how its stream was relayed, how it failed."""

    __slots__ = ("attempt", "engine", "error", "kind", "relay", "request", "route", "span")

    def __init__(self, kind: LegKind, engine: EngineSpec, attempt: int, route: str,
                 request: dict[str, Any]) -> None:
        self.kind = kind
        self.engine = engine
        # The exchange's attempt this leg belongs to (1 for the first prefill/decode pair).
        self.attempt = attempt
        # The route and body this leg's engine is asked (a continuation's differ from the client's).
        self.route = route
        self.request = request
        # Who relayed the stream after the client's first bytes: "pump" (the process's pump) or "task".
        self.relay: str | None = None
        # The failure class that ended the leg, if one did.
        self.error: str | None = None
        # The leg's span while it runs (traced requests only).
        self.span: Span | None = None


class RequestLine(msgspec.Struct):
    """The ``request`` event's fields after its head (event, ts, level): names and order are an interface
    (docs/operations.md); a field is only ever added at the end."""

    request_id: str
    route: str
    status: int
    prefill: str | None
    decode: str | None
    ttft_ms: float | None
    tokens: int
    duration_ms: float
    attempts: int
    continuations: int
    join_gap_ms: float | None
    regenerated_tokens: int
    error: str | None
    continued_after: str | None
    prefix_match: float | None
    relay: str | None
    model: str | None
    tenant: str | None
    trace_id: str | None


class Exchange:
    """One completion request: what was asked, the legs served on engines, and the outcome its log line says.

    Every leg of the request runs under the request's deadline (``serving.request_deadline_s``
    from ``started_at``); a leg on an engine a reload removed is cut as well (``RequestCore._cut``).
    """

    __slots__ = ("admitted", "attempts", "continuations", "continued_after", "continuing", "deadline_at",
                 "deadline_scope", "decode", "error_class", "error_engine", "inter_token_s", "join", "join_gap_s",
                 "legs", "model", "prefill", "prefix_match", "prompt_tokens",
                 "regenerated", "request", "response_ids", "rid", "rid_header", "route", "sink", "started_at",
                 "queue_span", "status", "stream_error", "tenant", "tokens", "trace", "trace_kw", "ttft_s")

    def __init__(self, route: str, rid: str, sink: Sink, started_at: float) -> None:
        self.route = route
        self.rid = rid
        self.rid_header = (b"x-request-id", rid.encode("latin-1"))
        # The headers that say which request (and trace) a response answers: x-request-id, and traceparent.
        self.response_ids: tuple[tuple[bytes, bytes], ...] = (self.rid_header,)
        # The request's trace (None: tracing off), and the data pool keyword of the engine call in progress:
        # {"trace": header lines} naming that call's span, or UNTRACED.
        self.trace: RequestTrace | None = None
        self.trace_kw: dict[str, bytes] = UNTRACED
        # The narwhal.queue span while the request waits for capacity (sampled traces only).
        self.queue_span: Span | None = None
        self.sink = sink
        self.started_at = started_at
        # When the request deadline passes, in trio time, where a leg scope carries it (saturate policy).
        self.deadline_at = math.inf
        # The cancel scope that carries the request deadline (bounded policy), moved to the model's own.
        self.deadline_scope: trio.CancelScope | None = None
        # The served model the request names (set once validated; an alias resolved to its model).
        self.model: ServedModel | None = None
        # The parsed, validated body (empty until validated).
        self.request: dict[str, Any] = {}
        # The stream's join when a failed decode may be continued (bounded policy, streamed).
        self.join: StreamJoin | None = None
        self.legs: list[Leg] = []
        self.attempts = 0
        self.continuations = 0
        # The engines of the last attempt's legs, for the log line and telemetry.
        self.prefill: str | None = None
        self.decode: str | None = None
        # -- the outcome --
        self.status = 0
        self.ttft_s: float | None = None
        self.tokens = 0
        self.error_class: str | None = None
        self.error_engine: str | None = None
        self.inter_token_s: float | None = None
        # A continuable failure happened and its continuation has not finished yet.
        self.continuing = False
        # The longest wait a client saw at a join of this request.
        self.join_gap_s: float | None = None
        # The stream had begun (status 200) and ended with an SSE error event: the client saw a failure.
        self.stream_error = False
        # Share of the prompt the chosen prefill engine held (cache-aware placement).
        self.prefix_match: float | None = None
        # The failure class a stream was completed after (continued, or only its tail was lost).
        self.continued_after: str | None = None
        # Tokens continuations generated again from a whole character back (the client had them).
        self.regenerated = 0
        # Client auth: the tenant (its key's name), what it holds while served, and the prompt's token count.
        self.tenant: str | None = None
        self.admitted: Any = None
        self.prompt_tokens: int | None = None

    def attempt(self, prefill: EngineSpec, decode: EngineSpec, route: str,
                request: dict[str, Any]) -> tuple[Leg, Leg]:
        """A new attempt's two legs: a prefill, then a decode (a continuation once the client has bytes)."""
        self.attempts += 1
        join = self.join
        kind: LegKind = "decode"
        if join is not None and join.started:
            join.continuations += 1
            self.continuations += 1
            kind = "continuation"
        self.prefill, self.decode = prefill.name, decode.name
        legs = (Leg("prefill", prefill, self.attempts, route, request),
                Leg(kind, decode, self.attempts, route, request))
        self.legs += legs
        return legs

    def relay(self) -> str | None:
        """Who relayed the stream after its first bytes: "pump" if the pump relayed any leg, else "task"."""
        relay = None
        for leg in self.legs:
            if leg.relay == "pump":
                return "pump"
            relay = relay or leg.relay
        return relay

    def stream_completed(self) -> None:
        """The stream reached the client whole after a failure: no error for the request, the failure noted."""
        self.continued_after = self.error_class
        self.error_class = None

    def log_line(self, duration_s: float) -> None:
        """The ``request`` event (docs/operations.md): its fields, in this order, are an interface."""
        ttft_s, join_gap_s, prefix_match, trace = self.ttft_s, self.join_gap_s, self.prefix_match, self.trace
        log_fields("request", RequestLine(
            self.rid,
            self.route,
            self.status,
            self.prefill,
            self.decode,
            None if ttft_s is None else round(ttft_s * 1000, 3),
            self.tokens,
            round(duration_s * 1000, 3),
            self.attempts,
            self.continuations,
            None if join_gap_s is None else round(join_gap_s * 1000, 3),
            self.regenerated,
            self.error_class,
            self.continued_after,
            None if prefix_match is None else round(prefix_match, 3),
            self.relay(),
            None if self.model is None else self.model.name,
            self.tenant,
            None if trace is None or not trace.sampled else trace.trace_id_hex,
        ))
