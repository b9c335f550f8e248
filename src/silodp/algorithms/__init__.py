"""Federated algorithms as plug-ins (SPEC §2).

Each algorithm is one module that defines an :class:`Algorithm` subclass with its own
``Config`` dataclass and registers it (:func:`register`); importing this package registers
the built-in ones. The experiment, the command line and the accounting reach an algorithm only
through :data:`ALGORITHMS` and the methods of :class:`Algorithm`.
"""

from __future__ import annotations

from silodp.algorithms import (  # noqa: F401  (each module registers its algorithms)
    dp_sgd,
    fedavg,
    higradavg,
    prifedsync,
    uldp_avg,
    uldp_naive,
    uldp_protocol,
    user_ldp,
)
from silodp.algorithms.base import Algorithm, AlgorithmConfig, SiloData, SiloUpdate
from silodp.algorithms.registry import (
    ALGORITHMS,
    algorithm_class,
    hyperparameter_tables,
    make_algorithm,
    register,
)

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "AlgorithmConfig",
    "SiloData",
    "SiloUpdate",
    "algorithm_class",
    "hyperparameter_tables",
    "make_algorithm",
    "register",
]
