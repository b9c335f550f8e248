"""Property tests of the config schema: every bad value is a ConfigError naming its key.

Each numeric option of ``[data]``, ``[training]`` and ``[privacy]`` (the algorithms' own keys
too) is set to values a user can write by mistake: zero, negative, huge, NaN, ±inf, text,
booleans, lists, tables. The config either parses (the value is valid) or raises a
:class:`~silodp.errors.ConfigError` whose message names the key; a ``[data]`` value that parses
is then built on a small synthetic dataset, which either works or raises a
:class:`~silodp.errors.SilodpError` — never an error from inside numpy.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import tomli_w
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from silodp.config import ConfigError, load_config, parse_config
from silodp.data.build import build_federated_data
from silodp.errors import SilodpError

SETTINGS = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)

#: (section, key, where 0 is a valid value)
NUMERIC = [
    ("data", "test_fraction", False),
    ("data", "num_silos", False),
    ("data", "num_subjects", False),
    ("data", "alpha", False),
    ("data", "zipf_alpha1", False),
    ("data", "zipf_alpha2", False),
    ("data", "dirichlet_beta", False),
    ("data", "shards_per_client", False),
    ("data", "labels_per_subject", False),
    ("data", "first_subjects", False),
    ("data", "max_records", False),
    ("data", "records_per_subject_per_silo", False),
    ("data", "records_per_subject", False),
    ("data", "scaling_budget", False),
    ("data", "num_features", False),
    ("data", "num_classes", False),
    ("data", "seed", True),
    ("training", "rounds", False),
    ("training", "silos_per_round", False),
    ("training", "seed", True),
    ("training", "eval_every", False),
    ("training", "local_steps", False),
    ("training", "batch_size", False),
    ("training", "lr", False),
    ("training", "server_lr", False),
    ("training", "local_epochs", False),
    ("privacy", "epsilon", False),
    ("privacy", "delta", False),
    ("privacy", "noise_multiplier", True),
    ("privacy", "span", False),
    ("privacy", "group_size", False),
    ("privacy", "clip", False),
    ("privacy", "subject_rate", False),
    ("privacy", "subject_records", False),
    ("privacy", "n_max", False),
    ("privacy", "key_bits", False),
]

#: the algorithms whose Config reads each algorithm key above (every other key is shared)
READERS = {
    "local_epochs": ["uldp_avg"],
    "subject_rate": ["uldp_avg"],
    "subject_records": ["higradavg_dp"],
    "n_max": ["uldp_avg_w"],
    "key_bits": ["uldp_avg_w"],
}

ALWAYS_BAD = [math.nan, math.inf, -math.inf, -1, -1e-300, "1", True, False, [], [1], {"a": 1}]
VALUES = st.one_of(
    st.sampled_from([*ALWAYS_BAD, 0, 0.0, 2**63 - 1, 10**400, 1e308, 5e-324, 0.5, 1, 3]),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
)


def _base(key: str) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "algorithms": READERS.get(key, ["local_item_dp"]),
        "data": {"source": "synthetic", "max_records": 200, "num_silos": 3, "num_subjects": 20},
        "training": {"rounds": 2},
        "privacy": {"noise": "seeded"},
    }
    return raw


def _always_bad(value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return True
    return math.isnan(value) or math.isinf(value) or value < 0


@pytest.mark.parametrize("option", NUMERIC, ids=[f"{s}.{k}" for s, k, _ in NUMERIC])
@settings(SETTINGS, max_examples=25)
@given(value=VALUES)
def test_a_numeric_option_is_valid_or_a_config_error_naming_it(
    option: tuple[str, str, bool], value: Any
) -> None:
    section, key, zero_ok = option
    raw = _base(key)
    raw[section][key] = value
    try:
        config = parse_config(raw)
    except ConfigError as err:
        assert key in str(err), (key, value, str(err))
        return
    assert not _always_bad(value), f"{section}.{key}={value!r} was accepted"
    assert zero_ok or value != 0, f"{section}.{key}={value!r} was accepted"
    if section == "data":
        try:
            data = build_federated_data(config.data)
        except SilodpError as err:
            assert str(err)
        else:
            assert len(data.train) >= 1


@SETTINGS
@given(
    section=st.sampled_from(["data", "training", "privacy", "model", "sweep"]),
    key=st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12),
)
def test_an_unknown_key_is_named(section: str, key: str) -> None:
    raw: dict[str, Any] = {"algorithms": ["prifedsync"], "sweep": {"target_accuracy": 0.5}}
    raw.setdefault(section, {})[key] = 1
    try:
        parse_config(raw)
    except ConfigError as err:
        assert key in str(err)
    else:  # the key was a real one and 1 a valid value for it
        assert key in {f for f in _known(section)}, (section, key)


def _known(section: str) -> set[str]:
    import dataclasses

    from silodp.algorithms import hyperparameter_tables
    from silodp.config import RUN_KEYS, ModelConfig, SweepConfig
    from silodp.data.config import DataConfig

    by_class = {"data": DataConfig, "model": ModelConfig, "sweep": SweepConfig}
    if section in by_class:
        return {f.name for f in dataclasses.fields(by_class[section])}
    return RUN_KEYS[section] | {k for k, t in hyperparameter_tables().items() if t == section}


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"name": 5}, "name"),
        ({"name": ""}, "name"),
        ({"algorithms": []}, "algorithm"),
        ({"algorithms": [1]}, "algorithms"),
        ({"algorithms": "fedavg", "algorithm": {"fedavg": 3}}, "algorithm.fedavg"),
        ({"algorithm": 3}, "algorithm"),
        ({"data": 3}, "[data]"),
        ({"data": {"feature_columns": []}, "privacy": {"epsilon": []}}, "privacy.epsilon"),
        ({"data": {"source": "table", "path": 5}}, "path"),
        ({"data": {"source": "table", "path": ""}}, "path"),
        ({"data": {"source": "table", "path": "t.csv", "feature_columns": ["a", "a"]}}, "'a'"),
        ({"data": {"source": "table", "path": "t.csv", "feature_columns": "a"}}, "feature_"),
        ({"privacy": {"budget": {}}}, "privacy.budget"),
        ({"privacy": {"budget": {"subject": math.inf}}}, "privacy.budget.subject"),
        ({"privacy": {"ledger": 5}}, "privacy.ledger"),
        ({"privacy": {"noise_multiplier": math.inf}}, "privacy.noise_multiplier"),
        ({"training": {"rounds": 10**7}}, "training.rounds"),
        (
            {"algorithms": ["prifedsync"], "sweep": {"target_accuracy": 0.5, "client_rate": 0.5}},
            "sweep.client_rate",
        ),
        ({"algorithms": ["prifedsync"], "sweep": {}}, "target_accuracy"),
    ],
)
def test_wrong_types_empty_lists_and_tables_are_named(raw: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(raw)
    assert key in str(err.value)


def test_a_data_path_that_does_not_exist_is_refused_when_the_config_is_loaded(
    tmp_path: Path,
) -> None:
    for key in ("path", "test_path"):
        data = {"source": "table", "path": str(tmp_path / "t.csv"), "subject_column": "p"}
        (tmp_path / "t.csv").write_text("a,label,p\n1,0,x\n2,1,y\n")
        data[key] = str(tmp_path / "missing.csv")
        if key == "test_path":
            data.pop("subject_column")
        cfg = tmp_path / f"{key}.toml"
        cfg.write_text(tomli_w.dumps({"data": data}))
        with pytest.raises(ConfigError, match=rf"data\.{key}='.*missing\.csv'.*does not exist"):
            load_config(cfg)


@SETTINGS
@given(text=st.text(max_size=60))
def test_garbled_toml_is_a_config_error(tmp_path: Path, text: str) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(text, encoding="utf-8")
    try:
        load_config(cfg)  # any other exception fails the test
    except ConfigError as err:
        assert str(err)


@pytest.mark.parametrize(
    ("section", "key", "largest"),
    [
        ("training", "local_steps", 10**6),
        ("training", "local_epochs", 10**6),
        ("training", "batch_size", 10**9),
        ("privacy", "key_bits", 8192),
    ],
)
def test_counts_above_their_limit_are_refused_naming_the_limit(
    section: str, key: str, largest: int
) -> None:
    raw = _base(key)
    raw[section][key] = largest
    parse_config(raw)  # the limit itself is accepted
    raw[section][key] = largest + 2
    with pytest.raises(ConfigError, match=rf"{key}={largest + 2}\b.*{largest}"):
        parse_config(raw)
