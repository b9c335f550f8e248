"""The batched mixture-of-Gaussians PLD builder is dp-accounting's builder, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from silodp.accounting import PrivacyPlan
from silodp.accounting.events import subject_mixture_steps
from silodp.accounting.mixture import mixture_gaussian_pld
from silodp.accounting.pld import event_pld
from silodp.algorithms import make_algorithm
from silodp.algorithms.planning import account_plan

EPSILONS = np.linspace(-3.0, 15.0, 400)


@pytest.mark.parametrize(
    ("sigma", "sensitivities", "probs"),
    [
        (1.5, [0.0, 1.0, 2.0, 3.0], [0.857375, 0.135375, 0.007125, 0.000125]),  # k=3, q=0.05
        (2.0, [1.0, 2.0], [0.5, 0.5]),  # no zero sensitivity: the loss spans all reals
    ],
)
def test_batched_builder_equals_dp_accounting(sigma, sensitivities, probs) -> None:
    """Same δ(ε) everywhere, exactly (the same bisection, midpoints and float operations)."""
    d = 1e-2  # coarse, so the library's own (slow) builder stays well under a second
    library = pld_lib.from_mixture_gaussian_mechanism(
        sigma, sensitivities, probs, value_discretization_interval=d
    )
    batched = mixture_gaussian_pld(sigma, sensitivities, probs, value_discretization_interval=d)
    np.testing.assert_array_equal(
        batched.get_delta_for_epsilon(EPSILONS), library.get_delta_for_epsilon(EPSILONS)
    )
    assert batched.get_epsilon_for_delta(1e-5) == library.get_epsilon_for_delta(1e-5)


def test_event_pld_builds_the_mixture_with_the_batched_builder() -> None:
    event = subject_mixture_steps(0.05, 1.5, 3, 1).event
    d = 1e-2
    library = pld_lib.from_mixture_gaussian_mechanism(
        1.5,
        list(event.sensitivities),
        list(event.sampling_probs),
        value_discretization_interval=d,
    )
    np.testing.assert_array_equal(
        event_pld(event, d).get_delta_for_epsilon(EPSILONS),
        library.get_delta_for_epsilon(EPSILONS),
    )


def test_subject_epsilon_of_a_plan_is_unchanged() -> None:
    """The subject ε of a small ``local_item_dp`` plan (k = 3) as computed with dp-accounting's
    ``from_mixture_gaussian_mechanism`` before the batched builder (13.6 s then, ~1 s now).
    The builder is bit-identical, so the tolerance only allows for another platform's
    floating-point (FFT) rounding: 1e-9 relative."""
    plan = PrivacyPlan(sampling_rates=(0.05, 0.05), rounds=2, silos_per_round=2, span=2, delta=1e-5)
    algo = make_algorithm(
        "local_item_dp",
        {"noise_multiplier": 1.0, "local_steps": 20, "group_size": 3, "num_silos": 2},
    )
    est = account_plan(algo, plan)[-1]["subject"]
    assert est.route == "pld-mixture"
    assert est.epsilon == pytest.approx(11.169847901397386, rel=1e-9)
