"""The relay pump (narwhal/http1/pump.py): every live decode stream read and written from the readiness hub.

The engine side is the real data pool against scripted engines on 127.0.0.1
(``tests/test_pools_data.py``); the client side is either a socketpair standing
in for the front's connection, or the real front (``HTTPServer`` + request core)
driven over TCP.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import socket
import struct
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import trio

from narwhal.config import parse_config
from narwhal.errors import EngineFailure, FailureClass, SuccessKind
from narwhal.fleet.admission import Admission
from narwhal.fleet.placement import InFlight
from narwhal.http1 import client as client_module
from narwhal.http1.server import ClientDisconnected, HTTPServer
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.pools.data import DataPool, UpstreamStream
from narwhal.serving.request_core import RequestCore
from tests import test_hostile_engines as hostile_engines
from tests import test_pools_data
from tests.test_pools_data import EVENTS, FAST, LAST_CHUNK, SSE_HEAD, FakeEngine, FakeRequest, chunk, sse

# The scripted engines and the pool, as tests/test_pools_data.py has them.
serve = test_pools_data.serve
make_pool = test_pools_data.make_pool

# Deadlines out of the way (a loaded machine connects 1,000 sockets slowly).
SLOW_DEADLINES = msgspec.structs.replace(FAST, stream_silence_s=30.0, first_token_deadline_s=30.0,
                                         request_timeout_s=30.0, connect_timeout_s=30.0)


class Client:
    """The front's side of one client connection, over a socketpair: what the pump writes to."""

    def __init__(self, *, small: bool = False) -> None:
        self.ours, self.peer = socket.socketpair()
        self.ours.setblocking(False)
        self.peer.setblocking(False)
        if small:
            # A few KiB of buffer: a client that does not read fills it at once.
            self.ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            self.peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.disconnected = False
        self.write_since = math.inf
        self.on_stall: Callable[[], None] | None = None
        self.scope: trio.CancelScope | None = None
        self.received = bytearray()

    @property
    def fd(self) -> int:
        return self.ours.fileno()

    def write_waits(self, on_stall: Callable[[], None]) -> None:
        self.write_since = trio.current_time()
        self.on_stall = on_stall

    def write_done(self) -> None:
        self.write_since = math.inf
        self.on_stall = None

    def cut_mid_write(self) -> None:
        self.disconnected = True

    def client_gone(self) -> None:
        self.disconnected = True
        if self.scope is not None:
            self.scope.cancel()

    def gone_error(self) -> Exception:
        return ClientDisconnected("the client has gone")

    async def read_until(self, size: int) -> bytes:
        """What the client received, once it is at least ``size`` bytes."""
        while len(self.received) < size:
            await trio.lowlevel.wait_readable(self.peer)
            try:
                data = self.peer.recv(1 << 20)
            except BlockingIOError:
                continue
            if not data:
                break
            self.received += data
        return bytes(self.received)

    async def send(self, data: bytes) -> None:
        """Write as the front's own ``send`` would (waiting while the client's socket is full)."""
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self.fd, view):]
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self.ours)

    def close(self) -> None:
        self.ours.close()
        self.peer.close()


@pytest.fixture
def clients():
    made: list[Client] = []

    def make(**kwargs: Any) -> Client:
        made.append(Client(**kwargs))
        return made[-1]
    yield make
    for client in made:
        client.close()


def until_done(upstream: UpstreamStream):
    """The plain relay's step: every read as it came, until the read that carries [DONE]."""
    def on_chunk(data: bytes, now: float) -> bytes | None:
        return None if upstream.saw_terminal else data
    return on_chunk


async def pumped(pool: DataPool, engine: FakeEngine, client: Client, *, chunked: bool = False,
                 request_id: str = "r1") -> tuple[bytes, bytes]:
    """One stream: its first read (written to the client as the front's head would be), then the pump.

    Returns (first read, the read carrying [DONE] that the pump handed back).
    """
    async with pool.stream(engine.spec, "/v1/completions", b"{}", request_id=request_id) as upstream:
        first = await upstream.read()
        os.write(client.fd, chunk(first) if chunked else first)
        assert pool.pump.can_relay(upstream)
        declined = await pool.pump.relay(upstream, client, chunked, until_done(upstream))
        assert await upstream.read() == b""
    # As the request task does: the read carrying [DONE] goes out with the chunked terminator.
    await client.send(chunk(declined) + LAST_CHUNK if chunked else declined)
    return first, declined


def paced(events: list[bytes], delay_s: float, *, then_forever: bool = False):
    """An engine that writes each event as its own chunk, ``delay_s`` apart (as vLLM does)."""
    async def respond(request: FakeRequest, stream: trio.SocketStream, index: int) -> bool:
        await stream.send_all(SSE_HEAD)
        for event in events:
            await stream.send_all(chunk(event))
            await trio.sleep(delay_s)
        if then_forever:
            await trio.sleep_forever()
        await stream.send_all(LAST_CHUNK)
        return True
    return respond


def numbered(stream_id: int, count: int, size: int = 0) -> list[bytes]:
    pad = b"x" * size
    return [b'data: {"s": %d, "i": %d, "p": "%s"}\n\n' % (stream_id, i, pad) for i in range(count)] + [EVENTS[2]]


# Both ways the hub's rounds run: from trio's idle wait while streams are live, or only in the hub task.
HUB_MODES = pytest.mark.parametrize("inline", [True, False], ids=["inline-rounds", "hub-task"])


# -- the pump and the data pool ----------------------------------------------------------------


@HUB_MODES
async def test_a_pumped_stream_reaches_its_client_chunk_framed_and_hands_back_done(serve, make_pool, clients, inline):
    engine = await serve(paced(EVENTS, 0.001))
    pool = await make_pool(SLOW_DEADLINES, relay_inline=inline)
    client = clients()
    with trio.fail_after(10):
        first, declined = await pumped(pool, engine, client, chunked=True)
    assert first == EVENTS[0]
    # [DONE] goes back to the request task, which writes it with the chunked terminator.
    assert declined == EVENTS[2]
    whole = b"".join(map(chunk, EVENTS)) + LAST_CHUNK
    assert await client.read_until(len(whole)) == whole
    assert pool.pump.streams == 0
    # Read to its end: the connection goes back to the pool for the next request.
    assert pool.statistics().idle_connections == 1 and pool.statistics().in_use == 0


@HUB_MODES
async def test_a_pumped_socket_is_in_the_pump_set_for_its_stream_only_and_serves_the_next_request(
        serve, make_pool, clients, inline):
    engine = await serve(paced(EVENTS, 0.001))
    pool = await make_pool(SLOW_DEADLINES, relay_inline=inline)
    readiness = pool.pump.readiness
    seen: list[int] = []
    real_relay = pool.pump.relay

    async def relay(upstream, *args, **kwargs):
        seen.append(readiness.pump_sockets)
        result = await real_relay(upstream, *args, **kwargs)
        seen.append(readiness.pump_sockets)
        return result
    pool.pump.relay = relay  # type: ignore[method-assign]
    inside: list[int] = []
    real_pump_in = readiness.pump_in

    def pump_in(watch):
        real_pump_in(watch)
        inside.append(readiness.pump_sockets)
    readiness.pump_in = pump_in  # type: ignore[method-assign]
    for n in range(3):
        client = clients()
        with trio.fail_after(10):
            first, declined = await pumped(pool, engine, client, request_id=f"r{n}")
        assert (first, declined) == (EVENTS[0], EVENTS[2])
        whole = b"".join(EVENTS)
        assert await client.read_until(len(whole)) == whole
    # In the pump set while its stream is pumped (with a pump set), back in the hub's set after, on the same
    # kept-alive connection each time: its head waits are the hub task's again.
    assert inside == ([1, 1, 1] if inline else [0, 0, 0])
    assert seen == [0, 0] * 3 and readiness.pump_sockets == 0
    assert pool.statistics().idle_connections == 1 and engine.connections == 1
    assert (readiness.pump_rounds > 0) is inline


@pytest.mark.parametrize("size", [1, 4089, 4090, 70000])
async def test_events_of_every_size_reach_the_client_chunk_framed(serve, make_pool, clients, size):
    # The size line comes from a table below 4096 bytes and is formatted above it; a 64 KiB read fills the
    # buffer (not drained: read again on the next round).
    big = b"data: " + b"x" * size + b"\n\n"
    events = [EVENTS[0], big, EVENTS[1], big, EVENTS[2]]
    engine = await serve(paced(events, 0.001))
    pool = await make_pool(SLOW_DEADLINES)
    client = clients()
    with trio.fail_after(10):
        first, declined = await pumped(pool, engine, client, chunked=True)
        received = b""
        while not received.endswith(LAST_CHUNK):
            received = await client.read_until(len(received) + 1)
    assert first == EVENTS[0] and declined == EVENTS[2]
    # Chunk boundaries follow the engine's reads, not its chunks: compare what the client de-chunks.
    assert sse_body(received) == b"".join(events)


def sse_body(received: bytes) -> bytes:
    """A chunked body de-chunked, through its terminator."""
    body = b""
    while True:
        size, _, rest = received.partition(b"\r\n")
        length = int(size, 16)
        if length == 0:
            assert rest == b"\r\n"
            return body
        body += rest[:length]
        assert rest[length:length + 2] == b"\r\n"
        received = rest[length + 2:]


@HUB_MODES
async def test_a_stream_whose_reads_never_block_still_lets_other_streams_progress(serve, make_pool, clients,
                                                                                 monkeypatch, inline):
    # Reads of a full buffer never wait; make a full buffer small and endless for one engine socket.
    size = 256
    monkeypatch.setattr(client_module, "_READ_SIZE", size)
    payload = b"data: " + b"x" * (size - 6 - 6 - 2) + b"\n\n"
    flood = chunk(payload)
    assert len(flood) == size
    flooded: set[int] = set()
    real_read = client_module._read
    monkeypatch.setattr(client_module, "_read", lambda fd, n: flood if fd in flooded else real_read(fd, n))

    flooding = trio.Event()
    other_done = trio.Event()
    engine = await serve(sse(EVENTS[0], then=trio.sleep_forever))
    # Paced by checkpoints, not by the wall clock: under load a millisecond sleep let the flood reach its limit.
    other_engine = await serve(paced(numbered(0, 20), 0))
    pool = await make_pool(SLOW_DEADLINES, relay_inline=inline)
    reads = 0
    limit = 20000

    async def flooded_stream() -> None:
        async with pool.stream(engine.spec, "/v1/completions", b"{}", request_id="flood") as upstream:
            assert await upstream.read() == EVENTS[0]
            flooded.add(upstream._conn._fd)
            upstream._conn._drained = False  # as if that first read had filled the buffer
            flooding.set()

            def on_chunk(data: bytes, now: float) -> bytes | None:
                nonlocal reads
                assert data == payload
                reads += 1
                # Bounded: a pump that never yields would read on to the limit before the other stream ends.
                return None if other_done.is_set() or reads >= limit else b""
            await pool.pump.relay(upstream, clients(), False, on_chunk)

    async def other_stream() -> None:
        await flooding.wait()
        client = clients()
        await pumped(pool, other_engine, client, request_id="other")
        whole = b"".join(numbered(0, 20))
        assert await client.read_until(len(whole)) == whole
        other_done.set()

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(flooded_stream)
            nursery.start_soon(other_stream)
    assert other_done.is_set() and 0 < reads < limit


@HUB_MODES
async def test_a_full_client_socket_stalls_only_its_own_stream(serve, make_pool, clients, inline):
    events_a, events_b = numbered(1, 200, 1000), numbered(2, 200, 1000)
    engine_a = await serve(paced(events_a, 0))
    engine_b = await serve(paced(events_b, 0))
    pool = await make_pool(SLOW_DEADLINES, relay_inline=inline)
    slow, fast = clients(small=True), clients()
    done_a = trio.Event()
    upstreams: dict[str, UpstreamStream] = {}

    async def relay(name: str, engine: FakeEngine, client: Client) -> None:
        async with pool.stream(engine.spec, "/v1/completions", b"{}", request_id=name) as upstream:
            upstreams[name] = upstream
            os.write(client.fd, await upstream.read())
            declined = await pool.pump.relay(upstream, client, False, until_done(upstream))
            assert await upstream.read() == b""
        await client.send(declined)

    async def stream_a() -> None:
        await relay("a", engine_a, slow)
        done_a.set()

    whole_a, whole_b = b"".join(events_a), b"".join(events_b)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream_a)
            # B runs to its end (its client reading along) while A's client reads nothing at all.
            nursery.start_soon(relay, "b", engine_b, fast)
            assert await fast.read_until(len(whole_b)) == whole_b
            assert not done_a.is_set()
            # A is parked on its client (the front's write watchdog sees it), and that is not engine silence.
            assert slow.write_since < math.inf
            assert upstreams["a"]._conn.waiting_since == math.inf
            assert pool.pump.streams == 1
            # Now A's client reads: A resumes and finishes, every byte in order.
            assert await slow.read_until(len(whole_a)) == whole_a
            await done_a.wait()
    assert slow.write_since == math.inf and pool.pump.streams == 0


async def test_the_silence_deadline_fires_for_a_pumped_stream(serve, make_pool, clients, autojump_clock):
    engine = await serve(paced(EVENTS[:2], 0, then_forever=True))
    pool = await make_pool(msgspec.structs.replace(FAST, stream_silence_s=10.0, first_token_deadline_s=20.0,
                                                   request_timeout_s=60.0))
    client = clients()
    started = trio.current_time()
    with pytest.raises(EngineFailure) as caught:
        await pumped(pool, engine, client)
    assert caught.value.failure_class is FailureClass.STREAM
    assert "silent for more than 10 s" in caught.value.message
    assert trio.current_time() - started == pytest.approx(10.0, abs=1e-6)
    assert pool.pump.streams == 0 and pool.statistics().in_use == 0


async def test_a_pumped_streams_deadline_comes_out_of_the_pump_as_a_reads_failure(serve, make_pool, clients,
                                                                                    autojump_clock):
    engine = await serve(paced(EVENTS[:1], 0, then_forever=True))
    pool = await make_pool(msgspec.structs.replace(FAST, stream_silence_s=10.0, first_token_deadline_s=20.0,
                                                   request_timeout_s=60.0))
    client = clients()
    async with pool.stream(engine.spec, "/v1/completions", b"{}", request_id="r2") as upstream:
        os.write(client.fd, await upstream.read())
        # The watchdog reaches the pump through the engine connection: the pump's read raises the failure and
        # hands it to the request task, with no scope cancelled around it.
        with pytest.raises(EngineFailure) as caught:
            await pool.pump.relay(upstream, client, False, until_done(upstream))
        assert pool.pump.streams == 0
        await trio.sleep(1.0)
    assert "silent for more than 10 s" in caught.value.message and caught.value.cause == "DeadlineExpired"
    assert pool.statistics().in_use == 0


async def test_a_slow_client_holding_up_the_pump_is_not_engine_silence(serve, make_pool, clients, autojump_clock):
    events = numbered(3, 100, 1000)
    engine = await serve(paced(events, 0.01))
    pool = await make_pool(msgspec.structs.replace(FAST, stream_silence_s=1.0, first_token_deadline_s=1.0,
                                                   request_timeout_s=60.0))
    client = clients(small=True)
    result: list[tuple[bytes, bytes]] = []

    async def stream() -> None:
        result.append(await pumped(pool, engine, client))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream)
        # The client reads nothing for 20 silence periods: the engine answered meanwhile, so nothing fails.
        await trio.sleep(20.0)
        assert client.write_since < math.inf
        received = await client.read_until(len(b"".join(events)))
    assert received == b"".join(events) and result


@HUB_MODES
async def test_a_client_that_disconnects_mid_stream_closes_the_engine_stream(serve, make_pool, clients, inline):
    engine = await serve(paced([b'data: {"i": 1}\n\n'] * 100000, 0.001))
    pool = await make_pool(SLOW_DEADLINES, relay_inline=inline)
    client = clients()
    with trio.fail_after(10):
        with trio.CancelScope() as scope:
            client.scope = scope

            async def leave() -> None:
                await client.read_until(200)
                # What the front's readiness hub does when the client's socket hangs up.
                client.client_gone()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(leave)
                await pumped(pool, engine, client)
        assert scope.cancelled_caught
        await engine.client_closed.wait()
    assert pool.pump.streams == 0 and pool.statistics().in_use == 0


async def test_a_write_to_a_client_that_reset_ends_the_stream_with_client_disconnected(serve, make_pool,
                                                                                      clients):
    engine = await serve(paced([b'data: {"i": 1}\n\n'] * 100000, 0.001))
    pool = await make_pool(SLOW_DEADLINES)
    client = clients()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            async def leave() -> None:
                await client.read_until(200)
                client.peer.close()
            nursery.start_soon(leave)
            with pytest.raises(ClientDisconnected):
                await pumped(pool, engine, client)
        await engine.client_closed.wait()
    assert client.disconnected
    assert pool.pump.streams == 0 and pool.statistics().in_use == 0


async def test_a_failure_in_the_step_is_raised_in_the_request_task(serve, make_pool, clients):
    engine = await serve(paced(EVENTS, 0.001))
    pool = await make_pool(SLOW_DEADLINES)

    def on_chunk(data: bytes, now: float) -> bytes | None:
        raise EngineFailure("e1", FailureClass.STREAM, "unreadable decode stream")

    with trio.fail_after(10), pytest.raises(EngineFailure, match="unreadable"):
        async with pool.stream(engine.spec, "/v1/completions", b"{}", request_id="x") as upstream:
            await upstream.read()
            await pool.pump.relay(upstream, clients(), False, on_chunk)
    assert pool.pump.streams == 0 and pool.statistics().in_use == 0


@HUB_MODES
async def test_a_thousand_concurrent_paced_streams_through_one_pump_arrive_whole_and_in_order(serve, make_pool,
                                                                                              clients, inline):
    streams, events = 1000, 12
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 8 * streams
    if soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            pytest.skip(f"needs {needed} file descriptors, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))

    arrived = 0
    all_in = trio.Event()

    async def respond(request: FakeRequest, stream: trio.SocketStream, index: int) -> bool:
        nonlocal arrived
        mine = numbered(int(request.headers[b"x-request-id"]), events)
        await stream.send_all(SSE_HEAD + chunk(mine[0]))
        arrived += 1
        if arrived == streams:
            all_in.set()
        # Every stream is live at once: the rest comes only when all of them have begun.
        await all_in.wait()
        for event in mine[1:]:
            await trio.sleep(0.005)
            await stream.send_all(chunk(event))
        await stream.send_all(LAST_CHUNK)
        return True

    engine = await serve(respond)
    pool = await make_pool(SLOW_DEADLINES, max_connections=streams, relay_inline=inline)
    most = 0
    done = 0

    async def one(i: int) -> None:
        nonlocal done
        client = clients()
        await pumped(pool, engine, client, request_id=str(i))
        expected = b"".join(numbered(i, events))
        assert await client.read_until(len(expected)) == expected
        done += 1

    async def sample() -> None:
        nonlocal most
        while True:
            most = max(most, pool.pump.streams)
            await trio.sleep(0.005)

    try:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(sample)
                async with trio.open_nursery() as streaming:
                    for i in range(streams):
                        streaming.start_soon(one, i)
                nursery.cancel_scope.cancel()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert done == streams
    # They were in the pump together, not one after another.
    assert most > streams * 9 // 10


# -- the whole front: HTTPServer, request core, data pool and its pump ------------------------------

FRONT_CONFIG = """
[serving]
count_tokens = false
request_deadline_s = {deadline}
client_write_timeout_s = {write}
relay_pump = {pump}
policy = "{policy}"
[engine]
request_timeout_s = 100.0
first_token_deadline_s = {first}
stream_silence_s = {silence}
[[engines]]
name = "p1"
url = "http://127.0.0.1:{prefill_port}"
role = "prefill"
[[engines]]
name = "d1"
url = "http://127.0.0.1:{decode_port}"
role = "decode"
"""
STREAM_REQUEST = b'{"model": "mock-model", "prompt": "hi", "max_tokens": 8, "stream": true}'


@pytest.fixture(autouse=True)
def _capture_events(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")


# Client connections the tests opened to the front, closed after each test (by ``front``).
_connections: list[trio.socket.SocketType] = []



def request_events(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "narwhal.events"]
    return [line for line in lines if line["event"] == "request"]


async def request_logged(caplog: pytest.LogCaptureFixture) -> dict[str, Any]:
    """The one ``request`` line, once written: the client has its [DONE] before the engine's body is read to
    its end, and the line follows that."""
    with trio.fail_after(100):
        while not request_events(caplog):
            await trio.sleep(0.01)
    (logged,) = request_events(caplog)
    return logged


def decode_sse(events: list[bytes], *, delay_s: float = 0.0, then_forever: bool = False):
    """A decode engine (``tests/test_hostile_engines.py`` style) streaming ``events`` as chunks."""
    respond = paced(events, delay_s, then_forever=then_forever)

    async def handler(stream: trio.SocketStream, _: bytes) -> None:
        await respond(None, stream, 0)  # paced never reads the request
    return handler


@pytest.fixture
async def front(hostile, nursery: trio.Nursery):
    """Start the front over a prefill and a decode engine; returns (port, supervisor, pool, decode engine)."""
    async def start(decode: Any, *, first: float = 30.0, silence: float = 30.0, write: float = 30.0,
                    pump: bool = True, policy: str = "saturate", deadline: float = 1000.0):
        p, d = await hostile(hostile_engines.PREFILL_ANSWER), await hostile(decode)
        config = parse_config(FRONT_CONFIG.format(prefill_port=p.port, decode_port=d.port, first=first,
                                                  silence=silence, write=write, pump=str(pump).lower(),
                                                  policy=policy, deadline=deadline))
        pool = DataPool(max_connections=8, engine_config=config.engine)
        await nursery.start(pool.run)
        supervisor = hostile_engines.RecordingSupervisor()
        core = RequestCore(config=config, supervisor=supervisor, data_pool=pool, in_flight=InFlight(["p1", "d1"]),
                           admission=Admission(), metrics=metrics)

        async def handle(request: Any, responder: Any) -> None:
            await core.handle(request.path, request.body, None, responder)
        server = HTTPServer(handle, client_write_timeout_s=config.serving.client_write_timeout_s)
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        pools.append(pool)
        start.core = core  # type: ignore[attr-defined]
        return port, supervisor, pool, d

    pools: list[DataPool] = []
    start.metrics = metrics = RouterMetrics()  # type: ignore[attr-defined]
    yield start
    while _connections:
        _connections.pop().close()
    for pool in pools:
        await pool.aclose()


hostile = hostile_engines.hostile


async def post_stream(port: int, body: bytes = STREAM_REQUEST, *, rcvbuf: int | None = None) -> trio.SocketStream:
    sock = trio.socket.socket()
    _connections.append(sock)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    await sock.connect(("127.0.0.1", port))
    stream = trio.SocketStream(sock)
    await stream.send_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\n\r\n%s" % (len(body), body))
    return stream


async def read_response(stream: trio.SocketStream) -> bytes:
    """One chunked response, through its terminator."""
    received = b""
    while not received.endswith(b"0\r\n\r\n"):
        data = await stream.receive_some(65536)
        assert data, received
        received += data
    return received


def sse_payloads(response: bytes) -> list[bytes]:
    body = response.partition(b"\r\n\r\n")[2]
    data = b""
    while body:
        size, _, rest = body.partition(b"\r\n")
        length = int(size, 16)
        data += rest[:length]
        body = rest[length + 2:]
    return [event.removeprefix(b"data: ") for event in data.split(b"\n\n") if event]


TOKEN_EVENTS = [b'data: {"choices": [{"text": "t%d"}]}\n\n' % i for i in range(8)] + [EVENTS[2]]


async def test_the_front_relays_a_stream_through_the_pump_with_counts_and_metrics(front, caplog):
    port, supervisor, pool, _ = await front(decode_sse(TOKEN_EVENTS, delay_s=0.001))
    with trio.fail_after(10):
        stream = await post_stream(port)
        response = await read_response(stream)
    assert response.startswith(b"HTTP/1.1 200")
    assert sse_payloads(response) == [event[6:-2] for event in TOKEN_EVENTS]
    logged = await request_logged(caplog)
    assert ("d1", SuccessKind.DECODE_TERMINAL) in supervisor.successes
    assert logged["relay"] == "pump" and logged["status"] == 200 and logged["tokens"] == 8
    assert logged["ttft_ms"] is not None
    # One inter-token gap per read after the first, observed by the pump's step as by the task's loop.
    assert 1 <= front.metrics.inter_token.count("mock-model") <= len(TOKEN_EVENTS) - 1
    assert front.metrics.ttft.count("/v1/completions", "mock-model") == 1
    assert pool.pump.streams == 0


async def test_the_first_token_deadline_fires_with_the_pump_on(front, caplog, autojump_clock):
    port, supervisor, _, _ = await front(decode_sse([], then_forever=True), first=4.0, silence=30.0)
    started = trio.current_time()
    stream = await post_stream(port)
    response = b""
    while b"\r\n\r\n" not in response or not response.endswith(b"}"):
        response += await stream.receive_some(65536)
    assert response.startswith(b"HTTP/1.1 502")
    assert b"first token" in response
    assert 4.0 <= trio.current_time() - started <= 4.0 + 0.2 + 1e-6
    assert supervisor.failures == [("d1", FailureClass.STREAM)]


async def test_silence_mid_stream_in_the_pump_ends_the_stream_with_the_sse_error_and_blames_the_decode(
        front, caplog, autojump_clock):
    port, supervisor, pool, _ = await front(decode_sse(TOKEN_EVENTS[:3], then_forever=True), first=30.0,
                                            silence=10.0)
    stream = await post_stream(port)
    silent_from = trio.current_time()
    response = await read_response(stream)
    assert 10.0 <= trio.current_time() - silent_from <= 10.0 + 0.5 + 1e-6
    payloads = sse_payloads(response)
    assert payloads[:3] == [event[6:-2] for event in TOKEN_EVENTS[:3]]
    # The SSE error event, and no [DONE]: the client knows the answer is cut.
    error = json.loads(payloads[-1])["error"]
    assert error["code"] == "stream" and "silent for more than 10 s" in error["message"]
    assert b"[DONE]" not in response
    assert supervisor.failures == [("d1", FailureClass.STREAM)]
    (logged,) = request_events(caplog)
    assert logged["relay"] == "pump" and logged["error"] == "stream" and logged["tokens"] == 3
    assert pool.pump.streams == 0 and pool.statistics().in_use == 0


async def test_a_client_that_stops_reading_is_cut_by_the_write_watchdog_and_its_engine_stream_closed(
        front, caplog, autojump_clock):
    events = [b'data: {"choices": [{"text": "%s"}]}\n\n' % (b"x" * 2000)] * 100000
    port, supervisor, pool, decode = await front(decode_sse(events, delay_s=0.001), write=5.0)
    stream = await post_stream(port, rcvbuf=4096)
    # The client reads the head, then nothing: the front's buffer fills and the pump parks the stream.
    assert (await stream.receive_some(100)).startswith(b"HTTP/1.1 200")
    await decode.cut_off.wait()
    (logged,) = request_events(caplog)
    assert logged["relay"] == "pump" and logged["status"] == 499 and logged["error"] == "client_stalled"
    # A stalled client is no evidence against the engine.
    assert supervisor.failures == []
    assert pool.pump.streams == 0 and pool.statistics().in_use == 0


@pytest.mark.parametrize("last", [chunk(EVENTS[1]), chunk(EVENTS[1]) + b"%x\r\n" % len(EVENTS[2])],
                         ids=["an-event", "an-event-then-bare-chunk-framing"])
async def test_an_engine_that_closes_right_after_its_last_bytes_fails_the_stream_not_hangs(serve, make_pool,
                                                                                           clients, last):
    # The bytes and the close arrive together: one edge, and no edge ever again for the EOF.
    in_pump = trio.Event()

    async def respond(request: FakeRequest, stream: trio.SocketStream, index: int) -> bool:
        await stream.send_all(SSE_HEAD + chunk(EVENTS[0]))
        await in_pump.wait()
        # No checkpoint between the bytes and the FIN: the router's hub sees them as one edge.
        os.write(stream.socket.fileno(), last)
        stream.socket.shutdown(socket.SHUT_WR)
        await trio.sleep_forever()
        return False

    engine = await serve(respond)
    pool = await make_pool(SLOW_DEADLINES)
    client = clients()
    with trio.fail_after(10), pytest.raises(EngineFailure) as caught:
        async with pool.stream(engine.spec, "/v1/completions", b"{}", request_id="cut") as upstream:
            os.write(client.fd, await upstream.read())
            in_pump.set()
            await pool.pump.relay(upstream, client, False, until_done(upstream))
    assert caught.value.failure_class is FailureClass.STREAM and "without data: [DONE]" in caught.value.message
    assert await client.read_until(len(EVENTS[0] + EVENTS[1])) == EVENTS[0] + EVENTS[1]
    assert pool.pump.streams == 0 and pool.statistics().in_use == 0


async def test_an_http_1_0_client_gets_the_pumped_stream_unframed_until_close(front, caplog):
    port, _, pool, _ = await front(decode_sse(TOKEN_EVENTS, delay_s=0.001))
    sock = trio.socket.socket()
    _connections.append(sock)
    await sock.connect(("127.0.0.1", port))
    stream = trio.SocketStream(sock)
    await stream.send_all(b"POST /v1/completions HTTP/1.0\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\n\r\n%s" % (len(STREAM_REQUEST), STREAM_REQUEST))
    response = b""
    with trio.fail_after(10):
        while data := await stream.receive_some(65536):
            response += data
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding" not in head.lower()
    # No chunk framing: HTTP/1.0 has none; the body ends when the connection closes.
    assert body == b"".join(TOKEN_EVENTS)
    (logged,) = request_events(caplog)
    assert logged["relay"] == "pump" and logged["tokens"] == 8
    assert pool.pump.streams == 0


@pytest.mark.parametrize("policy", ["saturate", "bounded"])
@pytest.mark.parametrize("pump", [True, False], ids=["pump", "task"])
async def test_a_client_that_leaves_mid_stream_is_logged_with_the_tokens_it_received(front, caplog, pump, policy):
    # Ten tokens, then the engine goes on (silent, connection open); the client reads the ten and closes.
    port, supervisor, pool, _ = await front(decode_sse(TOKEN_EVENTS[:8] + TOKEN_EVENTS[:2], then_forever=True),
                                            pump=pump, policy=policy)
    with trio.fail_after(10):
        stream = await post_stream(port)
        received = b""
        while received.count(b"data: ") < 10:
            data = await stream.receive_some(65536)
            assert data, received
            received += data
        # A reset: a FIN alone is a half-close, which the front answers on.
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await stream.aclose()
        while not request_events(caplog):
            await trio.sleep(0.01)
    (logged,) = request_events(caplog)
    assert logged["status"] == 499 and logged["error"] == "client_disconnected"
    assert logged["relay"] == ("pump" if pump else "task") and logged["tokens"] == 10
    # The client leaving is no evidence against the engine.
    assert supervisor.failures == []


# -- the end of an engine's body, and what may follow [DONE] (both relays) ----------------------------


@pytest.mark.parametrize("when", ["while-pumped", "before-the-handover"])
async def test_a_body_that_ends_in_the_read_of_its_last_event_without_done_ends_the_pumped_stream_at_once(
        serve, make_pool, clients, autojump_clock, when):
    # The last event and the chunked terminator come in one read: no edge ever comes again, so the
    # pump must see the body's end in that read, not wait for the silence deadline (30 s here).
    go, sent = trio.Event(), trio.Event()

    async def respond(request: FakeRequest, stream: trio.SocketStream, index: int) -> bool:
        await stream.send_all(SSE_HEAD + chunk(EVENTS[0]))
        await go.wait()
        os.write(stream.socket.fileno(), chunk(EVENTS[1]) + LAST_CHUNK)
        sent.set()
        return True

    engine = await serve(respond)
    pool = await make_pool(SLOW_DEADLINES)
    # Once racy (the end seen in some tries only): deterministic now, every time.
    for _ in range(50):
        go, sent = trio.Event(), trio.Event()
        client = clients()
        started = trio.current_time()
        with pytest.raises(EngineFailure) as caught:
            async with pool.stream(engine.spec, "/v1/completions", b"{}", request_id="r") as upstream:
                os.write(client.fd, await upstream.read())
                go.set()
                if when == "before-the-handover":
                    await sent.wait()
                await pool.pump.relay(upstream, client, False, until_done(upstream))
        assert trio.current_time() - started < 1.0
        assert caught.value.failure_class is FailureClass.STREAM
        assert caught.value.message == "stream ended without data: [DONE]"
        assert await client.read_until(len(EVENTS[0] + EVENTS[1])) == EVENTS[0] + EVENTS[1]
        assert pool.pump.streams == 0 and pool.statistics().in_use == 0
        client.close()


@pytest.mark.parametrize("pump", [True, False], ids=["pump", "task-relay"])
async def test_a_decode_body_ending_without_done_ends_the_client_stream_at_once(front, caplog, autojump_clock,
                                                                              pump):
    async def decode(stream: trio.SocketStream, _: bytes) -> None:
        await stream.send_all(SSE_HEAD + chunk(TOKEN_EVENTS[0]))
        # Mock time: this passes once the router has relayed the first event and waits for more.
        await trio.sleep(1.0)
        os.write(stream.socket.fileno(), chunk(TOKEN_EVENTS[1]) + LAST_CHUNK)
        # Kept open until the router closes it or sends its next request (then closed, and retried fresh).
        await stream.receive_some(65536)

    port, supervisor, pool, _ = await front(decode, silence=30.0, pump=pump)
    for _ in range(10):
        caplog.clear()
        supervisor.failures.clear()
        started = trio.current_time()
        stream = await post_stream(port)
        response = await read_response(stream)
        assert trio.current_time() - started < 2.0
        payloads = sse_payloads(response)
        assert payloads[:2] == [event[6:-2] for event in TOKEN_EVENTS[:2]]
        error = json.loads(payloads[-1])["error"]
        assert error["code"] == "stream" and error["message"].endswith("stream ended without data: [DONE]")
        assert supervisor.failures == [("d1", FailureClass.STREAM)]
        (logged,) = request_events(caplog)
        assert logged["relay"] == ("pump" if pump else "task") and logged["error"] == "stream"
        assert pool.pump.streams == 0


def completion_event(text: str, finish: str | None = None) -> bytes:
    return b"data: " + json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "mock-model",
                                   "choices": [{"index": 0, "text": text, "logprobs": None,
                                                "finish_reason": finish}]}, separators=(",", ":")).encode() + b"\n\n"


ANSWER = [completion_event("a"), completion_event("b"), completion_event("c"), completion_event("d", "length")]
DONE_EVENT = b"data: [DONE]\n\n"


def answer_then(tail: str, *, whole: bool) -> Any:
    """A decode engine: the answer and [DONE] (in one read, or after a first event), then ``tail``."""
    # "event-in-the-same-read": [DONE]'s read goes on with an event (then the body ends).
    same_read = completion_event("late") if tail == "event-in-the-same-read" else b""

    async def decode(stream: trio.SocketStream, _: bytes) -> None:
        if whole:
            await stream.send_all(SSE_HEAD + chunk(b"".join(ANSWER) + DONE_EVENT + same_read))
        else:
            await stream.send_all(SSE_HEAD + chunk(ANSWER[0]))
            await trio.sleep(1.0)
            await stream.send_all(chunk(b"".join(ANSWER[1:]) + DONE_EVENT + same_read))
        if same_read:
            await stream.send_all(LAST_CHUNK)
            await trio.sleep_forever()
        # Mock time: the router has read [DONE] and waits for what comes next.
        await trio.sleep(1.0)
        if tail == "keep-alive":
            await stream.send_all(chunk(b": keep-alive\n\n"))
            await trio.sleep(1.0)
            await stream.send_all(LAST_CHUNK)
            await trio.sleep_forever()
        elif tail == "stall":
            await trio.sleep_forever()
        # "close": gone without the chunked terminator (the hostile engine closes the socket on return).
    return decode


@pytest.mark.parametrize("whole", [True, False], ids=["answer-in-one-read", "answer-after-a-first-event"])
@pytest.mark.parametrize("policy", ["bounded", "saturate"])
@pytest.mark.parametrize("pump", [True, False], ids=["pump", "task-relay"])
@pytest.mark.parametrize("tail", ["keep-alive", "stall", "close", "event-in-the-same-read"])
async def test_whatever_follows_done_ends_the_stream_whole_and_charges_the_engine_nothing(
        front, caplog, autojump_clock, tail, pump, policy, whole):
    port, supervisor, pool, _ = await front(answer_then(tail, whole=whole), silence=30.0, pump=pump, policy=policy)
    started = trio.current_time()
    stream = await post_stream(port, b'{"model": "mock-model", "prompt": "hi", "max_tokens": 4, "stream": true}')
    response = await read_response(stream)
    # The client has the whole answer and [DONE] as soon as [DONE] came: never after the engine's tail.
    assert trio.current_time() - started < 1.5 + (0 if whole else 1.0)
    assert response.startswith(b"HTTP/1.1 200")
    assert sse_payloads(response) == [event[6:-2] for event in ANSWER] + [b"[DONE]"]
    logged = await request_logged(caplog)
    assert logged["status"] == 200 and logged["error"] is None and logged["tokens"] == 4
    assert logged["attempts"] == 1 and logged["continuations"] == 0
    if not whole:
        assert logged["relay"] == ("pump" if pump else "task")
    retries = [r for r in caplog.records if r.name == "narwhal.events" and '"request_retry"' in r.getMessage()]
    assert retries == []
    # What followed [DONE] is no evidence against the engine: nothing charged, the decode a success.
    assert supervisor.failures == []
    assert ("d1", SuccessKind.DECODE_TERMINAL) in supervisor.successes
    assert pool.pump.streams == 0 and pool.statistics().in_use == 0


@pytest.mark.parametrize("pump", [True, False], ids=["pump", "task-relay"])
@pytest.mark.parametrize("cut_by", ["client-leaves", "request-deadline", "engine-removed"])
async def test_a_stall_after_done_cut_short_by_the_client_or_the_deadline_is_still_a_whole_answer(
        front, caplog, autojump_clock, pump, cut_by):
    # The client has its [DONE]; the engine's missing terminator is waited for until something ends the wait.
    port, supervisor, pool, _ = await front(answer_then("stall", whole=False), silence=30.0, pump=pump,
                                            deadline=5.0 if cut_by == "request-deadline" else 1000.0)
    stream = await post_stream(port, b'{"model": "mock-model", "prompt": "hi", "max_tokens": 4, "stream": true}')
    response = await read_response(stream)
    assert sse_payloads(response) == [event[6:-2] for event in ANSWER] + [b"[DONE]"]
    if cut_by == "engine-removed":
        front.core._cut("d1")
    elif cut_by == "client-leaves":
        # A reset (a FIN alone is a half-close to the front): the front cancels the request's handler.
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await stream.aclose()
    logged = await request_logged(caplog)
    # Neither the client leaving, the deadline nor a removal cut after the whole answer went out fails it.
    assert logged["status"] == 200 and logged["error"] is None and logged["tokens"] == 4
    assert supervisor.failures == []
    assert pool.pump.streams == 0 and pool.statistics().in_use == 0


async def test_a_stream_reads_one_clock_when_the_caller_gives_trios_in_either_form() -> None:
    """The request core binds trio's running clock (its ``current_time`` method); the pump must still see it as
    trio's own, so the watchdog reuses the caller's reading instead of reading the clock again."""
    from types import SimpleNamespace

    from narwhal.http1.pump import _Stream

    upstream: Any = SimpleNamespace(relay_connection=None, relay_parts=lambda: None)
    client: Any = SimpleNamespace(fd=-1)

    def stream(clock: Callable[[], float]) -> Any:
        return _Stream(None, upstream, None, client, False, lambda data: None, clock)  # type: ignore[arg-type]

    assert stream(trio.current_time).same_clock
    assert stream(trio.lowlevel.current_clock().current_time).same_clock
    assert not stream(lambda: 0.0).same_clock
