"""``python -m narwhal bench``: router overhead and fault handling against a mock fleet.

Modules: ``cli`` (options), ``runner`` (one run from fleet start to report),
``fleet`` (mock engines and the router under test as processes), ``load`` (the
load generator), ``measure`` (CPU and memory from ``/proc`` around one load),
``scenario`` (the fault timeline), ``procstat`` (``/proc`` parsing), ``report``
(figures, table, JSON) and ``progress`` (the live line). docs/benchmarks.md
has the options, the definitions of the figures and the measured results.
"""
