"""Messages between the server and the silos as bytes, decoded without running code.

What crosses a process or machine boundary (the model, a round's instructions, a silo's update,
the protocol's messages) is a tree of numbers, strings, bytes, tuples, lists, dicts, tensors,
arrays, fractions, :class:`~silodp.accounting.SiloPrivacy` and dataclasses defined in silodp.
:func:`encode` writes it as one ``.npz`` blob (the tree as JSON, arrays beside it);
:func:`decode` rebuilds it with ``allow_pickle=False`` and constructs only silodp dataclasses by
their fields, so a malformed or hostile message is refused (:class:`WireError`) and never
executes anything. Sizes are checked before anything is read: the message (at most
:data:`MAX_MESSAGE_BYTES`, unpacked too), each array's declared shape against its bytes, and
the tree's nesting depth.
"""

from __future__ import annotations

import base64
import dataclasses
import importlib
import io
import json
import math
import re
import zipfile
import zlib
from fractions import Fraction
from typing import Any

import numpy as np
import torch

from silodp.accounting import SiloPrivacy
from silodp.crypto.errors import ProtocolError
from silodp.errors import InvalidValueError
from silodp.ledger.serialize import privacy_from_json, privacy_to_json

__all__ = ["MAX_DEPTH", "MAX_MESSAGE_BYTES", "WireError", "decode", "encode"]

_TREE = "tree"
_PACKAGE = "silodp."


class WireError(InvalidValueError):
    """A message that is not what :func:`encode` writes."""


#: the most bytes a message may hold or unpack to (its arrays and its tree together)
MAX_MESSAGE_BYTES = 2**30
#: the most arrays one message may carry
MAX_ARRAYS = 2**16
#: the deepest nesting of lists, tuples, dicts and dataclasses a message may have
MAX_DEPTH = 64
#: array element kinds a message may carry: booleans, integers, floats
_KINDS = "biuf"
_ARRAY_NAME = re.compile(r"a(0|[1-9][0-9]{0,5})")


def _to_tree(value: Any, arrays: list[np.ndarray]) -> Any:
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        # hexadecimal: no digit limit (a 8192-bit key's n^2 has more than 4300 decimal digits)
        return value if abs(value) < 2**53 else {"$int": hex(value)}
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


def _int(body: Any) -> int:
    if not isinstance(body, str):
        raise WireError(f"Expected an integer as text, got {type(body).__name__}.")
    text = body.strip()
    if text.lstrip("+-").lower().startswith("0x"):
        return int(text, 16)
    return int(text)  # decimal (bounded by Python's 4300-digit limit)


def _from_tree(tree: Any, arrays: dict[str, np.ndarray], depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise WireError(f"Expected a message nested at most {MAX_DEPTH} levels deep.")
    if tree is None or isinstance(tree, bool | str | int):
        return tree
    if isinstance(tree, list):
        return [_from_tree(v, arrays, depth + 1) for v in tree]
    if not isinstance(tree, dict) or len(tree) not in (1, 2):
        raise WireError(f"Expected an encoded value, got {str(tree)[:80]!r}.")
    (tag, body), *rest = tree.items()
    try:
        if tag == "$int":
            return _int(body)
        if tag == "$float":
            return float.fromhex(body)
        if tag == "$bytes":
            return base64.b64decode(body, validate=True)
        if tag == "$fraction":
            return Fraction(_int(body[0]), _int(body[1]))
        if tag in ("$tensor", "$array"):
            if isinstance(body, bool) or not isinstance(body, int):
                raise WireError(f"Expected an array index, got {body!r:.40}.")
            array = arrays[f"a{body}"]
            return torch.from_numpy(array.copy()) if tag == "$tensor" else array
        if tag == "$privacy":
            return privacy_from_json(body)
        if tag == "$tuple":
            if not isinstance(body, list):
                raise WireError(f"Expected a $tuple as a list, got {type(body).__name__}.")
            return tuple(_from_tree(v, arrays, depth + 1) for v in body)
        if tag == "$dict":
            if not isinstance(body, list):
                raise WireError(f"Expected a $dict as a list of pairs, got {type(body).__name__}.")
            return {
                _from_tree(k, arrays, depth + 1): _from_tree(v, arrays, depth + 1) for k, v in body
            }
        if tag == "$object" and rest and rest[0][0] == "fields":
            cls = _dataclass(body)
            raw_fields = rest[0][1]
            if not isinstance(raw_fields, dict):
                raise WireError(f"Expected the fields of {body!r} as a mapping.")
            fields = {k: _from_tree(v, arrays, depth + 1) for k, v in raw_fields.items()}
            return cls(**fields)
    except WireError:
        raise
    except ProtocolError as err:  # a protocol message refused its own contents
        raise WireError(f"Expected a well-formed {tag} value: {err}") from err
    except (
        KeyError,
        ValueError,
        TypeError,
        IndexError,
        AttributeError,
        ZeroDivisionError,
        OverflowError,
    ) as err:
        raise WireError(f"Expected a well-formed {tag} value: {err}") from err
    raise WireError(f"Expected an encoded value, got tag {str(tag)[:40]!r}.")


def _read_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> np.ndarray:
    """One ``.npy`` member, its header checked against its size before its data is read."""
    with archive.open(info) as fh:
        version = np.lib.format.read_magic(fh)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
        else:
            raise WireError(f"Expected an .npy version 1.0 or 2.0 array, got {version}.")
        if dtype.kind not in _KINDS or not dtype.isnative or dtype.fields:
            raise WireError(
                f"Expected a numeric array, got dtype {dtype.str!r} in {info.filename!r}."
            )
        size = math.prod(shape) * dtype.itemsize
        if size != info.file_size - fh.tell():
            raise WireError(
                f"Array {info.filename!r} declares shape {shape} ({size} bytes) but holds "
                f"{info.file_size - fh.tell()}."
            )
        buffer = bytearray(size)
        done = 0
        while done < size:
            chunk = fh.read(min(size - done, 1 << 24))
            if not chunk:
                raise WireError(f"Array {info.filename!r} is truncated.")
            buffer[done : done + len(chunk)] = chunk
            done += len(chunk)
    array = np.frombuffer(buffer, dtype=dtype)
    return array.reshape(shape[::-1]).T if fortran else array.reshape(shape)


def _read_arrays(data: bytes, max_bytes: int) -> dict[str, np.ndarray]:
    archive = zipfile.ZipFile(io.BytesIO(data))
    infos = archive.infolist()
    if len(infos) > MAX_ARRAYS + 1:
        raise WireError(f"Expected at most {MAX_ARRAYS} arrays, got {len(infos)}.")
    unpacked = sum(info.file_size for info in infos)
    if unpacked > max_bytes:
        raise WireError(
            f"Expected a message of at most {max_bytes} bytes, got one unpacking to {unpacked}."
        )
    arrays: dict[str, np.ndarray] = {}
    for info in infos:
        name = info.filename.removesuffix(".npy")
        if info.filename == name or (name != _TREE and not _ARRAY_NAME.fullmatch(name)):
            raise WireError(f"Expected arrays named a<i>.npy, got {info.filename[:40]!r}.")
        if name in arrays:
            raise WireError(f"Expected one array named {info.filename!r}, got two.")
        arrays[name] = _read_member(archive, info)
    if _TREE not in arrays:
        raise WireError("Expected the message's tree, got none.")
    return arrays


def decode(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Any:
    """The value :func:`encode` wrote.

    Everything is checked before it is used: the message's size (``max_bytes``, unpacked
    too), each array's header against its bytes (numeric dtypes only, never pickles), the
    tree's nesting depth and every tag; dataclasses are built only from silodp, by their
    fields (their own checks run).

    Raises:
      WireError: ``data`` is not such a message (truncated, garbled, oversized, too deeply
        nested or of unknown types).
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise WireError(f"Expected bytes, got {type(data).__name__}.")
    if len(data) > max_bytes:
        raise WireError(f"Expected a message of at most {max_bytes} bytes, got {len(data)}.")
    try:
        arrays = _read_arrays(bytes(data), max_bytes)
        tree = json.loads(arrays.pop(_TREE).tobytes().decode("utf-8"))
    except WireError:
        raise
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, RecursionError, zlib.error) as err:
        # zip, npy and JSON errors of a garbled message
        raise WireError(
            f"Expected an encoded silodp message ({len(data)} bytes): {type(err).__name__}: {err}"
        ) from err
    return _from_tree(tree, arrays)
