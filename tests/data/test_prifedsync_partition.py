"""PriFedSync's data splits: fixed-size Dirichlet clients and per-client test sets."""

from __future__ import annotations

import numpy as np
import pytest

from silodp.data import partition as part
from silodp.data.build import DataConfig, build_federated_data
from silodp.data.describe import describe, format_description


def _labels(n: int = 3000, classes: int = 10) -> np.ndarray:
    return np.random.default_rng(5).integers(0, classes, size=n)


def test_dirichlet_clients_have_exact_sizes_and_disjoint_records() -> None:
    y = _labels()
    index, client = part.dirichlet_clients(
        y, num_clients=20, beta=0.5, records_per_client=100, rng=np.random.default_rng(0)
    )
    assert np.bincount(client).tolist() == [100] * 20
    assert len(np.unique(index)) == len(index)  # no record in two clients


def test_dirichlet_clients_beta_controls_skew() -> None:
    y = _labels()

    def top_share(beta: float) -> float:
        index, client = part.dirichlet_clients(
            y, num_clients=10, beta=beta, records_per_client=100, rng=np.random.default_rng(1)
        )
        shares = [np.bincount(y[index][client == i]).max() / 100 for i in range(10)]
        return float(np.mean(shares))

    assert top_share(0.05) > 0.6 > 0.25 > top_share(100.0)


def test_dirichlet_clients_survive_exhausted_labels() -> None:
    y = np.repeat(np.arange(3), [10, 10, 280])
    index, client = part.dirichlet_clients(
        y, num_clients=3, beta=0.1, records_per_client=100, rng=np.random.default_rng(2)
    )
    assert np.bincount(client).tolist() == [100, 100, 100]
    assert len(np.unique(index)) == 300


def test_dirichlet_clients_refuse_more_records_than_exist() -> None:
    with pytest.raises(ValueError, match="records_per_client"):
        part.dirichlet_clients(
            _labels(100),
            num_clients=3,
            beta=1.0,
            records_per_client=50,
            rng=np.random.default_rng(),
        )


def test_per_client_test_uses_only_labels_the_client_holds() -> None:
    y = _labels()
    client = part.shards(y, num_clients=20, shards_per_client=2, rng=np.random.default_rng(0))
    test_y = _labels(1000)
    index, owner = part.per_client_test(
        y, client, test_y, num_clients=20, records_per_client=50, rng=np.random.default_rng(0)
    )
    assert np.bincount(owner).tolist() == [50] * 20
    for i in range(20):
        assert set(test_y[index[owner == i]]) <= set(y[client == i])
        if len(np.unique(index[owner == i])) < 50:  # only when a label pool is too small
            counts = np.bincount(test_y[index[owner == i]], minlength=10)
            assert (counts > np.bincount(test_y, minlength=10)).any()


def test_build_sets_per_client_test_splits() -> None:
    data = build_federated_data(
        DataConfig(source="digits", num_silos=5, allocation="shards", test_per_client=20)
    )
    assert data.test.silo is not None
    assert np.bincount(data.test.silo).tolist() == [20] * 5
    for s in range(5):
        seen = set(data.train.y[data.train.silo == s])
        assert set(data.test.y[data.test.silo_indices(s)]) <= seen


def test_repeated_per_client_test_records_are_counted_and_warned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # 10 shard clients x 100 test records from digits' ~360 test records: a client holding
    # two labels draws ~50 of each from pools of ~36, so its test set repeats records
    with caplog.at_level("WARNING", logger="silodp.data.build"):
        data = build_federated_data(
            DataConfig(source="digits", num_silos=10, allocation="shards", test_per_client=100)
        )
    split = describe(data)["split"]
    assert split["test_records"] == 1000 == len(data.test)
    assert data.test.silo is not None
    # independently: the distinct test feature rows, and the repeats inside each client
    rows = {tuple(x) for x in data.test.x.reshape(len(data.test), -1).tolist()}
    assert split["distinct_test_records"] == len(rows) < 1000
    within = sum(
        int(data.test.silo_indices(c).size)
        - len({tuple(x) for x in data.test.x[data.test.silo_indices(c)].reshape(-1, 64).tolist()})
        for c in range(10)
    )
    assert split["repeated_test_records"] == within > 0
    assert any("repeat a record already in the same client" in m for m in caplog.messages)
    assert "repeated in a client" in format_description(describe(data))
    # draws within the pools repeat nothing, and say so
    caplog.clear()
    with caplog.at_level("WARNING", logger="silodp.data.build"):
        small = build_federated_data(
            DataConfig(source="digits", num_silos=5, allocation="shards", test_per_client=20)
        )
    assert describe(small)["split"]["repeated_test_records"] == 0
    assert not any("repeat a record" in m for m in caplog.messages)


def test_build_dirichlet_clients() -> None:
    data = build_federated_data(
        DataConfig(
            source="digits",
            num_silos=6,
            allocation="dirichlet",
            dirichlet_beta=0.5,
            train_per_client=100,
            test_per_client=30,
        )
    )
    assert data.train.silo_sizes().tolist() == [100] * 6
    assert len(data.test) == 180


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"allocation": "uniform", "train_per_client": 10}, "train_per_client"),
        ({"allocation": "power", "test_per_client": 10}, "test_per_client"),
        ({"allocation": "shards", "test_per_client": 0}, "test_per_client=0"),
    ],
)
def test_bad_prifedsync_data_options(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DataConfig(source="digits", **kwargs)
