"""Named exceptions of the private weighting protocol and its building blocks.

Parameter problems found while setting things up are ``ValueError`` subclasses (a caller gave
a bad value); problems with a message received from another party are :class:`ProtocolError`
subclasses (a peer, or the network, misbehaved). Every message names the offending value.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "EncodingOverflowError",
    "InsecureKeyError",
    "KeyAgreementError",
    "KeyAuthenticationError",
    "MalformedMessageError",
    "ProtocolError",
    "SeedAuthenticationError",
    "SenderError",
    "SetupDropoutError",
    "SiloDropoutError",
    "StageError",
    "SubjectBoundError",
    "ValueOutOfRangeError",
]


class InsecureKeyError(ValueError):
    """A Paillier modulus below the minimum size was asked for or received."""


class EncodingOverflowError(ValueError):
    """The fixed-point parameters could let an aggregate wrap around the modulus."""


class ValueOutOfRangeError(ValueError):
    """A value to encode exceeds the bound declared (and checked) at set-up."""


class SubjectBoundError(ValueError):
    """A subject holds more records than ``N_max``; the weights could not be decoded."""


class ProtocolError(Exception):
    """A message from another party was refused."""


class StageError(ProtocolError):
    """A message arrived at a stage (or for a round) where it is not expected."""


class SenderError(ProtocolError):
    """A message came from an unknown or unexpected party, or twice from the same one."""


class MalformedMessageError(ProtocolError, ValueError):
    """A message has the wrong session, length, type or an out-of-range value."""


class SeedAuthenticationError(ProtocolError):
    """The encrypted shared seed failed authentication (tampered, or wrong key)."""


class KeyAgreementError(ProtocolError):
    """A Diffie-Hellman public key was invalid (e.g. a low-order point)."""


class KeyAuthenticationError(KeyAgreementError):
    """A key share's signature does not verify under the silo's registered identity key."""


class SiloDropoutError(ProtocolError):
    """Silos left mid-round: the round is aborted and nothing is decrypted."""

    def __init__(self, missing: Iterable[int], round_index: int) -> None:
        self.missing = tuple(sorted(missing))
        self.round_index = round_index
        super().__init__(
            f"Round {round_index} aborted: no masked sum from silo(s) {list(self.missing)}; "
            "their pairwise masks do not cancel, so the server decrypts nothing."
        )


class SetupDropoutError(ProtocolError):
    """Silos did not answer during set-up: the session is aborted (no key is used further)."""

    def __init__(self, missing: Iterable[int], stage: str) -> None:
        self.missing = tuple(sorted(missing))
        self.stage = stage
        super().__init__(
            f"Set-up aborted while {stage}: no answer from silo(s) {list(self.missing)}; "
            "without every silo's key share and masked histogram the masks and blinded totals "
            "are unusable. Start a new session."
        )
