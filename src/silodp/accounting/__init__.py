"""Privacy accounting on dp-accounting: per-unit composition, group conversion, calibration."""

from silodp.accounting.accountant import UNITS, Estimate, FederatedAccountant, SiloPrivacy

__all__ = ["Estimate", "FederatedAccountant", "SiloPrivacy", "UNITS"]
