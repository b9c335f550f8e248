"""X25519 pairwise keys, the sealed seed, and the ChaCha20 generators."""

from __future__ import annotations

import pytest

from silodp.crypto.errors import KeyAgreementError, SeedAuthenticationError
from silodp.crypto.keyagree import (
    derive_pairwise_keys,
    generate_dh_keypair,
    open_seed,
    seal_seed,
)
from silodp.crypto.prg import ChaCha20Prg, MaskStream, derive_key
from silodp.crypto.randomness import randbelow, randbits, random_unit

SESSION = bytes(range(16))


def _pair(seed: int) -> tuple:
    rng = ChaCha20Prg(bytes([seed]) * 32)
    return generate_dh_keypair(rng), generate_dh_keypair(rng), rng


def test_both_sides_derive_the_same_keys() -> None:
    a, b, _ = _pair(1)
    k_ab = derive_pairwise_keys(3, a, 7, b.public_bytes, session_id=SESSION)
    k_ba = derive_pairwise_keys(7, b, 3, a.public_bytes, session_id=SESSION)
    assert (k_ab.low, k_ab.high) == (3, 7)
    assert k_ab.aead_key == k_ba.aead_key and k_ab.mask_key == k_ba.mask_key
    assert k_ab.aead_key != k_ab.mask_key
    other = derive_pairwise_keys(3, a, 7, b.public_bytes, session_id=bytes(16))
    assert other.mask_key != k_ab.mask_key  # bound to the session
    assert "key" not in repr(k_ab).lower().replace("pairwisekeys", "")


def test_low_order_public_key_is_rejected() -> None:
    a, _, _ = _pair(2)
    with pytest.raises(KeyAgreementError):
        derive_pairwise_keys(0, a, 1, bytes(32), session_id=SESSION)
    with pytest.raises(KeyAgreementError):
        derive_pairwise_keys(0, a, 1, b"short", session_id=SESSION)


def test_sealed_seed_opens_only_with_the_right_key_and_route() -> None:
    a, b, rng = _pair(3)
    c = generate_dh_keypair(rng)
    k_ab = derive_pairwise_keys(0, a, 1, b.public_bytes, session_id=SESSION)
    k_ac = derive_pairwise_keys(0, a, 2, c.public_bytes, session_id=SESSION)
    seed = bytes(range(32))
    nonce, ct = seal_seed(k_ab, seed, session_id=SESSION, sender=0, recipient=1, source=rng)
    assert open_seed(k_ab, nonce, ct, session_id=SESSION, sender=0, recipient=1) == seed
    tampered = ct[:-1] + bytes([ct[-1] ^ 1])
    with pytest.raises(SeedAuthenticationError):
        open_seed(k_ab, nonce, tampered, session_id=SESSION, sender=0, recipient=1)
    with pytest.raises(SeedAuthenticationError):  # another pair's key
        open_seed(k_ac, nonce, ct, session_id=SESSION, sender=0, recipient=1)
    with pytest.raises(SeedAuthenticationError):  # replayed to another recipient
        open_seed(k_ab, nonce, ct, session_id=SESSION, sender=0, recipient=2)
    with pytest.raises(SeedAuthenticationError):  # other session
        open_seed(k_ab, nonce, ct, session_id=bytes(16), sender=0, recipient=1)


def test_prg_is_deterministic_per_key() -> None:
    a, b = ChaCha20Prg(bytes(32)), ChaCha20Prg(bytes(32))
    assert a.token_bytes(100) == b.token_bytes(100)
    assert a.token_bytes(7) + a.token_bytes(9) == b.token_bytes(16)
    assert ChaCha20Prg(bytes([1]) * 32).token_bytes(32) != ChaCha20Prg(bytes(32)).token_bytes(32)
    with pytest.raises(ValueError, match="32-byte key"):
        ChaCha20Prg(b"short")
    assert "key" not in repr(a)


def test_uniform_integers_by_rejection() -> None:
    rng = ChaCha20Prg(bytes([5]) * 32)
    n = 1000003 * 999983
    draws = [randbelow(rng, n) for _ in range(2000)]
    assert all(0 <= d < n for d in draws)
    assert max(draws) > n * 0.95 and min(draws) < n * 0.05
    units = [random_unit(rng, 15) for _ in range(200)]
    assert set(units) == {1, 2, 4, 7, 8, 11, 13, 14}
    assert all(0 <= randbits(rng, 5) < 32 for _ in range(100))
    with pytest.raises(ValueError):
        randbelow(rng, 0)


def test_masks_are_seekable_and_cancel() -> None:
    n = (2**127 - 1) * (2**89 - 1)
    key = derive_key(bytes(32), b"round|3")
    stream = MaskStream(key, n)
    whole = stream.values(0, 50)
    assert whole == stream.values(0, 17) + stream.values(17, 50)
    assert whole[33] == stream.value(33)
    assert all(0 <= v < n for v in whole) and len(set(whole)) == 50
    assert MaskStream(derive_key(bytes(32), b"round|4"), n).values(0, 50) != whole
    # silo i adds +mask, silo j adds -mask: the sum of the pair's contributions is zero
    own = [5, 6, 7]
    i_side = [(x + m) % n for x, m in zip(own, stream.values(0, 3), strict=True)]
    j_side = [(0 - m) % n for m in MaskStream(key, n).values(0, 3)]
    assert [(a + b) % n for a, b in zip(i_side, j_side, strict=True)] == own


def test_derive_key_separates_domains() -> None:
    s = bytes(32)
    assert derive_key(s, b"a") != derive_key(s, b"b")
    assert derive_key(s, b"a", salt=b"x") != derive_key(s, b"a")
    with pytest.raises(ValueError):
        derive_key(b"short", b"a")


def test_signed_key_shares_refuse_a_substituted_key() -> None:
    from silodp.crypto.errors import KeyAuthenticationError
    from silodp.crypto.messages import KeyDirectory
    from silodp.crypto.protocol import ProtocolConfig, Server, Silo, with_identities

    base = ProtocolConfig(
        silo_ids=(0, 1, 2), subject_ids=(0, 1), n_max=4, insecure_test_key_bits=512
    )
    config, identities = with_identities(base, ChaCha20Prg(bytes([7]) * 32))
    assert config.identity_of(1) == identities[1].public_bytes
    hist = {0: {0: 1}, 1: {1: 2}, 2: {0: 1}}

    def parties():
        server = Server(config)
        silos = {s: Silo(s, config, hist[s], identity=identities[s]) for s in range(3)}
        hello = server.hello()
        shares = {s: silo.receive_hello(hello) for s, silo in silos.items()}
        return server, silos, shares

    # honest run: every signature verifies, set-up completes
    server, silos, shares = parties()
    directory = None
    for share in shares.values():
        directory = server.receive_key_share(share)
    assert directory is not None and len(directory.signatures) == 3
    for silo in silos.values():
        silo.receive_directory(directory)
    # a server that swaps silo 1's key for its own is caught by every other silo
    server, silos, shares = parties()
    for share in shares.values():
        directory = server.receive_key_share(share)
    assert directory is not None
    mitm = dict(directory.dh_publics)
    mitm[1] = generate_dh_keypair(ChaCha20Prg(bytes([8]) * 32)).public_bytes
    forged = KeyDirectory(directory.session_id, tuple(sorted(mitm.items())), directory.signatures)
    with pytest.raises(KeyAuthenticationError, match="silo 1"):
        silos[0].receive_directory(forged)
    # a share signed by the wrong identity (or unsigned) is refused by the server too
    server, silos, shares = parties()
    bad = type(shares[2])(shares[2].session_id, 2, shares[2].dh_public, shares[1].signature)
    with pytest.raises(KeyAuthenticationError, match="silo 2"):
        server.receive_key_share(bad)
    with pytest.raises(ValueError, match="identity key registered"):
        Silo(0, config, hist[0], identity=identities[1])
