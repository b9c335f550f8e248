"""Algorithms by name: a class registers itself with :func:`register`, and the experiment, the
command line and the accounting find it here. Adding an algorithm is adding one module that
defines and registers it (and importing that module in :mod:`silodp.algorithms`, or in a test).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from silodp._validation import check_choice
from silodp.algorithms.base import Algorithm, AlgorithmConfig
from silodp.data import FederatedDataset
from silodp.errors import InvalidValueError
from silodp.privacy.randomness import Coins

__all__ = [
    "ALGORITHMS",
    "algorithm_class",
    "hyperparameter_tables",
    "make_algorithm",
    "register",
]

#: Every registered algorithm class by name.
ALGORITHMS: dict[str, type[Algorithm]] = {}

A = TypeVar("A", bound=type[Algorithm])


def register(cls: A) -> A:
    """Class decorator: makes ``cls`` available under ``cls.name``.

    Raises:
      InvalidValueError: another class is registered under that name.
    """
    existing = ALGORITHMS.get(cls.name)
    if existing is not None and existing is not cls:
        raise InvalidValueError(
            f"Expected a new algorithm name, got {cls.name!r} (already {existing.__name__})."
        )
    ALGORITHMS[cls.name] = cls
    return cls


def algorithm_class(name: str) -> type[Algorithm]:
    """The class registered as ``name``.

    Raises:
      InvalidValueError: no algorithm has that name (the message lists those that do).
    """
    check_choice("algorithm", name, ALGORITHMS)
    return ALGORITHMS[name]


def hyperparameter_tables() -> dict[str, str]:
    """``{key: table}`` of every hyperparameter some registered algorithm reads from a config
    file's ``[training]`` or ``[privacy]`` table."""
    out: dict[str, str] = {}
    for cls in ALGORITHMS.values():
        out.update(cls.Config.tables())
    return out


def make_algorithm(
    name: str,
    settings: Mapping[str, Any] | AlgorithmConfig | None = None,
    train: FederatedDataset | None = None,
    *,
    coins: Coins | None = None,
) -> Algorithm:
    """The algorithm registered as ``name``, configured by ``settings``: its own ``Config``, or
    a mapping from which it takes the keys it declares (keys no registered algorithm declares
    are errors). Set up for ``train`` if given, with ``coins`` as the set-up's randomness.

    Raises:
      InvalidValueError: unknown name, unknown key or a value out of range.
    """
    cls = algorithm_class(name)
    if isinstance(settings, AlgorithmConfig):
        config = settings
    else:
        values = dict(settings or {})
        known = {name for c in ALGORITHMS.values() for name in c.Config.__dataclass_fields__}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidValueError(
                f"Unknown hyperparameter(s) {unknown}; expected some of {sorted(known)}."
            )
        config = cls.Config.from_settings(values)
    return cls(config) if train is None else cls.for_data(config, train, coins=coins)
