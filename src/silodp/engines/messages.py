"""The messages between the server and a silo when they run apart, and their checks.

Every message is a kind and a body (:mod:`silodp.engines.wire` turns the body into bytes). The
server checks each silo's reply before it is used (:func:`update_from_wire`): a missing key,
a tensor of the wrong shape or dtype, a non-finite value or a count out of range is refused
with an error naming the silo and what was wrong.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from silodp.accounting import SiloPrivacy
from silodp.algorithms import SiloUpdate
from silodp.crypto.messages import MaskedWeightedSum
from silodp.errors import InvalidValueError
from silodp.privacy.gradients import Params

__all__ = ["KINDS", "MalformedReplyError", "update_from_wire", "update_to_wire"]

#: the server's first message to every node: which silo are you, which records do you hold
HELLO = "hello"
#: the run: the calibrated algorithm, its public set-up, the model, which records to train on
SETUP = "setup"
#: every silo's public key for the masked sum (the leader answers with the sealed seed)
DIRECTORY = "directory"
#: the leader's sealed seed, relayed to one silo
SEED = "seed"
#: a set-up stage of the private weighting protocol (:mod:`silodp.engines.weighting`)
WEIGHTING = "weighting"
#: one round: the global model, the round's instructions, the silo's state
TRAIN = "train"
KINDS = (HELLO, SETUP, DIRECTORY, SEED, WEIGHTING, TRAIN)
#: the key of a masked message (uint64, the secure sum's input) in an update's ``params``
MASKED = "__masked__"
#: the largest record or subject count a reply may state
MAX_COUNT = 2**62


class MalformedReplyError(InvalidValueError):
    """A silo's reply that is not what the server asked for."""


def update_to_wire(update: SiloUpdate) -> dict[str, Any]:
    """What a silo sends the server of its update: its message, record count and DP events.

    The update's batch diagnostics (``group_sizes``, ``subjects_per_batch``) stay at the silo:
    they count the silo's secret batches and subjects, which no ε covers.
    """
    return {
        "silo": update.silo,
        "params": update.params,
        "num_records": update.num_records,
        "privacy": update.privacy,
        "payload": update.payload,
    }


def _show(value: Any) -> str:
    """A short repr of a value from a reply (never failing on a huge int)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"<a {value.bit_length()}-bit int>"
    try:
        text = repr(value)
    except ValueError:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 40 else text[:37] + "..."


def _fail(silo: int, what: str) -> MalformedReplyError:
    return MalformedReplyError(f"Silo {silo} sent a malformed reply: {what}.")


def _check_params(
    silo: int, params: Any, like: Params, masked_size: int | None, dtype: torch.dtype | None
) -> Params:
    if masked_size is not None:
        if not isinstance(params, dict) or set(params) != {MASKED}:
            raise _fail(silo, "expected a masked message for the secure sum")
        masked = params[MASKED]
        if not isinstance(masked, np.ndarray) or masked.dtype != np.uint64:
            raise _fail(silo, "expected the masked message as uint64")
        if masked.shape != (masked_size,):
            raise _fail(silo, f"expected {masked_size} masked values, got {masked.shape}")
        return {MASKED: masked}  # type: ignore[dict-item]
    if not isinstance(params, dict) or set(params) != set(like):
        keys = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise _fail(silo, f"expected parameters {sorted(like)}, got {keys}")
    for name, ref in like.items():
        t = params[name]
        if not isinstance(t, torch.Tensor):
            raise _fail(silo, f"parameter {name!r} is a {type(t).__name__}, not a tensor")
        if t.shape != ref.shape:
            raise _fail(
                silo, f"parameter {name!r} has shape {tuple(t.shape)}, expected {tuple(ref.shape)}"
            )
        expected = dtype or ref.dtype
        if t.dtype != expected:
            raise _fail(silo, f"parameter {name!r} has dtype {t.dtype}, expected {expected}")
        if not bool(torch.isfinite(t).all()):
            raise _fail(silo, f"parameter {name!r} holds NaN or inf")
    return params


def update_from_wire(
    reply: Any,
    *,
    silo: int,
    like: Params,
    masked_size: int | None = None,
    encrypted: bool = False,
    dtype: torch.dtype | None = None,
) -> SiloUpdate:
    """Silo ``silo``'s update from its reply, checked against the global model ``like``
    (``masked_size``: the update's message is the secure sum's masked vector of that size;
    ``encrypted``: its message is the weighting protocol's masked weighted sum, whose values
    the protocol's server checks; ``dtype``: the message values' dtype, ``None``: that of
    ``like``'s parameters).

    Raises:
      MalformedReplyError: what was wrong, naming the silo.
    """
    if not isinstance(reply, dict):
        raise _fail(silo, f"expected a mapping, got {type(reply).__name__}")
    missing = sorted({"update", "state"} - set(reply))
    if missing:
        raise _fail(silo, f"missing {missing}")
    body = reply["update"]
    keys = ("silo", "params", "num_records", "privacy")
    if not isinstance(body, dict) or any(k not in body for k in keys):
        raise _fail(silo, f"expected an update with {list(keys)}")
    answers = body["silo"]
    if isinstance(answers, bool) or not isinstance(answers, int) or answers != silo:
        raise _fail(silo, f"it answers as silo {_show(answers)}")
    n = body["num_records"]
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_COUNT:
        raise _fail(silo, f"num_records={_show(n)}, expected an int in [1, 2^62]")
    privacy = body["privacy"]
    if privacy is not None and not isinstance(privacy, SiloPrivacy):
        raise _fail(silo, "its events are not a SiloPrivacy")
    payload = body.get("payload")
    if isinstance(payload, float) and not math.isfinite(payload):
        raise _fail(silo, "its payload holds NaN or inf")
    if encrypted:
        if not isinstance(body["params"], dict) or body["params"]:
            raise _fail(silo, "expected no parameters beside the encrypted weighted sum")
        if not isinstance(payload, MaskedWeightedSum) or payload.sender != silo:
            raise _fail(silo, "expected its masked weighted sum as the payload")
        params: Params = {}
    else:
        params = _check_params(silo, body["params"], like, masked_size, dtype)
    return SiloUpdate(
        silo=silo,
        params=params,
        num_records=n,
        privacy=privacy,
        payload=payload,
    )
