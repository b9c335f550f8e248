"""Tampered, misrouted and malformed messages are refused with named errors."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from silodp.crypto.errors import (
    KeyAgreementError,
    MalformedMessageError,
    ProtocolError,
    SeedAuthenticationError,
    SenderError,
    StageError,
)
from silodp.crypto.messages import (
    MAX_MODULUS_BITS,
    EncryptedWeights,
    KeyDirectory,
    KeyShare,
    MaskedHistogram,
    MaskedWeightedSum,
    SealedSeed,
    ServerHello,
)
from silodp.crypto.prg import ChaCha20Prg
from silodp.crypto.protocol import (
    ProtocolConfig,
    Server,
    Silo,
    SiloStage,
    WeightingSession,
    plaintext_weighted_sum,
)

CONFIG = ProtocolConfig(
    silo_ids=(0, 1, 2),
    subject_ids=("a", "b", "c"),
    n_max=20,
    insecure_test_key_bits=512,
    workers=1,
)
HIST = {0: {"a": 2, "b": 1}, 1: {"a": 3, "c": 4}, 2: {"b": 5}}
DIM = 3


def _parties(seed: int = 0):
    server = Server(CONFIG, source=ChaCha20Prg(bytes([seed]) * 32))
    silos = {
        s: Silo(s, CONFIG, HIST[s], source=ChaCha20Prg(bytes([seed + s + 1]) * 32)) for s in HIST
    }
    return server, silos


def _through_keys(server, silos):
    hello = server.hello()
    directory = None
    for silo in silos.values():
        directory = server.receive_key_share(silo.receive_hello(hello))
    return hello, directory


def _ready(seed: int = 0):
    server, silos = _parties(seed)
    _, directory = _through_keys(server, silos)
    for msg in [m for silo in silos.values() for m in silo.receive_directory(directory)]:
        silos[msg.recipient].receive_seed(server.relay_seed(msg))
    for silo in silos.values():
        server.receive_histogram(silo.masked_histogram())
    return server, silos


def _deltas(s: int) -> dict:
    return {a: np.full(DIM, 0.25 * (s + 1)) for a in HIST[s]}


def test_messages_validate_their_shape() -> None:
    sid = bytes(16)
    with pytest.raises(MalformedMessageError, match="session"):
        KeyShare(b"short", 0, bytes(32))
    with pytest.raises(MalformedMessageError, match="sender"):
        KeyShare(sid, -1, bytes(32))
    with pytest.raises(MalformedMessageError, match="sender"):
        KeyShare(sid, True, bytes(32))
    with pytest.raises(MalformedMessageError, match="dh_public"):
        KeyShare(sid, 0, bytes(31))
    with pytest.raises(MalformedMessageError, match="int"):
        MaskedHistogram(sid, 0, (1, 2.0))  # type: ignore[arg-type]
    with pytest.raises(MalformedMessageError, match="tuple"):
        MaskedHistogram(sid, 0, [1, 2])  # type: ignore[arg-type]
    with pytest.raises(MalformedMessageError, match="dim"):
        EncryptedWeights(sid, 0, -1, (1,))
    assert EncryptedWeights(sid, 0, 0, (1,)).dim == 0  # 0: the silos say how many
    with pytest.raises(MalformedMessageError, match="dim"):
        MaskedWeightedSum(sid, 0, 0, 0, (1,))
    with pytest.raises(MalformedMessageError, match="nonce"):
        SealedSeed(sid, 0, 1, bytes(11), b"x")
    with pytest.raises(MalformedMessageError, match="modulus"):
        ServerHello(sid, 100)
    with pytest.raises(MalformedMessageError):
        KeyDirectory(sid, ((0, bytes(32)), (1,)))  # type: ignore[arg-type]


def test_wrong_stage_is_refused() -> None:
    server, silos = _parties()
    with pytest.raises(StageError, match="created"):
        server.open_round(0, DIM)
    with pytest.raises(StageError):
        silos[0].masked_histogram()
    hello, directory = _through_keys(server, silos)
    with pytest.raises(StageError):
        silos[0].receive_hello(hello)  # twice
    with pytest.raises(StageError):
        server.receive_histogram(MaskedHistogram(server.session_id, 0, (1, 2, 3)))
    with pytest.raises(StageError):
        silos[1].receive_seed(SealedSeed(server.session_id, 0, 1, bytes(12), b"x" * 48))


def test_wrong_sender_duplicate_and_session_are_refused() -> None:
    server, silos = _parties()
    hello = server.hello()
    share = silos[0].receive_hello(hello)
    with pytest.raises(SenderError, match="unknown silo 7"):
        server.receive_key_share(dataclasses.replace(share, sender=7))
    server.receive_key_share(share)
    with pytest.raises(SenderError, match="second"):
        server.receive_key_share(share)
    other = silos[1].receive_hello(hello)
    with pytest.raises(MalformedMessageError, match="session"):
        server.receive_key_share(dataclasses.replace(other, session_id=bytes(16)))
    with pytest.raises(MalformedMessageError, match="KeyShare"):
        server.receive_key_share(hello)  # type: ignore[arg-type]


def test_tampered_directory_and_seed_are_refused() -> None:
    server, silos = _parties()
    _, directory = _through_keys(server, silos)
    swapped = dict(directory.dh_publics)
    swapped[1] = swapped[2]
    with pytest.raises(MalformedMessageError, match="own key"):
        silos[1].receive_directory(
            KeyDirectory(directory.session_id, tuple(sorted(swapped.items())))
        )
    bad = dict(directory.dh_publics)
    bad[2] = bytes(32)  # low-order point
    with pytest.raises(KeyAgreementError):
        silos[1].receive_directory(KeyDirectory(directory.session_id, tuple(sorted(bad.items()))))
    server2, silos2 = _parties(5)
    _, directory2 = _through_keys(server2, silos2)
    sealed = silos2[0].receive_directory(directory2)
    for s in (1, 2):
        silos2[s].receive_directory(directory2)
    to_1 = next(m for m in sealed if m.recipient == 1)
    flipped = dataclasses.replace(
        to_1, ciphertext=bytes([to_1.ciphertext[0] ^ 1]) + to_1.ciphertext[1:]
    )
    with pytest.raises(SeedAuthenticationError):
        silos2[1].receive_seed(server2.relay_seed(flipped))
    assert silos2[1].stage is SiloStage.AWAITING_SEED  # nothing accepted
    to_2 = next(m for m in sealed if m.recipient == 2)
    with pytest.raises(SenderError, match="only silo 0"):
        server2.relay_seed(dataclasses.replace(to_2, sender=1))
    with pytest.raises(SenderError):  # misrouted: silo 2's envelope delivered to silo 1
        silos2[1].receive_seed(to_2)


def test_wrong_lengths_and_out_of_range_values_are_refused() -> None:
    server, silos = _parties()
    _, directory = _through_keys(server, silos)
    for msg in [m for silo in silos.values() for m in silo.receive_directory(directory)]:
        silos[msg.recipient].receive_seed(server.relay_seed(msg))
    hist = silos[0].masked_histogram()
    n = server.public_key.n
    with pytest.raises(MalformedMessageError, match="2 values"):
        server.receive_histogram(dataclasses.replace(hist, values=hist.values[:2]))
    with pytest.raises(MalformedMessageError, match=r"not in \[0, n\)"):
        server.receive_histogram(dataclasses.replace(hist, values=(n,) + hist.values[1:]))
    server.receive_histogram(hist)
    for s in (1, 2):
        server.receive_histogram(silos[s].masked_histogram())
    weights = server.open_round(0, DIM)
    with pytest.raises(MalformedMessageError, match="2 weight"):
        silos[0].weighted_sum(
            dataclasses.replace(weights, ciphertexts=weights.ciphertexts[:2]), _deltas(0)
        )
    with pytest.raises(MalformedMessageError, match="coprime"):
        silos[0].weighted_sum(
            dataclasses.replace(weights, ciphertexts=(n,) + weights.ciphertexts[1:]), _deltas(0)
        )
    with pytest.raises(MalformedMessageError, match="n\\^2"):
        silos[0].weighted_sum(
            dataclasses.replace(weights, ciphertexts=(0,) + weights.ciphertexts[1:]), _deltas(0)
        )
    with pytest.raises(ValueError, match="shape"):
        silos[0].weighted_sum(weights, {a: np.zeros(DIM + 1) for a in HIST[0]})
    with pytest.raises(ValueError, match="missing"):
        silos[0].weighted_sum(weights, {"a": np.zeros(DIM)})
    reply = silos[0].weighted_sum(weights, _deltas(0))
    extra = reply.ciphertexts + reply.ciphertexts[:1]
    with pytest.raises(MalformedMessageError, match=f"{len(extra)} ciphertexts"):
        server.receive_weighted_sum(dataclasses.replace(reply, ciphertexts=extra))
    n2 = int(server.public_key.n_squared)
    with pytest.raises(MalformedMessageError, match="n\\^2"):
        server.receive_weighted_sum(
            dataclasses.replace(reply, ciphertexts=(n2,) + reply.ciphertexts[1:])
        )
    with pytest.raises(StageError, match="round 5"):
        server.receive_weighted_sum(dataclasses.replace(reply, round_index=5))
    server.receive_weighted_sum(reply)
    with pytest.raises(SenderError):
        server.receive_weighted_sum(reply)


def test_replayed_round_is_refused_by_the_silo() -> None:
    server, silos = _ready()
    weights = server.open_round(0, DIM)
    silos[0].weighted_sum(weights, _deltas(0))
    with pytest.raises(StageError, match="reuse its masks"):
        silos[0].weighted_sum(weights, _deltas(0))
    server.abort_round()
    with pytest.raises(StageError):
        server.open_round(0, DIM)


def test_garbage_ciphertext_is_detected_at_decoding() -> None:
    server, silos = _ready(3)
    weights = server.open_round(0, DIM)
    replies = [silo.weighted_sum(weights, _deltas(s)) for s, silo in silos.items()]
    forged = dataclasses.replace(
        replies[1],
        ciphertexts=tuple(c * 7 % int(server.public_key.n_squared) for c in replies[1].ciphertexts),
    )
    for reply in (replies[0], forged, replies[2]):
        server.receive_weighted_sum(reply)
    with pytest.raises(MalformedMessageError, match="out of range"):
        server.finish_round()
    assert isinstance(MalformedMessageError("x"), ProtocolError)


@settings(max_examples=8, deadline=None)
@given(
    data=st.lists(
        st.tuples(
            st.integers(0, 2),
            st.sampled_from("abc"),
            st.integers(1, 6),
            st.floats(-1, 1, allow_nan=False),
        ),
        min_size=1,
        max_size=8,
    )
)
def test_random_small_federations(data) -> None:
    hist: dict[int, dict[str, int]] = {0: {}, 1: {}, 2: {}}
    deltas: dict[int, dict[str, np.ndarray]] = {0: {}, 1: {}, 2: {}}
    for s, a, c, x in data:
        hist[s][a] = min(20, hist[s].get(a, 0) + c)
        deltas[s][a] = np.array([x, -x / 3])
    totals = {a: sum(h.get(a, 0) for h in hist.values()) for a in "abc"}
    if max(totals.values()) > 20:
        return
    session = WeightingSession(CONFIG, hist, source=ChaCha20Prg(bytes(32)))
    out = session.run_round(deltas).aggregate
    ref = plaintext_weighted_sum(deltas, hist)
    np.testing.assert_allclose(out, ref, rtol=0, atol=6 * 0.5e-10 + 1e-15)


def test_messages_bound_their_sizes_before_anything_is_computed() -> None:
    sid = bytes(16)
    huge = 2 ** (2 * MAX_MODULUS_BITS)  # one bit too many for a ciphertext mod n^2
    with pytest.raises(MalformedMessageError, match=r"ciphertexts\[1\] .* got a 32769-bit int"):
        MaskedWeightedSum(sid, 0, 0, 3, (1, huge))
    with pytest.raises(MalformedMessageError, match=r"values\[0\] .* got negative"):
        MaskedHistogram(sid, 0, (-1, 2))
    with pytest.raises(MalformedMessageError, match=r"values\[0\] to be an int in \[0, 2\^16384\)"):
        MaskedHistogram(sid, 0, (2**MAX_MODULUS_BITS,))
    with pytest.raises(MalformedMessageError, match="at most 16384 bits, got a 16385-bit int"):
        ServerHello(sid, 2**MAX_MODULUS_BITS + 1)
    with pytest.raises(MalformedMessageError, match="silo 1 has two"):
        KeyDirectory(sid, ((1, bytes(32)), (1, bytes(32))))
    with pytest.raises(MalformedMessageError, match="signature to be 64 bytes, got 3 bytes"):
        KeyShare(sid, 0, bytes(32), b"abc")
    with pytest.raises(MalformedMessageError, match="ciphertext to be 16 to 4096 bytes"):
        SealedSeed(sid, 0, 1, bytes(12), b"")
    with pytest.raises(MalformedMessageError, match="dim <= 2147483648"):
        MaskedWeightedSum(sid, 0, 0, 2**31 + 1, (1,))
    with pytest.raises(MalformedMessageError, match="round_index=<a 200-bit int>"):
        EncryptedWeights(sid, 2**199, 1, (1,))
    with pytest.raises(MalformedMessageError, match="session id"):
        KeyShare(bytearray(16), 0, bytes(32))  # type: ignore[arg-type]
    assert KeyShare(sid, 0, bytes(32), bytes(64)).signature == bytes(64)
