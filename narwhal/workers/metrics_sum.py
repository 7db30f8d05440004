"""Prometheus counters and histograms summed over workers, for the controller's ``/metrics``.

Each worker reports its cumulative values since it started; the sum keeps the
last report of every live worker plus everything retired workers had counted,
so a restarted worker never makes a counter go backwards.
"""

from __future__ import annotations

from collections.abc import Iterator

from narwhal.obs.metrics import Counter, Histogram, Registry
from narwhal.workers.protocol import HistogramSeries, MetricsState

__all__ = ["MetricsSum", "export_state"]


def export_state(registry: Registry) -> MetricsState:
    """The cumulative counter and histogram values of ``registry`` (gauges are live state, not sent)."""
    counters: dict[str, list[tuple[list[str], float]]] = {}
    histograms: dict[str, list[HistogramSeries]] = {}
    for metric in registry.metrics():
        if isinstance(metric, Counter):
            if metric.values:
                counters[metric.name] = [(list(labels), value) for labels, value in metric.values.items()]
        elif isinstance(metric, Histogram):
            if metric.series:
                histograms[metric.name] = [HistogramSeries(list(labels), list(counts), total[0])
                                           for labels, (counts, total) in metric.series.items()]
    return MetricsState(counters=counters, histograms=histograms)


class MetricsSum:
    """The last state of each live worker plus the retired total."""

    def __init__(self) -> None:
        self._live: dict[int, MetricsState] = {}
        self._retired_counters: dict[str, dict[tuple[str, ...], float]] = {}
        self._retired_histograms: dict[str, dict[tuple[str, ...], tuple[list[int], float]]] = {}

    def update(self, worker: int, state: MetricsState) -> None:
        self._live[worker] = state

    def retire(self, worker: int) -> None:
        """Fold a gone worker's last counts into the retired total."""
        state = self._live.pop(worker, None)
        if state is None:
            return
        for name, series in state.counters.items():
            into = self._retired_counters.setdefault(name, {})
            for labels, value in series:
                key = tuple(labels)
                into[key] = into.get(key, 0.0) + value
        for name, hseries in state.histograms.items():
            hinto = self._retired_histograms.setdefault(name, {})
            for entry in hseries:
                key = tuple(entry.labels)
                counts, total = hinto.get(key, ([0] * len(entry.counts), 0.0))
                hinto[key] = ([a + b for a, b in zip(counts, entry.counts, strict=True)], total + entry.total)

    def counter(self, name: str) -> dict[tuple[str, ...], float]:
        """Counter ``name`` summed over live and retired workers."""
        out = dict(self._retired_counters.get(name, {}))
        for state in self._live.values():
            for labels, value in state.counters.get(name, ()):
                key = tuple(labels)
                out[key] = out.get(key, 0.0) + value
        return out

    def histogram(self, name: str) -> dict[tuple[str, ...], tuple[list[int], float]]:
        """Histogram ``name`` summed over live and retired workers: per labels, bucket counts and sum."""
        out = {key: (list(counts), total) for key, (counts, total)
               in self._retired_histograms.get(name, {}).items()}
        for state in self._live.values():
            for entry in state.histograms.get(name, ()):
                key = tuple(entry.labels)
                if key in out:
                    counts, total = out[key]
                    out[key] = ([a + b for a, b in zip(counts, entry.counts, strict=True)], total + entry.total)
                else:
                    out[key] = (list(entry.counts), entry.total)
        return out

    def per_worker(self, name: str) -> Iterator[tuple[int, float]]:
        """Counter ``name`` summed over its labels, per live worker."""
        for worker, state in sorted(self._live.items()):
            yield worker, sum(value for _, value in state.counters.get(name, ()))

    def attach_to(self, registry: Registry) -> None:
        """Make ``registry`` render its counters and histograms as its own values plus the workers'."""
        for metric in registry.metrics():
            if isinstance(metric, Counter):
                metric.external = lambda name=metric.name: self.counter(name)
            elif isinstance(metric, Histogram):
                metric.external = lambda name=metric.name: self.histogram(name)
