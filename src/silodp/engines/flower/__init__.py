"""silodp on Flower: the only package that imports ``flwr``.

:mod:`.transport` carries the remote engine's messages over Flower's grid; :mod:`.server` holds
the ServerApp (the experiment, run by the server) and :mod:`.client` the ClientApp (a silo's
:class:`~silodp.engines.silo.SiloRuntime`, importing nothing of the server's side);
:mod:`.simulation` runs both on Flower's simulation engine and :mod:`.deployment` starts a local
federation (SuperLink and SuperNodes).
"""

import os
import sys

# never report to Flower's telemetry or check for updates from anything silodp starts
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")
# flwr reads the telemetry switch once, when its telemetry module is imported: a process that
# imported flwr before silodp would still report (its events are sent in this process)
_telemetry = sys.modules.get("flwr.supercore.telemetry")
if _telemetry is not None and os.environ["FLWR_TELEMETRY_ENABLED"] == "0":
    _telemetry.FLWR_TELEMETRY_ENABLED = "0"  # type: ignore[attr-defined]
