"""Test-session hooks shared by every test directory."""

from __future__ import annotations

import pytest

#: files that run for many minutes on one worker: scheduled first so the others overlap them
LONGEST_FIRST = ("tests/engines/test_flower_deployment.py",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return 0 if path in LONGEST_FIRST else 1

    items.sort(key=rank)  # stable: the order within each group is kept
