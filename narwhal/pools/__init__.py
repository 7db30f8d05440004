"""Engine connection pools: the data pool (prefill, decode, token counting) and
the control pool (health, verification, readmission), each with its own bound.

``classify`` is the one place where their errors become failure classes.
"""

from narwhal.pools.control import ControlCalls, ControlPool, ControlPoolStatistics, ControlResponse
from narwhal.pools.data import DataPool, DataPoolStatistics, UpstreamStream

__all__ = [
    "ControlCalls",
    "ControlPool",
    "ControlPoolStatistics",
    "ControlResponse",
    "DataPool",
    "DataPoolStatistics",
    "UpstreamStream",
]
