"""A lattice (BFV) backend for the ULDP-AVG-w weighting protocol: SEAL through TenSEAL's
bindings, exact integers by the CRT over several plaintext primes, noise flooding so that the
key holder learns only the sum. See :mod:`~silodp.crypto.bfv.weighting` for the protocol and
what each party learns, :mod:`~silodp.crypto.bfv.params` for the parameters and their noise
analysis, :mod:`~silodp.crypto.bfv.simulation` for the parties ``uldp_avg_w`` drives
(``scheme = "bfv"``, in-process simulator only) and the round's cost model. Importing this
package needs ``tenseal``; :mod:`silodp.crypto` does not import it."""

from silodp.crypto.bfv.params import BfvParameters, BfvPlan, batching_primes, plan_bfv_round
from silodp.crypto.bfv.simulation import BfvProtocol, BfvProtocolConfig, estimate_bfv_round
from silodp.crypto.bfv.weighting import BfvServer, BfvSilo, BfvWeightingSession

__all__ = [
    "BfvParameters",
    "BfvPlan",
    "BfvProtocol",
    "BfvProtocolConfig",
    "BfvServer",
    "BfvSilo",
    "BfvWeightingSession",
    "batching_primes",
    "estimate_bfv_round",
    "plan_bfv_round",
]
