"""Empirical privacy audits: canaries in the training data, an attack on the released model,
and a lower bound on ε to set beside the claimed one (``silodp audit``).

Layers, imported downward only: :mod:`~silodp.audit.bounds` (the statistics, numpy/scipy),
:mod:`~silodp.audit.canaries` (the canaries and the data they are added to),
:mod:`~silodp.audit.attack` (scores from the models), :mod:`~silodp.audit.plot` (the figure)
and :mod:`~silodp.audit.run` (training with canaries through the experiment's own code).
"""

from silodp.audit.bounds import (
    best_one_run_epsilon,
    clopper_pearson_epsilon,
    one_run_epsilon,
    one_run_p_value,
)

__all__ = [
    "best_one_run_epsilon",
    "clopper_pearson_epsilon",
    "one_run_epsilon",
    "one_run_p_value",
]
