"""``bench --scenario prefix --compare-kv-events`` / ``--routers N``: placement passes on one mock fleet.

One fleet of prefill mocks that publish their KV events; per pass, ``routers``
Narwhal processes in front of it (each its own config and handoff file, no
lease), the load split between them by client worker. ``--compare-kv-events``
runs a precise pass (``[placement] kv_events = "auto"``) then an approximate
one (``"off"``), emptying the mocks' caches (``POST /reset_prefix_cache``)
before each, with the same request sequence, so only the placement differs.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import msgspec
import trio

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

__all__ = ["pass_modes", "run_placement_passes"]

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


async def _start_routers(nursery: trio.Nursery, settings: BenchSettings, fleet: BenchFleet, workdir: Path, mode: str,
                         name: str) -> list[Target]:
    routers: list[Target] = []
    overrides = {**settings.overrides, "placement": {**settings.overrides.get("placement", {}), "kv_events": mode}}
    for index in range(1, settings.routers + 1):
        # Its own directory: its own config, handoff file and log; the routers share nothing but the engines.
        own = workdir / f"{name}-router{index}"
        own.mkdir()
        sections = narwhal_sections(own, count_tokens=settings.count_tokens, overrides=overrides)
        routers.append(await start_narwhal(nursery, fleet, own, sections))
    return routers


async def _one_pass(nursery: trio.Nursery, settings: BenchSettings, fleet: BenchFleet, client: httpx.AsyncClient,
                    workdir: Path, mode: str) -> tuple[PlacementPass, RunReport]:
    name = _PASS_NAMES.get(mode, mode)
    await _reset_caches(client, fleet)
    routers = await _start_routers(nursery, settings, fleet, workdir, mode, name)
    try:
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
        run, _ = await measured_load(spec, label=label, target=first.url, client=client, router_pid=first.pid,
                                     engines=engines, progress=settings.progress, bodies=workload)
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
        ttft_p99_ms=load.ttft.p99_ms if load.ttft else None, prefix=prefix, feeds=feeds), run


async def run_placement_passes(settings: BenchSettings) -> BenchReport:
    """Start the fleet once, run each pass (``pass_modes``) in front of it, stop everything; the report."""
    passes: list[PlacementPass] = []
    runs: list[RunReport] = []
    with make_workdir() as workdir_name:
        workdir = Path(workdir_name)
        async with httpx.AsyncClient(timeout=10.0) as client, trio.open_nursery() as nursery:
            fleet: BenchFleet | None = None
            load_started_unix = time.time()
            try:
                fleet = await start_fleet(nursery, prefill=settings.prefill, decode=settings.decode,
                                          mock_args=settings.mock_args)
                for mode in pass_modes(settings.compare_kv_events, settings.overrides):
                    done, run = await _one_pass(nursery, settings, fleet, client, workdir, mode)
                    passes.append(done)
                    runs.append(run)
            finally:
                with trio.CancelScope(shield=True):
                    if fleet is not None:
                        await fleet.stop()
                nursery.cancel_scope.cancel()
    record: dict[str, Any] = msgspec.structs.asdict(settings)
    record["mock_args"] = settings.mock_args
    record["python"] = sys.version.split()[0]
    return BenchReport(settings=record, run=runs[0], prefix=passes[0].prefix, load_started_unix=load_started_unix,
                       placement_passes=passes)
