"""The relay: a decode stream's reads, each through a per-read step, into the client's stream.

``relay`` is the one loop. The step (``Step``) does one read's bookkeeping
(token counting, KV stripping, a continuation's rewriting) and returns the
bytes for the client, or None for the read that ends the answer (it keeps
that read for the caller's last write). Once the client's stream has started,
the process's relay pump (``narwhal/http1/pump.py``) takes the stream when it
can and calls the same step per read; otherwise the request task reads on.

``relay_joined`` is a decode leg of a stream that may be continued: its step
is the join's (``StreamJoin.feed``), and it ends the client's stream at [DONE].
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from narwhal.errors import EngineFailure, FailureClass
from narwhal.http1.pump import OnChunk, RelayWatched
from narwhal.serving.continuation import EngineErrorEvent, StreamJoin
from narwhal.serving.exchange import Leg, Sink

__all__ = ["PumpRelay", "Step", "Upstream", "relay", "relay_joined"]

_DONE_EVENT = b"data: [DONE]\n\n"

# One read (and when it was read) in, the bytes for the client out; None ends the relay at that read.
# The pump calls the same step per read (its ``OnChunk``).
Step = OnChunk


class Upstream(RelayWatched, Protocol):
    """A decode stream's body as the data pool hands it over (``narwhal.pools.data.UpstreamStream``)."""

    @property
    def saw_terminal(self) -> bool: ...
    @property
    def data_events(self) -> int:
        """The events with a ``data:`` field read so far ([DONE] included), counted by event."""
        ...
    async def read(self) -> bytes: ...


# The pump's side of the relay (``RequestCore._pump_relay``): the read the step declined, b"" at the
# body's end, or None when the pump cannot take this stream (nothing read).
PumpRelay = Callable[[Upstream, Sink, Step, Leg], Awaitable["bytes | None"]]


async def relay(upstream: Upstream, sink: Sink, head: list[tuple[bytes, bytes]], step: Step, leg: Leg, *,
                clock: Callable[[], float], pump: PumpRelay | None) -> bool:
    """Relay ``upstream`` through ``step`` into ``sink``: True when ``step`` declined a read, False when the
    body ended first. The client's stream starts, with ``head``, at the first bytes if the caller had not."""
    leg.relay = "task"
    read = upstream.read
    while not sink.started:
        chunk = await read()
        if not chunk:
            return False
        out = step(chunk, clock())
        if out is None:
            return True
        if out:
            await sink.start_stream(200, head, out)
    if pump is not None:
        declined = await pump(upstream, sink, step, leg)
        if declined is not None:
            return bool(declined)
    while True:
        chunk = await read()
        if not chunk:
            return False
        out = step(chunk, clock())
        if out is None:
            return True
        if out:
            await sink.write(out)


async def relay_joined(join: StreamJoin, upstream: Upstream, sink: Sink, head: list[tuple[bytes, bytes]],
                       leg: Leg, *, clock: Callable[[], float], on_first: Callable[[float], None],
                       on_gap: Callable[[float], None], pump: PumpRelay | None) -> None:
    """Relay one decode leg through ``join`` into the client's stream, ending it as soon as [DONE] comes.

    ``on_first(now)`` runs once, when this leg's first bytes reach the client;
    ``on_gap`` gets the time between successive client writes within the leg.
    Unreadable events raise EngineFailure (class stream) against the leg's engine.
    """
    engine = leg.engine.name
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

    if not await relay(upstream, sink, head, step, leg, clock=clock, pump=pump) or done_out is None:
        # The pool ended the stream cleanly, but no complete event carried [DONE].
        raise EngineFailure(engine, FailureClass.STREAM, "decode stream ended before data: [DONE]")
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
