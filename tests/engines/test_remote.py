"""The remote engine through a loopback transport: the same numbers as in process, the masked
sum's secrecy and exactness, the wire codec's refusals, the failure policies, and the ledger
of rounds that are aborted or skipped."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tomli_w
import torch

from silodp.algorithms.uldp_common import PROTOCOL_AGGREGATION_NOTE, SIMULATED_AGGREGATION_NOTE
from silodp.config import load_config
from silodp.crypto.errors import MalformedMessageError
from silodp.crypto.masked_sum import MaskedSumParty, unmask_sum
from silodp.data.build import build_federated_data
from silodp.engines import messages as msg
from silodp.engines import wire
from silodp.engines.factory import remote_engine_factory, write_silo_files
from silodp.engines.loopback import LoopbackTransport
from silodp.engines.remote import (
    CLEAR_REMOTE_NOTE,
    MASKED_SUM_NOTE,
    PLANNING_NOTE,
    REMOTE_PROTOCOL_NOTE,
    SiloFailureError,
)
from silodp.engines.silo import SiloRuntime, read_silo_data
from silodp.experiment.run import resume_experiment, run_experiment
from silodp.ledger.report import ledger_report, verify_ledger

BASE = {
    "data": {
        "source": "digits",
        "num_silos": 3,
        "num_subjects": 30,
        "max_records": 300,
        "test_fraction": 0.2,
    },
    "model": {"name": "mlp"},
    "training": {"rounds": 2, "local_steps": 2, "batch_size": 16, "lr": 0.5},
    "privacy": {"noise_multiplier": 1.5, "group_size": 4, "noise": "seeded"},
}


#: a smaller federation, for the tests that run an experiment several times
SMALL = {"num_subjects": 15, "max_records": 120}


class FaultyTransport(LoopbackTransport):
    """A loopback whose nodes fail in named rounds: ``faults[(round, node)]`` is ``down`` (no
    answer), ``error`` (the silo answers with an error and no message), ``unreadable`` (bytes
    that are no message), ``malformed`` (a readable reply whose update has no parameters) or
    ``no_privacy`` (a reply that claims no privacy events).
    The silo runs the round in the last two cases: its reply, noisy message included, reaches
    the server damaged."""

    def __init__(self, runtimes: Mapping[int, SiloRuntime]) -> None:
        super().__init__(runtimes)
        self.faults: dict[tuple[int, int], str] = {}
        #: the keys of every update a silo sent, as the server received it
        self.update_keys: list[set[str]] = []

    def exchange(self, requests, timeout):
        fault = {
            node: self.faults.get((wire.decode(body)["round"], node))
            for node, (kind, body) in requests.items()
            if kind == msg.TRAIN
        }
        down = self.down
        self.down = down | {node for node, f in fault.items() if f == "down"}
        try:
            out = super().exchange(requests, timeout)
        finally:
            self.down = down
        for node in fault:
            if isinstance(out.get(node), bytes):
                self.update_keys.append(set(wire.decode(out[node])["update"]))
        for node, f in fault.items():
            if f == "error":
                out[node] = "the silo's process failed: out of memory"
            elif f == "unreadable":
                out[node] = b"not a message"
            elif f == "malformed":
                reply = wire.decode(out[node])
                reply["update"]["params"] = {}
                out[node] = wire.encode(reply)
            elif f == "no_privacy":  # its message, claiming no events
                reply = wire.decode(out[node])
                reply["update"]["privacy"] = None
                out[node] = wire.encode(reply)
        return out


def _setup(tmp: Path, algorithm: str, data=None, **privacy):
    raw = json.loads(json.dumps(BASE))
    raw.update(name="remote", algorithms=[algorithm])
    raw["privacy"].update(privacy)
    raw["data"].update(data or {})
    path = tmp / "c.toml"
    path.write_text(tomli_w.dumps(raw))
    config = load_config(path)
    data = build_federated_data(config.data)
    files = write_silo_files(data.train, tmp / "silos")
    transport = FaultyTransport(
        {70 + s: SiloRuntime(read_silo_data(f)) for s, f in enumerate(files)}
    )
    return config, transport


def _spent(ledger: Path) -> list[tuple[int, int, str]]:
    """(round, attempt, party) of every round event in ``ledger``, in the order recorded."""
    with sqlite3.connect(ledger) as db:
        return list(
            db.execute("SELECT round, attempt, party FROM events WHERE kind = 'round' ORDER BY id")
        )


def _model(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "model.pt")


@pytest.mark.parametrize(
    "algorithm,privacy",
    [
        ("higradavg_dp", {}),
        ("local_item_dp", {}),
        ("uldp_avg", {"subject_rate": 0.5}),
        ("uldp_naive", {}),
        ("prifedsync", {}),
    ],
)
def test_same_model_and_epsilon_as_in_process(tmp_path, algorithm, privacy):
    config, transport = _setup(tmp_path, algorithm, **privacy)
    local = run_experiment(config, tmp_path / "a", log=lambda m: None)
    remote = run_experiment(
        config, tmp_path / "b", log=lambda m: None, engine_factory=remote_engine_factory(transport)
    )
    a, b = _model(tmp_path / "a" / algorithm), _model(tmp_path / "b" / algorithm)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert local["runs"][0]["epsilon"] == remote["runs"][0]["epsilon"]
    secure = algorithm.startswith("uldp")
    assert remote["runs"][0]["aggregation"].startswith("masked sum" if secure else "clear")
    # the masked sum ran: its note replaces the in-process one, the other notes are kept, and
    # the last one says the server planned the run from every silo's records
    notes = local["runs"][0]["notes"]
    assert (SIMULATED_AGGREGATION_NOTE in notes) == secure
    expected = [MASKED_SUM_NOTE if n == SIMULATED_AGGREGATION_NOTE else n for n in notes]
    expected.append(PLANNING_NOTE)
    assert remote["runs"][0]["notes"] == expected
    written = json.loads((tmp_path / "b" / algorithm / "summary.json").read_text())
    assert written["notes"] == expected
    # a silo's batch diagnostics (subjects per batch, largest group) count its secret batches
    # and subjects: they never leave the silo
    assert transport.update_keys
    assert all(
        k == {"silo", "params", "num_records", "privacy", "payload"} for k in transport.update_keys
    )


def test_silos_sample_without_noise_from_an_exchanged_seed(tmp_path):
    # σ = 0: no masked sum, but the silos still draw the subject sample from a seed the
    # server never sees, so they exchange keys for it
    config, transport = _setup(
        tmp_path, "uldp_avg", noise_multiplier=0.0, noise="secure", subject_rate=0.5
    )
    remote = run_experiment(
        config, tmp_path / "b", log=lambda m: None, engine_factory=remote_engine_factory(transport)
    )
    assert remote["runs"][0]["aggregation"].startswith("clear (no noise, no guarantee)")
    assert remote["runs"][0]["status"] == "complete"
    notes = remote["runs"][0]["notes"]
    assert CLEAR_REMOTE_NOTE in notes and SIMULATED_AGGREGATION_NOTE not in notes


def test_secure_coins_every_silo_draws_the_same_subject_sample(tmp_path):
    # one process serving a silo's key-directory and training messages (the loopback, and
    # flower-sim's workers) must leave the leader with the seed it sealed to the others, as a
    # fresh process per message (a deployment) does
    config, transport = _setup(
        tmp_path,
        "uldp_avg",
        SMALL,
        noise="secure",
        subject_rate=0.3,
        subject_sampler="silos",
    )
    trained: dict[int, dict] = {}

    class Recording(FaultyTransport):
        def exchange(self, requests, timeout):
            for node, (kind, body) in requests.items():
                if kind == msg.TRAIN:
                    trained[node] = wire.decode(body)
            return super().exchange(requests, timeout)

    transport = Recording(transport.runtimes)
    remote = run_experiment(
        config, tmp_path / "b", log=lambda m: None, engine_factory=remote_engine_factory(transport)
    )
    assert remote["runs"][0]["status"] == "complete"
    runtimes = transport.runtimes
    samples = {
        node: [rt._cache["algorithm"].silo_sample(r).tolist() for r in (1, 2)]
        for node, rt in runtimes.items()
    }
    assert len({json.dumps(v) for v in samples.values()}) == 1, samples
    assert any(any(r) for r in samples[70]) and not all(all(r) for r in samples[70])
    # the leader rebuilt from its secret and the relayed messages has the same seed
    leader = runtimes[70]
    fresh = SiloRuntime(leader.data, leader.secret)
    fresh._seed(trained[70])
    assert fresh._cache["party"].sample_key.sample(1, 50, 0.5).tolist() == (
        leader._cache["party"].sample_key.sample(1, 50, 0.5).tolist()
    )


@pytest.mark.slow  # Paillier work: ~30 s each
@pytest.mark.parametrize("sampler", ["server", "silos"])
def test_weighting_protocol_over_messages(tmp_path, sampler):
    # a small model and the protocol's smallest keys keep the Paillier work short
    data = {"source": "synthetic", "num_features": 4, "num_classes": 2}
    config, transport = _setup(
        tmp_path,
        "uldp_avg_w",
        data=data,
        n_max=60,
        key_bits=2048,
        subject_rate=0.5,
        subject_sampler=sampler,
    )
    local = run_experiment(config, tmp_path / "a", log=lambda m: None)
    remote = run_experiment(
        config, tmp_path / "b", log=lambda m: None, engine_factory=remote_engine_factory(transport)
    )
    assert remote["runs"][0]["aggregation"].startswith("private weighting protocol")
    assert local["runs"][0]["epsilon"] == remote["runs"][0]["epsilon"]
    # the protocol ran over messages, not in one process: the notes say so
    assert PROTOCOL_AGGREGATION_NOTE in local["runs"][0]["notes"]
    expected = [
        REMOTE_PROTOCOL_NOTE if n == PROTOCOL_AGGREGATION_NOTE else n
        for n in local["runs"][0]["notes"]
    ] + [PLANNING_NOTE]
    assert remote["runs"][0]["notes"] == expected
    a, b = _model(tmp_path / "a" / "uldp_avg_w"), _model(tmp_path / "b" / "uldp_avg_w")
    if sampler == "server":  # the sample comes from the seeded coins: the very same model
        assert all(torch.equal(a[k], b[k]) for k in a)
    else:  # from the protocol's own shared seed, fresh in every session
        assert not all(torch.equal(a[k], b[k]) for k in a)
        assert all(torch.isfinite(b[k]).all() for k in b)


def test_masked_messages_hide_each_silo_and_sum_exactly():
    ids = [0, 1, 2]
    parties = {i: MaskedSumParty(i, ids, b"s" * 16) for i in ids}
    directory = {i: p.public_key for i, p in parties.items()}
    sealed = {}
    for p in parties.values():
        sealed.update(p.receive_directory(directory))
    for r, (nonce, ct) in sealed.items():
        parties[r].receive_seed(nonce, ct)
    rng = np.random.default_rng(0)
    values = {i: rng.integers(-(2**40), 2**40, size=1000) for i in ids}
    masked = {i: parties[i].mask(values[i], 3) for i in ids}
    assert np.array_equal(unmask_sum(list(masked.values())), sum(values.values()))
    # one message alone looks uniform: its top bit is set about half the time
    assert 0.4 < float((masked[1] >> np.uint64(63)).mean()) < 0.6
    # any two of three do not sum to the two values
    assert not np.array_equal(unmask_sum([masked[0], masked[1]]), values[0] + values[1])
    # every silo derives the same sample key, the masks change with the round
    assert (
        parties[1].sample_key.sample(2, 50, 0.5).tolist()
        == parties[2].sample_key.sample(2, 50, 0.5).tolist()
    )
    assert not np.array_equal(parties[0].mask(values[0], 4), masked[0])
    # a directory received again gets the same answer (the leader draws its seed once), and
    # one that differs from the first is refused
    assert parties[0].receive_directory(directory) == {r: sealed[r] for r in (1, 2)}
    assert parties[1].receive_directory(directory) == {}
    altered = {**directory, 2: parties[1].public_key}
    for p in parties.values():
        with pytest.raises(MalformedMessageError, match="differs from the first"):
            p.receive_directory(altered)


def test_wire_round_trip_and_refusals():
    from silodp.algorithms.uldp_common import RoundWeights

    value = {"w": RoundWeights(torch.rand(2, 3), None, 4), 3: (2**80, b"k", 0.1)}
    back = wire.decode(wire.encode(value))
    assert torch.equal(back["w"].weights, value["w"].weights) and back[3] == value[3]
    blob = wire.encode(value)
    for bad in (blob[:40], b"garbage", blob[:-10]):
        with pytest.raises(wire.WireError):
            wire.decode(bad)
    with pytest.raises(wire.WireError, match="silodp dataclass"):
        wire._from_tree({"$object": "os:system", "fields": {}}, {})
    with pytest.raises(wire.WireError, match="can send"):
        wire.encode(object())


def test_a_dead_silo_aborts_or_is_skipped(tmp_path):
    config, transport = _setup(tmp_path, "local_item_dp")
    transport.down.add(71)  # silo 1 never answers
    with pytest.raises(SiloFailureError, match="Node 71 did not say which silo"):
        run_experiment(
            config,
            tmp_path / "a",
            log=lambda m: None,
            engine_factory=remote_engine_factory(transport),
        )
    # connected for set-up, dead in the rounds: skipped, and charged its planned events (the
    # server cannot tell a dead silo from a slow one whose reply may still come)
    transport.down.clear()
    factory = remote_engine_factory(transport, on_failure="skip")

    def dying(run, data, **kw):
        engine = factory(run, data, **kw)
        transport.down.add(71)
        return engine

    skipped = run_experiment(config, tmp_path / "b", log=lambda m: None, engine_factory=dying)
    transport.down.clear()
    full = run_experiment(config, tmp_path / "c", log=lambda m: None)
    rows = [
        json.loads(x)
        for x in (tmp_path / "b" / "local_item_dp" / "metrics.jsonl").read_text().splitlines()
    ]
    assert all(r["silos"] == [0, 2] for r in rows)
    ledger = tmp_path / "b" / "local_item_dp" / "ledger.sqlite"
    assert _spent(ledger) == [(r, 0, f"silo:{s}") for r in (1, 2) for s in range(3)]
    assert skipped["runs"][0]["epsilon"] == pytest.approx(full["runs"][0]["epsilon"], rel=1e-12)


def test_uldp_aborts_the_round_when_a_silo_is_missing(tmp_path):
    config, transport = _setup(tmp_path, "uldp_avg")
    factory = remote_engine_factory(transport, on_failure="skip")

    def dying(run, data, **kw):
        engine = factory(run, data, **kw)
        transport.down.add(72)
        return engine

    with pytest.raises(SiloFailureError, match="needs every silo"):
        run_experiment(config, tmp_path / "a", log=lambda m: None, engine_factory=dying)
    # the masked messages of the silos that answered reached the server, and the silent
    # silo's may still: all recorded, although a partial masked sum reveals nothing (one rule
    # for every algorithm, never optimistic)
    ledger = tmp_path / "a" / "uldp_avg" / "ledger.sqlite"
    assert _spent(ledger) == [(1, 0, f"silo:{s}") for s in range(3)]
    assert verify_ledger(ledger) == []


def test_an_aborted_round_records_every_silo_that_answered(tmp_path):
    config, transport = _setup(tmp_path, "local_item_dp", data=SMALL)
    transport.faults[(2, 72)] = "down"
    factory = remote_engine_factory(transport)  # on_failure = "abort"
    with pytest.raises(
        SiloFailureError, match=r"Round 2: silo 2: no answer.*silo\(s\) \[0, 1, 2\]"
    ):
        run_experiment(config, tmp_path / "a", log=lambda m: None, engine_factory=factory)
    ledger = tmp_path / "a" / "local_item_dp" / "ledger.sqlite"
    first = [(1, 0, f"silo:{s}") for s in range(3)]
    cut = [(2, 0, f"silo:{s}") for s in range(3)]
    assert _spent(ledger) == [*first, *cut]
    assert verify_ledger(ledger) == []
    (run,) = ledger_report(ledger)["runs"]
    assert run["status"] == "interrupted" and run["interrupted_rounds"] == [2]
    # the summary's ε is what the ledger was charged (silos 0 and 1 sent round 2's noisy
    # updates before silo 2 was found missing), not only round 1's
    summary = json.loads((tmp_path / "a" / "local_item_dp" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["rounds_completed"] == 1
    assert summary["rounds_charged_not_completed"] == [2]
    assert summary["epsilon"] == pytest.approx(run["epsilon"], rel=1e-12)
    assert all(
        summary["epsilon"][u] > summary["epsilon_of_completed_rounds"][u]
        for u in summary["epsilon"]
    )
    assert summary["epsilon_by_adversary"]["server"]["record"] == pytest.approx(
        summary["epsilon"]["record"]
    )
    assert any("round(s) 2 were charged" in note for note in summary["notes"])

    # resumed with every silo up: round 2 runs again as a new attempt; the cut attempt's
    # events still count, and no silo is recorded twice in one attempt of a round
    transport.faults.clear()
    resumed = resume_experiment(tmp_path / "a", log=lambda m: None, engine_factory=factory)
    spent = _spent(ledger)
    assert len(set(spent)) == len(spent)
    assert spent == [*first, *cut] + [(2, 1, f"silo:{s}") for s in range(3)]
    assert verify_ledger(ledger) == []
    done = resumed["runs"][0]
    assert done["status"] == "complete"
    (run,) = ledger_report(ledger)["runs"]
    assert run["epsilon"] == pytest.approx(done["epsilon"], rel=1e-12)
    full = run_experiment(config, tmp_path / "c", log=lambda m: None)["runs"][0]
    assert all(done["epsilon"][u] > full["epsilon"][u] for u in full["epsilon"])


def test_an_unreadable_or_malformed_reply_is_charged_when_skipped(tmp_path):
    config, transport = _setup(tmp_path, "local_item_dp", data=SMALL)
    transport.faults.update({(1, 71): "unreadable", (2, 71): "malformed"})
    skipped = run_experiment(
        config,
        tmp_path / "b",
        log=lambda m: None,
        engine_factory=remote_engine_factory(transport, on_failure="skip"),
    )["runs"][0]
    rows = [
        json.loads(x)
        for x in (tmp_path / "b" / "local_item_dp" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["silos"] for r in rows] == [[0, 2], [0, 2]]
    # silo 1's replies reached the server: its planned events are recorded in both rounds
    ledger = tmp_path / "b" / "local_item_dp" / "ledger.sqlite"
    assert _spent(ledger) == [(r, 0, f"silo:{s}") for r in (1, 2) for s in range(3)]
    assert verify_ledger(ledger) == []
    # so the run spends what it would with silo 1 taking part
    full = run_experiment(config, tmp_path / "c", log=lambda m: None)["runs"][0]
    assert skipped["epsilon"] == pytest.approx(full["epsilon"], rel=1e-12)


def test_every_chosen_silo_is_charged_before_the_round_is_sent(tmp_path):
    """A reply may wait at the transport (a SuperLink) while the server dies before reading
    it: the ledger holds each chosen silo's planned events before any message leaves, so a
    silo whose app then raises stays charged (conservative) and the run's ε is what its
    ledger holds."""
    config, transport = _setup(tmp_path, "local_item_dp", data=SMALL)
    transport.faults[(2, 71)] = "error"
    seen: list[list[tuple[int, int, str]]] = []
    ledger = tmp_path / "b" / "local_item_dp" / "ledger.sqlite"
    send = transport.exchange

    def exchange(requests, *args, **kwargs):  # what the ledger holds as messages leave
        if any(kind == msg.TRAIN for kind, _ in requests.values()):
            seen.append(_spent(ledger))
        return send(requests, *args, **kwargs)

    transport.exchange = exchange
    run_experiment(
        config,
        tmp_path / "b",
        log=lambda m: None,
        engine_factory=remote_engine_factory(transport, on_failure="skip"),
    )
    round_1 = [(1, 0, f"silo:{s}") for s in range(3)]
    assert seen[0] == round_1 and seen[1] == round_1 + [(2, 0, f"silo:{s}") for s in range(3)]
    assert _spent(ledger) == seen[1]
    assert verify_ledger(ledger) == []


def test_a_node_with_other_records_is_refused(tmp_path):
    config, transport = _setup(tmp_path, "local_item_dp")
    other = transport.runtimes[70].data
    transport.runtimes[70].data = type(other)(0, other.x[:-1], other.y[:-1], other.subject[:-1])
    with pytest.raises(SiloFailureError, match="planned for"):
        run_experiment(
            config,
            tmp_path / "a",
            log=lambda m: None,
            engine_factory=remote_engine_factory(transport),
        )
    transport.runtimes[70].data = transport.runtimes[71].data
    with pytest.raises(SiloFailureError, match="both answer as silo 1"):
        run_experiment(
            config,
            tmp_path / "b",
            log=lambda m: None,
            engine_factory=remote_engine_factory(transport),
        )


def test_a_reply_claiming_other_events_is_refused_and_the_plan_charged(tmp_path):
    """A reply with ``privacy = None`` was aggregated and nothing recorded for its silo."""
    config, transport = _setup(tmp_path, "local_item_dp", data=SMALL)
    transport.faults[(2, 71)] = "no_privacy"
    with pytest.raises(SiloFailureError, match="silo 1: Silo 1 reported privacy events None"):
        run_experiment(
            config,
            tmp_path / "a",
            log=lambda m: None,
            engine_factory=remote_engine_factory(transport),
        )
    ledger = tmp_path / "a" / "local_item_dp" / "ledger.sqlite"
    assert _spent(ledger) == [(r, 0, f"silo:{s}") for r in (1, 2) for s in range(3)]


class TamperingTransport(FaultyTransport):
    """Replaces the replies of one message kind: ``tamper[kind](decoded reply) -> bytes``."""

    def __init__(self, runtimes: Mapping[int, SiloRuntime]) -> None:
        super().__init__(runtimes)
        self.tamper: dict[str, Any] = {}

    def exchange(self, requests, timeout):
        out = super().exchange(requests, timeout)
        for node, (kind, _) in requests.items():
            change = self.tamper.get(kind)
            if change is not None and isinstance(out.get(node), bytes):
                out[node] = change(node, wire.decode(out[node]))
        return out


def _tampered(tmp_path: Path, algorithm: str, kind: str, change: Any, data=None, **privacy) -> str:
    tmp_path.mkdir()
    config, faulty = _setup(tmp_path, algorithm, data=data, **privacy)
    transport = TamperingTransport(faulty.runtimes)
    transport.tamper[kind] = change
    with pytest.raises(SiloFailureError) as info:
        run_experiment(
            config,
            tmp_path / "a",
            log=lambda m: None,
            engine_factory=remote_engine_factory(transport),
        )
    return str(info.value)


def test_damaged_set_up_replies_and_states_are_named(tmp_path):
    """Each was a traceback (WireError naming no node, KeyError 'dh_public', AttributeError
    once a PriFedSync silo's state was used)."""
    text = _tampered(tmp_path / "h", "local_item_dp", msg.HELLO, lambda n, r: b"junk")
    assert "Node 70's hello cannot be read" in text

    def no_key(node: int, reply: dict) -> bytes:
        reply.pop("dh_public", None)
        return wire.encode(reply)

    text = _tampered(tmp_path / "k", "uldp_avg", msg.SETUP, no_key)
    assert "Silo 0's set-up reply has no public key" in text

    def bad_state(node: int, reply: dict) -> bytes:
        return wire.encode({**reply, "state": "garbage"} if node == 71 else reply)

    text = _tampered(tmp_path / "s", "prifedsync", msg.TRAIN, bad_state)
    assert "Silo 1's state is a str" in text


@pytest.mark.parametrize(
    "algorithm,privacy,sent,expected",
    [
        # an averaging algorithm's messages have the model's dtype: a float64 one made the
        # global model mixed float32/float64 (a traceback naming no silo at evaluation)
        ("local_item_dp", {}, torch.float64, torch.float32),
        # the ULDP messages are float64 by design (here σ = 0, sent in the clear)
        ("uldp_avg", {"noise_multiplier": 0.0}, torch.float32, torch.float64),
    ],
)
def test_a_message_in_another_dtype_is_refused_naming_the_silo(
    tmp_path, algorithm, privacy, sent, expected
):
    def retyped(node: int, reply: dict) -> bytes:
        if node == 71:
            params = reply["update"]["params"]
            reply["update"]["params"] = {k: v.to(sent) for k, v in params.items()}
        return wire.encode(reply)

    text = _tampered(tmp_path / "d", algorithm, msg.TRAIN, retyped, **privacy)
    assert f"has dtype {sent}, expected {expected}" in text and "Silo 1" in text


def test_damaged_weighting_set_up_replies_are_named(tmp_path):
    """A weighting set-up reply that was no mapping raised AttributeError (.get on a list)."""
    text = _tampered(
        tmp_path / "w",
        "uldp_avg_w",
        msg.WEIGHTING,
        lambda node, reply: wire.encode(["junk"] if node == 72 else reply),
        data={"source": "synthetic", "num_features": 4, "num_classes": 2},
        n_max=60,
    )
    assert "Silo 2 sent a malformed reply: expected a dict" in text


def test_engine_notes_keep_the_notes_on_how_the_run_ended(tmp_path, monkeypatch):
    """A ULDP run's notes were replaced by those of a run still "running": a note added for
    the real status (here: the accuracy is of an earlier round's model) was lost."""
    monkeypatch.setitem(BASE, "training", {**BASE["training"], "rounds": 4, "eval_every": 2})
    config, transport = _setup(tmp_path, "uldp_avg", data=SMALL)
    transport.faults[(4, 72)] = "down"  # round 4 is aborted: 3 rounds done, round 2 evaluated
    with pytest.raises(SiloFailureError):
        run_experiment(
            config,
            tmp_path / "b",
            log=lambda m: None,
            engine_factory=remote_engine_factory(transport),
        )
    written = json.loads((tmp_path / "b" / "uldp_avg" / "summary.json").read_text())
    assert (written["rounds_completed"], written["test_accuracy_round"]) == (3, 2)
    assert any("is of round 2's model" in n for n in written["notes"])
    assert MASKED_SUM_NOTE in written["notes"]
    assert SIMULATED_AGGREGATION_NOTE not in written["notes"]
    assert PLANNING_NOTE in written["notes"]
