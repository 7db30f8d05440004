"""The mock engine's prefix cache: an LRU of prompt blocks, as vLLM's automatic prefix caching keeps.

A prompt is split into whole blocks of ``block_tokens`` token ids; block ``i``
is keyed by blocks ``0..i`` (chained), so a hit is always a prefix. A lookup
finds the longest cached prefix and then inserts the prompt's blocks, deepest
first, so the prefixes outlive their tails under eviction. Counters follow
vLLM's prefix-cache metrics: queried and hit tokens (here ``prompt_tokens`` and
``cached_tokens``), plus requests that hit at all.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

__all__ = ["PrefixCache"]


class PrefixCache:
    """An LRU of at most ``capacity_blocks`` prompt blocks."""

    def __init__(self, capacity_blocks: int, block_tokens: int = 16) -> None:
        self.capacity_blocks = capacity_blocks
        self.block_tokens = block_tokens
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.reset_counters()

    def reset_counters(self) -> None:
        """Zero the counters; what the cache holds stays."""
        self.queries = 0
        self.hits = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def prefill(self, tokens: Sequence[int]) -> int:
        """Run a prompt through the cache: returns its cached tokens; its blocks are cached after."""
        size = self.block_tokens
        keys: list[int] = []
        previous = 0
        for start in range(0, len(tokens) - size + 1, size):
            previous = hash((previous, tuple(tokens[start:start + size])))
            keys.append(previous)
        blocks = self._blocks
        matched = 0
        for key in keys:
            if key not in blocks:
                break
            matched += 1
        # At least one token is always computed, as in vLLM (the last token's logits are needed).
        cached = min(matched * size, max(0, len(tokens) - 1))
        self.queries += 1
        self.prompt_tokens += len(tokens)
        self.cached_tokens += cached
        self.hits += cached > 0
        for key in reversed(keys):
            if key in blocks:
                blocks.move_to_end(key)
            else:
                blocks[key] = None
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)
        return cached

    def describe(self) -> dict[str, Any]:
        """The counters and occupancy, for ``GET /mock/stats``."""
        return {"queries": self.queries, "hits": self.hits, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens,
                "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None,
                "blocks": len(self._blocks), "capacity_blocks": self.capacity_blocks,
                "block_tokens": self.block_tokens}
