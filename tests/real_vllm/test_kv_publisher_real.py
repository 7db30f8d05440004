"""vLLM's own KV event publisher (its ZMQ publisher and replay socket, run by the tier's vLLM) feeding our feeds.

The test lives beside the feed's other tests (tests/test_kv_feed.py); it runs here, in the real-vLLM tier.
"""

from tests.test_kv_feed import test_vllms_own_publisher

__all__ = ["test_vllms_own_publisher"]
