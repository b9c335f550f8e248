"""What the public bounds' caps do to the record and silo units' neighbouring datasets.

The experiment enforces the public bounds by dropping data before training
(:mod:`silodp.data.bounds`): a subject's records above ``group_size`` (per silo, or in the
federation for ``uldp_group``) and its records in silos beyond ``span``. Which records survive
depends on the subject's own records only, so two datasets that differ by one subject still
differ by that subject after capping: the subject unit is unaffected. A smaller unit is not:

* **group cap.** Adding one record to a subject already at the cap can push out another of its
  records. The capped datasets then differ by a *replacement*, in the same silo (per-silo cap)
  or possibly in another silo (a federation-wide cap: ``uldp_group``'s bound, or
  ``data.records_per_subject``, which the data's own caps apply the same way).
* **span cap.** Adding one record can give its silo a higher priority than one of the
  subject's kept silos: up to ``k`` of the subject's records (the per-silo bound) come in there
  and the subject's records leave the silo it drops. For the silo unit, replacing one silo's
  dataset can change which records every other silo keeps. (Beside a federation-wide group
  cap, a move would also let the subject's records back in or out in other silos, so
  ``uldp_group`` does not cap the span.)

So the record (silo) unit of a run with caps is accounted for these differences: the record
events of this module hold for "add or remove one record of the data before capping", which is
what the unit promises.
"""

from __future__ import annotations

from dp_accounting import dp_event

from silodp.accounting.events import replace_one
from silodp.errors import InvalidValueError

__all__ = [
    "CAPS_SEEN_BY_SILOS_NOTE",
    "caps_seen_by_silos",
    "record_event_under_caps",
    "silo_event_under_span_cap",
]

#: why a run with a cap across silos has no record (silo) guarantee against the silos
CAPS_SEEN_BY_SILOS_NOTE = (
    "a cap across silos (a federation-wide group bound, data.records_per_subject or a span "
    "cap) decides which of a silo's records it keeps from the other silos' records, and each "
    "silo sees which of its own it keeps: no record-level (user_ldp: silo-level) guarantee "
    "holds against the silos (ε = inf); the released model's stands, and the subject level "
    "is unaffected"
)


def caps_seen_by_silos(*, cross_silo: bool, span_cap: int | None) -> bool:
    """Whether a silo's kept records depend on the other silos' records: a cap across silos
    or a span cap. Adding one record in silo s' can then change, deterministically, which
    records silo s keeps, and silo s sees that (it knows its records and trains on the kept
    ones), so against the silos the record and silo units have no guarantee. Per-silo caps
    depend on the silo's own records only."""
    return cross_silo or span_cap is not None


def record_event_under_caps(
    record: dp_event.DpEvent,
    subject: dp_event.DpEvent,
    *,
    group_capped: bool,
    cross_silo: bool,
    span_cap: int | None,
) -> dp_event.DpEvent:
    """One silo's record-unit event in a round, given the caps applied to the data.

    ``record`` is the silo's add/remove event for one record and ``subject`` its event for one
    subject's (up to ``k``) records in the silo. The result bounds every difference one added
    or removed record makes after capping:

    * no cap: ``record``;
    * group cap per silo: one record replaced by another in the silo, ``replace_one(record)``
      (which also bounds a plain addition);
    * a cap across silos (``cross_silo``): that, or an addition here and a removal in another
      silo, both bounded by ``replace_one(record)`` composed with ``record``;
    * span cap (with a public per-silo group bound k): additionally up to ``k`` records
      entering one silo and up to ``k`` leaving another, each silo bounded by ``subject``.
      These are composed with the above, which is loose but covers every case in one event.

    Raises:
      InvalidValueError: a span cap beside a cap across silos (not covered), or without the
        group cap that bounds what a move carries.
    """
    if span_cap is not None and (cross_silo or not group_capped):
        raise InvalidValueError(
            "Expected a span cap only beside a public per-silo group bound (and no bound "
            "across silos): only that bounds the records one added record can move."
        )
    if group_capped or cross_silo:
        parts = [replace_one(record)]
        if cross_silo:
            parts.append(record)
    else:
        parts = [record]
    if span_cap is not None:
        parts.extend([subject, subject])
    return parts[0] if len(parts) == 1 else dp_event.ComposedDpEvent(tuple(parts))


def silo_event_under_span_cap(
    silo: dp_event.DpEvent, *, span_cap: int | None, cross_silo: bool, num_silos: int | None
) -> dp_event.DpEvent:
    """One silo's silo-unit event in a round: ``silo`` without a cap across silos; with a span
    cap or a federation-wide bound (``cross_silo``), ``silo`` composed over every silo
    (replacing one silo's dataset can change which records each other silo keeps, and each
    silo's event bounds any change of its own dataset).

    Raises:
      InvalidValueError: such a cap without the number of silos.
    """
    if span_cap is None and not cross_silo:
        return silo
    if num_silos is None:
        raise InvalidValueError(
            "Expected num_silos with a cap across silos: the silo unit composes over them."
        )
    return dp_event.SelfComposedDpEvent(silo, num_silos) if num_silos > 1 else silo
