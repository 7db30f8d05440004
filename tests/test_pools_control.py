"""The control pool: httpx.MockTransport fakes for statuses and errors, and one
real-socket check that health calls get through while the data pool is full."""

from __future__ import annotations

import functools

import httpx
import msgspec
import pytest
import trio
import trio.testing

from narwhal.config import EngineConfig, EngineSpec
from narwhal.errors import EngineFailure, FailureClass, PoolSaturated
from narwhal.pools.control import ControlPool, ControlResponse
from narwhal.pools.data import DataPool

ENGINE = EngineSpec(name="e1", url="http://127.0.0.1:9", role="prefill")
CONFIG = EngineConfig(health_timeout_s=2.0, connect_timeout_s=1.0)


@pytest.fixture
async def make_pool():
    pools: list[ControlPool] = []

    def make(handler, **kwargs) -> ControlPool:
        pool = ControlPool(control_connections=kwargs.pop("control_connections", 4),
                           engine_config=kwargs.pop("engine_config", CONFIG),
                           transport=httpx.MockTransport(handler))
        pools.append(pool)
        return pool
    yield make
    for pool in pools:
        await pool.aclose()


@pytest.mark.parametrize("status", [200, 404, 503])
async def test_get_returns_any_status_with_its_body(make_pool, status):
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(status, content=b'{"status": "x"}')
    pool = make_pool(handler)
    assert await pool.get(ENGINE, "/health") == ControlResponse(status=status, body=b'{"status": "x"}')
    assert (seen[0].method, str(seen[0].url)) == ("GET", "http://127.0.0.1:9/health")


async def test_post_json_sends_the_body_as_json(make_pool):
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=b'{"signature": "s"}')
    pool = make_pool(handler)
    response = await pool.post_json(ENGINE, "/narwhal/attest", b'{"nonce": "n"}', timeout_s=7.0)
    assert response == ControlResponse(status=200, body=b'{"signature": "s"}')
    request = seen[0]
    assert (request.method, request.url.path, request.content) == ("POST", "/narwhal/attest", b'{"nonce": "n"}')
    assert request.headers["content-type"] == "application/json"
    assert request.extensions["timeout"]["read"] == 7.0


async def test_default_timeout_is_the_health_timeout(make_pool):
    timeouts = []

    def handler(request: httpx.Request) -> httpx.Response:
        timeouts.append(request.extensions["timeout"])
        return httpx.Response(200)
    pool = make_pool(handler)
    await pool.get(ENGINE, "/health")
    assert timeouts[0]["read"] == 2.0
    assert timeouts[0]["connect"] == 1.0


@pytest.mark.parametrize(("error", "failure_class"), [
    (httpx.ConnectError("connection refused"), FailureClass.CONNECTION),
    (httpx.ReadTimeout("timed out"), FailureClass.TIMEOUT),
    (httpx.ConnectTimeout("timed out"), FailureClass.TIMEOUT),
    (httpx.RemoteProtocolError("Server disconnected without sending a response."), FailureClass.CONNECTION),
])
async def test_transport_errors_become_engine_failures(make_pool, error, failure_class):
    def handler(request: httpx.Request) -> httpx.Response:
        raise error
    pool = make_pool(handler)
    with pytest.raises(EngineFailure) as caught:
        await pool.get(ENGINE, "/health")
    failure = caught.value
    assert (failure.engine, failure.failure_class, failure.cause) == ("e1", failure_class, type(error).__name__)
    assert pool.statistics().in_use == 0


async def test_whole_call_is_bounded_by_its_timeout(make_pool, autojump_clock):
    async def handler(request: httpx.Request) -> httpx.Response:
        await trio.sleep(10)
        return httpx.Response(200)
    pool = make_pool(handler)
    with pytest.raises(EngineFailure) as caught:
        await pool.get(ENGINE, "/health", timeout_s=0.5)
    assert caught.value.failure_class is FailureClass.TIMEOUT
    assert trio.current_time() == 0.5


class _StallingBody(httpx.AsyncByteStream):
    """One SSE event, then silence (``stall``) or a read error (``cut``)."""

    def __init__(self, how: str) -> None:
        self.how = how

    async def __aiter__(self):
        yield b'data: {"choices": []}\n\n'
        if self.how == "stall":
            await trio.sleep(10)
        raise httpx.ReadError("connection reset mid-body")


@pytest.mark.parametrize("how", ["stall", "cut"])
async def test_a_body_that_stalls_or_is_cut_after_the_status_line_is_stream(make_pool, autojump_clock, how):
    # As on the data path: once the response began, silence or a cut is the stream's, not a timeout.
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, stream=_StallingBody(how))
    pool = make_pool(handler)
    with pytest.raises(EngineFailure) as caught:
        await pool.post_json(ENGINE, "/v1/completions", b"{}", timeout_s=0.5)
    assert caught.value.failure_class is FailureClass.STREAM
    assert pool.statistics().in_use == 0


async def test_slot_wait_past_the_deadline_is_saturation_and_statistics_show_it(make_pool, autojump_clock,
                                                                                 nursery):
    release = trio.Event()

    async def handler(request: httpx.Request) -> httpx.Response:
        await release.wait()
        return httpx.Response(200)
    pool = make_pool(handler, control_connections=1,
                     engine_config=msgspec.structs.replace(CONFIG, health_timeout_s=100.0))
    nursery.start_soon(pool.get, ENGINE, "/health")
    await trio.sleep(1)
    assert repr(pool) == "<ControlPool [in use 1/1 | waiting 0]>"
    with trio.move_on_after(3) as caller:
        with pytest.raises(PoolSaturated):
            await pool.get(ENGINE, "/health")
    assert not caller.cancelled_caught
    release.set()
    await trio.sleep(1)
    stats = pool.statistics()
    assert (stats.control_connections, stats.in_use, stats.waiting) == (1, 0, 0)


# real sockets: the control pool does not share the data pool's bound ---------------

async def _engine(stream: trio.SocketStream, *, streams_started: list[int]) -> None:
    """GET /health answers 200; POST /v1/completions starts a stream that never ends."""
    buf = b""
    try:
        while b"\r\n\r\n" not in buf:
            data = await stream.receive_some(65536)
            if not data:
                return
            buf += data
        if buf.startswith(b"GET /health "):
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
            return
        streams_started.append(1)
        event = b'data: {"t": 1}\n\n'
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                              b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(event), event))
        await trio.sleep_forever()
    except trio.BrokenResourceError:
        return
    finally:
        await trio.aclose_forcefully(stream)


async def test_control_calls_go_through_while_the_data_pool_is_full(nursery):
    streams_started: list[int] = []
    listeners = await nursery.start(functools.partial(
        trio.serve_tcp, functools.partial(_engine, streams_started=streams_started), 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    engine = EngineSpec(name="e1", url=f"http://127.0.0.1:{port}", role="decode")
    config = EngineConfig(stream_silence_s=30.0, health_timeout_s=1.0)
    data_pool = DataPool(max_connections=2, engine_config=config)
    await nursery.start(data_pool.run)
    control_pool = ControlPool(control_connections=1, engine_config=config)
    held = trio.Semaphore(0)

    async def hold_a_data_slot() -> None:
        async with data_pool.stream(engine, "/v1/completions", b"{}", request_id="hold") as upstream:
            await upstream.__anext__()
            held.release()
            await trio.sleep_forever()
    try:
        async with trio.open_nursery() as holders:
            for _ in range(2):
                holders.start_soon(hold_a_data_slot)
            with trio.fail_after(2):
                for _ in range(2):
                    await held.acquire()
            assert data_pool.statistics().in_use == 2
            with trio.move_on_after(0.2), pytest.raises(PoolSaturated):
                await data_pool.post_json(engine, "/tokenize", b"{}", request_id="r")

            with trio.fail_after(2):
                response = await control_pool.get(engine, "/health")
            assert response == ControlResponse(status=200, body=b"ok")
            assert len(streams_started) == 2
            holders.cancel_scope.cancel()
        assert data_pool.statistics().in_use == 0
    finally:
        await control_pool.aclose()
        await data_pool.aclose()


# real sockets: kept-alive connections, and never more sockets than control_connections ---------

async def _request_head(stream: trio.SocketStream) -> bytes | None:
    """The next request's head (a GET: no body follows), or None once the router hung up."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = await stream.receive_some(65536)
        if not data:
            return None
        buf += data
    return buf


async def _keep_alive_engine(stream: trio.SocketStream, *, accepted: list[int], closed: list[int]) -> None:
    """Answers every GET with 200 on the same connection; records when the router hangs up."""
    accepted.append(1)
    try:
        while (head := await _request_head(stream)) is not None:
            assert head.startswith(b"GET /health HTTP/1.1\r\n")
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
    except trio.BrokenResourceError:
        return
    finally:
        closed.append(1)
        await trio.aclose_forcefully(stream)


async def _keep_alive_engines(nursery, count: int) -> tuple[list[EngineSpec], list[int], list[int]]:
    accepted: list[int] = []
    closed: list[int] = []
    engines = []
    for i in range(count):
        listeners = await nursery.start(functools.partial(
            trio.serve_tcp, functools.partial(_keep_alive_engine, accepted=accepted, closed=closed), 0,
            host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        engines.append(EngineSpec(name=f"e{i}", url=f"http://127.0.0.1:{port}", role="prefill"))
    return engines, accepted, closed


async def test_health_checks_reuse_one_kept_alive_connection_per_engine(nursery):
    engines, accepted, closed = await _keep_alive_engines(nursery, 3)
    pool = ControlPool(control_connections=4, engine_config=EngineConfig(health_timeout_s=2.0))
    try:
        with trio.fail_after(5):
            for _ in range(5):
                for engine in engines:
                    assert await pool.get(engine, "/health") == ControlResponse(status=200, body=b"ok")
        assert len(accepted) == 3 and not closed
        assert pool.idle_connections == 3
    finally:
        await pool.aclose()
    assert pool.idle_connections == 0


async def test_one_idle_connection_per_engine_is_kept_between_calls(nursery):
    engines, accepted, closed = await _keep_alive_engines(nursery, 5)
    pool = ControlPool(control_connections=2, engine_config=EngineConfig(health_timeout_s=2.0))
    try:
        with trio.fail_after(5):
            # More engines than slots: every engine still keeps its connection for the next sweep.
            for _ in range(3):
                async with trio.open_nursery() as sweep:
                    for engine in engines:
                        sweep.start_soon(pool.get, engine, "/health")
            assert len(accepted) == 5 and not closed and pool.idle_connections == 5
            # Two calls at once to one engine need two sockets; only one stays idle afterwards.
            async with trio.open_nursery() as both:
                for _ in range(2):
                    both.start_soon(pool.get, engines[0], "/health")
            await trio.testing.wait_all_tasks_blocked()
        assert len(accepted) == 6 and len(closed) == 1 and pool.idle_connections == 5
    finally:
        await pool.aclose()


# real sockets, bounded by the whole call's deadline: ours, or the caller's when it comes first -----------------

async def _slow_engine(stream: trio.SocketStream, *, how: str, accepted: list[int]) -> None:
    """``hang``: reads the request, never answers; ``drip``: a head, then one body byte every 0.1 s forever;
    ``ok``: answers 200 on the same connection."""
    accepted.append(1)
    try:
        while await _request_head(stream) is not None:
            if how == "hang":
                await trio.sleep_forever()
            if how == "drip":
                await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n")
                while True:
                    await trio.sleep(0.1)
                    await stream.send_all(b"x")
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
    except trio.BrokenResourceError:
        return
    finally:
        await trio.aclose_forcefully(stream)


async def _slow_engine_at(nursery, how: list[str], accepted: list[int]) -> EngineSpec:
    async def serve(stream: trio.SocketStream) -> None:
        await _slow_engine(stream, how=how[0], accepted=accepted)
    listeners = await nursery.start(functools.partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
    return EngineSpec(name="e1", url=f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}", role="prefill")


@pytest.mark.parametrize(("how", "failure_class"), [("hang", FailureClass.TIMEOUT), ("drip", FailureClass.STREAM)])
async def test_a_kept_alive_call_is_bounded_as_a_whole_by_its_timeout(nursery, autojump_clock, how, failure_class):
    # Each read comes in time (drip), or none does (hang): the bound is the whole call's, not a read's.
    accepted: list[int] = []
    engine = await _slow_engine_at(nursery, [how], accepted)
    pool = ControlPool(control_connections=2, engine_config=EngineConfig(health_timeout_s=2.0))
    try:
        started = trio.current_time()
        with trio.fail_after(10), pytest.raises(EngineFailure) as caught:
            await pool.get(engine, "/health", timeout_s=0.5)
        assert caught.value.failure_class is failure_class
        assert trio.current_time() - started == pytest.approx(0.5)
        assert pool.idle_connections == 0 and pool.statistics().in_use == 0
    finally:
        await pool.aclose()


@pytest.mark.parametrize("how", ["hang", "drip"])
async def test_a_call_under_a_nearer_caller_deadline_ends_there_and_drops_its_connection(nursery, autojump_clock,
                                                                                        how):
    # A health sweep's deadline comes before the call's own timeout: the sweep's scope ends the call (and reports
    # it), the half-read connection is closed, and the next call opens a fresh one.
    state = [how]
    accepted: list[int] = []
    engine = await _slow_engine_at(nursery, state, accepted)
    pool = ControlPool(control_connections=2, engine_config=EngineConfig(health_timeout_s=2.0))
    try:
        started = trio.current_time()
        with trio.move_on_after(1.0) as caller:
            await pool.get(engine, "/health", timeout_s=5.0, caller_deadline=caller.deadline)
        assert caller.cancelled_caught and trio.current_time() - started == pytest.approx(1.0)
        assert pool.idle_connections == 0 and pool.statistics().in_use == 0
        state[0] = "ok"
        assert await pool.get(engine, "/health", timeout_s=5.0) == ControlResponse(status=200, body=b"ok")
        assert len(accepted) == 2 and pool.idle_connections == 1
    finally:
        await pool.aclose()


async def _recording_engine(stream: trio.SocketStream, *, heads: list[bytes]) -> None:
    """Answers every GET with 200 on the same connection, keeping each request head."""
    try:
        while (head := await _request_head(stream)) is not None:
            heads.append(head)
            await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
    except trio.BrokenResourceError:
        return
    finally:
        await trio.aclose_forcefully(stream)


async def test_a_get_built_once_per_engine_and_path_names_each_and_the_kept_ones_are_bounded(nursery, monkeypatch):
    import narwhal.pools.control as control

    monkeypatch.setattr(control, "_MAX_KEPT_REQUESTS", 2)
    heads: list[bytes] = []
    engines = []
    for i in range(2):
        listeners = await nursery.start(functools.partial(
            trio.serve_tcp, functools.partial(_recording_engine, heads=heads), 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        engines.append(EngineSpec(name=f"e{i}", url=f"http://127.0.0.1:{port}", role="prefill"))
    pool = ControlPool(control_connections=2, engine_config=EngineConfig(health_timeout_s=2.0), via="narwhal-r1")
    try:
        with trio.fail_after(5):
            calls = [(engines[0], "/health"), (engines[1], "/health"), (engines[0], "/v1/models")] * 2
            for engine, path in calls:
                assert (await pool.get(engine, path)).status == 200
        for (engine, path), head in zip(calls, heads, strict=True):
            port = engine.url.rsplit(":", 1)[1]
            assert head == (f"GET {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\naccept-encoding: identity\r\n"
                            f"via: narwhal-r1\r\n\r\n").encode()
        assert len(pool._get_requests) <= 2  # three targets, at most two kept
        # An unsafe path is refused at every call, never kept.
        for _ in range(2):
            with pytest.raises(ValueError, match="unsafe request path"):
                await pool.get(engines[0], "/a b")
    finally:
        await pool.aclose()
