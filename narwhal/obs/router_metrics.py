"""Every Prometheus metric the router exports, in one place."""

from __future__ import annotations

from collections.abc import Callable

from narwhal.obs.metrics import Registry

__all__ = ["HANDOFF_WRITE_BUCKETS_S", "HEALTH_TO_ELIGIBLE_BUCKETS_S", "JOIN_GAP_BUCKETS_S", "MATCH_BUCKETS",
           "SNAPSHOT_LAG_BUCKETS_S", "RouterMetrics"]

JOIN_GAP_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
SNAPSHOT_LAG_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0)
# Readmission after a restart: the target is well under a second; the tail is the backoff's (<= probe_interval_s).
HEALTH_TO_ELIGIBLE_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# One handoff write (write, fsync, rename, directory fsync): well under a millisecond on tmpfs, tens on a disk.
HANDOFF_WRITE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# Matched share of a prompt: 0 (a miss) and 1 (whole prompt held) get buckets of their own.
MATCH_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)

_GaugeReader = Callable[[], dict[tuple[str, ...], float]]


def _empty() -> dict[tuple[str, ...], float]:
    return {}


class RouterMetrics:
    """Counters and histograms written by the request path and the control plane.

    Request and engine series carry ``model`` as their last label: a request's served model (its own name,
    never an alias; "" when refused before its model was known), an engine's configured model.
    """

    def __init__(self) -> None:
        r = self.registry = Registry()
        self.requests = r.counter("narwhal_requests", "Finished client requests by route, status and model.",
                                  ("route", "status", "model"))
        self.request_duration = r.histogram("narwhal_request_duration_seconds",
                                            "Client request duration.", ("route", "model"))
        self.ttft = r.histogram("narwhal_time_to_first_token_seconds",
                                "Time from request arrival to the first decode bytes.", ("route", "model"))
        self.inter_token = r.histogram("narwhal_inter_token_seconds",
                                       "Gap between successive decode reads relayed to a client.", ("model",))
        self.engine_failures = r.counter("narwhal_engine_failures",
                                         "Engine failures by engine and failure class.", ("engine", "class", "model"))
        self.engine_ejections = r.counter("narwhal_engine_ejections",
                                          "Engine ejections by cause (a failure class, liveness, probe or other).",
                                          ("engine", "cause", "model"))
        self.holds_applied = r.counter("narwhal_engine_holds_applied", "Holds applied by kind.",
                                       ("engine", "kind", "model"))
        self.probes = r.counter("narwhal_probes", "Suspect verification probes by kind and outcome.",
                                ("engine", "kind", "outcome", "model"))
        self.stage_errors = r.counter("narwhal_monitor_stage_errors",
                                      "Monitor stage errors by stage and exception class (router-wide: no model).",
                                      ("stage", "class"))
        self.readmissions = r.counter("narwhal_readmission_attempts",
                                      "Readmission attempts by outcome and failed check.",
                                      ("engine", "outcome", "check", "model"))
        self.health_to_eligible = r.histogram(
            "narwhal_readmission_health_to_eligible_seconds",
            "Automatic readmissions: from the engine's first health success since its ejection to its "
            "return to placement.", ("engine", "model"), HEALTH_TO_ELIGIBLE_BUCKETS_S)
        self.lease_renewals = r.counter("narwhal_lease_renewals",
                                        "Lease renewals by result (ok, failed, lost, late).", ("result",))
        self.snapshot_lag = r.histogram("narwhal_worker_snapshot_lag_seconds",
                                        "Delay from the controller publishing a fleet snapshot to a worker "
                                        "applying it (serving.workers > 1).", (), SNAPSHOT_LAG_BUCKETS_S)
        self.placements = r.counter("narwhal_placement", "Engine choices by role and reason (hit, miss, spill, "
                                    "only_choice, least_outstanding).", ("role", "reason", "model"))
        self.placement_match = r.histogram("narwhal_placement_matched_fraction",
                                           "Share of a prompt's blocks the chosen prefill engine held.", ("model",),
                                           MATCH_BUCKETS)
        self.continuations = r.counter("narwhal_continuations",
                                        "Stream continuations by outcome: completed, failed (continued again "
                                        "or ended), exhausted (no attempts or deadline left), not_eligible, "
                                        "context_full (the answer filled the context: ended as length).",
                                        ("outcome", "model"))
        self.join_gap = r.histogram("narwhal_continuation_join_gap_seconds",
                                    "Time a client waited at a continuation join: from the last bytes of the "
                                    "failed leg to the first bytes of the next.", ("model",), JOIN_GAP_BUCKETS_S)
        self.saturations = r.counter("narwhal_saturations", "Requests refused for saturation by reason.",
                                     ("reason", "model"))
        # Client keys ([auth] keys_file): a tenant is a key's name, a bounded set the operator wrote.
        self.tenant_requests = r.counter("narwhal_tenant_requests", "Finished client requests by tenant and status.",
                                         ("tenant", "status"))
        self.tenant_tokens = r.counter("narwhal_tenant_tokens", "Tokens by tenant and kind (prompt, completion).",
                                       ("tenant", "kind"))
        self.tenant_queue_wait = r.histogram("narwhal_tenant_queue_wait_seconds",
                                             "Time an admitted request waited for capacity, by tenant.", ("tenant",))
        self.tenant_refusals = r.counter("narwhal_tenant_refusals", "Requests refused by client auth, by tenant "
                                         "(unknown for a missing or invalid key) and reason.", ("tenant", "reason"))
        # Traces ([tracing] otlp_endpoint): spans the exporter could not queue or send (never retried).
        self.trace_spans_dropped = r.counter("narwhal_trace_spans_dropped",
                                             "Trace spans dropped: queue_full (the export queue was full) or "
                                             "export_failed (the collector failed, refused or timed out).",
                                             ("reason",))
        self.handoff_write = r.histogram("narwhal_handoff_write_seconds",
                                         "Time one handoff file took to write, fsync and rename into place.", (),
                                         HANDOFF_WRITE_BUCKETS_S)
        self.handoff_bytes = 0
        r.gauge("narwhal_handoff_bytes", "Size of the last handoff file written.", (),
                lambda: {(): float(self.handoff_bytes)} if self.handoff_bytes else {})

    def handoff_written(self, size: int, seconds: float) -> None:
        """A handoff file replaced the last: its size and write time."""
        self.handoff_bytes = size
        self.handoff_write.observe(seconds)

    def add_gauge(self, name: str, help_text: str, labels: tuple[str, ...], read: _GaugeReader) -> None:
        """Register a gauge read from live state at scrape time."""
        self.registry.gauge(name, help_text, labels, read)

    def render(self, prefix: str = "") -> str:
        """``/metrics``, or only the metrics whose name starts with ``prefix`` (``/admin/tenants`` reads its own)."""
        return self.registry.render(prefix)
