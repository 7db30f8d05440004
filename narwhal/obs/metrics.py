"""A small Prometheus registry, cheap enough for the request hot path.

Counters and histograms keep plain dicts keyed by label-value tuples; nothing is
formatted until ``/metrics`` is scraped. Gauges that mirror live state (pool
occupancy, in-flight requests) are read through callbacks at scrape time, so the
hot path never updates them.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence

__all__ = ["Counter", "Gauge", "Histogram", "Registry", "LATENCY_BUCKETS_S"]

LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{name}="{_escape(str(value))}"' for name, value in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


class Counter:
    """A monotonically increasing count per label combination."""

    kind = "counter"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.label_names = tuple(labels)
        self.values: dict[tuple[str, ...], float] = {}
        # Values counted elsewhere (worker processes), added at scrape time.
        self.external: Callable[[], dict[tuple[str, ...], float]] | None = None

    def inc(self, *label_values: str, amount: float = 1.0) -> None:
        self.values[label_values] = self.values.get(label_values, 0.0) + amount

    def get(self, *label_values: str) -> float:
        return self.values.get(label_values, 0.0)

    def render(self) -> Iterable[str]:
        values_by_labels = self.values
        if self.external is not None:
            values_by_labels = dict(values_by_labels)
            for labels, value in self.external().items():
                values_by_labels[labels] = values_by_labels.get(labels, 0.0) + value
        for values, count in values_by_labels.items():
            yield f"{self.name}_total{_labels(self.label_names, values)} {_number(count)}"


class Gauge:
    """A value read at scrape time from a callback returning {label-values: value}."""

    kind = "gauge"

    def __init__(self, name: str, help_text: str, labels: Sequence[str],
                 read: Callable[[], dict[tuple[str, ...], float]]) -> None:
        self.name = name
        self.help = help_text
        self.label_names = tuple(labels)
        self.read = read

    def render(self) -> Iterable[str]:
        for values, value in self.read().items():
            yield f"{self.name}{_labels(self.label_names, values)} {_number(value)}"


class Histogram:
    """Cumulative-bucket histogram per label combination."""

    kind = "histogram"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = (),
                 buckets: Sequence[float] = LATENCY_BUCKETS_S) -> None:
        self.name = name
        self.help = help_text
        self.label_names = tuple(labels)
        self.bounds = tuple(buckets)
        # Per label set: [bucket counts..., +Inf count], sum.
        self.series: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}
        # Series observed elsewhere (worker processes): labels -> (bucket counts, sum), added at scrape time.
        self.external: Callable[[], dict[tuple[str, ...], tuple[list[int], float]]] | None = None

    def observe(self, value: float, *label_values: str) -> None:
        series = self.series.get(label_values)
        if series is None:
            series = self.series[label_values] = ([0] * (len(self.bounds) + 1), [0.0])
        series[0][bisect.bisect_left(self.bounds, value)] += 1
        series[1][0] += value

    def cell(self, *label_values: str) -> tuple[list[int], list[float]]:
        """One label set's bucket counts (``bounds``' order, then +Inf) and sum, for a per-token path that
        observes inline (``counts[bisect_left(bounds, value)] += 1; total[0] += value``, as ``observe``)."""
        series = self.series.get(label_values)
        if series is None:
            series = self.series[label_values] = ([0] * (len(self.bounds) + 1), [0.0])
        return series

    def count(self, *label_values: str) -> int:
        series = self.series.get(label_values)
        return sum(series[0]) if series else 0

    def render(self) -> Iterable[str]:
        series = self.series
        if self.external is not None:
            series = dict(series)
            for labels, (ext_counts, ext_sum) in self.external().items():
                own = series.get(labels)
                if own is None:
                    series[labels] = (ext_counts, [ext_sum])
                else:
                    series[labels] = ([a + b for a, b in zip(own[0], ext_counts, strict=True)],
                                      [own[1][0] + ext_sum])
        for values, (counts, total) in series.items():
            running = 0
            for bound, count in zip((*self.bounds, math.inf), counts, strict=True):
                running += count
                le = f'le="{_number(bound)}"'
                yield f"{self.name}_bucket{_labels(self.label_names, values, le)} {running}"
            yield f"{self.name}_sum{_labels(self.label_names, values)} {repr(total[0])}"
            yield f"{self.name}_count{_labels(self.label_names, values)} {running}"


class Registry:
    """Holds metrics in registration order and renders the text exposition format."""

    def __init__(self) -> None:
        self._metrics: list[Counter | Gauge | Histogram] = []

    def counter(self, name: str, help_text: str, labels: Sequence[str] = ()) -> Counter:
        return self._add(Counter(name, help_text, labels))

    def histogram(self, name: str, help_text: str, labels: Sequence[str] = (),
                  buckets: Sequence[float] = LATENCY_BUCKETS_S) -> Histogram:
        return self._add(Histogram(name, help_text, labels, buckets))

    def gauge(self, name: str, help_text: str, labels: Sequence[str],
              read: Callable[[], dict[tuple[str, ...], float]]) -> Gauge:
        return self._add(Gauge(name, help_text, labels, read))

    def metrics(self) -> list[Counter | Gauge | Histogram]:
        """Every registered metric, in registration order."""
        return list(self._metrics)

    def _add(self, metric):
        self._metrics.append(metric)
        return metric

    def render(self, prefix: str = "") -> str:
        """The text exposition of every metric, or of those whose name starts with ``prefix``."""
        lines: list[str] = []
        for metric in self._metrics:
            if not metric.name.startswith(prefix):
                continue
            # Text format 0.0.4 names a counter by its sample name, suffix included.
            name = f"{metric.name}_total" if metric.kind == "counter" else metric.name
            lines.append(f"# HELP {name} {metric.help}")
            lines.append(f"# TYPE {name} {metric.kind}")
            lines.extend(metric.render())
        lines.append("")
        return "\n".join(lines)
