"""What each span of a request records (issue 40): the request, its queue wait, placement and engine legs.

The request core calls these only when the exchange has a trace (``Exchange.trace``), once per request,
attempt or leg: nothing here runs per token. Attribute names follow OpenTelemetry's semantic conventions
where they exist (``http.route``, ``http.response.status_code``, ``error.type``, ``server.address``,
``gen_ai.*``); the rest are ``narwhal.*``. An unsampled trace hands out its root span for every child
(``RequestTrace.child``), so the attributes set here go nowhere and cost a dict store.
"""

from __future__ import annotations

from narwhal.config import engine_endpoint
from narwhal.fleet.placement import Choice
from narwhal.serving.exchange import Exchange, Leg
from narwhal.tracing.spans import KIND_CLIENT, KIND_INTERNAL, AttrValue, RequestTrace, SharedAttributes, Span

__all__ = ["end_leg", "end_request", "open_leg", "open_queue", "placed"]

_OPERATION = {"/v1/completions": "text_completion", "/v1/chat/completions": "chat"}
_LEG_NAMES = {"prefill": "narwhal.prefill", "decode": "narwhal.decode", "continuation": "narwhal.continuation"}

# The attributes that repeat from request to request whole (a leg's engine, attempt, route and model; the
# placement's choices; the request's route, status, attempts, model and tenant) are one shared set per
# combination, encoded once (``SharedAttributes``). Bounded: a reload can bring new engines, and tenants are many.
_LEG_SHARED: dict[tuple[object, ...], SharedAttributes] = {}
# The placement span's: keyed by the set before (the prefill's choice, when the decode's is added) and the choice.
_PLACED_SHARED: dict[tuple[object, ...], SharedAttributes] = {}
_REQUEST_SHARED: dict[tuple[object, ...], SharedAttributes] = {}
_MAX_SHARED = 4096


def _shared(cache: dict[tuple[object, ...], SharedAttributes], key: tuple[object, ...],
            attributes: dict[str, AttrValue]) -> SharedAttributes:
    """A cache miss: the shared set for ``key``, kept."""
    if len(cache) >= _MAX_SHARED:
        cache.clear()
    shared = cache[key] = SharedAttributes(attributes)
    return shared


def open_queue(trace: RequestTrace, start_ns: int, reason: str) -> Span:
    """The wait for capacity (``narwhal.queue``), from ``start_ns``: opened only when the request waited."""
    span = trace.child("narwhal.queue", start_ns, KIND_INTERNAL)
    span.set("narwhal.queue.reason", reason)
    return span


# The placement span's keys, per role (made once, not per request).
_PLACED_KEYS = {role: (f"narwhal.placement.{role}", f"narwhal.placement.{role}_reason",
                       f"narwhal.placement.{role}_candidates") for role in ("prefill", "decode")}


def placed(span: Span, role: str, choice: Choice, candidates: int) -> None:
    """What the placement span says of one role's choice: the engine, why, among how many; a spill, the match.

    The choice joins the span's shared set (the roles' choices repeat whole from request to request); the
    matched share of the prompt, a float of this request's, is the span's own."""
    before = span.shared
    key = (before, role, choice.engine, choice.reason, candidates)
    shared = _PLACED_SHARED.get(key)
    if shared is None:
        engine_key, reason_key, candidates_key = _PLACED_KEYS[role]
        attributes: dict[str, AttrValue] = {} if before is None else dict(before.attributes)
        attributes[engine_key] = choice.engine
        attributes[reason_key] = choice.reason
        attributes[candidates_key] = candidates
        if choice.reason == "spill":
            # A better-matching engine was too loaded: the prompt spilled to another.
            attributes["narwhal.placement.spill"] = True
        shared = _shared(_PLACED_SHARED, key, attributes)
    span.shared = shared
    if choice.matched is not None:
        span.attributes["narwhal.placement.prefix_match"] = choice.matched


def open_leg(trace: RequestTrace, ex: Exchange, leg: Leg, now_ns: int) -> Span:
    """A prefill, decode or continuation leg's span (client kind), its engine call's traceparent set on ``ex``."""
    if not trace.sampled:
        # Engines get the root's context with the not-sampled flag (ex.trace_kw already names it).
        return trace.root
    engine, attempt, model = leg.engine, leg.attempt, ex.model
    key = (engine.name, engine.url, attempt, leg.route, None if model is None else model.name)
    shared = _LEG_SHARED.get(key)
    if shared is None:
        host, port, _, _ = engine_endpoint(engine.url)
        attributes: dict[str, AttrValue] = {
            "narwhal.engine": engine.name, "server.address": host, "server.port": port, "narwhal.attempt": attempt,
            # The retry number: 0 for the first attempt.
            "narwhal.retry": attempt - 1,
            "gen_ai.operation.name": _OPERATION.get(leg.route, leg.route),
        }
        if model is not None:
            attributes["gen_ai.request.model"] = model.name
        shared = _shared(_LEG_SHARED, key, attributes)
    span, ex.trace_kw = trace.open(_LEG_NAMES[leg.kind], now_ns, KIND_CLIENT, shared)
    if leg.kind == "continuation" and ex.join is not None:
        # The tokens regenerated before this join: its own count is the difference when it ends.
        span.attributes["narwhal.continuation.regenerated_before"] = ex.join.regenerated
    return span


def end_leg(trace: RequestTrace, ex: Exchange, leg: Leg, now_ns: int, *,
            error: str | None = None, message: str | None = None, evidence: bool = False) -> None:
    """End a leg's span (``leg.span``, then None; nothing if it has none): its failure class (and, when the
    failure was ``evidence`` against its engine, an event saying so), or its usage."""
    span = leg.span
    if span is None:
        return
    leg.span = None
    if span is trace.root:
        return
    ex.trace_kw = trace.root_kw
    failure = error or leg.error
    if leg.kind != "prefill":
        attributes = span.attributes
        if ex.prompt_tokens is not None:
            attributes["gen_ai.usage.input_tokens"] = ex.prompt_tokens
        attributes["gen_ai.usage.output_tokens"] = ex.tokens
        if leg.kind == "continuation":
            before = attributes.pop("narwhal.continuation.regenerated_before", 0)
            attributes["narwhal.continuation.regenerated_tokens"] = ex.regenerated - int(before)
            if ex.join_gap_s is not None:
                attributes["narwhal.continuation.join_gap_ms"] = round(ex.join_gap_s * 1000, 3)
    if failure is None:
        trace.finish(span, now_ns)
        return
    span.set("error.type", failure)
    span.set("narwhal.failure_class", failure)
    if evidence:
        # The failure is evidence against the engine: what ejects it in the end, shown where it happened.
        span.event("narwhal.engine_failure", now_ns, **{"narwhal.engine": leg.engine.name,
                                                        "narwhal.failure_class": failure,
                                                        "narwhal.stage": leg.kind})
    trace.finish(span, now_ns, error=message or failure)


def end_request(trace: RequestTrace, ex: Exchange, now_ns: int) -> None:
    """End the root span (``narwhal.request``, server kind) with what the request line says."""
    if not trace.sampled:
        return
    root = trace.root
    model, tenant = ex.model, ex.tenant
    key = (ex.route, ex.status, ex.attempts, None if model is None else model.name, tenant)
    shared = _REQUEST_SHARED.get(key)
    if shared is None:
        common: dict[str, AttrValue] = {"http.route": ex.route, "http.request.method": "POST",
                                     "http.response.status_code": ex.status, "narwhal.attempts": ex.attempts}
        if model is not None:
            common["gen_ai.request.model"] = model.name
        if tenant is not None:
            common["narwhal.tenant"] = tenant
        shared = _shared(_REQUEST_SHARED, key, common)
    root.shared = shared
    attributes = root.attributes
    attributes["narwhal.request_id"] = ex.rid
    attributes["gen_ai.usage.output_tokens"] = ex.tokens
    if ex.continuations:
        attributes["narwhal.continuations"] = ex.continuations
    if ex.prompt_tokens is not None:
        attributes["gen_ai.usage.input_tokens"] = ex.prompt_tokens
    if ex.continued_after is not None:
        root.set("narwhal.continued_after", ex.continued_after)
    error = ex.error_class
    if error is not None:
        root.set("error.type", error)
    elif ex.status >= 500:
        error = f"HTTP {ex.status}"
    trace.finish(root, now_ns, error=error)
