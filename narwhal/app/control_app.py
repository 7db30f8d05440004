"""The control app (quart-trio): every route except the two completion routes.

``/health`` (process alive), ``/ready`` (the load balancer's question: should
traffic come here? ``?model=NAME``: for that model), ``/metrics`` (Prometheus
text), ``/v1/models`` (and ``/v1/models/{id}``) and the admin API under
``/admin/``, which needs a bearer token when one is configured; without one,
requests a browser marks as from another site or sent to a foreign ``Host``
are refused (``narwhal.app.admin_guard``). On a replica (``[lease] mode =
"replicas"``) every admin mutation is a 409 ``not_controller`` naming the
controller that decides it.
The app holds no state of its own: it reads the router's through ``AppState``
(``narwhal.app.state``), never the ``Router`` itself.
"""

from __future__ import annotations

import hmac
from typing import Any

import msgspec
from quart import Response, request
from quart_trio import QuartTrio

from narwhal.app.admin_guard import admin_refusal, is_admin_api_path
from narwhal.app.query import unexpected_parameter
from narwhal.app.state import AppState
from narwhal.cluster.records import ControllerRef
from narwhal.wire import error_json

__all__ = ["create_app", "not_controller"]

_encode_json = msgspec.json.Encoder()
# The methods of an admin mutation: on a replica these go to the controller (409 not_controller).
_MUTATIONS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def _json(payload: Any, status: int = 200) -> Response:
    return Response(_encode_json.encode(payload), status=status, content_type="application/json")


def _error(status: int, message: str, type_: str, code: str | None = None) -> Response:
    return Response(error_json(message, type_, code), status=status, content_type="application/json")


def not_controller(controller: ControllerRef) -> Response:
    """The 409 of an admin mutation on a replica: the controller decides it; ``narwhal admin`` follows the answer."""
    who = controller.router_id or "(not registered yet)"
    where = controller.cluster_url or "(unknown)"
    error = msgspec.json.decode(error_json(
        f"this router is a replica: drains and reloads are decided by the controller {who} at {where}; "
        "send it there (narwhal admin follows this answer)", "invalid_request_error", "not_controller"))
    return _json({**error, "controller": controller}, status=409)


def create_app(router: AppState) -> QuartTrio:
    """Build the control app over ``router``'s live state."""
    app = QuartTrio("narwhal")
    # Quart cuts streamed responses at RESPONSE_TIMEOUT (60 s) silently; nothing here may be cut.
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = None
    app.config["MAX_CONTENT_LENGTH"] = router.config.serving.max_body_bytes

    @app.before_request
    async def _admin_auth() -> Response | None:
        # Read on every request: a config reload may set, change or remove the token.
        configured = router.config.admin.token
        if configured is None:
            if not is_admin_api_path(request.path):
                return None
            headers = request.headers
            refusal = admin_refusal(method=request.method, path=request.path, scheme=request.scheme,
                                    hosts=headers.getlist("host"), origins=headers.getlist("origin"),
                                    fetch_sites=headers.getlist("sec-fetch-site"),
                                    allowed_hosts=router.config.admin.allowed_hosts)
            if refusal is None:
                return None
            return _error(403, f"admin API (no [admin] token) refused this request: {refusal}",
                          "permission_error", "admin_request_refused")
        if not request.path.startswith("/admin/"):
            return None
        if request.path == "/admin/ui" and request.method in ("GET", "HEAD"):
            # The page's HTML holds no state; every request it makes for data carries the token.
            return None
        token = configured.encode()
        given = request.headers.get("authorization", "")
        scheme, _, value = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), token):
            response = _error(401, "admin API needs a valid bearer token", "authentication_error",
                              "unauthorized")
            response.headers["www-authenticate"] = 'Bearer realm="narwhal-admin"'
            return response
        return None

    @app.before_request
    async def _admin_query() -> Response | None:
        # After the auth check: a parameter an admin route does not take is a 400 naming it.
        rule = request.url_rule
        if rule is None or not is_admin_api_path(rule.rule) or not request.args:
            return None
        problem = unexpected_parameter(rule.rule, request.args.keys())
        if problem is None:
            return None
        return _error(400, str(problem), "invalid_request_error", problem.code)

    @app.before_request
    async def _admin_on_replica() -> Response | None:
        # After the auth check: only a caller allowed to mutate learns where the controller is.
        if request.method not in _MUTATIONS or not is_admin_api_path(request.path):
            return None
        controller = router.controller_redirect()
        return None if controller is None else not_controller(controller)

    @app.get("/health")
    async def health() -> Response:
        return _json({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        # ?model=NAME: that model alone (for load balancers that route by model).
        answer = router.model_view.ready(request.args.get("model"))
        return Response(answer.body, status=answer.status, content_type=answer.content_type)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), status=200,
                        content_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> Response:
        return _json(router.model_view.models())

    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        card = router.model_view.model(model_id)
        if card is None:
            return _error(404, f"The model {model_id[:200]!r} does not exist", "invalid_request_error",
                          "model_not_found")
        return _json(card)

    @app.get("/admin/models")
    async def admin_models() -> Response:
        return _json(router.model_view.admin())

    @app.get("/admin/engines")
    async def admin_engines() -> Response:
        return _json(router.engine_view.engines())

    @app.get("/admin/lease")
    async def admin_lease() -> Response:
        return _json(router.lease_view())

    @app.get("/admin/placement")
    async def admin_placement() -> Response:
        return _json(router.placement_view())

    @app.get("/admin/discovery")
    async def admin_discovery() -> Response:
        return _json(router.discovery_view())

    @app.get("/admin/telemetry")
    async def admin_telemetry() -> Response:
        return _json(router.telemetry.as_json())

    @app.errorhandler(404)
    async def not_found(_: Exception) -> Response:
        return _error(404, f"no route for {request.method} {request.path}", "invalid_request_error",
                      "not_found")

    @app.errorhandler(405)
    async def not_allowed(_: Exception) -> Response:
        return _error(405, f"{request.method} is not allowed on {request.path}", "invalid_request_error",
                      "method_not_allowed")

    @app.errorhandler(413)
    async def too_large(_: Exception) -> Response:
        return _error(413, f"request body larger than {app.config['MAX_CONTENT_LENGTH']} bytes",
                      "invalid_request_error", "body_too_large")

    return app
