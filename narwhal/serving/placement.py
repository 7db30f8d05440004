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

import trio

from narwhal.config import Config, PlacementConfig, RunningConfig
from narwhal.fleet.placement import Choice, InFlight, Placer, PrefixIndex, Scores, prompt_blocks
from narwhal.kv_events.service import KvEvents
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
                 rng: random.Random | None = None, kv: KvEvents | None = None,
                 clock: Callable[[], float] = trio.current_time) -> None:
        self.placer = placer or build_placer(config, rng=rng)
        self.metrics = metrics
        self.config = config.placement
        self._block_tokens = config.placement.block_tokens
        # The engines' own KV events (None: this process subscribes to none); their index is timed on the
        # clock the feeds run on.
        self.kv = kv
        self._clock = clock
        # kv_events = "required": only engines with a live feed prefill (read on every request).
        self.required = kv is not None and config.placement.kv_events == "required"

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
        if self.kv is not None:
            self.kv.configure(placement)
        self.required = self.kv is not None and placement.kv_events == "required"

    def prefill_candidates(self, candidates: list[str]) -> list[str]:
        """``kv_events = "required"``: only the engines with a live feed may prefill."""
        kv = self.kv
        if kv is None or not self.required:
            return candidates
        return [name for name in candidates if kv.live(name)]

    def wants_tokens(self, candidates: Sequence[str]) -> bool:
        """Whether the prompt's token IDs would change the prefill choice among ``candidates``."""
        return self.kv is not None and self.placer.cache_aware and self.kv.wanted(candidates)

    def _scores(self, candidates: Sequence[str], blocks: Sequence[int], tokens: Sequence[int]) -> Scores | None:
        """Each candidate's match in tokens: from its feed when live, else the index's share of the prompt."""
        kv = self.kv
        if kv is None or not tokens:
            return None
        live = list(map(kv.live, candidates))
        if not any(live):
            return None
        total = len(tokens)
        held = kv.index.match_each(candidates, tokens, self._clock())
        if all(live):
            return Scores(held, total, [kv.index.blocks(name) for name in candidates])
        index = self.placer.index
        guessed = index.match_each(candidates, blocks)
        n = len(blocks)
        matches = [h if is_live else (g * total // n if n else 0)
                   for h, g, is_live in zip(held, guessed, live, strict=True)]
        sizes = [kv.index.blocks(name) if is_live else index.entries(name)
                 for name, is_live in zip(candidates, live, strict=True)]
        return Scores(matches, total, sizes)

    def choose(self, role: str, candidates: Sequence[str], route: str, request: dict[str, Any],
               in_flight: InFlight, model: str = "", tokens: Sequence[int] | None = None) -> Choice | None:
        """The engine for ``role`` among ``candidates`` (already filtered by the fleet rules, all of ``model``,
        the label its choice is counted under), or None. ``tokens``: the prompt's token IDs, for the feeds."""
        placer = self.placer
        load = in_flight.loader()
        # Without other workers' loads, in_flight.busy is exactly the engines with load > 0.
        busy = None if in_flight.elsewhere else in_flight.busy
        if role == "prefill":
            blocks = prompt_blocks(request, chat=route == _CHAT, block_tokens=self._block_tokens) \
                if placer.cache_aware else []
            scores = self._scores(candidates, blocks, tokens) if tokens is not None and placer.cache_aware else None
            choice = placer.prefill(candidates, blocks, load, scores, busy)
            if choice is not None:
                placer.record(choice.engine, blocks)
                if tokens and self.kv is not None and self.kv.live(choice.engine):
                    self.kv.index.note_placed(choice.engine, tokens, self._clock())
                if choice.matched is not None:
                    self.metrics.placement_match.observe(choice.matched, model)
        else:
            choice = placer.decode(candidates, load, busy)
        if choice is not None:
            self.metrics.placements.inc(role, choice.reason, model)
        return choice
