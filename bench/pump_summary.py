"""Markdown tables from a ``bench/pump_compare.sh`` results directory: figures, targets, syscalls, profiles.

Usage: python bench/pump_summary.py RESULTS_DIR

Figures are medians over the repetitions; a ratio is of the two medians, and the
"per repetition" column gives the same ratio within each repetition (the runs of
one repetition are minutes apart, so these show how steady the ratio is). The
first tree named to pump_compare.sh is "before", the last "after".
"""

from __future__ import annotations

import json
import re
import signal
import sys
from pathlib import Path
from typing import Any

from profile_top import top_costs
from summarize import _get, _median, load_results

_CASES = ("paced-c64", "paced-c8", "unpaced-c64", "unpaced-c8", "unpaced-open")
_FIGURES = (
    ("offered req/s", ("run", "load", "offered_rate"), 0),
    ("req/s", ("run", "load", "requests_per_s"), 0),
    ("tokens/s", ("run", "load", "tokens_per_s"), 0),
    ("TTFT p50 ms", ("run", "load", "ttft", "p50_ms"), 2),
    ("TTFT p99 ms", ("run", "load", "ttft", "p99_ms"), 2),
    ("total p50 ms", ("run", "load", "total", "p50_ms"), 2),
    ("CPU ms/req", ("run", "router", "cpu_ms_per_request"), 3),
    ("CPU ms/1k tok", ("run", "router", "cpu_ms_per_1k_tokens"), 1),
    ("router cores", ("run", "router", "cpu_utilization"), 2),
    ("errors", ("run", "load", "errors"), 0),
)
_CPU_1K = ("run", "router", "cpu_ms_per_1k_tokens")
_CPU_REQ = ("run", "router", "cpu_ms_per_request")
_TTFT = ("run", "load", "ttft", "p50_ms")
# (target, case, figure path, digits, highest ratio to vllm-router that meets it)
_TARGETS = (
    ("CPU ms per 1,000 tokens, paced c64", "paced-c64", _CPU_1K, 1, 1.2),
    ("TTFT p50 ms, paced c64", "paced-c64", _TTFT, 2, 1.0),
    ("TTFT p50 ms, paced c8", "paced-c8", _TTFT, 2, 1.0),
    ("TTFT p50 ms, unpaced c64", "unpaced-c64", _TTFT, 2, 1.0),
    ("TTFT p50 ms, unpaced c8", "unpaced-c8", _TTFT, 2, 1.0),
    # One offered load for both (pump_compare.sh's RATE), not each router's saturation: see the case's table.
    ("TTFT p50 ms, unpaced open loop", "unpaced-open", _TTFT, 2, 1.0),
    ("TTFT p99 ms, unpaced open loop", "unpaced-open", ("run", "load", "ttft", "p99_ms"), 2, 1.0),
    ("CPU ms per request, unpaced c64", "unpaced-c64", _CPU_REQ, 3, 1.0),
    ("CPU ms per request, unpaced c8", "unpaced-c8", _CPU_REQ, 3, 1.0),
)
_STRACE_LINE = re.compile(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(?P<calls>\d+)\s+(?P<errors>\d+)?\s*(?P<name>\w+)\s*$")


def _cell(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    return ours / theirs if ours is not None and theirs else None


def _ratio_cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def tree_labels(directory: Path) -> list[str]:
    """The Narwhal trees in the order pump_compare.sh was given them (``trees.txt``)."""
    path = directory / "trees.txt"
    if not path.exists():
        return []
    return [line.split(":", 1)[0] for line in path.read_text().splitlines() if ":" in line]


def _by_rep(reports: list[dict[str, Any]], path: tuple[str, ...]) -> dict[str, Any]:
    return {r.get("_rep", str(i)): _get(r, path) for i, r in enumerate(reports)}


def figures_table(case: str, by_router: dict[str, list[dict[str, Any]]], routers: list[str]) -> str:
    """A row per router with the medians of every figure."""
    lines = [f"#### {case}", "", "| router | runs | " + " | ".join(t for t, _, _ in _FIGURES) + " |",
             "|---|---|" + "---|" * len(_FIGURES)]
    for router in routers:
        reports = by_router.get(router, [])
        if not reports:
            continue
        cells = [_cell(_median([_get(r, path) for r in reports]), d) for _, path, d in _FIGURES]
        lines.append(f"| {router} | {len(reports)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets_table(results: dict[str, dict[str, list[dict[str, Any]]]], trees: list[str]) -> str:
    """Issue 24's targets: each tree's median, its ratio to vllm-router's, and the ratio per repetition."""
    after = trees[-1]
    head = ["target"] + trees + ["vllm-router"] + [f"{t} / vllm" for t in trees]
    head += [f"{after} / vllm per repetition", "goal", "met?"]
    if len(trees) > 1:
        head.insert(len(head) - 3, f"{after} / {trees[0]}")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for title, case, path, digits, goal in _TARGETS:
        by_router = results.get(case, {})
        medians = {r: _median([_get(x, path) for x in by_router.get(r, [])]) for r in [*trees, "vllm-router"]}
        ratios = {t: _ratio(medians[t], medians["vllm-router"]) for t in trees}
        ours_by_rep = _by_rep(by_router.get(after, []), path)
        theirs_by_rep = _by_rep(by_router.get("vllm-router", []), path)
        per_rep = [_ratio(ours_by_rep[k], theirs_by_rep.get(k)) for k in sorted(ours_by_rep)]
        row = [title] + [_cell(medians[r], digits) for r in [*trees, "vllm-router"]]
        row += [_ratio_cell(ratios[t]) for t in trees]
        if len(trees) > 1:
            row.append(_ratio_cell(_ratio(medians[after], medians[trees[0]])))
        row.append(", ".join(_ratio_cell(r) for r in per_rep) or "-")
        met = ratios[after]
        row += [f"<= {goal:.1f}x", "-" if met is None else ("**yes**" if met <= goal else "**no**")]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def parse_strace(text: str) -> dict[str, tuple[int, int]]:
    """``strace -c`` output -> {syscall: (calls, errors)} (the total line excluded)."""
    counts: dict[str, tuple[int, int]] = {}
    for line in text.splitlines():
        match = _STRACE_LINE.match(line)
        if match and match["name"] != "total":
            counts[match["name"]] = (int(match["calls"]), int(match["errors"] or 0))
    return counts


def syscalls_table(directory: Path, routers: list[str], top: int = 10, *, prefix: str = "strace",
                   per_request: bool = False) -> str | None:
    """Syscalls by kind per 1,000 relayed tokens (or per request): the larger strace run minus the smaller."""
    unit, scale, figure = ("requests", 1, "ok") if per_request else ("tokens", 1000, "tokens")
    per_1k: dict[str, dict[str, tuple[float, float]]] = {}
    notes = []
    for router in routers:
        runs = []
        for path in directory.glob(f"{prefix}__{router}__*.strace"):
            report_path = path.with_suffix(".json")
            if not report_path.exists():
                continue
            report = json.loads(report_path.read_text())
            runs.append((_get(report, ("run", "load", figure)) or 0, parse_strace(path.read_text()),
                         _get(report, ("run", "load", "errors")) or 0))
        if len(runs) < 2:
            continue
        runs.sort(key=lambda r: r[0])
        (small_n, small, _), (large_n, large, _) = runs[0], runs[-1]
        amount = large_n - small_n
        if amount <= 0:
            continue
        notes.append(f"{router}: {amount:,} {unit} between the runs"
                     + (f" ({sum(r[2] for r in runs)} errors)" if any(r[2] for r in runs) else ""))
        per_1k[router] = {}
        for name in set(small) | set(large):
            calls = large.get(name, (0, 0))[0] - small.get(name, (0, 0))[0]
            errors = large.get(name, (0, 0))[1] - small.get(name, (0, 0))[1]
            per_1k[router][name] = (scale * calls / amount, scale * errors / amount)
    if not per_1k:
        return None
    shown = list(per_1k)
    digits = 2 if per_request else 0
    least = 0.05 if per_request else 5  # leave out the syscalls of startup noise
    kinds = sorted({k for r in shown for k, (c, _) in per_1k[r].items() if c >= least},
                   key=lambda k: -max(per_1k[r].get(k, (0, 0))[0] for r in shown))[:top]
    lines = ["| syscall | " + " | ".join(shown) + " |", "|---|" + "---|" * len(shown)]
    for kind in kinds:
        cells = []
        for router in shown:
            calls, errors = per_1k[router].get(kind, (0.0, 0.0))
            failed = errors >= (0.01 if per_request else 1)
            cells.append(f"{calls:,.{digits}f}" + (f" ({errors:,.{digits}f} failed)" if failed else ""))
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    totals = [f"**{sum(c for c, _ in per_1k[r].values()):,.{digits}f}**" for r in shown]
    lines.append("| all | " + " | ".join(totals) + " |")
    return "\n".join(lines) + "\n\n" + "; ".join(notes) + "."


# trio's wait in epoll_wait: py-spy --nonblocking counts part of the time the router sleeps there as running.
_WAIT_FRAME = "EpollIOManager.get_events"


def profile_table(lines: list[str], top: int = 15) -> str:
    """Top self costs of a collapsed py-spy profile, as % of the samples not sleeping in epoll_wait."""
    total, own, _ = top_costs(lines)
    waiting = sum(count for name, count in own.items() if name.startswith(_WAIT_FRAME))
    working = total - waiting
    if not working:
        return "no samples"
    rows = ["| self % | function |", "|---|---|"]
    for name, count in own.most_common():
        if name.startswith(_WAIT_FRAME):
            continue
        rows.append(f"| {100 * count / working:.1f} | `{name}` |")
        if len(rows) == top + 2:
            break
    return "\n".join(rows) + (f"\n\n{total} samples; {100 * waiting / total:.0f}% in `{_WAIT_FRAME}` "
                              f"(epoll_wait, mostly asleep) left out of the percentages.")


def main() -> None:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    directory = Path(sys.argv[1])
    results = load_results(directory)
    for case, by_router in results.items():
        for router, reports in by_router.items():
            # load_results keeps file order (CASE__ROUTER__REP.json sorted): remember each report's repetition.
            reps = sorted(p.stem.split("__")[2] for p in directory.glob(f"{case}__{router}__*.json"))
            for report, rep in zip(reports, reps, strict=False):
                report["_rep"] = rep
    trees = tree_labels(directory) or sorted({r for c in _CASES for r in results.get(c, {})} - {"vllm-router"})
    routers = [*trees, "vllm-router"]
    if (directory / "trees.txt").exists():
        print("Trees: " + "; ".join((directory / "trees.txt").read_text().splitlines()) + "\n")
    if trees:
        print("#### Targets (issue 24)\n")
        print(targets_table(results, trees))
        print()
    for case in _CASES:
        if case in results:
            print(figures_table(case, results[case], routers))
            print()
    table = syscalls_table(directory, routers)
    if table:
        print("#### Syscalls per 1,000 tokens (paced c64, strace -f -c)\n")
        print(table)
        print()
    table = syscalls_table(directory, routers, prefix="strace-unpaced", per_request=True)
    if table:
        print("#### Syscalls per request (unpaced c64, strace -f -c)\n")
        print(table)
        print()
    for prefix, case in (("profile", "paced c64"), ("profile-unpaced", "unpaced c64")):
        for tree in trees:
            profile = directory / f"{prefix}__{tree}.collapsed.txt"
            if profile.exists():
                print(f"#### py-spy, {tree}, {case}: top self costs\n")
                print(profile_table(profile.read_text().splitlines()))
                print()

if __name__ == "__main__":
    main()
