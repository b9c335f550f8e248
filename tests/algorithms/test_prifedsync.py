"""PriFedSync's steps: client sampling, helper models, noise scale, batches, empty rounds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from silodp.accounting.fdp import FdpAccountant, PriFedSyncPlan, account_prifedsync
from silodp.algorithms import SiloData, SiloUpdate, make_algorithm
from silodp.algorithms import prifedsync as pfs
from silodp.algorithms.base import uniform_batch
from silodp.algorithms.prifedsync import PriFedSync, noisy_gradient
from silodp.data import FederatedDataset, TestSplit
from silodp.federated import Simulator
from silodp.models import build_model
from silodp.privacy.randomness import Coins


def _with(settings: dict, **values: object) -> dict:
    """``settings`` with some hyperparameters changed."""
    return {**settings, **values}


ALPHA = 1e-4
CONFIG = dict(local_steps=3, batch_size=5, lr=0.05, clip=0.7, noise_multiplier=1.3, client_rate=0.3)


def _silo(n: int = 20, seed: int = 0) -> SiloData:
    gen = torch.Generator().manual_seed(seed)
    return SiloData(
        silo=0,
        x=torch.randn(n, 4, generator=gen),
        y=torch.randint(0, 3, (n,), generator=gen),
        subject=torch.arange(n),
    )


def _model():
    model = build_model("mlp", (4,), 3, seed=0)
    return model, {k: v.detach().clone() for k, v in model.named_parameters()}


def _sampling_pvalue(p_true: float, p_claimed: float, *, rounds: int = 2000) -> float:
    algo = PriFedSync(_with(CONFIG, client_rate=p_true))
    coins = Coins.seeded(0)
    clients = 10
    hits = sum(len(algo.sample_clients(clients, coins)) for _ in range(rounds))
    return float(stats.binomtest(hits, rounds * clients, p_claimed).pvalue)


@pytest.mark.parametrize("p", [0.25, 0.5, 1.0])
def test_client_sampling_frequency_matches_p(p: float) -> None:
    assert _sampling_pvalue(p, p) > ALPHA


def test_client_sampling_test_rejects_a_wrong_p() -> None:
    assert _sampling_pvalue(0.5, 0.45) < ALPHA
    assert _sampling_pvalue(0.25, 0.3) < ALPHA


def test_client_sampling_is_independent_per_client() -> None:
    algo = PriFedSync(_with(CONFIG, client_rate=0.5))
    coins = Coins.seeded(1)
    sizes = [len(algo.sample_clients(4, coins)) for _ in range(4000)]
    counts = np.bincount(sizes, minlength=5)
    expected = stats.binom.pmf(range(5), 4, 0.5) * len(sizes)
    assert stats.chisquare(counts, expected).pvalue > ALPHA
    assert counts[0] > 0  # empty samples happen and are kept (no re-draw)


def test_helper_interpolation_is_exact() -> None:
    local = {"w": torch.tensor([1.0, -2.0, 4.0]), "b": torch.tensor([0.5])}
    glob = {"w": torch.tensor([3.0, 2.0, 0.0]), "b": torch.tensor([-1.5])}
    algo = PriFedSync(_with(CONFIG, helper="interpolate", alpha=(0.1, 0.75)))
    for client, a in ((0, 0.1), (1, 0.75)):
        h = algo.helper(client, local, glob)
        for k in local:
            assert torch.equal(h[k], (1 - a) * local[k] + a * glob[k])
    same = PriFedSync(_with(CONFIG, helper="identity")).helper(0, local, glob)
    assert all(torch.equal(same[k], glob[k]) for k in glob)
    with pytest.raises(ValueError, match="one alpha per client"):
        algo.helper(2, local, glob)


def test_server_update_is_eta_interpolation_of_the_mean() -> None:
    glob = {"w": torch.tensor([1.0, 1.0])}
    ups = [
        SiloUpdate(0, {"w": torch.tensor([3.0, 0.0])}, 1, None),
        SiloUpdate(1, {"w": torch.tensor([5.0, 2.0])}, 1, None),
    ]
    out = PriFedSync(_with(CONFIG, server_lr=0.5)).aggregate(glob, ups)
    assert torch.allclose(out["w"], 0.5 * glob["w"] + 0.5 * torch.tensor([4.0, 1.0]))
    assert torch.equal(PriFedSync(CONFIG).aggregate(glob, [])["w"], glob["w"])


def _noise_pvalue(claimed_std: float) -> float:
    """Chi-square test that (noisy - clean gradient) * B has standard deviation claimed_std."""
    model, params = _model()
    silo = _silo()
    idx = torch.arange(5)
    clean = noisy_gradient(
        model,
        params,
        silo,
        idx,
        config=PriFedSync.configure(_with(CONFIG, noise_multiplier=0.0)),
        coins=Coins.seeded(0),
    )
    coins = Coins.seeded(3)
    samples = []
    for _ in range(20):
        noisy = noisy_gradient(
            model, params, silo, idx, config=PriFedSync.configure(CONFIG), coins=coins
        )
        samples += [((noisy[k] - clean[k]) * 5).flatten() for k in params]
    z = torch.cat(samples).double().numpy()
    stat = float(np.sum(z**2) / claimed_std**2)
    cdf = stats.chi2.cdf(stat, df=len(z))
    return float(2 * min(cdf, 1 - cdf))


def test_noise_std_is_two_c_sigma() -> None:
    right = 2 * CONFIG["clip"] * CONFIG["noise_multiplier"]
    assert _noise_pvalue(right) > ALPHA
    assert _noise_pvalue(CONFIG["clip"] * CONFIG["noise_multiplier"]) < ALPHA  # add/remove scale
    assert _noise_pvalue(0.9 * right) < ALPHA
    assert _noise_pvalue(1.1 * right) < ALPHA


def test_local_batches_are_fixed_size_uniform(monkeypatch: pytest.MonkeyPatch) -> None:
    drawn: list[torch.Tensor] = []

    def spy(n: int, size: int, coins: Coins) -> torch.Tensor:
        idx = uniform_batch(n, size, coins)
        drawn.append(idx)
        return idx

    monkeypatch.setattr(pfs, "uniform_batch", spy)
    model, params = _model()
    algo = PriFedSync(_with(CONFIG, local_steps=200))
    update = algo.local_train(model, _silo(), algo.initial_state(params), Coins.seeded(2))
    assert len(drawn) == 200
    assert all(len(i) == 5 and len(set(i.tolist())) == 5 for i in drawn)  # no replacement
    assert update.subjects_per_batch == [5] * 200
    counts = np.bincount(torch.cat(drawn).numpy(), minlength=20)
    assert stats.chisquare(counts).pvalue > ALPHA  # every record equally likely
    assert algo.batch_sampling == "uniform"


def test_poisson_batches_are_refused_for_training() -> None:
    """Poisson batches are accounting-only: training with them would release what the
    fixed-size accounting does not describe, so local_train refuses before any step."""
    from silodp.errors import InvalidValueError

    model, params = _model()
    algo = PriFedSync(_with(CONFIG, batch_sampling="poisson"))
    state = algo.initial_state(params)
    before = {k: v.clone() for k, v in state.personal.items()}
    with pytest.raises(InvalidValueError, match="batch_sampling='uniform'"):
        algo.local_train(model, _silo(), state, Coins.seeded(2))
    assert all(torch.equal(before[k], state.personal[k]) for k in before)


def test_uniform_batch_test_rejects_a_biased_sampler() -> None:
    gen = torch.Generator().manual_seed(0)
    biased = [torch.randperm(19, generator=gen)[:5] for _ in range(200)]  # never record 19
    counts = np.bincount(torch.cat(biased).numpy(), minlength=20)
    assert stats.chisquare(counts).pvalue < ALPHA


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_optimizer_state_persists_in_client_state(optimizer: str) -> None:
    model, params = _model()
    algo = PriFedSync(_with(CONFIG, optimizer=optimizer))
    state = algo.initial_state(params)
    algo.local_train(model, _silo(), state, Coins.seeded(0))
    assert state.steps == CONFIG["local_steps"]
    assert bool(state.moments) == (optimizer != "sgd")
    update = make_algorithm("prifedsync", _with(CONFIG, optimizer=optimizer)).local_update(
        model, params, _silo(), Coins.seeded(0)
    )
    assert update.privacy is not None and set(update.privacy.events) == {"record"}


def _federation(clients: int = 3, per: int = 12) -> tuple[FederatedDataset, TestSplit]:
    rng = np.random.default_rng(0)
    n = clients * per
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = rng.integers(0, 3, size=n)
    silo = np.repeat(np.arange(clients), per)
    train = FederatedDataset(x=x, y=y, silo=silo, subject=np.arange(n), num_classes=3)
    test = TestSplit(x=x, y=y, silo=silo)
    return train, test


def test_empty_round_leaves_the_global_model_unchanged_and_counts() -> None:
    train, test = _federation()
    config = _with(CONFIG, client_rate=0.2)
    plan = PriFedSyncPlan(
        noise_multiplier=config["noise_multiplier"],
        sample_rates=(5 / 12,) * 3,
        local_steps=config["local_steps"],
        rounds=8,
        client_rate=0.2,
    )
    reports = account_prifedsync(plan, per_round=True)
    model, _ = _model()
    sim = Simulator(
        algorithm=PriFedSync(config),
        model=model,
        train=train,
        test=test,
        accountant=FdpAccountant(clients=3, client_rate=plan.client_rate, delta=plan.delta),
        seed=0,
        noise="seeded",  # a fixed sample with empty rounds in it
    )
    empty = 0
    for r in range(1, 9):
        before = {k: v.clone() for k, v in sim.params.items()}
        personal = [{k: v.clone() for k, v in p.items()} for p in sim.personal_params]
        result = sim.run_round(r)
        assert (
            result.mu == {}
            and result.mu_estimates == reports[r - 1].mu
            and result.epsilon == reports[r - 1].epsilon
        )
        if not result.silos:
            empty += 1
            assert all(torch.equal(before[k], sim.params[k]) for k in before)
            for old, new in zip(personal, sim.personal_params, strict=True):
                assert all(torch.equal(old[k], new[k]) for k in old)
    assert empty > 0  # p = 0.2 over 3 clients: about half the rounds are empty
    eps = [r.epsilon["record"] for r in reports]
    assert all(b > a for a, b in zip(eps, eps[1:], strict=False))  # every round counts
