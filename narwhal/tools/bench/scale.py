"""The fleet scenario (``bench --scenario fleet``): the same load in front of fleets of growing size.

For each size one mock process serves the whole fleet (a quarter prefill, at
least one), a fresh router starts in front of it, and once it serves: its CPU
with no load, the admin answers an operator reads (``/admin/engines``, the
fleet page and what it reads each second, ``/metrics``), then the load, with
``narwhal_monitor_last_pass_seconds`` sampled from ``/metrics`` meanwhile, then
the handoff figures and the router's resident set. What grows with the fleet
shows as the ratio of each size's CPU per request to the smallest size's.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from pathlib import Path

import httpx
import msgspec
import trio

from narwhal.tools.bench import procstat
from narwhal.tools.bench.fleet import BenchFleet, Target, make_workdir, start_shared_fleet, wait_until_serving
from narwhal.tools.bench.load import LoadState, completion_body, run_load
from narwhal.tools.bench.measure import measured_load
from narwhal.tools.bench.report import AdminAnswer, BenchReport, FleetScaleReport, FleetSizeReport, RunReport
from narwhal.tools.bench.runner import (
    BenchSettings,
    _label,
    _settings_record,
    _spec,
    _start_profiler,
    _start_target,
    _stop_profiler,
)

__all__ = ["DEFAULT_SIZES", "fleet_split", "metric_samples", "run_fleet_scale"]

DEFAULT_SIZES = (4, 64, 256)
# What the fleet page (/admin/ui) reads every second once open (the timeline's whole window only when it opens,
# then the seconds since its last read), and the other answers measured.
_TIMELINE_SINCE = "/admin/timeline?seconds=3"
_FLEET_PAGE_READS = ("/admin/engines", "/admin/router", _TIMELINE_SINCE, "/admin/discovery", "/admin/placement",
                     "/admin/cluster", "/admin/tenants")
_ANSWERS = (*_FLEET_PAGE_READS, "/admin/ui", "/admin/timeline", "/metrics")
# /metrics is sampled once a second during the load (each sample deduplicated by pass count); a scrape's own
# CPU is measured apart (_SCRAPES back to back) and taken out of the per-request figure "less scrapes".
_SAMPLE_S = 1.0
_SCRAPES = 3
_READY_TIMEOUT_S = 180.0


def fleet_split(engines: int) -> tuple[int, int]:
    """(prefill, decode) of a fleet of ``engines``: a quarter prefill, at least one of each."""
    if engines < 2:
        raise ValueError(f"a fleet needs at least 2 engines (one prefill, one decode), got {engines}")
    prefill = max(1, engines // 4)
    return prefill, engines - prefill


def metric_samples(text: str, name: str) -> list[tuple[str, float]]:
    """The samples of metric ``name`` in a Prometheus text exposition: (label text, value)."""
    found = []
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        rest = line[len(name):]
        labels = ""
        if rest.startswith("{"):
            labels, _, rest = rest[1:].partition("}")
        elif not rest.startswith(" "):
            continue  # another metric whose name starts with this one
        try:
            found.append((labels, float(rest.split()[0])))
        except (ValueError, IndexError):
            continue
    return found


def _one(text: str, name: str) -> float | None:
    samples = metric_samples(text, name)
    return samples[0][1] if samples else None


async def _get(client: httpx.AsyncClient, url: str) -> tuple[AdminAnswer, bytes]:
    path = httpx.URL(url).raw_path.decode("ascii")  # with its query, if any
    started = time.perf_counter()
    try:
        response = await client.get(url)
    except httpx.HTTPError:
        return AdminAnswer(path=path, status=None, bytes=None, ms=None), b""
    elapsed_ms = round((time.perf_counter() - started) * 1000, 2)
    return AdminAnswer(path=path, status=response.status_code, bytes=len(response.content), ms=elapsed_ms), \
        response.content


async def _sample_monitor(client: httpx.AsyncClient, url: str, passes: dict[int, float], scrapes: list[int]) -> None:
    """Until cancelled: the latest pass's duration per pass number, from ``/metrics``; counts its scrapes."""
    while True:
        scrapes[0] += 1
        _, body = await _get(client, url + "/metrics")
        text = body.decode(errors="replace")
        number, seconds = _one(text, "narwhal_monitor_passes"), _one(text, "narwhal_monitor_last_pass_seconds")
        if number is not None and seconds is not None:
            passes[int(number)] = seconds
        await trio.sleep(_SAMPLE_S)


async def _sample_while_loaded(client: httpx.AsyncClient, url: str, passes: dict[int, float], scrapes: list[int],
                               _state: LoadState) -> None:
    await _sample_monitor(client, url, passes, scrapes)


def _handoff_figures(text: str) -> dict[str, float | int | None]:
    size = _one(text, "narwhal_handoff_bytes")
    count = _one(text, "narwhal_handoff_write_seconds_count")
    total = _one(text, "narwhal_handoff_write_seconds_sum")
    at_most = None
    if count:
        for labels, cumulative in metric_samples(text, "narwhal_handoff_write_seconds_bucket"):
            bound = float(labels.partition('le="')[2].rstrip('"'))
            if cumulative >= count:
                at_most = None if math.isinf(bound) else round(bound * 1000, 3)
                break
    return {"handoff_bytes": int(size) if size is not None else None,
            "handoff_writes": int(count) if count is not None else None,
            "handoff_write_mean_ms": round(total / count * 1000, 3) if count and total is not None else None,
            "handoff_write_max_ms_at_most": at_most}


def _profile_path(out: str, engines: int) -> str:
    path = Path(out)
    return str(path.with_name(f"{path.stem}-{engines}{path.suffix}"))


async def _one_size(settings: BenchSettings, engines: int, client: httpx.AsyncClient,
                    idle_s: float) -> tuple[FleetSizeReport, Target, int | None]:
    prefill, decode = fleet_split(engines)
    body = completion_body(prompt_words=settings.prompt_words, max_tokens=settings.tokens, stream=settings.stream,
                           model=settings.model)
    probe_body = completion_body(prompt_words=4, max_tokens=2, stream=True, model=settings.model)
    with make_workdir() as workdir_name:
        async with trio.open_nursery() as nursery:
            fleet: BenchFleet | None = None
            target: Target | None = None
            try:
                fleet = await start_shared_fleet(nursery, prefill=prefill, decode=decode,
                                                 mock_args=settings.mock_args)
                launched = trio.current_time()
                target = await _start_target(nursery, settings, fleet, Path(workdir_name))
                await wait_until_serving(client, target, probe_body=probe_body, timeout_s=_READY_TIMEOUT_S)
                ready_s = round(trio.current_time() - launched, 2)
                idle = None
                if target.pid:
                    before = procstat.sample_tree(target.pid)
                    started = trio.current_time()
                    await trio.sleep(idle_s)
                    after = procstat.sample_tree(target.pid)
                    idle = round(procstat.cpu_seconds_between(before, after) * 1000 / (trio.current_time() - started),
                                 2)
                answers = [(await _get(client, target.url + path))[0] for path in _ANSWERS] \
                    if target.is_narwhal else []
                scrape_ms = None
                if target.is_narwhal and target.pid:
                    before = procstat.sample_tree(target.pid)
                    for _ in range(_SCRAPES):
                        await _get(client, target.url + "/metrics")
                    scrape_ms = procstat.cpu_seconds_between(before, procstat.sample_tree(target.pid)) * 1000 / _SCRAPES
                # Warm every engine's connection (the idle window outlasts the mocks' keep-alive).
                warmup = max(settings.warmup, 2 * engines)
                spec = _spec(settings, target.host, target.port, body, requests=settings.requests,
                             duration_s=settings.duration_s)
                if warmup:
                    await run_load(msgspec.structs.replace(spec, requests=warmup, duration_s=None))
                passes: dict[int, float] = {}
                scrapes = [0]
                label = f"{_label(settings, target)} ({engines} engines)"
                profiler = None
                if settings.profile_router and target.pid:
                    profiler = await _start_profiler(target.pid, _profile_path(settings.profile_router, engines))
                    await trio.sleep(0.5)
                try:
                    run, _ = await measured_load(
                        spec, label=label, target=target.url, client=client, router_pid=target.pid,
                        progress=settings.progress,
                        alongside=functools.partial(_sample_while_loaded, client, target.url, passes, scrapes)
                        if target.is_narwhal else None)
                finally:
                    if profiler is not None:
                        with trio.CancelScope(shield=True):
                            await _stop_profiler(profiler)
                handoff: dict[str, float | int | None] = {}
                if target.is_narwhal:
                    _, metrics = await _get(client, target.url + "/metrics")
                    handoff = _handoff_figures(metrics.decode(errors="replace"))
                rss_kb = procstat.tree_rss_kb(target.pid) if target.pid else None
            finally:
                with trio.CancelScope(shield=True):
                    if target is not None:
                        await target.stop()
                    if fleet is not None:
                        await fleet.stop()
                nursery.cancel_scope.cancel()
    durations = sorted(passes.values())
    less_scrapes = None
    if run.router is not None and run.load.ok:
        less_scrapes = round((run.router.cpu_s * 1000 - scrapes[0] * (scrape_ms or 0.0)) / run.load.ok, 4)
    by_path = {answer.path: answer.bytes for answer in answers}
    page = [by_path.get(path) for path in _FLEET_PAGE_READS]
    report = FleetSizeReport(
        engines=engines, prefill=prefill, decode=decode, ready_s=ready_s, idle_cpu_ms_per_s=idle, run=run,
        cpu_ms_per_request_less_scrapes=less_scrapes, metrics_scrape_cpu_ms=round(scrape_ms, 2) if scrape_ms is not None
        else None, metrics_scrapes=scrapes[0],
        monitor_pass_samples=len(durations),
        monitor_pass_median_s=round(statistics.median(durations), 4) if durations else None,
        monitor_pass_max_s=round(durations[-1], 4) if durations else None,
        answers=answers, fleet_page_refresh_bytes=sum(b for b in page if b is not None) if answers else None,
        rss_mb=round(rss_kb / 1024, 1) if rss_kb else None, **handoff)  # type: ignore[arg-type]
    return report, target, rss_kb


def _cpu_per_request(run: RunReport) -> float | None:
    return run.router.cpu_ms_per_request if run.router is not None else None


def _ratio(value: float | None, base: float | None) -> float | None:
    return round(value / base, 3) if value is not None and base else None


async def run_fleet_scale(settings: BenchSettings) -> BenchReport:
    """Run the fleet scenario over ``settings.fleet_sizes``; ``run`` of the report is the largest fleet's."""
    sizes: list[FleetSizeReport] = []
    rss: list[int | None] = []
    target: Target | None = None
    async with httpx.AsyncClient(timeout=30.0) as client:
        for engines in settings.fleet_sizes:
            report, target, rss_kb = await _one_size(settings, engines, client, settings.fleet_idle_s)
            sizes.append(report)
            rss.append(rss_kb)
    assert target is not None
    smallest, base_rss = sizes[0], rss[0]
    base_cpu = _cpu_per_request(smallest.run)
    finished = []
    ratios: dict[str, float | None] = {}
    less_scrapes: dict[str, float | None] = {}
    for size, rss_kb in zip(sizes, rss, strict=True):
        per_engine = None
        if size is not smallest and rss_kb is not None and base_rss is not None:
            per_engine = round((rss_kb - base_rss) / (size.engines - smallest.engines), 1)
        finished.append(msgspec.structs.replace(size, memory_per_engine_kb=per_engine))
        ratios[str(size.engines)] = _ratio(_cpu_per_request(size.run), base_cpu)
        less_scrapes[str(size.engines)] = _ratio(size.cpu_ms_per_request_less_scrapes,
                                                 smallest.cpu_ms_per_request_less_scrapes)
    fleet = FleetScaleReport(sizes=finished, idle_s=settings.fleet_idle_s, cpu_per_request_vs_smallest=ratios,
                             cpu_per_request_less_scrapes_vs_smallest=less_scrapes)
    return BenchReport(settings=_settings_record(settings, target), run=finished[-1].run, fleet_scale=fleet)
