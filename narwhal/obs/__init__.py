"""Observability: JSON-line logs and Prometheus metrics."""
