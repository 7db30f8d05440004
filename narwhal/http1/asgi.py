"""Runs an ASGI app (the quart-trio control API) behind ``HTTPServer``.

``call_asgi`` turns one parsed request into an ASGI HTTP call; ``ASGILifespan``
runs the app's lifespan protocol around the server's life.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable
from typing import Any, Protocol

import trio

from narwhal.http1.server import Request
from narwhal.http1.target import asgi_path

__all__ = ["ASGIApp", "ASGILifespan", "ASGIResponder", "PEER_CERT_EXTENSION", "call_asgi"]

# The scope's extension that says a TLS peer presented a client certificate the listener verified (True);
# absent on plain HTTP and on TLS without one. The cluster's routes authenticate routers by it.
PEER_CERT_EXTENSION = "narwhal.peer_cert"



class ASGIApp(Protocol):
    """An ASGI 3 application (the quart-trio app): ``await app(scope, receive, send)``.

    Scope and messages are ASGI's dicts; each framework types them its own way, hence ``Any`` inside.
    """

    def __call__(self, scope: Any, receive: Any, send: Any, /) -> Awaitable[None]: ...

class ASGIResponder(Protocol):
    """What ``call_asgi`` writes the app's answer through: the server's ``Responder``, or a worker's collector."""

    @property
    def secure(self) -> bool: ...
    @property
    def peer_certified(self) -> bool:
        """The TLS peer presented a client certificate the listener verified (read only when ``secure``)."""
        ...
    @property
    def started(self) -> bool: ...
    @property
    def client_disconnected(self) -> bool: ...
    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None: ...
    async def start_stream(self, status: int, headers: list[tuple[bytes, bytes]], first: bytes = b"") -> None: ...
    async def write(self, data: bytes) -> None: ...
    async def end_stream(self, last: bytes = b"") -> None: ...


# The responder frames the body and decides about the connection itself.
_FRAMING_HEADERS = frozenset({b"content-length", b"transfer-encoding", b"connection", b"keep-alive"})


class _HTTPCall:
    """The receive and send callables of one ASGI HTTP call."""

    __slots__ = ("_body_delivered", "_buffered", "_headers", "_known_length", "_request", "_responder", "_sent",
                 "_status")

    def __init__(self, request: Request, responder: ASGIResponder) -> None:
        self._request = request
        self._responder = responder
        self._body_delivered = False
        self._status = 0
        self._headers: list[tuple[bytes, bytes]] = []
        self._known_length = False
        self._buffered: list[bytes] = []
        # True once the last body write has returned. Not ``responder.finished``:
        # that is set before the write, and quart-trio cancels its sending task
        # as soon as receive() says disconnect, which would cut a write that
        # yields (a TLS write always does) and lose the response.
        self._sent = False

    async def receive(self) -> dict[str, Any]:
        if not self._body_delivered:
            self._body_delivered = True
            return {"type": "http.request", "body": self._request.body, "more_body": False}
        if self._sent or self._responder.client_disconnected:
            return {"type": "http.disconnect"}
        # The server cancels the whole handler, this included, when the client
        # goes away; until then there is nothing more to receive.
        await trio.sleep_forever()

    async def send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        responder = self._responder
        if kind == "http.response.start":
            self._status = message["status"]
            headers = []
            for name, value in message.get("headers", ()):
                name = name.lower()
                if name == b"content-length":
                    self._known_length = True
                elif name not in _FRAMING_HEADERS:
                    headers.append((name, value))
            self._headers = headers
        elif kind == "http.response.body":
            if not self._status:
                raise RuntimeError("http.response.body before http.response.start")
            body = message.get("body", b"")
            more_body = message.get("more_body", False)
            if self._known_length:
                # Quart sends even a JSON body as "more" plus an empty last message;
                # a body of declared length is gathered and sent whole, not chunked.
                self._buffered.append(body)
                if not more_body:
                    await responder.respond(self._status, self._headers, b"".join(self._buffered))
                    self._sent = True
            elif not responder.started:
                if more_body:
                    await responder.start_stream(self._status, self._headers, body)
                else:
                    await responder.respond(self._status, self._headers, body)
                    self._sent = True
            elif more_body:
                await responder.write(body)
            else:
                await responder.end_stream(body)
                self._sent = True


async def call_asgi(
    app: ASGIApp, request: Request, responder: ASGIResponder, *, server: tuple[str, int] | None = None
) -> None:
    """Serve ``request`` with the ASGI ``app``, writing the response through ``responder``.

    A TLS peer with a verified client certificate is marked in ``scope["extensions"]`` (``PEER_CERT_EXTENSION``).
    """
    raw_path = request.raw_path
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": request.http_version,
        "method": request.method.decode("ascii"),
        "scheme": "https" if responder.secure else "http",
        # ASGI's path is percent-decoded (UTF-8); raw_path keeps the bytes as sent.
        "path": asgi_path(raw_path),
        "raw_path": raw_path,
        "query_string": request.query,
        "root_path": "",
        "headers": request.headers,
        "client": request.client,
        "server": server,
    }
    if responder.secure and responder.peer_certified:
        scope["extensions"] = {PEER_CERT_EXTENSION: True}
    call = _HTTPCall(request, responder)
    await app(scope, call.receive, call.send)


class ASGILifespan:
    """Runs the ASGI lifespan protocol of ``app`` in its own task, around an ``async with`` block."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app
        self._stack: contextlib.AsyncExitStack | None = None
        self._to_app_send, self._to_app_receive = trio.open_memory_channel[dict[str, Any]](1)
        self._from_app_send, self._from_app_receive = trio.open_memory_channel[dict[str, Any]](1)
        self._app_error: Exception | None = None

    async def __aenter__(self) -> ASGILifespan:
        """Start the app's lifespan task and wait for startup to complete."""
        stack = contextlib.AsyncExitStack()
        nursery = await stack.enter_async_context(trio.open_nursery())
        nursery.start_soon(self._run_app)
        started = False
        try:
            await self._to_app_send.send({"type": "lifespan.startup"})
            reply = await self._reply()
            if reply["type"] != "lifespan.startup.complete":
                raise RuntimeError(f"ASGI lifespan startup failed: {reply.get('message', '')}")
            started = True
        finally:
            if not started:
                nursery.cancel_scope.cancel()
                await stack.aclose()
        self._stack = stack
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Send lifespan.shutdown, wait for the app to finish it, and end the lifespan task."""
        stack, self._stack = self._stack, None
        assert stack is not None, "ASGILifespan exited without having been entered"
        try:
            await self._to_app_send.send({"type": "lifespan.shutdown"})
            reply = await self._reply()
            if reply["type"] != "lifespan.shutdown.complete":
                raise RuntimeError(f"ASGI lifespan shutdown failed: {reply.get('message', '')}")
        finally:
            # The block's own exception is not fed to the nursery, so that it
            # reaches the caller as it was, not wrapped in an exception group.
            await stack.aclose()

    async def _reply(self) -> dict[str, Any]:
        try:
            return await self._from_app_receive.receive()
        except trio.EndOfChannel:
            raise RuntimeError("the ASGI app's lifespan ended without replying") from self._app_error

    async def _run_app(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        try:
            async with self._from_app_send:
                await self._app(scope, self._to_app_receive.receive, self._from_app_send.send)
        except Exception as exc:
            self._app_error = exc
