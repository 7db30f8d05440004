"""Placement over hundreds of engines decides exactly as the per-engine loops it replaced.

``Placer`` now passes over the candidates with map/compress and asks the index
for all matches at once; the reference below is the policy as first written,
one Python step per engine. Same state, same seeds: the same engine, reason
and match, and the same random draws.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.fleet.placement import InFlight, Placer
from narwhal.fleet.placement.policy import ANCHOR_BLOCKS, Choice, Reason
from narwhal.fleet.placement.prefix_index import ENTRY_BYTES, PrefixIndex


def reference_least(candidates: Sequence[str], load: Callable[[str], int], rng: random.Random) -> str:
    loads = [load(name) for name in candidates]
    least = min(loads)
    tied = [name for name, n in zip(candidates, loads, strict=True) if n == least]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def reference_rank(anchor: int, name: str) -> int:
    """The rendezvous score written out: splitmix64's finalizer over the anchor, XOR the name's 64-bit blake2b,
    then CPython's hash of that 1-tuple."""
    mask = (1 << 64) - 1
    mixed = (anchor ^ (anchor >> 30)) * 0xBF58476D1CE4E5B9 & mask
    mixed = (mixed ^ (mixed >> 27)) * 0x94D049BB133111EB & mask
    mixed ^= mixed >> 31
    return hash((mixed ^ int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little"),))


def reference_pick(placer: Placer, pool: list[str], blocks: Sequence[int], reason: Reason, matched: int) -> Choice:
    """The tie-break as first written: random without blocks, else the highest ``rank`` (the first among equals)."""
    n = len(blocks)
    if len(pool) == 1:
        name = pool[0]
    elif not n:
        name = placer.rng.choice(pool)
    else:
        anchor = blocks[min(n, ANCHOR_BLOCKS) - 1]
        name = max(pool, key=lambda candidate: reference_rank(anchor, candidate))
    return Choice(name, reason, matched / n if n else None)


def reference_prefill(placer: Placer, candidates: Sequence[str], blocks: Sequence[int],
                      load: Callable[[str], int]) -> Choice | None:
    if not candidates:
        return None
    n = len(blocks)
    index = placer.index
    if len(candidates) == 1:
        return Choice(candidates[0], "only_choice", index.match(candidates[0], blocks) / n if n else None)
    if not placer.cache_aware:
        return Choice(reference_least(candidates, load, placer.rng), "least_outstanding", None)
    loads = {name: load(name) for name in candidates}
    least = min(loads.values())
    bound = max(least + placer.balance_abs, least * placer.balance_rel)
    matches = {name: index.match(name, blocks) for name in candidates} if n else dict.fromkeys(candidates, 0)
    best_any = max(matches.values())
    if best_any == 0:
        pool = [name for name in candidates if loads[name] == least]
        if len(pool) > 1 and n:
            # (A prompt without a whole block adds nothing to a cache: the least loaded alone decide.)
            smallest = min(index.entries(name) for name in pool)
            pool = [name for name in pool if index.entries(name) == smallest]
        return reference_pick(placer, pool, blocks, "miss", 0)
    allowed = [name for name in candidates if loads[name] <= bound]
    best = max(matches[name] for name in allowed)
    pool = [name for name in allowed if matches[name] == best]
    if len(pool) > 1 and best:
        deepest = blocks[best - 1]
        latest = max(index.last_used(name, deepest) for name in pool)
        pool = [name for name in pool if index.last_used(name, deepest) == latest]
    elif len(pool) > 1:
        lowest = min(loads[name] for name in pool)
        pool = [name for name in pool if loads[name] == lowest]
    return reference_pick(placer, pool, blocks, "hit" if best == best_any else "spill", best)


@pytest.mark.parametrize("max_bytes", [1 << 20, 64 * ENTRY_BYTES * 4])
def test_choices_over_a_large_fleet_match_the_per_engine_reference(max_bytes: int) -> None:
    """At 4 entries an engine (the second case) every cache fills: misses then tie over the idle engines and
    go to rendezvous among dozens."""
    rng = random.Random(34)
    prefill = [f"p{i}" for i in range(64)]
    decode = [f"d{i}" for i in range(192)]
    prefixes = [[rng.getrandbits(64) for _ in range(6)] for _ in range(12)]
    for seed in range(30):
        state = random.Random(seed)
        in_flight = InFlight(prefill + decode)
        balance_abs, balance_rel = state.choice((0, 2, 8)), state.choice((1.0, 1.5))
        fast = Placer(PrefixIndex(prefill, max_bytes=max_bytes), rng=random.Random(seed), balance_abs=balance_abs,
                      balance_rel=balance_rel, clock=iter(range(1, 10**6)).__next__)
        slow = Placer(PrefixIndex(prefill, max_bytes=max_bytes), rng=random.Random(seed), balance_abs=fast.balance_abs,
                      balance_rel=fast.balance_rel, clock=iter(range(1, 10**6)).__next__)
        for step in range(150):
            # Candidates as the request path gives them: the whole role, or filtered (retries, continuations).
            candidates = prefill if state.random() < 0.7 else [p for p in prefill if state.random() < 0.5]
            prefix = state.choice(prefixes)
            blocks = prefix[:state.randrange(len(prefix) + 1)] if state.random() < 0.8 else []
            load = in_flight.loader()
            # With the busy engines (the request path's single process) or without (other workers' loads).
            busy = in_flight.busy if state.random() < 0.5 else None
            got = fast.prefill(candidates, blocks, load, busy=busy)
            want = reference_prefill(slow, candidates, blocks, in_flight.load)
            if blocks or len(candidates) < 2:
                assert got == want, (seed, step)
            else:
                # No whole block: one of the least loaded, at random (not the reference's draw; uniformity is
                # tested below). Only such prompts draw at random, so the other choices still agree.
                assert got is not None and want is not None and (got.reason, got.matched) == ("miss", None)
                assert in_flight.load(got.engine) == min(map(in_flight.load, candidates)), (seed, step)
            if got is not None:
                fast.record(got.engine, blocks)
                slow.record(got.engine, blocks)
                in_flight.acquire(got.engine)
            candidates = decode if state.random() < 0.8 else [d for d in decode if state.random() < 0.3]
            if candidates:
                # Decode finds an idle candidate from the busy engines; the reference scans them all.
                choice = fast.decode(candidates, in_flight.loader(), in_flight.busy)
                assert choice is not None
                assert in_flight.load(choice.engine) == min(map(in_flight.load, candidates)), (seed, step)
                assert in_flight.busy == {n for n, c in in_flight.counts.items() if c > 0}
                in_flight.acquire(choice.engine)
            # Requests end: loads fall back unevenly.
            for name in [n for n, c in in_flight.counts.items() if c and state.random() < 0.3]:
                in_flight.release(name)


# The chi-square statistic's 0.1% tail at 9, 63 and 127 degrees of freedom.
_CHI2_TAIL = {9: 27.88, 63: 103.4, 127: 181.99}


def _uniform(counts: Counter[str], names: Sequence[str]) -> float:
    expected = sum(counts.values()) / len(names)
    return sum((counts[name] - expected) ** 2 / expected for name in names)


@pytest.mark.parametrize("busy_share", [0.0, 0.3, 0.5, 0.9])
def test_decode_and_a_blockless_prefill_are_uniform_over_the_idle_engines(busy_share: float) -> None:
    """Drawn at random, kept if idle: each idle engine equally likely, whatever the share busy (at 90% busy most
    choices fall back to the exact draw among the idle ones), never a busy one while one is idle."""
    rng = random.Random(40)
    names = [f"e{i}" for i in range(128 + round(128 * busy_share / (1 - busy_share)) if busy_share < 0.9 else 1280)]
    in_flight = InFlight([*names, "other-role"])
    busy = rng.sample(names, len(names) - 128)
    for name in [*busy, "other-role"]:
        in_flight.acquire(name)
    idle = [name for name in names if name not in busy]
    assert len(idle) == 128
    placer = Placer(PrefixIndex(names, max_bytes=1 << 20), rng=random.Random(41))
    decoded: Counter[str] = Counter()
    prefilled: Counter[str] = Counter()
    for _ in range(128 * 50):
        choice = placer.decode(names, in_flight.loader(), in_flight.busy)
        assert choice is not None
        decoded[choice.engine] += 1
        choice = placer.prefill(names, [], in_flight.loader(), busy=in_flight.busy)
        assert choice is not None and (choice.reason, choice.matched) == ("miss", None)
        prefilled[choice.engine] += 1
    assert set(decoded) <= set(idle) and set(prefilled) <= set(idle)
    assert _uniform(decoded, idle) < _CHI2_TAIL[127]
    assert _uniform(prefilled, idle) < _CHI2_TAIL[127]


def test_decode_among_few_idle_engines_finds_them_whoever_is_busy() -> None:
    decode = [f"d{i}" for i in range(10)]
    for busy in ([], ["d0"], ["d9"], ["d3", "d4", "d7"], decode[:9], decode[1:], decode):
        in_flight = InFlight(decode)
        for name in busy:
            in_flight.acquire(name)
        # Every busy: the least loaded (all load 1), at random.
        want = [name for name in decode if name not in busy] or decode
        seen = set()
        for seed in range(60):
            fast = Placer(PrefixIndex([], max_bytes=0), rng=random.Random(seed))
            got = fast.decode(decode, in_flight.loader(), in_flight.busy)
            assert got is not None and got.engine in want, busy
            seen.add(got.engine)
        assert seen == set(want), busy
    # Engines busy outside the candidates (another role, a filtered one) do not count.
    in_flight = InFlight(decode + ["p0"])
    in_flight.acquire("p0")
    in_flight.acquire("d1")
    fast = Placer(PrefixIndex([], max_bytes=0), rng=random.Random(3))
    got = fast.decode(["d1", "d2"], in_flight.loader(), in_flight.busy)
    assert got is not None and got.engine == "d2"


def test_the_loader_reads_zero_for_an_engine_without_an_entry_and_adds_none() -> None:
    in_flight = InFlight(["a"])
    in_flight.acquire("a")
    load = in_flight.loader()
    assert (load("a"), load("added-by-a-reload")) == (1, 0) and "added-by-a-reload" not in in_flight.counts
    # Another worker's loads count: the loader is then the summing one.
    in_flight.elsewhere = {"a": 2}
    assert in_flight.loader()("a") == 3


def _prompt_trees(rng: random.Random, trees: int) -> list[list[int]]:
    """Prompts as chained hashes make them: each tree's prompts share its first block and fork after it."""
    prompts = []
    for _ in range(trees):
        first = rng.getrandbits(64)
        for _ in range(3):
            prompts.append([first] + [rng.getrandbits(64) for _ in range(rng.randrange(6))])
    return prompts


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(min_value=0, max_value=10**6),
       operations=st.lists(st.tuples(st.sampled_from(["record", "record", "record", "forget", "engines", "bytes"]),
                                     st.integers(min_value=0, max_value=10**6)), max_size=80))
def test_property_the_holders_of_a_first_block_are_the_engines_holding_it(
        seed: int, operations: list[tuple[str, int]]) -> None:
    """Whatever was recorded, evicted, forgotten or re-shared: an engine is among a first block's holders exactly
    while it holds that block, and each such entry is charged within the bound."""
    rng = random.Random(seed)
    engines = ["p0", "p1", "p2", "p3", "p4"]
    prompts = _prompt_trees(rng, 6)
    firsts = {prompt[0] for prompt in prompts}
    index = PrefixIndex(engines[:3], max_bytes=ENTRY_BYTES * 40)
    for op, value in operations:
        choose = random.Random(value)
        if op == "record":
            index.record(choose.choice(engines), choose.choice(prompts), float(value))
        elif op == "forget":
            index.forget(choose.choice(engines))
        elif op == "engines":
            index.set_engines(choose.sample(engines, choose.randrange(1, len(engines) + 1)))
        else:
            index.set_max_bytes(ENTRY_BYTES * choose.randrange(0, 80))
        held_firsts = dict.fromkeys(index.engines, 0)
        for first in firsts:
            holders = index.holders(first)
            assert len(set(holders)) == len(holders)
            for engine in index.engines:
                assert (engine in holders) == (index.match(engine, [first]) == 1), (op, engine)
            for engine in holders:
                held_firsts[engine] += 1
        for engine in index.engines:
            assert index.bytes(engine) == (index.entries(engine) + held_firsts[engine]) * ENTRY_BYTES
        assert index.total_bytes() <= index.max_bytes


def test_a_candidate_list_with_a_repeated_name_is_placed_as_the_reference_places_it() -> None:
    prefill = [f"p{i}" for i in range(20)]
    candidates = [*prefill, "p3"]
    in_flight = InFlight(prefill)
    fast = Placer(PrefixIndex(prefill, max_bytes=1 << 20), rng=random.Random(1), clock=iter(range(1, 999)).__next__)
    slow = Placer(PrefixIndex(prefill, max_bytes=1 << 20), rng=random.Random(1), clock=iter(range(1, 999)).__next__)
    blocks = [11, 12, 13]
    for step in range(30):
        got = fast.prefill(candidates, blocks, in_flight.loader(), busy=in_flight.busy)
        assert got == reference_prefill(slow, candidates, blocks, in_flight.load), step
        assert got is not None
        fast.record(got.engine, blocks)
        slow.record(got.engine, blocks)
        in_flight.acquire(got.engine)
