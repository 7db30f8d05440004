"""One subscription per engine to vLLM's KV event publisher, run by trio, writing batches into a sink.

Each feed is a SUB socket on the publisher (and a DEALER on the replay socket when asked), watched by a
ZeroMQ socket monitor. Batches reach the sink in sequence order: a gap or a reconnect asks the replay
socket for what was missed; what replay cannot cover clears the sink, which then rebuilds from the live
feed (logged ``kv_events_resync``). A hostile publisher costs bounded memory (message size, inbox) and
CPU (an events-per-second budget), and every wait has a deadline.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping
from typing import Literal, Protocol

import msgspec
import trio
import zmq
from zmq.utils.monitor import parse_monitor_message

from narwhal.kv_events.wire import END_SEQ, KvBatch, KvWireError, decode_batch, decode_seq, encode_seq
from narwhal.kv_events.zmq_trio import TrioSocket
from narwhal.obs.logs import log_event

__all__ = ["FeedLimits", "FeedSource", "FeedState", "FeedStats", "KvFeeds", "KvSink"]

FeedState = Literal["live", "resyncing", "down", "off"]


class FeedSource(msgspec.Struct, frozen=True):
    """Where one engine publishes: the PUB endpoint (host resolved), its replay ROUTER, the topic (None: all)."""

    publisher: str
    replay: str | None = None
    topic: str | None = None


class KvSink(Protocol):
    """What the feeds write into (the KV index)."""

    def apply(self, engine: str, batch: KvBatch, now: float) -> None: ...

    def clear(self, engine: str) -> None: ...


class FeedStats(msgspec.Struct):
    """One engine's feed, as /admin/placement shows it."""

    state: FeedState
    last_seq: int | None
    blocks: int = 0
    events_per_s: float = 0.0
    resyncs: int = 0
    dropped: int = 0


class FeedLimits(msgspec.Struct, frozen=True):
    """What one feed may cost: at most (2 * rcv_hwm) * max_message_bytes + inbox_bytes of messages held.

    The defaults are far above what vLLM publishes: a batch is one scheduler step, tens of KB.
    """

    max_message_bytes: int = 1 << 20   # ZMQ_MAXMSGSIZE: a bigger message makes ZeroMQ drop the connection
    rcv_hwm: int = 64                  # messages ZeroMQ queues (SUB, and DEALER during a replay) before we read
    inbox_bytes: int = 16 << 20        # live messages held while a replay runs
    inbox_messages: int = 4096
    replay_idle_s: float = 2.0         # a replay that sends nothing for this long has failed
    replay_max_s: float = 30.0         # and one that has not ended by this
    events_per_s: float = 200_000.0    # the budget: events (plus one per message) per second, refilled
    burst_events: float = 400_000.0    # ... up to this many at once
    replay_cost: float = 100.0         # charged to the budget for each replay asked
    stall_s: float = 1.0               # a disconnect with no reconnect attempt by then: the socket is rebuilt
    bad_log_interval_s: float = 10.0   # at most one kv_events_bad_message line per engine per interval
    rate_window_s: int = 10            # events_per_s is averaged over this many seconds


DEFAULT_LIMITS = FeedLimits()

_MONITOR_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
                   | zmq.EVENT_CONNECT_DELAYED)
_CONNECTED = object()  # the inbox marker of a (re)connection, in order with the messages


class _Inbox:
    """Live messages waiting for the feed, bounded in count and bytes."""

    def __init__(self, limits: FeedLimits) -> None:
        self._items: deque[object] = deque()
        self._bytes = 0
        self._limits = limits
        self._ready = trio.Event()

    def put(self, item: object, size: int = 0) -> bool:
        """Queue ``item``; False (and not queued) when the inbox is full."""
        if size and (len(self._items) >= self._limits.inbox_messages
                     or self._bytes + size > self._limits.inbox_bytes):
            return False
        self._items.append(item)
        self._bytes += size
        self._ready.set()
        return True

    async def get(self) -> object:
        while not self._items:
            self._ready = trio.Event()
            await self._ready.wait()
        item = self._items.popleft()
        if isinstance(item, list):
            self._bytes -= sum(len(frame) for frame in item)
        return item


class _Counters:
    """What survives a feed's restart: the engine's resyncs and drops."""

    def __init__(self) -> None:
        self.resyncs = 0
        self.dropped = 0


class _Feed:
    """One engine's subscription: its sockets, its place in the sequence, its budget."""

    def __init__(self, engine: str, source: FeedSource, owner: KvFeeds, counters: _Counters) -> None:
        self.engine = engine
        self.source = source
        self.scope = trio.CancelScope()
        self._sink = owner.sink
        self._clock = owner.clock
        self._limits = owner.limits
        self.counters = counters
        self.connected = False
        self.resyncing = False
        self.last_seq: int | None = None
        self._caught_up = False          # asked the replay for the publisher's history once since a clear
        # Live copies of the batches a replay just delivered (seqs dup_low..dup_high) are skipped.
        self._dup_low: int | None = None
        self._dup_high: int | None = None
        self._dup_prev: int | None = None
        self._flood_from: int | None = None
        self._tokens = self._limits.burst_events
        self._refilled = self._clock()
        self._rate: deque[list[int]] = deque()  # [second, events applied in it]
        self._started = self._clock()
        self._last_bad_log: float | None = None
        self._bad_suppressed = 0
        self._topic = source.topic.encode() if source.topic is not None else None

    # --- introspection ------------------------------------------------------------------------------

    @property
    def state(self) -> FeedState:
        if not self.connected:
            return "down"
        return "resyncing" if self.resyncing or self._flood_from is not None else "live"

    def events_per_s(self) -> float:
        now = self._clock()
        window = self._limits.rate_window_s
        total = sum(count for second, count in self._rate if second > now - window - 1)
        return total / max(1.0, min(float(window), now - self._started))

    def stats(self) -> FeedStats:
        return FeedStats(state=self.state, last_seq=self.last_seq, events_per_s=self.events_per_s(),
                         resyncs=self.counters.resyncs, dropped=self.counters.dropped)

    # --- sockets ------------------------------------------------------------------------------------

    async def run(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        """Subscribe until cancelled, rebuilding the socket when it stops delivering."""
        with self.scope:
            self._sink.clear(self.engine)
            while True:
                await self._session(ctx)
                self.connected = False

    async def _session(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        sub = TrioSocket.open(ctx, zmq.SUB)
        sub.socket.setsockopt(zmq.MAXMSGSIZE, self._limits.max_message_bytes)
        sub.socket.setsockopt(zmq.RCVHWM, self._limits.rcv_hwm)
        sub.socket.setsockopt(zmq.SUBSCRIBE, self._topic or b"")
        monitor = TrioSocket(sub.socket.get_monitor_socket(_MONITOR_EVENTS))
        monitor.socket.setsockopt(zmq.LINGER, 0)
        try:
            sub.socket.connect(self.source.publisher)
            inbox = _Inbox(self._limits)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read, sub, inbox)
                nursery.start_soon(self._watch, monitor, inbox, nursery.cancel_scope)
                await self._process(ctx, inbox)
        finally:
            sub.socket.disable_monitor()
            monitor.close()
            sub.close()

    async def _read(self, sub: TrioSocket, inbox: _Inbox) -> None:
        while True:
            frames = await sub.recv_multipart()
            if self._topic is not None and frames[0] != self._topic:
                continue  # SUBSCRIBE matches prefixes; the topic is a whole frame
            if not inbox.put(frames, sum(len(frame) for frame in frames)):
                # Lost here, asked again from the replay when the feed sees the gap.
                self.counters.dropped += 1

    async def _watch(self, monitor: TrioSocket, inbox: _Inbox, session: trio.CancelScope) -> None:
        disconnected = False
        while True:
            with trio.move_on_after(self._limits.stall_s if disconnected else float("inf")) as waited:
                frames = await monitor.recv_multipart()
            if waited.cancelled_caught:
                # ZeroMQ drops a connection that sent a message over ZMQ_MAXMSGSIZE and, that being a
                # protocol error, does not reconnect: the one disconnect with no retry after it (any other
                # protocol error looks the same; oversize is the one a publisher of vLLM's format makes).
                self._bad("MessageTooLarge")
                session.cancel()
                return
            event = parse_monitor_message(frames)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                disconnected = False
                self.connected = True
                inbox.put(_CONNECTED)
            elif event == zmq.EVENT_DISCONNECTED:
                disconnected = True
                self.connected = False
            else:  # a retry scheduled: ZeroMQ is still trying
                disconnected = False

    # --- the sequence -------------------------------------------------------------------------------

    async def _process(self, ctx: zmq.Context[zmq.Socket[bytes]], inbox: _Inbox) -> None:
        # ZeroMQ's monitor may report a session's first handshake after a live message of that connection was
        # read: that message already put the feed in step (its catch-up, or its gap filled), and a replay asked
        # again would close the window that skips the live copies of what the catch-up delivered.
        live_first = connected_before = False
        while True:
            item = await inbox.get()
            if item is _CONNECTED:
                first, connected_before = not connected_before, True
                if first and live_first:
                    continue
                # Messages published while we were away (or before our subscription reached the
                # publisher) are only in its replay buffer.
                if self.last_seq is None:
                    await self._catch_up(ctx)
                else:
                    await self._fill_gap(ctx, None)
                continue
            assert isinstance(item, list)
            if len(item) != 3:
                self._bad("KvWireError")
                continue
            try:
                seq = decode_seq(item[1])
            except KvWireError:
                self._bad("KvWireError")
                continue
            if seq < 0:
                self._bad("KvWireError")
                continue
            live_first = live_first or not connected_before
            await self._on_live(ctx, seq, item[2])

    async def _on_live(self, ctx: zmq.Context[zmq.Socket[bytes]], seq: int, payload: bytes) -> None:
        if not self._admit():
            if self._flood_from is None:
                self._flood_from = seq if self.last_seq is None else self.last_seq + 1
            self.counters.dropped += 1
            return
        if self._flood_from is not None:
            # The flood is over: what it dropped is not asked again (it would be the flood again).
            self._resync(self._flood_from, seq - 1, "flood")
            self._flood_from = None
            self.last_seq = seq - 1
            self._caught_up = True
        if self._dup_high is not None:
            assert self._dup_low is not None
            if self._dup_low <= seq <= self._dup_high and (self._dup_prev is None or seq > self._dup_prev):
                self._dup_prev = seq  # already had from the replay
                return
            self._dup_high = None
        if self.last_seq is None:
            if not self._caught_up:
                await self._catch_up(ctx)
                await self._on_live(ctx, seq, payload)
                return
            self._apply(seq, payload)
        elif seq == self.last_seq + 1:
            self._apply(seq, payload)
        elif seq > self.last_seq + 1:
            await self._fill_gap(ctx, seq)
            if self._flood_from is not None:
                self.counters.dropped += 1
                return
            if self.last_seq is not None and seq <= self.last_seq:
                return  # the replay brought it
            if self.last_seq is not None and seq > self.last_seq + 1:
                self._resync(self.last_seq + 1, seq - 1, "replay_incomplete")
            self._apply(seq, payload)
        else:
            # Backwards: a new publisher process, counting from 0 again.
            self._resync(self.last_seq + 1, seq, "publisher_restarted")
            self.last_seq = None
            self._caught_up = False
            await self._on_live(ctx, seq, payload)

    async def _catch_up(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        """The publisher's history, from its replay buffer: an engine's cache predates our subscription."""
        self._caught_up = True
        if self.source.replay is not None:
            await self._replay(ctx, 0, catch_up=True)

    async def _fill_gap(self, ctx: zmq.Context[zmq.Socket[bytes]], seen: int | None) -> None:
        """Ask the replay from last_seq+1; when it cannot answer, clear (the feed goes on from live)."""
        assert self.last_seq is not None
        want = self.last_seq + 1
        failure = "no_replay" if self.source.replay is None else await self._replay(ctx, want, catch_up=False)
        if failure is None or failure == "flood" or self.last_seq is None:
            return
        if seen is None:
            # A reconnect whose replay could not answer: whatever was published meanwhile (a new process,
            # evictions) is unknown. Cleared, and in step again from the next live message.
            self._resync(want, None, failure)
            self.last_seq = None
            self._caught_up = True
            return
        if self.last_seq + 1 < seen:
            # What is still missing is lost: cleared, and in step again with the message that showed the gap.
            self._resync(self.last_seq + 1, seen - 1, failure)
            self.last_seq = seen - 1

    async def _replay(self, ctx: zmq.Context[zmq.Socket[bytes]], start: int, *, catch_up: bool) -> str | None:
        """Apply what the replay socket sends from ``start``; None when it ended, else why it failed."""
        assert self.source.replay is not None
        if not self._charge(self._limits.replay_cost):
            if not catch_up:
                self._flood_from = start
            return "flood"
        self.resyncing = True
        dealer = TrioSocket.open(ctx, zmq.DEALER)
        dealer.socket.setsockopt(zmq.MAXMSGSIZE, self._limits.max_message_bytes)
        dealer.socket.setsockopt(zmq.RCVHWM, self._limits.rcv_hwm)
        first: int | None = None
        try:
            dealer.socket.connect(self.source.replay)
            with trio.move_on_after(self._limits.replay_max_s):
                sent = False
                with trio.move_on_after(self._limits.replay_idle_s):
                    # A DEALER with no peer yet cannot send: this waits for the connection too.
                    await dealer.send_multipart([b"", encode_seq(start)])
                    sent = True
                while sent:
                    with trio.move_on_after(self._limits.replay_idle_s) as idle:
                        frames = await dealer.recv_multipart()
                    if idle.cancelled_caught:
                        break
                    if len(frames) != 4 or frames[0] != b"":
                        self._bad("KvWireError")
                        continue
                    try:
                        seq = decode_seq(frames[2])
                    except KvWireError:
                        self._bad("KvWireError")
                        continue
                    if seq == END_SEQ:
                        self._open_dup_window(first)
                        return None
                    if not self._admit():
                        self._flood_from = self.last_seq + 1 if self.last_seq is not None else max(0, seq)
                        self.counters.dropped += 1
                        return "flood"
                    if seq < 0 or (self.last_seq is not None and seq <= self.last_seq):
                        self._charge(1)  # a replay of copies costs the budget too
                        continue
                    if self.last_seq is not None and seq > self.last_seq + 1 and not catch_up:
                        # The replay buffer no longer holds what we missed.
                        self._resync(self.last_seq + 1, seq - 1, "replay_incomplete")
                    first = seq if first is None else first
                    self._apply(seq, frames[3])
            self._open_dup_window(first)
            return "replay_timeout"
        finally:
            dealer.close()
            self.resyncing = False

    def _open_dup_window(self, first: int | None) -> None:
        # Only what the replay delivered: a new publisher counting from 0 again must not look like copies.
        if first is None or self.last_seq is None:
            self._dup_low = self._dup_high = None
        else:
            self._dup_low, self._dup_high = first, self.last_seq
        self._dup_prev = None

    def _apply(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        try:
            batch = decode_batch(payload)
        except KvWireError:
            # Its place in the sequence is taken (replay would send the same bytes); its events are lost.
            self._bad("KvWireError")
            return
        self._charge(len(batch.events) + 1)
        now = self._clock()
        self._sink.apply(self.engine, batch, now)
        second = int(now)
        if self._rate and self._rate[-1][0] == second:
            self._rate[-1][1] += len(batch.events)
        else:
            self._rate.append([second, len(batch.events)])
            while len(self._rate) > self._limits.rate_window_s + 1:
                self._rate.popleft()

    # --- budget, resyncs, bad messages --------------------------------------------------------------

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self._limits.burst_events,
                           self._tokens + max(0.0, now - self._refilled) * self._limits.events_per_s)
        self._refilled = now

    def _admit(self) -> bool:
        """May one more message be decoded? During a flood, not until half the burst is back."""
        self._refill()
        floor = self._limits.burst_events / 2 if self._flood_from is not None else 0.0
        return self._tokens > floor

    def _charge(self, cost: float) -> bool:
        self._refill()
        self._tokens -= cost
        return self._tokens + cost > 0

    def _resync(self, from_seq: int, to_seq: int | None, reason: str) -> None:
        self._sink.clear(self.engine)
        self.counters.resyncs += 1
        self._dup_low = self._dup_high = None
        log_event("kv_events_resync", level=logging.WARNING, engine=self.engine, from_seq=from_seq,
                  to_seq=to_seq, reason=reason)

    def _bad(self, error: str) -> None:
        self.counters.dropped += 1
        self._charge(1)  # garbage costs the budget as a batch does
        now = self._clock()
        if self._last_bad_log is not None and now - self._last_bad_log < self._limits.bad_log_interval_s:
            self._bad_suppressed += 1
            return
        log_event("kv_events_bad_message", level=logging.WARNING, engine=self.engine, error=error,
                  suppressed=self._bad_suppressed)
        self._last_bad_log = now
        self._bad_suppressed = 0


class KvFeeds:
    """The engines' KV event feeds: one per engine with a publisher, all in run()'s nursery."""

    def __init__(self, sink: KvSink, *, clock: Callable[[], float] = trio.current_time,
                 limits: FeedLimits = DEFAULT_LIMITS) -> None:
        self.sink = sink
        self.clock = clock
        self.limits = limits
        self._feeds: dict[str, _Feed] = {}
        self._counters: dict[str, _Counters] = {}
        self._nursery: trio.Nursery | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the feeds until cancelled (sources set before start now)."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for feed in self._feeds.values():
                    self._run_feed(feed)
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            if self._ctx is not None:
                self._ctx.destroy(linger=0)
                self._ctx = None

    def _run_feed(self, feed: _Feed) -> None:
        assert self._nursery is not None
        if self._ctx is None:
            # Made with the first feed: a router with no publisher runs no ZeroMQ I/O thread.
            self._ctx = zmq.Context()
        self._nursery.start_soon(feed.run, self._ctx)

    def _start(self, engine: str, source: FeedSource) -> None:
        counters = self._counters.setdefault(engine, _Counters())
        feed = _Feed(engine, source, self, counters)
        self._feeds[engine] = feed
        if self._nursery is not None:
            self._run_feed(feed)

    def set_sources(self, sources: Mapping[str, FeedSource]) -> None:
        """Start feeds for new engines, stop those of engines gone, restart those whose source changed."""
        for engine in [engine for engine in self._feeds if engine not in sources]:
            self._feeds.pop(engine).scope.cancel()
            self._counters.pop(engine, None)
        for engine, source in sources.items():
            current = self._feeds.get(engine)
            if current is not None and current.source == source:
                continue
            if current is not None:
                current.scope.cancel()
            self._start(engine, source)

    def new_process(self, engine: str) -> None:
        """Readmission saw a new engine process: its entries go, and its feed starts over."""
        self.sink.clear(engine)
        feed = self._feeds.get(engine)
        if feed is not None:
            feed.scope.cancel()
            self._start(engine, feed.source)

    def stats(self) -> dict[str, FeedStats]:
        """Each engine's feed (``blocks`` left 0 for the caller to fill from the index)."""
        return {engine: feed.stats() for engine, feed in self._feeds.items()}

    def live(self, engine: str) -> bool:
        """Whether the engine's feed is connected and in step."""
        feed = self._feeds.get(engine)
        return feed is not None and feed.state == "live"
