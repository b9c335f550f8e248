"""``silodp bench protocol --zipf-route``: the fixed-point weights at ``uldp_fmnist_zipf``'s
shape, one subject through every silo's hop with the code a run uses, decrypt to
``floor(2^k/n_a)`` alone, with SEAL's measured noise inside the plan's worst-case bound."""

from __future__ import annotations

import pytest

pytest.importorskip("tenseal")

from silodp.bench.zipf_route import (  # noqa: E402
    ZIPF_COLUMNS,
    ZIPF_SHAPE,
    run_zipf_route,
    subject_weight,
    zipf_plan,
)
from silodp.crypto.bfv.backend import ciphertext_primes  # noqa: E402
from silodp.crypto.bfv.params import fixed_point_bits, fixed_weight_noise  # noqa: E402

SMALL = {"silos": 4, "subjects": 5, "pairs": 6, "dim": 100, "n_max": 40}


@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 0, 0], [40, 0, 0, 0], [1, 1, 1, 1]])
def test_one_subjects_weight_through_the_chain(counts: list[int]) -> None:
    plan = zipf_plan(SMALL)
    row = subject_weight(plan, counts)
    assert row["weight_ok"] == "yes"
    assert 0 < row["noise_bits"] <= plan.weight_noise_bound.bit_length()
    # before the switch: the chain, F and the trace, against their own worst case
    bound = fixed_weight_noise(
        16384,
        plan.plain_moduli[0],
        num_silos=4,
        n_max=40,
        ciphertext_primes=ciphertext_primes(16384, plan.params.coeff_bits),
    )
    assert 20 < row["trace_noise_bits"] <= bound.bit_length()


def test_counts_above_n_max_are_refused() -> None:
    with pytest.raises(ValueError, match=r"sum\(counts\)=41 <= n_max=40"):
        subject_weight(zipf_plan(SMALL), [40, 1, 0, 0])


def test_zipf_route_row_at_the_zipf_shape() -> None:
    (row,) = run_zipf_route()
    assert list(row) == ZIPF_COLUMNS
    assert row["weight_ok"] == "yes"
    assert row["noise_bits"] <= row["noise_bound_bits"]
    assert row["trace_noise_bits"] <= row["trace_noise_bound_bits"]
    assert row["poly_degree"] == 16384 and row["level_drop"] > 0
    k = fixed_point_bits(
        ZIPF_SHAPE["subjects"], ZIPF_SHAPE["n_max"], delta_bound=1.0, precision=1e-10
    )
    assert row["k"] == k
    assert row["weights_cpu_min"] > row["round_cpu_min"] > 0  # the weights dominate, once
