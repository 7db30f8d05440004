"""The cluster's routes: the routers' view for the operator, and the replicas' link to the controller.

    GET  /admin/cluster      the routers, their role, the fleet revision each applied and its lag
    GET  /admin/tenants      each client key's requests, tokens and refusals (the top 20)
    POST /cluster/evidence   a replica's failure evidence (and placement records) for the controller

``/cluster/evidence`` is not under ``/admin/``: its peers are routers, authenticated
by the router (``cluster_evidence``: mutual TLS or ``[lease] cluster_token_file``),
not by the admin token. With ``[admin] listen`` both are served only there.
"""

from __future__ import annotations

from typing import Any

import msgspec
from quart import Response, request
from quart_trio import QuartTrio

from narwhal.app.state import AppState
from narwhal.app.tenants_view import tenants_view
from narwhal.http1.asgi import PEER_CERT_EXTENSION

__all__ = ["register_cluster_routes"]

_encode_json = msgspec.json.Encoder()


def _peer_cert(scope: Any) -> bool:
    """Whether the TLS peer presented a certificate the listener verified (``call_asgi`` says so in the scope)."""
    extensions = scope.get("extensions") or {}
    return extensions.get(PEER_CERT_EXTENSION) is True


def register_cluster_routes(app: QuartTrio, router: AppState) -> None:
    """Add ``/admin/cluster`` and ``/cluster/evidence`` to ``app`` over ``router``."""

    @app.get("/admin/cluster")
    async def admin_cluster() -> Response:
        return Response(_encode_json.encode(await router.cluster_view()), status=200, content_type="application/json")

    @app.get("/admin/tenants")
    async def admin_tenants() -> Response:
        # Only the tenant families: the whole exposition grows with the fleet (~100 KiB at 256 engines).
        view = tenants_view(router.metrics.render("narwhal_tenant_"), auth=router.config.auth.keys_file is not None)
        return Response(_encode_json.encode(view), status=200, content_type="application/json")

    @app.post("/cluster/evidence")
    async def cluster_evidence() -> Response:
        body = await request.get_data(False, False, False)
        status, answer = router.cluster_evidence(body, authorization=request.headers.get("authorization"),
                                                 peer_cert=_peer_cert(request.scope), peer=request.remote_addr or "")
        return Response(answer, status=status, content_type="application/json")
