"""Hostile clients against the data-plane front (issue 13, items 5-9).

Smuggling through ``Upgrade``, slow heads and bodies, the connection cap,
clients that never read, deeply nested JSON and the small HTTP rules. Timeouts
run on trio's MockClock over lockstep memory streams (a client that does not
read really blocks the server's write there); the rest use real sockets on
127.0.0.1 and, where the rule is about the router, the real Router's front with
an unreachable fleet.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
from collections.abc import AsyncIterator
from typing import Any

import httptools
import pytest
import trio
import trio.testing
from test_request_core import CONFIG as CORE_CONFIG
from test_request_core import FakePool, FakeSupervisor, Sink

from narwhal.config import parse_config
from narwhal.errors import ClientGone
from narwhal.fleet.admission import Admission
from narwhal.fleet.placement import InFlight
from narwhal.http1.asgi import ASGILifespan
from narwhal.http1.server import OVERFLOW_CONNECTIONS, ClientDisconnected, HTTPServer, Request, Responder
from narwhal.obs.router_metrics import RouterMetrics
from narwhal.router import Router
from narwhal.serving.request_core import RequestCore

JSON = [(b"content-type", b"application/json")]

# Port 9 (discard) on 127.0.0.1: nothing listens, connects are refused at once.
ROUTER_CONFIG = """
[serving]
max_client_connections = {cap}
[[engines]]
name = "p1"
url = "http://127.0.0.1:9"
role = "prefill"
[[engines]]
name = "gpu a"
url = "http://127.0.0.1:9"
role = "decode"
"""


class Response:
    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.body = b""
        self.complete = False

    def json(self) -> Any:
        return json.loads(self.body)


class _ResponseParser:
    def __init__(self) -> None:
        self.responses: list[Response] = []
        self.parser = httptools.HttpResponseParser(self)

    def on_message_begin(self) -> None:
        self.responses.append(Response())

    def on_header(self, name: bytes, value: bytes) -> None:
        self.responses[-1].headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        self.responses[-1].status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.responses[-1].body += body

    def on_message_complete(self) -> None:
        self.responses[-1].complete = True


def parse_responses(raw: bytes) -> list[Response]:
    """Every response in ``raw``; a malformed byte stream fails the test."""
    parser = _ResponseParser()
    parser.parser.feed_data(raw)
    return parser.responses


async def read_to_eof(stream: trio.abc.ReceiveStream, limit_s: float = 5.0) -> bytes:
    raw = b""
    with trio.fail_after(limit_s):
        while True:
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                return raw
            if not data:
                return raw
            raw += data


@contextlib.asynccontextmanager
async def running(handler: Any, **options: Any) -> AsyncIterator[tuple[HTTPServer, int]]:
    server = HTTPServer(handler, **options)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        yield server, port
        server.shutdown(0)


@contextlib.asynccontextmanager
async def router_front(cap: int = 1000) -> AsyncIterator[tuple[Router, int]]:
    """The real Router's front (handler, core, quart app) on 127.0.0.1, its fleet unreachable."""
    router = Router(parse_config(ROUTER_CONFIG.format(cap=cap)))
    async with ASGILifespan(router.app), trio.open_nursery() as nursery:
        port = await nursery.start(router.data_plane.server.serve, "127.0.0.1", 0)
        yield router, port
        router.data_plane.server.shutdown(0)


async def exchange(port: int, data: bytes, *, half_close: bool = True) -> bytes:
    """Send ``data`` on a fresh connection, optionally half-close, read until the server closes."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(data)
        if half_close:
            await stream.send_eof()
        return await read_to_eof(stream)


async def echo(request: Request, responder: Responder) -> None:
    await responder.respond(200, JSON, json.dumps({"path": request.path, "body": request.body.decode()}).encode())


def request_events(caplog: pytest.LogCaptureFixture, event: str = "request") -> list[dict[str, Any]]:
    events = [json.loads(r.getMessage()) for r in caplog.records if r.name == "narwhal.events"]
    return [e for e in events if e["event"] == event]


# ---- item 5: no smuggling through Upgrade or CONNECT ----


async def test_upgrade_is_refused_and_a_smuggled_admin_drain_never_runs() -> None:
    smuggled = b"POST /admin/engines/p1/drain HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n"
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(smuggled))
    async with router_front() as (router, port):
        raw = await exchange(port, head + smuggled, half_close=False)
        drained = router.readmitter.drained("p1")
    (response,) = parse_responses(raw)  # one answer, then close: the body was never a request
    assert response.status == 400
    assert response.json()["error"]["code"] == "upgrade_not_supported"
    assert response.headers[b"connection"] == b"close"
    assert drained is False


@pytest.mark.parametrize("request_line", [b"CONNECT 127.0.0.1:8000 HTTP/1.1", b"GET / HTTP/1.1"])
async def test_connect_and_bare_upgrade_headers_are_400(request_line: bytes) -> None:
    extra = b"" if request_line.startswith(b"CONNECT") else b"upgrade: h2c\r\n"
    seen: list[str] = []

    async def handler(request: Request, responder: Responder) -> None:
        seen.append(request.path)
        await echo(request, responder)

    async with running(handler) as (_server, port):
        raw = await exchange(port, request_line + b"\r\nhost: x\r\n" + extra + b"\r\nGET /after HTTP/1.1\r\n\r\n")
    (response,) = parse_responses(raw)
    assert response.status == 400 and response.json()["error"]["type"] == "invalid_request_error"
    assert seen == []


# ---- item 6: slow heads, slow bodies, the connection cap ----


@contextlib.asynccontextmanager
async def memory_front(handler: Any, **options: Any) -> AsyncIterator[tuple[HTTPServer, trio.abc.Stream]]:
    """An HTTPServer serving one lockstep memory stream: a client's write waits for the server's read."""
    server = HTTPServer(handler, **options)
    client, server_side = trio.testing.lockstep_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.run_watchdog)
        nursery.start_soon(server.serve_stream, server_side)
        yield server, client
        nursery.cancel_scope.cancel()


async def test_a_head_trickled_one_byte_a_second_is_cut_at_header_timeout(autojump_clock: Any) -> None:
    head = b"GET /slow HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * 100 + b"\r\n\r\n"
    async with memory_front(echo, header_timeout_s=10.0, idle_timeout_s=60.0) as (_server, client):
        async def trickle() -> None:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                for byte in head:
                    await client.send_all(bytes([byte]))
                    await trio.sleep(1.0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trickle)
            raw = await read_to_eof(client, limit_s=60)
            cut_at = trio.current_time()
            nursery.cancel_scope.cancel()
    (response,) = parse_responses(raw)
    assert response.status == 408
    assert response.json()["error"]["code"] == "header_timeout"
    # Not reset per byte: the head's clock started at the accept, 10 s before.
    assert cut_at == pytest.approx(10.0)


async def test_a_connection_that_sends_nothing_is_closed_at_header_timeout(autojump_clock: Any) -> None:
    async with memory_front(echo, header_timeout_s=10.0, idle_timeout_s=60.0) as (_server, client):
        raw = await read_to_eof(client, limit_s=60)
        assert trio.current_time() == pytest.approx(10.0)
    assert raw == b""


async def test_later_heads_are_timed_from_their_first_byte(autojump_clock: Any) -> None:
    async with memory_front(echo, header_timeout_s=10.0, idle_timeout_s=60.0) as (_server, client):
        await client.send_all(b"GET /1 HTTP/1.1\r\nhost: x\r\n\r\n")
        first = await client.receive_some(65536)
        assert parse_responses(first)[0].status == 200
        await trio.sleep(30.0)  # idle, within idle_timeout_s
        await client.send_all(b"GET /2 HTTP/1.1\r\n")
        sent_at = trio.current_time()
        raw = await read_to_eof(client, limit_s=60)
    (response,) = parse_responses(raw)
    assert response.status == 408
    assert trio.current_time() - sent_at == pytest.approx(10.0)


async def test_a_body_trickled_slowly_is_cut_at_body_timeout(autojump_clock: Any) -> None:
    handled: list[str] = []

    async def handler(request: Request, responder: Responder) -> None:
        handled.append(request.path)
        await echo(request, responder)

    async with memory_front(handler, body_timeout_s=30.0, idle_timeout_s=600.0) as (_server, client):
        await client.send_all(b"POST /upload HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n")
        head_at = trio.current_time()

        async def trickle() -> None:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                for _ in range(1000):
                    await client.send_all(b"x")
                    await trio.sleep(1.0)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trickle)
            raw = await read_to_eof(client, limit_s=600)
            nursery.cancel_scope.cancel()
    (response,) = parse_responses(raw)
    assert response.status == 408
    assert response.json()["error"]["code"] == "body_timeout"
    assert trio.current_time() - head_at == pytest.approx(30.0, abs=1.0)
    assert handled == []


async def test_past_the_cap_new_connections_get_503_but_health_is_answered() -> None:
    release = trio.Event()

    async def handler(request: Request, responder: Responder) -> None:
        if request.path == "/hold":
            await release.wait()
        await echo(request, responder)

    async with running(handler, max_client_connections=2) as (server, port):
        held = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(2)]
        for stream in held:
            await stream.send_all(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n")
        with trio.fail_after(5):
            while server.statistics().requests_in_flight < 2:
                await trio.sleep(0.01)
        refused = parse_responses(await exchange(port, b"GET /other HTTP/1.1\r\nhost: x\r\n\r\n"))
        health = parse_responses(await exchange(port, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"))
        refused_count = server.statistics().connections_refused
        release.set()
        for stream in held:
            await stream.aclose()
    assert [r.status for r in refused] == [503]
    assert refused[0].json()["error"]["code"] == "too_many_connections"
    assert refused[0].headers[b"connection"] == b"close"
    assert [r.status for r in health] == [200]
    assert health[0].json()["path"] == "/health"
    assert refused_count == 2


async def test_past_the_cap_and_its_overflow_connections_get_503_without_being_read() -> None:
    async def never_answers(request: Request, responder: Responder) -> None:
        await trio.sleep_forever()

    async with running(never_answers, max_client_connections=1) as (server, port):
        # One counted connection and every overflow slot, each holding an unfinished head.
        held = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(1 + OVERFLOW_CONNECTIONS)]
        for stream in held:
            await stream.send_all(b"GET /health HTTP/1.1\r\n")
        with trio.fail_after(5):
            while server.statistics().connections_open < 1 + OVERFLOW_CONNECTIONS:
                await trio.sleep(0.01)
        raw = await exchange(port, b"", half_close=False)
        for stream in held:
            await stream.aclose()
    (response,) = parse_responses(raw)
    assert response.status == 503


def test_the_default_cap_is_sized_from_the_fd_limit() -> None:
    import resource

    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    config = parse_config(ROUTER_CONFIG.replace("max_client_connections = {cap}\n", ""))
    router = Router(config)
    cap = router.data_plane.server._max_client_connections
    pools = config.serving.max_connections + config.engine.control_connections + len(config.engines)
    assert cap is not None and 16 <= cap <= max(16, soft - pools - OVERFLOW_CONNECTIONS)


# ---- item 7: a client that never reads ----


async def test_a_client_that_never_reads_is_cut_at_the_write_timeout(autojump_clock: Any) -> None:
    outcome: list[str] = []

    async def streamer(request: Request, responder: Responder) -> None:
        try:
            # On a lockstep stream even the head's write waits for a read that never comes.
            await responder.start_stream(200, [], b"x" * 65536)
            while True:
                await responder.write(b"y" * 65536)
        except ClientGone as exc:
            outcome.append(exc.reason)
            raise

    async with memory_front(streamer, client_write_timeout_s=30.0) as (server, client):
        await client.send_all(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
        with trio.fail_after(100):
            while not outcome:
                await trio.sleep(0.5)
        stalled = server.statistics().clients_stalled
    assert outcome == ["client_stalled"]
    assert stalled == 1
    # The watchdog wakes at the pending write's deadline (30 s after the write began to wait, just after
    # the start); the loop above looks every 0.5 s.
    assert 30.0 <= trio.current_time() <= 31.0


class EndlessStream:
    """A decode stream that never ends: an event every 10 ms."""

    saw_terminal = False
    relay_watch = None
    data_events = 0

    async def read(self) -> bytes:
        await trio.sleep(0.01)
        self.data_events += 1
        return b'data: {"choices":[{"text":"' + b"t" * 4096 + b'"}]}\n\n'


class EndlessPool(FakePool):
    @contextlib.asynccontextmanager
    async def stream(self, engine: Any, path: str, body: bytes, *, request_id: str) -> Any:
        try:
            yield EndlessStream()
        finally:
            self.closed_streams += 1


def make_core(pool: FakePool) -> RequestCore:
    config = parse_config(CORE_CONFIG.format(count_tokens="false", policy="saturate").replace(
        "request_deadline_s = 5.0", "request_deadline_s = 300.0"))
    return RequestCore(config=config, supervisor=FakeSupervisor(), data_pool=pool,
                       in_flight=InFlight(e.name for e in config.engines),
                       admission=Admission(), metrics=RouterMetrics())


async def test_a_stalled_client_frees_the_engine_stream_and_is_logged_499_client_stalled(
        autojump_clock: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    pool = EndlessPool()
    core = make_core(pool)

    async def handler(request: Request, responder: Responder) -> None:
        await core.handle(request.path, request.body, None, responder)

    body = b'{"prompt": "hi", "stream": true, "max_tokens": 100000}'
    async with memory_front(handler, client_write_timeout_s=30.0) as (_server, client):
        await client.send_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s"
                              % (len(body), body))
        with trio.fail_after(100):
            while not request_events(caplog):
                await trio.sleep(0.5)
    (event,) = request_events(caplog)
    assert event["status"] == 499 and event["error"] == "client_stalled"
    assert pool.closed_streams == 1
    assert all(count == 0 for count in core.in_flight.counts.values())
    assert trio.current_time() < 35  # not the 300 s request deadline


async def test_end_stream_to_a_stalled_client_is_bounded(autojump_clock: Any) -> None:
    outcome: list[str] = []

    async def ender(request: Request, responder: Responder) -> None:
        try:
            await responder.start_stream(200, [])
            await responder.end_stream(b"z" * (1 << 20))
        except ClientGone as exc:
            outcome.append(exc.reason)

    async with memory_front(ender, client_write_timeout_s=5.0) as (_server, client):
        await client.send_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        head = await client.receive_some(65536)  # the head is read; the last chunk never is
        assert head.startswith(b"HTTP/1.1 200")
        with trio.fail_after(60):
            while not outcome:
                await trio.sleep(0.5)
    assert outcome == ["client_stalled"]


# ---- item 8: deeply nested JSON ----


@pytest.mark.parametrize("depth", [1_000, 100_000])
async def test_deeply_nested_json_is_400_and_logged_as_400(depth: int, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    core = make_core(FakePool())
    sink = Sink()
    body = b'{"prompt": "x", "junk": ' + b"[" * depth + b"]" * depth + b"}"
    await core.handle("/v1/completions", body, None, sink)
    assert sink.status == 400
    assert json.loads(sink.body)["error"]["type"] == "invalid_request_error"
    (event,) = request_events(caplog)
    assert event["status"] == 400


# ---- item 9: the small rules ----


async def test_asgi_path_is_percent_decoded_and_finds_an_engine_with_a_space() -> None:
    async with router_front() as (_router, port):
        raw = await exchange(port, b"GET /admin/engines/gpu%20a HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
    (response,) = parse_responses(raw)
    assert response.status == 200
    assert response.json()["engine"]["name"] == "gpu a"


async def test_asgi_raw_path_stays_raw() -> None:
    from narwhal.http1.asgi import call_asgi

    seen: dict[str, Any] = {}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.update(path=scope["path"], raw_path=scope["raw_path"])
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def handler(request: Request, responder: Responder) -> None:
        await call_asgi(app, request, responder)

    async with running(handler) as (_server, port):
        await exchange(port, b"GET /a%20b/%C3%A9?q=%20 HTTP/1.1\r\nhost: x\r\n\r\n")
    assert seen == {"path": "/a b/\u00e9", "raw_path": b"/a%20b/%C3%A9"}


def test_a_half_closed_client_still_gets_its_pipelined_responses() -> None:
    fin_sent = trio.Event()

    async def echo_after_the_fin(request: Request, responder: Responder) -> None:
        with trio.fail_after(5):
            await fin_sent.wait()  # the FIN arrives while the first request is being handled
        await echo(request, responder)

    async def main() -> bytes:
        async with running(echo_after_the_fin) as (_server, port):
            def client() -> bytes:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                    sock.sendall(b"".join(b"GET /%d HTTP/1.1\r\nhost: x\r\n\r\n" % i for i in range(3)))
                    sock.shutdown(socket.SHUT_WR)
                    trio.from_thread.run_sync(fin_sent.set)
                    raw = b""
                    while chunk := sock.recv(65536):
                        raw += chunk
                    return raw

            return await trio.to_thread.run_sync(client)

    raw = trio.run(main)
    assert [r.json()["path"] for r in parse_responses(raw)] == ["/0", "/1", "/2"]


@pytest.mark.parametrize("version", [b"HTTP/2.0", b"HTTP/3.0", b"HTTP/1.2"])
async def test_other_http_versions_get_505(version: bytes) -> None:
    async with running(echo) as (_server, port):
        raw = await exchange(port, b"GET / " + version + b"\r\nhost: x\r\n\r\n")
    (response,) = parse_responses(raw)
    assert response.status == 505
    assert response.json()["error"]["code"] == "http_version_not_supported"


async def test_expect_other_than_100_continue_gets_417() -> None:
    async with running(echo) as (_server, port):
        raw = await exchange(port, b"POST / HTTP/1.1\r\nhost: x\r\nexpect: 200-ok\r\ncontent-length: 2\r\n\r\nhi")
        ok = await exchange(port, b"POST / HTTP/1.1\r\nhost: x\r\nexpect: 100-Continue\r\ncontent-length: 2\r\n\r\nhi")
    (response,) = parse_responses(raw)
    assert response.status == 417
    assert response.json()["error"]["code"] == "expectation_failed"
    assert [r.status for r in parse_responses(ok) if r.status >= 200] == [200]


def test_after_an_early_413_the_upload_is_drained_so_the_client_reads_the_413() -> None:
    limit = 2 * 1024 * 1024
    # Past the 256 KiB a plain protocol error lingers for, and past what the kernel's
    # buffers absorb, but within the drain bound (4 x max_body_bytes).
    upload = 7 * 1024 * 1024

    async def main() -> bytes:
        async with running(echo, max_body_bytes=limit) as (_server, port):
            def client() -> bytes:
                with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                    sock.sendall(b"POST /up HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % upload)
                    sock.sendall(b"z" * upload)  # a client that sends it all before reading
                    raw = b""
                    while chunk := sock.recv(65536):
                        raw += chunk
                    return raw

            return await trio.to_thread.run_sync(client)

    raw = trio.run(main)
    (response,) = parse_responses(raw)
    assert response.status == 413


async def test_a_stream_the_client_cut_is_logged_499_not_200(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="narwhal.events")
    pool = EndlessPool()
    core = make_core(pool)

    async def handler(request: Request, responder: Responder) -> None:
        await core.handle(request.path, request.body, None, responder)

    body = b'{"prompt": "hi", "stream": true}'
    async with running(handler) as (_server, port):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s"
                              % (len(body), body))
        received = b""
        with trio.fail_after(5):
            while b"data: " not in received:
                received += await stream.receive_some(65536)
        await stream.aclose()
        with trio.fail_after(5):
            while not request_events(caplog):
                await trio.sleep(0.01)
    (event,) = request_events(caplog)
    assert event["status"] == 499 and event["error"] == "client_disconnected"
    assert pool.closed_streams == 1


async def test_a_write_to_a_gone_client_raises_client_disconnected_with_its_reason() -> None:
    # ClientDisconnected is the front's ClientGone: the core needs no import of the server.
    assert issubclass(ClientDisconnected, ClientGone)
    client_left = trio.Event()
    raised: list[BaseException] = []

    async def streamer(request: Request, responder: Responder) -> None:
        await responder.start_stream(200, [], b"first")
        await client_left.wait()
        try:
            for _ in range(3):  # the first write after the close may still land in a buffer
                await responder.write(b"more")
        except ClientGone as exc:
            raised.append(exc)
        await responder.end_stream() if not raised else None

    server = HTTPServer(streamer)
    client, server_side = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.serve_stream, server_side)
        await client.send_all(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
        with trio.fail_after(5):
            assert (await client.receive_some(65536)).startswith(b"HTTP/1.1 200")
        await client.aclose()
        client_left.set()
    [exc] = raised
    assert isinstance(exc, ClientDisconnected) and exc.reason == "client_disconnected"
    assert server.statistics().connections_open == 0


@pytest.mark.parametrize("tls", [False, True])
async def test_the_write_timeout_holds_on_real_sockets_and_over_tls(tls: bool) -> None:
    """The fast path (a non-blocking write first) and TLS streams are watched too."""
    import ssl

    import trustme

    outcome: list[str] = []

    async def streamer(request: Request, responder: Responder) -> None:
        try:
            await responder.start_stream(200, [], b"x" * 65536)
            while True:
                await responder.write(b"y" * 65536)
        except ClientGone as exc:
            outcome.append(exc.reason)
            raise

    server_context: ssl.SSLContext | None = None
    client_context = ssl.create_default_context()
    if tls:
        ca = trustme.CA()
        server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ca.issue_cert("127.0.0.1").configure_cert(server_context)
        ca.configure_trust(client_context)
    async with running(streamer, client_write_timeout_s=1.0, ssl_context=server_context) as (server, port):
        raw = await trio.open_tcp_stream("127.0.0.1", port)
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stream: trio.abc.Stream = raw
        if tls:
            stream = trio.SSLStream(raw, client_context, server_hostname="127.0.0.1")
        async with stream:
            await stream.send_all(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
            # Never read: the kernel's buffers fill, then the server's write has to wait.
            with trio.fail_after(10):
                while not outcome:
                    await trio.sleep(0.05)
        stalled = server.statistics().clients_stalled
    assert outcome == ["client_stalled"]
    assert stalled == 1
