"""Worker processes share one listening socket: one at its connection cap leaves new clients to a sibling.

Two servers in this process stand for two workers: each accepts on its own
descriptor of the same listening socket, as forked workers do.
"""

from __future__ import annotations

import socket

import trio

from narwhal.http1.server import HTTPServer, Request, Responder
from tests.test_http1_server import raw_client

GET = b"GET /work HTTP/1.1\r\nhost: x\r\n\r\n"


def named(name: bytes):
    async def handler(request: Request, responder: Responder) -> None:
        await responder.respond(200, [(b"content-type", b"text/plain")], name)

    return handler


def listener_on(sock: socket.socket) -> trio.SocketListener:
    return trio.SocketListener(trio.socket.from_stdlib_socket(sock))


async def test_a_worker_at_its_cap_leaves_new_connections_to_its_sibling() -> None:
    shared = socket.create_server(("127.0.0.1", 0), backlog=64)
    port = shared.getsockname()[1]
    full = HTTPServer(named(b"full"), max_client_connections=2, yield_at_cap=True)
    roomy = HTTPServer(named(b"roomy"), max_client_connections=12, yield_at_cap=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(full.serve_listeners, [listener_on(shared.dup())])
        clients = []
        for _ in range(2):
            client = await nursery.start(_hold_open, port)
            clients.append(client)
        assert full.statistics().connections_open == 2
        await nursery.start(roomy.serve_listeners, [listener_on(shared.dup())])
        # Twelve more clients while "full" is at its cap: none may be refused.
        for _ in range(12):
            client = await nursery.start(_hold_open, port)
            assert client.responses[0].status == 200 and client.responses[0].body == b"roomy"
        assert full.statistics().connections_refused == 0
        # Both at their caps: a further client is still answered (503) rather than left waiting.
        async with raw_client(port) as extra:
            await extra.send(GET)
            with trio.fail_after(5):
                response, = await extra.responses_complete(1)
            assert response.status == 503
        full.shutdown(0)
        roomy.shutdown(0)
        nursery.cancel_scope.cancel()
    shared.close()


async def _hold_open(port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """One client that got its first answer, keeping its connection open (a slot) until cancelled."""
    async with raw_client(port) as client:
        await client.send(GET)
        await client.responses_complete(1)
        task_status.started(client)
        await trio.sleep_forever()
