"""The engines' own KV cache events (vLLM's ``--kv-events-config``): the wire, the feeds, and the block index."""
