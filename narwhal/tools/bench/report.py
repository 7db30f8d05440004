"""The figures of a benchmark run: percentiles, summaries, the table and the JSON.

Everything here is pure: the load generator and the runner collect raw
samples, ``summarize_load`` turns them into a ``LoadSummary``, and
``format_report`` lays a ``BenchReport`` out as the table the CLI prints.
Latencies are reported in milliseconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import msgspec

from narwhal.tools.bench.cluster import RoutersComparison, format_comparison_lines
from narwhal.tools.bench.prefix import PlacementPass, PrefixReport, format_pass_lines, format_prefix_lines

__all__ = [
    "AdminAnswer",
    "AuthComparison",
    "BenchReport",
    "Distribution",
    "EngineTraffic",
    "FaultReport",
    "FleetScaleReport",
    "FleetSizeReport",
    "LoadSummary",
    "PriorityReport",
    "ProcessUsage",
    "RunReport",
    "TenantFigures",
    "distribution",
    "format_fleet_scale",
    "format_report",
    "percentile",
    "process_usage",
    "summarize_load",
]


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ascending values, interpolated linearly between ranks.

    The same definition as numpy's default: rank ``q/100 * (n - 1)``.
    """
    if not sorted_values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0-100, got {q}")
    rank = q / 100 * (len(sorted_values) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    fraction = rank - low
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * fraction


class Distribution(msgspec.Struct, frozen=True, kw_only=True):
    """Count, mean, percentiles and max of one latency, in milliseconds."""

    count: int
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float


def distribution(values_s: Sequence[float]) -> Distribution | None:
    """Summarise latencies given in seconds; None when there are none."""
    if not values_s:
        return None
    ordered = sorted(values_s)

    def ms(value: float) -> float:
        return round(value * 1000, 3)

    return Distribution(count=len(ordered), mean_ms=ms(math.fsum(ordered) / len(ordered)),
                        p50_ms=ms(percentile(ordered, 50)), p90_ms=ms(percentile(ordered, 90)),
                        p99_ms=ms(percentile(ordered, 99)), max_ms=ms(ordered[-1]))


class LoadSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What the clients saw: throughput, latencies, and every error by kind and by status."""

    requests: int
    ok: int
    errors: int
    duration_s: float
    requests_per_s: float
    tokens: int
    tokens_per_s: float
    ttft: Distribution | None
    inter_token: Distribution | None
    total: Distribution | None
    errors_by_kind: dict[str, int]
    errors_by_status: dict[str, int]
    connections_opened: int
    stale_connection_retries: int
    # Open loop (bench --rate): the arrival rate asked for (None: closed loop), and the requests that started
    # later than due because --concurrency were in flight, with the latest start (their latencies count from due).
    offered_rate: float | None = None
    late_starts: int = 0
    late_max_ms: float = 0.0


def summarize_load(*, kinds: Sequence[str], statuses: Sequence[int], ttft_s: Sequence[float],
                   total_s: Sequence[float], gaps_s: Sequence[float], tokens: int, duration_s: float,
                   connections_opened: int = 0, stale_connection_retries: int = 0,
                   offered_rate: float | None = None, late_starts: int = 0, late_max_s: float = 0.0) -> LoadSummary:
    """Summarise one load: ``kinds[i]``/``statuses[i]`` describe request ``i`` (``"ok"`` or an error kind).

    Throughput counts only successful requests and the tokens they carried;
    latency percentiles cover the successful requests only.
    """
    if len(kinds) != len(statuses):
        raise ValueError("kinds and statuses must describe the same requests")
    by_kind: dict[str, int] = {}
    by_status: dict[str, int] = {}
    ok = 0
    for kind, status in zip(kinds, statuses, strict=True):
        if kind == "ok":
            ok += 1
            continue
        by_kind[kind] = by_kind.get(kind, 0) + 1
        key = str(status) if status else "none"
        by_status[key] = by_status.get(key, 0) + 1
    rate = (lambda n: round(n / duration_s, 2)) if duration_s > 0 else (lambda n: 0.0)
    return LoadSummary(
        requests=len(kinds), ok=ok, errors=len(kinds) - ok, duration_s=round(duration_s, 3),
        requests_per_s=rate(ok), tokens=tokens, tokens_per_s=rate(tokens),
        ttft=distribution(ttft_s), inter_token=distribution(gaps_s), total=distribution(total_s),
        errors_by_kind=dict(sorted(by_kind.items())), errors_by_status=dict(sorted(by_status.items())),
        connections_opened=connections_opened, stale_connection_retries=stale_connection_retries,
        offered_rate=offered_rate, late_starts=late_starts, late_max_ms=round(late_max_s * 1000, 3))


class ProcessUsage(msgspec.Struct, frozen=True, kw_only=True):
    """CPU and peak memory of one process tree over the load (from ``/proc``)."""

    pids: list[int]
    cpu_s: float
    cpu_utilization: float
    cpu_ms_per_request: float | None
    cpu_ms_per_1k_tokens: float | None
    peak_rss_mb: float


def process_usage(*, pids: Sequence[int], cpu_s: float, wall_s: float, requests: int, tokens: int,
                  peak_rss_kb: int) -> ProcessUsage:
    """Per-request and per-1,000-token CPU cost; ``cpu_utilization`` is cores kept busy (1.0 = one)."""
    return ProcessUsage(
        pids=list(pids), cpu_s=round(cpu_s, 3),
        cpu_utilization=round(cpu_s / wall_s, 3) if wall_s > 0 else 0.0,
        cpu_ms_per_request=round(cpu_s * 1000 / requests, 4) if requests else None,
        cpu_ms_per_1k_tokens=round(cpu_s * 1e6 / tokens, 3) if tokens else None,
        peak_rss_mb=round(peak_rss_kb / 1024, 1))


class EngineTraffic(msgspec.Struct, frozen=True, kw_only=True):
    """What one mock engine saw during the load (from its ``/mock/stats``)."""

    name: str
    role: str
    connections_opened: int
    requests: int
    connections_per_request: float | None
    cpu_utilization: float | None = None


class RunReport(msgspec.Struct, frozen=True, kw_only=True):
    """One load against one target, with the cost it put on the router and the load generator."""

    label: str
    target: str
    load: LoadSummary
    router: ProcessUsage | None = None
    load_generator: ProcessUsage | None = None
    engines: list[EngineTraffic] = []
    # bench --models N (N >= 2): each model's share of the load, by model name (empty with one model).
    models: dict[str, LoadSummary] = {}


class FaultReport(msgspec.Struct, frozen=True, kw_only=True):
    """The fault scenario: what was lost, how streams ended, how fast the fleet reacted.

    Times are seconds from the fault; None means "not seen during the run".
    """

    killed_engine: str
    failing_engine: str
    failing_status: int
    timeline: list[dict[str, object]]
    goodput: float
    requests_lost: int
    lost_by_kind: dict[str, int]
    streams_cut: int
    cut_with_error_event: int
    cut_silently: int
    attempts_on_dead_engine: int | None
    dead_engine_last_attempt_s: float | None
    dead_engine_ineligible_s: float | None
    restarted_engine_eligible_s: float | None
    restarted_engine_first_served_s: float | None
    failing_engine_requests_during_fault: int | None
    failing_engine_last_request_s: float | None
    failing_engine_ineligible_s: float | None
    failing_engine_eligible_again_s: float | None = None
    # The restart, from the new process's launch: its /health first answered 200, and (Narwhal)
    # the router put it back in placement / it served, from that first 200.
    restarted_engine_health_s: float | None = None
    restarted_engine_eligible_after_health_s: float | None = None
    restarted_engine_first_served_after_health_s: float | None = None
    # Stream continuation (Narwhal, serving.policy = "bounded"): from the router's request log lines.
    requests_continued: int | None = None
    continuations: int | None = None
    join_gap_ms: dict[str, float] | None = None
    failed_requests: list[dict[str, object]] = []
    router_failures: list[dict[str, object]] = []
    notes: list[str] = []


class AdminAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """One GET on the router's admin API: its status, size and how long the answer took."""

    path: str
    status: int | None
    bytes: int | None
    ms: float | None


class FleetSizeReport(msgspec.Struct, frozen=True, kw_only=True):
    """One fleet size of the fleet scenario; None: not measured (e.g. another router has no such metric)."""

    engines: int
    prefill: int
    decode: int
    # From the router's launch to its first streamed completion (after /ready, for Narwhal).
    ready_s: float | None
    # The router's CPU with no load, over the idle window.
    idle_cpu_ms_per_s: float | None
    run: RunReport
    # The load's router CPU per request less the /metrics scrapes the scenario made during it
    # (metrics_scrapes, each metrics_scrape_cpu_ms): what the router spent on its own.
    cpu_ms_per_request_less_scrapes: float | None = None
    metrics_scrape_cpu_ms: float | None = None
    metrics_scrapes: int = 0
    # narwhal_monitor_last_pass_seconds sampled during the load, one value per pass seen.
    monitor_pass_samples: int = 0
    monitor_pass_median_s: float | None = None
    monitor_pass_max_s: float | None = None
    # narwhal_handoff_bytes and narwhal_handoff_write_seconds over the router's life.
    handoff_bytes: int | None = None
    handoff_writes: int | None = None
    handoff_write_mean_ms: float | None = None
    # The smallest bucket bound holding every write: the slowest write took at most this long.
    handoff_write_max_ms_at_most: float | None = None
    # /admin/engines, the fleet page (/admin/ui) and what it reads every second, /metrics.
    answers: list[AdminAnswer] = []
    # The bytes the fleet page reads each refresh once open: /admin/engines, /admin/router, the timeline's last
    # seconds (/admin/timeline?seconds=3), /admin/discovery, /admin/placement, /admin/cluster, /admin/tenants.
    # Until 2026-12-05 it counted the first three only, the timeline's whole window among them (the page read it
    # each second then): docs/benchmarks.md, "Fleet scale".
    fleet_page_refresh_bytes: int | None = None
    # The router's resident set after the load, and its growth per engine over the smallest fleet.
    rss_mb: float | None = None
    memory_per_engine_kb: float | None = None


class FleetScaleReport(msgspec.Struct, frozen=True, kw_only=True):
    """The fleet scenario: the same load in front of each fleet size, and how the costs grew."""

    sizes: list[FleetSizeReport]
    idle_s: float
    # Each size's CPU per request over the smallest fleet's (1.0 = flat), as measured and less the scrapes.
    cpu_per_request_vs_smallest: dict[str, float | None] = {}
    cpu_per_request_less_scrapes_vs_smallest: dict[str, float | None] = {}


class AuthComparison(msgspec.Struct, frozen=True, kw_only=True):
    """``--compare-auth``: passes with client auth off and on alike; CPU per request over each mode's passes."""

    passes: list[RunReport]
    # Each pass's mode, in order (passes[i] had client auth on when auth_on[i]).
    auth_on: list[bool]
    cpu_ms_per_request_off: float | None
    cpu_ms_per_request_on: float | None
    # on / off: 1.03 is 3 % more CPU per request with auth on.
    ratio: float | None


class TenantFigures(msgspec.Struct, frozen=True, kw_only=True):
    """One tenant of the priority scenario: what its clients saw and what the router says it waited."""

    tenant: str
    priority: str
    concurrency: int
    requests: int
    ok: int
    errors_by_status: dict[str, int]
    # Requests served before the tenants' clients stopped issuing (the fairness window).
    ok_in_window: int
    client_total_p50_ms: float | None
    # From narwhal_tenant_queue_wait_seconds over the run (bucket counts, interpolated within a bucket).
    queue_wait_count: int
    queue_wait_p50_ms: float | None
    queue_wait_p90_ms: float | None
    queue_wait_mean_ms: float | None


class PriorityReport(msgspec.Struct, frozen=True, kw_only=True):
    """``--scenario priority``: per tenant and per class queue waits under saturation, and fairness."""

    max_connections: int
    reserve_high: float
    max_queue: int
    duration_s: float
    tenants: list[TenantFigures]
    # Per class (both normal tenants' buckets together): p50 queue wait, ms.
    class_queue_wait_p50_ms: dict[str, float | None]
    ordered: bool
    # normal-a's and normal-b's shares of the normal class's completions in the window; each >= 0.4 passes.
    fairness_shares: dict[str, float | None]
    fair: bool


class BenchReport(msgspec.Struct, frozen=True, kw_only=True):
    """Everything ``--json`` writes: the settings, the run, the optional baseline and fault report."""

    settings: dict[str, object]
    run: RunReport
    baseline: RunReport | None = None
    router_vs_direct: dict[str, float | None] | None = None
    faults: FaultReport | None = None
    # Narwhal only: its /admin/timeline at the end of the run, and when the load began (unix), for --report.
    timeline: dict[str, Any] | None = None
    load_started_unix: float | None = None
    # The prefix scenario's cache figures (narwhal.tools.bench.prefix.PrefixReport).
    prefix: PrefixReport | None = None
    # The fleet scenario: every size (``run`` is then the largest fleet's load).
    fleet_scale: FleetScaleReport | None = None
    # --compare-kv-events / --routers N: each placement pass (``run`` and ``prefix`` are then the first's).
    placement_passes: list[PlacementPass] | None = None
    # --compare-routers: per kv_events mode, the N-router pass over the lone router's.
    routers_comparison: list[RoutersComparison] | None = None
    # --compare-auth: the passes with client auth off and on (``run`` is then the last pass).
    auth_comparison: AuthComparison | None = None
    # --scenario priority (``run`` is then every tenant's requests together).
    priority: PriorityReport | None = None


# ----- the table -------------------------------------------------------------------

def _fmt(value: float | int | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.{digits}f}"


def _dist_cells(dist: Distribution | None, which: Sequence[str]) -> list[str]:
    return [_fmt(getattr(dist, f"{name}_ms") if dist else None) for name in which]


def _rows(run: RunReport) -> list[tuple[str, str]]:
    load = run.load
    rows = [
        ("requests (ok / errors)", f"{load.ok} / {load.errors}"),
        ("duration s", _fmt(load.duration_s)),
        ("requests/s", _fmt(load.requests_per_s, 1)),
        ("tokens/s", _fmt(load.tokens_per_s, 0)),
        ("TTFT ms p50 / p90 / p99", " / ".join(_dist_cells(load.ttft, ("p50", "p90", "p99")))),
        ("inter-token ms p50 / p99", " / ".join(_dist_cells(load.inter_token, ("p50", "p99")))),
        ("total ms p50 / p99", " / ".join(_dist_cells(load.total, ("p50", "p99")))),
        ("client connections opened", str(load.connections_opened)),
    ]
    if load.offered_rate is not None:
        rows[2:2] = [("offered requests/s (open loop)", _fmt(load.offered_rate, 1)),
                     ("late starts / latest ms", f"{load.late_starts} / {_fmt(load.late_max_ms)}")]
    if run.router is not None:
        rows += [
            ("router CPU ms / request", _fmt(run.router.cpu_ms_per_request, 3)),
            ("router CPU ms / 1k tokens", _fmt(run.router.cpu_ms_per_1k_tokens, 1)),
            ("router CPU cores busy", _fmt(run.router.cpu_utilization, 2)),
            ("router peak RSS MB", _fmt(run.router.peak_rss_mb, 1)),
        ]
    if run.load_generator is not None:
        rows.append(("load generator CPU cores busy", _fmt(run.load_generator.cpu_utilization, 2)))
    for engine in run.engines:
        rows.append((f"{engine.name} new connections / request", _fmt(engine.connections_per_request, 3)))
        rows.append((f"{engine.name} CPU cores busy", _fmt(engine.cpu_utilization, 2)))
    errors = ", ".join(f"{k} {v}" for k, v in load.errors_by_kind.items()) or "none"
    rows.append(("errors by kind", errors))
    if load.errors_by_status:
        rows.append(("errors by status", ", ".join(f"{k} {v}" for k, v in load.errors_by_status.items())))
    return rows


def _model_rows(load: LoadSummary) -> list[tuple[str, str]]:
    """One model's column: what its requests saw (the router's and engines' costs are the run's)."""
    return [
        ("requests (ok / errors)", f"{load.ok} / {load.errors}"),
        ("requests/s", _fmt(load.requests_per_s, 1)),
        ("tokens/s", _fmt(load.tokens_per_s, 0)),
        ("TTFT ms p50 / p90 / p99", " / ".join(_dist_cells(load.ttft, ("p50", "p90", "p99")))),
        ("total ms p50 / p99", " / ".join(_dist_cells(load.total, ("p50", "p99")))),
        ("errors by kind", ", ".join(f"{k} {v}" for k, v in load.errors_by_kind.items()) or "none"),
    ]


def _table(columns: Sequence[tuple[str, list[tuple[str, str]]]]) -> str:
    names = [name for name, _ in columns]
    labels: list[str] = []
    for _, rows in columns:
        for label, _ in rows:
            if label not in labels:
                labels.append(label)
    cells = [[dict(rows).get(label, "") for _, rows in columns] for label in labels]
    label_width = max(len(label) for label in labels)
    widths = [max(len(names[i]), *(len(row[i]) for row in cells)) for i in range(len(columns))]
    lines = ["  ".join([" " * label_width, *(n.rjust(w) for n, w in zip(names, widths, strict=True))])]
    for label, row in zip(labels, cells, strict=True):
        lines.append("  ".join([label.ljust(label_width), *(c.rjust(w) for c, w in zip(row, widths, strict=True))]))
    return "\n".join(lines)


def _fault_lines(faults: FaultReport) -> list[str]:
    def secs(value: float | None) -> str:
        return "not seen" if value is None else f"{value:.2f} s"

    during_fault = faults.failing_engine_requests_during_fault
    lines = [
        "",
        f"fault scenario: {faults.killed_engine} killed and restarted; "
        f"{faults.failing_engine} answered {faults.failing_status} for a while",
        f"  goodput                                   {faults.goodput * 100:.2f} %",
        f"  requests lost                             {faults.requests_lost}"
        + (f" ({', '.join(f'{k} {v}' for k, v in faults.lost_by_kind.items())})" if faults.lost_by_kind else ""),
        f"  streams cut                               {faults.streams_cut} "
        f"({faults.cut_with_error_event} with an SSE error event, {faults.cut_silently} silently)",
        f"  attempts on the dead engine               "
        f"{'not observable' if faults.attempts_on_dead_engine is None else faults.attempts_on_dead_engine}",
        f"  dead engine: last attempt after kill      {secs(faults.dead_engine_last_attempt_s)}",
        f"  dead engine: ineligible after kill        {secs(faults.dead_engine_ineligible_s)}",
        f"  restarted engine: health 200 after restart {secs(faults.restarted_engine_health_s)}",
        f"  restarted engine: eligible after restart  {secs(faults.restarted_engine_eligible_s)}",
        f"  restarted engine: eligible after its health returned "
        f"{secs(faults.restarted_engine_eligible_after_health_s)}",
        f"  restarted engine: first served after      {secs(faults.restarted_engine_first_served_s)}",
        f"  restarted engine: first served after its health returned "
        f"{secs(faults.restarted_engine_first_served_after_health_s)}",
        f"  5xx engine: requests during the fault     {'-' if during_fault is None else during_fault}",
        f"  5xx engine: last request after fault set  {secs(faults.failing_engine_last_request_s)}",
        f"  5xx engine: ineligible after fault set    {secs(faults.failing_engine_ineligible_s)}",
        f"  5xx engine: eligible after fault cleared  {secs(faults.failing_engine_eligible_again_s)}",
    ]
    if faults.requests_continued is not None:
        gap = faults.join_gap_ms
        gap_text = (f"join gap p50 {gap['p50']:.1f} ms, p99 {gap['p99']:.1f} ms, max {gap['max']:.1f} ms"
                    if gap else "no join")
        lines.append(f"  streams continued                         {faults.requests_continued} "
                     f"({faults.continuations} continuations; {gap_text})")
    lines += [f"  note: {note}" for note in faults.notes]
    return lines


def _fleet_rows(size: FleetSizeReport, ratio: float | None, ratio_less_scrapes: float | None) -> list[tuple[str, str]]:
    run = size.run
    answers = {answer.path: answer for answer in size.answers}

    def answer(path: str) -> str:
        found = answers.get(path)
        if found is None or found.bytes is None:
            return "-"
        return f"{found.bytes / 1024:.1f} KiB / {_fmt(found.ms, 1)} ms"

    router = run.router
    return [
        ("engines (prefill + decode)", f"{size.engines} ({size.prefill} + {size.decode})"),
        ("ready after s", _fmt(size.ready_s, 1)),
        ("idle CPU ms / s", _fmt(size.idle_cpu_ms_per_s, 1)),
        ("requests (ok / errors)", f"{run.load.ok} / {run.load.errors}"),
        ("requests/s", _fmt(run.load.requests_per_s, 1)),
        ("TTFT ms p50", _fmt(run.load.ttft.p50_ms if run.load.ttft else None)),
        ("router CPU ms / request", _fmt(router.cpu_ms_per_request if router else None, 3)),
        ("  over the smallest fleet's", _fmt(ratio, 2)),
        ("router CPU ms / request less scrapes", _fmt(size.cpu_ms_per_request_less_scrapes, 3)),
        ("  less scrapes, over the smallest fleet's", _fmt(ratio_less_scrapes, 2)),
        ("monitor pass s median / max (n)",
         f"{_fmt(size.monitor_pass_median_s, 3)} / {_fmt(size.monitor_pass_max_s, 3)} ({size.monitor_pass_samples})"),
        ("handoff KiB", _fmt(size.handoff_bytes / 1024 if size.handoff_bytes is not None else None, 1)),
        ("handoff write ms mean / max <=",
         f"{_fmt(size.handoff_write_mean_ms, 2)} / {_fmt(size.handoff_write_max_ms_at_most, 1)}"),
        ("/admin/engines", answer("/admin/engines")),
        ("fleet page /admin/ui", answer("/admin/ui")),
        ("  /admin/router", answer("/admin/router")),
        ("  /admin/timeline (when the page opens)", answer("/admin/timeline")),
        ("  /admin/timeline?seconds=3 (each refresh)", answer("/admin/timeline?seconds=3")),
        ("  /admin/discovery", answer("/admin/discovery")),
        ("  /admin/placement", answer("/admin/placement")),
        ("  /admin/cluster", answer("/admin/cluster")),
        ("  /admin/tenants", answer("/admin/tenants")),
        ("  KiB read per refresh", _fmt(size.fleet_page_refresh_bytes / 1024
                                        if size.fleet_page_refresh_bytes is not None else None, 1)),
        ("/metrics", answer("/metrics")),
        ("/metrics CPU ms (scrapes in the load)", f"{_fmt(size.metrics_scrape_cpu_ms, 1)} ({size.metrics_scrapes})"),
        ("router RSS MB after the load", _fmt(size.rss_mb, 1)),
        ("memory per engine KiB", _fmt(size.memory_per_engine_kb, 1)),
    ]


def format_fleet_scale(fleet: FleetScaleReport, label: str) -> str:
    """The fleet scenario's table: one column per fleet size."""
    columns = [(f"{label} {size.engines}", _fleet_rows(
        size, fleet.cpu_per_request_vs_smallest.get(str(size.engines)),
        fleet.cpu_per_request_less_scrapes_vs_smallest.get(str(size.engines)))) for size in fleet.sizes]
    return "\n".join([_table(columns), f"(idle CPU over {fleet.idle_s:g} s with no load; less scrapes: the load's CPU "
                      "less this scenario's /metrics scrapes during it; the monitor pass and the handoff from "
                      "/metrics; a quarter of each fleet prefills)"])


def _auth_lines(comparison: AuthComparison) -> list[str]:
    ratio = comparison.ratio
    verdict = "-" if ratio is None else "within 3 %" if ratio <= 1.03 else "OVER 3 %"
    return ["", f"client auth cost ({len(comparison.passes)} passes, off and on in turn, same fleet)",
            f"  router CPU ms / request  auth off {_fmt(comparison.cpu_ms_per_request_off, 4)}, "
            f"auth on {_fmt(comparison.cpu_ms_per_request_on, 4)}",
            f"  on / off                 {_fmt(ratio, 3)} ({verdict})"]


def _priority_lines(priority: PriorityReport) -> list[str]:
    columns = [(f"{t.tenant} ({t.priority})", [
        ("clients", str(t.concurrency)),
        ("requests (ok / errors)", f"{t.ok} / {t.requests - t.ok}"),
        ("ok before the clients stopped", str(t.ok_in_window)),
        ("client total ms p50", _fmt(t.client_total_p50_ms, 1)),
        ("queue wait ms p50 / p90", f"{_fmt(t.queue_wait_p50_ms, 1)} / {_fmt(t.queue_wait_p90_ms, 1)}"),
        ("queue wait ms mean (n)", f"{_fmt(t.queue_wait_mean_ms, 1)} ({t.queue_wait_count})"),
        ("errors by status", ", ".join(f"{k} {v}" for k, v in t.errors_by_status.items()) or "none"),
    ]) for t in priority.tenants]
    waits = priority.class_queue_wait_p50_ms
    shares = priority.fairness_shares
    return ["", f"priority scenario: max_connections {priority.max_connections}, reserve_high "
            f"{priority.reserve_high:g}, max_queue {priority.max_queue}, clients for {priority.duration_s:g} s",
            _table(columns),
            "p50 queue wait by class ms: " + ", ".join(f"{c} {_fmt(v, 1)}" for c, v in waits.items())
            + f"; high < normal < low: {'pass' if priority.ordered else 'FAIL'}",
            "fairness (shares of the normal class's requests served while both waited): "
            + ", ".join(f"{t} {_fmt(v * 100 if v is not None else None, 1)} %" for t, v in shares.items())
            + f"; each >= 40 %: {'pass' if priority.fair else 'FAIL'}"]


def format_report(report: BenchReport) -> str:
    """The table the CLI prints: the run, the direct baseline beside it, then the fault scenario."""
    if report.fleet_scale is not None:
        return format_fleet_scale(report.fleet_scale, report.run.label.partition(" (")[0])
    runs = report.auth_comparison.passes if report.auth_comparison is not None else [report.run]
    columns = [(run.label, _rows(run)) for run in runs]
    columns += [(f"model {name}", _model_rows(load)) for name, load in report.run.models.items()]
    if report.baseline is not None:
        columns.append((report.baseline.label, _rows(report.baseline)))
    lines = [_table(columns)]
    if report.router_vs_direct:
        ratios = ", ".join(f"{k} {_fmt(v, 2)}" for k, v in report.router_vs_direct.items())
        lines.append(f"router / direct: {ratios}")
    if report.faults is not None:
        lines += _fault_lines(report.faults)
    if report.prefix is not None:
        lines += format_prefix_lines(report.prefix)
    if report.placement_passes:
        lines += format_pass_lines(report.placement_passes)
    if report.routers_comparison:
        lines += ["", "several routers against one (same fleet, caches emptied before each pass)",
                  *format_comparison_lines(report.routers_comparison)]
    if report.auth_comparison is not None:
        lines += _auth_lines(report.auth_comparison)
    if report.priority is not None:
        lines += _priority_lines(report.priority)
    return "\n".join(lines)
