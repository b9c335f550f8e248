"""The private weighting protocol of ULDP-AVG-w (SPEC §4; ULDP-FL, Protocol 1), by role.

* :mod:`~silodp.crypto.protocol.config`: :class:`ProtocolConfig`, the public parameters every
  party agrees on, and the stage check every party runs on a message;
* :mod:`~silodp.crypto.protocol.server`: the :class:`Server` (Paillier key holder, relay,
  decryptor of the aggregate), its :class:`ServerStage` and :class:`RoundResult`;
* :mod:`~silodp.crypto.protocol.silo`: a :class:`Silo` (histogram, keys, blinds, its masked
  weighted sum per round) and its :class:`SiloStage`;
* :mod:`~silodp.crypto.protocol.session`: the protocol step by step and the in-process driver:
  :class:`WeightingSession`, :func:`run_weighting_round`, :func:`with_identities`, the
  clear-text reference :func:`plaintext_weighted_sum`, and :class:`Parties` (the parties one
  process plays when they run apart);
* :mod:`~silodp.crypto.protocol.estimate`: :class:`RoundEstimate`, the modelled cost of a round.

Imports go one way: ``config`` <- ``server``, ``silo``, ``estimate`` <- ``session``.
"""

from silodp.crypto.protocol.config import ProtocolConfig
from silodp.crypto.protocol.estimate import RoundEstimate
from silodp.crypto.protocol.server import RoundResult, Server, ServerStage
from silodp.crypto.protocol.session import (
    Parties,
    WeightingSession,
    plaintext_weighted_sum,
    run_weighting_round,
    with_identities,
)
from silodp.crypto.protocol.silo import Silo, SiloStage

__all__ = [
    "Parties",
    "ProtocolConfig",
    "RoundEstimate",
    "RoundResult",
    "Server",
    "ServerStage",
    "Silo",
    "SiloStage",
    "WeightingSession",
    "plaintext_weighted_sum",
    "run_weighting_round",
    "with_identities",
]
