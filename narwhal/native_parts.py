"""Which of the optional C modules run in this process (``router_started``'s ``native`` field)."""

from __future__ import annotations

from narwhal.http1 import pump, readiness
from narwhal.tracing import otlp, spans

__all__ = ["native_parts"]


def native_parts() -> list[str]:
    """The compiled parts that run, by name; the others run their Python twins (no compiler at install time,
    or ``NARWHAL_NO_EXTENSIONS`` set)."""
    # hub_round came last (2026-12-07): names are only ever added, at the end.
    parts = (("relay", pump.RELAY_NATIVE), ("otlp_encoder", otlp.NATIVE), ("request_trace", spans.NATIVE),
             ("hub_round", readiness.ROUNDS_NATIVE))
    return [name for name, runs in parts if runs]
