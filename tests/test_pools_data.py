"""The data pool against tiny scripted engines on real 127.0.0.1 sockets.

Each fake engine is a ``respond(request, stream, index)`` coroutine run by
``trio.serve_tcp``: it writes hand-made HTTP bytes and returns whether to keep
the connection open (``index`` counts requests on that connection).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import socket
from collections.abc import Awaitable, Callable

import msgspec
import pytest
import trio

from narwhal.config import EngineConfig, EngineSpec
from narwhal.errors import EngineFailure, FailureClass, PoolSaturated, UpstreamClientError
from narwhal.pools.data import DataPool, UpstreamStream

FAST = EngineConfig(connect_timeout_s=0.5, request_timeout_s=0.5, first_token_deadline_s=0.3,
                    stream_silence_s=0.3, pool_idle_s=4.0)

SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
LAST_CHUNK = b"0\r\n\r\n"
EVENTS = [b'data: {"text": "a"}\n\n', b'data: {"text": "b"}\n\n', b"data: [DONE]\n\n"]


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def response(status: int, body: bytes = b"", *, close: bool = False) -> bytes:
    head = [b"HTTP/1.1 %d X" % status, b"content-type: application/json", b"content-length: %d" % len(body)]
    if close:
        head.append(b"connection: close")
    return b"\r\n".join(head) + b"\r\n\r\n" + body


@dataclasses.dataclass
class FakeRequest:
    method: bytes
    path: bytes
    headers: dict[bytes, bytes]
    body: bytes


Respond = Callable[[FakeRequest, trio.SocketStream, int], Awaitable[bool]]


async def read_request(stream: trio.SocketStream, buf: bytearray) -> FakeRequest | None:
    """One request from the stream, or None when the client closed (or reset) it."""
    try:
        while b"\r\n\r\n" not in buf:
            data = await stream.receive_some(65536)
            if not data:
                return None
            buf += data
        head, _, rest = bytes(buf).partition(b"\r\n\r\n")
        request_line, *header_lines = head.split(b"\r\n")
        method, path, _ = request_line.split(b" ")
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(b":", 1) for line in header_lines)}
        length = int(headers.get(b"content-length", b"0"))
        while len(rest) < length:
            data = await stream.receive_some(65536)
            if not data:
                return None
            rest += data
    except trio.BrokenResourceError:
        return None
    buf[:] = rest[length:]
    return FakeRequest(method, path, headers, rest[:length])


class FakeEngine:
    def __init__(self, respond: Respond) -> None:
        self.respond = respond
        self.port = 0
        self.connections = 0
        self.requests: list[FakeRequest] = []
        self.client_closed = trio.Event()

    @property
    def spec(self) -> EngineSpec:
        return EngineSpec(name="e1", url=f"http://127.0.0.1:{self.port}", role="decode")

    async def handle(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        buf = bytearray()
        try:
            for index in range(100):
                request = await read_request(stream, buf)
                if request is None:
                    self.client_closed.set()
                    return
                self.requests.append(request)
                if not await self.respond(request, stream, index):
                    return
        except trio.BrokenResourceError:
            self.client_closed.set()
        finally:
            await trio.aclose_forcefully(stream)


@pytest.fixture
async def serve(nursery: trio.Nursery) -> Callable[[Respond], Awaitable[FakeEngine]]:
    async def start(respond: Respond) -> FakeEngine:
        engine = FakeEngine(respond)
        listeners = await nursery.start(functools.partial(trio.serve_tcp, engine.handle, 0, host="127.0.0.1"))
        engine.port = listeners[0].socket.getsockname()[1]
        return engine
    return start


@pytest.fixture
async def make_pool(nursery: trio.Nursery):
    pools: list[DataPool] = []

    async def make(config: EngineConfig = FAST, max_connections: int = 8, relay_inline: bool = True) -> DataPool:
        pool = DataPool(max_connections=max_connections, engine_config=config, relay_inline=relay_inline)
        await nursery.start(pool.run)
        pools.append(pool)
        return pool
    yield make
    for pool in pools:
        await pool.aclose()


async def ok_json(request: FakeRequest, stream: trio.SocketStream, index: int) -> bool:
    await stream.send_all(response(200, b'{"ok": true}'))
    return True


def sse(*parts: bytes, end: bytes = LAST_CHUNK, then: Callable[[], Awaitable[None]] | None = None) -> Respond:
    async def respond(request: FakeRequest, stream: trio.SocketStream, index: int) -> bool:
        await stream.send_all(SSE_HEAD)
        for part in parts:
            await stream.send_all(chunk(part))
        if then is not None:
            await then()
        await stream.send_all(end)
        return True
    return respond


async def post(pool: DataPool, engine: FakeEngine) -> tuple[int, bytes]:
    return await pool.post_json(engine.spec, "/v1/completions", b'{"prompt": "hi"}', request_id="r1")


# keep-alive -----------------------------------------------------------------

async def test_sequential_requests_share_one_connection(serve, make_pool):
    engine = await serve(ok_json)
    pool = await make_pool()
    for _ in range(5):
        assert await post(pool, engine) == (200, b'{"ok": true}')
    assert engine.connections == 1
    stats = pool.statistics()
    assert (stats.connections_opened, stats.idle_connections, stats.in_use) == (1, 1, 0)
    request = engine.requests[0]
    assert (request.method, request.path, request.body) == (b"POST", b"/v1/completions", b'{"prompt": "hi"}')
    assert request.headers[b"content-type"] == b"application/json"
    assert request.headers[b"x-request-id"] == b"r1"
    assert request.headers[b"host"] == f"127.0.0.1:{engine.port}".encode()


async def test_connection_idle_longer_than_idle_s_is_not_reused(serve, make_pool):
    engine = await serve(ok_json)
    pool = await make_pool(msgspec.structs.replace(FAST, pool_idle_s=0.05))
    await post(pool, engine)
    await trio.sleep(0.1)
    await post(pool, engine)
    assert engine.connections == 2
    assert pool.statistics().connections_opened == 2


async def test_connection_close_response_is_not_pooled(serve, make_pool):
    async def respond(request, stream, index):
        await stream.send_all(response(200, b"{}", close=True))
        return False
    engine = await serve(respond)
    pool = await make_pool()
    await post(pool, engine)
    assert pool.statistics().idle_connections == 0
    await post(pool, engine)
    assert engine.connections == 2


# stale connections and the one retry ---------------------------------------

async def test_engine_closing_an_idle_connection_costs_a_fresh_connection(serve, make_pool):
    async def respond(request, stream, index):
        await stream.send_all(response(200, b"{}"))
        return False  # close the keep-alive connection right after answering
    engine = await serve(respond)
    pool = await make_pool()
    await post(pool, engine)
    await trio.sleep(0.02)
    assert await post(pool, engine) == (200, b"{}")
    assert engine.connections == 2


async def test_reused_connection_closed_before_any_response_byte_is_retried_once(serve, make_pool):
    async def respond(request, stream, index):
        if index == 1:
            return False  # read the request on the reused connection, then close unanswered
        await stream.send_all(response(200, b"{}"))
        return True
    engine = await serve(respond)
    pool = await make_pool()
    await post(pool, engine)
    assert await post(pool, engine) == (200, b"{}")
    assert engine.connections == 2
    assert len(engine.requests) == 3
    assert pool.statistics().connections_opened == 2


async def test_the_retry_happens_once(serve, make_pool):
    answered = []

    async def respond(request, stream, index):
        if answered:
            return False  # every request after the first: close unanswered
        answered.append(request)
        await stream.send_all(response(200, b"{}"))
        return True
    engine = await serve(respond)
    pool = await make_pool()
    await post(pool, engine)
    with pytest.raises(EngineFailure) as caught:
        await post(pool, engine)
    assert caught.value.failure_class is FailureClass.CONNECTION
    assert engine.connections == 2


async def test_failure_after_response_bytes_is_not_retried(serve, make_pool):
    async def respond(request, stream, index):
        if index == 1:
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
            return False
        await stream.send_all(response(200, b"{}"))
        return True
    engine = await serve(respond)
    pool = await make_pool()
    await post(pool, engine)
    with pytest.raises(EngineFailure) as caught:
        await post(pool, engine)
    assert caught.value.failure_class is FailureClass.STREAM
    assert engine.connections == 1


async def test_fresh_connection_closed_before_any_response_byte_is_a_connection_failure(serve, make_pool):
    async def respond(request, stream, index):
        return False
    engine = await serve(respond)
    pool = await make_pool()
    with pytest.raises(EngineFailure) as caught:
        await post(pool, engine)
    assert caught.value.failure_class is FailureClass.CONNECTION
    assert engine.connections == 1


# classification -------------------------------------------------------------

async def test_refused_port_is_a_connection_failure(make_pool):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    spec = EngineSpec(name="gone", url=f"http://127.0.0.1:{port}", role="prefill")
    pool = await make_pool()
    with pytest.raises(EngineFailure) as caught:
        await pool.post_json(spec, "/tokenize", b"{}", request_id="r1")
    failure = caught.value
    assert (failure.engine, failure.failure_class, failure.cause) == (
        "gone", FailureClass.CONNECTION, "ConnectionRefusedError")
    assert pool.statistics().in_use == 0


async def test_engine_that_never_answers_is_a_timeout(serve, make_pool):
    async def respond(request, stream, index):
        await trio.sleep_forever()
    engine = await serve(respond)
    pool = await make_pool(msgspec.structs.replace(FAST, request_timeout_s=0.2))
    started = trio.current_time()
    with pytest.raises(EngineFailure) as caught:
        await post(pool, engine)
    assert caught.value.failure_class is FailureClass.TIMEOUT
    assert caught.value.cause == "ReadTimeout"
    assert 0.2 <= trio.current_time() - started < 0.5


@pytest.mark.parametrize(("status", "failure_class"), [
    (408, FailureClass.OVERLOAD),
    (429, FailureClass.OVERLOAD),
    (500, FailureClass.INFERENCE_STATUS),
    (503, FailureClass.INFERENCE_STATUS),
])
async def test_error_statuses_are_classified(serve, make_pool, status, failure_class):
    async def respond(request, stream, index):
        await stream.send_all(response(status, b'{"error": "busy"}'))
        return True
    engine = await serve(respond)
    pool = await make_pool()
    with pytest.raises(EngineFailure) as caught:
        await post(pool, engine)
    assert (caught.value.failure_class, caught.value.status) == (failure_class, status)
    # The error body was read to its end, so the connection stays usable.
    assert pool.statistics().idle_connections == 1


@pytest.mark.parametrize("status", [400, 404, 422])
async def test_client_error_statuses_raise_upstream_client_error_with_body(serve, make_pool, status):
    async def respond(request, stream, index):
        await stream.send_all(response(status, b'{"error": {"message": "bad prompt"}}'))
        return True
    engine = await serve(respond)
    pool = await make_pool()
    with pytest.raises(UpstreamClientError) as caught:
        await post(pool, engine)
    assert (caught.value.engine, caught.value.status) == ("e1", status)
    assert caught.value.body == b'{"error": {"message": "bad prompt"}}'


async def test_malformed_response_is_a_stream_failure(serve, make_pool):
    async def respond(request, stream, index):
        await stream.send_all(b"SMTP ready\r\n\r\n")
        return False
    engine = await serve(respond)
    with pytest.raises(EngineFailure) as caught:
        await post(await make_pool(), engine)
    assert caught.value.failure_class is FailureClass.STREAM


# streams -------------------------------------------------------------------

async def collect(pool: DataPool, engine: FakeEngine) -> tuple[list[bytes], bool]:
    items = []
    async with pool.stream(engine.spec, "/v1/completions", b'{"stream": true}', request_id="r2") as upstream:
        assert upstream.status == 200
        assert (b"content-type", b"text/event-stream") in upstream.headers
        async for item in upstream:
            items.append(item)
    return items, upstream.saw_terminal


async def test_clean_stream_yields_every_byte_and_returns_its_connection(serve, make_pool):
    async def pause():
        await trio.sleep(0.01)
    engine = await serve(sse(*EVENTS[:2], then=pause, end=chunk(EVENTS[2]) + LAST_CHUNK))
    pool = await make_pool()
    items, saw_terminal = await collect(pool, engine)
    assert b"".join(items) == b"".join(EVENTS)
    assert saw_terminal
    assert engine.requests[0].headers[b"accept"] == b"text/event-stream"
    await collect(pool, engine)
    assert engine.connections == 1


async def relay_parts(serve, make_pool, parts: list[bytes]) -> tuple[bytes, UpstreamStream]:
    """A stream whose engine writes each of ``parts`` as its own chunk: the relayed bytes, and the stream."""
    async def respond(request, stream, index):
        await stream.send_all(SSE_HEAD)
        for part in parts:
            await stream.send_all(chunk(part))
            await trio.sleep(0.01)
        await stream.send_all(LAST_CHUNK)
        return True
    engine = await serve(respond)
    pool = await make_pool()
    async with pool.stream(engine.spec, "/v1/completions", b'{"stream": true}', request_id="r") as upstream:
        relayed = b"".join([item async for item in upstream])
    return relayed, upstream


async def test_the_stream_counts_its_data_events_in_every_shape_of_read(serve, make_pool):
    # One event per read (the usual read), two in one, [DONE] with a late event after it (not relayed, not
    # counted), and events split across reads: the count is the relayed events.
    parts = [EVENTS[0], EVENTS[1], EVENTS[0] + EVENTS[1], b'data: {"te', b'xt": "c"}\n', b"\n",
             EVENTS[2] + b"data: late\n\n"]
    relayed, upstream = await relay_parts(serve, make_pool, parts)
    assert relayed == b"".join(parts[:-1]) + EVENTS[2]
    assert upstream.data_events == relayed.count(b"data: ") == 6


async def test_a_tokens_text_that_says_data_is_one_event_in_every_shape_of_read(serve, make_pool):
    # The count is by event: a token whose text holds "data: " (the usual read, two events in a read, an
    # event split across reads) is one event, as is an event of two data lines.
    says = b'data: {"text": "data: x"}\n\n'
    parts = [says, says + says, says[:8], says[8:], b"data: a\ndata: b\n\n", EVENTS[2]]
    relayed, upstream = await relay_parts(serve, make_pool, parts)
    assert relayed == b"".join(parts)
    assert upstream.data_events == 6


async def test_stream_cut_off_after_the_terminal_marker_still_ends_cleanly(serve, make_pool):
    async def respond(request, stream, index):
        await stream.send_all(SSE_HEAD + b"".join(chunk(event) for event in EVENTS))
        return False  # no chunked terminator
    engine = await serve(respond)
    pool = await make_pool()
    items, saw_terminal = await collect(pool, engine)
    assert saw_terminal and b"".join(items) == b"".join(EVENTS)
    assert pool.statistics().idle_connections == 0


async def test_no_first_token_before_the_deadline_is_a_stream_failure(serve, make_pool):
    engine = await serve(sse(then=trio.sleep_forever))
    pool = await make_pool(msgspec.structs.replace(FAST, first_token_deadline_s=0.2))
    started = trio.current_time()
    with pytest.raises(EngineFailure) as caught:
        await collect(pool, engine)
    assert caught.value.failure_class is FailureClass.STREAM
    assert "first token" in caught.value.message
    assert 0.2 <= trio.current_time() - started < 0.45


async def test_first_token_deadline_covers_a_missing_response_head(serve, make_pool):
    async def respond(request, stream, index):
        await trio.sleep_forever()
    engine = await serve(respond)
    pool = await make_pool(msgspec.structs.replace(FAST, first_token_deadline_s=0.2, request_timeout_s=5.0))
    with pytest.raises(EngineFailure) as caught:
        await collect(pool, engine)
    assert caught.value.failure_class is FailureClass.STREAM
    assert "first token" in caught.value.message


async def test_silence_mid_stream_is_a_stream_failure(serve, make_pool):
    engine = await serve(sse(EVENTS[0], then=trio.sleep_forever))
    pool = await make_pool(msgspec.structs.replace(FAST, stream_silence_s=0.2))
    items = []
    with pytest.raises(EngineFailure) as caught:
        async with pool.stream(engine.spec, "/v1/completions", b"{}", request_id="r3") as upstream:
            async for item in upstream:
                items.append(item)
    assert items == [EVENTS[0]]
    assert caught.value.failure_class is FailureClass.STREAM
    assert "silent" in caught.value.message


async def test_stream_ending_without_done_is_a_stream_failure(serve, make_pool):
    engine = await serve(sse(*EVENTS[:2]))
    pool = await make_pool()
    items = []
    with pytest.raises(EngineFailure) as caught:
        async with pool.stream(engine.spec, "/v1/completions", b"{}", request_id="r4") as upstream:
            async for item in upstream:
                items.append(item)
    assert caught.value.failure_class is FailureClass.STREAM
    assert caught.value.message == "stream ended without data: [DONE]"
    assert b"".join(items) == b"".join(EVENTS[:2])
    assert not upstream.saw_terminal


async def test_events_after_done_are_not_relayed_and_no_failure(serve, make_pool, autojump_clock):
    # [DONE] ended the answer: what follows it in later reads is read only to see whether the connection
    # can be reused. (Mock time: the engine's pause ends once the pool has read [DONE] and waits.)
    async def pause():
        await trio.sleep(0.1)
    engine = await serve(sse(*EVENTS, then=pause, end=chunk(b'data: {"text": "late"}\n\n') + LAST_CHUNK))
    pool = await make_pool()
    for _ in range(2):
        items, saw_terminal = await collect(pool, engine)
        assert saw_terminal and b"".join(items) == b"".join(EVENTS)
    # Read to its end after all: the connection was kept.
    assert engine.connections == 1


@pytest.mark.parametrize("late", [b'data: {"text": "late"}\n\n', b": keep-alive\n\n", b"garbage"])
@pytest.mark.parametrize("split", ["whole-answer", "done-starts-the-read"])
async def test_what_follows_done_in_the_same_read_is_not_relayed_and_no_failure(serve, make_pool, late, split):
    # [DONE] ends the answer even when more comes in the same read: that read is cut after [DONE].
    parts = [b"".join(EVENTS) + late] if split == "whole-answer" else [b"".join(EVENTS[:2]), EVENTS[2] + late]
    engine = await serve(sse(*parts))
    pool = await make_pool()
    items, saw_terminal = await collect(pool, engine)
    assert saw_terminal and b"".join(items) == b"".join(EVENTS)


async def test_a_token_whose_text_says_done_does_not_end_the_stream(serve, make_pool):
    said = b'data: {"text": "data: [DONE]\\n\\n"}\n\n'
    engine = await serve(sse(EVENTS[0] + said + b"data: [DONE]\n\n"))
    items, saw_terminal = await collect(await make_pool(), engine)
    assert saw_terminal and b"".join(items) == EVENTS[0] + said + b"data: [DONE]\n\n"


async def test_a_stall_or_a_close_after_done_is_no_failure(serve, make_pool, autojump_clock):
    pool = await make_pool(msgspec.structs.replace(FAST, stream_silence_s=10.0, first_token_deadline_s=20.0,
                                                   request_timeout_s=60.0))
    for stall in (True, False):
        async def respond(request: FakeRequest, stream: trio.SocketStream, index: int, stall: bool = stall) -> bool:
            await stream.send_all(SSE_HEAD + b"".join(map(chunk, EVENTS)))
            await trio.sleep(1.0)
            if stall:
                await trio.sleep_forever()
            return False  # closed, without the chunked terminator
        engine = await serve(respond)
        started = trio.current_time()
        items, saw_terminal = await collect(pool, engine)
        assert saw_terminal and b"".join(items) == b"".join(EVENTS)
        # A stall is waited for up to the silence deadline (its own, not the watchdog's: no failure).
        assert trio.current_time() - started == pytest.approx(10.0 if stall else 1.0)
        assert pool.statistics().idle_connections == 0 and pool.statistics().in_use == 0


async def test_body_that_is_not_sse_is_a_stream_failure(serve, make_pool):
    engine = await serve(sse(b"<html>upstream proxy error</html>\n\n"))
    with pytest.raises(EngineFailure) as caught:
        await collect(await make_pool(), engine)
    assert caught.value.failure_class is FailureClass.STREAM
    assert "not a server-sent event stream" in caught.value.message


async def test_stream_with_another_content_type_is_a_stream_failure(serve, make_pool):
    engine = await serve(ok_json)
    with pytest.raises(EngineFailure) as caught:
        await collect(await make_pool(), engine)
    assert caught.value.failure_class is FailureClass.STREAM


@pytest.mark.parametrize(("status", "expected"), [(503, EngineFailure), (400, UpstreamClientError)])
async def test_stream_error_status_raises_on_entering(serve, make_pool, status, expected):
    async def respond(request, stream, index):
        await stream.send_all(response(status, b'{"error": "no"}'))
        return True
    engine = await serve(respond)
    pool = await make_pool()
    with pytest.raises(expected) as caught:
        await collect(pool, engine)
    assert caught.value.status == status
    # Its body read to the end: the connection is kept, and the slot is free again.
    assert (pool.statistics().in_use, pool.statistics().idle_connections) == (0, 1)


async def test_a_stream_cancelled_before_its_head_frees_its_slot_and_closes_its_connection(serve, make_pool):
    async def respond(request, stream, index):
        await trio.sleep_forever()
    engine = await serve(respond)
    pool = await make_pool(msgspec.structs.replace(FAST, first_token_deadline_s=30.0, request_timeout_s=30.0))
    with trio.move_on_after(0.1) as waited:
        await collect(pool, engine)
    assert waited.cancelled_caught
    stats = pool.statistics()
    assert (stats.in_use, stats.idle_connections) == (0, 0)


async def one_event_then_listen(request: FakeRequest, stream: trio.SocketStream, index: int) -> bool:
    await stream.send_all(SSE_HEAD + chunk(EVENTS[0]))
    return True  # the engine then waits for the next request, or sees the close


async def test_leaving_a_stream_early_closes_its_connection(serve, make_pool):
    engine = await serve(one_event_then_listen)
    pool = await make_pool()
    async with pool.stream(engine.spec, "/v1/completions", b"{}", request_id="r5") as upstream:
        assert await upstream.__anext__() == EVENTS[0]
    with trio.fail_after(1):
        await engine.client_closed.wait()
    stats = pool.statistics()
    assert (stats.in_use, stats.idle_connections) == (0, 0)


async def test_cancelling_a_stream_closes_its_connection(serve, make_pool):
    engine = await serve(one_event_then_listen)
    pool = await make_pool()
    with trio.move_on_after(0.1):
        await collect(pool, engine)
    with trio.fail_after(1):
        await engine.client_closed.wait()
    assert pool.statistics().in_use == 0


# saturation --------------------------------------------------------------

async def test_waiting_for_a_slot_past_the_callers_deadline_is_pool_saturated(serve, make_pool, nursery,
                                                                                  autojump_clock):
    # MockClock: the pool's own scope fires SATURATION_MARGIN_S before the caller's; in real time a
    # loaded machine's scheduler stall longer than that margin let the caller's scope win instead.
    engine = await serve(sse(EVENTS[0], then=trio.sleep_forever))
    pool = await make_pool(msgspec.structs.replace(FAST, stream_silence_s=30.0), max_connections=1)
    holding = trio.Event()
    holder = trio.CancelScope()

    async def hold_the_only_slot():
        with holder:
            async with pool.stream(engine.spec, "/v1/completions", b"{}", request_id="hold") as upstream:
                await upstream.__anext__()
                holding.set()
                await trio.sleep_forever()
    nursery.start_soon(hold_the_only_slot)
    await holding.wait()
    assert repr(pool) == "<DataPool [in use 1/1 | waiting 0 | opened 1 | idle 0]>"

    with trio.move_on_after(0.2) as deadline:
        with pytest.raises(PoolSaturated):
            await post(pool, engine)
    assert not deadline.cancelled_caught
    assert pool.statistics().waiting == 0
    holder.cancel()
    with trio.fail_after(1):
        while pool.statistics().in_use:
            await trio.sleep(0.01)
    assert pool.statistics().in_use == 0


# the relay loop: watchdog deadlines, reads that never block ------------------------

async def test_silence_deadline_fires_from_the_watchdog_on_time(serve, make_pool, autojump_clock):
    engine = await serve(sse(EVENTS[0], then=trio.sleep_forever))
    pool = await make_pool(msgspec.structs.replace(FAST, stream_silence_s=10.0, first_token_deadline_s=20.0,
                                                   request_timeout_s=60.0))
    items = []
    with pytest.raises(EngineFailure) as caught:
        async with pool.stream(engine.spec, "/v1/completions", b"{}", request_id="w1") as upstream:
            items.append(await upstream.read())
            silent_from = trio.current_time()
            items.append(await upstream.read())
    waited = trio.current_time() - silent_from
    assert items == [EVENTS[0]]
    assert caught.value.failure_class is FailureClass.STREAM and "silent for more than 10 s" in caught.value.message
    # No scope per read: the watchdog, asleep until the stream's deadline, ends it then.
    assert waited == pytest.approx(10.0, abs=1e-6)
    assert pool.statistics().in_use == 0


async def test_first_token_deadline_fires_from_the_watchdog_on_time(serve, make_pool, autojump_clock):
    engine = await serve(sse(then=trio.sleep_forever))
    pool = await make_pool(msgspec.structs.replace(FAST, stream_silence_s=30.0, first_token_deadline_s=4.0,
                                                   request_timeout_s=60.0))
    started = trio.current_time()
    with pytest.raises(EngineFailure) as caught:
        await collect(pool, engine)
    assert caught.value.failure_class is FailureClass.STREAM and "first token" in caught.value.message
    assert trio.current_time() - started == pytest.approx(4.0, abs=1e-6)


async def test_a_stream_deadline_is_raised_by_the_read_that_waits_not_by_a_cancelled_scope(
        serve, make_pool, autojump_clock):
    engine = await serve(sse(EVENTS[0], then=trio.sleep_forever))
    pool = await make_pool(msgspec.structs.replace(FAST, stream_silence_s=10.0, first_token_deadline_s=20.0,
                                                   request_timeout_s=60.0))
    async with pool.stream(engine.spec, "/v1/completions", b"{}", request_id="w3") as upstream:
        assert await upstream.read() == EVENTS[0]
        # A plain socket: the watchdog ends the engine read itself, so the failure comes out of the read,
        # and nothing around it was cancelled (a cancelled scope would raise Cancelled at the next checkpoint).
        with pytest.raises(EngineFailure) as caught:
            await upstream.read()
        await trio.sleep(1.0)
    assert (caught.value.failure_class, caught.value.cause) == (FailureClass.STREAM, "DeadlineExpired")
    assert "silent for more than 10 s" in caught.value.message
    assert pool.statistics().in_use == 0 and pool.statistics().idle_connections == 0


async def test_a_first_token_deadline_that_passes_while_the_relay_is_elsewhere_fails_its_next_read(
        serve, make_pool, autojump_clock):
    engine = await serve(sse(then=trio.sleep_forever))
    pool = await make_pool(msgspec.structs.replace(FAST, stream_silence_s=30.0, first_token_deadline_s=4.0,
                                                   request_timeout_s=60.0))
    async with pool.stream(engine.spec, "/v1/completions", b"{}", request_id="w4") as upstream:
        # Not waiting on the engine when the deadline passes (no wait to end): the failure waits for the read.
        await trio.sleep(10.0)
        assert upstream.expired == "no first token within 4 s"
        with pytest.raises(EngineFailure) as caught:
            await upstream.read()
    assert "no first token within 4 s" in caught.value.message
    assert pool.statistics().in_use == 0


async def test_the_watchdog_sleeps_while_no_stream_is_live_and_a_new_stream_is_watched(
        serve, make_pool, autojump_clock):
    engine = await serve(sse(then=trio.sleep_forever))
    pool = await make_pool(msgspec.structs.replace(FAST, stream_silence_s=30.0, first_token_deadline_s=4.0,
                                                   request_timeout_s=60.0))
    await trio.sleep(100.0)
    # No stream: the watchdog sleeps until a deadline is due instead of ticking.
    assert pool.alarm.at == math.inf and pool.alarm.wakeups == 0
    started = trio.current_time()
    with pytest.raises(EngineFailure) as caught:
        await collect(pool, engine)
    assert "no first token within 4 s" in caught.value.message
    assert trio.current_time() - started == pytest.approx(4.0, abs=1e-6)
    await trio.sleep(100.0)
    assert pool.alarm.at == math.inf  # asleep again once the stream ended
    # Woken by the engine read's deadline (the first of the call's), by the stream's, and at it.
    assert pool.alarm.wakeups <= 3


async def test_the_watchdog_wakes_at_deadlines_not_on_a_tick_while_a_stream_runs(serve, make_pool, autojump_clock):
    async def one_a_second(request, stream, index):
        await stream.send_all(SSE_HEAD)
        for _ in range(60):
            await trio.sleep(1.0)
            await stream.send_all(chunk(EVENTS[0]))
        await stream.send_all(chunk(EVENTS[2]) + LAST_CHUNK)
        return True
    engine = await serve(one_a_second)
    pool = await make_pool(msgspec.structs.replace(FAST, stream_silence_s=10.0, first_token_deadline_s=20.0,
                                                   request_timeout_s=60.0))
    items, terminal = await collect(pool, engine)
    assert terminal and b"".join(items).count(EVENTS[0]) == 60
    # 60 s of a live stream: a look when each deadline could first be due (about every 10 s),
    # where a tick of a twentieth of the smallest deadline woke it 120 times.
    assert pool.alarm.wakeups <= 9

async def test_a_read_timeout_is_kept_by_the_watchdog_not_a_scope(serve, make_pool, autojump_clock):
    async def respond(request, stream, index):
        await trio.sleep_forever()
    engine = await serve(respond)
    pool = await make_pool(msgspec.structs.replace(FAST, stream_silence_s=2.0, first_token_deadline_s=2.0,
                                                   request_timeout_s=10.05))
    await trio.sleep(5.0)
    # Idle: the watchdog sleeps until something is due instead of ticking.
    assert pool.alarm.at == math.inf
    started = trio.current_time()
    waiting: list[bool] = []

    async def watch_the_set() -> None:
        await trio.sleep(1.0)
        waiting.append(pool._readiness.timed_waits)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_the_set)
        with pytest.raises(EngineFailure) as caught:
            await post(pool, engine)
    elapsed = trio.current_time() - started
    assert (caught.value.failure_class, caught.value.cause) == (FailureClass.TIMEOUT, "ReadTimeout")
    assert "no response bytes within 10.05 s" in caught.value.message
    # The readiness set held the wait (no scope of its own), and the watchdog, asleep until its
    # deadline, failed it then: never early, never late.
    assert waiting == [True]
    assert elapsed == pytest.approx(10.05, abs=1e-6)
    assert pool.statistics().in_use == 0
    await trio.sleep(1.0)
    assert pool.alarm.at == math.inf  # asleep again


async def test_a_reload_gives_the_next_stream_its_first_token_deadline(serve, make_pool, nursery, autojump_clock):
    engine = await serve(sse(then=trio.sleep_forever))
    pool = await make_pool(msgspec.structs.replace(FAST, stream_silence_s=30.0, first_token_deadline_s=20.0,
                                                   request_timeout_s=60.0))
    first_failed: list[float] = []

    async def first_stream() -> None:
        with pytest.raises(EngineFailure, match="no first token within 20 s"):
            await collect(pool, engine)
        first_failed.append(trio.current_time())
    started = trio.current_time()
    nursery.start_soon(first_stream)
    await trio.sleep(1.0)
    # The watchdog sleeps until the first stream's deadline, 19 s from now.
    assert pool.alarm.at == pytest.approx(started + 20.0)
    pool.set_timeouts(msgspec.structs.replace(FAST, stream_silence_s=30.0, first_token_deadline_s=4.0,
                                              request_timeout_s=60.0, max_response_bytes=1024))
    assert pool._max_body == FAST.max_response_bytes  # a bound is not a timeout: kept as built
    with pytest.raises(EngineFailure) as caught:
        await collect(pool, engine)
    assert "no first token within 4 s" in caught.value.message
    # The new stream's deadline, before the one the watchdog slept to, woke it to watch the new one.
    assert trio.current_time() - started == pytest.approx(5.0, abs=1e-6)
    await trio.sleep(20.0)
    assert first_failed == [pytest.approx(started + 20.0, abs=1e-6)]


async def test_a_slow_client_holding_up_the_relay_is_not_engine_silence(serve, make_pool, autojump_clock):
    async def pause():
        await trio.sleep(0.5)
    engine = await serve(sse(EVENTS[0], then=pause, end=chunk(EVENTS[1]) + chunk(EVENTS[2]) + LAST_CHUNK))
    pool = await make_pool(msgspec.structs.replace(FAST, stream_silence_s=1.0, first_token_deadline_s=1.0,
                                                   request_timeout_s=60.0))
    items = []
    async with pool.stream(engine.spec, "/v1/completions", b"{}", request_id="w2") as upstream:
        items.append(await upstream.read())
        # The relay is busy elsewhere (a client that reads slowly) for 10 silence periods: the engine
        # answered meanwhile, so nothing may fail.
        await trio.sleep(10.0)
        while item := await upstream.read():
            items.append(item)
    assert b"".join(items) == b"".join(EVENTS) and upstream.saw_terminal


async def test_a_relay_whose_reads_never_block_still_lets_other_tasks_run(serve, make_pool, monkeypatch):
    from narwhal.http1 import client as client_module

    # Reads of a full buffer never wait for readability; make a full buffer small and endless for one socket.
    size = 256
    monkeypatch.setattr(client_module, "_READ_SIZE", size)
    payload = b"data: " + b"x" * (size - 6 - 6 - 2) + b"\n\n"  # chunk framing "fa\r\n...\r\n" is 6 bytes
    flood = chunk(payload)
    assert len(flood) == size
    flooded: set[int] = set()
    real_read = client_module._read

    def read(fd: int, n: int) -> bytes:
        return flood if fd in flooded else real_read(fd, n)
    monkeypatch.setattr(client_module, "_read", read)

    flooding = trio.Event()
    other_done = trio.Event()
    engine = await serve(sse(EVENTS[0], then=trio.sleep_forever))
    other_engine = await serve(sse(*EVENTS))
    pool = await make_pool(msgspec.structs.replace(FAST, stream_silence_s=30.0, first_token_deadline_s=30.0))
    reads = 0
    limit = 3000

    async def flooded_relay() -> None:
        nonlocal reads
        async with pool.stream(engine.spec, "/v1/completions", b"{}", request_id="flood") as upstream:
            assert await upstream.read() == EVENTS[0]
            flooded.add(upstream._conn._fd)
            upstream._conn._drained = False  # as if that first read had filled the buffer
            flooding.set()
            # Bounded: without its periodic checkpoint this loop would starve the other stream to the limit.
            while not other_done.is_set() and reads < limit:
                assert await upstream.read() == payload
                reads += 1

    async def other_stream() -> None:
        await flooding.wait()
        items, saw_terminal = await collect(pool, other_engine)
        assert saw_terminal and b"".join(items) == b"".join(EVENTS)
        other_done.set()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(flooded_relay)
            nursery.start_soon(other_stream)
    assert other_done.is_set() and 0 < reads < limit


async def test_an_idle_connection_the_engine_closed_is_not_reused(serve, make_pool):
    closed = trio.Event()

    async def respond(request, stream, index):
        await stream.send_all(response(200, b"{}"))
        if index == 0:
            await stream.aclose()
            closed.set()
            return False
        return True
    engine = await serve(respond)
    pool = await make_pool()
    await post(pool, engine)
    await closed.wait()
    conn = pool._connections._idle[("127.0.0.1", engine.port)][0]
    # The readiness set saw the close: the next request opens a fresh connection instead of failing
    # on this one (no poll(2) needed even though it was idle for under a second).
    with trio.fail_after(5):
        while not conn.closed_by_engine:
            await trio.sleep(0.001)
    assert await post(pool, engine) == (200, b"{}")
    assert engine.connections == 2 and len(engine.requests) == 2
