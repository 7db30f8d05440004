"""What each prefill engine recently prefilled, as chained block hashes: an approximate prefix index.

Pure state (no I/O; the caller says when each prompt was placed). Each engine has an LRU of
block hashes with an equal share of the memory bound, so the index as a whole
never holds more than ``max_bytes`` by its accounting (``ENTRY_BYTES`` per
entry, calibrated against tracemalloc in the tests, table growth included).

A prompt's blocks are recorded deepest first, so a block's ancestors are
always used at least as recently as the block itself: eviction takes the tails
of prompts before their prefixes, what an engine holds stays prefix-closed, and
a match is found by binary search.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

__all__ = ["ENTRY_BYTES", "PrefixIndex"]

# Bytes one entry costs: an OrderedDict slot and node, a 64-bit int key and at
# worst its own float time, measured at the worst point of the table's growth
# (~200 bytes), rounded up.
ENTRY_BYTES = 224


class PrefixIndex:
    """Per-engine LRU sets of block hashes under one memory bound."""

    def __init__(self, engines: Iterable[str], *, max_bytes: int) -> None:
        names = list(dict.fromkeys(engines))
        # block hash -> when a prompt through it was last placed (one number shared by a prompt's blocks).
        self._lru: dict[str, OrderedDict[int, float]] = {name: OrderedDict() for name in names}
        self.max_bytes = max_bytes
        # An equal share each: an engine's entries never crowd out another's.
        self.quota = max_bytes // ENTRY_BYTES // max(1, len(names))

    def set_engines(self, engines: Iterable[str]) -> None:
        """Index exactly ``engines`` from now on (a config reload): a new one starts empty, a removed one goes.

        The quota is shared again equally; an engine over its new share loses its least recently used blocks.
        """
        names = list(dict.fromkeys(engines))
        self._lru = {name: self._lru.get(name) or OrderedDict() for name in names}
        self._share()

    def set_max_bytes(self, max_bytes: int) -> None:
        """A new memory bound (a config reload): a smaller one evicts each engine's least recently used blocks."""
        self.max_bytes = max_bytes
        self._share()

    def _share(self) -> None:
        # An equal share of the bound each; an engine over its share loses its least recently used blocks.
        self.quota = self.max_bytes // ENTRY_BYTES // max(1, len(self._lru))
        for lru in self._lru.values():
            for _ in range(len(lru) - self.quota):
                lru.popitem(last=False)

    @property
    def engines(self) -> list[str]:
        return list(self._lru)

    def match(self, engine: str, blocks: Sequence[int]) -> int:
        """How many leading blocks of ``blocks`` the engine holds (0 for an engine not indexed)."""
        lru = self._lru.get(engine)
        if not lru or not blocks:
            return 0
        # Prefix-closed: the first absent block ends the match.
        lo, hi = 0, len(blocks)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if blocks[mid - 1] in lru:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def match_each(self, engines: Sequence[str], blocks: Sequence[int]) -> list[int]:
        """``match`` for each of ``engines``, in order, with one lookup for most engines instead of a search.

        Prefix-closed: an engine without the first block matches nothing, one with the last matches it all.
        """
        n = len(blocks)
        if not n:
            return [0] * len(engines)
        first, last = blocks[0], blocks[-1]
        get = self._lru.get
        found = []
        for engine in engines:
            lru = get(engine)
            if not lru or first not in lru:
                found.append(0)
            elif last in lru:
                found.append(n)
            else:
                found.append(self.match(engine, blocks))
        return found

    def entries_of(self, engines: Sequence[str]) -> list[int]:
        """``entries`` for each of ``engines``, in order."""
        try:
            # In C while every engine is indexed (an engine a reload just added may not be yet).
            return list(map(len, map(self._lru.__getitem__, engines)))
        except KeyError:
            get = self._lru.get
            return [len(lru) if (lru := get(engine)) is not None else 0 for engine in engines]

    def last_used_each(self, engines: Sequence[str], block: int) -> list[float]:
        """``last_used`` for each of ``engines``, in order."""
        get = self._lru.get
        return [lru.get(block, 0.0) if (lru := get(engine)) is not None else 0.0 for engine in engines]

    def last_used(self, engine: str, block: int) -> float:
        """When a prompt through ``block`` was last placed on the engine (the ``at`` of ``record``; 0: never)."""
        lru = self._lru.get(engine)
        return 0.0 if lru is None else lru.get(block, 0.0)

    def record(self, engine: str, blocks: Sequence[int], at: float) -> None:
        """The engine prefilled a prompt with these blocks, placed at ``at``: they become its most recently used.

        ``at`` is on a clock every process shares (a record relayed late never moves a block's time back).
        """
        lru = self._lru.get(engine)
        if lru is None or not blocks or self.quota == 0:
            return
        # Deepest first, and at most a quota's worth (a longer prompt keeps its prefix).
        move = lru.move_to_end
        get = lru.get
        for block in reversed(blocks[:self.quota]):
            seen = get(block)
            if seen is None:
                lru[block] = at
                continue
            move(block)
            if at > seen:
                lru[block] = at
        excess = len(lru) - self.quota
        for _ in range(excess):
            lru.popitem(last=False)

    def forget(self, engine: str) -> None:
        """Drop everything recorded for the engine (it left the fleet, or its cache is empty)."""
        lru = self._lru.get(engine)
        if lru is not None:
            self._lru[engine] = OrderedDict()

    def entries(self, engine: str) -> int:
        """Block hashes held for the engine."""
        lru = self._lru.get(engine)
        return 0 if lru is None else len(lru)

    def bytes(self, engine: str) -> int:
        """The engine's share of the index, in bytes by the index's accounting."""
        return self.entries(engine) * ENTRY_BYTES

    def total_bytes(self) -> int:
        """The whole index, in bytes by its accounting (never more than ``max_bytes``)."""
        return sum(len(lru) for lru in self._lru.values()) * ENTRY_BYTES
