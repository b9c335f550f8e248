"""The fixed-point weight route for large ``n_max`` (``silodp bench protocol --zipf-route``):
the encrypted product of the silos' monomials, times the public weight polynomial and traced,
decrypts to ``floor(2^k/n_a) mod t`` as a constant polynomial."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("tenseal")

from silodp.bench.zipf_route import (  # noqa: E402
    ZIPF_COLUMNS,
    ZIPF_SHAPE,
    fixed_point_weight,
    run_zipf_route,
    weight_bits,
)
from silodp.crypto.bfv.params import batching_primes  # noqa: E402
from silodp.crypto.encoding import WeightingEncoding  # noqa: E402

SMALL = dict(poly_degree=8192, coeff_bits=(60, 60, 60, 38), plain_bits=20)


@pytest.mark.parametrize("product", ["chain", "tree"])
@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 0, 0], [40, 0, 0, 0], [1, 1, 1]])
def test_weight_decrypts_to_the_fixed_point_inverse_as_a_constant(counts, product) -> None:
    k = 30
    row = fixed_point_weight(counts, n_max=40, k=k, product=product, **SMALL)
    t = batching_primes(8192, 20, 1)[0]
    n_a = sum(counts)
    expected = (2**k // n_a) % t if n_a else 0
    coefficients = row["coefficients"]
    assert int(coefficients[0]) == expected
    assert not coefficients[1:].any()
    assert row["weight_ok"] == "yes"
    assert row["budget_weight"] > 0


def test_counts_above_n_max_are_refused() -> None:
    with pytest.raises(ValueError, match=r"sum\(counts\)=41 <= n_max=40"):
        fixed_point_weight([40, 1], n_max=40, k=30, **SMALL)


def test_unknown_product_is_refused() -> None:
    with pytest.raises(ValueError, match=r"product in \['chain', 'tree'\], got 'ring'"):
        fixed_point_weight([1, 2], n_max=40, k=30, product="ring", **SMALL)


def test_zipf_route_rows_at_the_zipf_shape() -> None:
    chain, tree = run_zipf_route()
    assert list(chain) == ZIPF_COLUMNS and (chain["product"], tree["product"]) == ("chain", "tree")
    assert chain["weight_ok"] == tree["weight_ok"] == "yes"
    assert tree["depth"] == math.ceil(math.log2(ZIPF_SHAPE["silos"])) and chain["depth"] == 0
    # monomial products and fresh encryptions of 0 leave the fresh budget nearly whole
    assert chain["budget_product"] >= chain["budget_fresh"] - 10
    assert tree["budget_product"] < tree["budget_fresh"] - 100
    for row in (chain, tree):
        assert row["budget_after_silo"] >= row["budget_needed"]
    row = tree
    k = weight_bits(ZIPF_SHAPE["subjects"], ZIPF_SHAPE["n_max"], delta_bound=1.0, precision=1e-10)
    assert row["k"] == k and 2.0**-k * ZIPF_SHAPE["subjects"] * ZIPF_SHAPE["n_max"] <= 1e-10
    # the CRT primes hold twice the aggregate (2^k in place of L) and the tamper margin
    unit = WeightingEncoding(
        modulus=1 << 30000,
        n_max=1,
        num_subjects=ZIPF_SHAPE["subjects"],
        num_silos=ZIPF_SHAPE["silos"],
        noise_bound=1e3,
        packing=False,
    )
    need = ((2 * unit.aggregate_bound) << k << 32).bit_length()
    for row, bits in ((tree, 20), (chain, 32)):
        assert row["moduli"] * (bits - 1) >= need > (row["moduli"] - 1) * (bits - 1)
