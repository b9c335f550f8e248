"""Federated algorithms by name (SPEC §2)."""

from __future__ import annotations

from silodp._validation import check_choice
from silodp.algorithms.base import Algorithm, AlgorithmConfig, SiloData, SiloUpdate
from silodp.algorithms.dp_sgd import LocalGroupDP, LocalItemDP
from silodp.algorithms.fedavg import FedAvg
from silodp.algorithms.higradavg import HiGradAvgDP
from silodp.algorithms.user_ldp import UserLDP

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "AlgorithmConfig",
    "SiloData",
    "SiloUpdate",
    "make_algorithm",
]

ALGORITHMS: dict[str, type[Algorithm]] = {
    cls.name: cls for cls in (FedAvg, LocalItemDP, LocalGroupDP, HiGradAvgDP, UserLDP)
}


def make_algorithm(name: str, config: AlgorithmConfig) -> Algorithm:
    """The algorithm registered as ``name`` with ``config``."""
    check_choice("algorithm", name, ALGORITHMS)
    return ALGORITHMS[name](config)
