"""Each algorithm's local update: shapes, events, diagnostics, coins (seeded runs repeat, secure
runs do not, no draw bypasses the coins), sampling rates."""

from __future__ import annotations

import json
import math
from dataclasses import fields

import pytest
import torch
from dp_accounting.dp_event import ComposedDpEvent, SelfComposedDpEvent
from scipy import stats

from silodp.accounting.events import (
    PoissonReplaceOneDpEvent,
    gaussian_steps,
    poisson_gaussian_steps,
    replace_one,
)
from silodp.algorithms import ALGORITHMS, SiloData, SiloUpdate, make_algorithm
from silodp.algorithms.base import average_params, batch_diagnostics, poisson_mask
from silodp.algorithms.higradavg import HiGradAvgDP, select_subject_batch
from silodp.models import build_model
from silodp.privacy.randomness import Coins


def _with(settings: dict, **values: object) -> dict:
    """``settings`` with some hyperparameters changed."""
    return {**settings, **values}


ALPHA = 1e-6
#: Algorithms whose local update is a sequence of mini-batch steps on the silo's records
#: (the ULDP per-subject family is tested in test_uldp.py).
STEP_ALGORITHMS = sorted(
    n for n in ALGORITHMS if n not in {"uldp_naive", "uldp_avg", "uldp_sgd", "uldp_avg_w"}
)


def _silo(n: int = 24, subjects: int = 6, seed: int = 0, silo: int = 2) -> SiloData:
    gen = torch.Generator().manual_seed(seed)
    return SiloData(
        silo=silo,
        x=torch.randn(n, 4, generator=gen),
        y=torch.randint(0, 3, (n,), generator=gen),
        subject=torch.arange(n) % subjects + 100,
    )


def _model_params(seed: int = 0):
    model = build_model("mlp", (4,), 3, seed=seed)
    return model, {k: v.detach().clone() for k, v in model.named_parameters()}


CONFIG = dict(local_steps=4, batch_size=8, lr=0.05, clip=0.7, noise_multiplier=1.3, group_size=4)


def _run(name: str, seed: int, config: dict = CONFIG, silo: SiloData | None = None):
    model, params = _model_params()
    algo = make_algorithm(name, config)
    return algo.local_update(model, params, silo or _silo(), Coins.seeded(seed))


@pytest.mark.parametrize("name", STEP_ALGORITHMS)
def test_local_update_contract(name) -> None:
    silo = _silo()
    model, params = _model_params()
    before = {k: v.clone() for k, v in params.items()}
    algo = make_algorithm(name, CONFIG)
    update = algo.local_update(model, params, silo, Coins.seeded(0))
    assert isinstance(update, SiloUpdate)
    assert update.silo == 2 and update.num_records == 24
    assert update.params.keys() == params.keys()
    for k in params:
        assert update.params[k].shape == params[k].shape
        assert update.params[k].dtype == params[k].dtype
        assert torch.isfinite(update.params[k]).all()
        assert not torch.equal(update.params[k], params[k])
        assert torch.equal(params[k], before[k])  # the input is not modified
    assert len(update.group_sizes) == CONFIG["local_steps"]
    assert len(update.subjects_per_batch) == CONFIG["local_steps"]
    assert all(0 <= d <= 6 for d in update.subjects_per_batch)
    assert all(g <= 24 // 6 for g in update.group_sizes)
    assert all(
        (g == 0) == (d == 0)
        for g, d in zip(update.group_sizes, update.subjects_per_batch, strict=True)
    )
    rate = algo.sampling_rate(num_records=24, num_subjects=6)
    if name == "fedavg":
        assert update.privacy is None and algo.silo_privacy(sampling_rate=rate) is None
    else:
        assert update.privacy == algo.silo_privacy(sampling_rate=rate)
        assert update.privacy == algo.silo_privacy_for(silo)
        assert set(update.privacy.events) == set(algo.units)


@pytest.mark.parametrize("name", STEP_ALGORITHMS)
def test_seeding(name) -> None:
    a, b, c = _run(name, 1), _run(name, 1), _run(name, 2)
    for k in a.params:
        assert torch.equal(a.params[k], b.params[k])
    assert a.group_sizes == b.group_sizes and a.subjects_per_batch == b.subjects_per_batch
    assert any(not torch.equal(a.params[k], c.params[k]) for k in a.params)


@pytest.mark.parametrize("name", sorted(set(STEP_ALGORITHMS) - {"fedavg"}))
def test_secure_coins_are_not_reproducible(name) -> None:
    model, params = _model_params()
    algo = make_algorithm(name, CONFIG)
    a, b = (algo.local_update(model, params, _silo(), Coins.secure()) for _ in range(2))
    assert all(not torch.equal(a.params[k], b.params[k]) for k in a.params)


#: Global torch samplers that no privacy-relevant draw may use (the coins are the only source).
TORCH_SAMPLERS = ("rand", "randn", "randperm", "randint", "bernoulli", "normal", "multinomial")


@pytest.mark.parametrize(
    ("name", "overrides"),
    [(n, {}) for n in STEP_ALGORITHMS]
    + [("higradavg_dp", {"sampling": "subject"}), ("prifedsync", {"optimizer": "adam"})],
)
def test_no_draw_bypasses_the_coins(name, overrides, monkeypatch) -> None:
    silo = _silo()
    model, params = _model_params()
    algo = make_algorithm(name, _with(CONFIG, **overrides))

    def refuse(*args, **kwargs):
        raise AssertionError("a privacy-relevant draw went through torch's samplers")

    for sampler in TORCH_SAMPLERS:
        monkeypatch.setattr(torch, sampler, refuse)
    a = algo.local_update(model, params, silo, Coins.seeded(3))
    b = algo.local_update(model, params, silo, Coins.seeded(3))
    monkeypatch.undo()
    assert all(torch.equal(a.params[k], b.params[k]) for k in a.params)


def test_events_per_algorithm() -> None:
    cfg = CONFIG
    item = make_algorithm("local_item_dp", cfg).silo_privacy(sampling_rate=0.25)
    record = poisson_gaussian_steps(0.25, 1.3, 4)
    # the group cap (assumed by default) lets an added record push out another: replace-one
    assert item.events["record"] == replace_one(record)
    assert item.events["record"].event == PoissonReplaceOneDpEvent(0.25, 1.3)
    # the group conversion starts from the add/remove record event
    assert item.record_event == record and item.group_size == 4
    subject = item.events["subject"]
    assert subject.event.sensitivities == (0.0, 1.0, 2.0, 3.0, 4.0)
    assert make_algorithm("local_group_dp", cfg).silo_privacy(sampling_rate=0.25) == item
    uncapped = make_algorithm("local_item_dp", _with(cfg, group_capped=False))
    assert uncapped.silo_privacy(sampling_rate=0.25).events["record"] == record
    spanned = make_algorithm("local_item_dp", _with(cfg, span_cap=2))
    assert spanned.silo_privacy(sampling_rate=0.25).events["record"] == ComposedDpEvent(
        (replace_one(record), subject, subject)
    )
    group = make_algorithm("uldp_group", cfg).silo_privacy(sampling_rate=0.25)
    assert group.events["record"] == ComposedDpEvent((replace_one(record), record))
    # beside a federation-wide cap a span cap is not covered (and never applied)
    assert not make_algorithm("uldp_group", cfg).uses_span()
    with pytest.raises(ValueError, match="no bound across silos"):
        make_algorithm("uldp_group", _with(cfg, span_cap=2)).silo_privacy(sampling_rate=0.25)
    # a federation-wide cap of the data: a pushed-out record may sit in another silo
    across = make_algorithm("local_item_dp", _with(cfg, cross_silo_cap=True))
    assert across.silo_privacy(sampling_rate=0.25).events["record"] == ComposedDpEvent(
        (replace_one(record), record)
    )
    # a span cap needs the per-silo group cap that bounds what a move carries
    with pytest.raises(ValueError, match="public per-silo group bound"):
        make_algorithm("local_item_dp", _with(cfg, span_cap=2, group_capped=False)).silo_privacy(
            sampling_rate=0.25
        )
    ldp = make_algorithm("user_ldp", cfg).silo_privacy(sampling_rate=0.25)
    assert ldp.events == {"silo": gaussian_steps(1.3 / 2, 4), "subject": gaussian_steps(1.3 / 2, 4)}
    for caps in ({"span_cap": 2}, {"cross_silo_cap": True}):  # each changes other silos
        ldp = make_algorithm("user_ldp", _with(cfg, num_silos=3, **caps))
        assert ldp.silo_privacy(sampling_rate=0.25).events == {
            "silo": SelfComposedDpEvent(gaussian_steps(1.3 / 2, 4), 3),
            "subject": gaussian_steps(1.3 / 2, 4),
        }
    hi = make_algorithm("higradavg_dp", cfg).silo_privacy(sampling_rate=0.25)
    assert hi.events == {"subject": poisson_gaussian_steps(1 - 0.75**4, 1.3, 4)}
    hi_sub = make_algorithm("higradavg_dp", _with(cfg, sampling="subject"))
    assert hi_sub.silo_privacy(sampling_rate=0.25).events == {
        "subject": poisson_gaussian_steps(0.25, 1.3, 4)
    }


def test_sampling_rates() -> None:
    assert make_algorithm("local_item_dp", CONFIG).sampling_rate(
        num_records=80, num_subjects=5
    ) == pytest.approx(0.1)
    assert (
        make_algorithm("local_item_dp", CONFIG).sampling_rate(num_records=5, num_subjects=5) == 1.0
    )
    hi = make_algorithm("higradavg_dp", _with(CONFIG, sampling="subject"))
    assert hi.sampling_rate(num_records=1000, num_subjects=32) == pytest.approx(0.25)
    assert hi.sampling_rate(num_records=1000, num_subjects=4) == 1.0


# --- sampling statistics --------------------------------------------------------------------


def _binom_p(successes: int, trials: int, p: float) -> float:
    return stats.binomtest(successes, trials, p).pvalue


def test_poisson_mask_rate() -> None:
    gen = Coins.seeded(0)
    n, rate, reps = 500, 0.1, 40
    picked = [poisson_mask(n, rate, gen) for _ in range(reps)]
    total = sum(int(p.numel()) for p in picked)
    assert _binom_p(total, n * reps, rate) > ALPHA
    assert _binom_p(total, n * reps, rate * 1.2) < ALPHA
    assert _binom_p(total, n * reps, rate / 1.2) < ALPHA
    for p in picked:
        assert p.unique().numel() == p.numel() and (p >= 0).all() and (p < n).all()
    assert poisson_mask(10, 1.0, gen).tolist() == list(range(10))
    assert poisson_mask(10, 0.0, gen).numel() == 0


def test_local_item_dp_batch_sizes_follow_the_rate() -> None:
    """Every subject has one record, so distinct subjects per batch = batch size ~ Bin(n, q)."""
    n, batch, steps = 60, 12, 60
    silo = _silo(n=n, subjects=n)
    update = _run("local_item_dp", 3, _with(CONFIG, local_steps=steps, batch_size=batch), silo)
    total = sum(update.subjects_per_batch)
    q = batch / n
    assert _binom_p(total, n * steps, q) > ALPHA
    assert _binom_p(total, n * steps, q * 1.25) < ALPHA
    assert max(update.group_sizes) == 1


def test_select_subject_batch_rate_and_cap() -> None:
    gen = torch.Generator().manual_seed(4)
    coins = Coins.seeded(4)
    # 300 subjects with 1..6 records, shuffled order, arbitrary ids
    counts = torch.arange(300) % 6 + 1
    ids = torch.repeat_interleave(torch.arange(300) * 7 - 50, counts)
    subjects = ids[torch.randperm(ids.numel(), generator=gen)]
    rate, per_subject, reps = 0.3, 3, 40
    chosen_total = 0
    chosen_big = 0  # subjects with 6 records: still chosen at rate q, not 1-(1-q)^6
    for _ in range(reps):
        idx = select_subject_batch(subjects, rate=rate, per_subject=per_subject, coins=coins)
        assert torch.equal(idx, torch.sort(idx).values) and idx.unique().numel() == idx.numel()
        picked = subjects[idx]
        uniq, got = torch.unique(picked, return_counts=True)
        have = torch.stack([(subjects == u).sum() for u in uniq])
        # never more than per_subject records, and all of them up to that cap
        assert torch.equal(got, torch.clamp(have, max=per_subject))
        chosen_total += uniq.numel()
        chosen_big += int((have == 6).sum())
    assert _binom_p(chosen_total, 300 * reps, rate) > ALPHA
    assert _binom_p(chosen_total, 300 * reps, rate * 1.15) < ALPHA
    assert _binom_p(chosen_total, 300 * reps, rate / 1.15) < ALPHA
    assert _binom_p(chosen_big, 50 * reps, rate) > ALPHA
    assert _binom_p(chosen_big, 50 * reps, 1 - (1 - rate) ** 6) < ALPHA


def test_select_subject_batch_picks_records_at_random() -> None:
    coins = Coins.seeded(0)
    subjects = torch.zeros(10, dtype=torch.int64)
    seen = torch.zeros(10)
    for _ in range(400):
        idx = select_subject_batch(subjects, rate=1.0, per_subject=2, coins=coins)
        assert idx.numel() == 2
        seen[idx] += 1
    # each record kept with prob 2/10: 80 of 400 expected
    assert stats.chisquare(seen.numpy()).pvalue > ALPHA


def test_higradavg_subject_sampling_caps_records_per_subject() -> None:
    silo = _silo(n=60, subjects=5)  # 12 records each
    cfg = _with(CONFIG, sampling="subject", subject_records=3, batch_size=2, local_steps=30)
    update = _run("higradavg_dp", 0, cfg, silo)
    assert max(update.group_sizes) == 3
    assert all(g in (0, 3) for g in update.group_sizes)


def test_higradavg_subject_rate() -> None:
    rec = HiGradAvgDP(_with(CONFIG, group_size=3))
    assert rec.subject_rate(0.1) == pytest.approx(1 - 0.9**3)
    sub = HiGradAvgDP(_with(CONFIG, sampling="subject"))
    assert sub.subject_rate(0.1) == 0.1


# --- server and helpers ---------------------------------------------------------------------


def test_aggregate_is_average_with_server_lr() -> None:
    _, params = _model_params()
    ups = [_run("fedavg", s) for s in (1, 2, 3)]
    algo = make_algorithm("fedavg", _with(CONFIG, server_lr=0.5))
    out = algo.aggregate(params, ups)
    for k in params:
        mean = torch.stack([u.params[k] for u in ups]).mean(0)
        torch.testing.assert_close(out[k], params[k] + 0.5 * (mean - params[k]))
    same = average_params(params, [])
    assert all(torch.equal(same[k], params[k]) for k in params)


def test_batch_diagnostics() -> None:
    assert batch_diagnostics(torch.tensor([5, 5, 2, 5, 9])) == (3, 3)
    assert batch_diagnostics(torch.tensor([], dtype=torch.int64)) == (0, 0)


def test_silo_data_counts() -> None:
    silo = _silo(n=24, subjects=6)
    assert silo.num_records == 24 and silo.num_subjects == 6


# --- config validation ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("local_steps", 0, r"local_steps=0"),
        ("local_steps", 2.5, r"local_steps=2\.5"),
        ("batch_size", 0, r"batch_size=0"),
        ("lr", 0.0, r"lr=0\.0"),
        ("lr", -0.1, r"lr=-0\.1"),
        ("server_lr", 0, r"server_lr=0"),
        ("clip", -1.0, r"clip=-1\.0"),
        ("clip", float("nan"), r"clip=nan"),
        ("noise_multiplier", -0.5, r"noise_multiplier=-0\.5"),
        ("group_size", 0, r"group_size=0"),
        ("sampling", "silo", r"sampling='silo'"),
        ("subject_records", 0, r"subject_records=0"),
    ],
)
def test_config_validation_names_the_value(field, value, match) -> None:
    # the config of an algorithm that declares the field (each is declared once)
    owner = next(
        cls.Config for cls in ALGORITHMS.values() if field in cls.Config.__dataclass_fields__
    )
    with pytest.raises(ValueError, match=match):
        owner(**{field: value})


def test_unknown_algorithm_is_named() -> None:
    with pytest.raises(ValueError, match=r"algorithm='dp_magic'"):
        make_algorithm("dp_magic", CONFIG)


@pytest.mark.parametrize("name", ["local_item_dp", "local_group_dp", "higradavg_dp"])
def test_silo_above_the_accounted_group_bound_is_refused(name: str) -> None:
    from silodp.algorithms import SiloData, make_algorithm
    from silodp.models import build_model

    model = build_model("mlp", (4,), 2)
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    silo = SiloData(
        silo=0,
        x=torch.zeros(6, 4),
        y=torch.zeros(6, dtype=torch.long),
        subject=torch.tensor([0, 0, 0, 1, 2, 3]),
    )
    algorithm = make_algorithm(name, dict(group_size=2, local_steps=1))
    with pytest.raises(ValueError, match="3 records of one subject.*group_size=2"):
        algorithm.local_update(model, params, silo, Coins.seeded(0))
    ok = make_algorithm(name, dict(group_size=3, local_steps=1))
    ok.local_update(model, params, silo, Coins.seeded(0))


def test_user_ldp_reports_its_adjacency_per_unit() -> None:
    from silodp.cli.account import account_report

    user_ldp = ALGORITHMS["user_ldp"]
    # local DP: a silo's whole dataset replaced; a subject added or removed
    assert user_ldp.adjacency_of("silo") == "replace-one"
    assert user_ldp.adjacency_of("subject") == "add/remove"
    assert ALGORITHMS["prifedsync"].adjacency_of("record") == "replace-one"
    assert ALGORITHMS["local_item_dp"].adjacency_of("subject") == "add/remove"
    for cls in ALGORITHMS.values():  # every reported unit has one
        assert all(cls.adjacency_of(u) in ("add/remove", "replace-one") for u in cls.units)
    # what `silodp account --json` prints, with ε unchanged: 20 steps of the Gaussian at σ/2
    report = account_report("user_ldp", noise_multiplier=20.0, steps=5, rounds=4, silos=3)
    assert json.loads(json.dumps(report))["adjacency"] == {
        "silo": "replace-one",
        "subject": "add/remove",
    }
    assert report["mu"]["silo"] == pytest.approx(math.sqrt(20) / 10.0)
    update = _run("user_ldp", 0)
    assert update.privacy is not None
    sigma, steps = CONFIG["noise_multiplier"], CONFIG["local_steps"]
    assert update.privacy.events["silo"] == gaussian_steps(sigma / 2, steps)
    assert update.privacy.events["subject"] == gaussian_steps(sigma / 2, steps)


def test_user_ldp_adjacency_is_shown_per_unit_in_text_and_plots(tmp_path, monkeypatch, capsys):
    """`silodp account`'s text and the ε plot name each unit's own adjacency (they printed
    the raw mapping, and the plot labelled no unit as replace-one)."""
    from silodp import plotting
    from silodp.cli.account import account_report, print_report

    report = account_report("user_ldp", noise_multiplier=20.0, steps=5, rounds=4, silos=3)
    print_report(report)
    text = capsys.readouterr().out
    assert "{" not in text.splitlines()[0]
    assert "silo: ε = " in text and "(guarantee, replace-one adjacency;" in text
    assert "(guarantee, add/remove adjacency;" in text
    figures = []
    monkeypatch.setattr(plotting, "save_figure", lambda fig, path: figures.append(fig) or path)
    adjacency = dict(report["adjacency"])
    rows = [
        {"round": r, "epsilon": {"silo": 1.0 * r, "subject": 2.0 * r}, "adjacency": adjacency}
        for r in (1, 2)
    ]
    plotting.plot_epsilon(rows, tmp_path / "e.png", "user_ldp", 1e-5)
    legend = [t.get_text() for t in figures[0].axes[0].get_legend().get_texts()]
    assert legend == ["silo (replace-one)", "subject (add/remove)"]
    notes = [t.get_text() for t in figures[0].axes[0].texts]
    assert notes == ["silo: replace-one adjacency, not comparable with add/remove ε"]


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_threat_model_speaks_of_a_subject_sample_only_where_there_is_one(name: str) -> None:
    cls = ALGORITHMS[name]
    samples = "subject_rate" in {f.name for f in fields(cls.Config)}
    assert ("sample" in cls.threat_model) == samples, cls.threat_model
    settings = {**CONFIG, "num_silos": 3, **({"subject_rate": 0.5} if samples else {})}
    algorithm = make_algorithm(name, settings)
    if not algorithm.needs_secure_aggregation():
        return
    # the ULDP aggregate methods: what each round runs is sub-sampled exactly when the threat
    # model says there is a subject sample (uldp_naive: every subject, every round)
    rate = algorithm.sampling_rate(num_records=40, num_subjects=8)
    assert (rate < 1.0) == samples
    event = algorithm.silo_privacy(sampling_rate=rate).events["subject"]
    if samples:
        assert event == poisson_gaussian_steps(rate, CONFIG["noise_multiplier"], 1)
    else:
        assert event == gaussian_steps(CONFIG["noise_multiplier"] / 2, 1)
