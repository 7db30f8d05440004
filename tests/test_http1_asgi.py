"""A real quart-trio app served through HTTPServer by the ASGI adapter."""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import AsyncIterator

import httpx
import pytest
import trio
import trustme
from quart import request as quart_request
from quart_trio import QuartTrio

from narwhal.http1.asgi import ASGILifespan, call_asgi
from narwhal.http1.server import HTTPServer, Request, Responder


def make_app(events: list[str]) -> QuartTrio:
    app = QuartTrio(__name__)
    app.config["RESPONSE_TIMEOUT"] = None  # Quart would otherwise cut streams silently

    @app.before_serving
    async def starting() -> None:
        events.append("before_serving")

    @app.after_serving
    async def stopping() -> None:
        events.append("after_serving")

    @app.get("/json")
    async def json_route() -> dict:
        return {"ok": True, "query": quart_request.args.get("q"), "client": quart_request.remote_addr}

    @app.post("/echo")
    async def echo_route() -> dict:
        payload = await quart_request.get_json()
        return {"received": payload, "content_type": quart_request.content_type}

    @app.get("/stream")
    async def stream_route():
        async def events_out() -> AsyncIterator[bytes]:
            for i in range(3):
                yield b"data: %d\n\n" % i
                await trio.sleep(0.01)

        return events_out(), 200, {"content-type": "text/event-stream"}

    @app.get("/scope")
    async def scope_route() -> dict:
        scope = quart_request.scope
        return {
            "type": scope["type"],
            "asgi": scope["asgi"],
            "http_version": scope["http_version"],
            "method": scope["method"],
            "scheme": scope["scheme"],
            "path": scope["path"],
            "raw_path": scope["raw_path"].decode(),
            "query_string": scope["query_string"].decode(),
            "root_path": scope["root_path"],
            "server": list(scope["server"]),
        }

    return app


@contextlib.asynccontextmanager
async def served(app: QuartTrio, ssl_context: ssl.SSLContext | None = None) -> AsyncIterator[int]:
    async with ASGILifespan(app), trio.open_nursery() as nursery:
        server_address = ("127.0.0.1", 0)

        async def handler(request: Request, responder: Responder) -> None:
            await call_asgi(app, request, responder, server=server_address)

        server = HTTPServer(handler, ssl_context=ssl_context)
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        server_address = ("127.0.0.1", port)
        yield port
        server.shutdown(1.0)


async def test_json_route() -> None:
    async with served(make_app([])) as port, httpx.AsyncClient() as client:
        response = await client.get(f"http://127.0.0.1:{port}/json?q=hello")
    assert response.status_code == 200
    assert response.json() == {"ok": True, "query": "hello", "client": "127.0.0.1"}
    assert response.headers["content-type"] == "application/json"
    assert response.headers["content-length"] == str(len(response.content))


async def test_post_body_reaches_the_route() -> None:
    async with served(make_app([])) as port, httpx.AsyncClient() as client:
        response = await client.post(f"http://127.0.0.1:{port}/echo", json={"prompt": "hi", "n": 2})
    assert response.json() == {"received": {"prompt": "hi", "n": 2}, "content_type": "application/json"}


async def test_streamed_route_arrives_chunked() -> None:
    async with served(make_app([])) as port, httpx.AsyncClient() as client:
        async with client.stream("GET", f"http://127.0.0.1:{port}/stream") as response:
            assert response.headers["transfer-encoding"] == "chunked"
            assert response.headers["content-type"] == "text/event-stream"
            body = b"".join([chunk async for chunk in response.aiter_raw()])
    assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"


async def test_unknown_path_is_404() -> None:
    async with served(make_app([])) as port, httpx.AsyncClient() as client:
        response = await client.get(f"http://127.0.0.1:{port}/nowhere")
    assert response.status_code == 404


async def test_scope_carries_the_request() -> None:
    async with served(make_app([])) as port, httpx.AsyncClient() as client:
        response = await client.get(f"http://127.0.0.1:{port}/scope?a=1&b=2")
    assert response.json() == {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/scope",
        "raw_path": "/scope",
        "query_string": "a=1&b=2",
        "root_path": "",
        "server": ["127.0.0.1", port],
    }


async def test_responses_over_tls_are_not_cut_by_quarts_disconnect_watch() -> None:
    # A TLS write yields; saying "disconnect" before it returned let quart-trio
    # cancel its own send and the client waited forever for the response.
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_context)
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    async with served(make_app([]), server_context) as port, \
            httpx.AsyncClient(verify=client_context, timeout=5.0) as client:
        for _ in range(20):
            response = await client.get(f"https://127.0.0.1:{port}/scope")
            assert response.status_code == 200
            assert response.json()["scheme"] == "https"


async def test_lifespan_runs_before_and_after_serving_hooks() -> None:
    events: list[str] = []
    app = make_app(events)
    async with ASGILifespan(app):
        assert events == ["before_serving"]
    assert events == ["before_serving", "after_serving"]


async def test_lifespan_startup_failure_raises() -> None:
    app = QuartTrio(__name__)

    @app.before_serving
    async def broken() -> None:
        raise ValueError("no database")

    with pytest.raises(RuntimeError, match="no database"):
        async with ASGILifespan(app):
            pytest.fail("the block must not run")


async def test_client_disconnect_cancels_a_streaming_route(caplog: pytest.LogCaptureFixture) -> None:
    app = make_app([])
    streaming = trio.Event()
    stopped = trio.Event()

    @app.get("/endless")
    async def endless_route():
        async def events_out() -> AsyncIterator[bytes]:
            try:
                while True:
                    yield b"data: tick\n\n"
                    streaming.set()
                    await trio.sleep(0.01)
            finally:
                stopped.set()

        return events_out(), 200, {"content-type": "text/event-stream"}

    async with served(app) as port:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(b"GET /endless HTTP/1.1\r\nHost: x\r\n\r\n")
            await streaming.wait()
        with trio.fail_after(2):
            await stopped.wait()
    assert not [r for r in caplog.records if "http_handler_error" in r.getMessage()]
