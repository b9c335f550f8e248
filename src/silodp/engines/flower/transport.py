"""The remote engine's messages over a Flower grid (the Message API)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid

from silodp.engines.remote import NoReply

__all__ = ["RECORD", "GridTransport", "request_of", "reply_content"]

logger = logging.getLogger(__name__)

#: the record holding silodp's message in a Flower message
RECORD = "silodp"

#: Flower errors that mean the silo's app raised before replying, so it released nothing.
#: Every other error (the SuperLink's "reply unavailable" for a reply it stored and let
#: expire, "node unavailable" for a node that may have pulled the request and answered, a
#: crashed app, unknown) is taken as no answer, which the engine charges in full.
SENT_NOTHING = frozenset(
    {ErrorCode.LOAD_CLIENT_APP_EXCEPTION, ErrorCode.CLIENT_APP_RAISED_EXCEPTION}
)


def reply_content(body: bytes) -> RecordDict:
    return RecordDict({RECORD: ConfigRecord({"body": body})})


def request_of(message: Message) -> tuple[str, bytes]:
    """The ``(kind, body)`` of a silodp message received by a ClientApp."""
    record = message.content[RECORD]
    return str(record["kind"]), bytes(record["body"])  # type: ignore[arg-type]


class GridTransport:
    """Sends each node a ``query`` message; replies, Flower errors and timeouts by node (a
    node that did not answer in time is left out: see :class:`~silodp.engines.remote.Transport`)."""

    def __init__(self, grid: Grid, *, poll: float = 1.0, pull: float = 0.2) -> None:
        self.grid = grid
        self.poll = poll  # between looks for connected nodes
        self.pull = pull  # between pulls for replies

    def wait_for_nodes(self, count: int, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        while True:
            nodes = sorted(self.grid.get_node_ids())
            if len(nodes) >= count or time.monotonic() >= deadline:
                return nodes
            time.sleep(self.poll)

    def exchange(
        self, requests: Mapping[int, tuple[str, bytes]], timeout: float
    ) -> dict[int, bytes | str]:
        messages = [
            Message(
                RecordDict({RECORD: ConfigRecord({"kind": kind, "body": body})}),
                dst_node_id=node,
                message_type="query",
                ttl=timeout,
            )
            for node, (kind, body) in requests.items()
        ]
        out: dict[int, bytes | str] = {}
        for reply in self._send_and_receive(messages, timeout):
            node = reply.metadata.src_node_id
            if reply.has_error():
                if reply.error.code in SENT_NOTHING:
                    out[node] = f"the silo's process failed: {reply.error.reason}"
                else:  # charged like no answer: the silo may have released its message
                    out[node] = NoReply(
                        f"Flower error {reply.error.code}: {reply.error.reason}; the silo may "
                        "have released its message"
                    )
                continue
            try:
                out[node] = bytes(reply.content[RECORD]["body"])  # type: ignore[arg-type]
            except (KeyError, TypeError) as err:
                # a reply did reach the server: handed on as an unreadable body, which the
                # engine charges as a reply it could not read (it may hold a noisy message)
                logger.warning("node %d: a reply without silodp's record (%s)", node, err)
                out[node] = b""
        return out

    def _send_and_receive(self, messages: list[Message], timeout: float) -> list[Message]:
        """The grid's ``send_and_receive``, pulling every ``pull`` seconds: Flower's
        deployment grid sleeps 3 s between pulls, 1.5 s more per round trip on average."""
        waiting = set(self.grid.push_messages(messages))
        deadline = time.monotonic() + timeout
        replies: list[Message] = []
        while True:
            pulled = list(self.grid.pull_messages(waiting))
            replies += pulled
            waiting -= {reply.metadata.reply_to_message_id for reply in pulled}
            if not waiting or time.monotonic() >= deadline:
                return replies
            time.sleep(min(self.pull, max(0.0, deadline - time.monotonic())))
