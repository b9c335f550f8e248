"""The array-based ε(δ) reader gives dp-accounting's own ε(δ) on every kind of PLD silodp
builds, and is faster on long compositions."""

from __future__ import annotations

import math
from functools import cache

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from silodp.accounting.events import KnownSampleDpEvent
from silodp.accounting.hockey import EpsilonForDelta, epsilon_for_delta
from silodp.accounting.pld import event_pld

DELTAS = (0.999, 0.5, 0.1, 1e-5, 1e-12, 1e-30, 1e-300)


@cache
def _plds() -> dict[str, pld_lib.PrivacyLossDistribution]:
    gauss = dp_event.GaussianDpEvent(1.0)
    return {
        "sampled gaussian x1000": pld_lib.from_gaussian_mechanism(
            1.0, sampling_prob=0.01, value_discretization_interval=1e-3
        ).self_compose(1000),
        "gaussian": pld_lib.from_gaussian_mechanism(0.5, value_discretization_interval=1e-3),
        "tiny sigma (infinite mass)": pld_lib.from_gaussian_mechanism(
            0.05, value_discretization_interval=1e-3
        ),
        "coarse, composed": pld_lib.from_gaussian_mechanism(
            3.0, sampling_prob=0.3, value_discretization_interval=1e-2
        ).self_compose(10),
        "mixture (subject of DP-SGD) x50": event_pld(
            dp_event.MixtureOfGaussiansDpEvent(1.0, (0, 1, 2), (0.5, 0.3, 0.2)), 1e-3
        ).self_compose(50),
        "known sample": event_pld(KnownSampleDpEvent(0.2, gauss), 1e-3),
        "identity": pld_lib.identity(1e-3),
        "laplace (asymmetric)": pld_lib.from_laplace_mechanism(
            1.0, value_discretization_interval=1e-3
        ),
        "randomized response (sparse)": pld_lib.from_randomized_response(
            0.1, 4, value_discretization_interval=1e-3
        ),
    }


@pytest.mark.parametrize("name", sorted(_plds()))
def test_same_epsilon_as_dp_accounting(name: str) -> None:
    pld = _plds()[name]
    reader = EpsilonForDelta(pld)
    for delta in DELTAS:
        expected = pld.get_epsilon_for_delta(delta)
        assert reader(delta) == pytest.approx(expected, rel=1e-12, abs=1e-15), (name, delta)
        assert epsilon_for_delta(pld, delta) == reader(delta)


def test_infinite_where_the_library_is() -> None:
    pld = _plds()["tiny sigma (infinite mass)"]
    assert math.isinf(pld.get_epsilon_for_delta(1e-30))
    assert math.isinf(epsilon_for_delta(pld, 1e-30))
    assert math.isfinite(epsilon_for_delta(pld, 0.5))


def test_a_wrong_delta_gives_a_different_epsilon() -> None:
    """The comparison above can fail: ε at a neighbouring δ is not the library's ε at δ."""
    pld = _plds()["sampled gaussian x1000"]
    assert epsilon_for_delta(pld, 2e-5) != pytest.approx(pld.get_epsilon_for_delta(1e-5), rel=1e-6)


# --- plans too long for a PLD -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("sigma", "q", "count"),
    [
        (1.0, 0.01, 10**4),
        (0.3, 1.0, 10**3),
        (1.0, 1.0, 10**4),
        (5.0, 0.5, 10**4),
        (0.7, 0.05, 10**4),
    ],
)
def test_predicted_width_covers_the_composed_pld(sigma: float, q: float, count: int) -> None:
    """The size guard predicts no fewer grid points than dp-accounting's composition has."""
    from silodp.accounting import pld as pld_module

    event = dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma)), count
    )
    composed = event_pld(event, 1e-3)
    points = max(
        len(pmf.to_dense_pmf()._probs)  # noqa: SLF001
        for pmf in (composed._pmf_remove, composed._pmf_add)  # noqa: SLF001
    )
    predicted = pld_module._WIDTH_IN_STD * math.sqrt(pld_module.loss_variance(event)) / 1e-3
    assert points <= predicted
    # and the variance is additive: the composed PLD's own variance is the predicted one
    assert pld_module.pld_loss_moments(composed)[1] == pytest.approx(
        pld_module.loss_variance(event), rel=0.05
    )


def test_a_plan_beyond_the_pld_limit_is_bounded_by_rdp(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_PLD_POINTS the accountant drops the PLD route; what it reports is then the RDP
    bound, never below the PLD ε of the same plan."""
    from silodp.accounting import pld as pld_module
    from silodp.accounting.accountant import FederatedAccountant, SiloPrivacy
    from silodp.accounting.events import poisson_gaussian_steps, subject_mixture_steps

    def run() -> dict[str, object]:
        acc = FederatedAccountant(units=("record", "subject"), span=2, delta=1e-5)
        silo = SiloPrivacy(
            events={
                "record": poisson_gaussian_steps(0.05, 1.0, 50),
                "subject": subject_mixture_steps(0.05, 1.0, 2, 50),
            },
            record_event=poisson_gaussian_steps(0.05, 1.0, 50),
            group_size=2,
        )
        for _ in range(3):
            acc.compose_round([silo, silo])
        return acc.estimates()

    full = run()
    assert full["record"].route == "pld" and full["subject"].route == "pld-mixture"
    monkeypatch.setattr(pld_module, "MAX_PLD_POINTS", 1000)
    capped = run()
    assert set(capped["record"].routes) == {"rdp"}
    assert "pld-mixture" not in capped["subject"].routes
    assert "dp-group" not in capped["subject"].routes
    for unit in ("record", "subject"):
        assert capped[unit].epsilon >= full[unit].epsilon


@pytest.mark.parametrize("name", ["sampled gaussian x1000", "mixture (subject of DP-SGD) x50"])
def test_binary_search_stops_where_the_library_does(name: str) -> None:
    """Many δ, on a PLD as composed and on it split onto a 4x coarser grid: the binary search
    of the stopping point gives the library's ε every time."""
    from silodp.accounting.coarsen import coarsen_pld

    for pld in (_plds()[name], coarsen_pld(_plds()[name], 4)):
        reader = EpsilonForDelta(pld)
        for delta in [float(d) for d in np.geomspace(1e-200, 0.9, 40)]:
            assert reader(delta) == pytest.approx(
                pld.get_epsilon_for_delta(delta), rel=1e-12, abs=1e-15
            ), (name, delta)


@pytest.mark.parametrize("name", sorted(_plds()))
def test_many_deltas_at_once_equal_one_at_a_time(name: str) -> None:
    reader = EpsilonForDelta(_plds()[name])
    deltas = [float(d) for d in np.geomspace(1e-300, 0.999, 300)]
    assert reader.many(deltas) == [reader(d) for d in deltas]


def test_group_conversion_is_the_same_with_many_deltas_at_once() -> None:
    """dp-group asks for ε at a grid of δ in chunks: the answer of one δ at a time."""
    from silodp.accounting.conversions import group_epsilon_dp

    reader = EpsilonForDelta(_plds()["sampled gaussian x1000"])
    for k, m in ((2, 1), (4, 3), (16, 2)):
        together = group_epsilon_dp(reader, group_size=k, delta=1e-5, compositions=m)
        alone = group_epsilon_dp(lambda d: reader(d), group_size=k, delta=1e-5, compositions=m)
        assert together == alone
        assert math.isfinite(alone) == (k <= 4)  # 16 records: no δ_r is small enough
