"""The simulator's bookkeeping: random streams, silo sampling, JSON rows."""

from __future__ import annotations

import json
import math

import torch

from silodp.federated.simulator import (
    SAMPLING_STREAM,
    SERVER_STREAM,
    SILO_STREAM,
    RoundResult,
    round_generator,
)


def _draw(gen: torch.Generator) -> list[float]:
    return torch.rand(4, generator=gen).tolist()


def test_round_streams_are_reproducible_and_independent() -> None:
    a = _draw(round_generator(7, 3, SILO_STREAM, 1))
    assert a == _draw(round_generator(7, 3, SILO_STREAM, 1))
    others = [
        round_generator(7, 3, SILO_STREAM, 2),
        round_generator(7, 4, SILO_STREAM, 1),
        round_generator(8, 3, SILO_STREAM, 1),
        round_generator(7, 3, SAMPLING_STREAM),
        round_generator(7, 3, SERVER_STREAM),
    ]
    for gen in others:
        assert _draw(gen) != a


def test_round_result_json_has_no_non_finite_numbers() -> None:
    result = RoundResult(
        round=1,
        test_accuracy=0.1,
        test_loss=math.nan,
        epsilon={"subject": math.inf, "record": 1.5},
        epsilon_route={"subject": "none", "record": "pld"},
        mu={},
        wall_time_s=0.1,
        silos=[0],
    )
    row = result.to_json()
    text = json.dumps(row, allow_nan=False)
    assert json.loads(text)["test_loss"] is None
    assert row["epsilon"] == {"subject": None, "record": 1.5}
