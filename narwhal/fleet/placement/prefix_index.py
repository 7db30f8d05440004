"""What each prefill engine recently prefilled, as chained block hashes: an approximate prefix index.

Pure state (no I/O; the caller says when each prompt was placed). Each engine has an LRU of
block hashes with an equal share of the memory bound, so the index as a whole
never holds more than ``max_bytes`` by its accounting (``ENTRY_BYTES`` per
entry, calibrated against tracemalloc in the tests, table growth included).

A prompt's blocks are recorded deepest first, so a block's ancestors are
always used at least as recently as the block itself: eviction takes the tails
of prompts before their prefixes, what an engine holds stays prefix-closed, and
a match is found by binary search.

Prefix-closed also means an engine holds some of a prompt only if it holds the
prompt's first block: the index keeps, for each first block, the engines holding
it (``holders``), so placement among hundreds of engines looks at those few. Each
such entry is charged as one more block against its engine's share.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

__all__ = ["ENTRY_BYTES", "PrefixIndex"]

# Bytes one entry costs: an OrderedDict slot and node, a 64-bit int key and at
# worst its own float time, measured at the worst point of the table's growth
# (~200 bytes), rounded up. A first block's holder entry (a dict slot, the
# engine's name or a small tuple: ~100 bytes) is charged as one more entry.
ENTRY_BYTES = 224


class PrefixIndex:
    """Per-engine LRU sets of block hashes under one memory bound."""

    def __init__(self, engines: Iterable[str], *, max_bytes: int) -> None:
        names = list(dict.fromkeys(engines))
        # block hash -> when a prompt through it was last placed (one number shared by a prompt's blocks).
        self._lru: dict[str, OrderedDict[int, float]] = {name: OrderedDict() for name in names}
        # A prompt's first block -> the engines holding it (as a first block): one name, or a tuple of several (one
        # engine is the common case, and a tuple more memory); and how many each engine holds. Keys are chained
        # hashes, so a first block is never another prompt's later block.
        self._holders: dict[int, str | tuple[str, ...]] = {}
        self._firsts: dict[str, int] = dict.fromkeys(names, 0)
        self.max_bytes = max_bytes
        # An equal share each: an engine's entries never crowd out another's.
        self.quota = max_bytes // ENTRY_BYTES // max(1, len(names))

    def set_engines(self, engines: Iterable[str]) -> None:
        """Index exactly ``engines`` from now on (a config reload): a new one starts empty, a removed one goes.

        The quota is shared again equally; an engine over its new share loses its least recently used blocks.
        """
        names = list(dict.fromkeys(engines))
        for name in [name for name in self._lru if name not in names]:
            self.forget(name)
        self._lru = {name: self._lru.get(name) or OrderedDict() for name in names}
        self._firsts = {name: self._firsts.get(name, 0) for name in names}
        self._share()

    def set_max_bytes(self, max_bytes: int) -> None:
        """A new memory bound (a config reload): a smaller one evicts each engine's least recently used blocks."""
        self.max_bytes = max_bytes
        self._share()

    def _share(self) -> None:
        # An equal share of the bound each; an engine over its share loses its least recently used blocks.
        self.quota = self.max_bytes // ENTRY_BYTES // max(1, len(self._lru))
        for engine, lru in self._lru.items():
            self._trim(engine, lru)

    def _trim(self, engine: str, lru: OrderedDict[int, float]) -> None:
        """Evict the engine's least recently used blocks until it is within its share (first blocks count twice)."""
        firsts = self._firsts[engine]
        quota = self.quota
        while len(lru) + firsts > quota:
            block, _ = lru.popitem(last=False)
            if self._drop_holder(block, engine):
                firsts -= 1
        self._firsts[engine] = firsts

    def _drop_holder(self, block: int, engine: str) -> bool:
        """``engine`` no longer holds ``block``: out of its holders if it was one (then True)."""
        held = self._holders.get(block)
        if held is None:
            return False
        if isinstance(held, str):
            if held != engine:
                return False
            del self._holders[block]
            return True
        if engine not in held:
            return False
        rest = tuple([name for name in held if name != engine])
        self._holders[block] = rest[0] if len(rest) == 1 else rest
        return True

    @property
    def engines(self) -> list[str]:
        return list(self._lru)

    def match(self, engine: str, blocks: Sequence[int]) -> int:
        """How many leading blocks of ``blocks`` the engine holds (0 for an engine not indexed)."""
        lru = self._lru.get(engine)
        if not lru or not blocks:
            return 0
        if blocks[-1] in lru:
            # Prefix-closed: with the last block, all of it (the common case of a prompt sent again).
            return len(blocks)
        # The first absent block ends the match.
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

    def holders(self, first: int) -> tuple[str, ...]:
        """The engines holding the block ``first`` as a prompt's first block: every engine holding any of a
        prompt that begins with it (prefix-closed), in the order they took it."""
        held = self._holders.get(first)
        if held is None:
            return ()
        return (held,) if isinstance(held, str) else held

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
        first = blocks[0]
        held = self._holders.get(first)
        if held is None:
            self._holders[first] = engine
            self._firsts[engine] += 1
        elif isinstance(held, str):
            if held != engine:
                self._holders[first] = (held, engine)
                self._firsts[engine] += 1
        elif engine not in held:
            self._holders[first] = (*held, engine)
            self._firsts[engine] += 1
        if len(lru) + self._firsts[engine] > self.quota:
            self._trim(engine, lru)

    def forget(self, engine: str) -> None:
        """Drop everything recorded for the engine (it left the fleet, or its cache is empty)."""
        lru = self._lru.get(engine)
        if lru is None:
            return
        if self._firsts[engine]:
            for block in lru:
                self._drop_holder(block, engine)
        self._firsts[engine] = 0
        self._lru[engine] = OrderedDict()

    def entries(self, engine: str) -> int:
        """Block hashes held for the engine."""
        lru = self._lru.get(engine)
        return 0 if lru is None else len(lru)

    def bytes(self, engine: str) -> int:
        """The engine's share of the index, in bytes by the index's accounting (its blocks and first blocks)."""
        return (self.entries(engine) + self._firsts.get(engine, 0)) * ENTRY_BYTES

    def total_bytes(self) -> int:
        """The whole index, in bytes by its accounting (never more than ``max_bytes``)."""
        return (sum(len(lru) for lru in self._lru.values()) + sum(self._firsts.values())) * ENTRY_BYTES
