"""The router's processes collect garbage as a server should: startup frozen, the young generation less often."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from narwhal import cli
from narwhal.gc_tuning import GEN0_THRESHOLD, tune_for_serving
from narwhal.obs import logs
from tests.test_config import GOOD


@pytest.fixture
def restored_gc() -> Iterator[None]:
    """Whatever a test does to the collector, the next test gets Python's settings back."""
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_tuning_freezes_what_exists_and_raises_only_the_young_threshold(restored_gc) -> None:
    gc.set_threshold(700, 11, 12)
    made_at_startup: list[list[int]] = [[] for _ in range(10)]
    tune_for_serving()
    # Frozen: out of every later collection's walk (a full collection of 60,000 startup objects was 40 ms).
    assert gc.get_freeze_count() > len(made_at_startup)
    walked = {id(o) for o in gc.get_objects()}
    assert not walked & {id(o) for o in made_at_startup}
    # The older generations keep their own thresholds: only the young one is crossed by requests in flight.
    assert gc.get_threshold() == (GEN0_THRESHOLD, 11, 12)


def test_a_young_collection_waits_for_the_threshold(restored_gc) -> None:
    tune_for_serving()
    collected: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collected.append(info["generation"])

    gc.collect()
    gc.callbacks.append(seen)
    try:
        # More container objects alive at once than Python's default (700) lets pass without a collection.
        held = [[] for _ in range(GEN0_THRESHOLD // 2)]
        assert collected == []
        held += [[] for _ in range(GEN0_THRESHOLD)]
        assert collected, "past the threshold the young generation is collected"
    finally:
        gc.callbacks.remove(seen)


def _run_recorded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[int, int, int], int]]:
    """trio.run replaced by a recorder of the collector's settings at the moment serving would start."""
    seen: list[tuple[tuple[int, int, int], int]] = []

    def run(*args: object, **kwargs: object) -> None:
        seen.append((gc.get_threshold(), gc.get_freeze_count()))

    monkeypatch.setattr(trio, "run", run)
    # The test process keeps its own logging (serve and worker would send it to stderr as JSON lines).
    monkeypatch.setattr(logs, "configure_logging", lambda level="info": None)
    return seen


def test_serve_tunes_the_collector_before_it_serves(tmp_path: Path, monkeypatch, restored_gc) -> None:
    config = tmp_path / "narwhal.toml"
    config.write_text(f'[handoff]\npath = "{tmp_path / "handoff.json"}"\n' + GOOD)
    seen = _run_recorded(monkeypatch)
    assert cli.main(["serve", "--config", str(config)]) == 0
    [(threshold, frozen)] = seen
    assert threshold[0] == GEN0_THRESHOLD and frozen > 0


def test_a_worker_tunes_the_collector_before_it_serves(monkeypatch, restored_gc) -> None:
    seen = _run_recorded(monkeypatch)
    assert cli.main(["worker", "--index", "0", "--control-fd", "98", "--listen-fd", "99"]) == 0
    [(threshold, frozen)] = seen
    assert threshold[0] == GEN0_THRESHOLD and frozen > 0


def test_a_bad_config_exits_before_tuning(tmp_path: Path, monkeypatch, restored_gc) -> None:
    config = tmp_path / "narwhal.toml"
    config.write_text("[serving]\nlisten = 5\n")
    seen = _run_recorded(monkeypatch)
    assert cli.main(["serve", "--config", str(config)]) == 2
    assert seen == [] and gc.get_threshold()[0] != GEN0_THRESHOLD
