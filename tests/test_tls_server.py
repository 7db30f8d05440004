"""The HTTPS side of the front: handshake deadlines and the serving certificate's lifetime.

Certificates come from trustme; servers run on real 127.0.0.1 sockets. Time-based
rules run on trio's MockClock (autojump), so a deadline is read off the clock.
"""

from __future__ import annotations

import contextlib
import json
import ssl
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
import trustme

from narwhal.http1.server import HTTPServer, Request, Responder


@pytest.fixture
def server_tls() -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A (server, client) context pair from one trustme CA."""
    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server)
    client = ssl.create_default_context()
    ca.configure_trust(client)
    return server, client


async def ok(request: Request, responder: Responder) -> None:
    await responder.respond(200, [(b"content-type", b"application/json")], json.dumps({"path": request.path}).encode())


@contextlib.asynccontextmanager
async def https_server(context: ssl.SSLContext, **options: Any) -> AsyncIterator[tuple[HTTPServer, int]]:
    server = HTTPServer(ok, ssl_context=context, **options)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        yield server, port
        server.shutdown(0)


async def closed_at(stream: trio.SocketStream, limit_s: float) -> float:
    """The (virtual) time at which the server closed ``stream``."""
    with trio.fail_after(limit_s):
        while True:
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:
                break
            if not data:
                break
    return trio.current_time()


# A ClientHello's record header and the first bytes of its body: a handshake that never completes.
_HALF_HELLO = bytes.fromhex("16030100c8010000c40303") + b"\x00" * 16


@pytest.mark.parametrize("sent", [b"", _HALF_HELLO], ids=["silent", "half-hello"])
async def test_a_tls_handshake_counts_against_the_header_timeout(
        autojump_clock: Any, server_tls: tuple[ssl.SSLContext, ssl.SSLContext], sent: bytes) -> None:
    """A silent or half-sent ClientHello is closed at header_timeout_s, not idle_timeout_s (issue 19 item 9)."""
    server_context, _ = server_tls
    async with https_server(server_context, header_timeout_s=10.0, idle_timeout_s=600.0) as (server, port):
        start = trio.current_time()
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        if sent:
            await stream.send_all(sent)
        closed = await closed_at(stream, limit_s=1000)
        await stream.aclose()
        open_after = server.statistics().connections_open
    # The watchdog's 1 s ticks may pass between the connect and the accept.
    assert 10.0 <= closed - start <= 12.0
    assert open_after == 0


async def test_the_first_head_after_a_handshake_shares_its_window(
        autojump_clock: Any, server_tls: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    """A handshake and then a silent client: closed at header_timeout_s from the accept."""
    server_context, client_context = server_tls
    async with https_server(server_context, header_timeout_s=10.0, idle_timeout_s=600.0) as (_server, port):
        start = trio.current_time()
        stream = await trio.open_ssl_over_tcp_stream("127.0.0.1", port, ssl_context=client_context)
        await stream.do_handshake()
        with trio.fail_after(1000):
            while True:
                try:
                    data = await stream.receive_some(65536)
                except trio.BrokenResourceError:
                    break
                if not data:
                    break
        closed = trio.current_time()
        await trio.aclose_forcefully(stream)
    assert 10.0 <= closed - start <= 12.0


async def test_a_prompt_client_is_served_over_tls(server_tls: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    server_context, client_context = server_tls
    async with https_server(server_context, header_timeout_s=10.0) as (_server, port):
        stream = await trio.open_ssl_over_tcp_stream("127.0.0.1", port, ssl_context=client_context)
        await stream.send_all(b"GET /x HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        raw = b""
        with trio.fail_after(10):
            while True:
                try:
                    data = await stream.receive_some(65536)
                except trio.BrokenResourceError:
                    break
                if not data:
                    break
                raw += data
        await trio.aclose_forcefully(stream)
    assert raw.startswith(b"HTTP/1.1 200") and raw.endswith(b'{"path": "/x"}')
