"""Utility of a model on held-out records: the whole test split, or each client's own."""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call
from torch.nn import functional as F

from silodp.data import TestSplit
from silodp.errors import InvalidValueError
from silodp.privacy.gradients import Params

__all__ = ["client_tests", "evaluate"]


def evaluate(
    model: nn.Module, params: Params, test: TestSplit, *, batch_size: int = 1024
) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of ``params`` on ``test``."""
    correct, loss_sum = 0, 0.0
    x_all, y_all = torch.from_numpy(test.x), torch.from_numpy(test.y)
    with torch.no_grad():
        for start in range(0, len(test), batch_size):
            x, y = x_all[start : start + batch_size], y_all[start : start + batch_size]
            logits = functional_call(model, params, (x,))
            loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(dim=1) == y).sum())
    return correct / len(test), loss_sum / len(test)


def client_tests(test: TestSplit, num_clients: int) -> list[TestSplit]:
    """Each client's own test split (the shared split for every client when it has none).

    Raises:
      InvalidValueError: a client has no test records.
    """
    out = []
    for s in range(num_clients):
        idx = test.silo_indices(s)
        if len(idx) == 0:
            raise InvalidValueError(f"Expected test records for client {s}, got none.")
        out.append(TestSplit(x=test.x[idx], y=test.y[idx]))
    return out
