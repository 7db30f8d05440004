"""Operator and developer tools: the mock engine, the benchmark, the local fleet, the demo, the admin CLI."""
