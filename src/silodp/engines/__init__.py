"""Engines that run an experiment's rounds where the silos are.

``inprocess`` is the simulator (:mod:`silodp.federated.simulator`); the others run the silos
apart and exchange messages (:mod:`silodp.engines.remote`): ``flower-sim`` on Flower's
simulation engine, ``flower-deploy`` on a Flower deployment (:mod:`silodp.engines.flower`,
the only package that imports ``flwr``).
"""

ENGINES = ("inprocess", "flower-sim", "flower-deploy")

__all__ = ["ENGINES"]
