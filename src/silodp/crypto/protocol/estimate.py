"""The modelled cost of a weighting round (:class:`RoundEstimate`): the product count of
:func:`~silodp.crypto.weighted_sum.modelled_round_products` times a modular product timed on
this machine."""

from __future__ import annotations

from dataclasses import dataclass

from silodp.crypto.encoding import WeightingEncoding
from silodp.crypto.protocol.config import ProtocolConfig
from silodp.crypto.weighted_sum import modelled_round_products, product_seconds

__all__ = ["RoundEstimate", "estimate_round"]


@dataclass(frozen=True)
class RoundEstimate:
    """Modelled cost of one protocol round (see :func:`estimate_round`)."""

    pairs: int  # (silo, subject) pairs with records
    dim: int
    slots: int  # coordinates per ciphertext
    cpu_seconds: float
    scheme: str = "Paillier"  # what the estimate models, as the run's log names it
    setup_cpu_seconds: float = 0.0  # once per training before the first round (BFV
    # fixed-point weights)


def estimate_round(
    config: ProtocolConfig, encoding: WeightingEncoding, *, pairs: int, dim: int
) -> RoundEstimate:
    """The modelled CPU cost of one ``dim``-parameter round's cryptography on this machine
    (training not included) for ``pairs`` (silo, subject) pairs with records: the cost model
    of :func:`~silodp.crypto.weighted_sum.choose_slots` times a measured modular product."""
    slots = config.slots_for(encoding, dim)
    key_bits = encoding.modulus.bit_length()
    products = modelled_round_products(
        encoding, dim, pairs, slots, key_bits=key_bits, silos=len(config.silo_ids)
    )
    seconds = products * product_seconds(encoding.modulus**2)
    return RoundEstimate(pairs=pairs, dim=dim, slots=slots, cpu_seconds=seconds)
