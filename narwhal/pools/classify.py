"""The one place where what went wrong on an engine call becomes a failure class.

Both pools hand every transport error, status code and stream anomaly here;
nothing above the pools sees an httpx, socket or httptools exception::

    what happened                                           result
    ------------------------------------------------------  --------------------------
    refused, DNS, reset/closed before any response byte     EngineFailure(connection)
    TLS: untrusted/expired certificate, wrong host name,
      handshake refused, alert (e.g. no client certificate)  EngineFailure(connection), TLS reason in message
    connect, read or write timeout before the status line   EngineFailure(timeout)
    first-token deadline, mid-stream silence, body cut off
      (control calls too: a timeout or cut after the status line),
      end without `data: [DONE]`, not SSE, malformed HTTP   EngineFailure(stream)
    HTTP 408, 429                                           EngineFailure(overload)
    other 5xx (and any other non-2xx, non-4xx status)       EngineFailure(inference_status)
    response head or buffered body over its bound           EngineFailure(inference_status)
    other 4xx                                               UpstreamClientError
    no slot in our own limiter before the caller's deadline PoolSaturated
    EMFILE/ENFILE/ENOMEM/ENOBUFS of our own while connecting LocalResourceExhausted (a PoolSaturated)

``kv_handoff`` is decided by the request core, which reads the prefill body
(a prefill's 200 too large to read is an unreadable handoff there too).
The health stage and the supervisor's probes read statuses through the same
table (``health_answer``: 2xx is a successful health response, another 4xx the
clearing table's "4xx" row, the rest a failure of its class) and decode
streams through the same ``SSEWatch`` as the data path (``sse_body_failure``).
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import httpx
import trio

from narwhal.compiled import optional_module
from narwhal.errors import (
    EngineFailure,
    FailureClass,
    LocalResourceExhausted,
    PoolSaturated,
    SuccessKind,
    UpstreamClientError,
)
from narwhal.http1.client import (
    ConnectFailed,
    ConnectionClosed,
    ConnectTimeout,
    DeadlineExpired,
    HTTPTransportError,
    LocalResourceError,
    MalformedResponse,
    ReadTimeout,
    ResponseTooLarge,
    TLSFailed,
    WriteTimeout,
    local_errno_name,
)
from narwhal.tls import tls_reason

__all__ = [
    "SSEWatch",
    "call_timeout",
    "health_answer",
    "httpx_failure",
    "pool_slot",
    "raise_for_status",
    "response_too_large",
    "sse_body_failure",
    "status_failure",
    "stream_failure",
    "transport_failure",
]

# ConnectionClosed is absent: its class depends on whether the response had started.
_TRANSPORT_CLASSES: dict[type[HTTPTransportError], FailureClass] = {
    ConnectFailed: FailureClass.CONNECTION,
    # The engine is unreachable to us as configured (trust, name, client certificate).
    TLSFailed: FailureClass.CONNECTION,
    ConnectTimeout: FailureClass.TIMEOUT,
    WriteTimeout: FailureClass.TIMEOUT,
    ReadTimeout: FailureClass.TIMEOUT,
    DeadlineExpired: FailureClass.STREAM,
    MalformedResponse: FailureClass.STREAM,
    # An engine that answers more than any answer may be gave a bad answer.
    ResponseTooLarge: FailureClass.INFERENCE_STATUS,
}

# First match wins; httpx.PoolTimeout is handled before this table (our saturation).
_HTTPX_CLASSES: tuple[tuple[type[httpx.HTTPError], FailureClass], ...] = (
    (httpx.TimeoutException, FailureClass.TIMEOUT),
    (httpx.DecodingError, FailureClass.STREAM),
    # ConnectError, ReadError, WriteError, RemoteProtocolError ("server disconnected
    # without sending a response"): httpx cannot say whether response bytes arrived.
    (httpx.TransportError, FailureClass.CONNECTION),
)

_OVERLOAD_STATUSES = frozenset({408, 429})
_BODY_SNIPPET_BYTES = 200


def transport_failure(engine: str, exc: HTTPTransportError,
                      status: int | None = None) -> EngineFailure | LocalResourceExhausted:
    """The failure for a data-pool transport error (our own resource shortage is not the engine's).

    ``status`` is the answer's status when the error came while reading its body.
    """
    if isinstance(exc, LocalResourceError):
        return LocalResourceExhausted(str(exc), engine=engine, errno_name=exc.errno_name)
    if isinstance(exc, ConnectionClosed):
        failure_class = FailureClass.STREAM if exc.response_started else FailureClass.CONNECTION
    else:
        failure_class = _TRANSPORT_CLASSES[type(exc)]
    return EngineFailure(engine, failure_class, str(exc), status=status, cause=exc.cause)


def httpx_failure(engine: str, exc: httpx.HTTPError, *,
                  response_started: bool = False) -> EngineFailure | PoolSaturated:
    """The failure for an httpx error raised by a control-pool call.

    After the response began, a timeout or a cut is the body's: ``stream``
    (mid-stream silence, body cut off), as the data pool classifies it.
    """
    if isinstance(exc, httpx.PoolTimeout):
        return PoolSaturated(f"no free control connection to {engine}")
    local = local_errno_name(exc)
    if local is not None:
        return LocalResourceExhausted(f"cannot open a connection to {engine}: {local}", engine=engine,
                                      errno_name=local)
    message = str(exc) or type(exc).__name__
    reason = tls_reason(exc)
    if reason is not None and reason not in message:
        message = f"{message} (TLS: {reason})"
    if response_started and isinstance(exc, httpx.TransportError):
        return EngineFailure(engine, FailureClass.STREAM, f"response body failed: {message}",
                             cause=type(exc).__name__)
    for kind, failure_class in _HTTPX_CLASSES:
        if isinstance(exc, kind):
            return EngineFailure(engine, failure_class, message, cause=type(exc).__name__)
    return EngineFailure(engine, FailureClass.CONNECTION, message, cause=type(exc).__name__)


def status_failure(engine: str, status: int, body: bytes) -> EngineFailure | UpstreamClientError | None:
    """None for 2xx; otherwise what a data-pool caller must raise for this status."""
    if 200 <= status < 300:
        return None
    if status in _OVERLOAD_STATUSES:
        return EngineFailure(engine, FailureClass.OVERLOAD, f"HTTP {status}", status=status)
    if 400 <= status < 500:
        return UpstreamClientError(engine, status, body)
    snippet = body[:_BODY_SNIPPET_BYTES].decode("utf-8", "replace")
    message = f"HTTP {status}: {snippet}" if snippet else f"HTTP {status}"
    return EngineFailure(engine, FailureClass.INFERENCE_STATUS, message, status=status)


def health_answer(engine: str, status: int) -> SuccessKind | EngineFailure:
    """What an engine's answer to ``GET /health`` is evidence of, by the status table above."""
    failure = status_failure(engine, status, b"")
    if failure is None:
        return SuccessKind.HEALTH_200
    if isinstance(failure, UpstreamClientError):
        return SuccessKind.CLIENT_4XX
    return failure


def raise_for_status(engine: str, status: int, body: bytes) -> None:
    """Raise the failure for a non-2xx status; return for 2xx."""
    failure = status_failure(engine, status, body)
    if failure is not None:
        raise failure


def response_too_large(engine: str, what: str, max_bytes: int) -> EngineFailure:
    """A control-pool answer over its bound: a bad answer, so a failed check."""
    return EngineFailure(engine, FailureClass.INFERENCE_STATUS, f"{what} over the {max_bytes} byte bound",
                         cause="ResponseTooLarge")


def call_timeout(engine: str, timeout_s: float, *, response_started: bool = False) -> EngineFailure:
    """A whole control call overran its timeout (each read may have been quick).

    With the response begun, the body stalled or dripped: ``stream``, not ``timeout``.
    """
    if response_started:
        return EngineFailure(engine, FailureClass.STREAM, f"response body incomplete after {timeout_s:g} s",
                             cause="CallTimeout")
    return EngineFailure(engine, FailureClass.TIMEOUT, f"no complete response within {timeout_s:g} s",
                         cause="CallTimeout")


def stream_failure(engine: str, message: str, *, cause: str | None = None) -> EngineFailure:
    """A stream anomaly the data pool detected itself (no [DONE], not SSE, wrong type)."""
    return EngineFailure(engine, FailureClass.STREAM, message, cause=cause)


def sse_body_failure(engine: str, body: bytes) -> EngineFailure | None:
    """None when a complete SSE body ends with the terminal marker, else its stream failure."""
    watch = SSEWatch()
    if not watch.feed(body) or not watch.valid:
        return stream_failure(engine, "decode response is not an event stream", cause="NotSSE")
    if not watch.finish():
        return stream_failure(engine, "decode stream ended without its terminal marker", cause="NoDone")
    return None


# The caller's own cancel scope has the same deadline. If both expire in the same
# scheduler tick, trio lets the outer scope catch the cancellation and the caller
# never learns it was saturation; so ours fires this much earlier (a loop stalled
# longer than that still ends the caller at its own deadline, never as an engine
# failure). The margin also leaves the caller time to answer 503.
SATURATION_MARGIN_S = 0.05


class pool_slot:  # noqa: N801 -- used as a function: ``async with pool_slot(...)``
    """Hold one slot of ``limiter``; raise PoolSaturated if none frees up before the caller's deadline.

    With ``wait=False`` a full pool raises PoolSaturated at once (no queueing). A class rather than
    an ``asynccontextmanager``: it is entered twice per request, and a generator costs more.
    """

    __slots__ = ("_limiter", "_pool", "_token", "_wait")

    def __init__(self, limiter: trio.CapacityLimiter, pool: str, *, wait: bool = True) -> None:
        self._limiter = limiter
        self._pool = pool
        self._wait = wait
        # One per call: a task may hold several slots (e.g. decode plus a token count).
        self._token = object()

    async def __aenter__(self) -> None:
        limiter, token = self._limiter, self._token
        try:
            limiter.acquire_on_behalf_of_nowait(token)
        except trio.WouldBlock:
            if not self._wait:
                raise PoolSaturated(f"no free {self._pool} pool connection") from None
            with trio.move_on_at(trio.current_effective_deadline() - SATURATION_MARGIN_S) as scope:
                await limiter.acquire_on_behalf_of(token)
            if scope.cancelled_caught:
                raise PoolSaturated(f"no free {self._pool} pool connection before the request deadline") from None

    async def __aexit__(self, *exc_info: object) -> None:
        self.release()

    def release(self) -> None:
        """Give the slot back (``__aexit__``; or an owner that is itself a context manager, ``DataPool.stream``)."""
        self._limiter.release_on_behalf_of(self._token)


_SSE_FIELDS = (b"data:", b"event:", b"id:", b"retry:", b":")
_LONGEST_FIELD = 6
_TERMINAL_EVENTS = (b"data: [DONE]", b"data:[DONE]")
# The terminal event whole, as vLLM writes it.
_DONE_EVENT = b"data: [DONE]\n\n"
# Enough of an event's first bytes to check its field and recognise the terminal event.
_EVENT_HEAD_BYTES = 17
# Applied with map(): the per-event work stays in C.
_strip_leading_newlines = operator.methodcaller("lstrip", b"\n")
_starts_with_field = operator.methodcaller("startswith", _SSE_FIELDS)


def _native_whole_events() -> Callable[[bytes], int] | None:
    module = optional_module("narwhal.http1._relay_native")
    # None: the counts in ``SSEWatch.feed``, which conclude the same.
    return None if module is None else module.whole_data_events


# A read of whole one-line `data:` events, its events counted with memchr (glibc's vector scan): the two
# counts of the Python path walk every byte one at a time (about 8 us for an unpaced answer's 6.5 KB).
_whole_data_events = _native_whole_events()


class SSEWatch:
    """A cheap watch over a relayed SSE body: is it SSE, and was `data: [DONE]` the last event?

    It sees raw reads as they are relayed and keeps only the first bytes of the
    current event: per read one split on blank lines and C-level prefix checks
    over the events it completes, never a JSON parse.
    """

    __slots__ = ("_after_newline", "_event", "data_events", "saw_terminal", "valid")

    def __init__(self) -> None:
        self.valid = True
        self.saw_terminal = False
        # The events with a ``data:`` field ended so far ([DONE] included): counted by event, so a token's text
        # that says ``data: `` is not an event, nor is a multi-line event more than one.
        self.data_events = 0
        self._event = b""  # first bytes of the event not yet ended by a blank line
        self._after_newline = False

    @property
    def between_events(self) -> bool:
        """True when the bytes fed so far end on an event's end: the next read starts an event."""
        return not self._event

    def one_event(self, data: bytes) -> bool:
        """Take ``data`` if it is one whole ``data: `` event starting where an event starts (the usual read:
        vLLM writes each event as its own chunk); False, taking nothing, for any other read (``feed`` it).

        What ``feed`` would conclude from such a read, in four C-level checks instead of its general path.
        """
        if (data.startswith(b"data: ") and data.find(b"\n\n") == len(data) - 2 and data.find(b"\r") < 0
                and not self._event and self.valid):
            self._after_newline = True
            self.saw_terminal = data == _DONE_EVENT
            self.data_events += 1
            return True
        return False

    def feed(self, data: bytes) -> bool:
        """Take one read of the body; False once it is clearly not an event stream."""
        if data.find(b"\r") >= 0:  # not ``in``: bytes.__contains__ tries an int first (a raised TypeError)
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if self._after_newline and data.startswith(b"\n"):
            # The blank line that ends an event straddles two reads.
            self._end_event()
            data = data[1:]
        if not data:
            return self.valid
        if not self._event and data.startswith(b"data:") and data.endswith(b"\n\n"):
            if _whole_data_events is not None:
                ended = _whole_data_events(data)
            else:
                ended = data.count(b"\n\ndata:") + 1
                if data.count(b"\n") != 2 * ended:
                    ended = 0
            if ended:
                # The usual read: whole one-line `data:` events, as engines write them. Every newline is
                # then one of a separator's two (each followed by `data:`) or the last two, so the counts
                # (or the compiled walk of the newlines) check every event in C.
                self._after_newline = True
                self.data_events += ended
                self.saw_terminal = data.rsplit(b"\n\n", 2)[-2].lstrip(b"\n") in _TERMINAL_EVENTS
                return self.valid
        self._after_newline = data.endswith(b"\n")
        *complete, rest = data.split(b"\n\n")
        if complete:
            complete[0] = self._event + complete[0]
            self._event = b""
            self._end_events([event for event in map(_strip_leading_newlines, complete) if event])
        if rest and len(self._event) < _EVENT_HEAD_BYTES:
            if not self._event:
                rest = rest.lstrip(b"\n")
            self._event += rest[:_EVENT_HEAD_BYTES - len(self._event)]
            if len(self._event) >= _LONGEST_FIELD and not self._event.startswith(_SSE_FIELDS):
                self.valid = False
        return self.valid

    def finish(self) -> bool:
        """At the end of the body: True when the last event was the terminal marker.

        An unterminated last event still counts, so `data: [DONE]\\n` then EOF ends cleanly.
        """
        self._end_event()
        return self.valid and self.saw_terminal

    def _end_event(self) -> None:
        event, self._event = self._event.lstrip(b"\n"), b""
        if event:
            self._end_events([event])

    def _end_events(self, events: list[bytes]) -> None:
        if not all(map(_starts_with_field, events)):
            self.valid = False
            return
        # Off the usual path (whole `data:` events, counted in ``feed``): an event may have other fields first.
        self.data_events += sum(1 for event in events if event.startswith(b"data:") or b"\ndata:" in event)
        for event in reversed(events):
            if not event.startswith(b":"):  # a comment is not an event
                self.saw_terminal = event.rstrip(b"\n") in _TERMINAL_EVENTS
                return
