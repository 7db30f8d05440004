"""``bench --scenario prefix --compare-kv-events`` / ``--routers N``: placement passes on one mock fleet.

One fleet of prefill mocks that publish their KV events; per pass, ``routers``
Narwhal processes in front of it (each its own config and handoff file), the
load split between them by client worker. With N >= 2 they form one cluster
(``[lease] mode = "replicas"`` on one etcd, narwhal.tools.bench.cluster) unless
``--independent-routers``. ``--compare-kv-events`` runs a precise pass
(``[placement] kv_events = "auto"``) then an approximate one (``"off"``);
``--compare-routers`` runs a lone router before the N routers. The mocks' caches
are emptied (``POST /reset_prefix_cache``) before each pass, and each pass sends
the same request sequence, so only the placement (or the routers) differs.
"""

from __future__ import annotations

import secrets
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import msgspec
import trio

from narwhal.tools.bench import procstat
from narwhal.tools.bench.cluster import (
    CLUSTER_KEY_PREFIX,
    RoutersComparison,
    cluster_lease,
    compare_routers,
    router_roles,
    router_usage,
    wait_for_cluster,
    write_cluster_token,
)
from narwhal.tools.bench.etcd import BenchEtcd, start_etcd
from narwhal.tools.bench.fleet import (
    BenchFleet,
    Target,
    make_workdir,
    narwhal_sections,
    start_fleet,
    start_narwhal,
    wait_until_serving,
)
from narwhal.tools.bench.load import LoadSpec, completion_body, run_load
from narwhal.tools.bench.measure import measured_load
from narwhal.tools.bench.prefix import PlacementPass, PrefixWorkload, collect_prefix_report
from narwhal.tools.bench.report import BenchReport, RunReport
from narwhal.tools.bench.runner import BenchSettings

__all__ = ["ClusterPlan", "PassPlan", "comparisons", "pass_modes", "pass_plan", "router_sections",
           "run_placement_passes"]

# How long a pass waits for every router's feeds to be live before loading anyway (recorded in the pass).
_FEEDS_LIVE_TIMEOUT_S = 20.0
_PASS_NAMES = {"auto": "precise", "required": "precise", "off": "approximate"}


def pass_modes(compare: bool, overrides: dict[str, dict[str, Any]]) -> list[str]:
    """The ``kv_events`` value of each pass: auto then off to compare, else the configured one."""
    if compare:
        return ["auto", "off"]
    return [str(overrides.get("placement", {}).get("kv_events", "auto"))]


async def _reset_caches(client: httpx.AsyncClient, fleet: BenchFleet) -> None:
    """Empty every prefill mock's prefix cache (vLLM's route; the feed says AllBlocksCleared)."""
    for url in fleet.urls("prefill"):
        response = await client.post(url + "/reset_prefix_cache")
        if response.status_code != 200:
            raise RuntimeError(f"{url}/reset_prefix_cache answered {response.status_code}")


async def _feed_states(client: httpx.AsyncClient, router: Target) -> dict[str, str]:
    """Per prefill engine, the kv_events state in the router's ``/admin/placement`` (empty on an error)."""
    try:
        body = (await client.get(router.url + "/admin/placement")).json()
    except (httpx.HTTPError, ValueError):
        return {}
    engines = body.get("engines") if isinstance(body, dict) else None
    if not isinstance(engines, dict):
        return {}
    return {name: str((view.get("kv_events") or {}).get("state")) for name, view in engines.items()
            if isinstance(view, dict)}


async def _wait_feeds_live(client: httpx.AsyncClient, routers: Sequence[Target], engines: int) -> None:
    """Until every router sees every prefill engine's feed live, or the timeout (then the pass says so)."""
    with trio.move_on_after(_FEEDS_LIVE_TIMEOUT_S):
        while True:
            states = [await _feed_states(client, router) for router in routers]
            if all(sum(state == "live" for state in feed.values()) >= engines for feed in states):
                return
            await trio.sleep(0.2)


class PassPlan(msgspec.Struct, frozen=True, kw_only=True):
    """One pass: its kv_events mode, how many routers, and whether they form one cluster."""

    mode: str
    routers: int
    cluster: bool = False


def pass_plan(settings: BenchSettings) -> list[PassPlan]:
    """The passes, per kv_events mode: with ``--compare-routers`` a lone router, then (for a cluster) the same N
    routers with no lease, so the cluster's own cost shows apart from the load's split; then the N routers."""
    plan: list[PassPlan] = []
    for mode in pass_modes(settings.compare_kv_events, settings.overrides):
        if settings.compare_routers:
            plan.append(PassPlan(mode=mode, routers=1))
            if settings.cluster:
                plan.append(PassPlan(mode=mode, routers=settings.routers))
        plan.append(PassPlan(mode=mode, routers=settings.routers, cluster=settings.cluster))
    return plan


def router_sections(settings: BenchSettings, own: Path, mode: str, index: int,
                    cluster: ClusterPlan | None) -> dict[str, dict[str, Any]]:
    """Router ``index``'s (1-based) config sections: the pass's kv_events, and with a cluster its [lease]."""
    overrides: dict[str, dict[str, Any]] = {
        **settings.overrides, "placement": {**settings.overrides.get("placement", {}), "kv_events": mode}}
    if cluster is not None:
        overrides["lease"] = cluster_lease(etcd_url=cluster.etcd_url, key=cluster.key, router_id=f"bench-r{index}",
                                           token_file=cluster.token_file, extra=settings.overrides.get("lease"))
    return narwhal_sections(own, count_tokens=settings.count_tokens, overrides=overrides)


class ClusterPlan(msgspec.Struct, frozen=True, kw_only=True):
    """What a pass's routers share when they form one cluster: etcd, the lease key, the link token."""

    etcd_url: str
    key: str
    token_file: Path


async def _start_routers(nursery: trio.Nursery, settings: BenchSettings, fleet: BenchFleet, workdir: Path, mode: str,
                         name: str, count: int, cluster: ClusterPlan | None) -> list[Target]:
    routers: list[Target] = []
    for index in range(1, count + 1):
        # Its own directory: its own config, handoff file and log; beside the engines the routers share
        # nothing, or (a cluster) the etcd key and the token file.
        own = workdir / f"{name}-x{count}{'-cluster' if cluster else ''}-router{index}"
        own.mkdir()
        routers.append(await start_narwhal(nursery, fleet, own, router_sections(settings, own, mode, index, cluster)))
    return routers


async def _one_pass(nursery: trio.Nursery, settings: BenchSettings, fleet: BenchFleet, client: httpx.AsyncClient,
                    workdir: Path, mode: str, count: int,
                    cluster: ClusterPlan | None) -> tuple[PlacementPass, RunReport]:
    name = _PASS_NAMES.get(mode, mode)
    await _reset_caches(client, fleet)
    routers = await _start_routers(nursery, settings, fleet, workdir, mode, name, count, cluster)
    try:
        if cluster is not None:
            await wait_for_cluster(client, routers)
        probe = completion_body(prompt_words=4, max_tokens=2, stream=True, model=settings.model)
        for router in routers:
            await wait_until_serving(client, router, probe_body=probe, timeout_s=60.0)
        if mode != "off":
            await _wait_feeds_live(client, routers, settings.prefill)
        # A fresh workload per pass: the same seed, so every pass sends the same requests in the same order.
        workload: PrefixWorkload | None = settings.prefix_workload()
        assert workload is not None
        first = routers[0]
        spec = LoadSpec(host=first.host, port=first.port, body=b"{}", concurrency=settings.concurrency,
                        requests=settings.requests, duration_s=settings.duration_s,
                        keep_alive=settings.keep_alive, stream=settings.stream, timeout_s=settings.timeout_s,
                        path=workload.path, ports=tuple(router.port for router in routers))
        if settings.warmup:
            await run_load(msgspec.structs.replace(spec, requests=settings.warmup, duration_s=None), bodies=workload)
        workload.start_measuring()
        engines = [(engine, role, fleet.engines[engine].url, fleet.engines[engine].pid)
                   for engine, role in fleet.roles.items()]
        label = f"{name} x{len(routers)}" if len(routers) > 1 else name
        # Each router's own process tree, sampled around the load as measured_load samples the first's.
        before = [procstat.sample_tree(router.pid) if router.pid else None for router in routers]
        run, result = await measured_load(spec, label=label, target=first.url, client=client, router_pid=first.pid,
                                          engines=engines, progress=settings.progress, bodies=workload)
        after = [procstat.sample_tree(router.pid) if router.pid else None for router in routers]
        cpu_s = [procstat.cpu_seconds_between(b, a) if b is not None and a is not None else None
                 for b, a in zip(before, after, strict=True)]
        usage = router_usage(await router_roles(client, routers), result.ok_by_target(len(routers)), cpu_s)
        prefix = await collect_prefix_report(client, [(engine, fleet.engines[engine].url)
                                                      for engine in fleet.names("prefill")],
                                             workload, narwhal_url=first.url)
        feeds = [await _feed_states(client, router) for router in routers]
    finally:
        with trio.CancelScope(shield=True):
            for router in routers:
                await router.stop()
    load = run.load
    return PlacementPass(
        name=name, kv_events=mode, routers=len(routers), requests=load.requests, errors=load.errors,
        requests_per_s=load.requests_per_s, ttft_p50_ms=load.ttft.p50_ms if load.ttft else None,
        ttft_p99_ms=load.ttft.p99_ms if load.ttft else None, prefix=prefix, feeds=feeds,
        cluster=cluster is not None, router_usage=usage), run


def comparisons(passes: Sequence[PlacementPass]) -> list[RoutersComparison]:
    """``--compare-routers``: per kv_events mode, its last N-router pass over its lone router's pass (and over
    the N routers with no lease, when the last pass was a cluster)."""
    found = []
    for mode in dict.fromkeys(p.kv_events for p in passes):
        mine = [p for p in passes if p.kv_events == mode]
        lone = next((p for p in mine if p.routers == 1), None)
        last = mine[-1]
        if lone is None or last.routers < 2:
            continue
        apart = next((p for p in mine if p.routers == last.routers and not p.cluster), None) if last.cluster else None
        found.append(compare_routers(kv_events=mode, routers=last.routers, lone_hit_rate=lone.prefix.hit_rate,
                                     hit_rate=last.prefix.hit_rate, lone=lone.router_usage, several=last.router_usage,
                                     independent=apart.router_usage if apart is not None else ()))
    return found


async def run_placement_passes(settings: BenchSettings) -> BenchReport:
    """Start the fleet (and etcd, for a cluster) once, run each pass (``pass_plan``), stop everything; the report."""
    passes: list[PlacementPass] = []
    runs: list[RunReport] = []
    run_id = secrets.token_hex(4)
    with make_workdir() as workdir_name:
        workdir = Path(workdir_name)
        async with httpx.AsyncClient(timeout=10.0) as client, trio.open_nursery() as nursery:
            fleet: BenchFleet | None = None
            etcd: BenchEtcd | None = None
            load_started_unix = time.time()
            try:
                if settings.cluster:
                    etcd = BenchEtcd(settings.etcd) if settings.etcd else await start_etcd(workdir)
                    token_file = write_cluster_token(workdir)
                fleet = await start_fleet(nursery, prefill=settings.prefill, decode=settings.decode,
                                          mock_args=settings.mock_args)
                for index, planned in enumerate(pass_plan(settings), start=1):
                    cluster = None
                    if etcd is not None and planned.cluster:
                        # A key per pass: the previous pass's registrations may outlive its routers by a TTL.
                        cluster = ClusterPlan(etcd_url=etcd.url, key=f"{CLUSTER_KEY_PREFIX}/{run_id}/pass{index}",
                                              token_file=token_file)
                    done, run = await _one_pass(nursery, settings, fleet, client, workdir, planned.mode,
                                                planned.routers, cluster)
                    passes.append(done)
                    runs.append(run)
            finally:
                with trio.CancelScope(shield=True):
                    if fleet is not None:
                        await fleet.stop()
                    if etcd is not None:
                        await etcd.stop()
                nursery.cancel_scope.cancel()
    record: dict[str, Any] = msgspec.structs.asdict(settings)
    record["mock_args"] = settings.mock_args
    record["python"] = sys.version.split()[0]
    return BenchReport(settings=record, run=runs[0], prefix=passes[0].prefix, load_started_unix=load_started_unix,
                       placement_passes=passes, routers_comparison=comparisons(passes) or None)
