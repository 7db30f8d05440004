"""The operator's per-engine routes under ``/admin/``: inspect, drain, maintain, readmit.

    GET  /admin/engines/{name}              the engine's state (as in /admin/engines)
    POST /admin/engines/{name}/drain        stop new placements; in-flight requests finish
    POST /admin/engines/{name}/maintenance  drain and record the maintenance start
    POST /admin/engines/{name}/readmit      run the readmission chain now: 200, or 409
                                            naming the check that failed and why
    POST /admin/reload                      what SIGHUP does: 200 with what changed, or 422
                                            naming the file, key and problem (nothing changed)

Unknown engines get 404 with an OpenAI-style JSON error. The bearer-token check
for every ``/admin/`` path is the app's (``narwhal.app.control_app``), not repeated here.
"""

from __future__ import annotations

from typing import Any

import msgspec
from quart import Response
from quart_trio import QuartTrio

from narwhal.app.state import AppState
from narwhal.wire import error_json

__all__ = ["register_admin_routes"]

_encode_json = msgspec.json.Encoder()


def _json(payload: Any, status: int = 200) -> Response:
    return Response(_encode_json.encode(payload), status=status, content_type="application/json")


def _unknown(name: str) -> Response:
    return Response(error_json(f"no engine named {name!r}", "invalid_request_error", "engine_not_found"),
                    status=404, content_type="application/json")


def register_admin_routes(app: QuartTrio, router: AppState) -> None:
    """Add the per-engine admin routes to ``app`` over ``router``'s readmitter and engine view."""
    readmitter = router.readmitter
    engine_view = router.engine_view.engine

    @app.post("/admin/reload")
    async def admin_reload() -> Response:
        outcome = await router.reload()
        if outcome.reloaded:
            return _json(outcome)
        assert outcome.error is not None
        where = f"{outcome.error.key}: " if outcome.error.key else ""
        message = f"config not reloaded, nothing changed: {outcome.error.file}: {where}{outcome.error.problem}"
        error = msgspec.json.decode(error_json(message, "invalid_request_error", "config_reload_failed"))
        return _json({**error, "reload": outcome}, status=422)

    @app.get("/admin/engines/<name>")
    async def admin_engine(name: str) -> Response:
        if not readmitter.knows(name):
            return _unknown(name)
        return _json({"engine": engine_view(name)})

    @app.post("/admin/engines/<name>/drain")
    async def admin_drain(name: str) -> Response:
        if not readmitter.knows(name):
            return _unknown(name)
        readmitter.drain(name, readmitter.clock())
        return _json({"action": "drain", "engine": engine_view(name)})

    @app.post("/admin/engines/<name>/maintenance")
    async def admin_maintenance(name: str) -> Response:
        if not readmitter.knows(name):
            return _unknown(name)
        started_at = readmitter.maintenance(name, readmitter.clock())
        return _json({"action": "maintenance", "maintenance_started_at": started_at,
                      "engine": engine_view(name)})

    @app.post("/admin/engines/<name>/readmit")
    async def admin_readmit(name: str) -> Response:
        if not readmitter.knows(name):
            return _unknown(name)
        result = await readmitter.readmit(name, operator=True)
        body: dict[str, Any] = {"action": "readmit", "readmission": result, "engine": engine_view(name)}
        if result.readmitted:
            return _json(body)
        message = f"readmission of {name} refused by check {result.check}: {result.reason}"
        error = msgspec.json.decode(error_json(message, "conflict_error", "readmission_refused"))
        return _json({**error, **body}, status=409)
