"""The data-plane front: the two completion routes go to the request core, every other path to the app.

One handler for ``narwhal.http1.server.HTTPServer``. Completion routes accept
POST only (405 with ``Allow: POST`` otherwise); the rest is passed through the
ASGI adapter to the quart-trio control app, so both share one port.
"""

from __future__ import annotations

from narwhal.http1.asgi import ASGIApp, call_asgi
from narwhal.http1.server import Request, Responder
from narwhal.serving.request_core import COMPLETION_ROUTES, RequestCore
from narwhal.wire import error_json

__all__ = ["Front"]

_NOT_ALLOWED = error_json("completion routes accept POST only", "invalid_request_error", "method_not_allowed")
_NOT_ALLOWED_HEADERS = [(b"content-type", b"application/json"), (b"allow", b"POST")]


class Front:
    """Routes each request of the data-plane server to the core or to the app."""

    def __init__(self, core: RequestCore, app: ASGIApp) -> None:
        self.core = core
        self.app = app

    async def handle(self, request: Request, responder: Responder) -> None:
        """Serve one request: completions through the core, everything else through the app."""
        if request.path in COMPLETION_ROUTES:
            if request.method == b"POST":
                await self.core.handle(request.path, request.body, request.get_header(b"x-request-id"),
                                       responder)
            else:
                await responder.respond(405, _NOT_ALLOWED_HEADERS, _NOT_ALLOWED)
            return
        await call_asgi(self.app, request, responder)
