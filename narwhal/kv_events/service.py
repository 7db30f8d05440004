"""One process's view of what the prefill engines' KV caches hold: the feeds, the index they fill, and its rules.

The process that places requests subscribes (the router in one process, each
worker and the controller with workers), as every router of a fleet does:
the engines' feeds are the one source all of them read alike. ``[placement]
kv_events``: ``off`` subscribes to nothing; ``auto`` scores an engine with a
live feed from it; ``required`` also keeps an engine without one out of prefill.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import trio

from narwhal.config import PlacementConfig
from narwhal.kv_events.feed import FeedSource, FeedStats, KvFeeds
from narwhal.kv_events.index import KvIndex

__all__ = ["KvEvents"]


def _index_bytes(placement: PlacementConfig) -> int:
    return int(placement.max_index_mb * 1024 * 1024)


class KvEvents:
    """The feeds of one process and the block index they write; placement asks it what each engine holds."""

    def __init__(self, placement: PlacementConfig, engines: Iterable[str], *, feeds: KvFeeds | None = None) -> None:
        self.mode = placement.kv_events
        self.engines = list(dict.fromkeys(engines))
        self.index = KvIndex(self.engines, max_bytes=_index_bytes(placement))
        self.feeds = feeds if feeds is not None else KvFeeds(self.index)
        self._sources: dict[str, FeedSource] = {}
        self._placement = placement
        self.active = False

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Run the feeds until cancelled."""
        await self.feeds.run(task_status=task_status)

    def configure(self, placement: PlacementConfig) -> None:
        """A reload changed ``[placement]``: the mode and the memory bound follow; ``off`` stops every feed."""
        if placement == self._placement:
            return
        was = self.mode
        self.mode = placement.kv_events
        if placement.max_index_mb != self._placement.max_index_mb:
            self.index.set_max_bytes(_index_bytes(placement))
        self._placement = placement
        if (was == "off") != (self.mode == "off"):
            self._apply_sources()

    def set_engines(self, engines: Iterable[str]) -> None:
        """Index exactly these prefill engines (a reload, discovery)."""
        self.engines = list(dict.fromkeys(engines))
        self.index.set_engines(self.engines)

    def set_sources(self, sources: Mapping[str, FeedSource]) -> None:
        """Subscribe to exactly these publishers (start new ones, stop gone ones, restart changed ones)."""
        self._sources = dict(sources)
        self._apply_sources()

    def _apply_sources(self) -> None:
        self.feeds.set_sources({} if self.mode == "off" else self._sources)
        # Whether any feed may be live (a publisher known, mode not off): else a request asks nothing of it
        # (an attribute, read on every request).
        self.active = bool(self._sources) and self.mode != "off"

    @property
    def sources(self) -> Mapping[str, FeedSource]:
        return self._sources

    def new_process(self, engine: str) -> None:
        """A new process of ``engine`` (readmission's identity): its cache is empty, its sequence starts over."""
        if engine in self._sources and self.mode != "off":
            self.feeds.new_process(engine)
        self.index.clear(engine)

    def live(self, engine: str) -> bool:
        """Whether placement may score ``engine`` from its feed (subscribed and in step)."""
        return self.mode != "off" and self.feeds.live(engine)

    def wanted(self, candidates: Sequence[str]) -> bool:
        """Whether a prompt's token IDs would change this choice: some candidate (of several) has a live feed."""
        if not self._sources or len(candidates) < 2 or self.mode == "off":
            return False
        return any(map(self.feeds.live, candidates))

    def stats(self) -> dict[str, FeedStats]:
        """Each engine's feed as ``/admin/placement`` shows it (an engine with no publisher known: ``off``)."""
        stats = self.feeds.stats()
        shown: dict[str, FeedStats] = {}
        for engine in self.engines:
            feed = stats.get(engine)
            if feed is None:
                feed = FeedStats(state="off", last_seq=None)
            feed.blocks = self.index.blocks(engine)
            shown[engine] = feed
        return shown
