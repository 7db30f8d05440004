"""The data-plane front's routing, shared by the single router process and every worker.

A request that carries this router's own ``via`` token came back through an
engine URL that points at a router: it is refused (508) instead of fanning
out. The completion routes go to the request core; with ``[admin] listen``
set, admin paths are not served on the traffic port at all; everything else
goes to ``rest`` (the control app in one process, the controller from a
worker).
"""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Awaitable, Callable

from narwhal.http1.server import Request, Responder
from narwhal.obs.logs import log_event
from narwhal.serving.request_core import COMPLETION_ROUTES, RequestCore
from narwhal.wire import error_json

__all__ = ["Front", "is_admin_path"]

_JSON = [(b"content-type", b"application/json")]
_NOT_ALLOWED = error_json("completion routes accept POST only", "invalid_request_error", "method_not_allowed")


def is_admin_path(path: str) -> bool:
    """Whether the control app would route ``path`` to the admin API (percent-decoded, slashes collapsed)."""
    if "%" in path:
        path = urllib.parse.unquote(path)
    path = "/" + path.lstrip("/")
    return path == "/admin" or path.startswith("/admin/")


class Front:
    """Routes one parsed request: loop check, completions, admin off the port, the rest."""

    def __init__(self, core: RequestCore, *, via_token: str, admin_elsewhere: bool,
                 rest: Callable[[Request, Responder], Awaitable[None]]) -> None:
        self._core = core
        self._via = via_token.encode()
        self._admin_elsewhere = admin_elsewhere
        self._rest = rest
        self._loop_error = error_json(
            f"request loop detected: this router ({via_token}) sent this request itself; "
            "an [[engines]] url points back at a router", "server_error", "loop_detected")

    async def handle(self, request: Request, responder: Responder) -> None:
        via = request.get_header(b"via")
        if via is not None and self._via in via:
            log_event("request_loop", level=logging.ERROR, path=request.path, via=via.decode("latin-1")[:200])
            await responder.respond(508, _JSON, self._loop_error)
            return
        if request.path in COMPLETION_ROUTES:
            if request.method == b"POST":
                await self._core.handle(request.path, request.body, request.get_header(b"x-request-id"), responder)
            else:
                await responder.respond(405, [*_JSON, (b"allow", b"POST")], _NOT_ALLOWED)
            return
        if self._admin_elsewhere and is_admin_path(request.path):
            # [admin] listen moves the admin API off the traffic port entirely.
            await responder.respond(404, _JSON, error_json(f"no route for {request.method.decode('latin-1')} "
                                                           f"{request.path}", "invalid_request_error", "not_found"))
            return
        await self._rest(request, responder)
