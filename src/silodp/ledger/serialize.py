"""DP events and per-silo privacy as JSON, rebuilt exactly.

A ledger stores what each mechanism ran as data, not as numbers derived from it: every
dp-accounting event (and silodp's own, :mod:`silodp.accounting.events`) is
written as its class name and fields, floats in their shortest exact form, so that reading it
back gives an equal event and the same accountant gives the same ε.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping
from typing import Any

import attr
from dp_accounting import dp_event

from silodp.accounting import SiloPrivacy
from silodp.accounting.events import KnownSampleDpEvent, PoissonReplaceOneDpEvent
from silodp.errors import InvalidValueError

__all__ = ["event_from_json", "event_to_json", "privacy_from_json", "privacy_to_json"]

#: every event class a ledger may hold, by name
EVENT_TYPES: dict[str, type[dp_event.DpEvent]] = {
    name: cls
    for name, cls in inspect.getmembers(dp_event, inspect.isclass)
    if issubclass(cls, dp_event.DpEvent) and attr.has(cls)
} | {
    "KnownSampleDpEvent": KnownSampleDpEvent,
    "PoissonReplaceOneDpEvent": PoissonReplaceOneDpEvent,
}


def _value_to_json(value: Any) -> Any:
    if isinstance(value, dp_event.DpEvent):
        return event_to_json(value)
    if isinstance(value, list | tuple):
        return {"sequence": [_value_to_json(v) for v in value]}
    if isinstance(value, bool) or not isinstance(value, int | float | str) and value is not None:
        raise InvalidValueError(f"Expected a number, a string or an event, got {value!r}.")
    return value


def event_to_json(event: dp_event.DpEvent) -> dict[str, Any]:
    """``{"type": class name, field: value, ...}`` with nested events and sequences.

    Raises:
      InvalidValueError: an event class the ledger does not know.
    """
    name = type(event).__name__
    if EVENT_TYPES.get(name) is not type(event):
        raise InvalidValueError(f"Expected a dp-accounting or silodp event, got {name}.")
    out: dict[str, Any] = {"type": name}
    for f in attr.fields(type(event)):
        out[f.name] = _value_to_json(getattr(event, f.name))
    return out


def _value_from_json(value: Any) -> Any:
    if isinstance(value, Mapping) and "type" in value:
        return event_from_json(value)
    if isinstance(value, Mapping) and "sequence" in value:
        # tuples, events included: an event holding them stays hashable (the accountant
        # keys its caches by event)
        return tuple(_value_from_json(v) for v in value["sequence"])
    return value


def event_from_json(data: Mapping[str, Any]) -> dp_event.DpEvent:
    """The event :func:`event_to_json` wrote.

    Raises:
      InvalidValueError: an unknown event type or fields that do not fit it.
    """
    name = data.get("type")
    cls = EVENT_TYPES.get(str(name))
    if cls is None:
        raise InvalidValueError(f"Expected a known event type, got {name!r}.")
    fields = {k: _value_from_json(v) for k, v in data.items() if k != "type"}
    try:
        return cls(**fields)
    except TypeError as err:
        raise InvalidValueError(f"Expected the fields of {name}, got {sorted(fields)}.") from err


def privacy_to_json(privacy: SiloPrivacy) -> str:
    """One silo's events of one round (every unit and adversary view) as a JSON string."""
    return json.dumps(
        {
            "events": {u: event_to_json(e) for u, e in privacy.events.items()},
            "record_event": (
                None if privacy.record_event is None else event_to_json(privacy.record_event)
            ),
            "group_size": privacy.group_size,
            "group_scope": privacy.group_scope,
            "scope": privacy.scope,
            "views": {
                who: {u: event_to_json(e) for u, e in view.items()}
                for who, view in privacy.views.items()
            },
        },
        sort_keys=True,
    )


def privacy_from_json(text: str) -> SiloPrivacy:
    """The :class:`SiloPrivacy` :func:`privacy_to_json` wrote."""
    data = json.loads(text)
    record = data["record_event"]
    return SiloPrivacy(
        {u: event_from_json(e) for u, e in data["events"].items()},
        record_event=None if record is None else event_from_json(record),
        group_size=data["group_size"],
        group_scope=data["group_scope"],
        scope=data["scope"],
        views={
            who: {u: event_from_json(e) for u, e in view.items()}
            for who, view in data["views"].items()
        },
    )
