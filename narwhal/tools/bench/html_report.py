"""``narwhal bench --report FILE.html``: the run as one self-contained HTML page.

The figures table (as the terminal shows it) and, when the router was Narwhal,
strip charts drawn from its ``/admin/timeline`` over the run: requests/s,
errors/s by class, TTFT p50/p99 and each engine's state (eligible, held,
ejected), with the fault scenario's events marked. Inline SVG and CSS only:
no script, nothing fetched.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

from narwhal.tools.bench.report import BenchReport, format_report

__all__ = ["render_html"]

_W, _H = 960, 90
_COLORS = ("#2b6cb0", "#c53030", "#2f855a", "#b7791f", "#6b46c1", "#00838f", "#d53f8c", "#4a5568")
_STATE_COLORS = {"eligible": "#1b7f3b", "held": "#b7791f", "ejected": "#c53030"}
_STYLE = """
body { font: 13px/1.4 system-ui, sans-serif; margin: 16px; color: #222; }
pre { background: #f6f6f6; padding: 8px; overflow-x: auto; }
svg { width: 100%; max-width: 960px; display: block; background: #fcfcfc; border: 1px solid #ddd; }
.legend span { margin-right: 12px; } .swatch { display: inline-block; width: 10px; height: 10px; margin-right: 3px; }
h2 { font-size: 15px; margin-top: 18px; } .muted { color: #666; }
"""


def _x(i: float, n: int) -> float:
    return i * _W / max(n - 1, 1)


def _marks(marks: Sequence[tuple[float, str]], n: int, height: int) -> list[str]:
    out = []
    for offset, label in marks:
        x = _x(offset, n)
        out.append(f'<line class="fault-mark" x1="{x:.1f}" x2="{x:.1f}" y1="0" y2="{height}" stroke="#000" '
                   f'stroke-dasharray="4 3"><title>{html.escape(label)}</title></line>')
    return out


def _line_chart(chart_id: str, title: str, series: Sequence[tuple[str, Sequence[float | None]]], unit: str,
                marks: Sequence[tuple[float, str]]) -> str:
    n = len(series[0][1]) if series else 0
    top = max([v for _, values in series for v in values if v is not None] or [0.0])
    scale = top * 1.1 if top > 0 else 1.0
    parts = [f'<svg id="{chart_id}" viewBox="0 0 {_W} {_H}" preserveAspectRatio="none" height="{_H}">']
    legend = [f"<b>{html.escape(title)}</b> <span class='muted'>max {top:.4g} {unit}</span>"]
    for index, (name, values) in enumerate(series):
        color = _COLORS[index % len(_COLORS)]
        points = [f"{_x(i, n):.1f},{_H - v / scale * (_H - 4):.1f}" for i, v in enumerate(values) if v is not None]
        if points:
            parts.append(f'<polyline class="series" data-series="{html.escape(name)}" points="{" ".join(points)}" '
                         f'fill="none" stroke="{color}" stroke-width="1.5"/>')
        legend.append(f"<span><span class='swatch' style='background:{color}'></span>{html.escape(name)}</span>")
    parts += _marks(marks, n, _H)
    parts.append("</svg>")
    return f'<div class="legend">{" ".join(legend)}</div>' + "".join(parts)


def _state_chart(engines: Sequence[str], state: dict[str, list[str | None]], n: int,
                 marks: Sequence[tuple[float, str]]) -> str:
    row_h = 16
    height = row_h * len(engines)
    parts = [f'<svg id="chart-state" viewBox="0 0 {_W} {height}" preserveAspectRatio="none" height="{height}">']
    for row, name in enumerate(engines):
        values = state.get(name, [])
        start = 0
        for x in range(1, n + 1):
            if x == n or values[x] != values[start]:
                value = values[start]
                if value is not None:
                    parts.append(
                        f'<rect class="state-segment" data-engine="{html.escape(name)}" data-state="{value}" '
                        f'x="{start * _W / n:.1f}" y="{row * row_h + 1}" width="{max((x - start) * _W / n, 1):.1f}" '
                        f'height="{row_h - 2}" fill="{_STATE_COLORS.get(value, "#999")}">'
                        f'<title>{html.escape(name)}: {value} for {x - start} s</title></rect>')
                start = x
    parts += _marks(marks, n, height)
    parts.append("</svg>")
    legend = " ".join(f"<span><span class='swatch' style='background:{c}'></span>{k}</span>"
                      for k, c in _STATE_COLORS.items())
    return (f"<div class='legend'><b>Engine state</b> (rows: {html.escape(', '.join(engines))}) {legend}</div>"
            + "".join(parts))


def _window(timeline: dict[str, Any], started_unix: float | None) -> tuple[int, int]:
    """The timeline's indexes covering the run (from a second before the load started)."""
    n = len(timeline["requests"])
    if started_unix is None:
        return 0, n
    first = int(started_unix - timeline["start_unix"]) - 1
    return max(0, min(first, n - 1)), n


def _charts(report: BenchReport) -> str:
    timeline = report.timeline
    if not timeline:
        return "<p class='muted'>No timeline: the router was not Narwhal, or it did not answer /admin/timeline.</p>"
    lo, hi = _window(timeline, report.load_started_unix)
    n = hi - lo

    def cut(values: Sequence[Any]) -> list[Any]:
        return list(values[lo:hi])

    marks: list[tuple[float, str]] = []
    if report.faults is not None and report.load_started_unix is not None:
        base = report.load_started_unix - (timeline["start_unix"] + lo)
        marks = [(base + float(event["at_s"]), str(event["event"])) for event in report.faults.timeline  # type: ignore[arg-type]
                 if isinstance(event.get("at_s"), (int, float))]
    errors = [(name, cut(values)) for name, values in timeline["errors"].items()]
    errors += [(f"recovered {name}", cut(values)) for name, values in timeline.get("recovered", {}).items()]
    errors = errors or [("none", [0] * n)]
    engines = list(timeline["engines"])
    events = report.faults.timeline if report.faults is not None else []
    mark_list = "".join(f"<li>{html.escape(str(event.get('at_s')))} s after the load began: "
                        f"{html.escape(str(event.get('event')))}</li>" for event in events)
    return "".join([
        f"<p class='muted'>{n} one-second buckets from the router's /admin/timeline, from a second before the "
        f"load began; dashed lines mark the injected faults. Engine states are sampled once a second.</p>",
        _line_chart("chart-requests", "Requests/s", [("requests", cut(timeline["requests"]))], "/s", marks),
        _line_chart("chart-errors", "Errors/s by class (and recovered from)", errors, "/s", marks),
        _line_chart("chart-ttft", "TTFT", [("p50", cut(timeline["ttft_p50_ms"])),
                                           ("p99", cut(timeline["ttft_p99_ms"]))], "ms", marks),
        _state_chart(engines, {name: cut(timeline["state"][name]) for name in engines}, n, marks),
        f"<ul class='marks'>{mark_list}</ul>" if mark_list else "",
    ])


def render_html(report: BenchReport) -> str:
    """The report as one HTML document: the figures table, then the timelines."""
    label = html.escape(report.run.label)
    scenario = html.escape(str(report.settings.get("scenario", "load")))
    return (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        f"<title>Narwhal bench: {label} ({scenario})</title><style>{_STYLE}</style></head><body>"
        f"<h1>Narwhal bench: {label}, scenario {scenario}</h1>"
        f"<h2>Figures</h2><pre id='figures'>{html.escape(format_report(report))}</pre>"
        f"<h2>Timeline</h2>{_charts(report)}"
        "</body></html>\n"
    )
