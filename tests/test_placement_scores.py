"""Placement scored from the engines' own KV events (``Scores``): the same bound and steps, other matches."""

from __future__ import annotations

import random

from narwhal.fleet.placement import Placer, PrefixIndex, Scores

ENGINES = ["e0", "e1", "e2", "e3"]


def _placer() -> Placer:
    return Placer(PrefixIndex(ENGINES, max_bytes=1 << 20), rng=random.Random(7))


def _load(loads: dict[str, int]):
    return lambda name: loads.get(name, 0)


def test_the_longest_held_run_wins_whatever_the_index_says() -> None:
    placer = _placer()
    blocks = [11, 12, 13, 14]
    # The approximate index believes e0 holds the prompt (the engine has since evicted it).
    placer.index.record("e0", blocks, 1.0)
    choice = placer.prefill(ENGINES, blocks, _load({}), Scores([0, 32, 64, 0], 64, [0, 10, 10, 0]))
    assert choice is not None
    assert (choice.engine, choice.reason, choice.matched) == ("e2", "hit", 1.0)


def test_a_better_holder_past_the_balance_bound_spills_to_the_best_within_it() -> None:
    placer = _placer()
    loads = {"e0": 0, "e1": 0, "e2": 20, "e3": 0}
    choice = placer.prefill(ENGINES, [1, 2], _load(loads), Scores([0, 16, 64, 0], 64, [0, 0, 0, 0]))
    assert choice is not None
    assert (choice.engine, choice.reason, choice.matched) == ("e1", "spill", 0.25)


def test_a_miss_goes_to_the_least_loaded_holding_least() -> None:
    placer = _placer()
    loads = {"e0": 1, "e1": 0, "e2": 0, "e3": 0}
    choice = placer.prefill(ENGINES, [1, 2], _load(loads), Scores([0, 0, 0, 0], 64, [0, 50, 3, 9]))
    assert choice is not None
    assert (choice.engine, choice.reason, choice.matched) == ("e2", "miss", 0.0)


def test_equal_holders_are_told_apart_by_load_then_alike_in_every_router() -> None:
    # Two routers with different histories (one placed the prompt on e3 lately) pick the same engine.
    a, b = _placer(), Placer(PrefixIndex(ENGINES, max_bytes=1 << 20), rng=random.Random(99))
    b.index.record("e3", [5, 6, 7, 8], 100.0)
    scores = Scores([64, 0, 64, 64], 64, [1, 1, 1, 1])
    first = a.prefill(ENGINES, [5, 6, 7, 8], _load({"e0": 2}), scores)
    second = b.prefill(ENGINES, [5, 6, 7, 8], _load({"e0": 2}), scores)
    assert first is not None and second is not None
    assert first.engine == second.engine != "e0"


def test_scores_are_ignored_with_one_candidate_or_the_least_outstanding_policy() -> None:
    placer = _placer()
    only = placer.prefill(["e1"], [1], _load({}), Scores([0], 16, [0]))
    assert only is not None and only.reason == "only_choice"
    placer.cache_aware = False
    plain = placer.prefill(ENGINES, [1], _load({}), Scores([16, 0, 0, 0], 16, [0, 0, 0, 0]))
    assert plain is not None and plain.reason == "least_outstanding"
