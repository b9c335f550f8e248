"""In-process federated simulation."""

from silodp.federated.simulator import RoundResult, SimulationCallback, Simulator

__all__ = ["RoundResult", "SimulationCallback", "Simulator"]
