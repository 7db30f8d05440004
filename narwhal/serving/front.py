"""The data-plane front: the two completion routes go to the request core, every other path to the app.

One handler for ``narwhal.http1.server.HTTPServer``. A request carrying this
router's own ``Via`` token came back to it (an engine URL points at a router):
508 ``loop_detected``. Completion routes accept POST only (405 with
``Allow: POST`` otherwise). With ``[admin] listen`` the admin paths (and the
routers' ``/cluster/`` link) are 404 here, the body naming the admin address.
The rest goes to ``rest``: in one process the ASGI adapter to the quart-trio
control app, so both share one port; in a worker, the answers it gives from
its snapshot and the controller for everything else.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Awaitable, Callable

from narwhal.auth.client_auth import KeyMemo
from narwhal.config import Config
from narwhal.http1.server import OVERFLOW_CONNECTIONS, Handler, HTTPServer, Request, Responder, client_connection_budget
from narwhal.http1.target import asgi_path
from narwhal.obs.logs import log_event
from narwhal.serving.request_core import COMPLETION_ROUTES, RequestCore
from narwhal.wire import error_json

__all__ = ["Front", "admin_elsewhere_body", "admin_url", "build_admin_server", "build_front_server", "is_admin_path"]

_JSON = [(b"content-type", b"application/json")]
_NOT_ALLOWED = error_json("completion routes accept POST only", "invalid_request_error", "method_not_allowed")
_NOT_ALLOWED_HEADERS = [*_JSON, (b"allow", b"POST")]
# The paths [admin] listen takes off the traffic port: the admin API and the routers' link (/cluster/evidence).
_ADMIN_LISTEN_PREFIXES = ("/admin", "/cluster")
# Admin requests carry small JSON bodies, if any.
_ADMIN_MAX_BODY_BYTES = 64 * 1024


def is_admin_path(request: Request) -> bool:
    """Is ``request`` for what ``[admin] listen`` serves instead of the traffic port: the admin API (``/admin``)
    or the routers' link (``/cluster``)? Read from the path the ASGI scope gets (``split_target``, absolute
    form included; percent-decoded), leading slashes collapsed."""
    path = "/" + asgi_path(request.raw_path).lstrip("/")
    return any(path == prefix or path.startswith(prefix + "/") for prefix in _ADMIN_LISTEN_PREFIXES)


def admin_url(config: Config) -> str | None:
    """The URL of ``[admin] listen`` (https when the router serves TLS), or None when admin is on the traffic port."""
    if config.admin.listen is None:
        return None
    return f"{'https' if config.serving.tls_cert_file is not None else 'http'}://{config.admin.listen}"


def admin_elsewhere_body(request: Request, admin_address: str) -> bytes:
    """The 404 body for an admin path asked of the traffic port while ``[admin] listen`` serves them at
    ``admin_address``: it says where, so ``narwhal admin`` can say which ``--url`` to pass."""
    return error_json(f"no route for {request.method.decode('latin-1')} {request.path} on the traffic port: "
                      f"the admin API is served on [admin] listen {admin_address} "
                      f"(narwhal admin --url {admin_address})", "invalid_request_error", "not_found")


class Front:
    """Routes each request of the data-plane server to the core or to the app."""

    def __init__(self, core: RequestCore, rest: Callable[[Request, Responder], Awaitable[None]], *,
                 via_token: str, admin_elsewhere: str | None) -> None:
        """``admin_elsewhere``: the ``[admin] listen`` URL that serves the admin paths instead of this port."""
        self.core = core
        self.rest = rest
        self._via_token = via_token.encode()
        self._admin_elsewhere = admin_elsewhere
        self._loop_error = error_json(
            f"request loop detected: this router ({via_token}) sent this request itself; "
            "an [[engines]] url points back at a router", "server_error", "loop_detected")

    async def handle(self, request: Request, responder: Responder) -> None:
        """Serve one request: completions through the core, everything else through the app."""
        via = request.get_header(b"via")
        if via is not None and self._via_token in via:
            log_event("request_loop", level=logging.ERROR, path=request.path, via=via.decode("latin-1")[:200])
            await responder.respond(508, _JSON, self._loop_error)
            return
        if request.path in COMPLETION_ROUTES:
            if request.method == b"POST":
                # The Authorization header is looked for only with client keys on: a request does not pay for them.
                core = self.core
                memo: KeyMemo | None = None
                authorization = None
                if core.auth is not None:
                    authorization = request.get_header(b"authorization")
                    # The connection's last verified key: a kept-alive client's next requests skip the hash.
                    kept = request.memo
                    if isinstance(kept, KeyMemo):
                        memo = kept
                    else:
                        memo = request.memo = KeyMemo()
                if core.tracer is None:
                    await core.handle(request.path, request.body, request.get_header(b"x-request-id"), responder,
                                      authorization, key_memo=memo)
                else:
                    # The client's trace context, looked for only with tracing on (as the key with keys on); its
                    # tracestate only with a traceparent (W3C: without one, tracestate is not read).
                    traceparent = request.get_header(b"traceparent")
                    await core.handle(request.path, request.body, request.get_header(b"x-request-id"), responder,
                                      authorization, traceparent,
                                      None if traceparent is None else request.get_header(b"tracestate"),
                                      key_memo=memo)
            else:
                await responder.respond(405, _NOT_ALLOWED_HEADERS, _NOT_ALLOWED)
            return
        if self._admin_elsewhere is not None and is_admin_path(request):
            await responder.respond(404, _JSON, admin_elsewhere_body(request, self._admin_elsewhere))
            return
        await self.rest(request, responder)


def build_front_server(config: Config, front: Front, ssl_context: ssl.SSLContext | None, *,
                       yield_at_cap: bool = False) -> HTTPServer:
    """The data-plane server with every client-facing bound of ``[serving]``.

    ``yield_at_cap``: a worker process at its connection cap leaves new connections to its siblings.
    """
    serving = config.serving
    # The admin listener's connections (and its overflow) come out of the same descriptor table.
    admin_fds = config.admin.max_connections + OVERFLOW_CONNECTIONS if config.admin.listen is not None else 0
    # The control pool: its calls in flight, and one kept-alive connection per engine between passes.
    client_cap = serving.max_client_connections or client_connection_budget(
        serving.max_connections + config.engine.control_connections + len(config.engines) + admin_fds)
    return HTTPServer(front.handle, max_header_bytes=serving.max_header_bytes,
                      max_body_bytes=serving.max_body_bytes, idle_timeout_s=serving.idle_timeout_s,
                      header_timeout_s=serving.header_timeout_s, body_timeout_s=serving.body_timeout_s,
                      client_write_timeout_s=serving.client_write_timeout_s,
                      max_client_connections=client_cap, ssl_context=ssl_context, yield_at_cap=yield_at_cap,
                      early_rounds=serving.relay_inline)


def build_admin_server(config: Config, handler: Handler, ssl_context: ssl.SSLContext | None) -> HTTPServer:
    """The ``[admin] listen`` server: the control app behind its own connection cap and head timeout.

    The same HTTP/1.1 server as the traffic port (absolute-form targets, handshake
    deadline, slow-client bounds), so a flood there holds at most
    ``admin.max_connections`` (+16 for /health) descriptors of the controller.
    """
    serving, admin = config.serving, config.admin
    return HTTPServer(handler, max_header_bytes=serving.max_header_bytes,
                      max_body_bytes=min(serving.max_body_bytes, _ADMIN_MAX_BODY_BYTES),
                      idle_timeout_s=serving.idle_timeout_s, header_timeout_s=admin.header_timeout_s,
                      body_timeout_s=serving.body_timeout_s, client_write_timeout_s=serving.client_write_timeout_s,
                      max_client_connections=admin.max_connections, ssl_context=ssl_context)
