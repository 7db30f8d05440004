"""The cluster's records: what routers write to etcd and what ``/admin/cluster`` answers (msgspec, JSON)."""

from __future__ import annotations

import msgspec

__all__ = ["ClusterRouter", "ClusterView", "ControllerRef", "RouterEntry"]


class RouterEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One router's registration under ``<key>/routers/<router_id>``, bound to its own etcd lease."""

    router_id: str
    role: str               # "controller" | "replica"
    advertise_url: str      # the serving port (http(s)://HOST:PORT)
    cluster_url: str        # where its /cluster/evidence and /admin are: the [admin] listen URL, else advertise_url
    fleet_revision: int     # the fleet revision this router has applied
    view_at: float          # wall clock: when it last knew its view current
    started_at: float       # wall clock


class ClusterRouter(msgspec.Struct, frozen=True, kw_only=True):
    """One row of ``/admin/cluster``."""

    router_id: str
    role: str
    advertise_url: str
    fleet_revision: int
    lag_s: float
    cluster_url: str = ""
    is_self: bool = False


class ClusterView(msgspec.Struct, frozen=True, kw_only=True):
    """The ``GET /admin/cluster`` body."""

    mode: str                 # "standby" | "replicas"
    router_id: str            # this router
    role: str                 # this router's: "controller" | "replica" (standby mode: "controller"/"standby")
    controller: str | None    # the controller's router_id, when known
    fleet_revision: int       # the newest fleet revision this router knows of
    view_age_s: float | None  # replicas: seconds since it last knew its view current; None on the controller
    stale: bool               # past replica_stale_s (then /ready is 503)
    routers: list[ClusterRouter]


class ControllerRef(msgspec.Struct, frozen=True, kw_only=True):
    """Who decides admin mutations when this router may not: the controller (empty strings when unknown)."""

    router_id: str            # "" when unknown (no controller registered)
    cluster_url: str          # its admin/cluster URL ("" when unknown)
