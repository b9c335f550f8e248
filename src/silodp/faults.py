"""Named points at which a test can stop a real run the hard way.

``SILODP_KILL_AT="<point>:<round>"`` makes the process kill itself with SIGKILL when it reaches
that point in that round, as a crash or a power cut would; nothing runs after it. The points:
``silo_recorded`` (a silo's events are in the ledger, its message not yet aggregated),
``round_completed`` (the ledger has closed the round, its checkpoint is not yet written),
``round_written`` (a round's metrics are on disk, its checkpoint not yet), and
``checkpoint_written`` (the round is complete on disk), and ``run_recorded`` (round = the
rounds run: the ledger marks the run finished, its plots and summary are not yet written).
Unset, this does nothing.
"""

from __future__ import annotations

import os
import signal

__all__ = ["reached"]

ENV = "SILODP_KILL_AT"


def reached(point: str, round_index: int) -> None:
    """Kills this process if ``SILODP_KILL_AT`` names ``point`` in ``round_index``."""
    if os.environ.get(ENV) == f"{point}:{round_index}":
        os.kill(os.getpid(), signal.SIGKILL)
