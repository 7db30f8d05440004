"""The request path's placement: config to ``Placer``, a request to its prefix key, choices counted.

The policy itself is pure (``narwhal.fleet.cache_aware``); this module builds
it from ``[placement]``, keys each request (``narwhal.fleet.prefix_key``),
counts every choice in ``narwhal_placement_total{role,reason}`` and the
matched-fraction histogram, and records the prompt on the chosen prefill
engine at once, before any await, so the next placement already sees it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from narwhal.config import Config
from narwhal.fleet.cache_aware import Choice, Placer
from narwhal.fleet.placement import InFlight
from narwhal.fleet.prefix_index import PrefixIndex
from narwhal.fleet.prefix_key import prompt_blocks
from narwhal.obs.router_metrics import RouterMetrics

__all__ = ["RequestPlacement", "build_index", "build_placer"]

_CHAT = "/v1/chat/completions"


def build_index(config: Config) -> PrefixIndex:
    """An empty prefix index over the config's prefill engines, bounded by ``placement.max_index_mb``."""
    return PrefixIndex([spec.name for spec in config.engines if spec.role == "prefill"],
                       max_bytes=int(config.placement.max_index_mb * 1024 * 1024))


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
        self._block_tokens = config.placement.block_tokens

    def choose(self, role: str, candidates: Sequence[str], route: str, request: dict[str, Any],
               in_flight: InFlight) -> Choice | None:
        """The engine for ``role`` among ``candidates`` (already filtered by the fleet rules), or None."""
        placer = self.placer
        load = in_flight.load
        if role == "prefill":
            blocks = prompt_blocks(request, chat=route == _CHAT, block_tokens=self._block_tokens) \
                if placer.cache_aware else []
            choice = placer.prefill(candidates, blocks, load)
            if choice is not None:
                placer.record(choice.engine, blocks)
                if choice.matched is not None:
                    self.metrics.placement_match.observe(choice.matched)
        else:
            choice = placer.decode(candidates, load)
        if choice is not None:
            self.metrics.placements.inc(role, choice.reason)
        return choice
