"""End to end: hostile clients against the router process (issue 13, items 5 and 6)."""

from __future__ import annotations

import json

import pytest
import trio

pytestmark = pytest.mark.e2e


async def exchange(port: int, data: bytes) -> bytes:
    """Send ``data`` on a new connection, half-close, and read until the router closes."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    raw = b""
    async with stream:
        await stream.send_all(data)
        await stream.send_eof()
        with trio.fail_after(10):
            while chunk := await stream.receive_some(65536):
                raw += chunk
    return raw


def status_and_json(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


async def test_an_upgrade_cannot_smuggle_an_admin_drain(start_fleet):
    fleet = await start_fleet()
    smuggled = b"POST /admin/engines/p1/drain HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n"
    raw = await exchange(fleet.router.port, (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nupgrade: websocket\r\nconnection: Upgrade\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(smuggled), smuggled)))
    status, body = status_and_json(raw)
    assert status == 400 and body["error"]["code"] == "upgrade_not_supported"
    assert raw.count(b"HTTP/1.1 ") == 1
    engine = (await fleet.client.get(f"{fleet.url}/admin/engines/p1")).json()["engine"]
    assert engine["drained"] is False


async def test_past_the_connection_cap_only_health_is_answered(start_fleet):
    fleet = await start_fleet(sections={"serving": {"max_client_connections": 4}})
    port = fleet.router.port
    held: list[trio.SocketStream] = []
    try:
        refused = None
        for _ in range(12):
            raw = await exchange(port, b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
            if raw.startswith(b"HTTP/1.1 503"):
                refused = raw
                break
            # Hold a connection open (an unfinished head) to use up a slot.
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(b"GET /v1/models HTTP/1.1\r\n")
            held.append(stream)
        assert refused is not None, "the cap never applied"
        status, body = status_and_json(refused)
        assert body["error"]["code"] == "too_many_connections"
        health = await exchange(port, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert health.startswith(b"HTTP/1.1 200")
    finally:
        for stream in held:
            await stream.aclose()
