"""The HTTP/1.1 front over real sockets on 127.0.0.1: framing, limits, keep-alive,
pipelining, disconnects, handler failures and graceful shutdown."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import struct
from collections.abc import AsyncIterator

import httptools
import httpx
import pytest
import trio

from narwhal.http1 import connection as connection_module
from narwhal.http1.server import ClientDisconnected, HTTPServer, Request, Responder, ServerStatistics

JSON = [(b"content-type", b"application/json")]


@contextlib.asynccontextmanager
async def running(handler, **options) -> AsyncIterator[tuple[HTTPServer, int]]:
    """An HTTPServer on 127.0.0.1 with an ephemeral port, shut down on exit."""
    server = HTTPServer(handler, **options)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        yield server, port
        server.shutdown(0)


class Response:
    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.body = b""
        self.complete = False


class RawClient:
    """A client on a raw trio stream that parses responses with httptools."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.raw = b""
        self.eof = False
        self.responses: list[Response] = []
        self._parser = httptools.HttpResponseParser(self)

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.responses.append(Response())

    def on_header(self, name: bytes, value: bytes) -> None:
        self.responses[-1].headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        self.responses[-1].status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.responses[-1].body += body

    def on_message_complete(self) -> None:
        self.responses[-1].complete = True

    async def send(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def _receive(self) -> None:
        data = await self.stream.receive_some(65536)
        if not data:
            self.eof = True
            return
        self.raw += data
        self._parser.feed_data(data)

    async def responses_complete(self, count: int) -> list[Response]:
        """Read until ``count`` complete responses (interim ones included) arrived."""
        with trio.fail_after(5):
            while sum(r.complete for r in self.responses) < count:
                await self._receive()
                assert not self.eof, f"EOF after {self.raw!r}"
        return self.responses[:count]

    async def read_to_eof(self, within_s: float = 5.0) -> bytes:
        with trio.fail_after(within_s):
            while not self.eof:
                try:
                    await self._receive()
                except httptools.HttpParserError:
                    pass  # a cut stream: the raw bytes tell the story
        return self.raw


@contextlib.asynccontextmanager
async def raw_client(port: int) -> AsyncIterator[RawClient]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        yield RawClient(stream)


async def echo(request: Request, responder: Responder) -> None:
    document = {
        "method": request.method.decode(),
        "target": request.target.decode(),
        "path": request.path,
        "query": request.query.decode(),
        "headers": [[k.decode(), v.decode()] for k, v in request.headers],
        "body": request.body.decode(),
        "version": request.http_version,
        "keep_alive": request.keep_alive,
        "client_port": request.client[1] if request.client else None,
        "host": (request.get_header(b"host") or b"").decode(),
    }
    await responder.respond(200, JSON, json.dumps(document).encode())


async def test_request_fields_and_response_framing() -> None:
    async with running(echo) as (_server, port), httpx.AsyncClient() as client:
        response = await client.post(
            f"http://127.0.0.1:{port}/v1/completions?x=1", content=b'{"a": 1}', headers={"X-Trace": "t1"}
        )
    assert response.status_code == 200
    assert response.headers["content-length"] == str(len(response.content))
    assert response.headers["server"] == "narwhal"
    assert "date" in response.headers
    seen = response.json()
    assert seen["method"] == "POST"
    assert seen["target"] == "/v1/completions?x=1"
    assert seen["path"] == "/v1/completions"
    assert seen["query"] == "x=1"
    assert seen["body"] == '{"a": 1}'
    assert seen["version"] == "1.1"
    assert seen["keep_alive"] is True
    assert seen["host"] == f"127.0.0.1:{port}"
    assert ["x-trace", "t1"] in seen["headers"]


async def test_a_memo_lives_as_long_as_its_connection() -> None:
    seen: list[object] = []

    async def remember(request: Request, responder: Responder) -> None:
        seen.append(request.memo)
        request.memo = (request.memo or 0) + 1  # type: ignore[operator]
        await responder.respond(200, [], b"")

    async with running(remember) as (_server, port):
        async with httpx.AsyncClient() as client:  # one kept-alive connection
            for _ in range(3):
                assert (await client.get(f"http://127.0.0.1:{port}/")).status_code == 200
        async with httpx.AsyncClient() as client:  # a new connection starts with none
            await client.get(f"http://127.0.0.1:{port}/")
    assert seen == [None, 1, 2, None]
    # A request that came with no connection keeps nothing.
    alone = Request(b"GET", b"/")
    alone.memo = 5
    assert alone.memo is None


async def test_chunked_request_body_is_dechunked() -> None:
    async with running(echo) as (_server, port), raw_client(port) as client:
        await client.send(
            b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
        )
        (response,) = await client.responses_complete(1)
    assert json.loads(response.body)["body"] == "hello world"


async def test_stream_is_chunked_with_one_socket_write_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    sends: list[bytes] = []

    def counting_write(fd: int, data: bytes) -> int:
        sends.append(bytes(data))
        return os.write(fd, data)

    async def stream(request: Request, responder: Responder) -> None:
        await responder.start_stream(200, [(b"content-type", b"text/event-stream")], b"data: 1\n\n")
        await responder.write(b"")  # a no-op
        await responder.write(b"data: 2\n\n")
        await responder.end_stream(b"data: [DONE]\n\n")

    async with running(stream) as (_server, port), raw_client(port) as client:
        monkeypatch.setattr(connection_module, "_write", counting_write)
        await client.send(b"POST /s HTTP/1.1\r\nHost: x\r\n\r\n")
        (response,) = await client.responses_complete(1)
        monkeypatch.undo()
    assert response.headers[b"transfer-encoding"] == b"chunked"
    assert response.body == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
    assert len(sends) == 3
    assert sends[0].endswith(b"\r\n\r\n9\r\ndata: 1\n\n\r\n")
    assert sends[1] == b"9\r\ndata: 2\n\n\r\n"
    assert sends[2] == b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"


async def test_whole_stream_in_one_write_with_end(monkeypatch: pytest.MonkeyPatch) -> None:
    sends: list[bytes] = []

    def counting_write(fd: int, data: bytes) -> int:
        sends.append(bytes(data))
        return os.write(fd, data)

    async def stream(request: Request, responder: Responder) -> None:
        await responder.start_stream(200, [], b"data: [DONE]\n\n", end=True)
        assert responder.finished

    async with running(stream) as (_server, port), raw_client(port) as client:
        monkeypatch.setattr(connection_module, "_write", counting_write)
        await client.send(b"POST /s HTTP/1.1\r\nHost: x\r\n\r\n")
        (response,) = await client.responses_complete(1)
        monkeypatch.undo()
    assert response.body == b"data: [DONE]\n\n"
    assert len(sends) == 1 and sends[0].endswith(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")


async def test_a_partial_non_blocking_write_finishes(monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel takes only part of a write (a full socket buffer): the rest must still go out, in order.
    calls: list[int] = []

    def short_write(fd: int, data: bytes) -> int:
        calls.append(len(data))
        if len(calls) == 2:
            raise BlockingIOError
        return os.write(fd, bytes(data[:7]))

    body = b"x" * 5000

    async def stream(request: Request, responder: Responder) -> None:
        await responder.start_stream(200, [], body[:2500])
        await responder.end_stream(body[2500:])

    async with running(stream) as (_server, port), raw_client(port) as client:
        monkeypatch.setattr(connection_module, "_write", short_write)
        await client.send(b"POST /s HTTP/1.1\r\nHost: x\r\n\r\n")
        with trio.fail_after(5):
            (response,) = await client.responses_complete(1)
        monkeypatch.undo()
    assert response.body == body
    # One write for each send (the first partial, the second refused); trio's send_all sent the rest.
    assert len(calls) == 2


async def test_http10_stream_is_unframed_and_closes() -> None:
    async def stream(request: Request, responder: Responder) -> None:
        await responder.start_stream(200, [], b"one ")
        await responder.write(b"two")
        await responder.end_stream()

    async with running(stream) as (_server, port), raw_client(port) as client:
        await client.send(b"GET / HTTP/1.0\r\n\r\n")
        raw = await client.read_to_eof()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head
    assert b"connection: close" in head
    assert body == b"one two"


async def test_head_request_gets_length_without_body() -> None:
    async def handler(request: Request, responder: Responder) -> None:
        await responder.respond(200, [], b"12345")

    async with running(handler) as (_server, port), raw_client(port) as client:
        await client.send(b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n")
        raw = b""
        with trio.fail_after(5):
            while not raw.endswith(b"12345"):  # raw bytes: a response parser cannot know it was HEAD
                raw += await client.stream.receive_some(65536)
    first, _, second = raw.partition(b"\r\n\r\n")
    assert b"content-length: 5" in first
    assert second.startswith(b"HTTP/1.1 200 OK")


# ---- limits and malformed requests ----


async def _expect_error_and_close(client: RawClient, status: int) -> dict:
    raw = await client.read_to_eof()
    assert client.responses and client.responses[0].status == status, raw
    response = client.responses[0]
    assert response.headers[b"connection"] == b"close"
    assert response.headers[b"content-type"] == b"application/json"
    return json.loads(response.body)


async def test_too_many_header_bytes_get_431_and_close() -> None:
    async with running(echo, max_header_bytes=1024) as (_server, port), raw_client(port) as client:
        headers = b"".join(b"X-Filler-%d: %s\r\n" % (i, b"v" * 60) for i in range(40))
        await client.send(b"GET / HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n")
        error = await _expect_error_and_close(client, 431)
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["code"] == "request_header_fields_too_large"


@pytest.mark.parametrize(("target_bytes", "status"), [(700, 200), (900, 431)])
async def test_the_request_target_counts_toward_max_header_bytes(target_bytes: int, status: int) -> None:
    """A 900-byte target and a 200-byte header under a 1,000-byte bound: 431 (issue 26 break 6)."""
    target = b"/" + b"t" * (target_bytes - 1)
    head = b"GET " + target + b" HTTP/1.1\r\nx-pad: " + b"h" * 193 + b"\r\n\r\n"  # the header: 200 bytes counted
    async with running(echo, max_header_bytes=1000) as (_server, port), raw_client(port) as client:
        await client.send(head)  # one write: the bound is the parser's count, not the per-read one
        if status == 431:
            error = await _expect_error_and_close(client, 431)
            assert error["error"]["code"] == "request_header_fields_too_large"
        else:
            (response,) = await client.responses_complete(1)
            assert response.status == 200 and json.loads(response.body)["path"] == target.decode()


async def test_one_endless_header_line_gets_431() -> None:
    async with running(echo, max_header_bytes=1024) as (_server, port), raw_client(port) as client:
        await client.send(b"GET / HTTP/1.1\r\nX-Long: ")
        for _ in range(4):
            await client.send(b"v" * 512)
            await trio.sleep(0.01)  # separate reads: the head never completes
        error = await _expect_error_and_close(client, 431)
    assert error["error"]["code"] == "request_header_fields_too_large"


async def test_content_length_over_limit_gets_413_without_reading_body() -> None:
    async with running(echo, max_body_bytes=100) as (_server, port), raw_client(port) as client:
        await client.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 101\r\n\r\n")
        error = await _expect_error_and_close(client, 413)
    assert error["error"] == {"message": "request body larger than 100 bytes", "type": "invalid_request_error",
                              "code": "request_too_large"}


async def test_chunked_body_growing_over_limit_gets_413() -> None:
    handled: list[Request] = []

    async def handler(request: Request, responder: Responder) -> None:
        handled.append(request)
        await responder.respond(200, [], b"")

    async with running(handler, max_body_bytes=100) as (_server, port), raw_client(port) as client:
        await client.send(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(3):
            await client.send(b"3c\r\n" + b"x" * 60 + b"\r\n")
        await _expect_error_and_close(client, 413)
    assert handled == []


async def test_malformed_request_gets_400_and_close() -> None:
    async with running(echo) as (_server, port), raw_client(port) as client:
        await client.send(b"NOT HTTP AT ALL\r\n\r\n")
        error = await _expect_error_and_close(client, 400)
    assert error["error"]["code"] == "malformed_request"


async def test_error_after_good_pipelined_request_comes_after_its_response() -> None:
    async with running(echo) as (_server, port), raw_client(port) as client:
        await client.send(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n"
                          b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n")
        await client.read_to_eof()
    assert [r.status for r in client.responses] == [200, 400]


async def test_expect_100_continue_is_answered_before_the_body() -> None:
    async with running(echo) as (_server, port), raw_client(port) as client:
        await client.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        (interim,) = await client.responses_complete(1)
        assert interim.status == 100
        assert client.raw == b"HTTP/1.1 100 Continue\r\n\r\n"
        await client.send(b"hello")
        _interim, final = await client.responses_complete(2)
    assert final.status == 200
    assert json.loads(final.body)["body"] == "hello"


def nothing_received(stream: trio.SocketStream) -> bool:
    """True when no byte waits in the socket: on loopback a byte sent is a byte here, with no delay to wait out."""
    with socket.socket(fileno=os.dup(stream.socket.fileno())) as sock:  # a blocking-call view of the same socket
        try:
            data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
    return data == b""


async def test_expect_100_continue_waits_for_the_response_ahead_of_it() -> None:
    release = trio.Event()
    slow_running = trio.Event()

    async def handler(request: Request, responder: Responder) -> None:
        if request.path == "/slow":
            slow_running.set()
            await release.wait()
        await responder.respond(200, [], request.path.encode() + request.body)

    async with running(handler) as (_server, port), raw_client(port) as client:
        # One write: both heads are parsed before /slow's handler starts, so the interim
        # response for /upload is decided while /slow's response is still due.
        await client.send(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
                          b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nExpect: 100-continue\r\n\r\n")
        with trio.fail_after(5):
            await slow_running.wait()
        assert nothing_received(client.stream)  # nothing may interleave with the pending response
        release.set()
        first, interim = await client.responses_complete(2)
        assert (first.body, interim.status) == (b"/slow", 100)
        await client.send(b"abc")
        _first, _interim, final = await client.responses_complete(3)
    assert final.body == b"/uploadabc"


async def test_expect_100_continue_with_oversized_length_gets_413_at_once() -> None:
    async with running(echo, max_body_bytes=10) as (_server, port), raw_client(port) as client:
        await client.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 11\r\nExpect: 100-continue\r\n\r\n")
        await _expect_error_and_close(client, 413)
    assert b"100 Continue" not in client.raw


# ---- keep-alive ----


async def test_keep_alive_reuses_the_connection() -> None:
    async with running(echo) as (server, port), httpx.AsyncClient() as client:
        first = await client.get(f"http://127.0.0.1:{port}/a")
        second = await client.get(f"http://127.0.0.1:{port}/b")
        assert first.json()["client_port"] == second.json()["client_port"]
        assert "connection" not in second.headers
        assert server.statistics().requests_total == 2


async def test_idle_connection_closes_after_idle_timeout() -> None:
    async with running(echo, idle_timeout_s=0.2) as (server, port), raw_client(port) as client:
        await client.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await client.responses_complete(1)
        started = trio.current_time()
        await client.read_to_eof()
        waited = trio.current_time() - started
        assert 0.1 <= waited < 2
        with trio.fail_after(2):
            while server.statistics().connections_open:
                await trio.sleep(0.01)


# The head, body and idle deadlines of plain-socket connections are kept by the write watchdog (the
# readiness set's timed waits), not by moving the connection scope's deadline twice a request.
_TICKED = {"header_timeout_s": 2.05, "body_timeout_s": 2.0, "idle_timeout_s": 10.05, "client_write_timeout_s": 30.0}


async def _until_eof(client: RawClient) -> float:
    started = trio.current_time()
    await client.read_to_eof(within_s=60.0)
    return trio.current_time() - started


async def test_an_idle_deadline_is_kept_by_the_watchdog(autojump_clock: trio.testing.MockClock) -> None:
    async with running(echo, **_TICKED) as (server, port), raw_client(port) as client:
        await client.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await client.responses_complete(1)
        waited = await _until_eof(client)
        # The watchdog sleeps until the earliest deadline it keeps: the close comes at the idle deadline.
        assert waited == pytest.approx(10.05, abs=1e-6)
        with trio.fail_after(1):
            while server.statistics().connections_open:
                await trio.sleep(0.01)


async def test_the_front_watchdog_wakes_at_deadlines_not_on_a_tick(autojump_clock: trio.testing.MockClock) -> None:
    async with running(echo, **_TICKED) as (server, port), raw_client(port) as client:
        alarm = server._context.watchdog_alarm
        for n in range(1, 31):
            await client.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            await client.responses_complete(n)
            await trio.sleep(1.0)
        # 30 s of a request a second on one connection: each request pushes its idle deadline 10.05 s on, and
        # the watchdog wakes when the earliest deadline it last saw comes (three or four times), where a tick
        # of a twentieth of the smallest timeout woke it 300 times.
        assert 1 <= alarm.wakeups <= 5
        waited = await _until_eof(client)
        assert waited == pytest.approx(10.05 - 1.0, abs=1e-6)


async def test_a_slow_head_gets_its_408_at_its_deadline(
        autojump_clock: trio.testing.MockClock) -> None:
    async with running(echo, **_TICKED) as (_server, port), raw_client(port) as client:
        await client.send(b"GET / HTTP/1.1\r\nHo")
        waited = await _until_eof(client)
        assert b"408" in client.raw.split(b"\r\n", 1)[0] and b"header_timeout" in client.raw
        # From the accept (the first request's head is timed from it): at 2.05 s.
        assert waited == pytest.approx(2.05, abs=1e-6)


async def test_http10_closes_unless_keep_alive_requested() -> None:
    async with running(echo) as (_server, port):
        async with raw_client(port) as client:
            await client.send(b"GET / HTTP/1.0\r\n\r\n")
            await client.read_to_eof()
            assert client.responses[0].headers[b"connection"] == b"close"
        async with raw_client(port) as client:
            await client.send(b"GET /1 HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            (first,) = await client.responses_complete(1)
            assert first.headers[b"connection"] == b"keep-alive"
            await client.send(b"GET /2 HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
            _first, second = await client.responses_complete(2)
            assert json.loads(second.body)["path"] == "/2"


async def test_connection_close_is_honoured() -> None:
    async with running(echo) as (_server, port), raw_client(port) as client:
        await client.send(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        await client.read_to_eof()
    assert client.responses[0].status == 200
    assert client.responses[0].headers[b"connection"] == b"close"


# ---- pipelining ----


async def test_pipelined_requests_are_answered_in_order() -> None:
    async def handler(request: Request, responder: Responder) -> None:
        # Earlier requests take longer, so order cannot come from timing.
        await trio.sleep(0.03 * (5 - int(request.path[1:])))
        await responder.respond(200, [], request.path.encode())

    async with running(handler) as (_server, port), raw_client(port) as client:
        await client.send(b"".join(b"GET /%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(5)))
        responses = await client.responses_complete(5)
    assert [r.body for r in responses] == [b"/0", b"/1", b"/2", b"/3", b"/4"]


async def test_requests_arriving_while_a_handler_runs_are_buffered_in_order() -> None:
    release = trio.Event()

    slow_running = trio.Event()

    async def handler(request: Request, responder: Responder) -> None:
        if request.path == "/slow":
            slow_running.set()
            await release.wait()
        await responder.respond(200, [], request.path.encode())

    def requests(*paths: str) -> bytes:
        return b"".join(b"GET %b HTTP/1.1\r\nHost: x\r\n\r\n" % p.encode() for p in paths)

    async with running(handler) as (server, port), raw_client(port) as client:
        await client.send(requests("/slow", "/1", "/2"))
        with trio.fail_after(5):
            await slow_running.wait()
        # Two requests are already queued: these wait in the socket until there is room.
        await client.send(requests("/3", "/4"))
        assert nothing_received(client.stream)
        assert server.statistics().requests_total == 1
        release.set()
        responses = await client.responses_complete(5)
    assert [r.body for r in responses] == [b"/slow", b"/1", b"/2", b"/3", b"/4"]


# ---- client disconnects ----


async def _handler_cancelled_on_disconnect(close_client) -> list[str]:
    events: list[str] = []
    entered = trio.Event()
    done = trio.Event()

    async def handler(request: Request, responder: Responder) -> None:
        await responder.start_stream(200, [], b"first")
        entered.set()
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            events.append("cancelled")
            with trio.CancelScope(shield=True):
                try:
                    await responder.write(b"more")
                except ClientDisconnected:
                    events.append("write raised ClientDisconnected")
            raise
        finally:
            done.set()

    async with running(handler) as (server, port):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await entered.wait()
        await close_client(stream)
        with trio.fail_after(2):
            await done.wait()
        with trio.fail_after(2):
            while server.statistics().connections_open:
                await trio.sleep(0.01)
    return events


async def test_client_eof_cancels_the_handler() -> None:
    async def close(stream: trio.SocketStream) -> None:
        await stream.aclose()

    events = await _handler_cancelled_on_disconnect(close)
    assert events == ["cancelled", "write raised ClientDisconnected"]


async def test_client_reset_cancels_the_handler() -> None:
    async def reset(stream: trio.SocketStream) -> None:
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await stream.aclose()

    events = await _handler_cancelled_on_disconnect(reset)
    assert events == ["cancelled", "write raised ClientDisconnected"]


async def test_a_handler_that_fails_as_its_client_leaves_is_cancelled_and_its_failure_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    # The handler's nursery ends with the client's Cancelled and a task's own error in one group: the
    # error is logged, the Cancelled ends the connection, and the server serves on.
    entered, done = trio.Event(), trio.Event()

    async def failing_child() -> None:
        try:
            await trio.sleep_forever()
        finally:
            raise ValueError("cleanup broke")

    async def handler(request: Request, responder: Responder) -> None:
        if request.path == "/ok":
            await responder.respond(200, [], b"fine")
            return
        await responder.start_stream(200, [], b"first")
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(failing_child)
                nursery.start_soon(trio.sleep_forever)
                entered.set()
        finally:
            done.set()

    caplog.set_level(logging.ERROR, logger="narwhal.events")
    async with running(handler) as (server, port):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        with trio.fail_after(5):
            await entered.wait()
        await stream.aclose()
        with trio.fail_after(5):
            await done.wait()
            while server.statistics().connections_open:
                await trio.sleep(0.01)
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"http://127.0.0.1:{port}/ok")).text == "fine"
    events = [json.loads(r.getMessage()) for r in caplog.records if r.name == "narwhal.events"]
    (event,) = [e for e in events if e["event"] == "http_handler_error"]
    assert event["class"] == "ValueError" and event["message"] == "cleanup broke"


async def test_eof_is_noticed_while_pipelined_requests_are_queued_when_half_close_is_off() -> None:
    cancelled = trio.Event()
    entered = trio.Event()
    paths: list[str] = []

    async def handler(request: Request, responder: Responder) -> None:
        paths.append(request.path)
        entered.set()
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()

    async with running(handler, half_close=False) as (_server, port):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"".join(b"GET /%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(4)))
        with trio.fail_after(5):
            await entered.wait()  # /0 is being handled, /1-/3 are queued behind it
        await stream.aclose()
        with trio.fail_after(2):
            await cancelled.wait()
    assert paths == ["/0"]


# ---- handler failures ----


async def test_handler_exception_gets_500_and_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    async def handler(request: Request, responder: Responder) -> None:
        if request.path == "/boom":
            raise ValueError("kaboom")
        await responder.respond(200, [], b"fine")

    caplog.set_level(logging.ERROR, logger="narwhal.events")
    async with running(handler) as (_server, port), httpx.AsyncClient() as client:
        failed = await client.get(f"http://127.0.0.1:{port}/boom")
        after = await client.get(f"http://127.0.0.1:{port}/ok")
    assert failed.status_code == 500
    assert failed.json()["error"]["type"] == "server_error"
    assert after.text == "fine"  # the connection survived
    events = [json.loads(r.getMessage()) for r in caplog.records if r.name == "narwhal.events"]
    (event,) = [e for e in events if e["event"] == "http_handler_error"]
    assert event["path"] == "/boom"
    assert event["class"] == "ValueError"
    assert event["message"] == "kaboom"
    assert event["level"] == "error"


async def test_handler_returning_without_response_gets_500(caplog: pytest.LogCaptureFixture) -> None:
    async def handler(request: Request, responder: Responder) -> None:
        return None

    caplog.set_level(logging.ERROR, logger="narwhal.events")
    async with running(handler) as (_server, port), httpx.AsyncClient() as client:
        response = await client.get(f"http://127.0.0.1:{port}/nothing")
    assert response.status_code == 500
    assert any("http_handler_error" in r.getMessage() for r in caplog.records)


async def test_handler_failing_mid_stream_closes_without_terminator(caplog: pytest.LogCaptureFixture) -> None:
    async def handler(request: Request, responder: Responder) -> None:
        await responder.start_stream(200, [], b"partial")
        raise RuntimeError("upstream broke")

    caplog.set_level(logging.ERROR, logger="narwhal.events")
    async with running(handler) as (_server, port), raw_client(port) as client:
        await client.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        raw = await client.read_to_eof()
    assert raw.endswith(b"7\r\npartial\r\n")
    assert b"0\r\n\r\n" not in raw
    assert not client.responses[0].complete


# ---- shutdown and statistics ----


async def test_graceful_shutdown_lets_a_stream_finish_and_refuses_new_connections() -> None:
    in_stream = trio.Event()

    async def handler(request: Request, responder: Responder) -> None:
        if request.path == "/quick":
            await responder.respond(200, [], b"q")
            return
        await responder.start_stream(200, [], b"a")
        in_stream.set()
        for piece in (b"b", b"c", b"d"):
            await trio.sleep(0.05)
            await responder.write(piece)
        await responder.end_stream(b"e")

    server = HTTPServer(handler)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        async with raw_client(port) as idle, raw_client(port) as streaming:
            await idle.send(b"GET /quick HTTP/1.1\r\nHost: x\r\n\r\n")
            await idle.responses_complete(1)
            await streaming.send(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
            await in_stream.wait()
            server.shutdown(5.0)
            await idle.read_to_eof()  # the idle keep-alive connection is closed at once
            assert not streaming.eof
            with pytest.raises(OSError):
                late = await trio.open_tcp_stream("127.0.0.1", port)
                await late.aclose()
            (response,) = await streaming.responses_complete(1)
            assert response.body == b"abcde"
            await streaming.read_to_eof()  # closed after the stream, as shutdown is under way
    # Leaving the nursery means serve() returned on its own.
    assert server.statistics().connections_open == 0


async def test_response_finished_during_shutdown_says_connection_close() -> None:
    inside = trio.Event()
    release = trio.Event()

    async def handler(request: Request, responder: Responder) -> None:
        inside.set()
        await release.wait()
        await responder.respond(200, [], b"late")

    server = HTTPServer(handler)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        async with raw_client(port) as client:
            await client.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            await inside.wait()
            server.shutdown(5.0)
            release.set()
            await client.read_to_eof()
    assert client.responses[0].body == b"late"
    assert client.responses[0].headers[b"connection"] == b"close"


async def test_stream_outlasting_the_grace_period_is_cut() -> None:
    in_stream = trio.Event()

    async def handler(request: Request, responder: Responder) -> None:
        await responder.start_stream(200, [], b"a")
        in_stream.set()
        await trio.sleep(30)
        await responder.end_stream()

    server = HTTPServer(handler)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        async with raw_client(port) as client:
            await client.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            await in_stream.wait()
            started = trio.current_time()
            server.shutdown(0.2)
            raw = await client.read_to_eof()
            assert 0.15 <= trio.current_time() - started < 2
    # leaving the nursery means serve() returned
    assert raw.endswith(b"1\r\na\r\n")


async def test_statistics_count_connections_and_requests() -> None:
    inside = trio.Event()
    release = trio.Event()
    seen: list[ServerStatistics] = []

    async def handler(request: Request, responder: Responder) -> None:
        if request.path == "/hold":
            inside.set()
            await release.wait()
        await responder.respond(200, [], b"")

    async with running(handler) as (server, port), httpx.AsyncClient() as client:
        assert server.statistics() == ServerStatistics(connections_open=0, requests_in_flight=0, requests_total=0)
        await client.get(f"http://127.0.0.1:{port}/a")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client.get, f"http://127.0.0.1:{port}/hold")
            await inside.wait()
            seen.append(server.statistics())
            assert "1 in flight" in repr(server)
            release.set()
    assert seen == [ServerStatistics(connections_open=1, requests_in_flight=1, requests_total=2)]


async def test_accepted_sockets_have_tcp_nodelay() -> None:
    flags: list[int] = []

    async def handler(request: Request, responder: Responder) -> None:
        (conn,) = server._connections
        flags.append(conn.stream.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        await responder.respond(200, [], b"")

    async with running(handler) as (server, port), httpx.AsyncClient() as client:
        await client.get(f"http://127.0.0.1:{port}/")
    assert flags and flags[0] != 0


async def test_serve_listeners_reports_its_listeners() -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    server = HTTPServer(echo)
    async with trio.open_nursery() as nursery:
        reported = await nursery.start(server.serve_listeners, listeners)
        assert reported is listeners
        port = listeners[0].socket.getsockname()[1]
        async with httpx.AsyncClient() as client:
            response = await client.get(f"http://127.0.0.1:{port}/via-listener")
        assert response.json()["path"] == "/via-listener"
        server.shutdown(1.0)
