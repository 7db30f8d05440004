"""The histogram's cell: a per-token path that observes inline renders exactly as ``observe`` would."""

from __future__ import annotations

from bisect import bisect_left

from narwhal.obs.metrics import Histogram, Registry

GAPS = [0.0, 0.0004, 0.001, 0.0105, 0.25, 3.0, 1e9]


def test_observing_through_the_cell_is_observe():
    observed, inline = Histogram("gaps", "x"), Histogram("gaps", "x")
    for gap in GAPS:
        observed.observe(gap)
    counts, total = inline.cell()
    for gap in GAPS:
        counts[bisect_left(inline.bounds, gap)] += 1
        total[0] += gap
    assert list(inline.render()) == list(observed.render())
    assert inline.count() == len(GAPS)
    # The cell is the series itself: observe and inline updates add up.
    inline.observe(0.5)
    assert inline.cell()[0] is counts and inline.count() == len(GAPS) + 1


def test_a_registry_renders_only_the_metrics_a_prefix_names() -> None:
    registry = Registry()
    registry.counter("narwhal_tenant_requests", "by tenant", ("tenant",)).inc("a")
    registry.counter("narwhal_requests", "all", ("route",)).inc("/v1/completions")
    registry.gauge("narwhal_tenant_keys", "keys", (), lambda: {(): 2.0})
    whole = registry.render()
    only = registry.render("narwhal_tenant_")
    assert "narwhal_requests_total" in whole and "narwhal_requests_total" not in only
    assert only.splitlines() == [line for line in whole.splitlines()
                                 if "narwhal_tenant_" in line]
    assert registry.render("nothing_") == ""
