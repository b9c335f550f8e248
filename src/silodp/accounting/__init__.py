"""Privacy accounting on dp-accounting: per-unit composition, group conversion, calibration."""

from silodp.accounting.accountant import (
    ADVERSARIES,
    TARGETS,
    UNITS,
    Estimate,
    FederatedAccountant,
    SiloPrivacy,
)
from silodp.accounting.fdp import (
    FdpReport,
    PriFedSyncPlan,
    account_prifedsync,
    calibrate_prifedsync,
)

__all__ = [
    "ADVERSARIES",
    "TARGETS",
    "Estimate",
    "FdpReport",
    "FederatedAccountant",
    "PriFedSyncPlan",
    "SiloPrivacy",
    "UNITS",
    "account_prifedsync",
    "calibrate_prifedsync",
]
