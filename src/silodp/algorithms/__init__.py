"""Federated algorithms by name (SPEC §2)."""

from __future__ import annotations

from silodp._validation import check_choice
from silodp.algorithms.base import Algorithm, AlgorithmConfig, SiloData, SiloUpdate
from silodp.algorithms.dp_sgd import LocalGroupDP, LocalItemDP
from silodp.algorithms.fedavg import FedAvg
from silodp.algorithms.higradavg import HiGradAvgDP
from silodp.algorithms.prifedsync import PriFedSync
from silodp.algorithms.uldp import UldpAvg, UldpAvgW, UldpGroup, UldpNaive, UldpSgd
from silodp.algorithms.user_ldp import UserLDP
from silodp.data import FederatedDataset
from silodp.privacy.randomness import Coins

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "AlgorithmConfig",
    "SiloData",
    "SiloUpdate",
    "make_algorithm",
]

ALGORITHMS: dict[str, type[Algorithm]] = {
    cls.name: cls
    for cls in (
        FedAvg,
        LocalItemDP,
        LocalGroupDP,
        HiGradAvgDP,
        UserLDP,
        UldpNaive,
        UldpGroup,
        UldpAvg,
        UldpSgd,
        UldpAvgW,
        PriFedSync,
    )
}


def make_algorithm(
    name: str,
    config: AlgorithmConfig,
    train: FederatedDataset | None = None,
    *,
    coins: Coins | None = None,
) -> Algorithm:
    """The algorithm registered as ``name`` with ``config`` (set up for ``train`` if given,
    with ``coins`` as the set-up's randomness)."""
    check_choice("algorithm", name, ALGORITHMS)
    cls = ALGORITHMS[name]
    return cls(config) if train is None else cls.for_data(config, train, coins=coins)
