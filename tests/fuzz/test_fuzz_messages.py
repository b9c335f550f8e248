"""Property tests of the messages between the server and the silos on bad input.

Truncated, garbled, wrong-typed and oversized messages must be refused with a named error —
:class:`~silodp.engines.wire.WireError` from the wire codec,
:class:`~silodp.engines.messages.MalformedReplyError` for a silo's reply,
:class:`~silodp.crypto.errors.MalformedMessageError` (a ``ProtocolError``) from the weighting
protocol's messages — before anything is decrypted or computed with them.
"""

from __future__ import annotations

import dataclasses
import io
import json
import zipfile
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from silodp.crypto.errors import MalformedMessageError, ProtocolError
from silodp.crypto.messages import (
    MAX_MODULUS_BITS,
    EncryptedWeights,
    KeyDirectory,
    KeyShare,
    MaskedHistogram,
    MaskedWeightedSum,
    SealedSeed,
    ServerHello,
)
from silodp.engines import wire
from silodp.engines.messages import MASKED, MalformedReplyError, update_from_wire

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None)
SID = bytes(range(16))

JSON = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**80), 2**80),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=6),
    ),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


def _message() -> Any:
    return {
        "kind": "train",
        "model": {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3)},
        "big": 2**300,
        "counts": (1, 2, 3),
        "sum": MaskedWeightedSum(SID, 1, 0, 3, (5, 7)),
        "mask": np.arange(4, dtype=np.uint64),
    }


def _npz(tree: Any, arrays: dict[str, np.ndarray] | None = None) -> bytes:
    buffer = io.BytesIO()
    blobs = {"tree": np.frombuffer(json.dumps(tree).encode(), dtype=np.uint8), **(arrays or {})}
    np.savez(buffer, **blobs)  # type: ignore[arg-type]
    return buffer.getvalue()


# --- the wire codec ---------------------------------------------------------------------


@SETTINGS
@given(data=st.binary(max_size=300))
def test_random_bytes_are_a_wire_error(data: bytes) -> None:
    with pytest.raises(wire.WireError):
        wire.decode(data)


@SETTINGS
@given(
    cut=st.integers(0, 10**6),
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=4),
)
def test_a_cut_or_flipped_message_is_refused_or_decoded(cut: int, flips: list) -> None:
    blob = bytearray(wire.encode(_message()))
    for where, byte in flips:
        blob[where % len(blob)] = byte
    blob = blob[: cut % (len(blob) + 1)] if flips or cut % 2 else blob
    try:
        value = wire.decode(bytes(blob))
    except wire.WireError as err:
        assert "Expected" in str(err)
    else:  # only a flip inside array data or a string can survive, and the shape is kept
        assert value["model"]["w"].shape == (2, 3) or not isinstance(value, dict)


@SETTINGS
@given(data=st.data(), replacement=JSON)
def test_a_wrong_typed_tree_node_is_refused_or_decoded(
    data: st.DataObject, replacement: Any
) -> None:
    tree = wire._to_tree(_message(), arrays := [])
    paths = _paths(tree)
    path = data.draw(st.sampled_from(paths))
    tree = _replace(tree, path, replacement)
    blob = _npz(tree, {f"a{i}": a for i, a in enumerate(arrays)})
    try:
        wire.decode(blob)
    except wire.WireError as err:
        assert str(err)


def _paths(tree: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(tree, dict):
        for k, v in tree.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            out += _paths(v, (*prefix, i))
    return out


def _replace(tree: Any, path: tuple, value: Any) -> Any:
    if not path:
        return value
    tree[path[0]] = _replace(tree[path[0]], path[1:], value)
    return tree


def test_oversized_and_hostile_messages_are_refused_before_reading() -> None:
    blob = wire.encode(_message())
    with pytest.raises(wire.WireError, match=f"at most 100 bytes, got {len(blob)}"):
        wire.decode(blob, max_bytes=100)
    # an array header declaring far more data than the member holds
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f8", "fortran_order": False, "shape": (2**40,)}
    )
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("tree.npy", _npz_member(np.frombuffer(b'{"$array": 0}', dtype=np.uint8)))
        z.writestr("a0.npy", header.getvalue() + bytes(16))
    with pytest.raises(wire.WireError, match=r"declares shape \(1099511627776,\)"):
        wire.decode(archive.getvalue())
    # a pickled object array is never loaded
    with pytest.raises(wire.WireError, match="numeric array"):
        wire.decode(_npz({"$array": 0}, {"a0": np.array([{"x": 1}], dtype=object)}))
    # a deflated member that unpacks past the limit (a zip bomb) is refused by its size
    bomb = io.BytesIO()
    with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("tree.npy", _npz_member(np.zeros(2**21, dtype=np.uint8)))
    with pytest.raises(wire.WireError, match="unpacking to"):
        wire.decode(bomb.getvalue(), max_bytes=2**20)
    assert len(bomb.getvalue()) < 2**20
    # nesting deeper than MAX_DEPTH, and more than JSON can parse
    deep: Any = 1
    for _ in range(wire.MAX_DEPTH + 2):
        deep = [deep]
    with pytest.raises(wire.WireError, match="nested"):
        wire.decode(_npz(deep))
    with pytest.raises(wire.WireError):
        wire.decode(_npz_raw(b"[" * 100000 + b"]" * 100000))
    # a member that is not an array of the message, or a second tree
    with pytest.raises(wire.WireError, match="named"):
        wire.decode(_npz(1, {"os": np.zeros(1)}))


def _npz_member(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, array)
    return buffer.getvalue()


def _npz_raw(tree: bytes) -> bytes:
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("tree.npy", _npz_member(np.frombuffer(tree, dtype=np.uint8)))
    return archive.getvalue()


@pytest.mark.parametrize(
    "tree",
    [
        {"$int": "1" * 5000},
        {"$int": 5},
        {"$fraction": ["1", "0"]},
        {"$float": 1.5},
        {"$bytes": "not base64!"},
        {"$tensor": "0"},
        {"$tensor": True},
        {"$array": 7},
        {"$tuple": 5},
        {"$dict": [[[1], 2]]},
        {"$dict": 3},
        {"$object": "os:system", "fields": {}},
        {"$object": "silodp.engines.wire:encode", "fields": {}},
        {"$object": "silodp.crypto.messages:ServerHello", "fields": 3},
        {"$object": "silodp.crypto.messages:ServerHello", "fields": {"session_id": 1}},
        {"$nope": 1},
        1.5,
        {"a": 1, "b": 2, "c": 3},
    ],
)
def test_each_bad_tag_is_a_wire_error(tree: Any) -> None:
    with pytest.raises(wire.WireError, match="Expected"):
        wire.decode(_npz(tree))


def test_large_integers_cross_the_wire_in_hexadecimal() -> None:
    n2 = (2**8192 - 1) ** 2  # a 16384-bit ciphertext bound: 4932 decimal digits
    assert wire.decode(wire.encode({"c": n2, "d": -n2})) == {"c": n2, "d": -n2}


# --- the weighting protocol's messages --------------------------------------------------

OVERSIZED = 2 ** (2 * MAX_MODULUS_BITS + 1)
BAD_FIELD_VALUES = st.one_of(
    st.sampled_from(
        [
            None,
            True,
            -1,
            2**63,
            OVERSIZED,
            1.0,
            "0",
            b"",
            bytes(15),
            bytes(17),
            [1],
            (1.5,),
            (-1,),
            (OVERSIZED,),
            ((0, bytes(32)), (0, bytes(32))),
        ]
    ),
    JSON,
)

VALID = [
    ServerHello(SID, 2**511 + 1),
    KeyShare(SID, 1, bytes(32), bytes(64)),
    KeyDirectory(SID, ((0, bytes(32)), (1, bytes(32)))),
    SealedSeed(SID, 0, 1, bytes(12), bytes(48)),
    MaskedHistogram(SID, 1, (0, 5, 9)),
    EncryptedWeights(SID, 0, 3, (1, 2)),
    MaskedWeightedSum(SID, 1, 0, 3, (1, 2)),
]


@SETTINGS
@given(data=st.data(), value=BAD_FIELD_VALUES)
def test_a_wrong_field_is_a_malformed_message_error(data: st.DataObject, value: Any) -> None:
    message = data.draw(st.sampled_from(VALID))
    field = data.draw(st.sampled_from([f.name for f in dataclasses.fields(message)]))
    try:
        changed = dataclasses.replace(message, **{field: value})
    except MalformedMessageError as err:
        assert isinstance(err, ProtocolError) and str(err)
        # over the wire the same message is refused while it is decoded
        blob = wire.encode(message)
        tree = json.loads(_tree_bytes(blob))
        tree["fields"][field] = wire._to_tree(value, [])
        with pytest.raises(wire.WireError):
            wire.decode(_npz(tree))
    else:  # a value that fits the field's type and bounds crosses the wire unchanged
        assert wire.decode(wire.encode(changed)) == changed


def _tree_bytes(blob: bytes) -> bytes:
    with np.load(io.BytesIO(blob)) as z:
        return z["tree"].tobytes()


def test_oversized_protocol_values_are_refused_before_any_decryption() -> None:
    with pytest.raises(
        MalformedMessageError, match=r"ciphertexts\[1\] to be an int in \[0, 2\^32768\)"
    ):
        MaskedWeightedSum(SID, 0, 0, 3, (1, OVERSIZED))
    with pytest.raises(MalformedMessageError, match="16384 bits"):
        ServerHello(SID, 2**20000 + 1)
    with pytest.raises(MalformedMessageError, match="silo 0 has two"):
        KeyDirectory(SID, ((0, bytes(32)), (0, bytes(32))))
    with pytest.raises(MalformedMessageError, match="signature to be 64 bytes, got 63 bytes"):
        KeyShare(SID, 0, bytes(32), bytes(63))
    with pytest.raises(MalformedMessageError, match="16 to 4096 bytes, got 10000 bytes"):
        SealedSeed(SID, 0, 1, bytes(12), bytes(10000))
    with pytest.raises(MalformedMessageError, match="dim <= 2147483648"):
        EncryptedWeights(SID, 0, 2**40, (1,))
    blob = wire.encode(MaskedWeightedSum(SID, 0, 0, 3, (1, 2)))
    tree = json.loads(_tree_bytes(blob))
    tree["fields"]["ciphertexts"] = {"$tuple": [{"$int": hex(OVERSIZED)}]}
    with pytest.raises(wire.WireError, match="MaskedWeightedSum|ciphertexts"):
        wire.decode(_npz(tree))


# --- a silo's reply ---------------------------------------------------------------------

LIKE = {"w": torch.zeros(2, 3)}


def _reply() -> dict[str, Any]:
    return {
        "update": {
            "silo": 1,
            "params": {"w": torch.ones(2, 3)},
            "num_records": 5,
            "privacy": None,
            "payload": None,
        },
        "state": {},
    }


@SETTINGS
@given(
    data=st.data(),
    value=st.one_of(
        JSON,
        st.sampled_from(
            [
                np.zeros(3),
                torch.tensor([np.nan] * 6).reshape(2, 3),
                torch.zeros(3),
                2**70,
                -5,
                np.arange(2),
            ]
        ),
    ),
)
def test_a_wrong_reply_field_is_a_malformed_reply_error(data: st.DataObject, value: Any) -> None:
    reply = _reply()
    key = data.draw(
        st.sampled_from(
            [
                "silo",
                "params",
                "num_records",
                "privacy",
                "payload",
            ]
        )
    )
    reply["update"][key] = value
    try:
        update = update_from_wire(reply, silo=1, like=LIKE)
    except MalformedReplyError as err:
        assert "Silo 1 sent a malformed reply" in str(err)
    else:
        assert update.silo == 1 and 1 <= update.num_records


def test_masked_and_encrypted_replies_are_checked() -> None:
    reply = _reply()
    reply["update"]["params"] = {MASKED: np.zeros(4, dtype=np.uint64)}
    assert update_from_wire(reply, silo=1, like=LIKE, masked_size=4).params[MASKED].shape == (4,)
    with pytest.raises(MalformedReplyError, match=r"expected 5 masked values, got \(4,\)"):
        update_from_wire(reply, silo=1, like=LIKE, masked_size=5)
    reply["update"]["params"] = torch.zeros(2)
    with pytest.raises(MalformedReplyError, match="no parameters beside"):
        update_from_wire(reply, silo=1, like=LIKE, encrypted=True)
    reply["update"]["params"] = {}
    reply["update"]["payload"] = MaskedWeightedSum(SID, 2, 0, 3, (1,))
    with pytest.raises(MalformedReplyError, match="masked weighted sum"):
        update_from_wire(reply, silo=1, like=LIKE, encrypted=True)
