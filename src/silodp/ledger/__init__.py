"""The privacy ledger: the one place where privacy spending is recorded (SQLite), the
budgets it enforces, and the totals it recomputes from recorded events."""

from silodp.ledger.run import BudgetExceededError, RunLedger
from silodp.ledger.store import SCHEMA_VERSION, Ledger, LedgerError, RunRecord

__all__ = [
    "SCHEMA_VERSION",
    "BudgetExceededError",
    "Ledger",
    "LedgerError",
    "RunLedger",
    "RunRecord",
]
