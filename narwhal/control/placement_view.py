"""``GET /admin/placement``: per prefill engine, its approximate prefix index and its KV event feed.

Read from this process's index and subscriptions (with workers, the
controller's: it indexes every worker's placements and subscribes to every
feed as each worker does). No I/O.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from narwhal.fleet.placement import PrefixIndex
from narwhal.kv_events.feed import FeedStats
from narwhal.kv_events.service import KvEvents

__all__ = ["IndexView", "PlacementEngine", "PlacementView", "placement_view"]


class IndexView(msgspec.Struct, frozen=True, kw_only=True):
    """The approximate index's share for one engine: block hashes held and bytes by its accounting."""

    entries: int
    bytes: int


class PlacementEngine(msgspec.Struct, kw_only=True):
    model: str
    index: IndexView
    kv_events: FeedStats


class PlacementView(msgspec.Struct, kw_only=True):
    # [placement] policy and kv_events as the router runs them.
    policy: str
    kv_events: str
    engines: dict[str, PlacementEngine]


def placement_view(*, policy: str, index: PrefixIndex, kv: KvEvents, model_of: Callable[[str], str]) -> PlacementView:
    """Every prefill engine the index or the feeds know, under its name."""
    stats = kv.stats()
    names = list(dict.fromkeys([*index.engines, *stats]))
    engines = {}
    for name in names:
        feed = stats.get(name) or FeedStats(state="off", last_seq=None)
        engines[name] = PlacementEngine(model=model_of(name),
                                        index=IndexView(entries=index.entries(name), bytes=index.bytes(name)),
                                        kv_events=feed)
    return PlacementView(policy=policy, kv_events=kv.mode, engines=engines)
