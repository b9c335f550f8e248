"""Messages between the server and the silos as bytes, decoded without running code.

What crosses a process or machine boundary (the model, a round's instructions, a silo's update,
the protocol's messages) is a tree of numbers, strings, bytes, tuples, lists, dicts, tensors,
arrays, fractions, :class:`~silodp.accounting.SiloPrivacy` and dataclasses defined in silodp.
:func:`encode` writes it as one ``.npz`` blob (the tree as JSON, arrays beside it);
:func:`decode` rebuilds it with ``allow_pickle=False`` and constructs only silodp dataclasses by
their fields, so a malformed or hostile message is refused (:class:`WireError`) and never
executes anything.
"""

from __future__ import annotations

import base64
import dataclasses
import importlib
import io
import json
from fractions import Fraction
from typing import Any

import numpy as np
import torch

from silodp.accounting import SiloPrivacy
from silodp.errors import InvalidValueError
from silodp.ledger.serialize import privacy_from_json, privacy_to_json

__all__ = ["WireError", "decode", "encode"]

_TREE = "tree"
_PACKAGE = "silodp."


class WireError(InvalidValueError):
    """A message that is not what :func:`encode` writes."""


def _to_tree(value: Any, arrays: list[np.ndarray]) -> Any:
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return value if abs(value) < 2**53 else {"$int": str(value)}
    if isinstance(value, float):
        return {"$float": value.hex()}
    if isinstance(value, bytes):
        return {"$bytes": base64.b64encode(value).decode()}
    if isinstance(value, Fraction):
        return {"$fraction": [str(value.numerator), str(value.denominator)]}
    if isinstance(value, torch.Tensor):
        arrays.append(value.detach().cpu().contiguous().numpy())
        return {"$tensor": len(arrays) - 1}
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise WireError("Expected a numeric array, got an object array.")
        arrays.append(np.ascontiguousarray(value))
        return {"$array": len(arrays) - 1}
    if isinstance(value, np.integer | np.floating | np.bool_):
        return _to_tree(value.item(), arrays)
    if isinstance(value, SiloPrivacy):
        return {"$privacy": privacy_to_json(value)}
    if isinstance(value, tuple):
        return {"$tuple": [_to_tree(v, arrays) for v in value]}
    if isinstance(value, list):
        return [_to_tree(v, arrays) for v in value]
    if isinstance(value, dict):
        return {"$dict": [[_to_tree(k, arrays), _to_tree(v, arrays)] for k, v in value.items()]}
    cls = type(value)
    if dataclasses.is_dataclass(value) and cls.__module__.startswith(_PACKAGE):
        fields = {
            f.name: _to_tree(getattr(value, f.name), arrays)
            for f in dataclasses.fields(value)
            if f.init
        }
        return {"$object": f"{cls.__module__}:{cls.__qualname__}", "fields": fields}
    raise WireError(f"Expected a value silodp can send, got {cls.__name__}.")


def encode(value: Any) -> bytes:
    """``value`` as bytes (see the module's docstring for what it may hold)."""
    arrays: list[np.ndarray] = []
    tree = json.dumps(_to_tree(value, arrays), separators=(",", ":"))
    buffer = io.BytesIO()
    blobs: dict[str, np.ndarray] = {f"a{i}": a for i, a in enumerate(arrays)}
    blobs[_TREE] = np.frombuffer(tree.encode(), dtype=np.uint8)
    np.savez(buffer, **blobs)  # type: ignore[arg-type]
    return buffer.getvalue()


def _dataclass(name: Any) -> type:
    if not isinstance(name, str) or ":" not in name or not name.startswith(_PACKAGE):
        raise WireError(f"Expected a silodp dataclass, got {str(name)[:80]!r}.")
    module_name, _, qualname = name.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as err:
        raise WireError(f"Expected a silodp dataclass, got unknown {name!r}.") from err
    if not (isinstance(obj, type) and dataclasses.is_dataclass(obj)):
        raise WireError(f"Expected a silodp dataclass, got {name!r}.")
    return obj


def _from_tree(tree: Any, arrays: dict[str, np.ndarray]) -> Any:
    if tree is None or isinstance(tree, bool | str | int):
        return tree
    if isinstance(tree, list):
        return [_from_tree(v, arrays) for v in tree]
    if not isinstance(tree, dict) or len(tree) not in (1, 2):
        raise WireError(f"Expected an encoded value, got {str(tree)[:80]!r}.")
    (tag, body), *rest = tree.items()
    try:
        if tag == "$int":
            return int(body)
        if tag == "$float":
            return float.fromhex(body)
        if tag == "$bytes":
            return base64.b64decode(body, validate=True)
        if tag == "$fraction":
            return Fraction(int(body[0]), int(body[1]))
        if tag in ("$tensor", "$array"):
            array = arrays[f"a{int(body)}"]
            return torch.from_numpy(array.copy()) if tag == "$tensor" else array
        if tag == "$privacy":
            return privacy_from_json(body)
        if tag == "$tuple":
            return tuple(_from_tree(v, arrays) for v in body)
        if tag == "$dict":
            return {_from_tree(k, arrays): _from_tree(v, arrays) for k, v in body}
        if tag == "$object" and rest and rest[0][0] == "fields":
            cls = _dataclass(body)
            fields = {k: _from_tree(v, arrays) for k, v in rest[0][1].items()}
            return cls(**fields)
    except WireError:
        raise
    except (KeyError, ValueError, TypeError, IndexError, ZeroDivisionError) as err:
        raise WireError(f"Expected a well-formed {tag} value: {err}") from err
    raise WireError(f"Expected an encoded value, got tag {tag!r}.")


def decode(data: bytes) -> Any:
    """The value :func:`encode` wrote.

    Raises:
      WireError: ``data`` is not such a message (truncated, garbled or of unknown types).
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise WireError(f"Expected bytes, got {type(data).__name__}.")
    try:
        with np.load(io.BytesIO(bytes(data)), allow_pickle=False) as blob:
            arrays = {k: blob[k] for k in blob.files}
        tree = json.loads(arrays.pop(_TREE).tobytes().decode())
    except Exception as err:  # zip, npy and JSON errors of a garbled message
        raise WireError(f"Expected an encoded silodp message ({len(data)} bytes): {err}") from err
    return _from_tree(tree, arrays)
