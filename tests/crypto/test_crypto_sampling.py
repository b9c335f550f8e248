"""Poisson subject sampling from a key the silos share: same sample for every holder, a new
one every round, Bernoulli(q) per subject, and nothing without the key."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from silodp.crypto import sampling
from silodp.crypto.prg import ChaCha20Prg
from silodp.crypto.sampling import SharedSampleKey

ALPHA = 1e-6


def test_every_holder_of_the_key_derives_the_same_sample() -> None:
    key = bytes(range(32))
    a, b = SharedSampleKey(key), SharedSampleKey(bytes(key))
    for r in range(5):
        np.testing.assert_array_equal(a.sample(r, 300, 0.3), b.sample(r, 300, 0.3))
    assert a == b and hash(a) == hash(b)


def test_the_sample_depends_on_the_key_and_the_round() -> None:
    a = SharedSampleKey(bytes(32))
    b = SharedSampleKey(bytes([1]) + bytes(31))
    assert not np.array_equal(a.sample(0, 300, 0.5), b.sample(0, 300, 0.5))
    assert not np.array_equal(a.sample(0, 300, 0.5), a.sample(1, 300, 0.5))
    assert a != b


def test_sampling_frequency_is_q_and_rejects_a_wrong_rate() -> None:
    q, subjects, rounds = 0.1, 5000, 20
    key = SharedSampleKey.generate(ChaCha20Prg(bytes([7]) * 32))
    draws = np.stack([key.sample(r, subjects, q) for r in range(rounds)])
    hits, trials = int(draws.sum()), subjects * rounds
    assert stats.binomtest(hits, trials, q).pvalue > ALPHA
    assert stats.binomtest(hits, trials, 1.5 * q).pvalue < ALPHA
    assert stats.binomtest(hits, trials, 0.8 * q).pvalue < ALPHA
    # independent across subjects and rounds: consecutive subjects and rounds agree as often
    # as independent Bernoulli(q) pairs do
    same_subject = int((draws[:-1] & draws[1:]).sum())
    pairs = (rounds - 1) * subjects
    assert stats.binomtest(same_subject, pairs, q * q).pvalue > ALPHA
    neighbours = int((draws[:, :-1] & draws[:, 1:]).sum())
    assert stats.binomtest(neighbours, rounds * (subjects - 1), q * q).pvalue > ALPHA


def test_rates_zero_and_one() -> None:
    key = SharedSampleKey(bytes(32))
    assert not key.sample(3, 100, 0.0).any()
    assert key.sample(3, 100, 1.0).all()
    assert key.sample(3, 0, 0.5).shape == (0,)


class _Words:
    """A stand-in keystream: the given 64-bit words (little-endian), then zeros."""

    def __init__(self, words: list[int]) -> None:
        self._bytes = b"".join(w.to_bytes(8, "little") for w in words)

    def token_bytes(self, nbytes: int) -> bytes:
        out, self._bytes = self._bytes[:nbytes], self._bytes[nbytes:]
        return out + bytes(nbytes - len(out))


def test_a_word_tied_with_the_rate_is_decided_by_further_words() -> None:
    # U's first 64 bits equal floor(q 2^64): the next words decide U < q exactly
    q = 1e-5  # below 2^-11: q 2^64 is not an integer
    exact = Fraction(q) * 2**64
    assert exact.denominator > 1
    cut = int(exact)
    rest = exact - cut  # the fraction of the next word's range below q
    below = int(rest * 2**64) - 1
    assert sampling._below(cut, _Words([below]), Fraction(q))
    assert not sampling._below(cut, _Words([below + 2]), Fraction(q))
    assert sampling._below(cut - 1, _Words([]), Fraction(q))
    assert not sampling._below(cut + 1, _Words([]), Fraction(q))


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), True, "0.5"])
def test_bad_rates_are_refused(bad) -> None:
    with pytest.raises(ValueError, match="rate"):
        SharedSampleKey(bytes(32)).sample(0, 10, bad)


def test_bad_keys_and_rounds_are_refused_and_the_key_is_never_printed() -> None:
    with pytest.raises(ValueError, match="32-byte"):
        SharedSampleKey(bytes(16))
    key = SharedSampleKey(bytes([0xAB]) * 32)
    with pytest.raises(ValueError, match="round_index"):
        key.sample(-1, 10, 0.5)
    assert "ab" not in repr(key).lower() and "secret" in repr(key)
