"""Privacy accounting on dp-accounting: per-unit composition, group conversion, calibration.

Accounting knows DP events only: mechanisms describe what they ran as
:class:`SiloPrivacy` events, an :class:`~silodp.accounting.interface.Accountant` composes them,
and :func:`~silodp.accounting.calibrate.calibrate_noise` finds σ from a function that builds the
events for a given σ. Nothing here imports the algorithms.
"""

from silodp.accounting.accountant import (
    ADVERSARIES,
    TARGETS,
    UNITS,
    Estimate,
    FederatedAccountant,
    SiloPrivacy,
)
from silodp.accounting.calibrate import calibrate_noise, find_sigma
from silodp.accounting.fdp import (
    FdpAccountant,
    FdpReport,
    PriFedSyncPlan,
    account_prifedsync,
    calibrate_prifedsync,
)
from silodp.accounting.interface import STAGES, Accountant, AccountantFactory
from silodp.accounting.plan import PrivacyPlan, account_events, account_events_by_adversary
from silodp.errors import CalibrationError

__all__ = [
    "ADVERSARIES",
    "STAGES",
    "TARGETS",
    "UNITS",
    "Accountant",
    "AccountantFactory",
    "CalibrationError",
    "Estimate",
    "FdpAccountant",
    "FdpReport",
    "FederatedAccountant",
    "PriFedSyncPlan",
    "PrivacyPlan",
    "SiloPrivacy",
    "account_events",
    "account_events_by_adversary",
    "account_prifedsync",
    "calibrate_noise",
    "calibrate_prifedsync",
    "find_sigma",
]
