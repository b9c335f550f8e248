"""Federated algorithms as plug-ins (SPEC §2).

Each algorithm is one module of this package that defines an :class:`Algorithm` subclass with
its own ``Config`` dataclass and registers it (:func:`register`); importing this package
imports every such module, so a new algorithm is a new file here and nothing else. The
experiment, the command line and the accounting reach an algorithm only through
:data:`ALGORITHMS` and the methods of :class:`Algorithm`.
"""

from __future__ import annotations

import importlib
import pkgutil

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

#: modules of this package that hold no algorithm (the rest are imported to register theirs)
SUPPORT_MODULES = frozenset({"base", "planning", "registry"})

for _module in pkgutil.iter_modules(__path__):
    if _module.name not in SUPPORT_MODULES:
        importlib.import_module(f"{__name__}.{_module.name}")
