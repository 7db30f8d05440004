"""A mock vLLM engine for tests and benchmarks: P/D handoffs, identity, fault injection.

Run it with ``python -m narwhal mock-engine`` (or ``python -m narwhal.tools.mock``);
see ``narwhal.tools.mock.engine`` for the API it serves and ``narwhal.tools.mock.faults``
for the fault modes.
"""
