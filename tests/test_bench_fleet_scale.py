"""``bench --scenario fleet``: its options, its parsing of /metrics, and one small run end to end."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from narwhal.tools.bench import scale
from narwhal.tools.bench.cli import build_parser, settings_from_args
from narwhal.tools.bench.scale import fleet_split, metric_samples
from tests.fleet_page_script import page_script

REPO = Path(__file__).resolve().parents[1]


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    build_parser(parser)
    return parser.parse_args(list(argv))


def test_fleet_defaults() -> None:
    settings = settings_from_args(_args("--scenario", "fleet"))
    assert settings.fleet_sizes == (4, 64, 256) and settings.fleet_idle_s == 10.0
    assert (settings.concurrency, settings.tokens, settings.requests, settings.duration_s) == (64, 32, 3000, None)
    assert settings.mock_writes == "per-event" and settings.token_delay_s == 0.0
    # The other scenarios keep theirs.
    plain = settings_from_args(_args())
    assert (plain.concurrency, plain.mock_writes) == (16, "batched")
    assert settings_from_args(_args("--scenario", "fleet", "--fleet-sizes", "2,8", "--concurrency", "8")) \
        .fleet_sizes == (2, 8)


@pytest.mark.parametrize("argv", [
    ("--fleet-sizes", "1,4"),
    ("--fleet-sizes", "8,4"),
    ("--fleet-sizes", "4,4"),
    ("--fleet-sizes", "four"),
    ("--fleet-sizes", ""),
    ("--prefill", "2"),
    ("--target", "http://127.0.0.1:1"),
    ("--baseline", "direct"),
    ("--fleet-idle-s", "0"),
])
def test_bad_fleet_options(argv: tuple[str, ...]) -> None:
    with pytest.raises(ValueError):
        settings_from_args(_args("--scenario", "fleet", *argv))


def test_a_quarter_of_each_fleet_prefills() -> None:
    assert [fleet_split(n) for n in (2, 4, 7, 64, 256)] == [(1, 1), (1, 3), (1, 6), (16, 48), (64, 192)]
    with pytest.raises(ValueError):
        fleet_split(1)


def test_metric_samples_reads_one_metric_and_not_its_longer_namesakes() -> None:
    text = ("# HELP narwhal_handoff_bytes Size.\n# TYPE narwhal_handoff_bytes gauge\nnarwhal_handoff_bytes 2048\n"
            'narwhal_handoff_write_seconds_bucket{le="0.001"} 3\nnarwhal_handoff_write_seconds_count 4\n')
    assert metric_samples(text, "narwhal_handoff_bytes") == [("", 2048.0)]
    assert metric_samples(text, "narwhal_handoff_write_seconds_bucket") == [('le="0.001"', 3.0)]
    assert metric_samples(text, "narwhal_handoff_write_seconds") == []


@pytest.mark.e2e
def test_fleet_scenario_reports_every_figure_per_size(tmp_path: Path) -> None:
    out = tmp_path / "fleet.json"
    requests = 120
    done = subprocess.run([sys.executable, "-m", "narwhal", "bench", "--scenario", "fleet", "--fleet-sizes", "2,4",
                           "--fleet-idle-s", "0.5", "--requests", str(requests), "--concurrency", "8", "--quiet",
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for row in ("idle CPU ms / s", "router CPU ms / request", "router CPU ms / request less scrapes",
                "monitor pass s median / max", "handoff KiB",
                "/admin/engines", "fleet page /admin/ui", "memory per engine KiB"):
        assert row in done.stdout
    report = json.loads(out.read_text())
    scale = report["fleet_scale"]
    sizes = scale["sizes"]
    assert [(s["engines"], s["prefill"], s["decode"]) for s in sizes] == [(2, 1, 1), (4, 1, 3)]
    assert report["run"] == sizes[-1]["run"]
    assert set(scale["cpu_per_request_vs_smallest"]) == {"2", "4"}
    assert scale["cpu_per_request_vs_smallest"]["2"] == 1.0 and scale["cpu_per_request_vs_smallest"]["4"] > 0
    assert scale["cpu_per_request_less_scrapes_vs_smallest"]["2"] == 1.0
    for size in sizes:
        # Less the scenario's own /metrics scrapes, the load still cost the router something.
        assert 0 < size["cpu_ms_per_request_less_scrapes"] <= size["run"]["router"]["cpu_ms_per_request"]
        assert size["metrics_scrape_cpu_ms"] >= 0 and size["metrics_scrapes"] >= 1
        load = size["run"]["load"]
        assert (load["ok"], load["errors"]) == (requests, 0) and load["requests_per_s"] > 0
        assert load["ttft"]["p50_ms"] > 0 and size["run"]["router"]["cpu_ms_per_request"] > 0
        assert size["ready_s"] > 0 and size["idle_cpu_ms_per_s"] >= 0
        assert size["monitor_pass_samples"] >= 0
        if size["monitor_pass_samples"]:
            assert 0 < size["monitor_pass_median_s"] <= size["monitor_pass_max_s"] < 5
        # The handoff lists every engine: it grows with the fleet; each write was timed.
        assert size["handoff_bytes"] > 0 and size["handoff_writes"] >= 1 and size["handoff_write_mean_ms"] > 0
        answers = {a["path"]: a for a in size["answers"]}
        page_reads = ("/admin/engines", "/admin/router", "/admin/timeline?seconds=3", "/admin/discovery",
                      "/admin/placement", "/admin/cluster", "/admin/tenants")
        assert set(answers) == {*page_reads, "/admin/ui", "/admin/timeline", "/metrics"}
        assert all(a["status"] == 200 and a["bytes"] > 0 and a["ms"] >= 0 for a in answers.values())
        # The page reads the timeline's whole window when it opens, then only the seconds since.
        assert answers["/admin/timeline?seconds=3"]["bytes"] < answers["/admin/timeline"]["bytes"]
        assert size["fleet_page_refresh_bytes"] == sum(answers[p]["bytes"] for p in page_reads)
        assert size["rss_mb"] > 10
    assert sizes[1]["handoff_bytes"] > sizes[0]["handoff_bytes"]
    assert sizes[1]["answers"][0]["bytes"] > sizes[0]["answers"][0]["bytes"]  # /admin/engines lists 4, not 2
    assert sizes[0]["memory_per_engine_kb"] is None and isinstance(sizes[1]["memory_per_engine_kb"], float)


def test_the_page_reads_the_scenario_counts_are_the_pages_own() -> None:
    # What the fleet page fetches each refresh (its script's getJSON calls; the timeline through getTimeline,
    # whose steady read is the seconds since) is what "KiB read per refresh" adds up.
    refresh = page_script().split("async function refresh()", 1)[1].split("\n}\n", 1)[0]
    fetched = re.findall(r'getJSON\("(/admin/[a-z]+)"\)', refresh)
    assert "getTimeline()" in refresh
    assert set(scale._FLEET_PAGE_READS) == {*fetched, "/admin/timeline?seconds=3"}
