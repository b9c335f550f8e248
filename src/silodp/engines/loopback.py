"""A transport that delivers messages to silo runtimes in this process, through the same
bytes a network would carry (for tests and for trying a deployment's code path)."""

from __future__ import annotations

from collections.abc import Mapping

from silodp.engines import wire
from silodp.engines.silo import SiloRuntime
from silodp.errors import SilodpError

__all__ = ["LoopbackTransport"]


class LoopbackTransport:
    """``runtimes``: each node's silo; ``down``: nodes that never answer (as a dead node: no
    entry in the replies, as when a node gives no answer in time)."""

    def __init__(self, runtimes: Mapping[int, SiloRuntime]) -> None:
        self.runtimes = dict(runtimes)
        self.down: set[int] = set()

    def wait_for_nodes(self, count: int, timeout: float) -> list[int]:
        return sorted(self.runtimes)

    def exchange(
        self, requests: Mapping[int, tuple[str, bytes]], timeout: float
    ) -> dict[int, bytes | str]:
        out: dict[int, bytes | str] = {}
        for node, (kind, body) in requests.items():
            if node in self.down:
                continue
            try:
                out[node] = wire.encode(self.runtimes[node].handle(kind, wire.decode(body)))
            except SilodpError as err:
                out[node] = f"the silo refused the message: {err}"
        return out
