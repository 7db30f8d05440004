"""Markdown tables from the JSON files ``bench/compare.sh`` writes (``CASE__ROUTER__REP.json``).

Usage: python bench/summarize.py RESULTS_DIR

Each figure is the median over the repetitions of one case and router; the
routers of a case sit side by side, Narwhal's ratio to vllm-router last.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

_ROUTER_ORDER = ("narwhal", "vllm-router", "sglang-router")

# (column title, path into the report, digits)
_LOAD_FIGURES = (
    ("req/s", ("run", "load", "requests_per_s"), 0),
    ("TTFT p50 ms", ("run", "load", "ttft", "p50_ms"), 2),
    ("TTFT p99 ms", ("run", "load", "ttft", "p99_ms"), 2),
    ("CPU ms/req", ("run", "router", "cpu_ms_per_request"), 3),
    ("CPU ms/1k tok", ("run", "router", "cpu_ms_per_1k_tokens"), 1),
    ("peak RSS MB", ("run", "router", "peak_rss_mb"), 0),
    ("errors", ("run", "load", "errors"), 0),
)
_FAULT_FIGURES = (
    ("goodput %", ("faults", "goodput"), 2),
    ("lost", ("faults", "requests_lost"), 0),
    ("cut (SSE error / silent)", None, 0),
    ("dead engine out after s", ("faults", "dead_engine_ineligible_s"), 2),
    ("restarted engine served after s", ("faults", "restarted_engine_first_served_s"), 2),
    ("restarted engine eligible after its health returned s",
     ("faults", "restarted_engine_eligible_after_health_s"), 2),
    ("5xx engine requests", ("faults", "failing_engine_requests_during_fault"), 0),
    ("5xx engine last request after s", ("faults", "failing_engine_last_request_s"), 2),
)


def _get(report: dict[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = report
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def _median(values: list[Any]) -> float | None:
    numbers = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(numbers) if numbers else None


def _cell(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def load_results(directory: Path) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """case -> router -> reports."""
    results: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(directory.glob("*.json")):
        parts = path.stem.split("__")
        if len(parts) != 3:
            continue
        case, router, _ = parts
        results[case][router].append(json.loads(path.read_text()))
    return results


def _routers(by_router: dict[str, list[dict[str, Any]]]) -> list[str]:
    return sorted(by_router, key=lambda r: (_ROUTER_ORDER.index(r) if r in _ROUTER_ORDER else 99, r))


def load_table(case: str, by_router: dict[str, list[dict[str, Any]]]) -> str:
    """One markdown table: a row per router, medians of each figure, and Narwhal / vllm-router."""
    lines = [f"#### {case}", "", "| router | runs | " + " | ".join(t for t, _, _ in _LOAD_FIGURES) + " |",
             "|---|---|" + "---|" * len(_LOAD_FIGURES)]
    medians: dict[str, list[float | None]] = {}
    for router in _routers(by_router):
        reports = by_router[router]
        medians[router] = [_median([_get(r, path) for r in reports]) for _, path, _ in _LOAD_FIGURES]
        cells = [_cell(v, d) for v, (_, _, d) in zip(medians[router], _LOAD_FIGURES, strict=True)]
        lines.append(f"| {router} | {len(reports)} | " + " | ".join(cells) + " |")
    if "narwhal" in medians and "vllm-router" in medians:
        ratios = []
        for ours, theirs in zip(medians["narwhal"], medians["vllm-router"], strict=True):
            ratios.append("-" if ours is None or not theirs else f"{ours / theirs:.2f}x")
        lines.append("| narwhal / vllm-router | | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def fault_table(case: str, by_router: dict[str, list[dict[str, Any]]]) -> str:
    """The fault scenario per router: medians over repetitions."""
    lines = [f"#### {case}", "", "| router | runs | " + " | ".join(t for t, _, _ in _FAULT_FIGURES) + " |",
             "|---|---|" + "---|" * len(_FAULT_FIGURES)]
    for router in _routers(by_router):
        reports = by_router[router]
        cells = []
        for title, path, digits in _FAULT_FIGURES:
            if path is None:
                with_event = _median([_get(r, ("faults", "cut_with_error_event")) for r in reports])
                silent = _median([_get(r, ("faults", "cut_silently")) for r in reports])
                cells.append(f"{_cell(with_event, 0)} / {_cell(silent, 0)}")
                continue
            value = _median([_get(r, path) for r in reports])
            if title == "goodput %" and value is not None:
                value *= 100
            cells.append(_cell(value, digits))
        lines.append(f"| {router} | {len(reports)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    results = load_results(Path(sys.argv[1]))
    for case in sorted(results):
        by_router = results[case]
        has_faults = any(_get(r, ("faults",)) for reports in by_router.values() for r in reports)
        print(fault_table(case, by_router) if has_faults else load_table(case, by_router))
        print()


if __name__ == "__main__":
    main()
