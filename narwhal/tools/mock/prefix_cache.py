"""The mock engine's prefix cache: an LRU of prompt blocks, as vLLM's automatic prefix caching keeps.

A prompt is split into whole blocks of ``block_tokens`` token ids; block ``i``
is keyed by blocks ``0..i`` (chained: sha256 of the parent's key and the
block's tokens, the engine's own hash, not the router's), so a hit is always a
prefix. A lookup finds the longest cached prefix and then inserts the prompt's
blocks, deepest first, so the prefixes outlive their tails under eviction.
Counters follow vLLM's prefix-cache metrics: queried and hit tokens (here
``prompt_tokens`` and ``cached_tokens``), plus requests that hit at all.

A ``CacheListener`` hears what the cache stored and evicted, as vLLM's KV events
report it: the mock's KV event publisher is one.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["CacheListener", "PrefixCache", "block_hash"]

_MASK64 = (1 << 64) - 1


def block_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """A block's 32-byte key: sha256 over its parent's key (none for the first block) and its token ids."""
    # Token ids as unsigned 64-bit: a caller's token-ID prompt may hold any int, and the key must not fail.
    packed = struct.pack(f"<{len(tokens)}Q", *(token & _MASK64 for token in tokens))
    return hashlib.sha256((parent or b"") + packed).digest()


class CacheListener(Protocol):
    """Told, in order, what the cache did: the shape of vLLM's BlockStored, BlockRemoved, AllBlocksCleared."""

    def stored(self, hashes: list[bytes], parent: bytes | None, tokens: list[int], block_size: int) -> None: ...

    def removed(self, hashes: list[bytes]) -> None: ...

    def cleared(self) -> None: ...


class PrefixCache:
    """An LRU of at most ``capacity_blocks`` prompt blocks."""

    def __init__(self, capacity_blocks: int, block_tokens: int = 16, *,
                 listener: CacheListener | None = None) -> None:
        self.capacity_blocks = capacity_blocks
        self.block_tokens = block_tokens
        self.listener = listener
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self.reset_counters()

    def reset_counters(self) -> None:
        """Zero the counters; what the cache holds stays."""
        self.queries = 0
        self.hits = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def keys(self, tokens: Sequence[int]) -> list[bytes]:
        """The chained keys of the prompt's whole blocks."""
        size = self.block_tokens
        keys: list[bytes] = []
        previous: bytes | None = None
        for start in range(0, len(tokens) - size + 1, size):
            previous = block_hash(previous, tokens[start:start + size])
            keys.append(previous)
        return keys

    def prefill(self, tokens: Sequence[int]) -> int:
        """Run a prompt through the cache: returns its cached tokens; its blocks are cached after."""
        size = self.block_tokens
        keys = self.keys(tokens)
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
        # A present block's parent is always present (a parent is touched after its children), so the
        # missing blocks are the run after the matched prefix. A prompt longer than the cache keeps its
        # first blocks only: evicting its own prefix would orphan the tail.
        new = keys[matched:matched + max(0, self.capacity_blocks - matched)]
        # The hit is touched first, so eviction (before the fill, as vLLM frees blocks before it fills them)
        # takes only other prompts' blocks; touched again after, so each parent stays newer than its children.
        for key in reversed(keys[:matched]):
            blocks.move_to_end(key)
        evicted: list[bytes] = []
        while blocks and len(blocks) + len(new) > self.capacity_blocks:
            evicted.append(blocks.popitem(last=False)[0])
        for key in reversed(new):
            blocks[key] = None
        for key in reversed(keys[:matched]):
            blocks.move_to_end(key)
        if self.listener is not None:
            if evicted:
                self.listener.removed(evicted)
            if new:
                self.listener.stored(new, keys[matched - 1] if matched else None,
                                     list(tokens[matched * size:(matched + len(new)) * size]), size)
        return cached

    def clear(self) -> None:
        """Drop every block (vLLM's ``/reset_prefix_cache``); the counters stay."""
        self._blocks.clear()
        if self.listener is not None:
            self.listener.cleared()

    def describe(self) -> dict[str, Any]:
        """The counters and occupancy, for ``GET /mock/stats``."""
        return {"queries": self.queries, "hits": self.hits, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens,
                "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None,
                "blocks": len(self._blocks), "capacity_blocks": self.capacity_blocks,
                "block_tokens": self.block_tokens}
