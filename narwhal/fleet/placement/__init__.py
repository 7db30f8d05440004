"""Placement, pure: which eligible engine takes a request, and what each engine has in flight.

``policy`` (cache-aware prefill, least outstanding decode: ``least_outstanding``, the one
selection by load), ``prefix_key`` (a prompt as chained block hashes), ``prefix_index`` (what
each engine recently prefilled), ``shared_index`` (worker processes' indexes kept in step),
``in_flight`` (the counts). The request path's adapter is ``narwhal.serving.placement``.
"""

from narwhal.fleet.placement.in_flight import InFlight, InFlightCounts
from narwhal.fleet.placement.policy import Choice, Placer, Reason, Scores, least_outstanding
from narwhal.fleet.placement.prefix_index import PrefixIndex
from narwhal.fleet.placement.prefix_key import prompt_blocks
from narwhal.fleet.placement.shared_index import IndexRecord, SharedIndex

__all__ = ["Choice", "InFlight", "InFlightCounts", "IndexRecord", "Placer", "PrefixIndex", "Reason", "Scores",
           "SharedIndex", "least_outstanding", "prompt_blocks"]
