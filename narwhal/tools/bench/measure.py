"""One measured load: the router's CPU and memory before and after, the engines' connections.

``measured_load`` samples ``/proc`` for the router's process tree and for this
process (the load generator), resets the mock engines' counters, runs the load
with its progress line, and samples again. An optional ``alongside`` task (the
fault scenario) runs during the load and is cancelled when the load ends.
"""

from __future__ import annotations

import functools
import os
import ssl
from collections.abc import Awaitable, Callable, Sequence

import httpx
import trio

from narwhal.tools.bench import procstat
from narwhal.tools.bench.load import LoadResult, LoadSpec, LoadState, RequestRecord, run_load
from narwhal.tools.bench.progress import show_progress
from narwhal.tools.bench.report import EngineTraffic, RunReport, process_usage

__all__ = ["EngineRef", "measured_load", "reset_engine_stats"]

EngineRef = tuple[str, str, str, int]  # (name, role, url, pid)


async def reset_engine_stats(client: httpx.AsyncClient, engines: Sequence[EngineRef]) -> None:
    """Zero every mock engine's ``/mock/stats`` so the counts cover the measured load only."""
    for _, _, url, _ in engines:
        await client.post(url + "/mock/stats/reset")


async def _engine_traffic(client: httpx.AsyncClient, engines: Sequence[EngineRef], requests: int,
                          cpu_before: dict[int, int], wall_s: float) -> list[EngineTraffic]:
    traffic = []
    for name, role, url, pid in engines:
        stat = procstat.read_stat(pid)
        utilization = None
        if stat is not None and pid in cpu_before and wall_s > 0:
            cpu_s = (stat.cpu_ticks - cpu_before[pid]) / procstat.CLOCK_TICKS_PER_S
            utilization = round(cpu_s / wall_s, 3)
        try:
            stats = (await client.get(url + "/mock/stats")).json()
        except httpx.HTTPError:
            continue
        opened = int(stats["connections_opened"])
        traffic.append(EngineTraffic(
            name=name, role=role, connections_opened=opened, requests=sum(stats["requests"].values()),
            connections_per_request=round(opened / requests, 4) if requests else None,
            cpu_utilization=utilization))
    return traffic


async def measured_load(spec: LoadSpec, *, label: str, target: str, client: httpx.AsyncClient,
                        router_pid: int | None, engines: Sequence[EngineRef] = (), progress: bool = True,
                        alongside: Callable[[LoadState], Awaitable[None]] | None = None,
                        on_record: Callable[[RequestRecord], None] | None = None,
                        ssl_context: ssl.SSLContext | None = None,
                        bodies: Callable[[], bytes] | None = None,
                        models: Sequence[str] = ()) -> tuple[RunReport, LoadResult]:
    """Run ``spec`` and measure what it cost the router; returns the report and the raw records.

    ``models``: the model each of ``spec.model_bodies`` names, in order; with two or more the report has
    each model's figures beside the totals.
    """
    await reset_engine_stats(client, engines)
    state = LoadState()
    me = os.getpid()
    router_before = procstat.sample_tree(router_pid) if router_pid else None
    self_before = procstat.read_stat(me)
    engines_before = {pid: stat.cpu_ticks for *_, pid in engines if (stat := procstat.read_stat(pid)) is not None}
    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        if progress:
            nursery.start_soon(functools.partial(show_progress, state, label=label, total=spec.requests))
        if alongside is not None:
            nursery.start_soon(alongside, state)
        result = await run_load(spec, state=state, on_record=on_record, ssl_context=ssl_context, bodies=bodies)
        nursery.cancel_scope.cancel()
    wall_s = trio.current_time() - started
    self_after = procstat.read_stat(me)
    router_after = procstat.sample_tree(router_pid) if router_pid else None
    ok, tokens = result.ok, result.tokens
    router = None
    if router_before is not None and router_after is not None:
        router = process_usage(pids=sorted(router_after.ticks), cpu_s=procstat.cpu_seconds_between(router_before,
                               router_after), wall_s=wall_s, requests=ok, tokens=tokens,
                               peak_rss_kb=router_after.peak_rss_kb)
    load_generator = None
    if self_before is not None and self_after is not None:
        cpu_s = (self_after.cpu_ticks - self_before.cpu_ticks) / procstat.CLOCK_TICKS_PER_S
        load_generator = process_usage(pids=[me], cpu_s=cpu_s, wall_s=wall_s, requests=len(result.records),
                                       tokens=tokens, peak_rss_kb=0)
    traffic = await _engine_traffic(client, engines, len(result.records), engines_before, wall_s)
    per_model = {name: result.summary(index) for index, name in enumerate(models)} if len(models) > 1 else {}
    report = RunReport(label=label, target=target, load=result.summary(), router=router,
                       load_generator=load_generator, engines=traffic, models=per_model)
    return report, result
