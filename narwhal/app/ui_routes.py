"""The fleet page and the JSON it reads that ``/admin/engines`` does not carry.

    GET /admin/ui        the fleet page: one self-contained HTML document (no CDN, no build step)
    GET /admin/timeline  the last 15 minutes in one-second buckets (``narwhal.obs.timeline``);
                         ``?seconds=N`` for the last N only
    GET /admin/router    readiness, the lease, monitor stages, workers (``narwhal.app.router_status``)

The page's HTML holds no fleet state, so it loads without the admin token (a
browser cannot send a bearer header for a page it navigates to); every request
the page makes for data carries the token typed into its login field, kept in
the page's memory only. The data routes are behind the app's token check.
"""

from __future__ import annotations

from importlib import resources
from typing import Any, Protocol

import msgspec
from quart import Response, request
from quart_trio import QuartTrio

from narwhal.app.query import QueryParameterError, whole_number
from narwhal.app.router_status import RouterStatus
from narwhal.obs.timeline import TimelineView
from narwhal.wire import error_json

__all__ = ["UI_PATH", "register_ui_routes"]

UI_PATH = "/admin/ui"
# Inline script and style only; data from this origin only; never framed.
_PAGE_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
                               "frame-ancestors 'none'",
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}

_encode_json = msgspec.json.Encoder()


class _Timeline(Protocol):
    def view(self, seconds: int | None = None) -> TimelineView: ...


class UiState(Protocol):
    """What these routes read: the router's timeline feed and its status."""

    @property
    def timeline(self) -> _Timeline: ...
    def router_status(self) -> RouterStatus: ...


def _json(payload: Any, status: int = 200) -> Response:
    return Response(_encode_json.encode(payload), status=status, content_type="application/json")


def page_html() -> bytes:
    """The fleet page, read from the package."""
    return resources.files("narwhal.app").joinpath("ui_page.html").read_bytes()


def register_ui_routes(app: QuartTrio, router: UiState) -> None:
    """Add ``/admin/ui``, ``/admin/timeline`` and ``/admin/router`` to ``app`` over ``router``."""
    page = page_html()

    @app.get(UI_PATH)
    async def admin_ui() -> Response:
        response = Response(page, status=200, content_type="text/html; charset=utf-8")
        response.headers.update(_PAGE_HEADERS)
        return response

    @app.get("/admin/timeline")
    async def admin_timeline() -> Response:
        try:
            seconds = whole_number("seconds", request.args.getlist("seconds"), max_digits=6,
                                   what="a whole number of seconds")
        except QueryParameterError as exc:
            return Response(error_json(str(exc), "invalid_request_error", exc.code),
                            status=400, content_type="application/json")
        return _json(router.timeline.view(seconds))

    @app.get("/admin/router")
    async def admin_router() -> Response:
        return _json(router.router_status())
