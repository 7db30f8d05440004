"""Telemetry stage: publish the latest closed interval to ``/metrics`` as per-engine gauges.

Gauges are read at scrape time from what the latest pass published, so a
scrape between passes sees the last closed interval, never a half-open one.
"""

from __future__ import annotations

from collections.abc import Callable

from narwhal.fleet.telemetry import Interval, Telemetry
from narwhal.obs.router_metrics import RouterMetrics

__all__ = ["TelemetryStage"]

_Series = dict[tuple[str, ...], float]


class TelemetryStage:
    """Registers the interval gauges once and refreshes their values every pass."""

    name = "telemetry"

    def __init__(self, *, telemetry: Telemetry, metrics: RouterMetrics,
                 model_of: Callable[[str], str] | None = None) -> None:
        self.telemetry = telemetry
        # Each engine's model, the gauges' last label (read per closed interval, not per request).
        self._model_of = model_of
        self.published: Interval | None = None
        self._requests: _Series = {}
        self._errors: _Series = {}
        self._ttft: _Series = {}
        self._inter_token: _Series = {}
        metrics.add_gauge("narwhal_engine_interval_requests",
                          "Requests charged to the engine in the latest closed telemetry interval.",
                          ("engine", "model"), lambda: self._requests)
        metrics.add_gauge("narwhal_engine_interval_errors",
                          "Errors charged to the engine in the latest closed telemetry interval.",
                          ("engine", "model"), lambda: self._errors)
        metrics.add_gauge("narwhal_engine_interval_time_to_first_token_seconds",
                          "Time to first token of the engine's requests (prefill engines), "
                          "latest closed interval.", ("engine", "quantile", "model"), lambda: self._ttft)
        metrics.add_gauge("narwhal_engine_interval_inter_token_seconds",
                          "Inter-token latency of the engine's streams (decode engines), "
                          "latest closed interval.", ("engine", "quantile", "model"), lambda: self._inter_token)

    async def run(self, pass_number: int) -> None:
        """Publish the latest closed interval if it is new."""
        self.run_now(pass_number)

    def run_now(self, pass_number: int) -> None:
        """The same, as a plain call (it never waits): the monitor's pass calls it in its own task."""
        self.publish()

    def publish(self) -> bool:
        """Swap in the gauges' values from the latest closed interval; False when nothing new."""
        interval = self.telemetry.latest()
        if interval is None or interval is self.published:
            return False
        requests: _Series = {}
        errors: _Series = {}
        ttft: _Series = {}
        inter_token: _Series = {}
        for name, figures in interval.engines.items():
            model = self._model(name)
            requests[(name, model)] = float(figures.requests)
            errors[(name, model)] = float(figures.errors)
            for quantile, value in (("0.5", figures.ttft_p50_s), ("0.9", figures.ttft_p90_s)):
                if value is not None:
                    ttft[(name, quantile, model)] = value
            for quantile, value in (("0.5", figures.inter_token_p50_s), ("0.9", figures.inter_token_p90_s)):
                if value is not None:
                    inter_token[(name, quantile, model)] = value
        self._requests, self._errors, self._ttft, self._inter_token = requests, errors, ttft, inter_token
        self.published = interval
        return True

    def _model(self, name: str) -> str:
        # An interval recorded before a reload removed the engine: its model is no longer known.
        if self._model_of is None:
            return ""
        try:
            return self._model_of(name)
        except KeyError:
            return ""
