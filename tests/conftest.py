"""Suite-wide hooks: the longest tests start first, so two xdist workers do not end on one of them alone."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A stable sort: every other test keeps its collection order.
    items.sort(key=lambda item: item.get_closest_marker("long") is None)
