"""Coins: secure streams differ, seeded ones repeat, derived draws are exact."""

from __future__ import annotations

import os
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from silodp.privacy.randomness import Coins

ALPHA = 1e-7


def test_seeded_coins_repeat_and_secure_coins_do_not() -> None:
    assert np.array_equal(Coins.seeded(1, 2).uint64(8), Coins.seeded(1, 2).uint64(8))
    assert not np.array_equal(Coins.seeded(1, 2).uint64(8), Coins.seeded(1, 3).uint64(8))
    assert not np.array_equal(Coins.secure().uint64(8), Coins.secure().uint64(8))
    coins = Coins.secure()
    assert not np.array_equal(coins.uint64(8), coins.uint64(8))
    assert Coins.for_mode("secure", 1).is_secure and not Coins.for_mode("seeded", 1).is_secure


def test_secure_words_are_uniform_bits() -> None:
    words = Coins.secure().uint64(50_000)
    bits = np.unpackbits(words.view(np.uint8)).reshape(-1, 64).mean(axis=0)
    # each bit position: mean 1/2 with std 1/sqrt(4·50000)
    assert np.all(np.abs(bits - 0.5) < 6 / np.sqrt(4 * 50_000))
    assert len(Coins.secure().token_bytes(33)) == 33


def test_forked_child_does_not_replay_the_parent_stream() -> None:
    coins = Coins.secure()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.write(write, coins.uint64(4).tobytes())
        os._exit(0)
    os.waitpid(pid, 0)
    child = np.frombuffer(os.read(read, 32), dtype=np.uint64)
    assert not np.array_equal(child, coins.uint64(4))


@pytest.mark.parametrize("rate", [0.0, 1.0, 0.3])
def test_bernoulli_is_exact(rate) -> None:
    draws = Coins.secure().bernoulli(200_000, rate).numpy()
    count = int(draws.sum())
    if rate in (0.0, 1.0):
        assert count == rate * draws.size
        return
    p = stats.binomtest(count, draws.size, rate).pvalue
    assert p > ALPHA


def test_bernoulli_at_a_rate_below_one_word_decides_ties_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # rate 2^-64 + 2^-70 (no sample could tell it from 0): floor(rate·2^64) = 1, so the word
    # 0 is in, 2 and above are out, and 1 ties: in exactly when the next word is below 2^58
    coins = Coins.seeded(0)
    words = iter(
        [
            np.array([0, 1, 1, 2], dtype=np.uint64),
            np.array([2**58 - 1], dtype=np.uint64),
            np.array([2**58], dtype=np.uint64),
        ]
    )
    monkeypatch.setattr(coins, "uint64", lambda n: next(words))
    assert coins.bernoulli(4, 2.0**-70 + 2.0**-64).tolist() == [True, True, False, False]


def test_bernoulli_ties_read_further_bits() -> None:
    coins = Coins.seeded(4)
    rate = Fraction(1, 3)
    cut = int(rate * 2**64)
    # a uniform whose first 64 bits equal floor(rate·2^64) is decided by the next bits
    outcomes = [coins.below(cut, 64, rate) for _ in range(4000)]
    # P(U < 1/3 | first 64 bits = cut) = frac(2^64/3) = 1/3 (2^64 = 1 mod 3)
    assert stats.binomtest(sum(outcomes), 4000, 1 / 3).pvalue > ALPHA


def test_permutation_and_ranks_are_permutations_and_uniform() -> None:
    coins = Coins.seeded(9)
    perm = coins.permutation(50)
    assert sorted(perm.tolist()) == list(range(50))
    ranks = coins.ranks(50)
    assert sorted(ranks.tolist()) == list(range(50))
    firsts = np.array([int(coins.permutation(4)[0]) for _ in range(8000)])
    assert stats.chisquare(np.bincount(firsts, minlength=4)).pvalue > ALPHA
