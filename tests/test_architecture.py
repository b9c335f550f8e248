"""The layering of docs/architecture.md ("Who imports whom"), read from every module's imports
(``TYPE_CHECKING`` and function-level imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

import silodp

ROOT = Path(next(iter(silodp.__path__)))
_ABOVE_DATA = {
    "accounting", "algorithms", "config", "ledger", "federated", "experiment", "engines",
    "audit", "cli", "bench", "reports", "plotting", "tracking", "html_report",
}  # fmt: skip
#: layer -> the silodp layers it never imports (the table's last column, and everything above)
NEVER = {
    "privacy": _ABOVE_DATA,
    "data": _ABOVE_DATA,
    "models": _ABOVE_DATA,
    "evaluation": _ABOVE_DATA,
    "accounting": {"algorithms", "federated", "experiment", "config", "ledger", "engines",
                   "audit", "cli", "bench"},
    "algorithms": {"federated", "experiment", "config", "ledger", "engines", "audit", "cli",
                   "bench"},
    "ledger": {"algorithms", "federated", "experiment", "config", "engines", "audit", "cli",
               "bench"},
    "federated": {"experiment", "config", "engines", "audit", "cli", "bench"},
    "experiment": {"cli", "bench"},
    "config": {"experiment", "federated", "engines", "ledger", "audit", "cli", "bench",
               "reports", "plotting", "tracking", "html_report"},
    **{base: _ABOVE_DATA | {"privacy", "data", "models", "evaluation", "io", "_validation",
                            "display", "locking", "faults", "stopping"} - {base}
       for base in ("errors",)},
    **{base: _ABOVE_DATA | {"privacy", "data", "models", "evaluation"}
       for base in ("_validation", "io", "display")},
}  # fmt: skip


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def violations(module: str, source: str) -> list[str]:
    """The imports of ``module`` (dotted name, its ``source``) that break the layering."""
    layer, found = _layer(module), []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                found.append(f"{module}: relative import of {node.module!r}")
                continue
            names = [node.module or ""]
            if node.module == "silodp":  # from silodp import algorithms: silodp.algorithms
                names = [f"silodp.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if layer == "crypto":
                outside = name.split(".")[0] == "silodp" and not name.startswith("silodp.crypto")
                if outside or name.split(".")[0] == "torch":
                    found.append(f"{module}: imports {name}")
            elif name.startswith("silodp.") and _layer(name) in NEVER.get(layer, ()):
                found.append(f"{module}: imports {name} (line {node.lineno})")
    return found


def test_every_module_imports_only_the_layers_below_it() -> None:
    found, modules = [], 0
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found += violations(module, path.read_text())
        modules += 1
    assert modules > 100
    assert found == []


def test_the_check_sees_a_wrong_import() -> None:
    assert violations("silodp.crypto.x", "import torch")
    assert violations("silodp.crypto.x", "from silodp.privacy import noise")
    assert violations("silodp.crypto.x", "import silodp")
    assert not violations("silodp.crypto.x", "from silodp.crypto.prg import ChaCha20Prg")
    assert violations("silodp.accounting.x", "def f():\n    from silodp.algorithms import a")
    assert violations("silodp.privacy.x", "from silodp.config import load")
    assert not violations("silodp.algorithms.x", "from silodp.accounting import pld")
    assert violations("silodp.privacy.noise", "from silodp import algorithms")
    assert not violations("silodp.privacy.noise", "from silodp import errors")
    assert violations("silodp.config", "from silodp.experiment import run")
    assert violations("silodp.display", "from silodp.data import build")
