"""bench --scenario prefix --compare-kv-events / --routers N: options, the best possible hit rate, the report."""

from __future__ import annotations

import argparse
import json

import pytest

from narwhal.tools.bench.cli import build_parser, settings_from_args
from narwhal.tools.bench.load import LoadSpec, completion_body, run_load
from narwhal.tools.bench.placement import pass_modes
from narwhal.tools.bench.prefix import PlacementPass, PrefixReport, PrefixWorkload, same_engine_share
from narwhal.tools.bench.report import BenchReport, RunReport, format_report, summarize_load
from narwhal.tools.mock.engine import MockSettings, serve_mock


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    build_parser(parser)
    return parser.parse_args(list(argv))


def test_compare_and_routers_make_the_prefill_mocks_publish() -> None:
    settings = settings_from_args(_args("--scenario", "prefix", "--compare-kv-events", "--routers", "2"))
    assert settings.placement_passes and (settings.compare_kv_events, settings.routers) == (True, 2)
    assert settings.mock_args[-4:] == ["--kv-events", "0", "--kv-events-replay", "0"]
    plain = settings_from_args(_args("--scenario", "prefix"))
    assert not plain.placement_passes and "--kv-events" not in plain.mock_args
    assert settings_from_args(_args("--scenario", "prefix", "--routers", "2")).placement_passes


@pytest.mark.parametrize("argv", [
    ("--compare-kv-events",),
    ("--routers", "2"),
    ("--scenario", "prefix", "--routers", "0"),
    ("--scenario", "prefix", "--compare-kv-events", "--chat-turns", "2"),
    ("--scenario", "prefix", "--compare-kv-events", "--mock-cache-blocks", "0"),
    ("--scenario", "prefix", "--routers", "2", "--tls"),
    ("--scenario", "prefix", "--routers", "2", "--baseline", "direct"),
])
def test_bad_placement_pass_options(argv: tuple[str, ...]) -> None:
    with pytest.raises(ValueError):
        settings_from_args(_args(*argv))


def test_pass_modes() -> None:
    assert pass_modes(True, {}) == ["auto", "off"]
    assert pass_modes(False, {}) == ["auto"]
    assert pass_modes(False, {"placement": {"kv_events": "off"}}) == ["off"]


def test_best_hit_rate_counts_whole_prefix_blocks_after_each_groups_first() -> None:
    # 40-word prefixes: 2 whole blocks (32 tokens) can be cached; prompts of 44 tokens.
    workload = PrefixWorkload(prefixes=2, prefix_words=40, suffix_words=4, skew=0.0, chat_turns=0,
                              max_tokens=1, stream=False)
    groups = [json.loads(workload())["prompt"].split()[0][:2] for _ in range(10)]
    firsts = len(set(groups))
    assert workload.best_hit_rate == round((10 - firsts) * 32 / (10 * 44), 4)
    # After the warm-up every group has been seen: every measured request could hit.
    workload.start_measuring()
    for _ in range(5):
        workload()
    assert workload.best_hit_rate == round(32 / 44, 4)
    chat = PrefixWorkload(prefixes=2, prefix_words=40, suffix_words=4, skew=0.0, chat_turns=2, max_tokens=1,
                          stream=False)
    chat()
    assert chat.best_hit_rate is None


def test_same_engine_share() -> None:
    assert same_engine_share({}) is None
    # Prefix a: 3 of 4 on p1; prefix b: all 4 on p2.
    assert same_engine_share({"a": {"p1": 3, "p2": 1}, "b": {"p2": 4}}) == 0.875


def _pass(name: str, mode: str, hit: float, same: float, ttft: float) -> PlacementPass:
    prefix = PrefixReport(hit_rate=hit, largest_prefill_share=0.3, engines=[], workload={}, best_hit_rate=0.94,
                          hit_rate_vs_best=round(hit / 0.94, 4), same_engine_share=same)
    return PlacementPass(name=name, kv_events=mode, routers=2, requests=400, errors=0, requests_per_s=100.0,
                         ttft_p50_ms=ttft, ttft_p99_ms=2 * ttft, prefix=prefix,
                         feeds=[{"p1": "live"}, {"p1": "live"}] if mode == "auto" else [])


def test_the_report_has_a_row_per_pass() -> None:
    load = summarize_load(kinds=["ok"], statuses=[200], ttft_s=[0.01], total_s=[0.02], gaps_s=[], tokens=8,
                          duration_s=1.0)
    passes = [_pass("precise", "auto", 0.94, 0.998, 30.0), _pass("approximate", "off", 0.79, 0.665, 16.0)]
    report = BenchReport(settings={}, run=RunReport(label="precise x2", target="t", load=load),
                         prefix=passes[0].prefix, placement_passes=passes)
    text = format_report(report)
    assert "best possible hit rate                    0.940 (hit rate / best 1.000)" in text
    assert "prefills on their prefix's usual engine   0.998" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines()
            if line.startswith(("  precise ", "  approximate ")) and "feeds" not in line}
    assert rows["precise"][1:7] == ["auto", "2", "0.940", "0.940", "1.000", "0.998"]
    assert rows["approximate"][1:9] == ["off", "2", "0.790", "0.940", "0.840", "0.665", "16.0ms", "32.0ms"]
    assert "precise x2 feeds by router: p1 live; p1 live" in text


async def test_a_load_over_several_ports_splits_by_worker(nursery) -> None:
    mocks = [await nursery.start(serve_mock, MockSettings(role="decode", engine_id=f"d{i}", tokens=2))
             for i in (1, 2)]
    body = completion_body(prompt_words=4, max_tokens=2, stream=False, kv_transfer_params={
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p1", "remote_block_ids": [1],
        "remote_host": "127.0.0.1", "remote_port": 9, "tp_size": 1})
    spec = LoadSpec(host="127.0.0.1", port=1, body=body, concurrency=4, requests=40, duration_s=None,
                    stream=False, timeout_s=5.0, ports=tuple(mock.engine.port for mock in mocks))
    result = await run_load(spec)
    assert result.ok == 40
    served = [mock.engine.stats.decode for mock in mocks]
    assert sum(served) == 40 and min(served) > 0
    # Each record knows its router: the counts per router are the ones each mock saw.
    assert result.ok_by_target(2) == served
    for mock in mocks:
        mock.stop(0)


async def test_the_mock_counts_prefills_by_their_first_block(nursery) -> None:
    service = await nursery.start(serve_mock, MockSettings(role="prefill", engine_id="p1", tokens=1,
                                                           prefix_cache_blocks=50))
    prompts = ["a " * 20 + "x", "a " * 20 + "y", "b " * 20 + "z"]
    bodies = iter(json.dumps({"model": "mock-model", "prompt": p, "max_tokens": 1}).encode() for p in prompts)
    spec = LoadSpec(host="127.0.0.1", port=service.engine.port, body=b"", concurrency=1, requests=3,
                    duration_s=None, stream=False, timeout_s=5.0)
    assert (await run_load(spec, bodies=lambda: next(bodies))).ok == 3
    assert sorted(service.engine.stats.describe()["prefills_by_first_block"].values()) == [1, 2]
    service.stop(0)
