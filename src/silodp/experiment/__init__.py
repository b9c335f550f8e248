"""The experiment layer: from a config to results on disk.

``prepare`` (data bounds, plan, σ) → an engine runs the rounds → ``record`` writes what each
round released and spent; ``sweep`` runs a grid of PriFedSync cells. See
``docs/architecture.md``.
"""

from silodp.errors import OutputExistsError
from silodp.experiment.prepare import PreparedRun, dp_scaling, prepare_run
from silodp.experiment.run import ProgressFactory, resume_experiment, run_experiment, train_run

__all__ = [
    "OutputExistsError",
    "PreparedRun",
    "ProgressFactory",
    "dp_scaling",
    "prepare_run",
    "resume_experiment",
    "run_experiment",
    "train_run",
]
