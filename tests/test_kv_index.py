"""The KV event index: an engine's own events, matched to prompts by the tokens its blocks hold."""

from __future__ import annotations

import hashlib
import random
import tracemalloc
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.kv_events.index import ENTRY_BYTES, MAX_BLOCKS, KvIndex, chain_keys
from narwhal.kv_events.wire import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KvBatch, KvEvent

BS = 16


def batch(*events: KvEvent) -> KvBatch:
    return KvBatch(ts=0.0, events=list(events))


def stored(hashes: Sequence[BlockHash], parent: BlockHash | None, tokens: list[int], size: int = BS,
           **kw: Any) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=tokens, block_size=size,
                       **kw)


def prompt(blocks: int, seed: int = 0, size: int = BS) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(150_000) for _ in range(blocks * size)]


def index(*engines: str, max_bytes: int = 1 << 24) -> KvIndex:
    return KvIndex(engines or ("p1",), max_bytes=max_bytes)


# -- the key --------------------------------------------------------------------------------------


def test_chain_keys_follow_the_documented_hash() -> None:
    tokens = [1, 2, 3, 4, -5, 6, 7]
    expected, key = [], 0
    for start in (0, 3):
        data = key.to_bytes(8, "little") + b"".join(t.to_bytes(8, "little", signed=True)
                                                    for t in tokens[start:start + 3])
        key = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
        expected.append(key)
    assert chain_keys(tokens, 3) == expected  # whole blocks only: the 7th token is left out
    assert chain_keys(tokens, 3, max_blocks=1) == expected[:1]
    assert chain_keys(tokens, 8) == chain_keys(tokens, 0) == []
    assert len(chain_keys(list(range(2 * MAX_BLOCKS)), 1)) == MAX_BLOCKS == 1024
    assert chain_keys([1 << 70] * 3, 3) == []  # no int64: nothing can match it


# -- matching ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("hashes", [[7, 2**64 - 1, 0], [b"\x01" * 32, b"\x02" * 32, b"\x03" * 32],
                                    [b"short", 5, b"x" * 100]])
def test_stored_blocks_match_the_prompts_tokens_whatever_the_engines_hashes(hashes: list[BlockHash]) -> None:
    kv = index()
    tokens = prompt(4)
    kv.apply("p1", batch(stored(hashes, None, tokens[:3 * BS])), 1.0)
    assert kv.block_size("p1") == BS and kv.blocks("p1") == 3
    assert kv.match_each(["p1"], tokens + [1, 2, 3], 1.0) == [3 * BS]
    assert kv.match_each(["p1"], tokens[:2 * BS + 5], 1.0) == [2 * BS]
    # Same second block, different first: a chained key covers every token before it.
    other = prompt(1, seed=9) + tokens[BS:]
    assert kv.match_each(["p1"], other, 1.0) == [0]


def test_parents_chain_across_events_and_batches() -> None:
    kv = index()
    tokens = prompt(5)
    kv.apply("p1", batch(stored([11, 12], None, tokens[:2 * BS])), 1.0)
    kv.apply("p1", batch(stored([13], 12, tokens[2 * BS:3 * BS]),
                         stored([14, 15], 13, tokens[3 * BS:5 * BS])), 1.0)
    assert kv.match_each(["p1"], tokens, 1.0) == [5 * BS]
    # A branch off block 11: shares the first block only.
    branch = tokens[:BS] + prompt(1, seed=3)
    kv.apply("p1", batch(stored([21], 11, branch[BS:])), 1.0)
    assert kv.match_each(["p1"], branch, 1.0) == [2 * BS]
    assert kv.blocks("p1") == 6 and kv.orphans("p1") == 0


def test_block_removed_removes_and_a_removed_middle_block_ends_the_run() -> None:
    kv = index()
    tokens = prompt(4)
    kv.apply("p1", batch(stored([1, 2, 3, 4], None, tokens)), 1.0)
    kv.apply("p1", batch(BlockRemoved([4, 999, b"unknown"])), 1.0)
    assert kv.match_each(["p1"], tokens, 1.0) == [3 * BS] and kv.blocks("p1") == 3
    kv.apply("p1", batch(BlockRemoved([2])), 1.0)
    assert kv.match_each(["p1"], tokens, 1.0) == [BS] and kv.blocks("p1") == 2


def test_a_key_stays_held_while_any_engine_hash_carries_it() -> None:
    kv = index()
    tokens = prompt(1)
    # Two cache groups (or a re-hash) storing the same tokens under different hashes.
    kv.apply("p1", batch(stored([1], None, tokens), stored([2], None, tokens)), 1.0)
    kv.apply("p1", batch(BlockRemoved([1])), 1.0)
    assert kv.match_each(["p1"], tokens, 1.0) == [BS]
    kv.apply("p1", batch(BlockRemoved([2])), 1.0)
    assert kv.match_each(["p1"], tokens, 1.0) == [0]


def test_all_blocks_cleared_and_clear() -> None:
    kv = index("p1", "p2")
    tokens = prompt(2)
    for engine in ("p1", "p2"):
        kv.apply(engine, batch(stored([1, 2], None, tokens)), 1.0)
    kv.apply("p1", batch(AllBlocksCleared(), stored([3], None, tokens[:BS])), 1.0)
    assert kv.match_each(["p1", "p2"], tokens, 1.0) == [BS, 2 * BS]
    assert kv.blocks("p1") == 1
    kv.apply("p1", batch(AllBlocksCleared()), 1.0)
    assert kv.blocks("p1") == 0 and kv.bytes("p1") == 0 and kv.block_size("p1") == BS
    kv.clear("p2")  # a resync or a new process: its block size may change too
    assert kv.match_each(["p1", "p2"], tokens, 1.0) == [0, 0]
    assert kv.block_size("p2") is None and kv.total_bytes() == 0
    kv.clear("nobody")


def test_orphans_are_skipped_and_counted() -> None:
    kv = index()
    tokens = prompt(3)
    kv.apply("p1", batch(stored([2, 3], 1, tokens[BS:])), 1.0)  # parent 1 never seen
    assert kv.orphans("p1") == 2 and kv.blocks("p1") == 0
    kv.apply("p1", batch(stored([4], 3, tokens[2 * BS:])), 1.0)  # its child: an orphan too
    assert kv.orphans("p1") == 3
    kv.apply("p1", batch(stored([1], None, tokens[:BS]), stored([2], 1, tokens[BS:2 * BS])), 1.0)
    assert kv.match_each(["p1"], tokens, 1.0) == [2 * BS] and kv.orphans("p1") == 3


@pytest.mark.parametrize("extra", [{"medium": "CPU"}, {"medium": "STORAGE"}, {"lora": True},
                                   {"extra_keys": True}])
def test_offload_tiers_lora_and_extra_keys_are_ignored(extra: dict[str, Any]) -> None:
    kv = index()
    tokens = prompt(2)
    kv.apply("p1", batch(stored([1, 2], None, tokens, **extra)), 1.0)
    assert kv.blocks("p1") == 0 and kv.match_each(["p1"], tokens, 1.0) == [0]
    kv.apply("p1", batch(stored([1, 2], None, tokens, medium="GPU")), 1.0)
    kv.apply("p1", batch(BlockRemoved([1, 2], medium="CPU")), 1.0)  # the offloaded copy went, not ours
    assert kv.match_each(["p1"], tokens, 1.0) == [2 * BS]


def test_malformed_stores_are_skipped() -> None:
    kv = index()
    tokens = prompt(2)
    kv.apply("p1", batch(stored([1, 2], None, tokens[:-1]), stored([1], None, tokens[:BS], size=0),
                         stored([1], None, [1 << 70] * BS)), 1.0)
    assert kv.blocks("p1") == 0 and kv.block_size("p1") == BS


def test_block_sizes_differ_per_engine_and_match_in_tokens() -> None:
    kv = index("a", "b", "c")
    tokens = prompt(6, size=16)
    kv.apply("a", batch(stored([1, 2, 3], None, tokens[:48], size=16)), 1.0)
    kv.apply("b", batch(stored([1], None, tokens[:32], size=32)), 1.0)
    # A second size from the same engine (another cache group): the first one is what is matched.
    kv.apply("b", batch(stored([9], None, tokens[:16], size=16)), 1.0)
    assert kv.block_size("b") == 32 and kv.blocks("b") == 1
    assert kv.match_each(["a", "b", "c"], tokens, 1.0) == [48, 32, 0]


def test_match_each_keeps_order_and_gives_0_for_unknown_engines() -> None:
    kv = index("p1", "p2", "p3")
    tokens = prompt(3)
    kv.apply("p2", batch(stored([1, 2, 3], None, tokens)), 1.0)
    kv.apply("p3", batch(stored([1], None, tokens[:BS])), 1.0)
    assert kv.match_each(["p3", "ghost", "p2", "p1"], tokens, 1.0) == [BS, 0, 3 * BS, 0]
    assert kv.match_each([], tokens, 1.0) == []
    assert kv.match_each(["p2"], [], 1.0) == [0]


# -- pending placements ----------------------------------------------------------------------------


def test_placed_blocks_count_until_pending_s_passes() -> None:
    kv = KvIndex(["p1", "p2"], max_bytes=1 << 24, pending_s=2.0)
    tokens = prompt(3)
    kv.note_placed("p1", tokens, 10.0)  # no block size yet: nothing to key it by
    assert kv.match_each(["p1"], tokens, 10.0) == [0] and kv.bytes("p1") == 0
    kv.apply("p1", batch(stored([1], None, prompt(1, seed=5))), 10.0)
    kv.note_placed("p1", tokens, 10.0)
    assert kv.match_each(["p1", "p2"], tokens, 11.9) == [3 * BS, 0]
    assert kv.blocks("p1") == 1 and kv.bytes("p1") == 4 * ENTRY_BYTES
    assert kv.match_each(["p1"], tokens, 12.0) == [0]
    kv.apply("p1", batch(), 12.5)  # the next batch lets expired notes go
    assert kv.bytes("p1") == ENTRY_BYTES


def test_placed_blocks_stay_held_once_the_feed_stores_them() -> None:
    kv = KvIndex(["p1"], max_bytes=1 << 24, pending_s=2.0)
    tokens = prompt(3)
    kv.apply("p1", batch(stored([1], None, tokens[:BS])), 0.0)
    kv.note_placed("p1", tokens, 1.0)
    kv.apply("p1", batch(stored([2], 1, tokens[BS:2 * BS])), 1.5)
    assert kv.match_each(["p1"], tokens, 2.9) == [3 * BS]
    assert kv.match_each(["p1"], tokens, 3.0) == [2 * BS]  # the third was never stored
    kv.note_placed("p1", tokens, 3.0)  # a later note renews it
    assert kv.match_each(["p1"], tokens, 4.9) == [3 * BS]
    kv.apply("p1", batch(BlockRemoved([2])), 5.5)
    assert kv.match_each(["p1"], tokens, 5.5) == [BS] and kv.blocks("p1") == 1


# -- the memory bound -------------------------------------------------------------------------------


def chain_batches(engine_hashes: Iterator[BlockHash], blocks: int, per_event: int, seed: int = 1,
                  size: int = BS) -> Iterator[KvBatch]:
    """One long chain of blocks, ``per_event`` to a BlockStored, built lazily (as a feed decodes them)."""
    rng = random.Random(seed)
    parent: BlockHash | None = None
    for start in range(0, blocks, per_event):
        count = min(per_event, blocks - start)
        hashes = [next(engine_hashes) for _ in range(count)]
        yield batch(stored(hashes, parent, [rng.randrange(150_000) for _ in range(count * size)], size))
        parent = hashes[-1]


def int_hashes(seed: int = 2) -> Iterator[BlockHash]:
    rng = random.Random(seed)
    while True:
        yield rng.getrandbits(64) | (1 << 63)  # the biggest ints vLLM sends cost the most


def bytes_hashes(seed: int = 2) -> Iterator[BlockHash]:
    rng = random.Random(seed)
    while True:
        yield rng.randbytes(32)


def test_engines_share_the_bound_equally_and_forget_their_oldest_stored_blocks() -> None:
    kv = KvIndex(["p1", "p2"], max_bytes=ENTRY_BYTES * 20)
    assert kv.quota == 10
    old, new = prompt(6, seed=1), prompt(6, seed=2)
    kv.apply("p1", batch(stored(list(range(6)), None, old)), 1.0)
    kv.apply("p1", batch(stored(list(range(10, 16)), None, new)), 1.0)
    assert kv.blocks("p1") == 10 and kv.total_bytes() <= kv.max_bytes
    # The older prompt lost its oldest blocks; within an event its prefix is newer than its tail.
    assert kv.match_each(["p1"], new, 1.0) == [6 * BS]
    assert kv.match_each(["p1"], old, 1.0) == [4 * BS]
    kv.set_engines(["p1", "p2", "p3", "p4"])  # reshared: 5 each
    assert kv.quota == 5 and kv.blocks("p1") == 5 and kv.match_each(["p1"], new, 1.0) == [5 * BS]
    kv.apply("p4", batch(stored([1], None, new[:BS])), 1.0)
    kv.set_engines(["p4"])  # p1 goes; p4 keeps what it had
    assert kv.engines == ["p4"] and kv.blocks("p1") == 0 and kv.blocks("p4") == 1
    kv.set_max_bytes(0)
    assert kv.quota == 0 and kv.total_bytes() == 0
    kv.apply("p4", batch(stored([1], None, new[:BS])), 1.0)
    kv.note_placed("p4", new, 1.0)
    assert kv.total_bytes() == 0


def test_pending_blocks_are_bounded_too() -> None:
    kv = KvIndex(["p1"], max_bytes=ENTRY_BYTES * 8, pending_s=100.0)
    kv.apply("p1", batch(stored([1, 2], None, prompt(2))), 0.0)
    for seed in range(10):
        kv.note_placed("p1", prompt(4, seed=100 + seed), 1.0)
        assert kv.total_bytes() <= kv.max_bytes
    assert kv.blocks("p1") == 0  # the oldest stored blocks went first


# Two of the four combinations (each costs seconds under tracemalloc): bytes hashes one block an event (the
# most objects a block), int hashes in events of 16; each at one of the two sizes just past a table's growth
# (43,691 and 87,382 blocks: the worst points).
@pytest.mark.parametrize(("hashes", "per_event", "blocks"), [(bytes_hashes, 1, 43_691), (int_hashes, 16, 87_382)])
def test_accounted_bytes_cover_what_python_allocates(hashes: type, per_event: int, blocks: int) -> None:
    kv = KvIndex(["p1"], max_bytes=ENTRY_BYTES * blocks)
    tracemalloc.start()
    try:
        for one in chain_batches(hashes(), blocks, per_event):
            kv.apply("p1", one, 0.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert kv.blocks("p1") == blocks
    assert peak <= kv.total_bytes() <= kv.max_bytes


def test_churn_and_pending_stay_within_the_bound() -> None:
    # Stores and removes at the bound leave deleted slots until a table resizes: the worst case, not growth.
    quota = 21_845
    kv = KvIndex(["p1"], max_bytes=ENTRY_BYTES * quota, pending_s=1e9)
    rng = random.Random(4)
    prompts = [[rng.randrange(150_000) for _ in range(64 * BS)] for _ in range(40)]
    tracemalloc.start()
    try:
        for i, one in enumerate(chain_batches(bytes_hashes(), 4 * quota, 16)):
            kv.apply("p1", one, 0.0)
            if i % 2 == 0:  # the engine evicts some (not the last block: the next event's parent)
                kv.apply("p1", batch(BlockRemoved(one.events[0].block_hashes[:8])), 0.0)  # type: ignore[union-attr]
            if i % 50 == 0:
                kv.note_placed("p1", prompts[i % 40], float(i))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert kv.total_bytes() <= kv.max_bytes and peak <= kv.max_bytes


def test_a_hostile_batch_costs_bounded_memory() -> None:
    kv = KvIndex(["p1", "p2"], max_bytes=ENTRY_BYTES * 2000)
    huge = list(range(1_000_000))
    flood = batch(
        stored(huge, None, [7] * len(huge), size=1),  # a million blocks in one event
        BlockRemoved([b"?" * 64] * 100_000 + huge[1000:200_000]),  # unknown and known removes
        stored([42] * 100_000, None, [1] * 100_000, size=1),  # one hash stored a hundred thousand times
        stored([b"z" * 10_000] * 3, None, [1, 2, 3], size=1),  # oversized hashes
    )
    tracemalloc.start()
    try:
        kv.apply("p1", flood, 0.0)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert kv.blocks("p1") <= kv.quota == 1000
    assert kv.total_bytes() <= kv.max_bytes and peak <= kv.max_bytes
    assert kv.blocks("p2") == 0


# -- the property: a simple reference model ----------------------------------------------------------

TOKENS = st.lists(st.integers(min_value=0, max_value=2), min_size=2, max_size=2)
OPS = st.lists(st.one_of(
    st.tuples(st.just("store"), st.sampled_from(["a", "b"]), st.integers(0, 12), st.one_of(st.none(),
              st.integers(0, 12)), st.lists(TOKENS, min_size=1, max_size=4)),
    st.tuples(st.just("remove"), st.sampled_from(["a", "b"]), st.lists(st.integers(0, 40), max_size=5)),
    st.tuples(st.just("clear"), st.sampled_from(["a", "b"])),
), max_size=40)


def reference_apply(model: dict[str, dict[int, tuple[int, ...]]], op: tuple) -> None:
    """The model: engine -> {engine hash: every token from the first block through this one}."""
    if op[0] == "store":
        _, engine, first, parent, blocks = op
        held = model[engine]
        if parent is not None and parent not in held:
            return
        prefix = () if parent is None else held[parent]
        for offset, block in enumerate(blocks):
            prefix = prefix + tuple(block)
            held[first + offset] = prefix
    elif op[0] == "remove":
        for block_hash in op[2]:
            model[op[1]].pop(block_hash, None)
    else:
        model[op[1]].clear()


def reference_match(held: dict[int, tuple[int, ...]], tokens: list[int]) -> int:
    prefixes = set(held.values())
    run = 0
    while run * 2 + 2 <= len(tokens) and tuple(tokens[:run * 2 + 2]) in prefixes:
        run += 1
    return run * 2


@settings(max_examples=150, deadline=None)
@given(ops=OPS, probes=st.lists(st.lists(st.integers(0, 2), max_size=10), min_size=1, max_size=6),
       quota=st.sampled_from([3, 1000]))
def test_property_the_index_matches_a_reference_model(ops: list[tuple], quota: int,
                                                      probes: list[list[int]]) -> None:
    kv = KvIndex(["a", "b"], max_bytes=ENTRY_BYTES * quota * 2)
    model: dict[str, dict[int, tuple[int, ...]]] = {"a": {}, "b": {}}
    for op in ops:
        if op[0] == "store":
            _, engine, first, parent, blocks = op
            event = stored(list(range(first, first + len(blocks))), parent, [t for b in blocks for t in b], 2)
            kv.apply(engine, batch(event), 0.0)
        elif op[0] == "remove":
            kv.apply(op[1], batch(BlockRemoved(list(op[2]))), 0.0)
        else:
            kv.clear(op[1])
        reference_apply(model, op)
        assert kv.total_bytes() <= kv.max_bytes
        for engine in ("a", "b"):
            [found] = kv.match_each([engine], probes[0], 0.0)
            expected = reference_match(model[engine], probes[0])
            if quota == 1000:  # never over the bound: exactly the model
                assert found == expected and kv.blocks(engine) == len(model[engine])
            else:  # over it, the index forgets: never more than the model
                assert found <= expected and kv.blocks(engine) <= quota
    for engine in ("a", "b"):
        for probe in probes:
            [found_one] = kv.match_each([engine], probe, 0.0)
            if quota == 1000:
                assert found_one == reference_match(model[engine], probe)
            else:
                assert found_one <= reference_match(model[engine], probe)
