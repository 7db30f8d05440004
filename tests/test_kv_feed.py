"""KV event feeds against a publisher that speaks vLLM's ZmqEventPublisher protocol over real ZeroMQ.

The publisher is an XPUB (to the subscriber, the same as vLLM's PUB) so that a test can wait for the
subscription to arrive instead of sleeping; its ROUTER answers replay requests as vLLM's does: the
buffered batches from ``start_seq``, then sequence -1 with an empty payload. Every wait is bounded.
"""

from __future__ import annotations

import json
import logging
import subprocess
import time
from collections.abc import Callable

import pytest
import trio
import zmq

import narwhal.kv_events.feed as feed_module
from narwhal.kv_events.feed import FeedLimits, FeedSource, KvFeeds
from narwhal.kv_events.wire import AllBlocksCleared, KvBatch, encode_batch
from narwhal.kv_events.zmq_trio import TrioSocket

WAIT = 15  # seconds any step may take on a loaded machine (real sockets, real time)


class Sink:
    """Records what the feeds write; tasks wait on its changes."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, float | None]] = []  # (kind, engine, batch ts)
        self._changed = trio.Event()

    def apply(self, engine: str, batch: KvBatch, now: float) -> None:
        self.calls.append(("apply", engine, batch.ts))
        self._changed.set()

    def clear(self, engine: str) -> None:
        self.calls.append(("clear", engine, None))
        self._changed.set()

    def applied(self, engine: str = "e") -> list[float]:
        """The batches (their ts, which the tests set to the seq) applied since the last clear."""
        seen: list[float] = []
        for kind, name, ts in self.calls:
            if name == engine:
                if kind == "clear":
                    seen = []
                else:
                    assert ts is not None
                    seen.append(ts)
        return seen

    def clears(self, engine: str = "e") -> int:
        return sum(1 for kind, name, _ in self.calls if kind == "clear" and name == engine)

    async def until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            self._changed = trio.Event()
            await self._changed.wait()


class Publisher:
    """vLLM's ZmqEventPublisher, as trio tasks: XPUB for the live batches, ROUTER for replay."""

    def __init__(self, ctx: zmq.Context, *, topic: bytes = b"kv", port: int | None = None,
                 replay_port: int | None = None, replay: bool = True) -> None:
        self.ctx = ctx
        self.topic = topic
        self.buffer: list[tuple[int, bytes]] = []
        self.next_seq = 0
        self.replay_requests: list[int] = []
        self.replay_gate = trio.Event()
        self.replay_gate.set()
        self.answer_replay = True
        self._asked = trio.Event()
        self._subscribed = trio.Event()
        self.subscriptions = 0
        self.closed = False
        self.unsubscriptions = 0
        self.pub = self._bind_pub(port)
        self.port = int(self.pub.socket.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self.router: TrioSocket | None = None
        self.replay_port: int | None = None
        if replay:
            self.router = TrioSocket.open(ctx, zmq.ROUTER)
            bind(self.router, replay_port)
            self.replay_port = int(self.router.socket.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])

    def _bind_pub(self, port: int | None) -> TrioSocket:
        pub = TrioSocket.open(self.ctx, zmq.XPUB)
        pub.socket.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription is seen, even a repeated one
        bind(pub, port)
        return pub

    def source(self, **overrides) -> FeedSource:
        fields = {"publisher": f"tcp://127.0.0.1:{self.port}",
                  "replay": f"tcp://127.0.0.1:{self.replay_port}" if self.replay_port else None,
                  "topic": self.topic.decode()}
        fields.update(overrides)
        return FeedSource(**fields)

    def publish(self, payload: bytes | None = None, *, send: bool = True, keep: bool = True,
                seq: int | None = None) -> int:
        """Publish the next batch (ts = its seq); ``send``/``keep``: on the PUB socket / in the replay buffer."""
        seq = self.next_seq if seq is None else seq
        self.next_seq = seq + 1
        if payload is None:
            payload = encode_batch(KvBatch(float(seq), [AllBlocksCleared()]))
        if send:
            self.pub.send_multipart_nowait([self.topic, seq.to_bytes(8, "big"), payload])
        if keep:
            self.buffer.append((seq, payload))
        return seq

    async def serve(self) -> None:
        """Take subscriptions and answer replay requests until cancelled."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._subscriptions)
            if self.router is not None:
                nursery.start_soon(self._replays)

    async def _subscriptions(self) -> None:
        while True:
            try:
                [message] = await self.pub.recv_multipart()
            except trio.ClosedResourceError:
                # Closed by close(), or by rebind() (which binds the new socket before returning).
                if self.closed:
                    return
                continue
            if message[:1] == b"\x01":
                self.subscriptions += 1
                self._subscribed.set()
            else:
                self.unsubscriptions += 1

    async def _replays(self) -> None:
        assert self.router is not None
        while True:
            try:
                client, empty, start = await self.router.recv_multipart()
            except trio.ClosedResourceError:
                return
            start_seq = int.from_bytes(start, "big")
            self.replay_requests.append(start_seq)
            self._asked.set()
            await self.replay_gate.wait()
            if not self.answer_replay:
                continue
            for seq, payload in list(self.buffer):
                if seq >= start_seq:
                    await self.router.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    async def subscribed(self) -> None:
        """Wait for the next subscription to reach this publisher."""
        await self._subscribed.wait()
        self._subscribed = trio.Event()

    async def asked(self, count: int) -> None:
        """Wait until ``count`` replay requests have come."""
        while len(self.replay_requests) < count:
            self._asked = trio.Event()
            await self._asked.wait()

    def rebind(self) -> None:
        """Close the PUB socket and bind a new one on the same port (the subscriber reconnects)."""
        self.pub.close()
        self.pub = self._bind_pub(self.port)

    def close(self) -> None:
        self.closed = True
        self.pub.close()
        if self.router is not None:
            self.router.close()


def bind(socket: TrioSocket, port: int | None) -> None:
    """Bind on 127.0.0.1 (a random port for None), retrying while a just-closed socket still holds the port."""
    for _ in range(200):
        try:
            socket.socket.bind(f"tcp://127.0.0.1:{port or 0}")
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or port is None:
                raise
            time.sleep(0.01)  # ZeroMQ's I/O thread releases the port
    raise AssertionError(f"port {port} stays in use")


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def events(caplog: pytest.LogCaptureFixture, name: str) -> list[dict]:
    lines = [json.loads(record.getMessage()) for record in caplog.records if record.name == "narwhal.events"]
    return [line for line in lines if line["event"] == name]


@pytest.fixture(autouse=True)
def _capture(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")


async def wait_until(predicate: Callable[[], bool]) -> None:
    """For what only shows in the feed's stats (no event to wait on): look again every few ms."""
    while not predicate():
        await trio.sleep(0.005)


async def start(nursery: trio.Nursery, feeds: KvFeeds, *publishers: Publisher) -> None:
    for publisher in publishers:
        nursery.start_soon(publisher.serve)
    await nursery.start(feeds.run)


async def follow(nursery: trio.Nursery, feeds: KvFeeds, pub: Publisher) -> None:
    """``pub`` and the feeds running, engine "e" subscribed to it and its first replay (the catch-up) asked."""
    await start(nursery, feeds, pub)
    feeds.set_sources({"e": pub.source()})
    await pub.subscribed()
    await pub.asked(1)


FAST = FeedLimits(replay_idle_s=0.5, stall_s=0.5)


async def test_batches_reach_the_sink_in_order(ctx) -> None:
    pub = Publisher(ctx)
    for _ in range(3):  # the engine's history before the router subscribed: caught up from replay
        pub.publish(send=False)
    sink = Sink()
    feeds = KvFeeds(sink, limits=FAST)
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            await follow(nursery, feeds, pub)
            for _ in range(20):
                pub.publish()
            await sink.until(lambda: len(sink.applied()) == 23)
            assert sink.applied() == [float(seq) for seq in range(23)]
            pub.publish()  # once it arrives, any replay still running has ended
            await sink.until(lambda: len(sink.applied()) == 24)
            assert pub.replay_requests[0] == 0
            stats = feeds.stats()["e"]
            assert (stats.state, stats.last_seq, stats.dropped, stats.resyncs) == ("live", 23, 0, 0)
            assert stats.events_per_s > 0 and stats.blocks == 0  # blocks: the caller's, from the index
            assert feeds.live("e")
            nursery.cancel_scope.cancel()
    pub.close()


async def test_a_gap_is_filled_by_replay(ctx) -> None:
    pub = Publisher(ctx)
    sink = Sink()
    feeds = KvFeeds(sink, limits=FAST)
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            await follow(nursery, feeds, pub)
            pub.publish()
            await sink.until(lambda: sink.applied() == [0.0])
            pub.publish(send=False)  # seq 1 never reaches the subscriber
            pub.publish(send=False)
            pub.publish()
            await sink.until(lambda: len(sink.applied()) == 4)
            assert sink.applied() == [0.0, 1.0, 2.0, 3.0]
            assert pub.replay_requests[1:] == [1]
            assert sink.clears() == 1  # only the feed's start
            assert feeds.stats()["e"].resyncs == 0
            nursery.cancel_scope.cancel()
    pub.close()


async def test_a_reconnect_asks_replay(ctx) -> None:
    pub = Publisher(ctx)
    sink = Sink()
    feeds = KvFeeds(sink, limits=FAST)
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            await follow(nursery, feeds, pub)
            pub.publish()
            await sink.until(lambda: sink.applied() == [0.0])
            pub.rebind()
            pub.publish(send=False)  # published while the subscriber was away
            await pub.subscribed()
            await pub.asked(2)
            assert pub.replay_requests[1] == 1
            await sink.until(lambda: sink.applied() == [0.0, 1.0])
            pub.publish()
            await sink.until(lambda: sink.applied() == [0.0, 1.0, 2.0])
            assert feeds.stats()["e"].resyncs == 0
            nursery.cancel_scope.cancel()
    pub.close()


async def test_a_live_batch_read_before_the_connection_event_is_not_a_publisher_restart(ctx, caplog,
                                                                                       monkeypatch) -> None:
    """ZeroMQ's monitor may report the handshake after the first live batch of that connection was read (seen in
    the real-vLLM tier on a loaded machine). That batch's catch-up covered what the subscription missed; the late
    event must not ask the replay again and close the window that skips the live copies of what the catch-up
    delivered (a copy then looked like a new publisher counting from 0: a resync that cleared the engine)."""
    held: list[feed_module._Inbox] = []
    put = feed_module._Inbox.put

    def hold_connected(self: feed_module._Inbox, item: object, size: int = 0) -> bool:
        if item is feed_module._CONNECTED and not held:
            held.append(self)
            return True
        return put(self, item, size)

    monkeypatch.setattr(feed_module._Inbox, "put", hold_connected)
    pub = Publisher(ctx)
    sink = Sink()
    feeds = KvFeeds(sink, limits=FAST)
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            await start(nursery, feeds, pub)
            pub.publish(send=False)  # before the subscription: only in the replay buffer
            feeds.set_sources({"e": pub.source()})
            await pub.subscribed()
            pub.publish()  # seq 1, live: read before the handshake event, it asks the catch-up
            pub.publish(send=False)  # seq 2: its live copy is still on its way when the catch-up has it
            await sink.until(lambda: sink.applied() == [0.0, 1.0, 2.0])
            assert pub.replay_requests == [0]
            # A second replay (what the late event asked before) is answered once the copy is on its way.
            pub.replay_gate = trio.Event()
            put(held[0], feed_module._CONNECTED)  # the handshake event, late
            pub.pub.send_multipart_nowait([pub.topic, (2).to_bytes(8, "big"), pub.buffer[2][1]])
            pub.publish(keep=False)  # seq 3, live only: read after the copy
            pub.replay_gate.set()
            await sink.until(lambda: 3.0 in sink.applied())
            assert feeds.stats()["e"].resyncs == 0 and not events(caplog, "kv_events_resync")
            assert sink.applied() == [0.0, 1.0, 2.0, 3.0] and sink.clears() == 1
            assert pub.replay_requests == [0]
            nursery.cancel_scope.cancel()
    pub.close()


@pytest.mark.parametrize("case", ["incomplete", "no_replay", "timeout"])
async def test_replay_that_cannot_cover_clears_and_logs(ctx, caplog, case) -> None:
    pub = Publisher(ctx, replay=case != "no_replay")
    sink = Sink()
    feeds = KvFeeds(sink, limits=FAST)
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            await start(nursery, feeds, pub)
            feeds.set_sources({"e": pub.source()})
            await pub.subscribed()
            if case != "no_replay":
                await pub.asked(1)
            pub.publish()
            await sink.until(lambda: sink.applied() == [0.0])
            # Seqs 1 and 2 never reach the subscriber, and the replay buffer no longer holds them.
            pub.publish(send=False, keep=False)
            pub.publish(send=False, keep=False)
            if case == "timeout":
                pub.answer_replay = False
            pub.publish()
            await sink.until(lambda: sink.applied() == [3.0])
            assert sink.clears() == 2
            reason = {"incomplete": "replay_incomplete", "no_replay": "no_replay", "timeout": "replay_timeout"}[case]
            [resync] = events(caplog, "kv_events_resync")
            assert (resync["engine"], resync["from_seq"], resync["to_seq"], resync["reason"]) == ("e", 1, 2, reason)
            pub.publish()
            await sink.until(lambda: sink.applied() == [3.0, 4.0])
            assert feeds.stats()["e"].resyncs == 1
            nursery.cancel_scope.cancel()
    pub.close()


async def test_sequence_going_backwards_clears(ctx, caplog) -> None:
    pub = Publisher(ctx)
    sink = Sink()
    feeds = KvFeeds(sink, limits=FAST)
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            await follow(nursery, feeds, pub)
            for _ in range(4):
                pub.publish()
            await sink.until(lambda: len(sink.applied()) == 4)
            # A new publisher process: its own buffer, counting from 0 again.
            pub.buffer, pub.next_seq = [], 0
            pub.publish(send=False)
            pub.publish()
            await sink.until(lambda: sink.clears() == 2 and sink.applied() == [0.0, 1.0])
            [resync] = events(caplog, "kv_events_resync")
            assert resync["reason"] == "publisher_restarted"
            assert (resync["from_seq"], resync["to_seq"]) == (4, 1)
            pub.publish()
            await sink.until(lambda: sink.applied() == [0.0, 1.0, 2.0])
            nursery.cancel_scope.cancel()
    pub.close()


async def test_a_message_over_the_bound_is_dropped_and_the_feed_goes_on(ctx, caplog) -> None:
    pub = Publisher(ctx)
    sink = Sink()
    feeds = KvFeeds(sink, limits=FeedLimits(max_message_bytes=1000, replay_idle_s=0.5, stall_s=0.5))
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            await follow(nursery, feeds, pub)
            pub.publish()
            await sink.until(lambda: sink.applied() == [0.0])
            pub.publish(b"\x00" * 5000, keep=False)
            # ZeroMQ drops the connection and does not come back: the feed rebuilds its socket.
            await pub.subscribed()
            await pub.asked(2)
            pub.publish()
            await sink.until(lambda: sink.applied() == [2.0])
            stats = feeds.stats()["e"]
            assert stats.dropped == 1
            [bad] = events(caplog, "kv_events_bad_message")
            assert (bad["engine"], bad["error"]) == ("e", "MessageTooLarge")
            pub.publish()
            await sink.until(lambda: sink.applied() == [2.0, 3.0])
            nursery.cancel_scope.cancel()
    pub.close()


async def test_garbage_is_dropped_and_counted(ctx, caplog) -> None:
    pub = Publisher(ctx)
    sink = Sink()
    feeds = KvFeeds(sink, limits=FAST)
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            await follow(nursery, feeds, pub)
            pub.publish()
            pub.publish(b"\xc1garbage")
            pub.publish(b"\x92\xcb")
            pub.pub.send_multipart_nowait([pub.topic, b"short", b""])
            pub.publish()
            await sink.until(lambda: sink.applied() == [0.0, 3.0])
            pub.publish()  # behind the bad frames on the wire: they have been read when it arrives
            await sink.until(lambda: sink.applied() == [0.0, 3.0, 4.0])
            assert feeds.stats()["e"].dropped == 3
            assert feeds.stats()["e"].last_seq == 4
            [bad] = events(caplog, "kv_events_bad_message")  # rate-limited: one line
            assert (bad["engine"], bad["error"]) == ("e", "KvWireError")
            nursery.cancel_scope.cancel()
    pub.close()


async def test_a_flood_past_the_budget_is_dropped_and_resynced(ctx, caplog) -> None:
    now = [1000.0]
    pub = Publisher(ctx)
    sink = Sink()
    limits = FeedLimits(events_per_s=10, burst_events=20, replay_cost=1, replay_idle_s=0.5, stall_s=0.5)
    feeds = KvFeeds(sink, clock=lambda: now[0], limits=limits)
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            await follow(nursery, feeds, pub)
            for _ in range(30):  # each costs 2 (one event, one message); the clock stands still
                pub.publish(keep=False)
            await sink.until(lambda: len(sink.applied()) == 10)
            await wait_until(lambda: feeds.stats()["e"].dropped == 20)
            assert feeds.stats()["e"].state == "resyncing"
            now[0] += 60  # the budget refills; the next batch ends the flood
            pub.publish()
            await sink.until(lambda: sink.applied() == [30.0])
            [resync] = events(caplog, "kv_events_resync")
            assert (resync["from_seq"], resync["to_seq"], resync["reason"]) == (10, 29, "flood")
            assert feeds.stats()["e"].resyncs == 1
            assert feeds.stats()["e"].state == "live"
            nursery.cancel_scope.cancel()
    pub.close()


async def test_state_down_resyncing_live(ctx) -> None:
    sink = Sink()
    feeds = KvFeeds(sink, limits=FAST)
    # Ports taken now, the publisher bound later.
    probe = Publisher(ctx)
    port, replay_port = probe.port, probe.replay_port
    probe.close()
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            await nursery.start(feeds.run)
            feeds.set_sources({"e": FeedSource(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}", "kv")})
            assert feeds.stats()["e"].state == "down"
            assert not feeds.live("e")
            pub = Publisher(ctx, port=port, replay_port=replay_port)
            pub.publish(send=False)
            pub.replay_gate = trio.Event()
            nursery.start_soon(pub.serve)
            await pub.subscribed()
            await pub.asked(1)
            assert feeds.stats()["e"].state == "resyncing"
            pub.replay_gate.set()
            await sink.until(lambda: sink.applied() == [0.0])
            pub.publish()
            await sink.until(lambda: sink.applied() == [0.0, 1.0])
            assert feeds.stats()["e"].state == "live"
            assert feeds.live("e")
            pub.close()
            await wait_until(lambda: feeds.stats()["e"].state == "down")
            nursery.cancel_scope.cancel()


async def test_set_sources_starts_stops_and_restarts(ctx) -> None:
    a, b = Publisher(ctx), Publisher(ctx)
    sink = Sink()
    feeds = KvFeeds(sink, limits=FAST)
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            await start(nursery, feeds, a, b)
            feeds.set_sources({"a": a.source()})
            await a.subscribed()
            await a.asked(1)
            assert set(feeds.stats()) == {"a"}
            feeds.set_sources({"a": a.source(), "b": b.source()})
            await b.subscribed()
            await b.asked(1)
            b.publish()
            await sink.until(lambda: sink.applied("b") == [0.0])
            # Same sources again: nothing restarts.
            feeds.set_sources({"a": a.source(), "b": b.source()})
            # a goes (its subscription is withdrawn), b's source changes (restarted: cleared, caught up again).
            feeds.set_sources({"b": b.source(topic=None)})
            await b.asked(2)
            assert pub_requests(b) == [0, 0]
            assert set(feeds.stats()) == {"b"}
            await sink.until(lambda: sink.clears("b") == 2 and sink.applied("b") == [0.0])
            await wait_until(lambda: a.unsubscriptions == 1)
            assert sink.clears("a") == 1
            nursery.cancel_scope.cancel()
    a.close()
    b.close()


def pub_requests(pub: Publisher) -> list[int]:
    return pub.replay_requests


async def test_new_process_clears_and_starts_over(ctx) -> None:
    pub = Publisher(ctx)
    sink = Sink()
    feeds = KvFeeds(sink, limits=FAST)
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            await follow(nursery, feeds, pub)
            pub.publish()
            await sink.until(lambda: sink.applied() == [0.0])
            pub.buffer = []
            feeds.new_process("e")
            assert sink.calls[-1] == ("clear", "e", None)
            assert feeds.stats()["e"].last_seq is None
            await pub.subscribed()
            await pub.asked(2)
            assert pub.replay_requests == [0, 0]
            pub.publish()
            await sink.until(lambda: sink.applied() == [1.0])
            nursery.cancel_scope.cancel()
    pub.close()


async def test_only_the_topic_asked_for(ctx) -> None:
    pub = Publisher(ctx, topic=b"kv")
    sink = Sink()
    feeds = KvFeeds(sink, limits=FAST)
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            await follow(nursery, feeds, pub)
            # A topic that only starts with ours (ZeroMQ's subscription matches it) is not ours.
            pub.pub.send_multipart_nowait([b"kv-other", (7).to_bytes(8, "big"),
                                           encode_batch(KvBatch(7.0, [AllBlocksCleared()]))])
            pub.publish()
            pub.publish()
            await sink.until(lambda: sink.applied() == [0.0, 1.0])
            assert feeds.stats()["e"].dropped == 0
            nursery.cancel_scope.cancel()
    pub.close()


async def test_live_batches_held_during_a_replay_are_bounded(ctx) -> None:
    pub = Publisher(ctx)
    sink = Sink()
    # The replay is held by the test's gate, not by time: an idle limit of WAIT, so a loaded machine that takes
    # seconds to read the ten batches cannot end the replay before the gate opens (with 2 s a loaded CI run
    # once waited here until WAIT).
    feeds = KvFeeds(sink, limits=FeedLimits(inbox_messages=3, replay_idle_s=WAIT, stall_s=0.5))
    with trio.fail_after(WAIT):
        async with trio.open_nursery() as nursery:
            await start(nursery, feeds, pub)
            pub.replay_gate = trio.Event()
            feeds.set_sources({"e": pub.source()})
            await pub.subscribed()
            await pub.asked(1)
            for _ in range(10):  # held while the replay is answered: three kept, the rest dropped
                pub.publish()
            await wait_until(lambda: feeds.stats()["e"].dropped == 7)
            pub.replay_gate.set()  # the replay brings them all
            await sink.until(lambda: len(sink.applied()) == 10)
            pub.publish()
            await sink.until(lambda: sink.applied() == [float(seq) for seq in range(11)])
            assert feeds.stats()["e"].resyncs == 0
            nursery.cancel_scope.cancel()
    pub.close()


VLLM_PUBLISHER = """
import sys
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher
publisher = ZmqEventPublisher(0, endpoint=f"tcp://*:{sys.argv[1]}", replay_endpoint=f"tcp://*:{sys.argv[2]}",
                              topic="kv")
print("ready", flush=True)
for line in sys.stdin:
    n = int(line)
    publisher.publish(KVEventBatch(ts=float(n), events=[
        BlockStored(block_hashes=[n, 2**64 - 1 - n], parent_block_hash=None, token_ids=list(range(8)),
                    block_size=4, lora_id=None, medium="GPU", lora_name=None),
        BlockRemoved(block_hashes=[n], medium="GPU")]))
publisher.shutdown()
"""


def real_vllm_python() -> str | None:
    """The real-vLLM tier's venv python, if one was built here (any recipe: vLLM's publisher is what is used)."""
    from tests.real_vllm.setup_env import cache_root

    for python in sorted(cache_root().glob("venv-*/bin/python")):
        if list(python.parent.parent.glob("lib/python3*/site-packages/vllm/distributed/kv_events.py")):
            return str(python)
    return None


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class BatchSink(Sink):
    def __init__(self) -> None:
        super().__init__()
        self.batches: list[KvBatch] = []

    def apply(self, engine: str, batch: KvBatch, now: float) -> None:
        self.batches.append(batch)
        super().apply(engine, batch, now)


# vLLM's own publisher runs in the real-vLLM tier's venv (importing vLLM takes seconds): the tier runs this
# test (tests/real_vllm/test_kv_publisher_real.py), the main suite does not.
@pytest.mark.real_vllm
async def test_vllms_own_publisher(tmp_path) -> None:
    python = real_vllm_python()
    if python is None:
        pytest.skip("no real-vLLM venv here (python3 tests/real_vllm/setup_env.py builds one)")
    from narwhal.kv_events.wire import BlockRemoved, BlockStored

    script = tmp_path / "publisher.py"
    script.write_text(VLLM_PUBLISHER)
    port, replay_port = free_port(), free_port()
    sink = BatchSink()
    feeds = KvFeeds(sink, limits=FAST)
    with trio.fail_after(180):
        proc = await trio.lowlevel.open_process([python, str(script), str(port), str(replay_port)],
                                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                stderr=subprocess.DEVNULL)
        assert proc.stdin is not None and proc.stdout is not None
        try:
            seen = b""
            while b"ready\n" not in seen:
                chunk = await proc.stdout.receive_some()
                assert chunk, "vLLM's publisher exited"
                seen += chunk
            for n in range(3):  # published before the router subscribed: caught up from vLLM's replay
                await proc.stdin.send_all(f"{n}\n".encode())
            async with trio.open_nursery() as nursery:
                await nursery.start(feeds.run)
                # vLLM publishes from a thread: wait until the history is in its replay buffer.
                while sink.applied() != [0.0, 1.0, 2.0]:
                    feeds.set_sources({})
                    feeds.set_sources({"e": FeedSource(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}",
                                                       "kv")})
                    with trio.move_on_after(2):
                        await sink.until(lambda: sink.applied() == [0.0, 1.0, 2.0])
                # Live now; a batch published before our subscription reached vLLM is lost to the live
                # socket, and the next one's gap brings it back from the replay.
                n = 3
                while sink.applied() != [float(seq) for seq in range(n)] or n < 6:
                    await proc.stdin.send_all(f"{n}\n".encode())
                    n += 1
                    with trio.move_on_after(2):
                        await sink.until(lambda want=n: len(sink.applied()) >= want)
                assert feeds.stats()["e"].resyncs == 0
                last = sink.batches[-1]
                k = int(last.ts)
                assert last.events == [BlockStored([k, 2**64 - 1 - k], None, list(range(8)), 4, medium="GPU"),
                                       BlockRemoved([k], medium="GPU")]
                nursery.cancel_scope.cancel()
        finally:
            await proc.stdin.aclose()
            with trio.move_on_after(10):
                await proc.wait()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
