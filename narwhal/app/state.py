"""What the control app reads and asks of the router: one small Protocol, so the app never sees ``Router``.

``narwhal.router.Router`` provides it; a test can pass any object that does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from narwhal.cluster.records import ClusterView, ControllerRef
from narwhal.config import Config
from narwhal.control.discovery import DiscoveryView
from narwhal.control.engine_view import EngineEntry, EnginesView
from narwhal.control.model_view import ModelCard, ModelList, ModelsView
from narwhal.control.placement_view import PlacementView
from narwhal.control.readmission import ReadmissionResult
from narwhal.control.reload import ReloadOutcome
from narwhal.lease.service import LeaseView
from narwhal.model_ready import ReadyAnswer

__all__ = ["AppState", "EngineViews", "ModelViews", "OperatorActions"]


class EngineViews(Protocol):
    """``/admin/engines`` and ``/admin/engines/{name}`` (``narwhal.control.engine_view.EngineViewer``)."""

    def engines(self) -> EnginesView: ...
    def engine(self, name: str) -> EngineEntry: ...


class ModelViews(Protocol):
    """``/v1/models``, ``/v1/models/{id}``, ``/ready`` and ``/admin/models`` (``narwhal.control.model_view``)."""

    def models(self) -> ModelList: ...
    def model(self, name: str) -> ModelCard | None: ...
    def ready(self, model: str | None) -> ReadyAnswer: ...
    def admin(self) -> ModelsView: ...


class OperatorActions(Protocol):
    """The admin routes' actions (``narwhal.control.readmission.Readmitter``)."""

    @property
    def clock(self) -> Callable[[], float]: ...
    def knows(self, name: str) -> bool: ...
    def drain(self, name: str, now: float) -> None: ...
    def maintenance(self, name: str, now: float) -> float: ...
    async def readmit(self, name: str, *, operator: bool) -> ReadmissionResult: ...


class _Metrics(Protocol):
    def render(self, prefix: str = "") -> str: ...


class _Telemetry(Protocol):
    def as_json(self) -> dict[str, Any]: ...


class AppState(Protocol):
    """Everything the control app and the admin routes use."""

    @property
    def config(self) -> Config: ...
    @property
    def metrics(self) -> _Metrics: ...
    @property
    def telemetry(self) -> _Telemetry: ...
    @property
    def engine_view(self) -> EngineViews: ...
    @property
    def readmitter(self) -> OperatorActions: ...
    @property
    def model_view(self) -> ModelViews: ...

    def readiness(self) -> str | None:
        """None when this router should get traffic, else the one-line reason."""
        ...

    async def reload(self) -> ReloadOutcome:
        """``POST /admin/reload``: what SIGHUP does (the config file again, then TLS)."""
        ...

    def lease_view(self) -> LeaseView:
        """``/admin/lease``: the lease record and this router's role."""
        ...

    def discovery_view(self) -> DiscoveryView:
        """``/admin/discovery``: the backend, the watch's state and the discovered engines."""
        ...

    def placement_view(self) -> PlacementView:
        """``/admin/placement``: each prefill engine's prefix index and KV event feed."""
        ...

    async def cluster_view(self) -> ClusterView:
        """``/admin/cluster``: the routers, their roles, the fleet revision each applied and its lag."""
        ...

    def controller_redirect(self) -> ControllerRef | None:
        """None when this router may act on an admin mutation; else the controller that decides it."""
        ...

    def cluster_evidence(self, body: bytes, *, authorization: str | None, peer_cert: bool,
                         peer: str = "") -> tuple[int, bytes]:
        """``POST /cluster/evidence``: a replica's report, authenticated and applied; (status, JSON body)."""
        ...
