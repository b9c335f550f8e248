"""Cryptography for ULDP-AVG-w's private weighting protocol (torch-free).

Modules: :mod:`~silodp.crypto.paillier` (Paillier on gmpy2), :mod:`~silodp.crypto.keyagree`
(X25519 + HKDF + sealed seed), :mod:`~silodp.crypto.prg` (ChaCha20 generators),
:mod:`~silodp.crypto.encoding` (fixed point with ``L = lcm(1..N_max)``),
:mod:`~silodp.crypto.identity` (Ed25519-signed key shares),
:mod:`~silodp.crypto.sampling` (Poisson subject samples from a key the silos share),
:mod:`~silodp.crypto.protocol` (the parties, messages and the in-process driver).
"""

from silodp.crypto.encoding import FixedPointCodec, WeightingEncoding, lcm_upto
from silodp.crypto.errors import (
    EncodingOverflowError,
    InsecureKeyError,
    KeyAgreementError,
    KeyAuthenticationError,
    MalformedMessageError,
    ProtocolError,
    SeedAuthenticationError,
    SenderError,
    SetupDropoutError,
    SiloDropoutError,
    StageError,
    SubjectBoundError,
    ValueOutOfRangeError,
)
from silodp.crypto.paillier import (
    PaillierKeyPair,
    PaillierPrivateKey,
    PaillierPublicKey,
    generate_keypair,
)
from silodp.crypto.protocol import (
    ProtocolConfig,
    RoundResult,
    Server,
    Silo,
    WeightingSession,
    plaintext_weighted_sum,
    run_weighting_round,
    with_identities,
)
from silodp.crypto.sampling import SharedSampleKey

__all__ = [
    "EncodingOverflowError",
    "FixedPointCodec",
    "InsecureKeyError",
    "KeyAgreementError",
    "KeyAuthenticationError",
    "MalformedMessageError",
    "PaillierKeyPair",
    "PaillierPrivateKey",
    "PaillierPublicKey",
    "ProtocolConfig",
    "ProtocolError",
    "RoundResult",
    "SeedAuthenticationError",
    "SenderError",
    "Server",
    "SetupDropoutError",
    "SharedSampleKey",
    "Silo",
    "SiloDropoutError",
    "StageError",
    "SubjectBoundError",
    "ValueOutOfRangeError",
    "WeightingEncoding",
    "WeightingSession",
    "generate_keypair",
    "lcm_upto",
    "plaintext_weighted_sum",
    "run_weighting_round",
    "with_identities",
]
