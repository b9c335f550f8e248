"""Engines that run an algorithm's rounds: the seam (:mod:`silodp.federated.engine`) and the
in-process simulator."""

from silodp.federated.engine import Engine, RoundCallback, RoundResult, StopRule
from silodp.federated.simulator import SimulationCallback, Simulator

__all__ = ["Engine", "RoundCallback", "RoundResult", "SimulationCallback", "Simulator", "StopRule"]
