"""The ClientApp: a silo, answering the server's messages with its
:class:`~silodp.engines.silo.SiloRuntime`.

It reads its node config: ``data`` (the silo's records, a file of
:func:`~silodp.engines.silo.write_silo_data`; its secret is kept beside it as ``<data>.key``),
or in a simulation ``partition-id`` with the run config's ``silo-dir``.

A SuperNode starts one ClientApp process per message, and every message pays this module's
import: it leaves out the experiment runner, the engine factory, plotting and matplotlib,
which only the server uses (``tests/engines/test_flower_local.py`` checks).
"""

from __future__ import annotations

import os
from pathlib import Path

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from silodp.engines import wire
from silodp.engines.flower.transport import reply_content, request_of
from silodp.engines.silo import SiloRuntime, read_silo_data, silo_file, silo_secret
from silodp.errors import SilodpError

__all__ = ["SILO_DIR_ENV", "client_app", "silo_data_path"]

client_app = ClientApp()

#: where a simulation's virtual silos find their data files (``silo-<partition-id>.npz``)
SILO_DIR_ENV = "SILODP_SILO_DIR"

#: one runtime per silo data file in this process
_RUNTIMES: dict[str, SiloRuntime] = {}


def silo_data_path(context: Context) -> Path:
    """The silo's data file: the node config's ``data``, else (simulation) the run config's
    ``silo-dir`` and the node's ``partition-id``."""
    node = context.node_config
    if "data" in node:
        return Path(str(node["data"]))
    directory = context.run_config.get("silo-dir") or os.environ.get(SILO_DIR_ENV)
    if "partition-id" in node and directory:
        return silo_file(str(directory), int(node["partition-id"]))
    raise SilodpError(
        "Expected the SuperNode's node config to name the silo's data file (data=PATH)."
    )


def _runtime(context: Context) -> SiloRuntime:
    path = silo_data_path(context)
    key = str(path.resolve())
    if key not in _RUNTIMES:
        _RUNTIMES[key] = SiloRuntime(read_silo_data(path), silo_secret(f"{path}.key"))
    return _RUNTIMES[key]


@client_app.query()
def silo_query(message: Message, context: Context) -> Message:
    """A silo's reply to one of the server's messages (errors go back as Flower errors)."""
    kind, body = request_of(message)
    reply = _runtime(context).handle(kind, wire.decode(body))
    return Message(reply_content(wire.encode(reply)), reply_to=message)
