"""Experiment config parsing: round trip and clear errors."""

from __future__ import annotations

import tomllib

import pytest
import tomli_w

from silodp.config import (
    ConfigError,
    default_config_path,
    load_config,
    parse_config,
    to_toml_dict,
)


def test_default_demo_config_parses_and_lists_record_and_subject_level_methods() -> None:
    cfg = load_config(default_config_path())
    assert cfg.algorithms == (
        "fedavg",
        "local_item_dp",
        "local_group_dp",
        "higradavg_dp",
        "uldp_sgd",
        "uldp_avg",
    )
    assert cfg.data.source == "digits"
    assert cfg.privacy.epsilon == 4.0 and cfg.privacy.delta == 1e-5


def test_round_trip_through_toml() -> None:
    raw = {
        "name": "x",
        "algorithms": ["local_item_dp", "higradavg_dp"],
        "data": {"source": "synthetic", "num_silos": 3, "max_records": 300},
        "training": {"rounds": 3, "batch_size": 16},
        "privacy": {"epsilon": 2.0, "span": 2},
        "algorithm": {"higradavg_dp": {"sampling": "subject", "lr": 0.3}},
    }
    cfg = parse_config(raw)
    again = parse_config(tomllib.loads(tomli_w.dumps(to_toml_dict(cfg))))
    assert again == cfg


def test_overrides_apply_per_algorithm() -> None:
    cfg = parse_config(
        {
            "algorithms": ["local_item_dp", "higradavg_dp"],
            "algorithm": {
                "higradavg_dp": {"sampling": "subject", "lr": 0.3, "noise_multiplier": 2.0}
            },
        }
    )
    _, privacy = cfg.for_algorithm("higradavg_dp")
    hyper = cfg.algorithm_config("higradavg_dp")
    assert hyper.lr == 0.3 and hyper.sampling == "subject"
    assert privacy.noise_multiplier == 2.0 and privacy.epsilon is None
    _, privacy = cfg.for_algorithm("local_item_dp")
    hyper = cfg.algorithm_config("local_item_dp")
    assert hyper.lr == 0.1 and not hasattr(hyper, "sampling")


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"algorithms": ["nope"]}, "'nope'"),
        ({"training": {"rounds": 0}}, "training.rounds=0"),
        ({"training": {"batchsize": 3}}, "batchsize"),
        ({"privacy": {"delta": 2.0}}, "privacy.delta=2.0"),
        ({"privacy": {"epsilon": -1.0}}, "privacy.epsilon=-1.0"),
        ({"model": {"name": "resnet"}}, "'resnet'"),
        ({"data": {"num_silos": 0}}, "num_silos"),
        ({"colour": "blue"}, "colour"),
        ({"algorithms": ["fedavg"], "algorithm": {"user_ldp": {"lr": 1.0}}}, "user_ldp"),
        ({"algorithm": {"fedavg": {"nesterov": True}}}, "nesterov"),
        ({"data": {"num_silos": 2}, "training": {"silos_per_round": 3}}, "silos_per_round=3"),
        ({"privacy": {"secure_noise": True}}, 'use noise = "secure"'),
        ({"privacy": {"noise": "urandom"}}, "privacy.noise='urandom'"),
        ({"privacy": {"adversary": "everyone"}}, "privacy.adversary='everyone'"),
        ({"privacy": {"subject_sampler": "nobody"}}, "privacy.subject_sampler='nobody'"),
    ],
)
def test_bad_config_names_the_value(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        parse_config(raw)


def test_missing_and_malformed_files(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "none.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = [unclosed")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


@pytest.mark.parametrize(
    "value", [10**400, -(10**400), 10**5000], ids=["1e400", "-1e400", "1e5000"]
)
def test_an_integer_beyond_float_range_is_a_clear_error(value: int) -> None:
    from silodp._validation import check_in_range, check_positive
    from silodp.errors import InvalidValueError

    for check in (
        lambda: check_positive("privacy.noise_multiplier", value),
        lambda: check_in_range("privacy.delta", value, 0.0, 1.0),
    ):
        with pytest.raises(InvalidValueError, match=r"privacy\.\w+ to be a number of at most"):
            check()


def test_a_given_sigma_leaves_no_default_target() -> None:
    """A file that sets only noise_multiplier has no ε target (the default 4 would read as
    one); ε and σ together are kept (the run warns), as is ε alone."""
    base = {"algorithms": ["local_item_dp"], "data": {"source": "digits"}}
    sigma = parse_config({**base, "privacy": {"noise_multiplier": 1.0}}).privacy
    assert sigma.epsilon is None and sigma.noise_multiplier == 1.0
    both = parse_config({**base, "privacy": {"noise_multiplier": 1.0, "epsilon": 2.0}}).privacy
    assert both.epsilon == 2.0
    assert parse_config(base).privacy.epsilon == 4.0


def test_messages_point_at_the_right_command_and_value() -> None:
    """A sweep file given to `silodp run` says so; a group_size that is neither a number nor a
    known name says that a number is allowed."""
    with pytest.raises(ConfigError, match="looks like a sweep file: run it with `silodp sweep`"):
        parse_config({"base": "b.toml", "grid": {"privacy.epsilon": [1.0]}})
    with pytest.raises(ConfigError, match="'three' to be an integer >= 1 or one of 'max'"):
        parse_config({"privacy": {"group_size": "three"}})
