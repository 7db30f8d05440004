"""The garbage collector's settings for a router process: set once, after startup, before serving."""

from __future__ import annotations

import gc

# Python's default (700) is crossed by the objects of the requests in flight alone: at 64 streams the router ran
# about 45 young collections a second of load, most of them finding nothing, about 8% of its CPU per request.
# At 10,000 the young generation fills from what outlives requests (pools, windows, tables), a few times a
# minute; a collection then walks up to 10,000 young objects, a pause of about 3 ms (docs/architecture.md).
GEN0_THRESHOLD = 10_000


def tune_for_serving() -> None:
    """Move what startup made out of the collector's sight, and collect the young generation less often."""
    # Imports, config and tables made before this are never garbage: frozen, a full collection skips them
    # (about 60,000 objects, 40 ms a full collection before).
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
