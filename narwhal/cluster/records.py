"""What routers of one cluster tell each other: the etcd values, the link's messages, the admin view.

The controller writes one ``FleetEntry`` per engine under ``<key>/fleet/<engine>``
(when it changes); each router keeps a ``RouterEntry`` under
``<key>/routers/<router_id>`` on its own etcd lease. Replicas send an
``EvidenceBatch`` to the controller's ``POST /cluster/evidence`` and get an
``EvidenceReply``. Every struct decodes values written by a newer version
(unknown fields are ignored; new fields have defaults).
"""

from __future__ import annotations

import msgspec

from narwhal.fleet.model import EngineRecord
from narwhal.fleet.registry import EngineEntry
from narwhal.kv_events.feed import FeedSource

__all__ = ["FLEET_SCHEMA", "ClusterRouter", "ClusterView", "ControllerRef", "EvidenceBatch", "EvidenceItem",
           "EvidenceReply", "FleetEntry", "PlacedPrompt", "RouterEntry", "decisions_of", "with_decisions"]

# The version of ``FleetEntry``; a replica reading a higher one still applies the fields it knows.
FLEET_SCHEMA = 1


class FleetEntry(msgspec.Struct, frozen=True, kw_only=True):
    """``<key>/fleet/<engine>``: one engine as the controller decided it (what it is, and its state)."""

    schema: int = FLEET_SCHEMA
    entry: EngineEntry
    # The controller's decisions about it (``decisions_of`` its record): ejection and holds (drain,
    # maintenance, quarantine, ...), in the handoff's format; eligibility follows from them.
    record: EngineRecord
    # Whether the engine takes new requests at the controller, when it wrote this (informational).
    eligible: bool = False
    # Its KV event publisher as the controller resolved it (configured, registered or from its identity).
    kv_source: FeedSource | None = None
    # The engine process the controller last attested (its identity's process_started_at): another one
    # means empty caches, and every router forgets what it placed there.
    process_started_at: float | None = None
    # The term that wrote it.
    controller: str = ""
    epoch: int = 0
    written_at: float = 0.0


def decisions_of(record: EngineRecord) -> EngineRecord:
    """What the controller publishes of an engine's record: its decisions (ejection, holds), not its evidence.

    Streaks, liveness misses and counters change with every failure the controller counts; published, they
    would be a write (and a watch event on every router) per failed request. They stay the controller's (its
    handoff keeps them) and may be lost with it.
    """
    return EngineRecord(name=record.name, role=record.role, model=record.model, ejected=record.ejected,
                        ejected_reason=record.ejected_reason, ejected_cause=record.ejected_cause,
                        ejected_at_wall=record.ejected_at_wall, holds=record.holds)


def with_decisions(current: EngineRecord, published: EngineRecord) -> EngineRecord:
    """``current`` (this router's record of the engine) with the controller's decisions in place of its own."""
    return msgspec.structs.replace(current, ejected=published.ejected, ejected_reason=published.ejected_reason,
                                   ejected_cause=published.ejected_cause, ejected_at_wall=published.ejected_at_wall,
                                   holds=published.holds)


class RouterEntry(msgspec.Struct, frozen=True, kw_only=True):
    """``<key>/routers/<router_id>``: one router of the cluster, on its own etcd lease."""

    router_id: str
    role: str
    advertise_url: str
    cluster_url: str
    fleet_revision: int = 0
    view_at: float = 0.0
    started_at: float = 0.0


class ClusterRouter(msgspec.Struct, frozen=True, kw_only=True):
    """One row of ``GET /admin/cluster``."""

    router_id: str
    role: str
    advertise_url: str
    fleet_revision: int
    lag_s: float
    cluster_url: str = ""
    is_self: bool = False


class ClusterView(msgspec.Struct, frozen=True, kw_only=True):
    """``GET /admin/cluster``: every router of the cluster, its role, the fleet revision it applied and its lag."""

    mode: str
    router_id: str
    role: str
    controller: str | None
    fleet_revision: int
    view_age_s: float | None
    stale: bool
    routers: list[ClusterRouter]


class ControllerRef(msgspec.Struct, frozen=True, kw_only=True):
    """Who decides, as a replica names it in a 409."""

    router_id: str
    cluster_url: str


class EvidenceItem(msgspec.Struct, frozen=True, array_like=True):
    """One engine outcome the fleet rules count: a failure class or a success kind (as a worker's ``Evidence``)."""

    engine: str
    failure_class: str | None = None
    success_kind: str | None = None


class PlacedPrompt(msgspec.Struct, frozen=True, array_like=True):
    """A prompt placed on an engine (its chained block hashes), for the other routers' prefix indexes."""

    engine: str
    blocks: list[int]


class EvidenceBatch(msgspec.Struct, frozen=True, kw_only=True):
    """``POST /cluster/evidence``: what a replica saw since its last batch."""

    router_id: str
    evidence: list[EvidenceItem] = []
    placements: list[PlacedPrompt] = []
    # The relay position the replica has: the reply carries other routers' placements after it.
    cursor: int = 0


class EvidenceReply(msgspec.Struct, frozen=True, kw_only=True):
    """The controller's answer: how much it applied, and what other routers placed since ``cursor``."""

    controller: str
    applied: int = 0
    placements: list[PlacedPrompt] = []
    cursor: int = 0
