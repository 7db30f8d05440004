"""``bench --scenario priority``: queue waits by priority class under saturation, and fairness in a class.

One prefill and one decode mock (slow tokens, so requests hold their slots), a router with ``policy =
"bounded"``, a small data pool (``max_connections``), ``reserve_high`` and a keys file of four tenants:
``high-a`` (high), ``normal-a`` and ``normal-b`` (normal; normal-b has ten times the clients) and ``low-a``
(low). Every tenant's clients send for the same duration, far more in total than the pool holds. The queue
waits are the router's own (``narwhal_tenant_queue_wait_seconds``, scraped before and after: the
difference of the bucket counts); fairness is each normal tenant's share of the normal class's requests
served while every client was still sending (each tenant has more clients than its fair share of the
class's slots, so both always have a request waiting then).
"""

from __future__ import annotations

import math
import re
import statistics
import time
from array import array
from collections.abc import Sequence
from pathlib import Path

import httpx
import msgspec
import trio

from narwhal.auth.keys import Priority
from narwhal.tools.bench.auth import auth_sections, write_keys_file
from narwhal.tools.bench.fleet import BenchFleet, Target, make_workdir, start_fleet, wait_until_serving
from narwhal.tools.bench.load import LoadResult, bearer_header, completion_body, run_load
from narwhal.tools.bench.report import BenchReport, PriorityReport, RunReport, TenantFigures
from narwhal.tools.bench.runner import BenchSettings, _settings_record, _spec, _start_target

__all__ = ["TENANTS", "Histogram", "histogram_quantile", "priority_figures", "queue_wait_histograms",
           "run_priority"]

# (tenant, priority, clients as a multiple of --priority-concurrency).
TENANTS: tuple[tuple[str, Priority, int], ...] = (
    ("high-a", "high", 1), ("normal-a", "normal", 1), ("normal-b", "normal", 10), ("low-a", "low", 1))
_FAIR_SHARE = 0.4

_BUCKET = re.compile(r'^narwhal_tenant_queue_wait_seconds_bucket\{tenant="([^"]*)",le="([^"]+)"\} ([0-9.e+-]+)$')
_SUM = re.compile(r'^narwhal_tenant_queue_wait_seconds_sum\{tenant="([^"]*)"\} ([0-9.e+-]+)$')


class Histogram(msgspec.Struct, kw_only=True):
    """One tenant's queue-wait histogram: cumulative counts per upper bound (ascending, +Inf last), sum."""

    buckets: list[tuple[float, float]]
    sum_s: float = 0.0

    @property
    def count(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0

    def minus(self, earlier: Histogram | None) -> Histogram:
        """The observations made since ``earlier`` (a scrape of the same series before)."""
        if earlier is None:
            return self
        before = dict(earlier.buckets)
        return Histogram(buckets=[(le, count - before.get(le, 0.0)) for le, count in self.buckets],
                         sum_s=self.sum_s - earlier.sum_s)


def queue_wait_histograms(text: str) -> dict[str, Histogram]:
    """``narwhal_tenant_queue_wait_seconds`` per tenant from a ``/metrics`` text."""
    found: dict[str, Histogram] = {}
    for line in text.splitlines():
        if (match := _BUCKET.match(line)) is not None:
            tenant, le, value = match.groups()
            found.setdefault(tenant, Histogram(buckets=[])).buckets.append((float(le), float(value)))
        elif (match := _SUM.match(line)) is not None:
            found.setdefault(match[1], Histogram(buckets=[])).sum_s = float(match[2])
    for histogram in found.values():
        histogram.buckets.sort()
    return found


def histogram_quantile(buckets: Sequence[tuple[float, float]], q: float) -> float | None:
    """The ``q`` (0-1) quantile of cumulative buckets, as Prometheus's ``histogram_quantile`` reads them.

    Linear within the bucket holding the rank (from 0 for the first); in +Inf, the highest finite bound.
    None when there are no observations.
    """
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank and count > lower_count:
            if math.isinf(bound):
                return lower_bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def _merged(histograms: Sequence[Histogram]) -> Histogram:
    totals: dict[float, float] = {}
    for histogram in histograms:
        for le, count in histogram.buckets:
            totals[le] = totals.get(le, 0.0) + count
    return Histogram(buckets=sorted(totals.items()), sum_s=sum(h.sum_s for h in histograms))


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def priority_figures(results: dict[str, LoadResult], waits: dict[str, Histogram], *, concurrency: int,
                     duration_s: float, max_connections: int, reserve_high: float,
                     max_queue: int) -> PriorityReport:
    """The scenario's figures from each tenant's load and queue-wait histogram (over the load only)."""
    tenants = []
    for name, priority, multiple in TENANTS:
        result = results[name]
        ok = [record for record in result.records if record.kind == "ok"]
        wait = waits.get(name)
        count = int(wait.count) if wait is not None else 0
        statuses: dict[str, int] = {}
        for record in result.records:
            if record.kind != "ok":
                key = str(record.status or record.kind)
                statuses[key] = statuses.get(key, 0) + 1
        tenants.append(TenantFigures(
            tenant=name, priority=priority, concurrency=concurrency * multiple, requests=len(result.records),
            ok=len(ok), errors_by_status=dict(sorted(statuses.items())),
            ok_in_window=sum(1 for record in ok if record.started_at + record.total_s <= duration_s),
            client_total_p50_ms=_ms(statistics.median(r.total_s for r in ok)) if ok else None,
            queue_wait_count=count,
            queue_wait_p50_ms=_ms(histogram_quantile(wait.buckets, 0.5)) if wait is not None else None,
            queue_wait_p90_ms=_ms(histogram_quantile(wait.buckets, 0.9)) if wait is not None else None,
            queue_wait_mean_ms=_ms(wait.sum_s / count) if wait is not None and count else None))
    classes: dict[str, float | None] = {}
    for cls in ("high", "normal", "low"):
        merged = _merged([waits[name] for name, priority, _ in TENANTS if priority == cls and name in waits])
        classes[cls] = _ms(histogram_quantile(merged.buckets, 0.5))
    high, normal, low = classes["high"], classes["normal"], classes["low"]
    ordered = high is not None and normal is not None and low is not None and high < normal < low
    served = {t.tenant: t.ok_in_window for t in tenants if t.priority == "normal"}
    total = sum(served.values())
    shares = {name: round(n / total, 4) if total else None for name, n in served.items()}
    fair = all(share is not None and share >= _FAIR_SHARE for share in shares.values())
    return PriorityReport(max_connections=max_connections, reserve_high=reserve_high, max_queue=max_queue,
                          duration_s=duration_s, tenants=tenants, class_queue_wait_p50_ms=classes,
                          ordered=ordered, fairness_shares=shares, fair=fair)


async def _scrape(client: httpx.AsyncClient, target: Target) -> dict[str, Histogram]:
    response = await client.get(target.url + "/metrics")
    response.raise_for_status()
    return queue_wait_histograms(response.text)


def _combined(results: Sequence[LoadResult]) -> LoadResult:
    """Every tenant's requests as one load, for the report's ``run``."""
    gaps = array("d")
    for result in results:
        gaps.extend(result.gaps_s)
    return LoadResult([record for result in results for record in result.records], gaps,
                      duration_s=max(result.duration_s for result in results),
                      wall_started_at=min(result.wall_started_at for result in results),
                      connections_opened=sum(result.connections_opened for result in results),
                      stale_connection_retries=sum(result.stale_connection_retries for result in results))


async def run_priority(settings: BenchSettings) -> BenchReport:
    """Start the fleet and the router, load it with every tenant at once, and report the waits."""
    assert settings.duration_s is not None
    body = completion_body(prompt_words=settings.prompt_words, max_tokens=settings.tokens, stream=settings.stream,
                           model=settings.model)
    clients = sum(settings.priority_concurrency * multiple for *_, multiple in TENANTS)
    # Every client may wait at once: none should be shed from a full queue (this measures order, not shedding).
    max_queue = max(256, clients)
    results: dict[str, LoadResult] = {}
    with make_workdir() as workdir_name:
        workdir = Path(workdir_name)
        keys = write_keys_file(workdir / "keys.toml", [(name, priority) for name, priority, _ in TENANTS])
        extra = {**auth_sections(workdir / "keys.toml", settings.priority_reserve_high),
                 "serving": {"policy": "bounded", "max_connections": settings.priority_max_connections,
                             "max_queue": max_queue}}
        async with httpx.AsyncClient(timeout=10.0) as client, trio.open_nursery() as nursery:
            fleet: BenchFleet | None = None
            target: Target | None = None
            try:
                fleet = await start_fleet(nursery, prefill=settings.prefill, decode=settings.decode,
                                          mock_args=settings.mock_args)
                target = await _start_target(nursery, settings, fleet, workdir, None, extra)
                await wait_until_serving(client, target, probe_body=completion_body(
                    prompt_words=4, max_tokens=2, stream=True, model=settings.model),
                    headers={"authorization": f"Bearer {keys['high-a']}"})
                before = await _scrape(client, target)
                load_started_unix = time.time()

                async def tenant_load(name: str, multiple: int) -> None:
                    assert target is not None
                    spec = msgspec.structs.replace(
                        _spec(settings, target.host, target.port, body, requests=None,
                              duration_s=settings.duration_s, headers=bearer_header(keys[name])),
                        concurrency=settings.priority_concurrency * multiple)
                    results[name] = await run_load(spec)

                async with trio.open_nursery() as loads:
                    for name, _, multiple in TENANTS:
                        loads.start_soon(tenant_load, name, multiple)
                after = await _scrape(client, target)
            finally:
                with trio.CancelScope(shield=True):
                    if target is not None:
                        await target.stop()
                    if fleet is not None:
                        await fleet.stop()
                nursery.cancel_scope.cancel()
    waits = {tenant: histogram.minus(before.get(tenant)) for tenant, histogram in after.items()}
    figures = priority_figures(results, waits, concurrency=settings.priority_concurrency,
                               duration_s=settings.duration_s, max_connections=settings.priority_max_connections,
                               reserve_high=settings.priority_reserve_high, max_queue=max_queue)
    combined = _combined([results[name] for name, *_ in TENANTS])
    run = RunReport(label=settings.label or "narwhal (priority)", target=target.url, load=combined.summary())
    return BenchReport(settings=_settings_record(settings, target), run=run, load_started_unix=load_started_unix,
                       priority=figures)
