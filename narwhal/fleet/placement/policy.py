"""Placement policy: cache-aware prefill selection under a balance bound, least outstanding decode.

Pure logic (no I/O, no clock). The caller gives the eligible engines (fleet
rules and retry exclusions already applied), each engine's load (requests in
flight on it router-wide, prefills and decodes) and the prompt's chained block
hashes; ``Placer`` answers which engine, why, and how much of the prompt it
holds, and records the prompt on the chosen engine.

Prefill, ``cache_aware``:
1. Only engines within the balance bound may win on a match: load at most
   ``max(least + balance_abs, least * balance_rel)``, ``least`` being the least
   loaded candidate's load (the least loaded is always within it).
2. Among those, the longest match wins. ``hit``: the winner holds as much as any candidate. ``spill``: a better match
   was past the bound; the next best takes the prompt and holds it from now on.
3. Nobody holds any of it (``miss``): the least loaded; among equally loaded,
   the one whose index holds least, so new prefixes spread over the caches.
Equal matches go to the engine that had the prompt placed last (by the
placement's time, which worker processes share). Remaining ties are broken by
rendezvous hashing on the prompt's first blocks,
so every worker process picks the same engine from the same state, and a
prompt's first placement is deterministic while loads are equal.

Decode is least outstanding (random among ties): the KV arrives from the
prefill, so no decode engine holds a useful prefix.
"""

from __future__ import annotations

import hashlib
import itertools
import operator
import random
from collections.abc import Callable, Collection, Sequence
from itertools import compress, repeat
from typing import Literal, NamedTuple, overload

from narwhal.fleet.placement.prefix_index import PrefixIndex

__all__ = ["ANCHOR_BLOCKS", "Choice", "Placer", "Reason", "Scores", "least_outstanding"]

Reason = Literal["hit", "miss", "spill", "only_choice", "least_outstanding"]
# Rendezvous hashing keys on the hash of this many leading blocks (fewer in a shorter prompt).
ANCHOR_BLOCKS = 4
_MASK = (1 << 64) - 1
# Candidate lists whose positions ``Placer`` keeps: both roles of a few models.
_POSITIONED = 8
# Random draws among the candidates before the idle ones are found exactly (each lands on an idle one with at
# least the idle share's chance).
_DRAWS = 4
# From how many prefill candidates on the holders of a prompt's first block are looked at first: below, a pass over
# every candidate in C costs less than finding the few (the same choice either way).
_HOLDERS_FROM = 8


class Scores(NamedTuple):
    """Matches from another source than the index (the engines' KV events): per candidate, in candidate order."""

    # How much of the prompt each candidate holds, in units of ``total`` (tokens).
    matches: list[int]
    total: int
    # What each candidate holds in all (blocks): among equally loaded candidates that hold none of the
    # prompt, the one holding least takes it.
    sizes: list[int]


class Choice(NamedTuple):
    """One placement: the engine, why it won, and the matched share of the prompt (None: no blocks)."""

    engine: str
    reason: Reason
    matched: float | None


def least_outstanding(candidates: Sequence[str], load: Callable[[str], int], rng: random.Random) -> str:
    """The candidate (at least one) with the least ``load``; ``rng`` picks among ties.

    Random, so that a burst after a quiet spell does not pile onto the first engine in the config.
    """
    # map/compress keep the per-candidate work in C (with a C ``load``, e.g. a dict lookup): a fleet of
    # hundreds costs microseconds per request, not a Python call per engine.
    loads = list(map(load, candidates))
    least = min(loads)
    tied = list(compress(candidates, map(operator.eq, loads, repeat(least))))
    return tied[0] if len(tied) == 1 else rng.choice(tied)


class _Idle(Sequence[str]):
    """The candidates with no request in flight, in candidate order, found lazily from the busy positions.

    ``rng.choice`` asks only its length and one item, so a choice among hundreds of idle engines costs a
    walk over the busy ones, not a list of the idle ones.
    """

    def __init__(self, candidates: Sequence[str], busy_positions: list[int]) -> None:
        self._candidates = candidates
        self._busy = busy_positions
        self._len = len(candidates) - len(busy_positions)

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, k: int) -> str: ...
    @overload
    def __getitem__(self, k: slice) -> Sequence[str]: ...

    def __getitem__(self, k: int | slice) -> str | Sequence[str]:
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(self._len))]
        if not 0 <= k < self._len:
            raise IndexError(k)
        # The k-th idle position: every busy position at or before it pushes it one further.
        position = k
        for busy in self._busy:
            if busy > position:
                break
            position += 1
        return self._candidates[position]


def _salt(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def _mix(value: int) -> int:
    # splitmix64's finalizer: spreads a prompt anchor over 64 bits before the per-engine hash.
    value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    value = (value ^ (value >> 27)) * 0x94D049BB133111EB & _MASK
    return value ^ (value >> 31)


class Placer:
    """Chooses engines for one router process; ``record`` keeps the index in step with its choices."""

    def __init__(self, index: PrefixIndex, *, cache_aware: bool = True, balance_abs: int = 8,
                 balance_rel: float = 1.5, rng: random.Random | None = None,
                 on_record: Callable[[str, Sequence[int], float], None] | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.index = index
        # When a placement happened, on a clock all processes share (the shell gives CLOCK_MONOTONIC);
        # by default a counter, enough in one process.
        self.clock: Callable[[], float] = clock or itertools.count(1).__next__
        # Told of every recorded prompt: a worker process shares its placements through the controller.
        self.on_record = on_record
        self.cache_aware = cache_aware
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.rng = rng or random.Random()
        self._salts: dict[str, int] = {}
        # The last candidate lists seen (a role's, a model's) with each name's position, newest first: a request's
        # list is a fresh copy of the same eligible engines, so a C-level comparison or two usually finds it here.
        self._positioned: list[tuple[list[str], dict[str, int]]] = []

    def rendezvous(self, pool: Sequence[str], anchor: int) -> str:
        """The engine of ``pool`` (at least one) with the highest rendezvous score for a prompt anchor (the first
        of equals), the same in every process.

        The anchor is mixed once (splitmix64's finalizer), each engine's score is CPython's hash of the 1-tuple
        (mixed anchor XOR a hash of the engine's name): computed in C, since a miss among hundreds of idle
        engines scores every one of them. Ints and tuples of ints hash alike in every 64-bit CPython since 3.8
        (no per-process seed), so worker processes and routers agree.
        """
        salts = self._salts
        try:
            values = list(map(salts.__getitem__, pool))
        except KeyError:
            for name in pool:
                if name not in salts:
                    salts[name] = _salt(name)
            values = list(map(salts.__getitem__, pool))
        scores = list(map(hash, zip(map(_mix(anchor).__xor__, values))))
        return pool[scores.index(max(scores))]

    def prefill(self, candidates: Sequence[str], blocks: Sequence[int], load: Callable[[str], int],
                scores: Scores | None = None, busy: Collection[str] | None = None) -> Choice | None:
        """The prefill engine for a prompt of ``blocks`` among ``candidates``, or None when there are none.

        ``scores``, when given, replace the index's matches (the engines' own KV events): equal holders are
        then told apart by load and rendezvous, which every router computes alike, not by this router's
        own placement times. ``busy``: as ``decode``'s, for the choices made by load alone.
        """
        if not candidates:
            return None
        n = len(blocks)
        index = self.index
        if len(candidates) == 1:
            name = candidates[0]
            return Choice(name, "only_choice", index.match(name, blocks) / n if n else None)
        if not self.cache_aware:
            return Choice(self._least(candidates, load, busy), "least_outstanding", None)
        if not n and scores is None:
            # A prompt shorter than one block matches nothing and adds nothing to any cache: the least loaded
            # takes it (random among equals), found as decode finds it, without a pass over hundreds.
            return Choice(self._least(candidates, load, busy), "miss", None)
        if scores is None and len(candidates) > _HOLDERS_FROM:
            held_at = self._holders_at(candidates, blocks[0])
            if held_at:
                chosen = self._among_holders(candidates, blocks, load, busy, held_at)
                if chosen is not None:
                    return chosen
            elif held_at is not None:
                # Nobody holds the first block, so nobody holds any of the prompt.
                load_list = list(map(load, candidates))
                return self._miss(candidates, blocks, load_list, min(load_list), n, None)
        # The per-candidate passes run in C where they can (map, compress over lists aligned with the
        # candidates): see least_outstanding.
        load_list = list(map(load, candidates))
        least = min(load_list)
        bound = max(least + self.balance_abs, least * self.balance_rel)
        if scores is None:
            match_list, total = index.match_each(candidates, blocks), n
        else:
            match_list, total = scores.matches, scores.total
        best_any = max(match_list)
        if best_any == 0:
            return self._miss(candidates, blocks, load_list, least, total, scores)
        # The holders (match above 0) are usually few among hundreds of candidates: the steps below walk
        # their positions only, unless none of them is within the bound.
        held = [i for i in compress(range(len(match_list)), match_list) if load_list[i] <= bound]
        if held:
            best = max([match_list[i] for i in held])
            held = [i for i in held if match_list[i] == best]
            pool = [candidates[i] for i in held]
            if len(pool) > 1 and scores is None:
                # Equal holders: the one that had it last, whose cache most likely still has it. A spilled
                # prefix thus concentrates again on one engine instead of crowding several caches, and
                # worker processes agree on which (the time of a placement travels with its record).
                used = index.last_used_each(pool, blocks[best - 1])
                latest = max(used)
                pool = list(compress(pool, map(operator.eq, used, repeat(latest))))
            elif len(pool) > 1:
                lowest = min([load_list[i] for i in held])
                pool = [candidates[i] for i in held if load_list[i] == lowest]
        else:
            # Every holder is past the bound: the least loaded of those within it take the prompt.
            best = 0
            within = list(map(operator.le, load_list, repeat(bound)))
            pool = list(compress(candidates, within))
            if len(pool) > 1:
                pool_loads = list(compress(load_list, within))
                lowest = min(pool_loads)
                pool = list(compress(pool, map(operator.eq, pool_loads, repeat(lowest))))
        return self._pick(pool, blocks, "hit" if best == best_any else "spill", best, total)

    def _miss(self, candidates: Sequence[str], blocks: Sequence[int], load_list: list[int], least: int,
              total: int, scores: Scores | None) -> Choice:
        """Nobody holds any of the prompt: the least loaded, the emptiest cache among them, then rendezvous."""
        least_at = list(map(operator.eq, load_list, repeat(least)))
        pool = list(compress(candidates, least_at))
        if len(pool) > 1:
            # The emptiest cache among the least loaded: new prefixes spread over the caches.
            sizes = self.index.entries_of(pool) if scores is None else list(compress(scores.sizes, least_at))
            smallest = min(sizes)
            pool = list(compress(pool, map(operator.eq, sizes, repeat(smallest))))
        return self._pick(pool, blocks, "miss", 0, total)

    def _holders_at(self, candidates: Sequence[str], first: int) -> list[int] | None:
        """The positions, in order, of the candidates holding the block ``first`` (None: names repeat)."""
        positions = self._positions(candidates)
        if positions is None:
            return None
        holders = self.index.holders(first)
        if not holders:
            return []
        return sorted([i for i in map(positions.get, holders) if i is not None])

    def _among_holders(self, candidates: Sequence[str], blocks: Sequence[int], load: Callable[[str], int],
                       busy: Collection[str] | None, held_at: list[int]) -> Choice | None:
        """The prefill choice when some candidates (at ``held_at``) hold the prompt: the same as the pass over every
        candidate, from the holders' loads and matches alone; None when every holder is past the balance bound
        (the least loaded of the rest then take it: the full pass)."""
        if busy is not None and self._any_idle(candidates, busy):
            least = 0
        else:
            least = min(map(load, candidates))
        bound = max(least + self.balance_abs, least * self.balance_rel)
        index = self.index
        names = [candidates[i] for i in held_at]
        matches = [index.match(name, blocks) for name in names]
        within = [k for k, name in enumerate(names) if load(name) <= bound]
        if not within:
            return None
        best_any = max(matches)
        best = max([matches[k] for k in within])
        pool = [names[k] for k in within if matches[k] == best]
        if len(pool) > 1:
            # Equal holders: the one that had it last, whose cache most likely still has it. A spilled
            # prefix thus concentrates again on one engine instead of crowding several caches, and
            # worker processes agree on which (the time of a placement travels with its record).
            used = index.last_used_each(pool, blocks[best - 1])
            latest = max(used)
            pool = list(compress(pool, map(operator.eq, used, repeat(latest))))
        return self._pick(pool, blocks, "hit" if best == best_any else "spill", best, len(blocks))

    def decode(self, candidates: Sequence[str], load: Callable[[str], int],
               busy: Collection[str] | None = None) -> Choice | None:
        """The decode engine: least outstanding, random among ties; None when there are none.

        ``busy``, when given, must be exactly the engines whose ``load`` is above 0: while some candidate
        is idle the choice (uniform over the idle ones, as without it) then costs O(1) in the common case
        of many idle engines and O(busy) at worst, not O(candidates).
        """
        if not candidates:
            return None
        if len(candidates) == 1:
            return Choice(candidates[0], "only_choice", None)
        return Choice(self._least(candidates, load, busy), "least_outstanding", None)

    def _least(self, candidates: Sequence[str], load: Callable[[str], int], busy: Collection[str] | None) -> str:
        """``least_outstanding`` over two or more candidates; from the busy ones alone while one is idle."""
        if busy is not None:
            count = len(candidates)
            if len(busy) < count:
                # Some candidate is likely idle (the busy ones, of any role, are fewer; surely so when names do
                # not repeat): draw a candidate at random and keep it if idle. Each draw that lands is uniform
                # over the idle ones, and so is the exact draw below when none lands, so the choice is uniform
                # over them, in a few steps while many are idle.
                draw = self.rng.random
                for _ in range(_DRAWS):
                    name = candidates[int(draw() * count)]
                    if name not in busy:
                        return name
            idle = self._idle(candidates, busy)
            if idle is not None:
                # As least_outstanding: the least load is 0, the tied are the idle candidates in order.
                return idle[0] if len(idle) == 1 else self.rng.choice(idle)
        return least_outstanding(candidates, load, self.rng)

    def _positions(self, candidates: Sequence[str]) -> dict[str, int] | None:
        """Each candidate's position in the list (None when names repeat)."""
        for entry in self._positioned:
            if entry[0] == candidates:
                positions = entry[1]
                break
        else:
            names = list(candidates)
            positions = {name: i for i, name in enumerate(names)}
            # Bounded: a reload or a filtered list (a retry's) adds one; the oldest goes.
            self._positioned = [(names, positions), *self._positioned[:_POSITIONED - 1]]
        return positions if len(positions) == len(candidates) else None

    def _any_idle(self, candidates: Sequence[str], busy: Collection[str]) -> bool:
        """Whether a candidate has no request in flight (from the busy engines alone)."""
        positions = self._positions(candidates)
        if positions is None:
            return False
        if len(busy) < len(candidates):
            # Fewer engines busy, of any role, than distinct candidates: one of them is idle.
            return True
        return sum([1 for name in busy if name in positions]) < len(candidates)

    def _idle(self, candidates: Sequence[str], busy: Collection[str]) -> _Idle | None:
        """The idle candidates (None when every candidate is busy, or names repeat)."""
        positions = self._positions(candidates)
        if positions is None:
            return None
        # A list comprehension, not a generator: a sixth less at 64 busy engines (no generator frame to resume).
        taken = sorted([i for i in map(positions.get, busy) if i is not None])
        return _Idle(candidates, taken) if len(taken) < len(candidates) else None

    def record(self, engine: str, blocks: Sequence[int]) -> None:
        """The prompt was sent to ``engine``: it holds these blocks now."""
        if self.cache_aware and blocks:
            at = self.clock()
            self.index.record(engine, blocks, at)
            if self.on_record is not None:
                self.on_record(engine, blocks, at)

    def _pick(self, pool: list[str], blocks: Sequence[int], reason: Reason, matched: int,
              total: int | None = None) -> Choice:
        """``matched`` of ``total`` (default: the prompt's blocks) as the choice's share."""
        n = len(blocks)
        if total is None:
            total = n
        if len(pool) == 1:
            name = pool[0]
        elif not n:
            # No blocks to key on (a short prompt): random, so such prompts do not all go to one engine.
            name = self.rng.choice(pool)
        else:
            name = self.rendezvous(pool, blocks[min(n, ANCHOR_BLOCKS) - 1])
        return Choice(name, reason, matched / total if total else None)
