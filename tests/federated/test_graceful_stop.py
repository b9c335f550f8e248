"""Ctrl-C or SIGTERM while a run's rounds are running: the round in progress is recorded and
checkpointed before the run stops, so a calibrated run whose budget is its target ε resumes to
the end (it stopped one round short: the cut round counted in full, then ran again). A second
signal stops at once."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from silodp import faults
from silodp.cli.common import Terminated, sigterm_interrupts, summary_table
from silodp.config import parse_config
from silodp.experiment import resume_experiment, run_experiment
from silodp.ledger.report import ledger_report, verify_ledger

RAW = {
    "name": "graceful",
    "algorithms": ["local_item_dp"],
    "data": {"source": "digits", "num_silos": 3, "num_subjects": 40, "max_records": 300},
    "model": {"name": "mlp"},
    "training": {"rounds": 4, "local_steps": 2, "batch_size": 16, "lr": 0.5},
    # calibrated to ε = 2 with no budget: the target is the budget, with no room to spare
    "privacy": {"epsilon": 2.0, "group_size": 3, "noise": "seeded"},
}


def _signal_at_silo_recorded(
    monkeypatch: pytest.MonkeyPatch, round_index: int, signals: int, signum: int
) -> None:
    """Sends this process ``signals`` × ``signum`` once a silo's events of ``round_index``
    are in the ledger (its message not yet aggregated)."""
    reached = faults.reached
    sent = [False]

    def send(point: str, index: int) -> None:
        if point == "silo_recorded" and index == round_index and not sent[0]:
            sent[0] = True
            for _ in range(signals):
                os.kill(os.getpid(), signum)
        reached(point, index)

    monkeypatch.setattr(faults, "reached", send)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_inside_a_round_waits_for_its_checkpoint_and_the_run_resumes_to_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signum: int
) -> None:
    whole = run_experiment(parse_config(RAW), tmp_path / "whole")["runs"][0]
    out = tmp_path / "out"
    _signal_at_silo_recorded(monkeypatch, 2, 1, signum)
    stop = Terminated if signum == signal.SIGTERM else KeyboardInterrupt
    with pytest.raises(stop), sigterm_interrupts():
        run_experiment(parse_config(RAW), out)
    summary = json.loads((out / "local_item_dp" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["rounds_completed"] == 2
    (entry,) = ledger_report(out / "local_item_dp" / "ledger.sqlite")["runs"]
    assert entry["interrupted_rounds"] == [] and entry["rounds"] == 2
    monkeypatch.undo()
    resumed = resume_experiment(out)["runs"][0]
    assert resumed["status"] == "complete" and resumed["rounds_completed"] == 4
    assert resumed["epsilon"] == pytest.approx(whole["epsilon"], rel=1e-12)
    (entry,) = ledger_report(out / "local_item_dp" / "ledger.sqlite")["runs"]
    assert entry["interrupted_rounds"] == [] and entry["rounds_run_again"] == []
    assert verify_ledger(out / "local_item_dp" / "ledger.sqlite") == []
    assert not any("cut short" in note for note in resumed["notes"])


def test_a_second_stop_stops_at_once_and_the_cut_round_counts_in_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    _signal_at_silo_recorded(monkeypatch, 2, 2, signal.SIGTERM)
    with pytest.raises(Terminated), sigterm_interrupts():
        run_experiment(parse_config(RAW), out)
    summary = json.loads((out / "local_item_dp" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["rounds_completed"] == 1
    (entry,) = ledger_report(out / "local_item_dp" / "ledger.sqlite")["runs"]
    assert entry["interrupted_rounds"] == [2]
    # the interrupted summary's ε is the ledger's charge, the cut round included
    assert summary["rounds_charged_not_completed"] == [2]
    assert summary["epsilon"] == pytest.approx(entry["epsilon"], rel=1e-12)
    assert summary["epsilon_of_completed_rounds"]["record"] < summary["epsilon"]["record"]
    monkeypatch.undo()
    # the target is the budget: the cut round leaves no room for the last one
    experiment = resume_experiment(out)
    resumed = experiment["runs"][0]
    assert resumed["status"] == "budget_exhausted" and resumed["rounds_completed"] == 3
    # the summary says why its ε is above its account_command's (the plan's), and so does
    # the table silodp run prints
    assert any("1 round(s) were cut short" in note for note in resumed["notes"])
    assert resumed["round_attempts_cut_short"] == 1
    assert "  local_item_dp: ε counts 1 round(s) cut short and run again on resume in full " in (
        "\n".join(summary_table(experiment))
    )
    written = json.loads((out / "local_item_dp" / "summary.json").read_text())
    assert written["notes"] == resumed["notes"]


def test_a_second_stop_while_the_stop_is_written_leaves_an_interrupted_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two Ctrl-Cs 20 ms apart: the first waits for the round, the second came while the
    stopped run's files were written and left ``summary.json`` saying "running" (the
    process had printed that the run was interrupted). Those writes now finish first."""
    from silodp.experiment import record

    out = tmp_path / "out"
    _signal_at_silo_recorded(monkeypatch, 2, 1, signal.SIGINT)
    write_jsonl = record.write_jsonl
    writes_of_two_rounds = []

    def stop_again(path: Path, rows: list) -> None:
        if path.name == "metrics.jsonl" and len(rows) == 2:
            writes_of_two_rounds.append(path)
            if len(writes_of_two_rounds) == 2:  # round 2's rows, then the stopped run's
                os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C
        write_jsonl(path, rows)

    monkeypatch.setattr(record, "write_jsonl", stop_again)
    with pytest.raises(KeyboardInterrupt), sigterm_interrupts():
        run_experiment(parse_config(RAW), out)
    summary = json.loads((out / "local_item_dp" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["rounds_completed"] == 2
    rows = (out / "local_item_dp" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(row)["round"] for row in rows] == [1, 2]
    assert len(writes_of_two_rounds) == 2


def test_a_stop_outside_the_rounds_is_raised_at_once(tmp_path: Path) -> None:
    with pytest.raises(Terminated), sigterm_interrupts():
        os.kill(os.getpid(), signal.SIGTERM)
        raise AssertionError("not stopped")  # pragma: no cover


def test_a_forked_worker_keeps_a_stop_for_later_without_saying_it_again(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A terminal's Ctrl-C reaches the protocol's forked workers too, which inherit the
    handler: each printed the "stopping once the round ..." line (three lines for one
    Ctrl-C). Only the process that installed the handler says it; a worker keeps the stop
    as its parent does."""
    from silodp import stopping

    with sigterm_interrupts(), stopping.rounds_running():
        pid = os.fork()
        if pid == 0:  # the worker: the stop is kept, not raised, and nothing is printed
            code = 1
            try:
                os.kill(os.getpid(), signal.SIGINT)
                try:
                    stopping.check()
                except KeyboardInterrupt:
                    code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            stopping.check()
    assert capfd.readouterr().err.count("stopping once the round in progress") == 1
