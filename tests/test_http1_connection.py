"""The responder, the write watchdog and one connection without sockets.

``narwhal.http1.responder.Responder`` frames each response and decides
whether the connection goes on; here it writes to a list. The write watchdog
(``narwhal.http1.watchdogs.watch_writes``) runs over fake connections on
trio's MockClock, and a ``Connection`` over a memory stream with only its
``ServerContext`` (no ``HTTPServer``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import trio
import trio.testing

from narwhal.errors import ClientGone
from narwhal.http1.alarm import Alarm
from narwhal.http1.connection import Connection, ServerContext
from narwhal.http1.protocol import Limits, Request
from narwhal.http1.responder import Responder
from narwhal.http1.watchdogs import watch_writes

COMMON = b"server: narwhal\r\n"


class Context:
    def __init__(self) -> None:
        self.closing = False

    def common_head_lines(self) -> bytes:
        return COMMON


class Wire:
    """The connection as the responder sees it: every send recorded, nothing on a socket."""

    def __init__(self, *, fd: int = 7, secure: bool = False) -> None:
        self.context = Context()
        self.sent: list[bytes] = []
        self.disconnected = False
        self._fd = fd
        self._secure = secure

    @property
    def fd(self) -> int:
        return self._fd

    @property
    def secure(self) -> bool:
        return self._secure

    async def send(self, data: bytes) -> None:
        if self.disconnected:
            raise self.gone_error()
        self.sent.append(data)

    def gone_error(self) -> Exception:
        return ClientGone("the client has gone")

    def write_waits(self, on_stall: Callable[[], None]) -> None:
        raise AssertionError("the responder never parks a write")

    def write_done(self) -> None:
        raise AssertionError("the responder never parks a write")

    def cut_mid_write(self) -> None:
        raise AssertionError("the responder never cuts a write")

    def client_gone(self) -> None:
        self.disconnected = True


def responder(method: bytes = b"GET", *, version: str = "1.1", keep_alive: bool = True,
              wire: Wire | None = None) -> tuple[Responder, Wire]:
    wire = wire or Wire()
    return Responder(wire, Request(method, b"/x", http_version=version, keep_alive=keep_alive)), wire


async def test_a_whole_response_is_one_write_with_its_length_and_the_connection_goes_on() -> None:
    r, wire = responder()
    await r.respond(200, [(b"content-type", b"text/plain")], b"hello")
    assert wire.sent == [b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n" + COMMON
                         + b"content-length: 5\r\n\r\nhello"]
    assert r.started and r.finished and not r.closes


@pytest.mark.parametrize(("method", "status"), [(b"HEAD", 200), (b"GET", 204), (b"GET", 304)])
async def test_head_204_and_304_carry_no_body(method: bytes, status: int) -> None:
    r, wire = responder(method)
    await r.respond(status, [], b"body")
    assert not wire.sent[0].endswith(b"body")
    assert (b"content-length: 4" in wire.sent[0]) == (method == b"HEAD")


async def test_a_stream_is_chunk_framed_one_write_per_call_and_terminated_once() -> None:
    r, wire = responder()
    await r.start_stream(200, [], b"first")
    await r.write(b"")  # nothing to send: no write at all
    await r.write(b"second")
    await r.end_stream(b"last")
    assert wire.sent[0].endswith(b"transfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
    assert wire.sent[1:] == [b"6\r\nsecond\r\n", b"4\r\nlast\r\n0\r\n\r\n"]
    assert r.finished and not r.closes
    with pytest.raises(RuntimeError):
        await r.write(b"more")


async def test_an_http_1_0_stream_is_unframed_and_closes_the_connection() -> None:
    r, wire = responder(version="1.0")
    await r.start_stream(200, [], b"first")
    await r.write(b"second")
    await r.end_stream()
    assert wire.sent[0].endswith(b"connection: close\r\n\r\nfirst")
    assert wire.sent[1:] == [b"second"]
    assert r.closes


async def test_http_1_0_keep_alive_is_said_and_connection_close_is_honoured() -> None:
    r, wire = responder(version="1.0")
    await r.respond(200, [], b"")
    assert b"connection: keep-alive\r\n" in wire.sent[0] and not r.closes
    r, wire = responder(keep_alive=False)
    await r.respond(200, [], b"")
    assert b"connection: close\r\n" in wire.sent[0] and r.closes


async def test_a_shutting_down_server_closes_after_each_response() -> None:
    wire = Wire()
    wire.context.closing = True
    r, _ = responder(wire=wire)
    await r.respond(200, [], b"")
    assert b"connection: close\r\n" in wire.sent[0] and r.closes


async def test_a_response_to_a_client_known_gone_raises_its_error_and_sends_nothing() -> None:
    r, wire = responder()
    wire.disconnected = True
    assert r.client_disconnected
    with pytest.raises(ClientGone):
        await r.respond(200, [], b"")
    assert wire.sent == []


async def test_direct_hands_the_pump_a_started_plain_socket_stream_only() -> None:
    r, wire = responder()
    assert r.direct() is None  # not started
    await r.start_stream(200, [])
    assert r.direct() == (wire, True)
    r10, wire10 = responder(version="1.0")
    await r10.start_stream(200, [])
    assert r10.direct() == (wire10, False)
    tls, _ = responder(wire=Wire(fd=-1, secure=True))
    await tls.start_stream(200, [])
    assert tls.direct() is None and tls.secure
    await r.end_stream()
    assert r.direct() is None  # finished


# ---- the write watchdog ----


class Pending:
    def __init__(self, since: float) -> None:
        self.write_since = since
        self.disconnected = False
        self.stalls = 0
        self.stalled_at = math.nan

    async def stalled(self) -> None:
        self.stalls += 1
        self.stalled_at = trio.current_time()
        self.disconnected = True


async def test_the_write_watchdog_closes_only_writes_older_than_the_timeout(autojump_clock) -> None:
    now = trio.current_time()
    stuck, recent, idle = Pending(now), Pending(now), Pending(math.inf)
    alarm = Alarm()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_writes, [stuck, recent, idle], 10.0, alarm)
        await trio.sleep(9.5)
        recent.write_since = trio.current_time()  # this one's write went out and another began
        alarm.due(recent.write_since + 10.0)
        assert stuck.stalls == 0
        await trio.sleep(1.0)
        assert (stuck.stalls, recent.stalls, idle.stalls) == (1, 0, 0)
        await trio.sleep(30.0)
        # Once gone, a connection is never closed again.
        assert (stuck.stalls, recent.stalls, idle.stalls) == (1, 1, 0)
        # Each at its deadline: the watchdog sleeps until the earliest write's, not on a tick.
        assert (stuck.stalled_at, recent.stalled_at) == (now + 10.0, now + 19.5)
        assert alarm.wakeups == 2 and alarm.at == math.inf
        nursery.cancel_scope.cancel()


async def test_the_write_watchdog_sleeps_while_no_write_waits_and_a_write_that_starts_to_wait_wakes_it(
        autojump_clock) -> None:
    connections: list[Pending] = [Pending(math.inf)]
    alarm = Alarm()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_writes, connections, 10.0, alarm)
        await trio.sleep(100.0)
        assert alarm.at == math.inf and alarm.wakeups == 0  # asleep since it started: no tick
        stuck = Pending(trio.current_time())
        connections.append(stuck)
        alarm.due(stuck.write_since + 10.0)
        await trio.sleep(30.0)
        assert stuck.stalls == 1 and stuck.stalled_at == 110.0
        nursery.cancel_scope.cancel()


async def test_a_connection_whose_write_starts_to_wait_wakes_the_write_watchdog() -> None:
    ctx = context(echo)
    ours, _theirs = trio.testing.memory_stream_pair()
    conn = Connection(ctx, ours)
    woken = []

    async def sleeper() -> None:
        await ctx.watchdog_alarm.sleep_until(math.inf)
        woken.append(True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sleeper)
        await trio.testing.wait_all_tasks_blocked()
        conn.write_waits(lambda: None)
        await trio.testing.wait_all_tasks_blocked()
        assert woken == [True] and conn.write_since < math.inf


# ---- one connection over a memory stream: no server, no socket ----


def context(handler) -> ServerContext:
    return ServerContext(handler, limits=Limits(), idle_timeout_s=5.0, client_write_timeout_s=5.0,
                         overflow_paths=frozenset({"/health"}), gone_events=0, server_name=b"narwhal")


async def echo(request: Request, responder: Responder) -> None:
    await responder.respond(200, [], request.path.encode())


async def test_a_connection_answers_pipelined_requests_in_order_over_a_memory_stream(autojump_clock) -> None:
    ours, theirs = trio.testing.memory_stream_pair()
    ctx = context(echo)
    conn = Connection(ctx, ours)
    assert conn.sock is None and conn.fd == -1 and not conn.secure
    async with trio.open_nursery() as nursery:
        nursery.start_soon(conn.run)
        await theirs.send_all(b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n"
                              b"GET /b HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        received = b""
        while received.count(b"HTTP/1.1 200") < 2 or not received.endswith(b"/b"):
            received += await theirs.receive_some()
    assert received.index(b"\r\n\r\n/a") < received.index(b"\r\n\r\n/b")
    assert b"connection: close" in received.split(b"\r\n\r\n/a")[1]
    assert (ctx.requests_total, ctx.requests_in_flight) == (2, 0)


async def test_an_overflow_connection_serves_health_only(autojump_clock) -> None:
    for path, status in ((b"/health", b"200"), (b"/v1/completions", b"503")):
        ours, theirs = trio.testing.memory_stream_pair()
        ctx = context(echo)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(Connection(ctx, ours, overflow=True).run)
            await theirs.send_all(b"GET " + path + b" HTTP/1.1\r\nhost: x\r\n\r\n")
            received = await theirs.receive_some()
        assert received.startswith(b"HTTP/1.1 " + status) and b"connection: close" in received
