"""Cache-aware placement as pure logic: the prefix key, the bounded index, the policy.

Table-driven: each case states engines' loads and what they hold, and the
choice and reason that must follow. No I/O, no clock, no trio.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import tracemalloc
from collections import Counter
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from narwhal.fleet.placement import Placer
from narwhal.fleet.placement.prefix_index import ENTRY_BYTES, PrefixIndex
from narwhal.fleet.placement.prefix_key import MAX_BLOCKS, _chain, prompt_blocks

ENGINES = ["p1", "p2", "p3", "p4"]
BLOCK = 16


def text(words: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(words))


def blocks_of(prompt: Any, *, chat: bool = False) -> list[int]:
    request = {"messages": prompt} if chat else {"prompt": prompt}
    return prompt_blocks(request, chat=chat, block_tokens=BLOCK)


def placer(*, balance_abs: int = 4, balance_rel: float = 1.5, max_bytes: int = 1 << 20) -> Placer:
    return Placer(PrefixIndex(ENGINES, max_bytes=max_bytes), balance_abs=balance_abs, balance_rel=balance_rel,
                  rng=random.Random(7))


def loads(**counts: int) -> Any:
    return lambda name: counts.get(name, 0)


# -- the prefix key ---------------------------------------------------------------------------


def test_text_blocks_are_chained_so_equal_hashes_mean_equal_prefixes() -> None:
    shared = text(200)
    a, b = blocks_of(shared + " alpha tail words"), blocks_of(shared + " beta other words")
    common = len(shared.encode()) // (4 * BLOCK)
    assert a[:common] == b[:common]
    assert a[common:] != b[common:]
    # A block equal in content but behind a different prefix hashes differently.
    assert blocks_of("x" * 64 + "y" * 64)[1] != blocks_of("z" * 64 + "y" * 64)[1]


def test_only_whole_blocks_count_and_hashing_is_bounded() -> None:
    assert blocks_of("short prompt") == []
    assert len(blocks_of("a" * (4 * BLOCK * 3 + 5))) == 3
    assert len(blocks_of("a" * (4 * BLOCK * (MAX_BLOCKS + 50)))) == MAX_BLOCKS


def test_token_id_prompts_are_keyed_on_the_ids() -> None:
    ids = list(range(1000, 1000 + 5 * BLOCK + 3))
    keyed = blocks_of(ids)
    assert len(keyed) == 5
    changed = ids.copy()
    changed[3 * BLOCK] += 1
    assert blocks_of(changed)[:3] == keyed[:3] and blocks_of(changed)[3:] != keyed[3:]
    # Not the same key as the ids' text.
    assert blocks_of(" ".join(map(str, ids)))[:1] != keyed[:1]
    # Ids past 64 bits still key (as JSON), rather than fail.
    assert blocks_of([2**70] * 40)


def test_chat_keys_cover_every_message_and_role_in_order() -> None:
    system = {"role": "system", "content": text(100, "s")}
    first = [system, {"role": "user", "content": text(60, "u")}]
    turn2 = [*first, {"role": "assistant", "content": text(60, "a")}, {"role": "user", "content": text(60, "q")}]
    base = blocks_of(first, chat=True)
    longer = blocks_of(turn2, chat=True)
    # A conversation's next turn extends its key: its earlier blocks stay the same.
    assert longer[:len(base)] == base and len(longer) > len(base)
    # Same first message, a different later one: different keys (not the first message only).
    other = [system, {"role": "user", "content": text(60, "v")}]
    assert blocks_of(other, chat=True) != base
    assert blocks_of(other, chat=True)[:2] == base[:2]
    # The role counts, and so does the order.
    as_assistant = [system, {"role": "assistant", "content": text(60, "u")}]
    assert blocks_of(as_assistant, chat=True) != base
    swapped = [first[1], first[0]]
    assert blocks_of(swapped, chat=True)[:1] != base[:1]
    # Multi-part content is keyed too.
    parts = [system, {"role": "user", "content": [{"type": "text", "text": text(60, "u")}]}]
    assert len(blocks_of(parts, chat=True)) >= len(base)


# -- the index --------------------------------------------------------------------------------


def test_index_matches_the_longest_recorded_prefix() -> None:
    index = PrefixIndex(ENGINES, max_bytes=1 << 20)
    prompt = blocks_of(text(300))
    index.record("p1", prompt, 1.0)
    assert index.match("p1", prompt) == len(prompt)
    assert index.match("p2", prompt) == 0
    other = blocks_of(text(150) + " " + text(150, "z"))
    assert 0 < index.match("p1", other) < len(other)
    assert index.match("unknown", prompt) == 0


def test_lru_evicts_tails_before_prefixes_and_least_recent_prompts_first() -> None:
    # 32 entries' worth: two prompts of 16 blocks, each first block charged once more, make 34.
    index = PrefixIndex(["p1"], max_bytes=ENTRY_BYTES * 32)
    assert index.quota == 32
    hot, cold = blocks_of(list(range(16 * BLOCK))), blocks_of(list(range(1, 16 * BLOCK + 1)))
    assert len(hot) == len(cold) == 16
    index.record("p1", hot, 1.0)
    index.record("p1", cold, 1.0)
    assert index.entries("p1") == 30 and index.total_bytes() == index.max_bytes
    # The older prompt lost its tail, kept its prefix.
    assert index.match("p1", hot) == 14 and index.match("p1", cold) == 16
    index.record("p1", hot, 1.0)
    assert index.match("p1", hot) == 16 and index.match("p1", cold) == 14


def test_forget_drops_an_engines_entries_only() -> None:
    index = PrefixIndex(ENGINES, max_bytes=1 << 20)
    prompt = blocks_of(text(300))
    index.record("p1", prompt, 1.0)
    index.record("p2", prompt, 1.0)
    index.forget("p1")
    assert index.match("p1", prompt) == 0 and index.entries("p1") == 0
    assert index.match("p2", prompt) == len(prompt)


@pytest.mark.parametrize("per_record", [1, 50])
def test_accounted_bytes_cover_what_python_allocates(per_record: int) -> None:
    rng = random.Random(1)
    records = [[rng.getrandbits(64) for _ in range(per_record)] for _ in range(100_000 // per_record)]
    # The peak of the dict's growth is just past a resize (87,382 entries grows the table).
    for entries in (87_382, 100_000):
        index = PrefixIndex(["p1"], max_bytes=ENTRY_BYTES * entries)
        tracemalloc.start()
        try:
            for i, blocks in enumerate(records):
                index.record("p1", blocks, i + 0.5)  # a time object of its own per prompt: the worst case
            current, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        # Full (to within a first block's entry, which is evicted with its block): one-block prompts, the worst
        # case for the first blocks' entries, fill half as many blocks.
        assert index.max_bytes - ENTRY_BYTES <= index.total_bytes() <= index.max_bytes
        if per_record == 1:
            assert index.entries("p1") == entries // 2
        assert peak <= index.total_bytes() <= index.max_bytes


def test_relayed_records_never_move_a_blocks_time_back() -> None:
    index = PrefixIndex(["p1"], max_bytes=1 << 20)
    index.record("p1", [1, 2], 5.0)
    index.record("p1", [1, 2, 3], 3.0)  # placed earlier elsewhere, heard of later
    assert [index.last_used("p1", b) for b in (1, 2, 3)] == [5.0, 5.0, 3.0]
    assert index.last_used("p1", 9) == 0.0 and index.last_used("nope", 1) == 0.0


def test_workers_agree_on_the_holder_that_had_it_last() -> None:
    """Two processes that placed the same prompt on different engines converge once they hear of each other."""
    times = iter([1.0, 2.0])
    a = Placer(PrefixIndex(ENGINES, max_bytes=1 << 20), clock=lambda: next(times))
    b = Placer(PrefixIndex(ENGINES, max_bytes=1 << 20), clock=lambda: 99.0)
    a.record("p1", HOT)   # worker a at t=1
    a.record("p3", COLD)  # t=2
    b.index.record("p2", HOT, 1.5)  # worker b placed HOT on p2 at t=1.5, before hearing of a
    # The relay: each applies the other's record with its original time.
    a.index.record("p2", HOT, 1.5)
    b.index.record("p1", HOT, 1.0)
    first, second = a.prefill(ENGINES, HOT, loads()), b.prefill(ENGINES, HOT, loads())
    assert first is not None and second is not None and first.engine == second.engine == "p2"


@settings(max_examples=60, deadline=None)
@given(max_entries=st.integers(min_value=0, max_value=64),
       operations=st.lists(st.tuples(st.sampled_from(["record", "forget"]), st.sampled_from(ENGINES),
                                     st.lists(st.integers(min_value=0, max_value=40), max_size=80)),
                           max_size=60))
def test_property_the_index_never_exceeds_its_bound(max_entries: int,
                                                    operations: list[tuple[str, str, list[int]]]) -> None:
    index = PrefixIndex(ENGINES, max_bytes=max_entries * ENTRY_BYTES)
    for op, engine, blocks in operations:
        if op == "record":
            index.record(engine, blocks, 1.0)
        else:
            index.forget(engine)
        assert index.total_bytes() <= index.max_bytes
        assert all(index.entries(name) <= index.quota for name in ENGINES)


def _chained(branch: int, fork: int, length: int) -> list[int]:
    """A prompt's blocks as chained hashes make them: block i stands for the whole prefix through i, so two
    prompts share block i only if they share every block before it. Branch 0 is one line of blocks; another
    branch leaves it after its first ``fork`` blocks, on blocks of its own, different for each fork (the same
    block past different forks would be a hash that ignores its prefix, which the index may assume away)."""
    return [i if branch == 0 or i < fork else 1000 * (16 * branch + fork) + i for i in range(length)]


_PROMPTS = st.tuples(st.integers(min_value=0, max_value=3), st.integers(min_value=0, max_value=12),
                     st.integers(min_value=0, max_value=12))


@settings(max_examples=80, deadline=None)
@given(operations=st.lists(st.tuples(st.sampled_from(["record", "forget"]), st.sampled_from(ENGINES), _PROMPTS),
                           max_size=40),
       max_entries=st.integers(min_value=0, max_value=48), prompt=_PROMPTS,
       at=st.integers(min_value=0, max_value=12))
# Found once in a full run when a block past one fork had the id of the block past another: [0, 3001] held,
# [3000, 3001, 3002] asked. Not a state chained hashes can reach; kept as the case the generator must not make.
@example(operations=[("record", "p1", (3, 1, 2))], max_entries=8, prompt=(3, 0, 3), at=0)
def test_property_the_per_engine_passes_equal_one_engine_at_a_time(
        operations: list[tuple[str, str, tuple[int, int, int]]], max_entries: int, prompt: tuple[int, int, int],
        at: int) -> None:
    # Engines holding all, part or none of a prompt (and engines the index does not hold), as placement asks.
    index = PrefixIndex(ENGINES, max_bytes=max_entries * ENTRY_BYTES)
    for step, (op, engine, recorded) in enumerate(operations):
        if op == "record":
            index.record(engine, _chained(*recorded), float(step))
        else:
            index.forget(engine)
    engines = [*ENGINES, "unknown", ENGINES[0]]
    blocks = _chained(*prompt)
    assert index.match_each(engines, blocks) == [index.match(name, blocks) for name in engines]
    assert all(type(value) is int for value in index.match_each(engines, blocks))
    assert index.entries_of(engines) == [index.entries(name) for name in engines]
    assert index.entries_of(ENGINES) == [index.entries(name) for name in ENGINES]  # all indexed: the C path
    assert index.last_used_each(engines, at) == [index.last_used(name, at) for name in engines]


# -- the policy: table-driven -----------------------------------------------------------------

HOT = blocks_of(text(512, "hot"))
COLD = blocks_of(text(512, "cold"))

CASES: list[tuple[str, dict[str, list[list[int]]], dict[str, int], list[str], str, str, float]] = [
    # (name, held: engine -> prompts it holds, loads, candidates, expected engine, reason, matched)
    ("hit on the holder", {"p2": [HOT]}, {}, ENGINES, "p2", "hit", 1.0),
    ("hit while within balance_abs", {"p2": [HOT]}, {"p2": 4}, ENGINES, "p2", "hit", 1.0),
    ("hit within balance_rel at high load", {"p2": [HOT]}, {"p1": 20, "p2": 30, "p3": 20, "p4": 20},
     ENGINES, "p2", "hit", 1.0),
    ("miss goes to the least loaded", {"p2": [COLD]}, {"p1": 3, "p2": 1, "p3": 0, "p4": 2}, ENGINES, "p3",
     "miss", 0.0),
    ("holder past the bound: spill to the least loaded", {"p2": [HOT]}, {"p2": 5, "p1": 1, "p3": 0, "p4": 1},
     ENGINES, "p3", "spill", 0.0),
    ("spill prefers the next best match", {"p2": [HOT], "p4": [HOT[:10]]}, {"p2": 9, "p1": 0, "p3": 0, "p4": 3},
     ENGINES, "p4", "spill", 10 / len(HOT)),
    ("two holders: the one that had it last", {"p2": [HOT], "p1": [HOT]}, {"p1": 2, "p2": 1}, ENGINES, "p1",
     "hit", 1.0),
    ("longest match beats a shorter one", {"p1": [HOT[:8]], "p3": [HOT]}, {"p3": 2}, ENGINES, "p3", "hit", 1.0),
    ("an ineligible holder is never scored", {"p2": [HOT]}, {}, ["p1", "p3"], "p1", "miss", 0.0),
    ("the one candidate", {"p2": [HOT]}, {"p1": 50}, ["p1"], "p1", "only_choice", 0.0),
]


@pytest.mark.parametrize(("held", "load", "candidates", "expected", "reason", "matched"),
                         [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_prefill_choice(held: dict[str, list[list[int]]], load: dict[str, int], candidates: list[str],
                        expected: str, reason: str, matched: float) -> None:
    p = placer()
    for engine, prompts in held.items():
        for prompt in prompts:
            p.record(engine, prompt)
    if expected == "p1" and reason == "miss":
        # Equal loads: rendezvous decides; any candidate is right as long as it is a candidate.
        choice = p.prefill(candidates, HOT, loads(**load))
        assert choice is not None and choice.engine in candidates and choice.reason == "miss"
        return
    choice = p.prefill(candidates, HOT, loads(**load))
    assert choice is not None
    assert (choice.engine, choice.reason) == (expected, reason)
    assert choice.matched == pytest.approx(matched)


def test_no_candidates_no_choice() -> None:
    assert placer().prefill([], HOT, loads()) is None
    assert placer().decode([], loads()) is None


def test_spill_then_the_spilled_engine_holds_it_and_locality_returns() -> None:
    p = placer(balance_abs=2)
    p.record("p1", HOT)
    busy = {"p1": 6, "p2": 0, "p3": 1, "p4": 1}
    choice = p.prefill(ENGINES, HOT, loads(**busy))
    assert choice is not None and (choice.engine, choice.reason) == ("p2", "spill")
    p.record(choice.engine, HOT)
    # Both hold it now: the hot prompt stays on its holders, and is a hit on either.
    for state in ({"p1": 6, "p2": 2, "p3": 1, "p4": 1}, {"p1": 1, "p2": 3}, {}):
        again = p.prefill(ENGINES, HOT, loads(**state))
        assert again is not None and again.engine in {"p1", "p2"} and again.reason == "hit"
    # Load gone: equal holders, one deterministic choice (rendezvous), the same each time.
    quiet = {p.prefill(ENGINES, HOT, loads()).engine for _ in range(20)}  # type: ignore[union-attr]
    assert len(quiet) == 1 and quiet <= {"p1", "p2"}


def test_skew_spreads_a_hot_prefix_over_as_many_engines_as_it_needs() -> None:
    """Half the traffic on one prefix, the rest on 7 others: no engine takes the hot half alone."""
    p = placer(balance_abs=2)
    rng = random.Random(3)
    others = [blocks_of(text(512, f"g{g}")) for g in range(7)]
    in_flight: Counter[str] = Counter()
    queue: list[str] = []
    placed: Counter[str] = Counter()
    hot_engines: set[str] = set()
    hits = 0
    for _ in range(2000):
        prompt = HOT if rng.random() < 0.5 else rng.choice(others)
        choice = p.prefill(ENGINES, prompt, lambda name: in_flight[name])
        assert choice is not None
        p.record(choice.engine, prompt)
        placed[choice.engine] += 1
        hits += choice.reason == "hit"
        if prompt is HOT:
            hot_engines.add(choice.engine)
        in_flight[choice.engine] += 1
        queue.append(choice.engine)
        if len(queue) > 16:  # 16 in flight, oldest finishes first
            in_flight[queue.pop(0)] -= 1
    assert max(placed.values()) / 2000 < 0.45
    assert len(hot_engines) >= 2
    assert hits / 2000 > 0.8


def test_cold_prefixes_keep_their_engines_under_balanced_load() -> None:
    p = placer()
    groups = [blocks_of(text(512, f"g{g}")) for g in range(8)]
    first = {}
    for g, prompt in enumerate(groups):
        choice = p.prefill(ENGINES, prompt, loads())
        assert choice is not None
        p.record(choice.engine, prompt)
        first[g] = choice.engine
    for _ in range(3):
        for g, prompt in enumerate(groups):
            choice = p.prefill(ENGINES, prompt, loads())
            assert choice is not None and choice.engine == first[g] and choice.reason == "hit"


def test_the_same_state_gives_the_same_choice_in_every_process() -> None:
    """Rendezvous ties: two placers (two workers) with the same state pick the same engine for each prompt."""
    a, b = placer(), Placer(PrefixIndex(ENGINES, max_bytes=1 << 20), rng=random.Random(99))
    for g in range(20):
        prompt = blocks_of(text(200, f"r{g}"))
        first, second = a.prefill(ENGINES, prompt, loads()), b.prefill(ENGINES, prompt, loads())
        assert first is not None and second is not None and first.engine == second.engine


def test_misses_spread_distinct_prefixes_over_engines() -> None:
    p = placer()
    chosen = Counter(p.prefill(ENGINES, blocks_of(text(200, f"m{g}")), loads()).engine  # type: ignore[union-attr]
                     for g in range(200))
    assert set(chosen) == set(ENGINES) and min(chosen.values()) > 20


def test_an_engine_restart_forgets_its_entries() -> None:
    p = placer()
    p.record("p2", HOT)
    assert p.prefill(ENGINES, HOT, loads()).engine == "p2"  # type: ignore[union-attr]
    p.index.forget("p2")
    choice = p.prefill(ENGINES, HOT, loads(p1=1, p3=1, p4=1))
    assert choice is not None and choice.reason == "miss" and choice.engine == "p2"  # least loaded, empty


def test_least_outstanding_policy_ignores_prefixes() -> None:
    p = Placer(PrefixIndex(ENGINES, max_bytes=1 << 20), cache_aware=False, rng=random.Random(1))
    p.record("p2", HOT)
    assert p.index.entries("p2") == 0
    choice = p.prefill(ENGINES, HOT, loads(p1=1, p2=1, p3=0, p4=1))
    assert choice is not None and (choice.engine, choice.reason) == ("p3", "least_outstanding")


def test_decode_is_least_outstanding() -> None:
    p = placer()
    choice = p.decode(["d1", "d2"], loads(d1=3, d2=1))
    assert choice is not None and (choice.engine, choice.reason) == ("d2", "least_outstanding")
    assert p.decode(["d1"], loads(d1=9)).reason == "only_choice"  # type: ignore[union-attr]


def test_block_hashes_are_the_running_hash_read_out_after_each_block():
    # Worker processes and the controller must agree on every hash: block i is blake2b-8 of blocks 0..i.
    data = bytes(range(256)) * 3
    for size in (1, 16, 64, 100):
        expected = [int.from_bytes(hashlib.blake2b(data[:end], digest_size=8).digest(), "little")
                    for end in range(size, len(data) - len(data) % size + 1, size)]
        assert _chain(data, size) == expected
    assert _chain(b"short", 64) == []


def test_rendezvous_spreads_ties_evenly_and_moves_only_a_leaving_engines_prompts() -> None:
    """Over random prompt anchors each of 16 tied engines wins about a sixteenth; without one engine, only the
    anchors it won move, each to an engine that stays."""
    p = placer()
    engines = [f"e{i}" for i in range(16)]
    rng = random.Random(40)
    anchors = [rng.getrandbits(64) for _ in range(16_000)]
    won = {anchor: p.rendezvous(engines, anchor) for anchor in anchors}
    counts = Counter(won.values())
    # Chi-square over 15 degrees of freedom: 37.7 is its 0.1% tail; a biased score lands in the hundreds.
    assert sum((counts[name] - 1000) ** 2 / 1000 for name in engines) < 37.7
    # Consecutive anchors (a structured input) spread too, over 64 engines: the anchor is mixed before the
    # per-engine hash (unmixed, chi-square 181 here; 103.4 is the 0.1% tail over 63 degrees of freedom).
    many = [f"e{i}" for i in range(64)]
    consecutive = Counter(p.rendezvous(many, anchor) for anchor in range(32_000))
    assert sum((consecutive[name] - 500) ** 2 / 500 for name in many) < 103.4
    without = [name for name in engines if name != "e5"]
    for anchor, name in won.items():
        again = p.rendezvous(without, anchor)
        assert again == name if name != "e5" else again in without


def test_rendezvous_is_the_same_in_another_process_with_another_hash_seed() -> None:
    """Worker processes and other routers must agree: the score does not use Python's per-process str hash."""
    engines = [f"engine-{i}" for i in range(32)]
    anchors = [random.Random(7).getrandbits(64) + i for i in range(200)]
    here = [placer().rendezvous(engines, anchor) for anchor in anchors]
    script = ("import json, sys; from narwhal.fleet.placement import Placer; "
              "from narwhal.fleet.placement.prefix_index import PrefixIndex; "
              "engines, anchors = json.load(sys.stdin); p = Placer(PrefixIndex([], max_bytes=0)); "
              "print(json.dumps([p.rendezvous(engines, a) for a in anchors]))")
    for seed in ("1", "4242"):
        out = subprocess.run([sys.executable, "-c", script], input=json.dumps([engines, anchors]),
                             capture_output=True, text=True, check=True, timeout=60,
                             env={**os.environ, "PYTHONHASHSEED": seed})
        assert json.loads(out.stdout) == here
