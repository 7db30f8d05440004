"""The request path: validate, admit, count tokens, place, prefill, decode, relay.

It knows no HTTP framework: ``RequestCore.handle`` reads a parsed request (route,
body, request id) and writes bytes to a ``Sink`` (``respond`` / ``start_stream``
/ ``write`` / ``end_stream``). The data-plane front hands it its ``Responder``;
tests hand it a recorder. Each request is an ``Exchange`` of legs
(``narwhal.serving.exchange``); a streamed decode leg goes through the one relay
loop (``narwhal.serving.relay``).

Evidence: every engine outcome is reported to the supervisor (failure with its
class, or the success row it earns); a client's 4xx is never engine failure.

Policies: ``saturate`` (default) makes one prefill/decode attempt and then
reports; ``bounded`` queues for capacity and retries within the request's
original deadline, each retry with a new prefill (fresh KV ownership). Tokens
already streamed to a client are never replayed: a failure after the first
byte ends the stream with an SSE error event and no ``[DONE]``, unless the
bounded policy continues the stream on another engine
(``narwhal.serving.continuation``).

An engine a config reload removed leaves the engine set (``set_engines``) once
its grace ran out: each leg still in flight on it is cut as an attempt failed
with ``engine_removed``, handled like any other failure but never evidence.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import random
import re
import time
from bisect import bisect_left
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, NoReturn, Protocol, TypeVar

import msgspec
import trio

from narwhal.auth.client_auth import Admitted, AuthRefused, ClientAuth, KeyMemo
from narwhal.auth.keys import KeyEntry
from narwhal.config import Config, EngineSpec, FleetConfig
from narwhal.errors import (
    ClientGone,
    EngineFailure,
    FailureClass,
    LocalResourceExhausted,
    NarwhalError,
    PoolSaturated,
    SuccessKind,
    UpstreamClientError,
)
from narwhal.fleet.placement import InFlight, least_outstanding
from narwhal.http1.pump import OnChunk, Pump, RelayBook
from narwhal.obs.logs import log_event
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.served_models import ServedModel, ServedModels
from narwhal.serving import continuation, request_spans
from narwhal.serving.client_view import (
    KV_KEY,
    choice_count,
    final_usage_tokens,
    is_role_only_event,
    strip_kv_from_body,
    strip_kv_from_events,
    wants_usage,
)
from narwhal.serving.continuation import CONTINUED_CLASSES, ENGINE_REMOVED, StreamJoin
from narwhal.serving.exchange import UNTRACED, Exchange, Leg, Sink
from narwhal.serving.placement import RequestPlacement
from narwhal.serving.relay import PumpRelay, Upstream, relay, relay_joined
from narwhal.tracing.spans import Span
from narwhal.tracing.tracer import Tracer
from narwhal.wire import PREFILL_KV_REQUEST, HandoffRejected, error_json, read_handoff

__all__ = ["COMPLETION_ROUTES", "AdmissionGate", "RequestCore", "Sink", "TelemetrySink"]

COMPLETION_ROUTES = ("/v1/completions", "/v1/chat/completions")
_CHAT_ROUTE = COMPLETION_ROUTES[1]

_JSON_HEADERS = [(b"content-type", b"application/json")]
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_DATA = b"data: "
_DONE = b"data: [DONE]"
# Bounded policy: how often a queued request looks for capacity again.
_QUEUE_POLL_S = 0.05
# A client's X-Request-Id longer than this (or not ASCII) is replaced by our own.
_MAX_REQUEST_ID = 128
_MAX_UPSTREAM_MESSAGE = 2048
_QUEUEABLE = frozenset({"no_capacity", "pool_saturated", "local_resource_exhausted"})
# A refusal for capacity tells the client when to try again (capacity frees as requests end).
_RETRY_AFTER = ((b"retry-after", b"1"),)
# Status codes as metric label text, made once: the per-tenant counter's label without a str() per request.
_STATUS_TEXT = [str(code) for code in range(600)]

_decode_json = msgspec.json.Decoder()
_encode_json = msgspec.json.Encoder()


class Supervisor(Protocol):
    """The part of the control plane the request path talks to."""

    def eligible(self, role: str, model: str | None = None) -> list[str]: ...
    def capacity_problem(self, model: str | None = None) -> str | None: ...
    def record_failure(self, engine: str, failure_class: FailureClass) -> None: ...
    def record_success(self, engine: str, kind: SuccessKind) -> None: ...


class AdmissionGate(Protocol):
    """Whether a new request may start: ``Admission`` in one process, a worker's ``WorkerView``."""

    def reason(self) -> str | None: ...


class TelemetrySink(Protocol):
    """Where each finished request's timings go: ``Telemetry`` in one process, a worker's ``TelemetryRelay``."""

    def record_request(self, *, prefill: str | None, decode: str | None, ttft_s: float | None,
                       inter_token_s: float | None, error_engine: str | None, status: int = 0,
                       error_class: str | None = None, failed: bool = False) -> None: ...


# A decode stream's body as the data pool hands it over: what the relay and the pump read.
DecodeStream = Upstream


class DataPool(Protocol):
    """The data pool's calls the request path makes (``narwhal.pools.data.DataPool``)."""

    # ``trace``: the engine call's trace context header lines; passed only when the request is traced.
    async def post_json(self, engine: EngineSpec, path: str, body: bytes, *, request_id: str,
                        trace: bytes = b"") -> tuple[int, bytes]: ...
    def stream(self, engine: EngineSpec, path: str, body: bytes, *,
               request_id: str, trace: bytes = b"") -> AbstractAsyncContextManager[DecodeStream]: ...
    @property
    def pump(self) -> Pump | None:
        """The process's relay pump; None where there is none (a test's pool)."""
        ...


class ClientError(NarwhalError):
    """A request the router refuses before or instead of serving it."""

    def __init__(self, status: int, message: str, type_: str, code: str | None = None,
                 headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        # Sent with the error (retry-after, x-ratelimit-*, www-authenticate).
        self.headers = headers

    def body(self) -> bytes:
        return error_json(self.message, self.type, self.code)


class _Uncountable(NarwhalError):
    """An engine's /tokenize could not count the tokens of an answer whose tokens came without IDs."""


class _AttemptFailed(NarwhalError):
    """One prefill/decode attempt failed before anything reached the client."""

    def __init__(self, error: ClientError, engine: str | None, failure_class: str, stage: str = "") -> None:
        super().__init__(error.message)
        self.error = error
        self.engine = engine
        self.failure_class = failure_class
        self.stage = stage


class _Usage(msgspec.Struct):
    completion_tokens: int = 0
    prompt_tokens: int | None = None


class _UsageOnly(msgspec.Struct):
    usage: _Usage | None = None


class _TokenizeCount(msgspec.Struct):
    count: int
    max_model_len: int | None = None


class _TokenizeResult(_TokenizeCount):
    # vLLM's /tokenize answer lists every token ID: read only where a KV event feed scores them.
    tokens: list[int] | None = None


_T = TypeVar("_T", bound=_TokenizeCount)


# Counting alone, a typed decoder skips the token IDs without building a list.
_decode_count = msgspec.json.Decoder(_TokenizeCount)
_decode_tokenize = msgspec.json.Decoder(_TokenizeResult)


def _is_token_ids(prompt: list[Any]) -> bool:
    """A prompt given as token IDs: a list of (non-boolean) integers."""
    return all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)


class _DeadlinePassed(NarwhalError):
    """The request deadline passed during an attempt whose leg scope carried it (saturate policy)."""


class _LegCut:
    """An attempt's cancel scope, in ``RequestCore._legs`` under the engine of its current leg.

    Under the saturate policy it also carries the request deadline (``deadline``), so a request
    enters one scope for both: ``removed`` tells a removal's cut from the deadline.
    """

    __slots__ = ("_by_engine", "_legs", "engine", "leg", "removed", "scope")

    def __init__(self, by_engine: dict[str, set[_LegCut]], engine: str, leg: str,
                 deadline: float = math.inf) -> None:
        self.scope = trio.CancelScope(deadline=deadline)
        self._by_engine = by_engine
        self._legs: set[_LegCut] | None = None
        self.engine = engine
        self.leg = leg
        self.removed = False
        self._register()

    def _register(self) -> None:
        legs = self._by_engine.get(self.engine)
        if legs is None:
            legs = self._by_engine[self.engine] = set()
        legs.add(self)
        self._legs = legs

    def cut(self) -> None:
        """The leg's engine was removed: cancel the scope, as a removal (not the deadline)."""
        self.removed = True
        self.scope.cancel()

    def move(self, engine: str, leg: str) -> None:
        """The next leg, on ``engine``: only its removal cuts the scope from now on."""
        self.drop()
        self.engine, self.leg = engine, leg
        self._register()

    def drop(self) -> None:
        if self._legs is not None:
            self._legs.discard(self)
            self._legs = None


def _listed(names: list[str]) -> str:
    """Model names for an error message: quoted, at most ten, then how many more."""
    shown = ", ".join(f"'{name}'" for name in names[:10])
    return shown if len(names) <= 10 else f"{shown} and {len(names) - 10} more"


def _model_label(ex: Exchange) -> str:
    """The ``model`` label of a request's series: its served model's own name, "" before it is known."""
    return ex.model.name if ex.model is not None else ""


def _sse_error(message: str, type_: str, code: str | None) -> bytes:
    return b"data: " + error_json(message, type_, code) + b"\n\n"


def _failure_error(exc: EngineFailure, leg: str) -> ClientError:
    status = 504 if exc.failure_class is FailureClass.TIMEOUT else 502
    return ClientError(status, f"{leg} engine {exc.engine} failed: {exc.failure_class}: {exc.message}",
                       "upstream_error", str(exc.failure_class))


class RequestCore:
    """Serves the two completion routes against the fleet."""

    def __init__(self, *, config: Config, supervisor: Supervisor, data_pool: DataPool,
                 in_flight: InFlight, admission: AdmissionGate, metrics: RouterMetrics,
                 telemetry: TelemetrySink | None = None,
                 clock: Callable[[], float] = trio.current_time, rng: random.Random | None = None,
                 placement: RequestPlacement | None = None, auth: ClientAuth | None = None,
                 tracer: Tracer | None = None) -> None:
        """``auth``: client keys, limits and the priority gate (None: none of it, as without ``[auth]``).
        ``tracer``: each request's trace ([tracing]; None: no tracing work at all). ``clock``: trio's (the
        request deadline is a trio deadline)."""
        self.config = config
        self.auth = auth
        self.tracer = tracer
        self.supervisor = supervisor
        self.data_pool = data_pool
        self.in_flight = in_flight
        self.admission = admission
        self.metrics = metrics
        self.telemetry = telemetry
        self.clock = clock
        self.rng = rng or random.Random()
        self.placement = placement or RequestPlacement(config, metrics, rng=self.rng)
        self.engines: dict[str, EngineSpec] = {spec.name: spec for spec in config.engines}
        self._serving = config.serving
        self._fleet = config.fleet
        # The models served, their aliases and per-model limits: rebuilt when the engines or [fleet] change.
        self.models = ServedModels(config.engines, config.fleet, config.serving)
        self._deadline_s = config.serving.request_deadline_s
        self._bounded = config.serving.policy == "bounded"
        self._continue_streams = self._bounded and config.serving.continue_streams
        self._count_tokens = config.serving.count_tokens
        # The process's relay pump (the data pool's), unless serving.relay_pump is off.
        self._pump: Pump | None = data_pool.pump if config.serving.relay_pump else None
        # What the relay hands a started stream to (None: the request task relays every stream itself).
        self._to_pump: PumpRelay | None = self._pump_relay if self._pump is not None else None
        # Each prefill engine's max_model_len, from its /tokenize answers: the limit for token-ID prompts.
        self._max_model_len: dict[str, int] = {}
        self._max_handoff_bytes = config.engine.max_handoff_bytes
        self._ids = itertools.count(1)
        self._id_prefix = os.urandom(4).hex()
        # The cancel scope of every engine leg in flight, by engine: a removed engine's are cut.
        self._legs: dict[str, set[_LegCut]] = {}
        # Each tenant's queue-wait bucket for a wait of 0 (``_observe_queue_wait``); bounded by the keys' names.
        self._zero_wait: dict[str, tuple[list[int], int]] = {}

    def set_engines(self, engines: Iterable[EngineSpec]) -> None:
        """The engine set changed (a config reload, through the snapshot): place on these from now on.

        Placement reads names from the snapshot, which never names an engine
        missing here. An engine that left (or whose url or role changed) left
        after serving.shutdown_grace_s: its legs still in flight are cut now
        (``_cuttable``), without blame.
        """
        specs = {spec.name: spec for spec in engines}
        for name, spec in self.engines.items():
            if specs.get(name) != spec:
                self._cut(name)
                if name not in specs:
                    self.in_flight.forget(name)
        self.engines = specs
        self.models = ServedModels(specs.values(), self._fleet, self._serving)

    def set_fleet(self, fleet: FleetConfig) -> None:
        """The [fleet] keys changed (a config reload, through the snapshot): models, aliases and limits follow."""
        self._fleet = fleet
        self.models = ServedModels(self.engines.values(), fleet, self._serving)

    def _cut(self, engine: str) -> None:
        cuts = self._legs.pop(engine, None)
        if cuts:
            log_event("engine_removal_cut", level=logging.WARNING, engine=engine, legs=len(cuts),
                      reason="still in flight after serving.shutdown_grace_s")
            for cut in cuts:
                cut.cut()

    @contextlib.contextmanager
    def _cuttable(self, engine: str, leg: str, deadline: float = math.inf) -> Iterator[None]:
        """One leg on ``engine``, cut (as a failed attempt that blames nobody) if the engine leaves meanwhile;
        ``deadline``: the request's, when this scope carries it (``_DeadlinePassed``)."""
        cut = _LegCut(self._legs, engine, leg, deadline)
        try:
            with cut.scope:
                yield
        finally:
            cut.drop()
        if cut.scope.cancelled_caught:
            if not cut.removed:
                raise _DeadlinePassed()
            raise self._removed(engine, leg)

    @staticmethod
    def _removed(engine: str, leg: str) -> _AttemptFailed:
        error = ClientError(502, f"{leg} engine {engine} was removed from the router's configuration and "
                            "the request was cut after serving.shutdown_grace_s", "upstream_error",
                            ENGINE_REMOVED)
        return _AttemptFailed(error, engine, ENGINE_REMOVED, leg)

    # -- entry point -------------------------------------------------------

    async def handle(self, route: str, body: bytes, request_id: bytes | None, sink: Sink,
                     authorization: bytes | None = None, traceparent: bytes | None = None,
                     tracestate: bytes | None = None, *, key_memo: KeyMemo | None = None) -> None:
        """Serve one completion request and write its response to ``sink``.

        ``traceparent``/``tracestate``: the client's trace context, read by the front only with tracing on;
        ``key_memo``: the client connection's last verified key (client keys on)."""
        started_at = self.clock()
        if request_id and len(request_id) <= _MAX_REQUEST_ID and request_id.isascii():
            rid = request_id.decode("ascii")
        else:
            rid = f"nw-{self._id_prefix}-{next(self._ids)}"
        ex = Exchange(route, rid, sink, started_at)
        tracer = self.tracer
        if tracer is not None:
            # Not sampled: nothing is recorded, and the request goes on as an untraced one (ex.trace None)
            # but for the context its engines and its client get (the root's, flag 00).
            trace, header, lines = tracer.begin(traceparent, tracestate)
            ex.trace = trace
            ex.response_ids = (ex.rid_header, header)
            # A sampled trace has the keyword made already (the root's lines).
            ex.trace_kw = {"trace": lines} if trace is None else trace.root_kw
        answered = False
        try:
            try:
                if self._bounded:
                    with trio.move_on_after(self._deadline_s) as deadline:
                        ex.deadline_scope = deadline
                        await self._serve(ex, body, authorization, key_memo)
                    expired = deadline.cancelled_caught
                else:
                    # One attempt, and every await of the request is inside it: its leg scope carries the
                    # deadline (one cancel scope fewer per request than a scope of its own here).
                    ex.deadline_at = started_at + self._deadline_s
                    try:
                        await self._serve(ex, body, authorization, key_memo)
                        expired = False
                    except _DeadlinePassed:
                        expired = True
                if expired and not _delivered(sink):
                    ex.error_class = "deadline"
                    if ex.continuing:
                        self.metrics.continuations.inc("exhausted", _model_label(ex))
                    deadline_s = self._deadline_s if ex.model is None else ex.model.request_deadline_s
                    message = f"request deadline of {deadline_s:g} s exceeded"
                    await self._fail(ex, ClientError(504, message, "timeout", "deadline_exceeded"))
            except ClientError as exc:
                await self._fail(ex, exc)
            answered = True
        except Exception as exc:
            gone = _client_gone(exc)
            if gone is not None:
                # The sink's write failed: the client went away or stopped reading (client_stalled).
                ex.status = 499
                ex.error_class = gone.reason
            else:
                # A bug of ours: the front answers 500, and the log must say 500, not blame the client.
                ex.status = 500
                ex.error_class = f"internal_error:{type(exc).__name__}"
            raise
        finally:
            if not answered and ex.status == 0:
                # Cancelled from outside (client went away, router stopping).
                ex.status = 499
                ex.error_class = ex.error_class or "client_disconnected"
            elif not answered and ex.status == 200 and not _delivered(sink):
                # A stream the client cut is 499, though its head said 200.
                ex.status = 499
                ex.error_class = "client_disconnected"
            self._finish(ex)

    async def _fail(self, ex: Exchange, error: ClientError) -> None:
        sink = ex.sink
        if sink.started:
            # Tokens already reached the client: say why the stream ends, never replay.
            ex.status = ex.status or 200
            ex.stream_error = True
            await sink.end_stream(_sse_error(error.message, error.type, error.code))
        else:
            ex.status = error.status
            await sink.respond(error.status, [*_JSON_HEADERS, *ex.response_ids, *error.headers], error.body())

    def _finish(self, ex: Exchange) -> None:
        admitted = ex.admitted
        if admitted is not None:
            self._finish_tenant(ex, admitted)
        duration_s = self.clock() - ex.started_at
        route = ex.route
        # The served model's own name (a bounded set); "" for a request refused before its model was known:
        # a name a client sent is never a label value.
        model = ex.model.name if ex.model is not None else ""  # _model_label, inline: once per request
        self.metrics.requests.inc(route, str(ex.status), model)
        self.metrics.request_duration.observe(duration_s, route, model)
        if ex.ttft_s is not None:
            self.metrics.ttft.observe(ex.ttft_s, route, model)
        if self.telemetry is not None:
            self.telemetry.record_request(prefill=ex.prefill, decode=ex.decode,
                                          ttft_s=ex.ttft_s, inter_token_s=ex.inter_token_s,
                                          error_engine=ex.error_engine, status=ex.status,
                                          error_class=ex.error_class or ex.continued_after,
                                          failed=ex.status >= 400 or ex.stream_error)
        trace = ex.trace
        if trace is not None:
            # The request's trace ends (inline: one call fewer a traced request).
            now_ns = time.time_ns()
            if ex.queue_span is not None:
                # Still waiting for capacity when the request ended (its deadline, the client left).
                trace.finish(ex.queue_span, now_ns, error=ex.error_class or "cancelled")
                ex.queue_span = None
            request_spans.end_request(trace, ex, now_ns)
        ex.log_line(duration_s)

    # -- the request's trace (only with [tracing] on: ``ex.trace`` is None otherwise) -----------------------

    @staticmethod
    def _queued(ex: Exchange, reason: str, waited_s: float = 0.0) -> None:
        """The request waits for capacity (``reason``) from now, or waited ``waited_s`` until now."""
        trace = ex.trace
        if trace is None or not trace.sampled:
            return
        now_ns = time.time_ns()
        if waited_s:
            trace.finish(request_spans.open_queue(trace, now_ns - int(waited_s * 1e9), reason), now_ns)
        elif ex.queue_span is None:
            ex.queue_span = request_spans.open_queue(trace, now_ns, reason)

    @staticmethod
    def _attempt_ended(ex: Exchange, exc: BaseException) -> None:
        """A traced request's attempt raised: a leg's span still open is ended with why.

        Called from ``_serve``'s handlers rather than by a wrapping coroutine: a wrapper would be one more frame
        on every resume of the attempt.
        """
        trace = ex.trace
        if trace is not None:
            now_ns = time.time_ns()
            why = (exc.failure_class if isinstance(exc, _AttemptFailed) else
                   "deadline" if isinstance(exc, _DeadlinePassed) else
                   exc.code or exc.type if isinstance(exc, ClientError) else
                   "cancelled" if isinstance(exc, trio.Cancelled) else type(exc).__name__)
            failed = exc if isinstance(exc, _AttemptFailed) else None
            for leg in ex.legs[-2:]:
                if leg.span is not None:
                    # Evidence against the leg's engine (what _translate recorded), not a removal's cut or a 4xx.
                    evidence = (failed is not None and failed.engine == leg.engine.name
                                and failed.failure_class != ENGINE_REMOVED)
                    request_spans.end_leg(trace, ex, leg, now_ns, error=leg.error or why,
                                          message=None if failed is None else failed.error.message,
                                          evidence=evidence)

    @staticmethod
    def _placed(ex: Exchange) -> None:
        """The wait for capacity, if any, ended: an attempt has its engines."""
        trace, span = ex.trace, ex.queue_span
        if trace is not None and span is not None:
            ex.queue_span = None
            trace.finish(span, time.time_ns())

    # -- one request ---------------------------------------------------------

    async def _serve(self, ex: Exchange, body: bytes, authorization: bytes | None = None,
                     key_memo: KeyMemo | None = None) -> None:
        # The gate compares the lease deadline itself, per request: no timer closes it on time.
        closed = self.admission.reason()
        if closed is not None:
            # Refused before the body is read: the model is not known yet.
            self.metrics.saturations.inc("admission_closed", "")
            raise ClientError(503, closed, "service_unavailable", "admission_closed")
        auth = self.auth
        key = None
        if auth is not None:
            # 401 before anything else is read of the request.
            try:
                key = auth.identify(authorization, key_memo)
            except AuthRefused as refused:
                self.metrics.tenant_refusals.inc("unknown", refused.reason)
                raise ClientError(refused.status, refused.message, refused.type, refused.code,
                                  refused.headers) from None
        route, rid, sink = ex.route, ex.rid, ex.sink
        request = ex.request = self._validate(route, body, ex)
        served = ex.model
        assert served is not None  # _validate names it
        if key is not None:
            assert auth is not None
            if self._bounded:
                await self._admit_waiting(auth, key, ex, request)
            else:
                # The saturate policy never waits for a slot: no coroutine for it.
                self._admit(auth, key, ex, request)
        if served.request_deadline_s != self._deadline_s:
            # The model's own deadline, from the request's start, as serving.request_deadline_s would be.
            shift = served.request_deadline_s - self._deadline_s
            if ex.deadline_scope is not None:
                ex.deadline_scope.deadline += shift
            else:
                ex.deadline_at += shift
        max_attempts = served.max_attempts
        join: StreamJoin | None = None
        not_continued: str | None = None
        if self._bounded and request.get("stream") is True:
            join, not_continued = continuation.plan(route, request, enabled=self._continue_streams)
            ex.join = join
        # Engines that failed this request: a retry goes elsewhere while it can.
        failed_engines: set[str] = set()
        # The decode engine whose failure a continuation resumes from: never its next decode.
        exclude: str | None = None
        leg_route, leg_request = route, request
        while True:
            if join is not None:
                leg = join.next_leg()
                if leg is None:
                    self.metrics.continuations.inc("not_eligible", _model_label(ex))
                    log_event("stream_not_continued", request_id=rid, reason=join.not_resumable)
                    raise ClientError(502, "the decode failed and its answer cannot be resumed: "
                                      + _NOT_RESUMABLE.get(join.not_resumable or "", "no place to resume"),
                                      "upstream_error", "not_continued")
                leg_route, leg_request = leg
            try:
                try:
                    await self._attempt(ex, leg_route, leg_request, failed_engines, exclude)
                except BaseException as exc:
                    if ex.trace is not None:
                        self._attempt_ended(ex, exc)
                    raise
                if ex.continuing:
                    self.metrics.continuations.inc("completed", _model_label(ex))
                    ex.stream_completed()
                return
            except _AttemptFailed as failed:
                if _delivered(sink):
                    # Cut (its engine removed) while the engine's body was read to its end: the answer is whole.
                    return
                ex.error_class = failed.failure_class
                # A leg cut because its engine was removed is nobody's failure (telemetry's errors too).
                ex.error_engine = None if failed.failure_class == ENGINE_REMOVED else failed.engine
                if failed.engine is not None:
                    failed_engines.add(failed.engine)
                queued = failed.failure_class in _QUEUEABLE
                if sink.started:
                    if ex.continuing and not queued:
                        self.metrics.continuations.inc("failed", _model_label(ex))
                    ex.continuing = False
                    await self._after_relay(ex, failed, not_continued, queued)
                    ex.continuing = join is not None and not join.finished
                    if join is not None and join.finished:
                        return
                    if failed.stage == "decode" and not queued:
                        exclude = failed.engine
                elif not self._bounded or (not queued and ex.attempts >= max_attempts):
                    raise failed.error from None
                if queued:
                    # Waiting for capacity is bounded by the request deadline, not by attempts.
                    if ex.trace is not None:
                        self._queued(ex, failed.failure_class)
                    await trio.sleep(_QUEUE_POLL_S)
                else:
                    retry: dict[str, Any] = {"class": failed.failure_class}
                    log_event("request_retry", request_id=rid, attempt=ex.attempts,
                              engine=failed.engine, continued=sink.started, **retry)
            except ClientError as refused:
                if join is None or not join.started or not _fills_context(refused):
                    raise
                await self._end_at_context(ex, join, refused)
                return

    def _admit(self, auth: ClientAuth, key: KeyEntry, ex: Exchange, request: dict[str, Any]) -> None:
        """The key's model, limits and a slot at once (saturate): refused here, a request never reaches an engine."""
        ex.tenant = key.name
        try:
            if key.models is not None:
                self._check_model(auth, key, ex, request)
            ex.admitted = auth.admit_now(key)
        except AuthRefused as refused:
            raise self._auth_refused(key, ex, refused) from None
        # Nothing waits under saturate: the wait of 0 is one bucket's count (``_observe_queue_wait``, inline).
        try:
            cell = self._zero_wait[key.name]
        except KeyError:
            self._observe_queue_wait(key.name, 0.0)
        else:
            cell[0][cell[1]] += 1

    async def _admit_waiting(self, auth: ClientAuth, key: KeyEntry, ex: Exchange, request: dict[str, Any]) -> None:
        """As ``_admit``, waiting in line for a slot (bounded) until the request's deadline."""
        ex.tenant = key.name
        deadline = ex.deadline_scope.deadline if ex.deadline_scope is not None else ex.deadline_at
        try:
            if key.models is not None:
                self._check_model(auth, key, ex, request)
            admitted = ex.admitted = await auth.admit(key, deadline)
        except AuthRefused as refused:
            raise self._auth_refused(key, ex, refused) from None
        self._observe_queue_wait(key.name, admitted.queue_wait_s)
        if ex.trace is not None and admitted.queue_wait_s > 0:
            self._queued(ex, "priority_gate", admitted.queue_wait_s)

    @staticmethod
    def _check_model(auth: ClientAuth, key: KeyEntry, ex: Exchange, request: dict[str, Any]) -> None:
        served = ex.model
        assert served is not None
        asked = request.get("model")
        auth.check_model(key, (asked if isinstance(asked, str) else served.name, served.name))

    def _auth_refused(self, key: KeyEntry, ex: Exchange, refused: AuthRefused) -> ClientError:
        self.metrics.tenant_refusals.inc(key.name, refused.reason)
        if refused.status == 503:
            self.metrics.saturations.inc(refused.code, ex.model.name if ex.model is not None else "")
        return ClientError(refused.status, refused.message, refused.type, refused.code, refused.headers)

    def _observe_queue_wait(self, tenant: str, waited_s: float) -> None:
        # Most requests wait nothing: their observation is one bucket's count, from a cell kept per tenant.
        if waited_s:
            self.metrics.tenant_queue_wait.observe(waited_s, tenant)
            return
        cell = self._zero_wait.get(tenant)
        if cell is None:
            histogram = self.metrics.tenant_queue_wait
            counts = histogram.cell(tenant)[0]
            cell = self._zero_wait[tenant] = (counts, bisect_left(histogram.bounds, 0.0))
        cell[0][cell[1]] += 1

    def _finish_tenant(self, ex: Exchange, admitted: Admitted) -> None:
        """Give back the request's gate slot and concurrency; count its tokens against the tenant."""
        ex.admitted = None
        auth = self.auth
        prompt = ex.prompt_tokens or 0
        name = admitted.key.name
        # ClientAuth.finish has nothing to do for an admission that holds nothing, of a tenant without limits.
        if auth is not None and (admitted.ticket is not None or admitted.limited or name in auth.limited):
            auth.finish(admitted, prompt + ex.tokens)
        # ``Counter.inc``'s work, inline, without a call: once per request with keys on, where every call counts
        # (docs/benchmarks.md).
        requests = self.metrics.tenant_requests.values
        status = ex.status
        label = (name, _STATUS_TEXT[status] if 100 <= status < 600 else str(status))
        try:
            requests[label] += 1.0
        except KeyError:
            requests[label] = 1.0
        if prompt or ex.tokens:
            tokens = self.metrics.tenant_tokens.values
            if prompt:
                label = (name, "prompt")
                try:
                    tokens[label] += prompt
                except KeyError:
                    tokens[label] = float(prompt)
            if ex.tokens:
                label = (name, "completion")
                try:
                    tokens[label] += ex.tokens
                except KeyError:
                    tokens[label] = float(ex.tokens)

    async def _after_relay(self, ex: Exchange, failed: _AttemptFailed, not_continued: str | None,
                           queued: bool) -> None:
        """A leg failed after the client had bytes: continue (return), finish, or end with the error."""
        join, rid = ex.join, ex.rid
        if join is None:
            if self._bounded:
                self.metrics.continuations.inc("not_eligible", _model_label(ex))
                log_event("stream_not_continued", request_id=rid, reason=not_continued)
            raise failed.error from None
        if join.finished:
            # The last token reached the client; only usage and [DONE] were lost.
            await self._end_with_tail(ex, join)
            return
        # A decode that broke, or a continuation's own leg that failed before relaying anything.
        continuable = failed.failure_class in CONTINUED_CLASSES or queued or (
            join.continuations > 0 and not join.leg_relayed)
        if not continuable:
            self.metrics.continuations.inc("not_eligible", _model_label(ex))
            log_event("stream_not_continued", request_id=rid, reason=f"class:{failed.failure_class}")
            raise failed.error from None
        assert ex.model is not None
        if not queued and ex.attempts >= ex.model.max_attempts:
            self.metrics.continuations.inc("exhausted", _model_label(ex))
            log_event("stream_not_continued", request_id=rid, reason="max_attempts")
            raise failed.error from None
        decode_engines = self.models.decode_engines.get(ex.model.name, frozenset())
        if failed.stage == "decode" and not decode_engines - {failed.engine}:
            # The continuation may not go back to the engine that failed, and there is no other.
            self.metrics.continuations.inc("not_eligible", _model_label(ex))
            log_event("stream_not_continued", request_id=rid, reason="no_other_decode_engine")
            raise failed.error from None

    async def _end_at_context(self, ex: Exchange, join: StreamJoin, refused: ClientError) -> None:
        """An engine refused a continuation because the answer so far fills its context: the answer ends as the
        uninterrupted one would have, with ``finish_reason: "length"``, its usage and [DONE]; no error event."""
        self.metrics.continuations.inc("context_full", _model_label(ex))
        log_event("stream_ended_at_context", request_id=ex.rid, prefill=ex.prefill, decode=ex.decode,
                  tokens=join.tokens, message=refused.message)
        join.end_at_context()
        ex.continuing = False
        await self._end_with_tail(ex, join)

    async def _end_with_tail(self, ex: Exchange, join: StreamJoin) -> None:
        """End a finished answer's stream after a failure: what ``join.tail`` owes (usage, counted by an engine if
        none gave it, and [DONE]); the request completed, with the failure noted."""
        if join.tail_needs_count:
            await self._count_tail(join, ex.rid, ex.model.name if ex.model is not None else None, ex.trace_kw)
        ex.tokens = join.tokens
        ex.status = 200
        await ex.sink.end_stream(join.tail())
        ex.stream_completed()

    def _validate(self, route: str, body: bytes, ex: Exchange) -> dict[str, Any]:
        try:
            request = _decode_json.decode(body)
        except msgspec.DecodeError as exc:
            raise ClientError(400, _json_problem(body, exc), "invalid_request_error", "invalid_json") from None
        except RecursionError:
            # msgspec stops at the interpreter's recursion limit (~1,000 levels).
            raise ClientError(400, "request body is nested too deeply", "invalid_request_error",
                              "invalid_json") from None
        if not isinstance(request, dict):
            raise ClientError(400, "request body must be a JSON object", "invalid_request_error",
                              "invalid_body")
        ex.model = self._served_model(request.get("model"))
        # An alias is the model's: the engines get its own name, and their answers carry it.
        request["model"] = ex.model.name
        if route == "/v1/chat/completions":
            messages = request.get("messages")
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                raise ClientError(400, "'messages' must be a non-empty array of message objects",
                                  "invalid_request_error", "invalid_messages")
        else:
            prompt = request.get("prompt")
            if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt)):
                raise ClientError(400, "'prompt' must be a string or a non-empty array",
                                  "invalid_request_error", "invalid_prompt")
            if isinstance(prompt, list) and not _is_token_ids(prompt):
                if all(isinstance(p, str | list) for p in prompt):
                    # One request is one prefill/decode handoff; a batch would need one per prompt.
                    raise ClientError(400, "a list of prompts is not supported: Narwhal hands one prompt's KV "
                                      "cache from prefill to decode per request; send each prompt as its own "
                                      "request", "invalid_request_error", "prompt_list_unsupported")
                raise ClientError(400, "'prompt' must be a string or an array of token IDs (integers)",
                                  "invalid_request_error", "invalid_prompt")
        stream = request.get("stream", False)
        if not isinstance(stream, bool):
            raise ClientError(400, "'stream' must be a boolean", "invalid_request_error", "invalid_stream")
        for key in ("max_tokens", "max_completion_tokens"):
            value = request.get(key)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ClientError(400, f"'{key}' must be a positive integer", "invalid_request_error",
                                  f"invalid_{key}")
        # A client does not choose KV placement; the router owns the handoff.
        request.pop("kv_transfer_params", None)
        return request

    def _served_model(self, model: Any) -> ServedModel:
        """The served model a request's ``model`` names; a 400 or 404 (OpenAI's errors) when it names none."""
        models = self.models
        if isinstance(model, str):
            served = models.by_name.get(model)
            if served is not None:
                return served
            raise ClientError(404, f"The model '{model}' does not exist (this router serves "
                              f"{_listed(models.names())})", "invalid_request_error", "model_not_found")
        if model is not None:
            raise ClientError(400, "'model' must be a string", "invalid_request_error", "invalid_model")
        if models.only is not None:
            return models.only
        raise ClientError(400, f"'model' is required: this router serves {len(models)} models "
                          f"({_listed(models.names())})", "invalid_request_error", "missing_model")

    def _candidates(self, role: str, avoid: set[str], model: str | None, exclude: str | None = None) -> list[str]:
        candidates = self.supervisor.eligible(role, model)
        if role == "prefill" and self.placement.required:
            candidates = self.placement.prefill_candidates(candidates)
        if exclude is not None:
            # A continuation's decode never goes back to the engine that just broke the stream.
            candidates = [name for name in candidates if name != exclude]
        if avoid:
            # Fall back to an engine that failed this request only when no other is eligible.
            candidates = [name for name in candidates if name not in avoid] or candidates
        return candidates

    def _place(self, role: str, avoid: set[str], route: str, request: dict[str, Any], ex: Exchange,
               exclude: str | None = None, tokens: Sequence[int] | None = None, span: Span | None = None) -> str:
        model = ex.model.name if ex.model is not None else None
        candidates = self._candidates(role, avoid, model, exclude)
        choice = self.placement.choose(role, candidates, route, request, self.in_flight, model or "", tokens)
        if choice is None:
            self.metrics.saturations.inc(f"no_{role}", model or "")
            problem = self.supervisor.capacity_problem(model) or (
                "serving capacity exhausted: no prefill engine with a live KV event feed "
                "(placement.kv_events = \"required\")"
                if role == "prefill" and self.placement.kv is not None and self.placement.kv.mode == "required"
                and self.supervisor.eligible(role, model) else
                f"serving capacity exhausted: no eligible {role} engine")
            raise _AttemptFailed(ClientError(503, problem, "service_unavailable", "no_capacity"),
                                 None, "no_capacity")
        if role == "prefill":
            ex.prefix_match = choice.matched
        if span is not None:
            request_spans.placed(span, role, choice, len(candidates))
        return choice.engine

    async def _attempt(self, ex: Exchange, route: str, request: dict[str, Any], avoid: set[str],
                       exclude: str | None = None) -> None:
        join, rid = ex.join, ex.rid
        counted: _TokenizeResult | None = None
        feeds = self.placement.kv
        trace = ex.trace
        placing = None if trace is None or not trace.sampled else trace.child("narwhal.placement", time.time_ns())
        try:
            if feeds is not None and feeds.active and not (join is not None and join.started):
                if trace is not None and placing is not None:
                    # Placement's own engine calls (/tokenize for the KV event feeds) name its span.
                    ex.trace_kw = trace.engine_kw(placing)
                # The engines' KV events key blocks by token IDs: the prompt's are asked before the choice.
                counted = await self._tokens_for_placement(route, request, ex, avoid)
            prefill_name = self._place("prefill", avoid, route, request, ex,
                                       tokens=counted.tokens if counted is not None else None, span=placing)
            decode_name = self._place("decode", avoid, route, request, ex, exclude, span=placing)
        except BaseException as exc:
            if trace is not None and placing is not None:
                ex.trace_kw = trace.root_kw
                failure = getattr(exc, "failure_class", type(exc).__name__)
                # Polling for capacity: the first refusal says why the request waits, the queue span how long.
                if ex.queue_span is None or failure not in _QUEUEABLE:
                    trace.finish(placing, time.time_ns(), error=failure)
            raise
        if trace is not None:
            if placing is not None:
                ex.trace_kw = trace.root_kw
                trace.finish(placing, time.time_ns())
            if ex.queue_span is not None:
                self._placed(ex)
        prefill, decode = ex.attempt(self.engines[prefill_name], self.engines[decode_name], route, request)
        in_flight = self.in_flight
        # One cancel scope for both legs (a scope costs as much as the rest of a leg's bookkeeping),
        # registered under the engine of the leg in progress, so a removed engine cuts only its own leg.
        cut = _LegCut(self._legs, prefill_name, "prefill", ex.deadline_at)
        decoded = False
        try:
            with cut.scope:
                in_flight.acquire(prefill_name)
                if trace is not None:
                    prefill.span = request_spans.open_leg(trace, ex, prefill, time.time_ns())
                try:
                    if (self._count_tokens or counted is not None) and not (join is not None and join.started):
                        # A continuation's prompt grew by exactly the tokens its max_tokens shrank by.
                        prompt_tokens = await self._check_context(route, request, prefill.engine, rid, counted,
                                                                  trace=ex.trace_kw)
                        ex.prompt_tokens = prompt_tokens
                        if join is not None and prompt_tokens is not None:
                            join.note_prompt_tokens(prompt_tokens)
                    if join is not None and join.started and join.uncounted:
                        # Tokens came without IDs: the engine counts what the client has, and the leg is
                        # built again from its count (never from events, which may carry several tokens).
                        try:
                            await self._count_join(join, prefill.engine, rid, trace=ex.trace_kw)
                        except _Uncountable as exc:
                            self.metrics.continuations.inc("not_eligible", _model_label(ex))
                            log_event("stream_not_continued", request_id=rid, reason="uncounted")
                            raise ClientError(502, "the decode failed and its answer cannot be resumed: the engine "
                                              "sent no token IDs and the tokens the client has cannot be counted "
                                              f"({exc})", "upstream_error", "not_continued") from None
                        leg = join.next_leg()
                        assert leg is not None
                        prefill.route, prefill.request = decode.route, decode.request = leg
                        ex.tokens = join.tokens
                    kv = await self._prefill(prefill.route, prefill.request, prefill.engine, rid, trace=ex.trace_kw)
                    if trace is not None:
                        if prefill.span is not None and trace.sampled:
                            prefill.span.attributes["narwhal.kv_handoff.bytes"] = len(kv)
                        request_spans.end_leg(trace, ex, prefill, time.time_ns())
                finally:
                    in_flight.release(prefill_name)
                if not cut.scope.cancel_called:
                    cut.move(decode_name, "decode")
                    in_flight.acquire(decode_name)
                    if trace is not None:
                        decode.span = request_spans.open_leg(trace, ex, decode, time.time_ns())
                    try:
                        await self._decode_leg(ex, decode, kv)
                    finally:
                        in_flight.release(decode_name)
                    decoded = True
                    if trace is not None:
                        request_spans.end_leg(trace, ex, decode, time.time_ns())
        except _AttemptFailed as failed:
            (decode if cut.leg == "decode" else prefill).error = failed.failure_class
            raise
        finally:
            cut.drop()
        if cut.scope.cancel_called and not cut.removed and (cut.scope.cancelled_caught or not decoded):
            # The request deadline (saturate: this scope carries it) cut the attempt, or passed before its decode.
            raise _DeadlinePassed()
        if cut.scope.cancelled_caught:
            (decode if cut.leg == "decode" else prefill).error = ENGINE_REMOVED
            raise self._removed(cut.engine, cut.leg)
        if not decoded:
            # The prefill engine was cut just as its leg ended (no checkpoint left to see it): the prefill
            # counts, and the decode runs under a scope of its own, as with one scope per leg.
            in_flight.acquire(decode_name)
            if trace is not None:
                decode.span = request_spans.open_leg(trace, ex, decode, time.time_ns())
            try:
                with self._cuttable(decode_name, "decode", ex.deadline_at):
                    await self._decode_leg(ex, decode, kv)
                if trace is not None:
                    request_spans.end_leg(trace, ex, decode, time.time_ns())
            except _AttemptFailed as failed:
                decode.error = failed.failure_class
                raise
            finally:
                in_flight.release(decode_name)

    def _decode_leg(self, ex: Exchange, leg: Leg, kv: msgspec.Raw) -> Coroutine[Any, Any, None]:
        """The decode leg's coroutine, awaited by its caller (no await level of its own on the relay's path)."""
        if ex.join is not None:
            return self._decode_joined(ex, leg, kv, ex.join)
        return self._decode(ex, leg, kv)

    async def _engine_call(self, leg: str, call: Any) -> Any:
        """Await one engine call, turning its failure into evidence and a client error."""
        try:
            return await call
        except (EngineFailure, UpstreamClientError, PoolSaturated) as exc:
            self._translate(leg, exc)

    def _translate(self, leg: str, exc: Exception) -> NoReturn:
        """The one place engine outcomes become evidence and client-facing errors."""
        if isinstance(exc, EngineFailure):
            self.supervisor.record_failure(exc.engine, exc.failure_class)
            log_event("engine_failure", level=logging.WARNING, engine=exc.engine, stage=leg,
                      **{"class": exc.failure_class.value}, cause=exc.cause, message=exc.message,
                      model=self.models.engines.get(exc.engine, ""))
            raise _AttemptFailed(_failure_error(exc, leg), exc.engine, exc.failure_class.value, leg) from None
        if isinstance(exc, UpstreamClientError):
            self.supervisor.record_success(exc.engine, SuccessKind.CLIENT_4XX)
            raise ClientError(exc.status, _upstream_message(exc), "invalid_request_error",
                              "upstream_rejected") from None
        if isinstance(exc, LocalResourceExhausted):
            # Our process is short of fds or memory: the engine did nothing wrong.
            log_event("local_resource_exhausted", level=logging.ERROR, engine=exc.engine, stage=leg,
                      errno=exc.errno_name, message=str(exc))
            self.metrics.saturations.inc("local_resources", self.models.engines.get(exc.engine, ""))
            raise _AttemptFailed(ClientError(503, f"router out of local resources ({exc.errno_name}); "
                                             "try again later", "service_unavailable", "local_resource_exhausted"),
                                 None, "local_resource_exhausted") from None
        # The data pool is shared by every model and its saturation names no engine: router-wide, model "".
        self.metrics.saturations.inc("pool", "")
        raise _AttemptFailed(ClientError(503, "router saturated: no free data connection",
                                         "service_unavailable", "pool_saturated", _RETRY_AFTER),
                             None, "pool_saturated") from None

    async def _tokens_for_placement(self, route: str, request: dict[str, Any], ex: Exchange,
                                    avoid: set[str]) -> _TokenizeResult | None:
        """The prompt's token IDs (and count) when a live KV event feed would score them, else None.

        A text prompt is tokenized by one of the model's prefill engines (any: they share the model's
        tokenizer), the least loaded; its failure is that engine's, as a prefill's would be. An answer
        without IDs leaves placement to the approximate index.
        """
        model = ex.model.name if ex.model is not None else None
        candidates = self._candidates("prefill", avoid, model)
        if not self.placement.wants_tokens(candidates):
            return None
        prompt = request.get("prompt")
        if route != _CHAT_ROUTE and isinstance(prompt, list):
            return _TokenizeResult(len(prompt), None, prompt)
        engine = self.engines[least_outstanding(candidates, self.in_flight.loader(), self.rng)]
        with trio.CancelScope(deadline=ex.deadline_at) as scope:
            self.in_flight.acquire(engine.name)
            try:
                counted = await self._tokenize(route, request, engine, ex.rid, _decode_tokenize, ex.trace_kw)
            finally:
                self.in_flight.release(engine.name)
        if scope.cancelled_caught:
            raise _DeadlinePassed()
        return counted if counted is not None and counted.tokens is not None else None

    async def _tokenize(self, route: str, request: dict[str, Any], engine: EngineSpec, rid: str,
                        decoder: msgspec.json.Decoder[_T], trace: Mapping[str, bytes] = UNTRACED) -> _T | None:
        """The prompt's /tokenize answer from ``engine`` (None when unreadable: no reason to refuse the request).

        The engine's failure is this attempt's (``_translate``); the context length it reports is kept.
        """
        query = ({"model": request["model"], "messages": request["messages"]} if route == _CHAT_ROUTE
                 else {"model": request["model"], "prompt": request.get("prompt")})
        try:
            _, raw = await self.data_pool.post_json(engine, "/tokenize", _encode_json.encode(query), request_id=rid,
                                                    **trace)
        except (EngineFailure, UpstreamClientError, PoolSaturated) as exc:
            self._translate("tokenize", exc)
        try:
            counted = decoder.decode(raw)
        except (msgspec.DecodeError, RecursionError):
            return None
        if counted.max_model_len is not None:
            self._max_model_len[engine.name] = counted.max_model_len
        return counted

    async def _check_context(self, route: str, request: dict[str, Any], prefill: EngineSpec,
                             rid: str, counted: _TokenizeResult | None = None, *,
                             trace: Mapping[str, bytes] = UNTRACED) -> int | None:
        """Refuse a prompt the context cannot hold; returns the prompt's token count when /tokenize gave it.

        ``counted``: the prompt's count already asked (placement's token IDs), not asked again.
        """
        prompt = request.get("prompt")
        if counted is not None:
            if counted.max_model_len is None:
                counted = _TokenizeResult(counted.count, self._max_model_len.get(prefill.name))
        elif route != "/v1/chat/completions" and isinstance(prompt, list):
            # Token IDs count themselves, and vLLM's /tokenize takes only a string: the limit is the one this
            # engine's last /tokenize answer gave; none known yet, the engine judges (its 400 is the client's).
            counted = _TokenizeResult(len(prompt), self._max_model_len.get(prefill.name))
        else:
            count = await self._tokenize(route, request, prefill, rid, _decode_count, trace)
            if count is None:
                return None
            counted = _TokenizeResult(count.count, count.max_model_len)
        limit = counted.max_model_len
        if limit is None:
            return counted.count
        if counted.count > limit:
            raise ClientError(400, f"the prompt is {counted.count} tokens, more than the model's "
                              f"context length of {limit}", "invalid_request_error", "context_length_exceeded")
        wanted = request.get("max_completion_tokens") or request.get("max_tokens")
        if wanted is not None and counted.count + wanted > limit:
            raise ClientError(400, f"the prompt ({counted.count} tokens) plus max_tokens ({wanted}) exceeds "
                              f"the model's context length of {limit}", "invalid_request_error",
                              "context_length_exceeded")
        return counted.count

    async def _count_join(self, join: StreamJoin, engine: EngineSpec, rid: str, *,
                          trace: Mapping[str, bytes] = UNTRACED) -> None:
        """Count, with ``engine``'s /tokenize, the tokens of all the text the client has (and the original prompt,
        when no engine has said yet): a leg without token IDs tells the router only how many events it sent.

        The engine's failure is this attempt's (evidence, and the next attempt counts elsewhere); an answer
        that cannot count (a 4xx, an unreadable body) raises _Uncountable.
        """
        model = join.request.get("model")
        text_query = ({"model": model, "prompt": join.output_text, "add_special_tokens": False}
                      if join.uncounted else None)
        prompt_query = join.prompt_query()
        queries = [text_query, None if prompt_query is None else {"model": model, **prompt_query}]
        counts: list[int | None] = []
        for query in queries:
            if query is None:
                counts.append(None)
                continue
            try:
                _, raw = await self.data_pool.post_json(engine, "/tokenize", _encode_json.encode(query),
                                                        request_id=rid, **trace)
                counts.append(_decode_count.decode(raw).count)
            except UpstreamClientError as exc:
                self.supervisor.record_success(exc.engine, SuccessKind.CLIENT_4XX)
                why = f"{engine.name}'s /tokenize answered HTTP {exc.status}"
            except (msgspec.DecodeError, RecursionError):
                why = f"{engine.name}'s /tokenize answer is unreadable"
            except (EngineFailure, PoolSaturated) as exc:
                self._translate("tokenize", exc)
            else:
                continue
            if query is text_query:
                raise _Uncountable(why)
            # The prompt's count only makes the usage exact; the answer goes on without it.
            counts.append(None)
        join.counted(counts[0], counts[1])

    async def _count_tail(self, join: StreamJoin, rid: str, model: str | None,
                          trace: Mapping[str, bytes] = UNTRACED) -> None:
        """The counts a tail's usage chunk needs, from the first eligible prefill engine that gives them; if none
        does, the tail goes without usage (``StreamJoin.tail``)."""
        for name in self.supervisor.eligible("prefill", model):
            engine = self.engines.get(name)
            if engine is None:
                continue
            try:
                await self._count_join(join, engine, rid, trace=trace)
                return
            except (_AttemptFailed, _Uncountable):
                continue

    async def _prefill(self, route: str, request: dict[str, Any], prefill: EngineSpec, rid: str, *,
                       trace: Mapping[str, bytes] = UNTRACED) -> msgspec.Raw:
        body = dict(request)
        body["max_tokens"] = 1
        if "max_completion_tokens" in body:
            body["max_completion_tokens"] = 1
        body["stream"] = False
        body.pop("stream_options", None)
        body["kv_transfer_params"] = PREFILL_KV_REQUEST
        try:
            _, raw = await self.data_pool.post_json(prefill, route, _encode_json.encode(body), request_id=rid,
                                                    **trace)
        except EngineFailure as exc:
            if exc.cause == "ResponseTooLarge" and exc.status is not None and 200 <= exc.status < 300:
                # A prefill that said 200 and sent more than can be held: its handoff is unreadable.
                exc = EngineFailure(prefill.name, FailureClass.KV_HANDOFF,
                                    f"prefill answer too large to read its handoff: {exc.message}",
                                    status=exc.status, cause=exc.cause)
            self._translate("prefill", exc)
        except (UpstreamClientError, PoolSaturated) as exc:
            self._translate("prefill", exc)
        try:
            kv = read_handoff(raw, max_bytes=self._max_handoff_bytes)
        except HandoffRejected as exc:
            # Found here, at the prefill leg: a bad handoff is never the decode engine's fault.
            self._translate("prefill", EngineFailure(prefill.name, FailureClass.KV_HANDOFF, str(exc),
                                                     cause="HandoffRejected"))
        self.supervisor.record_success(prefill.name, SuccessKind.PREFILL_HANDOFF)
        return kv

    async def _decode(self, ex: Exchange, leg: Leg, kv: msgspec.Raw) -> None:
        """A plain decode leg: the whole JSON answer, or a stream relayed (``relay``) with this leg's step."""
        route, request, decode, sink = leg.route, leg.request, leg.engine, ex.sink
        body = dict(request)
        body["kv_transfer_params"] = kv
        payload = _encode_json.encode(body)
        if not request.get("stream", False):
            _, raw = await self._engine_call("decode", self.data_pool.post_json(
                decode, route, payload, request_id=ex.rid, **ex.trace_kw))
            self.supervisor.record_success(decode.name, SuccessKind.DECODE_TERMINAL)
            ex.ttft_s = self.clock() - ex.started_at
            try:
                usage = msgspec.json.decode(raw, type=_UsageOnly).usage
            except (msgspec.DecodeError, RecursionError):
                usage = None
            ex.tokens = usage.completion_tokens if usage else 0
            if usage and ex.prompt_tokens is None:
                ex.prompt_tokens = usage.prompt_tokens
            ex.status = 200
            await sink.respond(200, [*_JSON_HEADERS, *ex.response_ids], strip_kv_from_body(raw))
            return
        clock = self.clock
        # The inter-token histogram observed inline, once per read (``Histogram.observe``'s work, no call).
        gap_bounds = self.metrics.inter_token.bounds
        gap_counts, gap_sum = self.metrics.inter_token.cell(ex.model.name if ex.model is not None else "")
        role_events = 0
        upstream: DecodeStream | None = None
        try:
            async with self.data_pool.stream(decode, route, payload, request_id=ex.rid, **ex.trace_kw) as upstream:
                read = upstream.read
                chunk = await read()
                if not chunk:
                    raise EngineFailure(decode.name, FailureClass.STREAM,
                                        "decode stream ended before its first event")
                first_at = last_at = clock()
                ex.ttft_s = first_at - ex.started_at
                ex.status = 200
                # The chat stream opens with a role-only event per choice: no token, not counted, like [DONE].
                if route == _CHAT_ROUTE and is_role_only_event(chunk):
                    role_events = choice_count(request)
                if chunk.find(KV_KEY) >= 0:
                    chunk = strip_kv_from_events(chunk)
                head = [*_SSE_HEADERS, *ex.response_ids]
                # One client write per upstream read, except the read that carries [DONE]: it is
                # held and goes out with the chunked terminator in one write (P5).
                if not upstream.saw_terminal:
                    await sink.start_stream(200, head, chunk)
                    # One read's bookkeeping, for the process's pump and the task's own loop alike (the pool
                    # counts its events as it checks them: nothing here scans the read but the key).
                    book = RelayBook(upstream, gap_bounds, gap_counts, gap_sum, last_at=first_at, marker=KV_KEY,
                                     strip=strip_kv_from_events)
                    # The read holding [DONE] is left in ``held``; b"" when the body ended first.
                    await relay(upstream, sink, head, book, leg, clock=clock, pump=self._to_pump)
                    chunk = book.held
                    last_at = book.last_at
                held = chunk
                tokens = upstream.data_events
                if tokens > 2:
                    ex.inter_token_s = (last_at - first_at) / (tokens - 2)
                # Every stream that ends cleanly ended with [DONE] (the pool raises otherwise): the answer
                # is whole and goes out now, before anything the engine sends after it is waited for.
                # The engine's own count when the client asked for usage (an event may carry several
                # tokens); else the events, less [DONE] and the usage-only event.
                usage_asked = wants_usage(request)
                counted = final_usage_tokens(held) if usage_asked else None
                ex.tokens = counted if counted is not None else max(0, tokens - 1 - role_events - usage_asked)
                if sink.started:
                    await sink.end_stream(held)
                else:
                    await sink.start_stream(200, head, held, end=True)
                self.supervisor.record_success(decode.name, SuccessKind.DECODE_TERMINAL)
                # The body's end, for the connection's reuse; whatever comes instead is no failure.
                await read()
        except (EngineFailure, UpstreamClientError, PoolSaturated) as exc:
            ex.tokens = max(0, (upstream.data_events if upstream is not None else 0) - role_events)
            self._translate("decode", exc)
        except BaseException:
            # Cancelled (the client left, its engine was removed, the deadline) or the client's write failed:
            # the log counts what was relayed all the same; once [DONE] went out, the count set then stands.
            if not _delivered(sink):
                ex.tokens = max(0, (upstream.data_events if upstream is not None else 0) - role_events)
            raise


    async def _pump_relay(self, upstream: DecodeStream, sink: Sink, on_chunk: OnChunk, leg: Leg) -> bytes | None:
        """Relay the rest of a started stream through the process's pump (``narwhal/http1/pump.py``).

        The read ``on_chunk`` declined, b"" at the end of the body; None (nothing read)
        when the pump cannot take this stream (pump off, TLS on either side, a test's sink).
        """
        pump = self._pump
        if pump is None or not pump.can_relay(upstream):
            return None
        client = sink.direct()
        if client is None:
            return None
        leg.relay = "pump"
        return await pump.relay(upstream, client[0], client[1], on_chunk, clock=self.clock)

    async def _decode_joined(self, ex: Exchange, leg: Leg, kv: msgspec.Raw, join: StreamJoin) -> None:
        """A streamed decode leg that may be continued: every event goes through ``join``."""
        body = dict(leg.request)
        body["kv_transfer_params"] = kv
        payload = _encode_json.encode(body)
        sink, decode = ex.sink, leg.engine
        head = [*_SSE_HEADERS, *ex.response_ids]
        gaps = [0.0, 0]
        # The inter-token histogram observed inline, once per read (``Histogram.observe``'s work, no call).
        gap_bounds = self.metrics.inter_token.bounds
        gap_counts, gap_sum = self.metrics.inter_token.cell(ex.model.name if ex.model is not None else "")

        def on_first(now: float) -> None:
            if not join.continuing:
                ex.ttft_s = now - ex.started_at
            elif join.last_relay_at is not None:
                gap = now - join.last_relay_at
                self.metrics.join_gap.observe(gap, _model_label(ex))
                ex.join_gap_s = max(gap, ex.join_gap_s or 0.0)

        def on_gap(gap: float) -> None:
            gap_counts[bisect_left(gap_bounds, gap)] += 1
            gap_sum[0] += gap
            gaps[0] += gap
            gaps[1] += 1

        diverged = join.diverged
        try:
            async with self.data_pool.stream(decode, leg.route, payload, request_id=ex.rid,
                                             **ex.trace_kw) as upstream:
                ex.status = 200
                await relay_joined(join, upstream, sink, head, leg, clock=self.clock, on_first=on_first,
                                   on_gap=on_gap, pump=self._to_pump)
                # The client has the whole answer and [DONE].
                ex.tokens = join.tokens
                self._note_regenerated(ex, join, diverged, decode.name)
                leg_tokens = join.tokens - join.tokens_before
                if gaps[1] and leg_tokens > 1:
                    # Per token, as the plain relay reports it (a read may carry several tokens).
                    ex.inter_token_s = gaps[0] / (leg_tokens - 1)
                self.supervisor.record_success(decode.name, SuccessKind.DECODE_TERMINAL)
                # The body's end, for the connection's reuse; whatever comes instead is no failure.
                await upstream.read()
        except (EngineFailure, UpstreamClientError, PoolSaturated) as exc:
            ex.tokens = join.tokens
            self._note_regenerated(ex, join, diverged, decode.name)
            if not sink.started:
                ex.status = 0
            self._translate("decode", exc)
        except BaseException:
            # Cancelled or the client's write failed: the log counts what was relayed all the same.
            ex.tokens = join.tokens
            ex.regenerated = join.regenerated
            raise

    @staticmethod
    def _note_regenerated(ex: Exchange, join: StreamJoin, diverged: bool, engine: str) -> None:
        """Count the tokens continuations generated again; say once if they came out different (sampling)."""
        ex.regenerated = join.regenerated
        if join.diverged and not diverged:
            log_event("continuation_diverged", level=logging.WARNING, request_id=ex.rid, engine=engine,
                      regenerated_tokens=join.regenerated)


# Why a started answer cannot be resumed (StreamJoin.not_resumable), for the client's error event.
_NOT_RESUMABLE = {
    "token_id_prompt_without_ids": "the engine sent no token IDs for a token-ID prompt",
    "reasoning": "the answer carried a reasoning model's thinking, whose end only the failed engine's parser knew",
}


def _delivered(sink: Sink) -> bool:
    """The whole response went out: a cancel while the engine's body is read to its end changes nothing."""
    return sink.started and sink.finished


def _client_gone(exc: BaseException) -> ClientGone | None:
    """The ClientGone in ``exc`` (alone or in an exception group), if any."""
    if isinstance(exc, ClientGone):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _client_gone(inner)
            if found is not None:
                return found
    return None


# How engines say a prompt does not fit the context: vLLM ("maximum context length", "longer than the maximum
# model length"), SGLang ("longer than the model's context length").
_CONTEXT_FULL = re.compile(r"context length|model length", re.IGNORECASE)


def _fills_context(refused: ClientError) -> bool:
    """Whether an engine refused a request because its prompt does not fit the context (its 4xx message says so)."""
    return refused.code == "upstream_rejected" and _CONTEXT_FULL.search(refused.message) is not None


def _upstream_message(exc: UpstreamClientError) -> str:
    try:
        detail = _decode_json.decode(exc.body)
        message = detail["error"]["message"] if isinstance(detail.get("error"), dict) else detail.get("message")
        if isinstance(message, str):
            # An engine's message is relayed, but not at any length.
            return message[:_MAX_UPSTREAM_MESSAGE]
    except (msgspec.DecodeError, RecursionError, AttributeError, KeyError, TypeError):
        pass
    return f"engine {exc.engine} rejected the request with HTTP {exc.status}"


# A \uD800-\uDBFF escape not followed by another escape: msgspec calls it "Input data was truncated".
_LONE_HIGH_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u)")


def _json_problem(body: bytes, exc: msgspec.DecodeError) -> str:
    """Why ``body`` is refused: msgspec's reason, except where it misleads (an empty body, a lone surrogate)."""
    if not body.strip():
        return "request body is empty"
    match = _LONE_HIGH_SURROGATE.search(body) if "truncated" in str(exc) else None
    if match is not None:
        try:
            json.loads(body)  # complete JSON but for the surrogate (the stdlib accepts lone ones)
        except (ValueError, RecursionError):
            return f"request body is not valid JSON: {exc}"
        return f"request body is not valid JSON: lone UTF-16 surrogate escape {match.group().decode()} " \
               f"at byte {match.start()}"
    return f"request body is not valid JSON: {exc}"
