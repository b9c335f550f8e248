"""Privacy accounting on dp-accounting: per-unit composition, group conversion, calibration."""

from silodp.accounting.accountant import Estimate, FederatedAccountant, SiloPrivacy, UNITS

__all__ = ["Estimate", "FederatedAccountant", "SiloPrivacy", "UNITS"]
