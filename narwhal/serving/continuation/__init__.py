"""Stream continuation: one client stream across decode legs on several engines.

Under ``serving.policy = "bounded"`` with ``serving.continue_streams`` on, a
streamed request whose decode leg fails (class connection, timeout or stream,
or cut because a reload removed its engine) after its stream reached the
client is continued: a fresh prefill of the original prompt plus the output so
far, then a decode on another engine asking for the tokens still owed, relayed
into the same client stream.

``plan`` says whether a request may be continued (and why not). A ``StreamJoin``
(``join``) holds one request's answer so far and composes one part per job:
``events`` (what the client never sees of an engine's events), ``lazy`` (the
first leg's events read only when needed), ``accounting`` (token counts),
``resume`` (resume points and divergence) and ``legs`` (each next leg's
request); ``policy`` says which streams are continued. ``relay`` pumps one
decode leg through a join into the client's sink. No I/O of its own beyond the
sink and the upstream stream it is handed; the clock is injected.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from narwhal.errors import EngineFailure, FailureClass
from narwhal.serving.continuation.events import DONE_EVENT as _DONE_EVENT
from narwhal.serving.continuation.events import EngineErrorEvent
from narwhal.serving.continuation.join import StreamJoin
from narwhal.serving.continuation.policy import (
    CHAT,
    COMPLETIONS,
    CONTINUED_CLASSES,
    ENGINE_REMOVED,
    not_continued_reason,
)

__all__ = ["CHAT", "COMPLETIONS", "CONTINUED_CLASSES", "ENGINE_REMOVED", "EngineErrorEvent", "StreamJoin",
           "not_continued_reason", "plan", "relay"]


def plan(route: str, request: dict[str, Any], *, enabled: bool) -> tuple[StreamJoin | None, str | None]:
    """A StreamJoin for a streamed request that may be continued, else None and the reason."""
    if not enabled:
        return None, "continue_streams_off"
    reason = not_continued_reason(route, request)
    if reason is not None:
        return None, reason
    return StreamJoin(route, request), None


class _Sink(Protocol):
    started: bool

    async def start_stream(self, status: int, headers: list[tuple[bytes, bytes]], first: bytes = b"",
                           end: bool = False) -> None: ...
    async def write(self, data: bytes) -> None: ...
    async def end_stream(self, last: bytes = b"") -> None: ...


# One read through the join: the bytes for the client, or None once [DONE] came.
_Step = Callable[[bytes, float], "bytes | None"]


class _Upstream(Protocol):
    async def read(self) -> bytes: ...


async def relay(join: StreamJoin, upstream: _Upstream, sink: _Sink, head: list[tuple[bytes, bytes]], *,
                engine: str, clock: Callable[[], float],
                on_first: Callable[[float], None], on_gap: Callable[[float], None],
                pump: Callable[[_Step], Awaitable[bytes | None]] | None = None) -> None:
    """Pump one decode leg through ``join`` into the client's stream, ending it as soon as [DONE] comes.

    ``on_first(now)`` runs once, when this leg's first bytes reach the client;
    ``on_gap`` gets the time between successive client writes within the leg.
    Unreadable events raise EngineFailure (class stream) against ``engine``.
    ``pump``, once the client's stream has started, relays the reads through the
    same per-read step elsewhere (the process's relay pump): it returns the read
    the step declined ([DONE]), b"" at the end of the body, or None when it cannot.
    """
    first = True
    last_at = 0.0
    done_out: bytes | None = None

    def step(chunk: bytes, now: float) -> bytes | None:
        """One read through the join: the bytes for the client, or None once [DONE] came (kept in done_out)."""
        nonlocal first, last_at, done_out
        try:
            out, done = join.feed(chunk)
        except EngineErrorEvent as exc:
            raise EngineFailure(engine, FailureClass.STREAM, str(exc), cause="ErrorEvent") from None
        except ValueError as exc:
            raise EngineFailure(engine, FailureClass.STREAM, f"unreadable decode stream: {exc}",
                                cause="UnreadableEvent") from None
        if done:
            done_out = out
            return None
        if not out:
            return out
        if first:
            on_first(now)
            first = False
        else:
            on_gap(now - last_at)
        last_at = now
        join.last_relay_at = now
        return out

    while done_out is None:
        if pump is not None and sink.started:
            declined = await pump(step)
            if declined is not None:
                if done_out is None:
                    # The pool ended the stream cleanly, but no complete event carried [DONE].
                    raise EngineFailure(engine, FailureClass.STREAM, "decode stream ended before data: [DONE]")
                break
            pump = None
        chunk = await upstream.read()
        if not chunk:
            # The pool ended the stream cleanly, but no complete event carried [DONE].
            raise EngineFailure(engine, FailureClass.STREAM, "decode stream ended before data: [DONE]")
        out = step(chunk, clock())
        if not out:
            continue
        if sink.started:
            await sink.write(out)
        else:
            await sink.start_stream(200, head, out)
    # The answer is whole: it goes out now, in the write that ends the stream. The caller reads what the
    # engine sends after [DONE] only afterwards (for the connection's reuse; none of it is a failure).
    out = done_out + _DONE_EVENT
    now = clock()
    if first:
        on_first(now)
    join.last_relay_at = now
    if sink.started:
        await sink.end_stream(out)
    else:
        await sink.start_stream(200, head, out, end=True)
