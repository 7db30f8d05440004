"""The bench's client-key measurements (issue 39): --auth, --compare-auth and --scenario priority.

Their options, the keys file the bench writes, the request head with the key, the queue-wait
histogram's quantiles, the figures and the table; end to end, a tiny priority scenario.
"""

from __future__ import annotations

import argparse
import json
import stat
import subprocess
import sys
import time
from array import array
from pathlib import Path

import httptools
import msgspec
import pytest

from narwhal.auth.keys import KeyStore, hash_key, read_keys_file
from narwhal.tools.bench.auth import auth_sections, write_keys_file
from narwhal.tools.bench.auth_compare import auth_comparison
from narwhal.tools.bench.cli import build_parser, settings_from_args
from narwhal.tools.bench.load import LoadResult, LoadSpec, RequestRecord, bearer_header, build_request
from narwhal.tools.bench.priority import (
    TENANTS,
    Histogram,
    histogram_quantile,
    priority_figures,
    queue_wait_histograms,
)
from narwhal.tools.bench.report import BenchReport, RunReport, format_report, process_usage, summarize_load

REPO = Path(__file__).resolve().parent.parent


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    build_parser(parser)
    return parser.parse_args(list(argv))


# ----- options ---------------------------------------------------------------------------------------

def test_auth_options_and_priority_defaults() -> None:
    plain = settings_from_args(_args())
    assert (plain.auth, plain.compare_auth) == (False, False)
    assert settings_from_args(_args("--auth")).auth
    compare = settings_from_args(_args("--compare-auth", "--auth-rounds", "3", "--concurrency", "64"))
    assert (compare.auth, compare.compare_auth, compare.auth_rounds, compare.concurrency) == (True, True, 3, 64)
    assert settings_from_args(_args("--compare-auth")).auth_rounds == 2
    priority = settings_from_args(_args("--scenario", "priority"))
    assert (priority.duration_s, priority.token_delay_s, priority.requests) == (20.0, 0.005, None)
    assert (priority.priority_max_connections, priority.priority_reserve_high,
            priority.priority_concurrency) == (8, 0.125, 4)
    tuned = settings_from_args(_args("--scenario", "priority", "--duration-s", "5", "--token-delay-s", "0.01",
                                     "--priority-max-connections", "4", "--priority-reserve-high", "0.25",
                                     "--priority-concurrency", "2"))
    assert (tuned.duration_s, tuned.token_delay_s, tuned.priority_max_connections, tuned.priority_reserve_high,
            tuned.priority_concurrency) == (5.0, 0.01, 4, 0.25, 2)


@pytest.mark.parametrize("argv", [
    ("--auth", "--target", "http://127.0.0.1:1"),
    ("--compare-auth", "--router-cmd", "x {port}"),
    ("--scenario", "priority", "--router-cmd", "x {port}"),
    ("--auth", "--scenario", "faults"),
    ("--compare-auth", "--scenario", "prefix"),
    ("--compare-auth", "--tls"),
    ("--compare-auth", "--baseline", "direct"),
    ("--compare-auth", "--models", "2"),
    ("--auth-rounds", "2"),
    ("--compare-auth", "--auth-rounds", "0"),
    ("--scenario", "priority", "--auth"),
    ("--scenario", "priority", "--compare-auth"),
    ("--scenario", "priority", "--target", "http://127.0.0.1:1"),
    ("--scenario", "priority", "--requests", "10"),
    ("--scenario", "priority", "--concurrency", "10"),
    ("--scenario", "priority", "--tls"),
    ("--scenario", "priority", "--priority-max-connections", "1"),
    ("--scenario", "priority", "--priority-concurrency", "0"),
    ("--scenario", "priority", "--priority-reserve-high", "1"),
    ("--scenario", "priority", "--priority-reserve-high", "-0.1"),
])
def test_bad_auth_option_combinations(argv: tuple[str, ...]) -> None:
    with pytest.raises(ValueError):
        settings_from_args(_args(*argv))


# ----- the keys file and the request head -----------------------------------------------------------

def test_the_keys_file_the_bench_writes_is_one_the_router_reads(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    keys = write_keys_file(path, [(name, priority) for name, priority, _ in TENANTS])
    loaded = read_keys_file(path)
    assert [(entry.name, entry.priority) for entry in loaded.keys] == [(n, p) for n, p, _ in TENANTS]
    for entry in loaded.keys:
        assert entry.sha256 == hash_key(keys[entry.name])
        assert (entry.models, entry.requests_per_minute, entry.tokens_per_minute, entry.max_concurrent) == (
            None, None, None, None)
    # The keys themselves are not in the file, which only its owner reads.
    assert not any(key in path.read_text() for key in keys.values())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    store = KeyStore(loaded.keys)
    assert store.lookup(b"Bearer " + keys["low-a"].encode()).name == "low-a"  # type: ignore[union-attr]
    section = auth_sections(path, 0.125)["auth"]
    assert section == {"keys_file": str(path.resolve()), "reserve_high": 0.125}
    assert "reserve_high" not in auth_sections(path)["auth"]


class _Head:
    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = b""

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_body(self, body: bytes) -> None:
        self.body += body


def test_the_request_carries_the_key_once() -> None:
    spec = LoadSpec(host="127.0.0.1", port=1, body=b'{"a":1}', headers=bearer_header("nwk-abc"))
    head = _Head()
    httptools.HttpRequestParser(head).feed_data(build_request(spec))
    assert [value for name, value in head.headers if name == b"authorization"] == [b"Bearer nwk-abc"]
    assert head.body == b'{"a":1}'
    plain = _Head()
    httptools.HttpRequestParser(plain).feed_data(build_request(msgspec.structs.replace(spec, headers=b"")))
    assert b"authorization" not in dict(plain.headers) and plain.body == b'{"a":1}'
    with pytest.raises(ValueError):
        LoadSpec(host="h", port=1, body=b"", headers=b"authorization: x")


# ----- the queue-wait histogram ------------------------------------------------------------------------

_METRICS = """\
# TYPE narwhal_tenant_queue_wait_seconds histogram
narwhal_tenant_queue_wait_seconds_bucket{tenant="a",le="0.1"} 2
narwhal_tenant_queue_wait_seconds_bucket{tenant="a",le="1"} 6
narwhal_tenant_queue_wait_seconds_bucket{tenant="a",le="+Inf"} 8
narwhal_tenant_queue_wait_seconds_sum{tenant="a"} 12.5
narwhal_tenant_queue_wait_seconds_count{tenant="a"} 8
narwhal_tenant_queue_wait_seconds_bucket{tenant="b",le="0.1"} 0
narwhal_tenant_queue_wait_seconds_bucket{tenant="b",le="1"} 0
narwhal_tenant_queue_wait_seconds_bucket{tenant="b",le="+Inf"} 0
narwhal_tenant_requests_total{tenant="a",status="200"} 8
"""


def test_queue_wait_histograms_are_read_per_tenant() -> None:
    found = queue_wait_histograms(_METRICS)
    assert set(found) == {"a", "b"}
    assert found["a"].buckets == [(0.1, 2.0), (1.0, 6.0), (float("inf"), 8.0)]
    assert (found["a"].sum_s, found["a"].count) == (12.5, 8.0)
    since = found["a"].minus(Histogram(buckets=[(0.1, 1.0), (1.0, 1.0), (float("inf"), 1.0)], sum_s=0.5))
    assert since.buckets == [(0.1, 1.0), (1.0, 5.0), (float("inf"), 7.0)] and since.sum_s == 12.0


@pytest.mark.parametrize(("q", "expected"), [
    (0.25, 0.1),          # rank 2 ends the first bucket
    (0.125, 0.05),        # rank 1: halfway through the first bucket, from 0
    (0.5, 0.1 + 0.9 * 2 / 4),  # rank 4: the second of the 4 in (0.1, 1]
    (0.9, 1.0),           # in +Inf: the highest finite bound
])
def test_histogram_quantile_interpolates_within_the_bucket(q: float, expected: float) -> None:
    buckets = [(0.1, 2.0), (1.0, 6.0), (float("inf"), 8.0)]
    assert histogram_quantile(buckets, q) == pytest.approx(expected)


def test_histogram_quantile_of_nothing_is_none() -> None:
    assert histogram_quantile([], 0.5) is None
    assert histogram_quantile([(0.1, 0.0), (float("inf"), 0.0)], 0.5) is None
    # Empty buckets below the rank are skipped, not interpolated into.
    assert histogram_quantile([(0.1, 0.0), (1.0, 0.0), (10.0, 4.0), (float("inf"), 4.0)], 0.5) == 5.5


# ----- the figures and the table ----------------------------------------------------------------------

def _records(count: int, *, total_s: float, start_every_s: float = 0.1, kind: str = "ok",
             status: int = 200) -> list[RequestRecord]:
    records = []
    for i in range(count):
        record = RequestRecord(i * start_every_s)
        record.total_s, record.kind, record.status = total_s, kind, status
        records.append(record)
    return records


def _result(records: list[RequestRecord]) -> LoadResult:
    return LoadResult(records, array("d"), duration_s=10.0, wall_started_at=0.0, connections_opened=1,
                      stale_connection_retries=0)


def _hist(*waits_s: float) -> Histogram:
    bounds = (0.01, 0.1, 1.0, 10.0, 30.0, float("inf"))
    return Histogram(buckets=[(b, float(sum(1 for w in waits_s if w <= b))) for b in bounds], sum_s=sum(waits_s))


def _priority(normal_a: int = 45, normal_b: int = 55) -> BenchReport:
    results = {
        "high-a": _result(_records(50, total_s=0.2)),
        # normal-a: its first requests served in the window, one more after the clients stopped (at 10 s).
        "normal-a": _result(_records(normal_a, total_s=0.5) + _records(1, total_s=15.0)),
        "normal-b": _result(_records(normal_b, total_s=2.0, start_every_s=0.05)
                            + _records(2, total_s=0.0, kind="status", status=503)),
        "low-a": _result(_records(3, total_s=12.0)),
    }
    waits = {"high-a": _hist(*[0.005] * 50), "normal-a": _hist(*[0.3] * 46), "normal-b": _hist(*[1.8] * 55),
             "low-a": _hist(12.0, 12.0, 12.0)}
    figures = priority_figures(results, waits, concurrency=4, duration_s=10.0, max_connections=8,
                               reserve_high=0.125, max_queue=256)
    run = RunReport(label="narwhal (priority)", target="http://x",
                    load=summarize_load(kinds=["ok"], statuses=[200], ttft_s=[0.1], total_s=[0.1], gaps_s=(),
                                        tokens=1, duration_s=1.0))
    return BenchReport(settings={}, run=run, priority=figures)


def test_priority_figures_order_the_classes_and_share_the_normal_class() -> None:
    figures = _priority().priority
    assert figures is not None
    by_name = {t.tenant: t for t in figures.tenants}
    assert [t.tenant for t in figures.tenants] == ["high-a", "normal-a", "normal-b", "low-a"]
    assert [t.concurrency for t in figures.tenants] == [4, 4, 40, 4]
    assert (by_name["normal-a"].ok, by_name["normal-a"].ok_in_window) == (46, 45)
    assert (by_name["normal-b"].requests, by_name["normal-b"].errors_by_status) == (57, {"503": 2})
    assert by_name["high-a"].client_total_p50_ms == 200.0 and by_name["high-a"].queue_wait_count == 50
    assert by_name["low-a"].queue_wait_mean_ms == 12000.0
    waits = figures.class_queue_wait_p50_ms
    assert waits["high"] is not None and waits["normal"] is not None and waits["low"] is not None
    assert waits["high"] < 10 < waits["normal"] < 10000 < waits["low"]
    assert figures.ordered
    assert figures.fairness_shares == {"normal-a": 0.45, "normal-b": 0.55} and figures.fair
    unfair = _priority(normal_a=20, normal_b=80).priority
    assert unfair is not None and not unfair.fair
    assert unfair.fairness_shares == {"normal-a": 0.2, "normal-b": 0.8}


def test_the_order_fails_when_a_class_has_no_wait_or_is_out_of_order() -> None:
    results = {name: _result(_records(2, total_s=0.1)) for name, *_ in TENANTS}
    waits = {"high-a": _hist(2.0), "normal-a": _hist(0.5), "normal-b": _hist(0.5)}
    figures = priority_figures(results, waits, concurrency=1, duration_s=10.0, max_connections=8,
                               reserve_high=0.0, max_queue=256)
    assert figures.class_queue_wait_p50_ms["low"] is None and not figures.ordered


def test_the_priority_table() -> None:
    report = _priority()
    text = format_report(report)
    assert "priority scenario: max_connections 8, reserve_high 0.125, max_queue 256, clients for 10 s" in text
    assert "high-a (high)" in text and "normal-b (normal)" in text and "low-a (low)" in text
    assert "high < normal < low: pass" in text
    assert "normal-a 45.0 %, normal-b 55.0 %; each >= 40 %: pass" in text
    assert "503 2" in text
    decoded = json.loads(msgspec.json.encode(report))
    assert decoded["priority"]["fairness_shares"] == {"normal-a": 0.45, "normal-b": 0.55}
    assert "FAIL" in format_report(_priority(normal_a=20, normal_b=80))


def _pass(label: str, cpu_s: float, ok: int) -> RunReport:
    load = summarize_load(kinds=["ok"] * ok, statuses=[200] * ok, ttft_s=[0.01], total_s=[0.01], gaps_s=(),
                          tokens=ok, duration_s=1.0)
    return RunReport(label=label, target="http://x", load=load,
                     router=process_usage(pids=[1], cpu_s=cpu_s, wall_s=1.0, requests=ok, tokens=ok,
                                          peak_rss_kb=1024))


def test_auth_comparison_sums_each_mode_over_its_passes() -> None:
    passes = [_pass("auth off #1", 1.0, 1000), _pass("auth on #1", 1.1, 1000), _pass("auth off #2", 1.2, 1000),
              _pass("auth on #2", 1.2, 1000)]
    comparison = auth_comparison(passes, [False, True, False, True])
    assert (comparison.cpu_ms_per_request_off, comparison.cpu_ms_per_request_on) == (1.1, 1.15)
    assert comparison.ratio == pytest.approx(1.15 / 1.1, abs=1e-4)
    text = format_report(BenchReport(settings={}, run=passes[-1], auth_comparison=comparison))
    header = text.splitlines()[0]
    assert header.split("  ")[-1].strip() == "auth on #2" and "auth off #1" in header
    assert "auth off 1.1000, auth on 1.1500" in text and "OVER 3 %" in text
    within = auth_comparison([_pass("auth off #1", 1.0, 1000), _pass("auth on #1", 1.02, 1000)], [False, True])
    assert "within 3 %" in format_report(BenchReport(settings={}, run=passes[-1], auth_comparison=within))


# ----- end to end ---------------------------------------------------------------------------------------

@pytest.mark.e2e
def test_a_small_priority_scenario_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "narwhal", "bench", "--scenario", "priority", "--duration-s", "2",
                           "--priority-concurrency", "1", "--priority-max-connections", "4", "--tokens", "8",
                           "--token-delay-s", "0.01", "--json", str(out), "--quiet"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 30
    assert "high < normal < low:" in done.stdout and "each >= 40 %:" in done.stdout
    report = json.loads(out.read_text())
    tenants = {t["tenant"]: t for t in report["priority"]["tenants"]}
    assert set(tenants) == {"high-a", "normal-a", "normal-b", "low-a"}
    # Every tenant's key was accepted: requests served, none refused 401; the router saw each one wait.
    for figures in tenants.values():
        assert figures["ok"] >= 1 and "401" not in figures["errors_by_status"]
        assert figures["queue_wait_count"] == figures["ok"]
    assert tenants["normal-b"]["concurrency"] == 10
    assert report["settings"]["scenario"] == "priority"


@pytest.mark.e2e
def test_a_load_with_client_auth_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, "-m", "narwhal", "bench", "--auth", "--requests", "100", "--concurrency",
                           "4", "--json", str(out), "--quiet"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "narwhal (auth)" in done.stdout.splitlines()[0]
    report = json.loads(out.read_text())
    # Every request carried the key: none refused (a request without it is a 401).
    assert (report["run"]["load"]["ok"], report["run"]["load"]["errors"]) == (100, 0)
    assert report["settings"]["auth"] is True and report["run"]["router"]["cpu_s"] > 0


def test_a_router_command_gets_the_keys_file_only_with_auth(tmp_path: Path) -> None:
    from narwhal.tools.bench.fleet import BenchFleet, CommandTemplateError, command_for

    class Engine:
        def __init__(self, port: int) -> None:
            self.url = f"http://127.0.0.1:{port}"

    fleet = BenchFleet({"p1": Engine(1), "d1": Engine(2)},  # type: ignore[dict-item]
                       {"p1": "prefill", "d1": "decode"}, [])
    keys = tmp_path / "keys.toml"
    argv = command_for("r {port} auth.keys_file={keys_file}", fleet, port=9, metrics_port=10, keys_file=keys)
    assert argv == ["r", "9", f"auth.keys_file={keys}"]
    with pytest.raises(CommandTemplateError):
        command_for("r {keys_file}", fleet, port=9, metrics_port=10)
    assert settings_from_args(_args("--auth", "--router-cmd", "r {port} {keys_file}")).auth
