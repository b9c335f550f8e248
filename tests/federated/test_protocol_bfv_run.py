"""`uldp_avg_w` through the BFV weighting protocol (``scheme = "bfv"``): a federated run trains
the same model as weights computed in the clear; a round equals the clear weighted sum over
the sample, whoever draws it; the scheme is validated with the config; the engines whose silos
run apart refuse it before any message.

Without noise (σ = 0) and with seeded coins, as in test_protocol_cnn_run.py: with σ > 0 the two
runs would differ by independent noise drawn on different grids."""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

from silodp.algorithms import SiloData
from silodp.algorithms.uldp_common import RoundWeights, UldpAvgWConfig, record_weights
from silodp.algorithms.uldp_protocol import ProtocolRound, UldpAvgW
from silodp.config import parse_config
from silodp.crypto.errors import SiloDropoutError, StageError
from silodp.data import FederatedDataset
from silodp.data.build import build_federated_data
from silodp.errors import InvalidValueError
from silodp.experiment import run_experiment
from silodp.models import MLP, build_model
from silodp.privacy.randomness import Coins

pytest.importorskip("tenseal")

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "uldp_digits_uniform.toml"


def _raw(weighting: str, scheme: str = "paillier", **algorithm: object) -> dict:
    raw = tomllib.loads(CONFIG.read_text())
    raw["algorithms"] = ["uldp_avg_w"]
    raw["algorithm"] = {
        "uldp_avg_w": {"weighting": weighting, "scheme": scheme, "n_max": 64, **algorithm}
    }
    raw["data"].update(num_silos=3, num_subjects=6, max_records=120)
    raw["training"].update(rounds=2, local_epochs=1, batch_size=64)
    raw["privacy"].pop("epsilon", None)
    raw["privacy"].update(noise_multiplier=0.0, noise="seeded")
    return raw


def _model(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "uldp_avg_w" / "model.pt")


@pytest.mark.slow
@pytest.mark.parametrize("encoding", ["exact", "fixed_point"])
def test_digits_mlp_trains_through_bfv_as_with_clear_weights(tmp_path: Path, encoding: str) -> None:
    """Every subject each round (q = 1): with q < 1 the clear run's silos draw their sample
    from another key than the protocol's seed; sampled rounds are compared below."""
    lines: list[str] = []
    config = parse_config(_raw("protocol", "bfv", weight_encoding=encoding))
    (bfv,) = run_experiment(config, tmp_path / "bfv", log=lines.append)["runs"]
    (clear,) = run_experiment(parse_config(_raw("clear")), tmp_path / "clear")["runs"]
    assert bfv["weights_private"] is True and clear["weights_private"] is False
    assert any("under BFV encryption" in n for n in bfv["notes"]), bfv["notes"]
    assert not any("weights not private" in n for n in bfv["notes"])
    estimates = [line for line in lines if "private weighting protocol, " in line]
    assert len(estimates) == 1, lines
    assert "BFV, " in estimates[0] and "Paillier" not in estimates[0]
    once = [line for line in lines if "fixed-point weights once" in line]
    assert len(once) == (encoding == "fixed_point"), lines
    assert bfv["epsilon"] == clear["epsilon"]
    a, b = _model(tmp_path / "bfv"), _model(tmp_path / "clear")
    assert a.keys() == b.keys()
    moved = max(float((a[k] - b[k]).abs().max()) for k in a)
    # fixed point: (subjects + silos) * 1e-10 / 2 per coordinate and round
    assert moved < 1e-6
    # and the rounds did move the model: not two untouched copies
    train = build_federated_data(config.data).train
    init = build_model("mlp", train.feature_shape, train.num_classes, seed=0)
    start = {k: v.detach() for k, v in init.named_parameters()}
    assert max(float((a[k] - start[k]).abs().max()) for k in a) > 1e4 * moved


# --- one round, algorithm level (a 75-parameter MLP) -------------------------------------

_MODEL = MLP(5, 3, hidden=8).double()


def _params(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        k: torch.randn(v.shape, generator=gen, dtype=torch.float64) * 0.5
        for k, v in _MODEL.named_parameters()
    }


def _federation(n: int, silos: int, subjects: int, seed: int) -> FederatedDataset:
    rng = np.random.default_rng(seed)
    silo = np.concatenate([np.arange(silos), rng.integers(0, silos, n - silos)])
    return FederatedDataset(
        x=rng.normal(size=(n, 5)),
        y=rng.integers(0, 3, n),
        silo=silo,
        subject=rng.integers(0, subjects, n),
        num_classes=3,
    )


def _silos(train: FederatedDataset) -> list[SiloData]:
    out = []
    for s in range(train.num_silos):
        idx = train.silo_indices(s)
        out.append(
            SiloData(
                s,
                torch.from_numpy(np.ascontiguousarray(train.x[idx])).double(),
                torch.from_numpy(train.y[idx]),
                torch.from_numpy(train.subject[idx]),
            )
        )
    return out


def _bfv(cfg: dict, train: FederatedDataset, seed: int) -> UldpAvgW:
    algo = UldpAvgW.for_data({**cfg, "scheme": "bfv"}, train, coins=Coins.seeded(seed))
    assert isinstance(algo, UldpAvgW)
    return algo


@pytest.mark.parametrize(
    ("sampler", "encoding"), [("server", "exact"), ("silos", "exact"), ("silos", "fixed_point")]
)
def test_bfv_round_equals_the_clear_weighted_sum_over_the_sample(
    sampler: str, encoding: str
) -> None:
    train = _federation(n=40, silos=2, subjects=6, seed=4)
    cfg = dict(
        noise_multiplier=0.0,
        clip=1.0,
        subject_rate=0.5,
        n_max=40,
        subject_sampler=sampler,
        weight_encoding=encoding,
    )
    algo = _bfv(cfg, train, seed=1)
    params = _params(1)
    algo.initial_state(params)  # the simulator's first call: the model's size sets up BFV
    instr = algo.configure_round(1, Coins.seeded(7))
    assert isinstance(instr, ProtocolRound)
    assert all(len(row) == 6 for row in instr.message.weights)  # every subject, per prime
    if sampler == "server":
        sampled = Coins.seeded(7).bernoulli(6, 0.5)
    else:  # every silo derives the same sample from the protocol's shared seed
        samples = {algo.protocol.silos[s].subject_sample(1, 0.5) for s in (0, 1)}
        assert len(samples) == 1
        sampled = algo.silo_sample(1)
        assert {int(a) for a in torch.nonzero(sampled).flatten()} == samples.pop()
    assert 0 < int(sampled.sum()) < 6
    silos = _silos(train)
    updates = [algo.local_update(_MODEL, params, s, Coins.seeded(s.silo), instr) for s in silos]
    new = algo.aggregate(params, updates)
    weights = record_weights(train.histogram()) * sampled.numpy()
    clear = UldpAvgW(
        {**cfg, "weighting": "clear", "subject_sampler": "server", "weight_encoding": "exact"},
        weights=record_weights(train.histogram()),
    )
    round_weights = RoundWeights(torch.from_numpy(weights), sampled, 1)
    ref = clear.aggregate(
        params,
        [clear.local_update(_MODEL, params, s, Coins.seeded(s.silo), round_weights) for s in silos],
    )
    for k in params:
        torch.testing.assert_close(new[k], ref[k], rtol=0, atol=1e-8)
    assert any(not torch.equal(new[k], params[k]) for k in params)
    if encoding == "fixed_point":
        assert algo.protocol.session().plan.weights == "fixed_point"
    # the comparison can fail: every subject's weight instead of the sample's moves the sum
    everyone = clear.aggregate(
        params,
        [
            clear.local_update(
                _MODEL, params, s, Coins.seeded(s.silo), RoundWeights(clear.weights, None, 1)
            )
            for s in silos
        ],
    )
    assert any(float((new[k] - everyone[k]).abs().max()) > 1e-4 for k in params)


def test_bfv_round_needs_the_model_size_and_every_silo() -> None:
    train = _federation(n=30, silos=3, subjects=5, seed=3)
    algo = _bfv(dict(noise_multiplier=1.0, n_max=30), train, seed=2)
    with pytest.raises(StageError, match="parameter count"):
        algo.configure_round(1, Coins.seeded(1))
    params = _params(2)
    algo.initial_state(params)
    instr = algo.configure_round(1, Coins.seeded(1))
    silos = _silos(train)
    updates = [algo.local_update(_MODEL, params, s, Coins.seeded(s.silo), instr) for s in silos]
    with pytest.raises(SiloDropoutError):
        algo.aggregate(params, updates[:2])


def test_bfv_run_notes_name_the_scheme() -> None:
    train = _federation(n=30, silos=3, subjects=5, seed=3)
    notes = _bfv(dict(n_max=30), train, seed=0).run_notes()
    assert any("under BFV encryption" in n for n in notes), notes
    assert not any("Paillier" in n for n in notes)


# --- the option ---------------------------------------------------------------------------


def test_scheme_defaults_to_paillier_and_accepts_bfv() -> None:
    assert UldpAvgWConfig().scheme == "paillier"
    assert UldpAvgWConfig(scheme="bfv").scheme == "bfv"


def test_scheme_refuses_an_unknown_value_naming_it() -> None:
    with pytest.raises(InvalidValueError, match=r"privacy\.scheme='rsa'.*'paillier', 'bfv'"):
        UldpAvgWConfig(scheme="rsa")
    raw = _raw("protocol", "ckks")
    with pytest.raises(ValueError, match="ckks"):
        parse_config(raw)


def test_fixed_point_weights_are_validated_with_the_config() -> None:
    UldpAvgWConfig(scheme="bfv", weight_encoding="fixed_point", n_max=16383)
    with pytest.raises(InvalidValueError, match=r"weight_encoding='fixed_point' only with"):
        UldpAvgWConfig(weight_encoding="fixed_point")  # Paillier
    with pytest.raises(InvalidValueError, match=r"n_max=16384 < 16384"):
        UldpAvgWConfig(scheme="bfv", weight_encoding="fixed_point", n_max=16384)
    with pytest.raises(InvalidValueError, match=r"subject_sampler\)?='silos'"):
        UldpAvgWConfig(
            scheme="bfv", weight_encoding="fixed_point", subject_rate=0.5, subject_sampler="server"
        )
    with pytest.raises(InvalidValueError, match=r"weight_encoding='float'.*'exact', 'fixed_point'"):
        UldpAvgWConfig(scheme="bfv", weight_encoding="float")
    raw = _raw("protocol", "bfv", weight_encoding="fixed_point", n_max=20000)
    with pytest.raises(ValueError, match="n_max=20000"):
        parse_config(raw)


def test_fixed_point_run_notes_say_what_the_weights_are() -> None:
    train = _federation(n=30, silos=3, subjects=5, seed=3)
    notes = _bfv(dict(n_max=30, weight_encoding="fixed_point"), train, seed=0).run_notes()
    assert any("fixed-point weights floor(2^k/n_a)/2^k" in n for n in notes), notes
    assert not any("blinded histograms" in n for n in notes)
    assert not any("weights n_{s,a}/n_a, per-subject" in n for n in notes)


def test_bfv_scheme_needs_the_protocol() -> None:
    with pytest.raises(InvalidValueError, match=r"scheme='bfv' only with privacy\.weighting"):
        UldpAvgWConfig(scheme="bfv", weighting="clear")
    UldpAvgWConfig(scheme="paillier", weighting="clear")  # the default stays valid


def test_flower_engines_refuse_bfv_before_any_message() -> None:
    from silodp.engines.factory import check_engine_config, remote_engine_factory

    with pytest.raises(InvalidValueError, match="in-process simulator only"):
        check_engine_config(parse_config(_raw("protocol", "bfv")))
    check_engine_config(parse_config(_raw("protocol")))  # Paillier runs on Flower

    class _Run:
        name = "uldp_avg_w"
        algorithm = UldpAvgW(UldpAvgWConfig(scheme="bfv"))

    make = remote_engine_factory(transport=None)  # type: ignore[arg-type]
    with pytest.raises(InvalidValueError, match="BFV weighting protocol"):
        make(_Run(), None)


def test_bfv_sum_with_a_delta_zero_on_a_whole_block() -> None:
    """A subject's delta can be zero on a whole block of 8192 parameters (a layer that did not
    move); its product is skipped, and the sum still equals the clear one."""
    from silodp.crypto.bfv import BfvWeightingSession
    from silodp.crypto.protocol import plaintext_weighted_sum

    dim = 8192 + 50
    hist = {0: {"a": 2, "b": 1}, 1: {"a": 1}}
    rng = np.random.default_rng(5)
    deltas = {s: {a: rng.uniform(-1, 1, dim) / np.sqrt(dim) for a in h} for s, h in hist.items()}
    deltas[0]["a"][:8192] = 0.0  # the first block of one pair
    deltas[1]["a"][:] = 0.0  # every block of another
    session = BfvWeightingSession(hist, n_max=4, dim=dim, noise_bound=10.0)
    got = session.run_round(deltas)
    want = plaintext_weighted_sum(deltas, hist)
    assert float(np.abs(got - want).max()) < 1e-8
    assert float(np.abs(want).max()) > 1e-4
