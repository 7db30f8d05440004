"""Which blocks each prefill engine's KV cache holds, from the engine's own events, keyed by their tokens.

Pure state (no I/O; the caller passes ``now``). A block's key is the router's own chained hash of the
tokens it holds (``chain_keys``), so a prompt matches an engine's blocks whatever hash the engine was
started with; a map from the engine's block hashes to those keys makes ``BlockRemoved`` apply.

Memory: ``max_bytes`` shared equally among engines, by the index's accounting (``ENTRY_BYTES`` per
stored or pending block, calibrated against tracemalloc in the tests); an engine over its share forgets
its oldest stored blocks. A hostile feed (huge events, unknown removes, duplicates) stays inside its share.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from itertools import islice, takewhile

from narwhal.fleet.placement.prefix_key import MAX_BLOCKS
from narwhal.kv_events.wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KvBatch

__all__ = ["ENTRY_BYTES", "MAX_BLOCKS", "KvIndex", "chain_keys"]

# Bytes one block costs at worst: the engine-hash -> key OrderedDict slot and node, the hash (a 32-byte
# bytes object) and the key (a 64-bit int), the key -> count dict slot. Measured under churn (stores and
# removes at the bound: deleted slots linger until a resize, which sizes a table for three times the
# live entries), ~480 bytes at worst, rounded up; growth alone peaks near 310. A pending block costs less.
ENTRY_BYTES = 512

_MASK = (1 << 64) - 1
# vLLM's bytes hashes are 32 bytes (sha256); a longer one is digested so a hostile hash costs no more.
_MAX_HASH_BYTES = 32
_LITTLE = sys.byteorder == "little"
_GPU = (None, "GPU")


def _token_bytes(tokens: Sequence[int]) -> bytes | None:
    # Token ids as int64 little-endian; None when one is not a 64-bit int (nothing can match it).
    try:
        ids = array("q", tokens)
    except (OverflowError, TypeError):
        return None
    if not _LITTLE:
        ids.byteswap()
    return ids.tobytes()


def _chain(key: int, data: bytes, step: int) -> list[int]:
    # Block i's key = blake2b-64(block i-1's key as 8 bytes LE || block i's tokens as int64 LE).
    keys: list[int] = []
    blake, from_bytes = hashlib.blake2b, int.from_bytes
    view = memoryview(data)
    for offset in range(0, len(data) - step + 1, step):
        hasher = blake(key.to_bytes(8, "little"), digest_size=8)
        hasher.update(view[offset:offset + step])
        key = from_bytes(hasher.digest(), "little")
        keys.append(key)
    return keys


def chain_keys(tokens: Sequence[int], block_size: int, *, max_blocks: int = MAX_BLOCKS) -> list[int]:
    """The chained keys of the whole ``block_size``-token blocks of ``tokens`` (at most ``max_blocks``)."""
    if block_size <= 0:
        return []
    count = min(len(tokens) // block_size, max_blocks)
    if count <= 0:
        return []
    data = _token_bytes(tokens[:count * block_size])
    return [] if data is None else _chain(0, data, block_size * 8)


def _norm(block_hash: BlockHash) -> BlockHash:
    # The engine's hash as a bounded object: an int as unsigned 64 bits, bytes at most 32 long.
    if block_hash.__class__ is int:
        return block_hash if 0 <= block_hash <= _MASK else block_hash & _MASK
    if len(block_hash) > _MAX_HASH_BYTES:  # type: ignore[arg-type]
        return hashlib.blake2b(block_hash, digest_size=_MAX_HASH_BYTES).digest()  # type: ignore[arg-type]
    return block_hash


class _Engine:
    """One engine's blocks."""

    __slots__ = ("block_size", "held", "order", "orphans", "pending", "placed")

    def __init__(self) -> None:
        self.block_size: int | None = None
        # engine hash -> key, oldest stored first.
        self.order: OrderedDict[BlockHash, int] = OrderedDict()
        # key -> how many stored engine hashes carry it.
        self.held: dict[int, int] = {}
        # key -> when its pending ends, for placed blocks the feed has not stored (yet).
        self.placed: dict[int, float] = {}
        # (deadline, key) of note_placed blocks, in deadline order: what expires first is first.
        self.pending: deque[tuple[float, int]] = deque()
        self.orphans = 0

    def entries(self) -> int:
        return len(self.order) + len(self.pending)

    def clear(self, *, keep_block_size: bool) -> None:
        # New tables, not emptied ones: a dict keeps its peak size after deletes.
        self.order, self.held, self.placed, self.pending = OrderedDict(), {}, {}, deque()
        if not keep_block_size:
            self.block_size = None


class KvIndex:
    """Per-engine blocks from the engines' KV events, under one memory bound; the feeds' sink."""

    def __init__(self, engines: Iterable[str], *, max_bytes: int, pending_s: float = 2.0) -> None:
        self._engines: dict[str, _Engine] = {name: _Engine() for name in dict.fromkeys(engines)}
        self.max_bytes = max_bytes
        self.pending_s = pending_s
        self.quota = 0
        self._share()

    def set_engines(self, engines: Iterable[str]) -> None:
        """Index exactly ``engines`` from now on: a new one starts empty, a removed one goes."""
        self._engines = {name: self._engines.get(name) or _Engine() for name in dict.fromkeys(engines)}
        self._share()

    def set_max_bytes(self, max_bytes: int) -> None:
        """A new memory bound: each engine over its new share forgets its oldest stored blocks."""
        self.max_bytes = max_bytes
        self._share()

    def _share(self) -> None:
        # An equal share each: one engine's feed never crowds out another's.
        self.quota = max(0, self.max_bytes) // ENTRY_BYTES // max(1, len(self._engines))
        for engine in self._engines.values():
            self._trim(engine)

    # -- the sink -------------------------------------------------------------------------------

    def apply(self, engine: str, batch: KvBatch, now: float) -> None:
        """Apply one batch of the engine's events (an engine not indexed is ignored)."""
        state = self._engines.get(engine)
        if state is None:
            return
        self._expire(state, now)
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._store(state, event)
            elif isinstance(event, BlockRemoved):
                self._remove(state, event)
            elif isinstance(event, AllBlocksCleared):
                # Same process, same block size: it is kept, so placements still count as pending.
                state.clear(keep_block_size=True)

    def clear(self, engine: str) -> None:
        """Forget everything about the engine's cache, its block size too (a resync, a new process)."""
        state = self._engines.get(engine)
        if state is not None:
            state.clear(keep_block_size=False)

    def _store(self, state: _Engine, event: BlockStored) -> None:
        # Offload tiers, LoRA and extra keys (multimodal, cache salt) are blocks a token key cannot name.
        if event.medium not in _GPU or event.lora or event.extra_keys:
            return
        size, hashes = event.block_size, event.block_hashes
        if size <= 0 or not hashes or len(event.token_ids) != size * len(hashes):
            return
        if state.block_size is None:
            state.block_size = size
        elif size != state.block_size:
            # Another cache group's size (hybrid models): the first size seen is the one matched.
            return
        parent = event.parent_block_hash
        key = 0 if parent is None else state.order.get(_norm(parent))
        if key is None:
            state.orphans += len(hashes)
            return
        # Only a share's worth of an event's leading blocks can be kept: chain no further.
        count = min(len(hashes), self.quota)
        if count == 0:
            return
        data = _token_bytes(event.token_ids[:count * size])
        if data is None:
            return
        keys = _chain(key, data, size * 8)
        order, held, placed = state.order, state.held, state.placed
        # Deepest first: within an event a block's ancestors are newer, so eviction takes tails first.
        for index in range(count - 1, -1, -1):
            block_hash, key = _norm(hashes[index]), keys[index]
            old = order.pop(block_hash, None)
            if old is not None:
                _drop_key(held, old)
            order[block_hash] = key
            held[key] = held.get(key, 0) + 1
            if placed:
                placed.pop(key, None)  # stored: no longer only pending
        self._trim(state)

    def _remove(self, state: _Engine, event: BlockRemoved) -> None:
        if event.medium not in _GPU:
            return
        pop, held = state.order.pop, state.held
        for block_hash in event.block_hashes:
            key = pop(_norm(block_hash), None)
            if key is not None:
                _drop_key(held, key)

    def _trim(self, state: _Engine) -> None:
        # Over the share: the oldest stored blocks go first, then the oldest pending ones.
        excess = state.entries() - self.quota
        order, held, pending = state.order, state.held, state.pending
        while excess > 0 and order:
            _drop_key(held, order.popitem(last=False)[1])
            excess -= 1
        while excess > 0 and pending:
            _drop_pending(state.placed, *pending.popleft())
            excess -= 1

    def _expire(self, state: _Engine, now: float) -> None:
        pending, placed = state.pending, state.placed
        while pending and pending[0][0] <= now:
            _drop_pending(placed, *pending.popleft())

    # -- placement ------------------------------------------------------------------------------

    def block_size(self, engine: str) -> int | None:
        """The engine's block size, from its BlockStored events (None before any)."""
        state = self._engines.get(engine)
        return None if state is None else state.block_size

    def match_each(self, engines: Sequence[str], tokens: Sequence[int], now: float) -> list[int]:
        """Per engine, in order, the tokens in the longest run of the prompt's leading blocks it holds."""
        keys_of: dict[int, list[int]] = {}
        found: list[int] = []
        get_state = self._engines.get
        for engine in engines:
            state = get_state(engine)
            if state is None or state.block_size is None or not (state.held or state.placed):
                found.append(0)
                continue
            size = state.block_size
            keys = keys_of.get(size)
            if keys is None:
                keys = keys_of[size] = chain_keys(tokens, size)
            # The first block an engine lacks ends its run: most engines cost one lookup, and the
            # stored run is counted in C (a fleet of hundreds may all hold a long system prompt).
            held = state.held
            run = len(list(takewhile(held.__contains__, keys)))
            placed = state.placed
            if placed and run < len(keys):
                get = placed.get
                for key in islice(keys, run, None):
                    if key not in held and get(key, 0.0) <= now:
                        break
                    run += 1
            found.append(run * size)
        return found

    def note_placed(self, engine: str, tokens: Sequence[int], now: float) -> None:
        """This router just sent the prompt to the engine: its blocks count as held for ``pending_s``.

        Until the engine's feed stores them (it publishes only after its prefill), so a burst of one
        prefix is not scattered before the first BlockStored arrives.
        """
        state = self._engines.get(engine)
        if state is None or state.block_size is None or self.quota == 0:
            return
        self._expire(state, now)
        deadline = float(now + self.pending_s)
        held, placed, pending = state.held, state.placed, state.pending
        for key in chain_keys(tokens, state.block_size, max_blocks=min(MAX_BLOCKS, self.quota)):
            if key in held:
                continue  # stored already
            placed[key] = deadline
            pending.append((deadline, key))
        self._trim(state)

    # -- introspection --------------------------------------------------------------------------

    @property
    def engines(self) -> list[str]:
        return list(self._engines)

    def blocks(self, engine: str) -> int:
        """Blocks the engine's feed says it holds now."""
        state = self._engines.get(engine)
        return 0 if state is None else len(state.order)

    def bytes(self, engine: str) -> int:
        """The engine's share of the index, in bytes by the index's accounting."""
        state = self._engines.get(engine)
        return 0 if state is None else state.entries() * ENTRY_BYTES

    def total_bytes(self) -> int:
        """The whole index, in bytes by its accounting (never more than ``max_bytes``)."""
        return sum(state.entries() for state in self._engines.values()) * ENTRY_BYTES

    def orphans(self, engine: str) -> int:
        """Stored blocks skipped because their parent was unknown."""
        state = self._engines.get(engine)
        return 0 if state is None else state.orphans


def _drop_key(held: dict[int, int], key: int) -> None:
    # One fewer stored engine hash carries the key.
    seen = held.get(key, 0)
    if seen > 1:
        held[key] = seen - 1
    elif seen:
        del held[key]


def _drop_pending(placed: dict[int, float], deadline: float, key: int) -> None:
    # Only if this note is still the key's latest one (and the feed has not stored it since).
    if placed.get(key) == deadline:
        del placed[key]
