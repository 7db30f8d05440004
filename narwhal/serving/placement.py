"""The request path's placement: config to ``Placer``, a request to its prefix key, choices counted.

The policy itself is pure (``narwhal.fleet.placement``); this module builds
it from ``[placement]``, keys each request (``prompt_blocks``),
counts every choice in ``narwhal_placement_total{role,reason,model}`` and the
matched-fraction histogram, and records the prompt on the chosen prefill
engine at once, before any await, so the next placement already sees it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from narwhal.config import Config, PlacementConfig, RunningConfig
from narwhal.fleet.placement import Choice, InFlight, Placer, PrefixIndex, prompt_blocks
from narwhal.obs.router_metrics import RouterMetrics

__all__ = ["FollowedIndex", "RequestPlacement", "build_index", "build_placer", "reconfigure_index"]

_CHAT = "/v1/chat/completions"


def _index_bytes(placement: PlacementConfig) -> int:
    return int(placement.max_index_mb * 1024 * 1024)


def build_index(config: Config) -> PrefixIndex:
    """An empty prefix index over the config's prefill engines, bounded by ``placement.max_index_mb``."""
    return PrefixIndex([spec.name for spec in config.engines if spec.role == "prefill"],
                       max_bytes=_index_bytes(config.placement))


def reconfigure_index(index: PrefixIndex, old: PlacementConfig, new: PlacementConfig) -> None:
    """A reload changed ``[placement]``: the index takes the new memory bound, and is emptied on a new block size.

    Blocks hashed at another size never match a prompt again; they would only take room.
    """
    if new.block_tokens != old.block_tokens:
        for engine in index.engines:
            index.forget(engine)
    if new.max_index_mb != old.max_index_mb:
        index.set_max_bytes(_index_bytes(new))


class FollowedIndex:
    """A prefix index that follows ``[placement]`` across reloads (the controller's copy of the workers')."""

    def __init__(self, index: PrefixIndex, placement: PlacementConfig) -> None:
        self._index = index
        self._placement = placement

    def configure(self, running: RunningConfig) -> None:
        placement = running.config.placement
        reconfigure_index(self._index, self._placement, placement)
        self._placement = placement


def build_placer(config: Config, index: PrefixIndex | None = None, *, rng: random.Random | None = None,
                 on_record: Callable[[str, Sequence[int], float], None] | None = None) -> Placer:
    """The ``[placement]`` policy over ``index`` (a new one when None).

    Placements are timed on CLOCK_MONOTONIC, which every process on the host shares, so worker
    processes agree on which engine had a prompt last.
    """
    placement = config.placement
    return Placer(build_index(config) if index is None else index,
                  cache_aware=placement.policy == "cache_aware", balance_abs=placement.balance_abs,
                  balance_rel=placement.balance_rel, rng=rng, on_record=on_record, clock=time.monotonic)


class RequestPlacement:
    """Chooses the engines of one attempt and counts the choice."""

    def __init__(self, config: Config, metrics: RouterMetrics, placer: Placer | None = None,
                 rng: random.Random | None = None) -> None:
        self.placer = placer or build_placer(config, rng=rng)
        self.metrics = metrics
        self.config = config.placement
        self._block_tokens = config.placement.block_tokens

    def configure(self, placement: PlacementConfig) -> None:
        """A config reload changed ``[placement]``: the next choice follows it (in each process, by its snapshot)."""
        if placement == self.config:
            return
        placer = self.placer
        reconfigure_index(placer.index, self.config, placement)
        placer.cache_aware = placement.policy == "cache_aware"
        placer.balance_abs = placement.balance_abs
        placer.balance_rel = placement.balance_rel
        self._block_tokens = placement.block_tokens
        self.config = placement

    def choose(self, role: str, candidates: Sequence[str], route: str, request: dict[str, Any],
               in_flight: InFlight, model: str = "") -> Choice | None:
        """The engine for ``role`` among ``candidates`` (already filtered by the fleet rules, all of ``model``,
        the label its choice is counted under), or None."""
        placer = self.placer
        load = in_flight.loader()
        if role == "prefill":
            blocks = prompt_blocks(request, chat=route == _CHAT, block_tokens=self._block_tokens) \
                if placer.cache_aware else []
            choice = placer.prefill(candidates, blocks, load)
            if choice is not None:
                placer.record(choice.engine, blocks)
                if choice.matched is not None:
                    self.metrics.placement_match.observe(choice.matched, model)
        else:
            # Without other workers' loads, in_flight.busy is exactly the engines with load > 0.
            choice = placer.decode(candidates, load, None if in_flight.elsewhere else in_flight.busy)
        if choice is not None:
            self.metrics.placements.inc(role, choice.reason, model)
        return choice
