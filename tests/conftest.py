"""Test-session hooks shared by every test directory."""

from __future__ import annotations

import os

import pytest

# before any test module imports flwr (which reads it once): no telemetry from the tests
os.environ["FLWR_TELEMETRY_ENABLED"] = "0"

#: files that run for many minutes on one worker: scheduled first so the others overlap them
#: (the Makefile passes --no-loadscope-reorder: xdist >= 3.8 would otherwise hand files out by
#: their number of tests, and this file, with few long tests, would start last)
LONGEST_FIRST = ("tests/engines/test_flower_deployment.py",)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.nodeid.split("::", 1)[0]
        return 0 if path in LONGEST_FIRST else 1

    items.sort(key=rank)  # stable: the order within each group is kept


@pytest.fixture
def dp_scaled_table(tmp_path):
    """A ``[data]`` table of a 300-record CSV (3 sites, 60 people, 2 features in [-3, 3])
    with ``scaling = "dp"``: its statistics are a release before round 1."""
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(0)
    n = 300
    frame = pd.DataFrame(
        {
            "a": rng.normal(size=n),
            "b": rng.normal(size=n),
            "label": rng.integers(0, 2, size=n),
            "site": rng.integers(0, 3, size=n),
            "person": rng.integers(0, 60, size=n),
        }
    )
    frame.to_csv(tmp_path / "t.csv", index=False)
    return {
        "source": "table",
        "path": str(tmp_path / "t.csv"),
        "feature_columns": ["a", "b"],
        "label_values": [0, 1],
        "silo_column": "site",
        "subject_column": "person",
        "allocation": "column",
        "scaling": "dp",
        "feature_bounds": [[-3.0, 3.0], [-3.0, 3.0]],
    }


@pytest.fixture
def interrupt_call(monkeypatch: pytest.MonkeyPatch):
    """``interrupt_call(module, name, n)``: from now on ``module.name`` raises
    KeyboardInterrupt on its ``n``-th call (a stop as the n-th cell or run starts); the earlier
    calls run. Returns the original, to put it back."""

    def patch(module: object, name: str, n: int):
        real = getattr(module, name)
        calls: list[int] = []

        def stopped(*args, **kwargs):
            calls.append(1)
            if len(calls) == n:
                raise KeyboardInterrupt
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, stopped)
        return real

    return patch
